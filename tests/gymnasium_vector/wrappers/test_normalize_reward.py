"""Gymnasium's tests/wrappers/vector/test_normalize_reward.py, each test run on SyncVectorEnv and BoltzLabsVecEnv.

Ported from Gymnasium 1.4.0 (MIT License; notice in tests/gymnasium_vector/__init__.py).
"""

import numpy as np
import pytest
from gymnasium import wrappers
from gymnasium.error import InvalidBound
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from ..conftest import generic_env, vectorisers


def thunk():
    # upstream's reset_func/step_func: terminated after 10 steps ("ten_step" in envs/generic/env.py)
    return generic_env(behaviour="ten_step")


@pytest.mark.parametrize("vectoriser", vectorisers())
def test_functionality(vectoriser, build,
    n_envs=3,
    n_steps=100,
):
    env = build(vectoriser, [thunk() for _ in range(n_envs)])
    env = wrappers.vector.NormalizeReward(env)

    env.reset()
    for _ in range(n_steps):
        action = env.action_space.sample()
        env.step(action)

    env.reset()
    forward_rets = []
    accumulated_rew = 0
    for _ in range(n_steps):
        action = env.action_space.sample()
        _, reward, terminated, truncated, _ = env.step(action)
        dones = np.logical_or(terminated, truncated)
        accumulated_rew = accumulated_rew * 0.9 * dones + reward
        forward_rets.append(accumulated_rew)

    env.close()

    forward_rets = np.asarray(forward_rets)
    assert np.allclose(np.std(forward_rets, axis=0), 0.89, atol=0.1)


@pytest.mark.parametrize("vectoriser", vectorisers())
def test_against_wrapper(vectoriser, build, n_envs=3, n_steps=100, rtol=0.1, atol=0):
    vec_env = build(vectoriser, [thunk() for _ in range(n_envs)])
    vec_env = wrappers.vector.NormalizeReward(vec_env)
    vec_env.reset()
    for _ in range(n_steps):
        action = vec_env.action_space.sample()
        vec_env.step(action)

    env = wrappers.Autoreset(thunk().thunk())
    env = wrappers.NormalizeReward(env)
    env.reset()
    for _ in range(n_steps):
        action = env.action_space.sample()
        env.step(action)

    assert np.allclose(env.return_rms.var, vec_env.return_rms.var, rtol=rtol, atol=atol)


@pytest.mark.parametrize("vectoriser", vectorisers())
def test_equivalence_with_wrapper(vectoriser, build, n_steps=50):
    def thunk_with_normalize():
        return wrappers.NormalizeReward(thunk().thunk())

    # The per-env wrapper is the reference, in this process.
    per_env = SyncVectorEnv([thunk_with_normalize])
    per_env.reset(seed=42)
    for _ in range(n_steps):
        per_env.step(per_env.action_space.sample())

    vec_env = build(vectoriser, [thunk()])
    vec_env = wrappers.vector.NormalizeReward(vec_env)
    vec_env.reset(seed=42)
    for _ in range(n_steps):
        vec_env.step(vec_env.action_space.sample())

    assert vec_env.return_rms.count == per_env.envs[0].return_rms.count
    assert np.allclose(
        vec_env.return_rms.mean, per_env.envs[0].return_rms.mean, rtol=1e-4
    )
    assert np.allclose(
        vec_env.return_rms.var, per_env.envs[0].return_rms.var, rtol=1e-4
    )
    per_env.close()
    vec_env.close()


@pytest.mark.parametrize("gamma", [-1.0, 1.01, 2.0, 99])
@pytest.mark.parametrize("vectoriser", vectorisers())
def test_gamma_outside_unit_interval_is_rejected(vectoriser, build, gamma):
    """Matches the same check on the non-vector wrapper, which shares this accumulator."""
    vec_env = build(vectoriser, [thunk()])
    with pytest.raises(InvalidBound, match="`gamma` should be in the interval"):
        wrappers.vector.NormalizeReward(vec_env, gamma=gamma)
    vec_env.close()


@pytest.mark.parametrize("epsilon", [0.0, -1e-8, -1.0])
@pytest.mark.parametrize("vectoriser", vectorisers())
def test_non_positive_epsilon_is_rejected(vectoriser, build, epsilon):
    vec_env = build(vectoriser, [thunk()])
    with pytest.raises(InvalidBound, match="`epsilon` should be strictly positive"):
        wrappers.vector.NormalizeReward(vec_env, epsilon=epsilon)
    vec_env.close()


@pytest.mark.parametrize("vectoriser", vectorisers())
def test_same_step_autoreset_updates_return_rms(vectoriser, build, n_envs=2, episode_length=4, n_steps=12):
    """SAME_STEP first-after-done rewards must update return_rms and start a new return."""

    env = wrappers.vector.NormalizeReward(
        build(
            vectoriser,
            [generic_env(behaviour="fixed_length", episode_length=episode_length) for _ in range(n_envs)],
            autoreset_mode=AutoresetMode.SAME_STEP,
        )
    )

    env.reset(seed=123)
    for _ in range(n_steps):
        _, _, terminated, truncated, _ = env.step(env.action_space.sample())
        dones = np.logical_or(terminated, truncated)
        if np.any(dones):
            assert np.all(env.accumulated_reward[dones] == 0)

    # Every step is a real environment step under SAME_STEP.
    assert np.isclose(env.return_rms.count, n_steps * n_envs)
    env.close()
