"""The Stable-Baselines3 adapter (boltzlabs.sb3) against SB3's own DummyVecEnv.

Part 1 ports SB3's VecEnv checks (tests/test_vec_envs.py,
tests/test_vec_monitor.py and tests/test_vec_normalize.py of https://github.com/DLR-RM/stable-baselines3,
MIT License, Copyright (c) 2019 Antonin Raffin), keeping their names, with
BoltzLabsSB3VecEnv as the vec env class; their envs are in
tests/envs/sb3_custom. Part 2: the same seeds, options and actions through
the adapter (each env in a sandbox) and DummyVecEnv (in process) give equal
observations, rewards, dones and infos (terminal_observation included), bare
and under VecNormalize, VecMonitor and VecFrameStack. Part 3: hostile envs
(a crash mid-episode, a reset that fails, observations that do not fit).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import logging
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

pytest.importorskip("stable_baselines3", reason="Stable-Baselines3 is not installed: pip install -e '.[sb3]'")

import gymnasium as gym
from gymnasium import spaces
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.vec_env import DummyVecEnv, VecFrameStack, VecMonitor, VecNormalize

from boltzlabs import RLPool
from boltzlabs.errors import EnvError
from boltzlabs.sb3 import BoltzLabsSB3VecEnv

from conftest import TESTS, env_class

CUSTOM = TESTS / "envs" / "sb3_custom"
DICT_ENV = TESTS / "envs" / "dict_env"
EXAMPLE = TESTS.parent / "examples" / "sb3_ppo_cartpole.py"
N_ENVS = 3
VEC_ENV_WRAPPERS = [None, VecNormalize, VecFrameStack]


DictEnv = env_class(DICT_ENV, "DictEnv")
SPACES = env_class(CUSTOM, "SPACES")


def ours(n=N_ENVS, **params):
    """The adapter over sandboxes of SB3's test env (params as make_env takes them)."""
    return BoltzLabsSB3VecEnv(str(CUSTOM), n, step_timeout=30.0, **params)


def wrap(vec_env, vec_env_wrapper):
    if vec_env_wrapper is None:
        return vec_env
    if vec_env_wrapper == VecFrameStack:
        return vec_env_wrapper(vec_env, n_stack=2)
    return vec_env_wrapper(vec_env)


# -- Part 1: SB3's checks, ported ----------------------------------------------------------------


@pytest.mark.parametrize("vec_env_wrapper", VEC_ENV_WRAPPERS)
def test_vecenv_custom_calls(vec_env_wrapper):
    """Test access to methods/attributes of vectorized environments"""
    vec_env = wrap(ours(), vec_env_wrapper)

    # Test seed method
    vec_env.seed(0)

    # Test render method call
    array_explicit_mode = vec_env.render(mode="rgb_array")
    # test render without argument (new gym API style)
    array_implicit_mode = vec_env.render()
    assert np.array_equal(array_implicit_mode, array_explicit_mode)

    # test warning if you try different render mode
    with pytest.warns(UserWarning):
        vec_env.render(mode="something_else")

    # Set a new attribute, on the last wrapper and on the env
    assert not vec_env.has_attr("dummy")
    vec_env.set_attr("dummy", 12)
    assert vec_env.get_attr("dummy") == [12] * N_ENVS

    assert not vec_env.has_attr("dummy2")
    vec_env.env_method("set_wrapper_attr", "dummy2", 2)
    assert vec_env.get_attr("dummy2") == [2] * N_ENVS

    env_method_results = vec_env.env_method("custom_method", 1, indices=None, dim_1=2)
    setattr_results = []
    # Set new variable dummy1 of the last wrapper to an arbitrary value
    for env_idx in range(N_ENVS):
        setattr_results.append(vec_env.set_attr("dummy1", env_idx, indices=env_idx))
    # Retrieve the value for each environment
    assert vec_env.has_attr("dummy1")
    getattr_results = vec_env.get_attr("dummy1")

    assert len(env_method_results) == N_ENVS
    assert len(setattr_results) == N_ENVS
    assert len(getattr_results) == N_ENVS

    for env_idx in range(N_ENVS):
        assert (env_method_results[env_idx] == np.ones((1, 2))).all()
        assert setattr_results[env_idx] is None
        assert getattr_results[env_idx] == env_idx

    # Call env_method on a subset of the VecEnv
    env_method_subset = vec_env.env_method("custom_method", 1, indices=[0, 2], dim_1=3)
    assert (env_method_subset[0] == np.ones((1, 3))).all()
    assert (env_method_subset[1] == np.ones((1, 3))).all()
    assert len(env_method_subset) == 2

    # Test to change value for all the environments
    setattr_result = vec_env.set_attr("dummy1", 42, indices=None)
    getattr_result = vec_env.get_attr("dummy1")
    assert setattr_result is None
    assert getattr_result == [42 for _ in range(N_ENVS)]

    vec_env.reset()
    setattr_result = vec_env.env_method("set_wrapper_attr", "current_step", 12, indices=[0, 1])
    getattr_result = vec_env.get_attr("current_step")
    getattr_result_subset = vec_env.get_attr("current_step", indices=[0, 1])
    assert setattr_result == [True, True]
    assert getattr_result == [12 for _ in range(2)] + [0 for _ in range(N_ENVS - 2)]
    assert getattr_result_subset == [12, 12]
    assert vec_env.get_attr("current_step", indices=[0, 2]) == [12, 0]

    vec_env.reset()
    # Change value only for first and last environment
    setattr_result = vec_env.env_method("set_wrapper_attr", "current_step", 12, indices=[0, -1])
    getattr_result = vec_env.get_attr("current_step")
    assert setattr_result == [True, True]
    assert getattr_result == [12] + [0 for _ in range(N_ENVS - 2)] + [12]
    assert vec_env.get_attr("current_step", indices=[-1]) == [12]

    # Checks that options are correctly passed
    assert vec_env.get_attr("current_options")[0] is None
    # Same options for all envs
    options = {"hello": 1}
    vec_env.set_options(options)
    assert vec_env.get_attr("current_options")[0] is None
    # Only effective at reset
    vec_env.reset()
    assert vec_env.get_attr("current_options") == [options] * N_ENVS
    vec_env.reset()
    # Options are reset
    assert vec_env.get_attr("current_options")[0] is None
    # Use a list of options, different for the first env
    options = [{"hello": 1}] * N_ENVS
    options[0] = {"other_option": 2}
    vec_env.set_options(options)
    vec_env.reset()
    assert vec_env.get_attr("current_options") == options

    vec_env.close()


