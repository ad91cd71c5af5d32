"""Gymnasium's tests/vector/test_vector_env_info.py: the test that builds a vector env.

Ported from Gymnasium 1.4.0 (MIT License; notice in tests/gymnasium_vector/__init__.py).
test_vector_add_info is not ported: it calls VectorEnv._add_info on a bare VectorEnv, which
BoltzLabsVecEnv inherits unchanged.
"""

from __future__ import annotations

from typing import Any, SupportsFloat

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.core import ActType, ObsType
from gymnasium.spaces import Box
from gymnasium.utils.env_checker import data_equivalence
from gymnasium.vector import SyncVectorEnv

from .conftest import HETEROGENEOUS, vectorisers


class ReturnInfoEnv(gym.Env):
    def __init__(self, infos):
        self.observation_space = Box(0, 1)
        self.action_space = Box(0, 1)

        self.infos = infos

    def reset(
        self,
        *,
        seed: int | None = None,
        options: dict[str, Any] | None = None,
    ) -> tuple[ObsType, dict[str, Any]]:
        return self.observation_space.sample(), self.infos[0]

    def step(
        self, action: ActType
    ) -> tuple[ObsType, SupportsFloat, bool, bool, dict[str, Any]]:
        return self.observation_space.sample(), 0, True, False, self.infos[1]


@pytest.mark.parametrize("vectoriser", vectorisers(boltzlabs=HETEROGENEOUS))
def test_vector_return_info(vectoriser):
    # Two sub-envs returning different infos: only the reference can be built (the boltzlabs side is skipped).
    vec_env = SyncVectorEnv(
        [
            lambda: ReturnInfoEnv([{"a": 1}, {"c": np.array([1, 2])}]),
            lambda: ReturnInfoEnv([{"a": 2, "b": 3}, {"c": np.array([3, 4])}]),
        ]
    )

    reset_expected_infos = {
        "a": np.array([1, 2]),
        "b": np.array([0, 3]),
        "_a": np.array([True, True]),
        "_b": np.array([False, True]),
    }
    step_expected_infos = {
        "c": np.array([[1, 2], [3, 4]]),
        "_c": np.array([True, True]),
    }

    _, reset_info = vec_env.reset()
    assert data_equivalence(reset_info, reset_expected_infos)
    _, _, _, _, step_info = vec_env.step(vec_env.action_space.sample())
    assert data_equivalence(step_info, step_expected_infos)
