"""Gymnasium's tests/wrappers/vector/test_normalize_observation.py, each test run on SyncVectorEnv and BoltzLabsVecEnv.

Ported from Gymnasium 1.4.0 (MIT License; notice in tests/gymnasium_vector/__init__.py).
"""

import numpy as np
import pytest
from gymnasium import wrappers
from gymnasium.error import InvalidBound

from ..conftest import generic_env, vectorisers


def create_env():
    return generic_env(obs="box3")


@pytest.mark.parametrize("vectoriser", vectorisers())
def test_normalization(vectoriser, build,
    n_envs: int = 2, convergence_steps: int = 250, testing_steps: int = 100
):
    vec_env = build(vectoriser, [create_env() for _ in range(n_envs)])
    vec_env = wrappers.vector.NormalizeObservation(vec_env)

    vec_env.reset(seed=123)
    vec_env.observation_space.seed(123)
    vec_env.action_space.seed(123)
    for _ in range(convergence_steps):
        vec_env.step(vec_env.action_space.sample())

    observations = []
    for _ in range(testing_steps):
        obs, *_ = vec_env.step(vec_env.action_space.sample())
        observations.append(obs)
    observations = np.array(observations)  # (100, 2, 3)

    mean_obs = np.mean(observations, axis=(0, 1))
    var_obs = np.var(observations, axis=(0, 1))
    assert mean_obs.shape == (3,) and var_obs.shape == (3,)

    assert np.allclose(mean_obs, np.zeros(3), atol=0.15)
    assert np.allclose(var_obs, np.ones(3), atol=0.2)


@pytest.mark.parametrize("vectoriser", vectorisers())
def test_wrapper_equivalence(vectoriser, build,
    n_envs: int = 3,
    n_steps: int = 250,
):
    mean_rtol = (np.array([0.1, 0.4, 0.25]),)
    var_rtol = (np.array([0.15, 0.15, 0.18]),)

    vec_env = build(vectoriser, [create_env() for _ in range(n_envs)])
    vec_env = wrappers.vector.NormalizeObservation(vec_env)

    vec_env.reset(seed=123)
    vec_env.observation_space.seed(123)
    vec_env.action_space.seed(123)
    for _ in range(n_steps):
        vec_env.step(vec_env.action_space.sample())

    env = wrappers.Autoreset(create_env().thunk())
    env = wrappers.NormalizeObservation(env)
    env.reset(seed=123)
    env.action_space.seed(123)
    for _ in range(n_steps // n_envs):
        env.step(env.action_space.sample())

    assert np.allclose(env.obs_rms.mean, vec_env.obs_rms.mean, rtol=mean_rtol)
    assert np.allclose(env.obs_rms.var, vec_env.obs_rms.var, rtol=var_rtol)


@pytest.mark.parametrize("vectoriser", vectorisers())
def test_update_running_mean(vectoriser, build):
    env = build(vectoriser, [create_env() for _ in range(2)])
    env = wrappers.vector.NormalizeObservation(env)

    # Default value is True
    assert env.update_running_mean

    env.reset()
    for _ in range(100):
        env.step(env.action_space.sample())

    # Disable updating the running mean
    env.update_running_mean = False
    copied_rms_mean = np.copy(env.obs_rms.mean)
    copied_rms_var = np.copy(env.obs_rms.var)

    # Continue stepping through the environment and check that the running mean is not effected
    for _ in range(10):
        env.step(env.action_space.sample())

    assert np.all(copied_rms_mean == env.obs_rms.mean)
    assert np.all(copied_rms_var == env.obs_rms.var)

    # Re-enable updating the running mean
    env.update_running_mean = True

    for _ in range(10):
        env.step(env.action_space.sample())

    assert np.any(copied_rms_mean != env.obs_rms.mean)
    assert np.any(copied_rms_var != env.obs_rms.var)


@pytest.mark.parametrize("vectoriser", vectorisers())
def test_observation_space_and_dtype(vectoriser, build):
    vec_env = build(vectoriser, [create_env() for _ in range(2)])
    vec_env = wrappers.vector.NormalizeObservation(vec_env)

    assert vec_env.single_observation_space.dtype == np.float32
    assert np.all(vec_env.single_observation_space.low == -np.inf)
    assert np.all(vec_env.single_observation_space.high == np.inf)

    obs, _ = vec_env.reset(seed=123)
    assert obs.dtype == np.float32

    obs, *_ = vec_env.step(vec_env.action_space.sample())
    assert obs.dtype == np.float32


@pytest.mark.parametrize("epsilon", [0.0, -1e-8, -1.0])
@pytest.mark.parametrize("vectoriser", vectorisers())
def test_non_positive_epsilon_is_rejected(vectoriser, build, epsilon):
    """Matches the same check on the non-vector wrapper, which shares this scaling."""
    vec_env = build(vectoriser, [create_env()])
    with pytest.raises(InvalidBound, match="`epsilon` should be strictly positive"):
        wrappers.vector.NormalizeObservation(vec_env, epsilon=epsilon)
    vec_env.close()