@pytest.mark.parametrize("vec_env_wrapper", VEC_ENV_WRAPPERS)
def test_vecenv_terminal_obs(vec_env_wrapper):
    """Test that 'terminal_observation' gets added to info dict upon
    termination."""
    step_nums = [i + 5 for i in range(N_ENVS)]
    # boltzlabs: one pool's envs share their params; StepEnv(0) takes its length from its seed.
    vec_env = wrap(ours(env="step"), vec_env_wrapper)
    vec_env.seed(step_nums[0])

    zero_acts = np.zeros((N_ENVS,), dtype="int")
    prev_obs_b = vec_env.reset()
    for step_num in range(1, max(step_nums) + 1):
        obs_b, _, done_b, info_b = vec_env.step(zero_acts)
        assert len(obs_b) == N_ENVS
        assert len(done_b) == N_ENVS
        assert len(info_b) == N_ENVS
        env_iter = zip(prev_obs_b, obs_b, done_b, info_b, step_nums, strict=True)
        for prev_obs, obs, done, info, final_step_num in env_iter:
            assert done == (step_num == final_step_num)
            if not done:
                assert "terminal_observation" not in info
            else:
                terminal_obs = info["terminal_observation"]

                # do some rough ordering checks that should work for all
                # wrappers, including VecNormalize
                assert np.all(prev_obs < terminal_obs)
                assert np.all(obs < prev_obs)

                if not isinstance(vec_env, VecNormalize):
                    # more precise tests that we can't do with VecNormalize
                    # (which changes observation values)
                    assert np.all(prev_obs + 1 == terminal_obs)
                    assert np.all(obs == 0)

        prev_obs_b = obs_b

    vec_env.close()


def check_vecenv_spaces(space_name, obs_assert):
    """Helper method to check observation spaces in vectorized environments."""
    vec_env = ours(space=space_name)
    vec_env.seed(0)
    obs = vec_env.reset()
    obs_assert(obs)

    dones = [False] * N_ENVS
    while not any(dones):
        actions = [vec_env.action_space.sample() for _ in range(N_ENVS)]
        obs, _rews, dones, _infos = vec_env.step(actions)
        obs_assert(obs)
    vec_env.close()


def check_vecenv_obs(obs, space):
    """Helper method to check observations from multiple environments each belong to
    the appropriate observation space."""
    assert obs.shape[0] == N_ENVS
    for value in obs:
        assert space.contains(value)


@pytest.mark.parametrize("space_name", list(SPACES))
def test_vecenv_single_space(space_name):
    space = SPACES[space_name]

    def obs_assert(obs):
        return check_vecenv_obs(obs, space)

    check_vecenv_spaces(space_name, obs_assert)


def test_vecenv_dict_spaces():
    """Test dictionary observation spaces with vectorized environments."""
    space = spaces.Dict(SPACES)

    def obs_assert(obs):
        assert isinstance(obs, dict)
        assert obs.keys() == space.spaces.keys()
        for key, values in obs.items():
            check_vecenv_obs(values, space.spaces[key])

    check_vecenv_spaces("dict", obs_assert)
    # Check that vec_env_class can accept unordered dict observations (and convert to OrderedDict)
    check_vecenv_spaces("unordered_dict", obs_assert)


