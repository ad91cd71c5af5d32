"""Gymnasium's tests/vector/test_vector_wrapper.py, each test run on SyncVectorEnv and BoltzLabsVecEnv.

Ported from Gymnasium 1.4.0 (MIT License; notice in tests/gymnasium_vector/__init__.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from gymnasium.core import ObsType
from gymnasium.vector import VectorWrapper

from .conftest import vectorisers


class DummyVectorWrapper(VectorWrapper):
    """Dummy Vector wrapper that contains a counter function to logging the number of times that reset is called."""

    def __init__(self, env):
        """Initialises the wrapper with the environment creating a counter variable."""
        super().__init__(env)

        self.counter = 0

    def reset(
        self,
        *,
        seed: int | None = None,
        options: dict[str, Any] | None = None,
    ) -> tuple[ObsType, dict[str, Any]]:
        """Updates the ``counter`` each time at ``reset`` is called."""
        self.counter += 1

        return super().reset(seed=seed, options=options)


@pytest.mark.parametrize("vectoriser", vectorisers())
def test_vector_env_wrapper_inheritance(vectoriser, make_vec):
    """Test vector environment wrapper inheritance."""
    env = make_vec(vectoriser, "FrozenLake-v1")
    wrapped = DummyVectorWrapper(env)
    wrapped.reset()
    assert wrapped.counter == 1

    env.close()


@pytest.mark.parametrize("vectoriser", vectorisers())
def test_vector_env_wrapper_attributes(vectoriser, make_vec):
    """Test if `set_attr`, `call` methods for VecEnvWrapper get correctly forwarded to the vector env it is wrapping."""
    env = make_vec(vectoriser, "CartPole-v1", num_envs=3)
    wrapped = DummyVectorWrapper(make_vec(vectoriser, "CartPole-v1", num_envs=3))

    assert np.allclose(wrapped.env.call("gravity"), env.call("gravity"))
    env.set_attr("gravity", [20.0, 20.0, 20.0])
    wrapped.env.set_attr("gravity", [20.0, 20.0, 20.0])
    assert np.allclose(wrapped.env.get_attr("gravity"), env.get_attr("gravity"))

    env.close()


@pytest.mark.parametrize("vectoriser", vectorisers())
def test_vector_env_metadata(vectoriser, make_vec):
    """Test if `metadata` property for VectorWrapper correctly forwards to the vector env it is wrapping."""
    env = make_vec(vectoriser, "CartPole-v1", num_envs=3)
    wrapped = DummyVectorWrapper(make_vec(vectoriser, "CartPole-v1", num_envs=3))

    assert env.metadata == wrapped.metadata
    env.metadata = {"render_modes": ["rgb_array"]}
    assert env.metadata != wrapped.metadata

    env.close()
