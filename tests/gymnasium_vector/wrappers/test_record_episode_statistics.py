"""Gymnasium's tests/wrappers/vector/test_record_episode_statistics.py, each test run on SyncVectorEnv and BoltzLabsVecEnv.

Ported from Gymnasium 1.4.0 (MIT License; notice in tests/gymnasium_vector/__init__.py).
"""

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import data_equivalence
from gymnasium.vector import AutoresetMode, VectorEnv

from ..conftest import generic_env, vectorisers


@pytest.mark.parametrize("num_envs", (1, 3))
@pytest.mark.parametrize("vectoriser", vectorisers())
def test_record_episode_statistics(vectoriser, make_vec, num_envs, env_id="CartPole-v1", num_steps=100):
    wrapper_vector_env: VectorEnv = gym.wrappers.vector.RecordEpisodeStatistics(
        make_vec(vectoriser, env_id, num_envs=num_envs),
    )
    # The per-env wrapper under SyncVectorEnv is the reference.
    vector_wrapper_env = gym.make_vec(
        id=env_id,
        num_envs=num_envs,
        vectorization_mode="sync",
        wrappers=(gym.wrappers.RecordEpisodeStatistics,),
    )

    assert wrapper_vector_env.action_space == vector_wrapper_env.action_space
    assert wrapper_vector_env.observation_space == vector_wrapper_env.observation_space
    assert (
        wrapper_vector_env.single_action_space == vector_wrapper_env.single_action_space
    )
    assert (
        wrapper_vector_env.single_observation_space
        == vector_wrapper_env.single_observation_space
    )

    assert wrapper_vector_env.num_envs == vector_wrapper_env.num_envs

    wrapper_vector_obs, wrapper_vector_info = wrapper_vector_env.reset(seed=123)
    vector_wrapper_obs, vector_wrapper_info = vector_wrapper_env.reset(seed=123)

    assert data_equivalence(wrapper_vector_obs, vector_wrapper_obs)
    assert data_equivalence(wrapper_vector_info, vector_wrapper_info)

    for _ in range(1, num_steps + 1):
        action = wrapper_vector_env.action_space.sample()
        (
            wrapper_vector_obs,
            wrapper_vector_reward,
            wrapper_vector_terminated,
            wrapper_vector_truncated,
            wrapper_vector_info,
        ) = wrapper_vector_env.step(action)
        (
            vector_wrapper_obs,
            vector_wrapper_reward,
            vector_wrapper_terminated,
            vector_wrapper_truncated,
            vector_wrapper_info,
        ) = vector_wrapper_env.step(action)

        assert data_equivalence(wrapper_vector_obs, vector_wrapper_obs)
        assert data_equivalence(wrapper_vector_reward, vector_wrapper_reward)
        assert data_equivalence(wrapper_vector_terminated, vector_wrapper_terminated)
        assert data_equivalence(wrapper_vector_truncated, vector_wrapper_truncated)

        if "episode" in wrapper_vector_info:
            wrapper_vector_time = wrapper_vector_info["episode"].pop("t")
            vector_wrapper_time = vector_wrapper_info["episode"].pop("t")
            assert wrapper_vector_time.shape == vector_wrapper_time.shape
            assert wrapper_vector_time.dtype == vector_wrapper_time.dtype

            vector_wrapper_info["episode"].pop("_l")
            vector_wrapper_info["episode"].pop("_r")
            vector_wrapper_info["episode"].pop("_t")

        assert data_equivalence(wrapper_vector_info, vector_wrapper_info)

    wrapper_vector_env.close()
    vector_wrapper_env.close()


@pytest.mark.parametrize("autoreset_mode", list(AutoresetMode))
@pytest.mark.parametrize("vectoriser", vectorisers())
def test_episode_statistics_with_autoreset_mode(vectoriser, build,
    autoreset_mode, num_envs=2, episode_length=3, num_steps=25
):
    """Check that the recorded statistics are correct for all autoreset modes using fixed-length episodes."""

    envs = gym.wrappers.vector.RecordEpisodeStatistics(
        build(
            vectoriser,
            [generic_env(behaviour="fixed_length", episode_length=episode_length) for _ in range(num_envs)],
            autoreset_mode=autoreset_mode,
        )
    )

    envs.reset(seed=123)
    for _ in range(num_steps):
        actions = envs.action_space.sample()
        _, _, terminations, truncations, infos = envs.step(actions)

        dones = np.logical_or(terminations, truncations)
        if np.any(dones):
            assert "episode" in infos
            assert np.all(infos["episode"]["r"][dones] == episode_length)
            assert np.all(infos["episode"]["l"][dones] == episode_length)

            if autoreset_mode == AutoresetMode.DISABLED:
                envs.reset(options={"reset_mask": np.copy(dones)})

    assert envs.episode_count > num_envs
    assert np.all(np.array(envs.return_queue) == episode_length)
    assert np.all(np.array(envs.length_queue) == episode_length)
    envs.close()