def test_vecenv_tuple_spaces():
    """Test tuple observation spaces with vectorized environments."""
    space = spaces.Tuple(tuple(SPACES.values()))

    def obs_assert(obs):
        assert isinstance(obs, tuple)
        assert len(obs) == len(space.spaces)
        for values, inner_space in zip(obs, space.spaces, strict=True):
            check_vecenv_obs(values, inner_space)

    return check_vecenv_spaces("tuple", obs_assert)


def test_framestack_vecenv():
    """Test that framestack environment stacks on desired axis"""

    image_space_shape = [12, 8, 3]
    zero_acts = np.zeros([N_ENVS, *image_space_shape], dtype=np.uint8)
    transposed_image_space_shape = image_space_shape[::-1]
    transposed_zero_acts = np.zeros([N_ENVS, *transposed_image_space_shape], dtype=np.uint8)

    # boltzlabs: the upstream test steps before any reset (DummyVecEnv's CustomGymEnv allows
    # it); a pool's env has no observation until its first reset, so reset first.
    vec_env = VecFrameStack(ours(space="image"), n_stack=2)
    vec_env.reset()
    obs, _, _, _ = vec_env.step(zero_acts)
    vec_env.close()
    # Should be stacked on the last dimension
    assert obs.shape[-1] == (image_space_shape[-1] * 2)

    # Try automatic stacking on first dimension now
    vec_env = VecFrameStack(ours(space="image_transposed"), n_stack=2)
    vec_env.reset()
    obs, _, _, _ = vec_env.step(transposed_zero_acts)
    vec_env.close()
    # Should be stacked on the first dimension (note the transposing in make_transposed_image_env)
    assert obs.shape[1] == (image_space_shape[-1] * 2)

    # Try forcing dimensions
    venv = ours(space="image")
    vec_env = VecFrameStack(venv, n_stack=2, channels_order="last")
    vec_env.reset()
    obs, _, _, _ = vec_env.step(zero_acts)
    assert obs.shape[-1] == (image_space_shape[-1] * 2)

    vec_env = VecFrameStack(venv, n_stack=2, channels_order="first")
    vec_env.reset()
    obs, _, _, _ = vec_env.step(zero_acts)
    # Should be stacked on the first dimension
    assert obs.shape[1] == (image_space_shape[0] * 2)

    # Test invalid channels_order
    with pytest.raises(AssertionError):
        vec_env = VecFrameStack(venv, n_stack=2, channels_order="not_valid")
    venv.close()

    # Test that it works with non-image envs when no channels_order is given
    vec_env = VecFrameStack(ours(), n_stack=2)
    vec_env.close()


def test_vec_env_is_wrapped():
    # boltzlabs: a wrapper class of this process never wraps an env inside its sandbox
    # (upstream: one env with Monitor, one without -> [False, True]).
    vec_env = ours(n=2)
    assert vec_env.env_is_wrapped(Monitor) == [False, False]
    assert vec_env.env_is_wrapped(Monitor, indices=1) == [False]
    vec_env = VecFrameStack(vec_env, n_stack=2)
    assert vec_env.env_is_wrapped(Monitor) == [False, False]
    vec_env.close()


def test_env_is_wrapped_names_the_wrappers_gymnasium_make_put_inside_as_dummy_vec_env_does():
    """A gym source's env is wrapped inside its sandbox by gymnasium.make:
    env_is_wrapped says so for those classes and their bases, as DummyVecEnv
    says for the same env in this process (Monitor: False on both)."""
    import gymnasium
    from gymnasium.wrappers import OrderEnforcing, PassiveEnvChecker, TimeLimit

    ref = DummyVecEnv([lambda: gymnasium.make("CartPole-v1")] * 2)
    venv = BoltzLabsSB3VecEnv("CartPole-v1", 2)
    try:
        for wrapper in (TimeLimit, OrderEnforcing, PassiveEnvChecker, gymnasium.Wrapper, Monitor, VecFrameStack):
            assert venv.env_is_wrapped(wrapper) == ref.env_is_wrapped(wrapper), wrapper
        assert venv.env_is_wrapped(TimeLimit) == [True, True]
        assert venv.env_is_wrapped(TimeLimit, indices=[1]) == [True]
    finally:
        venv.close()
        ref.close()


