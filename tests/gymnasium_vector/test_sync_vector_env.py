"""Gymnasium's tests/vector/test_sync_vector_env.py, each test run on SyncVectorEnv and BoltzLabsVecEnv.

Ported from Gymnasium 1.4.0 (MIT License; notice in tests/gymnasium_vector/__init__.py).
"""

import re

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.spaces import Box, Discrete, MultiDiscrete, Tuple
from gymnasium.vector import AutoresetMode

from .conftest import (HETEROGENEOUS, NO_BOX2D, NO_PYGAME, REFUSED_SPACE, SANDBOX_RNG, SANDBOX_RNG_SEEN, generic,
                       generic_env, make_env, vectorisers)


def assert_rng_equal(rng_1: np.random.Generator, rng_2: np.random.Generator):
    """Tests whether two random number generators are equal."""
    assert rng_1.bit_generator.state == rng_2.bit_generator.state


@pytest.mark.parametrize("vectoriser", vectorisers())
def test_create_sync_vector_env(vectoriser, build):
    """Tests creating the sync vector environment."""
    env = build(vectoriser, [make_env("FrozenLake-v1", i) for i in range(8)])
    env.close()

    assert env.num_envs == 8


@pytest.mark.parametrize("vectoriser", vectorisers())
def test_metadata_sync_vector_env(vectoriser, build):
    """Tests that the vector env's metadata doesn't mutate the sub-environment's (class-level) metadata."""
    envs_1 = build(vectoriser, [make_env("CartPole-v1", 0)], autoreset_mode=AutoresetMode.NEXT_STEP)
    envs_2 = build(vectoriser, [make_env("CartPole-v1", 1)], autoreset_mode=AutoresetMode.SAME_STEP)

    assert envs_1.metadata["autoreset_mode"] == AutoresetMode.NEXT_STEP
    assert envs_2.metadata["autoreset_mode"] == AutoresetMode.SAME_STEP
    # Ours has no envs[0] in this process: the sub-env's metadata is what its handshake declared.
    sub_metadata = envs_1.envs[0].metadata if vectoriser == "sync" else envs_1.env_contract.metadata
    assert "autoreset_mode" not in sub_metadata
    assert "autoreset_mode" not in gym.make("CartPole-v1").unwrapped.metadata

    envs_1.close()
    envs_2.close()


@pytest.mark.parametrize("vectoriser", vectorisers())
def test_reset_sync_vector_env(vectoriser, build):
    """Tests sync vector `reset` function."""
    env = build(vectoriser, [make_env("CartPole-v1", i) for i in range(8)])
    observations, infos = env.reset()
    env.close()

    assert isinstance(env.observation_space, Box)
    assert isinstance(observations, np.ndarray)
    assert observations.dtype == env.observation_space.dtype
    assert observations.shape == (8,) + env.single_observation_space.shape
    assert observations.shape == env.observation_space.shape

    del observations


@pytest.mark.parametrize("vectoriser", vectorisers())
@pytest.mark.parametrize("use_single_action_space", [True, False])
def test_step_sync_vector_env(use_single_action_space, vectoriser, build):
    """Test sync vector `steps` function."""
    env = build(vectoriser, [make_env("FrozenLake-v1", i) for i in range(8)])
    env.reset()

    assert isinstance(env.single_action_space, Discrete)
    assert isinstance(env.action_space, MultiDiscrete)

    if use_single_action_space:
        actions = [env.single_action_space.sample() for _ in range(8)]
    else:
        actions = env.action_space.sample()
    observations, rewards, terminations, truncations, _ = env.step(actions)

    env.close()

    assert isinstance(env.observation_space, MultiDiscrete)
    assert isinstance(observations, np.ndarray)
    assert observations.dtype == env.observation_space.dtype
    assert observations.shape == (8,) + env.single_observation_space.shape
    assert observations.shape == env.observation_space.shape

    assert isinstance(rewards, np.ndarray)
    assert isinstance(rewards[0], (float, np.floating))
    assert rewards.ndim == 1
    assert rewards.size == 8

    assert isinstance(terminations, np.ndarray)
    assert terminations.dtype == np.bool_
    assert terminations.ndim == 1
    assert terminations.size == 8

    assert isinstance(truncations, np.ndarray)
    assert truncations.dtype == np.bool_
    assert truncations.ndim == 1
    assert truncations.size == 8


@NO_PYGAME
@pytest.mark.parametrize("vectoriser", vectorisers())
def test_render_sync_vector(vectoriser, build):
    envs = build(vectoriser, [make_env("CartPole-v1", i, render_mode="rgb_array") for i in range(3)])
    assert envs.render_mode == "rgb_array"

    envs.reset()
    rendered_frames = envs.render()
    assert isinstance(rendered_frames, tuple)
    assert len(rendered_frames) == envs.num_envs
    assert all(isinstance(frame, np.ndarray) for frame in rendered_frames)

    envs = build(vectoriser, [make_env("CartPole-v1", i) for i in range(3)])
    assert envs.render_mode is None


