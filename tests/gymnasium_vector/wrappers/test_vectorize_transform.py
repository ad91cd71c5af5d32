"""Gymnasium's tests/wrappers/vector/test_vectorize_transform.py, each test run on SyncVectorEnv and BoltzLabsVecEnv.

Ported from Gymnasium 1.4.0 (MIT License; notice in tests/gymnasium_vector/__init__.py).
"""

from functools import partial

import gymnasium as gym
import numpy as np
import pytest

from ..conftest import PER_ENV_WRAPPERS, generic_env, vectorisers


@pytest.mark.parametrize("vectoriser", vectorisers())
def test_vectorize_box_to_dict_action(vectoriser, build):
    def func(x):
        return x["key"]

    envs = build(vectoriser, [generic_env() for _ in range(2)])
    envs = gym.wrappers.vector.VectorizeTransformAction(
        env=envs,
        wrapper=gym.wrappers.TransformAction,
        func=func,
        action_space=gym.spaces.Dict(
            {"key": gym.spaces.Box(low=0.0, high=1.0, shape=(1,), dtype=np.float32)}
        ),
    )

    obs, _ = envs.reset()
    obs, _, _, _, _ = envs.step(envs.action_space.sample())
    envs.close()


@pytest.mark.parametrize("vectoriser", vectorisers(boltzlabs=PER_ENV_WRAPPERS, names=("async", "boltzlabs")))
def test_vectorize_dict_to_box_obs(vectoriser, make_vec):
    wrappers = [
        partial(
            gym.wrappers.TransformObservation,
            func=lambda x: {"key1": x[0:1], "key2": x[1:]},
            observation_space=gym.spaces.Dict(
                {
                    "key1": gym.spaces.Box(low=-np.inf, high=np.inf, shape=(1,)),
                    "key2": gym.spaces.Box(low=-np.inf, high=np.inf, shape=(3,)),
                }
            ),
        )
    ]
    envs = gym.make_vec(
        "CartPole-v1",
        num_envs=2,
        vectorization_mode=gym.VectorizeMode.ASYNC if vectoriser == "async" else gym.VectorizeMode.SYNC,
        wrappers=wrappers,
    )
    obs, _ = envs.reset()
    assert obs in envs.observation_space
    obs, _, _, _, _ = envs.step(envs.action_space.sample())
    assert obs in envs.observation_space
    envs.close()