def test_vec_deterministic():
    vec_env = ours()
    vec_env.seed(3)
    obs = vec_env.reset()
    vec_env.seed(3)
    new_obs = vec_env.reset()
    assert np.allclose(new_obs, obs)
    # Test with VecNormalize (VecEnvWrapper should call self.venv.seed())
    vec_normalize = VecNormalize(vec_env)
    vec_normalize.seed(3)
    obs = vec_env.reset()
    vec_normalize.seed(3)
    new_obs = vec_env.reset()
    assert np.allclose(new_obs, obs)
    vec_normalize.close()
    # Similar test but with make_vec_env
    # boltzlabs: make_vec_env builds DummyVecEnv/SubprocVecEnv from env_fns; ours takes the id.
    vec_env_1 = BoltzLabsSB3VecEnv("Pendulum-v1", N_ENVS)
    vec_env_2 = BoltzLabsSB3VecEnv("Pendulum-v1", N_ENVS)
    vec_env_1.seed(0)
    vec_env_2.seed(0)
    assert np.allclose(vec_env_1.reset(), vec_env_2.reset())
    random_actions = [vec_env_1.action_space.sample() for _ in range(N_ENVS)]
    assert np.allclose(vec_env_1.step(random_actions)[0], vec_env_2.step(random_actions)[0])
    vec_env_1.close()
    vec_env_2.close()


def test_vec_seeding():
    n_envs = 3
    vec_env = ours(n=n_envs)
    # Seed with no argument
    vec_env.seed()
    obs = vec_env.reset()
    _, rewards, _, _ = vec_env.step(np.array([vec_env.action_space.sample() for _ in range(n_envs)]))
    # Seed should be different per process
    assert not np.allclose(obs[0], obs[1])
    assert not np.allclose(rewards[0], rewards[1])
    assert not np.allclose(obs[1], obs[2])
    assert not np.allclose(rewards[1], rewards[2])
    vec_env.close()


def test_render():
    # boltzlabs: the rgb_array half of upstream's test_render (its "human" half needs an X
    # server), on tests/envs/dict_env instead of Pendulum (whose frames need pygame).
    n_envs = 2
    vec_env = BoltzLabsSB3VecEnv(str(DICT_ENV), n_envs, render_mode="rgb_array")
    reference = DummyVecEnv([lambda: DictEnv(render_mode="rgb_array")] * n_envs)
    for venv in (vec_env, reference):
        venv.seed(1)
        venv.reset()
    assert vec_env.render_mode == "rgb_array" and vec_env.metadata["render_modes"] == reference.metadata["render_modes"]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        image = vec_env.render()
        assert np.array_equal(vec_env.render("rgb_array"), image)
    assert len(record) == 0
    assert np.array_equal(image, reference.render())  # the frames tiled as DummyVecEnv tiles them
    for frame, want in zip(vec_env.get_images(), reference.get_images(), strict=True):
        assert_same(frame, want)

    with pytest.warns(UserWarning):
        assert vec_env.render(mode="blah") is None

    for _ in range(10):
        actions = np.array([vec_env.action_space.sample() for _ in range(n_envs)])
        vec_env.step(actions)
        reference.step(actions)
        assert np.array_equal(vec_env.render(), reference.render())

    vec_env.close()
    reference.close()

    # Check that it still works with vec env wrapper (boltzlabs: on a Box env: the Dict env's
    # MultiBinary key cannot be stacked)
    vec_env = ours()
    vec_env.reset()
    vec_env = VecFrameStack(vec_env, 2)
    vec_env.render()
    assert vec_env.render_mode == "rgb_array"
    vec_env = VecNormalize(vec_env)
    assert vec_env.render_mode == "rgb_array"
    assert np.array_equal(vec_env.render(), np.zeros((8, 8, 3)))  # 3 frames of 4x4, tiled 2x2
    vec_env.close()

    # No render mode: a warning and no image, as DummyVecEnv.
    vec_env = BoltzLabsSB3VecEnv(str(DICT_ENV), 1)
    with pytest.warns(UserWarning):
        assert vec_env.render() is None
    with pytest.warns(UserWarning):
        assert vec_env.get_images() == [None]
    vec_env.close()


def test_vec_monitor(tmp_path):
    """
    Test the `VecMonitor` wrapper
    """
    env = BoltzLabsSB3VecEnv("CartPole-v1", 1)
    env.seed(0)
    monitor_file = str(tmp_path / "stable_baselines-test.monitor.csv")
    monitor_env = VecMonitor(env, monitor_file)
    monitor_env.reset()
    total_steps = 1000
    ep_len, ep_reward = 0, 0
    episodes = 0
    for _ in range(total_steps):
        _, rewards, dones, infos = monitor_env.step([monitor_env.action_space.sample()])
        ep_len += 1
        ep_reward += rewards[0]
        if dones[0]:
            assert ep_reward == infos[0]["episode"]["r"]
            assert ep_len == infos[0]["episode"]["l"]
            ep_len, ep_reward = 0, 0
            episodes += 1

    monitor_env.close()
    assert episodes > 5
    with open(monitor_file) as file_handler:
        assert file_handler.readline().startswith("#")
        assert file_handler.readline().strip() == "r,l,t"
        assert len(file_handler.readlines()) == episodes


# From SB3's tests/test_vec_normalize.py.


