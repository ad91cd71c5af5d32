"""Gymnasium's tests/wrappers/vector/test_dict_info_to_list.py, the test that builds a vector env.

Ported from Gymnasium 1.4.0 (MIT License; notice in tests/gymnasium_vector/__init__.py).
test_update_info and test_errors are not ported: they feed DictInfoToList a bare VectorEnv
whose reset returns the infos they give it.
"""

import gymnasium as gym
import pytest
from gymnasium.wrappers.vector import DictInfoToList

from ..conftest import vectorisers


@pytest.mark.parametrize("vectoriser", vectorisers())
def test_usage_in_vector_env(vectoriser, make_vec, env_id: str = "CartPole-v1", num_envs: int = 3):
    env = gym.make(env_id, disable_env_checker=True)
    vector_env = make_vec(vectoriser, env_id, num_envs=num_envs)

    DictInfoToList(vector_env)

    with pytest.raises(TypeError):
        DictInfoToList(env)