@NO_PYGAME
@pytest.mark.parametrize("vectoriser", vectorisers())
def test_call_sync_vector_env(vectoriser, build):
    """Test sync vector `call` on sub-environments."""
    env = build(vectoriser, [make_env("CartPole-v1", i, render_mode="rgb_array_list") for i in range(4)])
    _ = env.reset()
    images = env.call("render")
    gravity = env.call("gravity")

    env.close()

    assert isinstance(images, tuple)
    assert len(images) == 4
    for i in range(4):
        assert len(images[i]) == 1
        assert isinstance(images[i][0], np.ndarray)

    assert isinstance(gravity, tuple)
    assert len(gravity) == 4
    for i in range(4):
        assert isinstance(gravity[i], float)
        assert gravity[i] == 9.8


@pytest.mark.parametrize("vectoriser", vectorisers())
def test_set_attr_sync_vector_env(vectoriser, build):
    """Test sync vector `set_attr` function."""
    env = build(vectoriser, [make_env("CartPole-v1", i) for i in range(4)])
    env.set_attr("gravity", [9.81, 3.72, 8.87, 1.62])
    gravity = env.get_attr("gravity")
    assert gravity == (9.81, 3.72, 8.87, 1.62)

    env.close()


@pytest.mark.parametrize("vectoriser", vectorisers(boltzlabs=HETEROGENEOUS))
def test_check_spaces_sync_vector_env(vectoriser, build):
    """Tests the sync vector `check_spaces` function."""
    # CartPole-v1 - observation_space: Box(4,), action_space: Discrete(2)
    env_fns = [make_env("CartPole-v1", i) for i in range(8)]
    # FrozenLake-v1 - Discrete(16), action_space: Discrete(4)
    env_fns[1] = make_env("FrozenLake-v1", 1)
    with pytest.raises(
        RuntimeError,
        match=re.escape(
            "SyncVectorEnv(..., observation_mode='same') however the sub-environments observation spaces are not equivalent."
        ),
    ):
        env = build(vectoriser, env_fns)
        env.close()


@pytest.mark.parametrize("vectoriser", vectorisers(boltzlabs=REFUSED_SPACE))
def test_custom_space_sync_vector_env(vectoriser, build):
    """Test the use of custom spaces with sync vector environment."""
    env = build(vectoriser, [generic_env(obs="custom", act="custom", behaviour="custom")] * 4)
    reset_observations, infos = env.reset()

    assert isinstance(env.single_action_space, generic.CustomSpace)
    assert isinstance(env.action_space, Tuple)

    actions = ("action-2", "action-3", "action-5", "action-7")
    step_observations, _, _, _, _ = env.step(actions)

    env.close()

    assert isinstance(env.single_observation_space, generic.CustomSpace)
    assert isinstance(env.observation_space, Tuple)

    assert isinstance(reset_observations, tuple)
    assert reset_observations == ("reset", "reset", "reset", "reset")

    assert isinstance(step_observations, tuple)
    assert step_observations == (
        "step(action-2)",
        "step(action-3)",
        "step(action-5)",
        "step(action-7)",
    )


@NO_BOX2D
@pytest.mark.parametrize("vectoriser", vectorisers(boltzlabs=SANDBOX_RNG))
def test_sync_vector_env_seed(vectoriser, build):
    """Test seeding for sync vector environments."""
    env = make_env("BipedalWalker-v3", seed=123).thunk()
    sync_vector_env = build(vectoriser, [make_env("BipedalWalker-v3", seed=123)])

    assert_rng_equal(env.action_space.np_random, sync_vector_env.action_space.np_random)
    for _ in range(100):
        env_action = env.action_space.sample()
        vector_action = sync_vector_env.action_space.sample()
        assert np.all(env_action == vector_action)

    env.close()


def _testing_env_ids():
    # tests/envs/utils.py's all_testing_env_specs: the registered gymnasium envs that can be made here.
    ids = []
    for spec in gym.envs.registry.values():
        if isinstance(spec.entry_point, str) and "gymnasium.envs." in spec.entry_point:
            try:
                spec.make(disable_env_checker=True).close()
            except (ImportError, AttributeError, gym.error.DependencyNotInstalled, gym.error.MissingArgument):
                continue
            ids.append(spec.id)
    return ids


def _determinism_params():
    # The batched action_space lives on the host whatever the env: ours is checked (strict) on one id only.
    params = []
    for spec in _testing_env_ids():
        mark = SANDBOX_RNG if spec == "CartPole-v1" else SANDBOX_RNG_SEEN
        params += [pytest.param(spec, v.values[0], marks=v.marks, id=f"{spec}-{v.id}")
                   for v in vectorisers(boltzlabs=mark)]
    return params


@pytest.mark.parametrize("spec, vectoriser", _determinism_params())
def test_sync_vector_determinism(spec: str, vectoriser, build, seed: int = 123, n: int = 3):
    """Check that for all environments, the sync vector envs produce the same action samples using the same seeds."""
    env_1 = build(vectoriser, [make_env(spec, seed=seed) for _ in range(n)])
    env_2 = build(vectoriser, [make_env(spec, seed=seed) for _ in range(n)])
    assert_rng_equal(env_1.action_space.np_random, env_2.action_space.np_random)

    for _ in range(100):
        env_1_samples = env_1.action_space.sample()
        env_2_samples = env_2.action_space.sample()
        assert np.all(env_1_samples == env_2_samples)

    env_1.close()
    env_2.close()