def check_vec_norm_equal(norma, normb):
    assert norma.observation_space == normb.observation_space
    assert norma.action_space == normb.action_space
    assert norma.num_envs == normb.num_envs
    for a, b in ((norma.obs_rms, normb.obs_rms), (norma.ret_rms, normb.ret_rms)):
        assert np.all(a.mean == b.mean) and np.all(a.var == b.var) and np.all(a.count == b.count)
    assert norma.clip_obs == normb.clip_obs
    assert norma.clip_reward == normb.clip_reward
    assert norma.norm_obs == normb.norm_obs
    assert norma.norm_reward == normb.norm_reward
    assert np.all(norma.returns == normb.returns)
    assert norma.gamma == normb.gamma
    assert norma.epsilon == normb.epsilon
    assert norma.training == normb.training


def test_vec_env(tmp_path):
    """Test VecNormalize Object"""
    # boltzlabs: upstream's make_env case (Pendulum-v1; its Monitor inside the env becomes nothing:
    # wrapper classes stay on this side of the sandbox).
    clip_obs = 0.5
    clip_reward = 5.0

    orig_venv = BoltzLabsSB3VecEnv("Pendulum-v1", 1)
    norm_venv = VecNormalize(orig_venv, norm_obs=True, norm_reward=True, clip_obs=clip_obs, clip_reward=clip_reward)
    assert orig_venv.render_mode is None
    assert norm_venv.render_mode is None

    _, done = norm_venv.reset(), [False]
    while not done[0]:
        actions = [norm_venv.action_space.sample()]
        obs, rew, done, _ = norm_venv.step(actions)
        assert np.max(np.abs(obs)) <= clip_obs
        assert np.max(np.abs(rew)) <= clip_reward

    path = tmp_path / "vec_normalize"
    norm_venv.save(path)
    assert orig_venv.render_mode is None
    deserialized = VecNormalize.load(path, venv=orig_venv)
    assert deserialized.render_mode is None
    check_vec_norm_equal(norm_venv, deserialized)
    norm_venv.close()


def test_get_original():
    # boltzlabs: _make_warmstart_cartpole() over the adapter
    venv = VecNormalize(BoltzLabsSB3VecEnv("CartPole-v1", 1))
    venv.reset()
    venv.get_original_obs()
    for _ in range(100):
        venv.step([venv.action_space.sample()])
    for _ in range(3):
        actions = [venv.action_space.sample()]
        obs, rewards, _, _ = venv.step(actions)
        obs = obs[0]
        orig_obs = venv.get_original_obs()[0]
        rewards = rewards[0]
        orig_rewards = venv.get_original_reward()[0]

        assert np.all(orig_rewards == 1)
        assert orig_obs.shape == obs.shape
        assert orig_rewards.dtype == rewards.dtype
        assert not np.array_equal(orig_obs, obs)
        assert not np.array_equal(orig_rewards, rewards)
        np.testing.assert_allclose(venv.normalize_obs(orig_obs), obs)
        np.testing.assert_allclose(venv.normalize_reward(orig_rewards), rewards, atol=1e-6)
    venv.close()


# -- Part 2: the same trajectories as DummyVecEnv ---------------------------------------------------

# name: (source, params, in-process factory)
CASES = {
    "CartPole": ("CartPole-v1", {}, lambda: gym.make("CartPole-v1")),
    "Dict": (str(DICT_ENV), {"horizon": 7}, lambda: DictEnv(horizon=7)),
}
RESET_OPTIONS = {
    "CartPole": {"low": -0.01, "high": 0.01},
    "Dict": [{"tag": 1}, {}, {"tag": 3}],
}  # one per lane, one of them empty (no options)


def assert_same(got, want, where="value"):
    """Equal trees: same keys, array dtypes, shapes and values; tuples and lists alike."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{where}: keys {sorted(got)} != {sorted(want)}"
        for key in want:
            assert_same(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), f"{where}: {got!r} != {want!r}"
        for k, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{k}]")
    elif isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray), f"{where}: {type(got)}"
        assert (got.dtype, got.shape) == (want.dtype, want.shape), (
            f"{where}: {got.dtype}{got.shape} != {want.dtype}{want.shape}"
        )
        np.testing.assert_array_equal(got, want, err_msg=where)
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def drive(venv, name, actions):
    """A fixed script: seed() and reset, steps, then seed() and set_options() and a reset mid-way."""
    trace = []
    venv.seed(42)
    trace.append(("reset", venv.reset(), list(venv.reset_infos)))
    for t, action in enumerate(actions):
        obs, rewards, dones, infos = venv.step(action)
        trace.append(("step", obs, rewards, dones, infos, list(venv.reset_infos)))
        if t == len(actions) // 2:
            venv.seed(7)
            venv.set_options(RESET_OPTIONS[name])
            trace.append(("reset", venv.reset(), list(venv.reset_infos)))
    return trace


@pytest.fixture(scope="module")
def vec_envs():
    """One adapter per case for the module (the pools start once)."""
    with contextlib.ExitStack() as stack:

        @functools.cache
        def get(name):
            source, params, _ = CASES[name]
            return stack.enter_context(
                contextlib.closing(BoltzLabsSB3VecEnv(source, N_ENVS, step_timeout=30.0, **params))
            )

        yield get


@pytest.mark.parametrize("name", list(CASES))
def test_trajectories_equal_dummy_vec_env(vec_envs, name):
    _, _, factory = CASES[name]
    reference = DummyVecEnv([factory] * N_ENVS)
    venv = vec_envs(name)
    assert venv.observation_space == reference.observation_space
    assert venv.action_space == reference.action_space
    assert venv.metadata == reference.metadata and venv.render_mode == reference.render_mode
    reference.action_space.seed(0)
    actions = [np.array([reference.action_space.sample() for _ in range(N_ENVS)]) for _ in range(60)]
    want = drive(reference, name, actions)
    got = drive(venv, name, actions)
    terminal = 0
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g[0] == w[0]
        for j, (a, b) in enumerate(zip(g[1:], w[1:], strict=True)):
            assert_same(a, b, f"{g[0]} #{k} item {j}")
        if g[0] == "step":
            assert g[2].dtype == np.float32 and g[3].dtype == np.bool_
            terminal += sum("terminal_observation" in info for info in g[4])
            for info in g[4]:  # writable, as DummyVecEnv's (torch warns on a read-only array)
                terminal_obs = info.get("terminal_observation", {})
                for value in [*info.values(), *(terminal_obs.values() if isinstance(terminal_obs, dict) else [])]:
                    assert not isinstance(value, np.ndarray) or value.flags.writeable
    assert terminal >= 2, "the script must cross episode boundaries"
    reference.close()


def test_a_remote_pool_gives_the_same_trajectories(tmp_path):
    from test_remote import TOKEN, Worker

    worker = Worker(tmp_path)
    try:
        venv = BoltzLabsSB3VecEnv("CartPole-v1", N_ENVS, worker=worker.url, token=TOKEN, step_timeout=30.0)
        reference = DummyVecEnv([CASES["CartPole"][2]] * N_ENVS)
        reference.action_space.seed(0)
        actions = [np.array([reference.action_space.sample() for _ in range(N_ENVS)]) for _ in range(40)]
        for g, w in zip(drive(venv, "CartPole", actions), drive(reference, "CartPole", actions), strict=True):
            for a, b in zip(g[1:], w[1:], strict=True):
                assert_same(a, b, g[0])
        venv.close()
    finally:
        worker.stop()


@pytest.mark.parametrize("wrapper", ["VecNormalize", "VecMonitor", "VecFrameStack"])
def test_wrappers_on_top_equal_dummy_vec_env(vec_envs, wrapper):
    make = {
        "VecNormalize": VecNormalize,
        "VecMonitor": VecMonitor,
        "VecFrameStack": functools.partial(VecFrameStack, n_stack=3),
    }[wrapper]
    reference = make(DummyVecEnv([CASES["CartPole"][2]] * N_ENVS))
    venv = make(vec_envs("CartPole"))
    rng = np.random.default_rng(1)
    for v in (venv, reference):
        v.seed(5)
    assert_same(venv.reset(), reference.reset())
    episodes = 0
    for _ in range(120):
        actions = rng.integers(0, 2, N_ENVS)
        got, want = venv.step(actions), reference.step(actions)
        for a, b in zip(got[:3], want[:3]):
            assert_same(a, b)
        for g, w in zip(got[3], want[3]):
            if "episode" in w:  # VecMonitor: its "t" is wall time
                episodes += 1
                assert (g["episode"]["r"], g["episode"]["l"]) == (w["episode"]["r"], w["episode"]["l"])
                g, w = dict(g, episode=None), dict(w, episode=None)
            assert_same(g, w)
    if wrapper == "VecNormalize":
        np.testing.assert_array_equal(venv.obs_rms.mean, reference.obs_rms.mean)
        np.testing.assert_array_equal(venv.get_original_obs(), reference.get_original_obs())
    if wrapper == "VecMonitor":
        assert episodes >= 3


def test_ppo_learns_through_the_adapter(tmp_path):
    """The example trains PPO for a few hundred steps and writes its learning curve."""
    curve = tmp_path / "curve.csv"
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--timesteps", "512", "--n-envs", "2", "--n-steps", "128", "--out", str(curve)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = curve.read_text().splitlines()
    assert lines[0] == "timesteps,episodes,mean_return,seconds"
    assert len(lines) >= 3  # one row per rollout (512 / (2 * 128) = 2)
    assert float(lines[-1].split(",")[0]) >= 512


# -- the adapter's own API ------------------------------------------------------------------------


def test_constructed_from_a_source_or_a_pool_and_closes_its_pool():
    venv = BoltzLabsSB3VecEnv("CartPole-v1", 2, step_timeout=5.0)
    assert venv.num_envs == 2 and venv.pool.step_timeout == 5.0
    assert repr(venv) == "BoltzLabsSB3VecEnv('CartPole-v1', n_envs=2)"
    venv.close()
    venv.close()  # idempotent
    assert venv.pool.closed
    pool = RLPool("CartPole-v1", 2)
    venv = BoltzLabsSB3VecEnv(pool)
    assert venv.pool is pool
    with pytest.raises(TypeError, match="open RLPool alone"):
        BoltzLabsSB3VecEnv(pool, 2)
    with pytest.raises(TypeError, match="needs n_envs"):
        BoltzLabsSB3VecEnv("CartPole-v1")
    with pytest.raises(TypeError, match="cluster pool .* is not supported"):
        BoltzLabsSB3VecEnv("CartPole-v1", 2, cluster="ray")
    venv.close()
    assert pool.closed


def test_an_env_without_declared_spaces_is_refused_and_its_pool_closed(env_dir):
    source = env_dir("""
        from boltzlabs.env import serve
        serve(reset=lambda seed: 0, step=lambda a: (0, 0.0, False, {}))
    """)
    pool = RLPool(source, 1)
    with pytest.raises(ValueError, match="declared no observation_space"):
        BoltzLabsSB3VecEnv(pool)
    pool.close()
    with pytest.raises(ValueError, match="declared no observation_space"):
        BoltzLabsSB3VecEnv(source, 1)


def test_step_wait_needs_a_step_async_and_a_reset_waits_out_a_step_in_flight(vec_envs):
    venv = vec_envs("CartPole")
    venv.reset()
    with pytest.raises(ValueError, match="without a step_async"):
        venv.step_wait()
    venv.step_async(np.zeros(N_ENVS, dtype=np.int64))
    with pytest.raises(ValueError, match="in flight"):
        venv.step_async(np.zeros(N_ENVS, dtype=np.int64))
    obs = venv.reset()  # SB3: a reset cancels the step in flight
    assert obs.shape == (N_ENVS, 4)
    obs, _, _, _ = venv.step(np.zeros(N_ENVS, dtype=np.int64))
    assert obs.shape == (N_ENVS, 4)


def test_indices_out_of_range_are_refused_before_any_request(vec_envs):
    venv = vec_envs("CartPole")
    for bad in (N_ENVS, -N_ENVS - 1, [0, 7], ["a"], [True]):
        with pytest.raises(IndexError, match="out of range"):
            venv.env_is_wrapped(Monitor, indices=bad)
        with pytest.raises(IndexError, match="out of range"):
            venv.get_attr("render_mode", indices=bad)
    assert venv.get_attr("render_mode", indices=-1) == [None]


def test_set_attr_gives_every_env_the_same_value_even_a_list():
    venv = ours()
    venv.set_attr("dummy", [1, 2, 3])  # SB3: one value for all, never one per env
    assert venv.get_attr("dummy") == [[1, 2, 3]] * N_ENVS
    venv.set_attr("dummy", [4], indices=[-1])
    assert venv.get_attr("dummy") == [[1, 2, 3], [1, 2, 3], [4]]
    venv.close()


def test_only_boltzlabs_sb3_imports_sb3_and_torch():
    # Every import of every module, function-level ones included (as test_layout reads them).
    offenders = []
    for path in sorted((TESTS.parent / "boltzlabs").rglob("*.py")):
        if path.name == "sb3.py" and path.parent.name == "boltzlabs":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            offenders += [
                f"{path}:{node.lineno} imports {name}"
                for name in names
                if name.split(".")[0] in ("torch", "stable_baselines3") or name == "boltzlabs.sb3"
            ]
    assert offenders == []
    # And at run time: the client, the Gymnasium adapter and the env shim load neither.
    code = (
        "import sys, boltzlabs, boltzlabs.gym, boltzlabs.env; from boltzlabs import RLPool; "
        "print(sorted(m for m in ('torch', 'stable_baselines3') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(TESTS.parent)),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# -- Part 3: hostile envs ---------------------------------------------------------------------------

CRASHING = """
    import os
    import numpy as np
    from gymnasium import spaces
    from boltzlabs.env import serve

    state = {"t": 0, "seed": None}

    def reset(seed, options=None):
        if state.get("crashed") and FAIL_RESET:
            raise RuntimeError("this env cannot come back")
        state["t"], state["seed"] = 0, seed
        return np.zeros(2, np.float32), {"seed": seed}

    def step(action):
        state["t"] += 1
        if state["seed"] == 1 and state["t"] == 3:
            state["crashed"] = True
            CRASH
        return np.full(2, state["t"], np.float32), 1.0, False, state["t"] >= 10, {"t": state["t"]}

    serve(reset=reset, step=step, observation_space=spaces.Box(-100, 100, (2,), np.float32),
          action_space=spaces.Discrete(2))
"""


@pytest.mark.parametrize(
    "crash,error,timeout",
    [
        ("os._exit(7)", "exit", 10.0),
        ("raise ValueError('boom at t=3')", "boom at t=3", 10.0),
        ("import time; time.sleep(60)", "missed the step deadline of 2 s", 2.0),
    ],
    ids=["exit", "raise", "hang"],
)
def test_a_crash_mid_episode_is_a_truncated_lane_with_its_error_then_reset(
    env_dir, spawn, caplog, crash, error, timeout
):
    source = env_dir(CRASHING.replace("CRASH", crash).replace("FAIL_RESET", "False"))
    venv = VecMonitor(BoltzLabsSB3VecEnv(source, 2, spawn=spawn, step_timeout=timeout))
    venv.seed(0)  # lane 1 gets seed 1: it crashes at its third step
    venv.reset()
    actions = np.zeros(2, dtype=np.int64)
    for _ in range(2):
        venv.step(actions)
    with caplog.at_level(logging.WARNING, logger="boltzlabs"):
        obs, rewards, dones, infos = venv.step(actions)
    assert dones.tolist() == [False, True]
    assert rewards.tolist() == [1.0, 0.0]
    assert error in infos[1]["error"].lower()
    assert infos[1]["TimeLimit.truncated"] is True
    np.testing.assert_array_equal(infos[1]["terminal_observation"], [2, 2])  # its last good observation
    np.testing.assert_array_equal(obs, [[3, 3], [0, 0]])  # lane 1 reset, lane 0 untouched
    assert infos[1]["episode"]["l"] == 3  # VecMonitor closes the episode
    assert "env 1" in caplog.text and error in caplog.text.lower()
    assert "error" not in infos[0]
    obs, rewards, dones, infos = venv.step(actions)  # and the lane goes on
    np.testing.assert_array_equal(obs, [[4, 4], [1, 1]])
    assert rewards.tolist() == [1.0, 1.0]
    venv.close()


def test_an_env_that_cannot_be_reset_after_a_crash_raises_naming_the_lane(env_dir):
    source = env_dir(CRASHING.replace("CRASH", "raise ValueError('boom')").replace("FAIL_RESET", "True"))
    venv = BoltzLabsSB3VecEnv(source, 2, step_timeout=10.0)
    venv.seed(0)
    venv.reset()
    actions = np.zeros(2, dtype=np.int64)
    venv.step(actions)
    venv.step(actions)
    with pytest.raises(EnvError, match=r"(?s)env 1 of .* could not be reset: .*this env cannot come back") as caught:
        venv.step(actions)
    assert caught.value.env_index == 1
    venv.close()


BAD_OBS = """
    import numpy as np
    from gymnasium import spaces
    from boltzlabs.env import serve

    state = {"t": 0, "seed": None}

    def reset(seed, options=None):
        state["t"], state["seed"] = 0, seed
        if seed == 5:
            return BAD
        return {"pos": np.zeros(2, np.float32), "n": 0}

    def step(action):
        state["t"] += 1
        if state["seed"] == 1 and state["t"] == 2:
            return BAD, 1.0, False, False, {}
        return {"pos": np.full(2, state["t"], np.float32), "n": state["t"]}, 1.0, False, False, {}

    serve(reset=reset, step=step, action_space=spaces.Discrete(2),
          observation_space=spaces.Dict({"pos": spaces.Box(-100, 100, (2,), np.float32), "n": spaces.Discrete(100)}))
"""


@pytest.mark.parametrize(
    "bad",
    [
        "{'pos': [1.0, 2.0, 3.0], 'n': 1}",  # a longer row
        "{'pos': 1.0, 'n': 1}",  # a scalar numpy would broadcast
        "{'n': 1}",  # a missing key
        "'text'",  # not a dict at all
        "{'pos': ['a', 'b'], 'n': 1}",  # not numbers
        "{'pos': [[1.0], [2.0, 3.0]], 'n': 1}",  # ragged
        "None",  # nothing
    ],
    ids=["long", "scalar", "missing", "text", "strings", "ragged", "none"],
)
def test_an_observation_that_does_not_fit_the_space_fails_its_lane(env_dir, bad):
    source = env_dir(BAD_OBS.replace("BAD", bad))
    venv = BoltzLabsSB3VecEnv(source, 2, step_timeout=10.0)
    venv.seed(0)
    venv.reset()
    actions = np.zeros(2, dtype=np.int64)
    venv.step(actions)
    obs, rewards, dones, infos = venv.step(actions)
    assert dones.tolist() == [False, True]
    assert "does not fit" in infos[1]["error"]
    assert infos[1]["TimeLimit.truncated"] is True
    np.testing.assert_array_equal(infos[1]["terminal_observation"]["pos"], [1, 1])  # its last good one
    np.testing.assert_array_equal(obs["pos"], [[2, 2], [0, 0]])
    assert obs["n"].tolist() == [2, 0]
    venv.seed(4)  # lane 1 gets seed 5: its reset sends the bad observation
    with pytest.raises(EnvError, match="env 1 of .*its reset: the env sent an observation"):
        venv.reset()
    venv.close()
