"""Gymnasium's testing envs as one boltzlabs env dir.

Adapted from Gymnasium 1.4.0's tests/testing_env.py (GenericTestEnv), tests/vector/testing_utils.py
and the reset/step functions written inline in tests/vector/ and tests/wrappers/vector/.
Copyright (c) 2016 OpenAI, (c) 2022 Farama Foundation; MIT License (the notice is in
tests/gymnasium_vector/__init__.py).

Upstream builds each env from a Python callable with its reset and step functions bound in;
a sandbox can only be told a source and JSON params, so every variant the ported tests need
has a name here: `make(obs=..., act=..., behaviour=..., **kwargs)` builds it. The tests import
this module in process for SyncVectorEnv, and RLPool runs it as a script in every sandbox with
the same params, so both sides run the same code.
"""

import functools
import importlib.util
import pathlib

import numpy as np

import gymnasium as gym
from gymnasium import spaces

# The spaces the ported tests name (upstream passes Space objects to GenericTestEnv).
SPACES = {
    "box01": lambda: spaces.Box(0, 1, (1,)),
    "discrete4": lambda: spaces.Discrete(4),
    "discrete5": lambda: spaces.Discrete(5),
    "box3": lambda: spaces.Box(low=np.array([0, -10, -5], dtype=np.float32),
                               high=np.array([10, -5, 10], dtype=np.float32)),
    "dict_ab": lambda: spaces.Dict({"a": spaces.Box(0, 1), "b": spaces.Discrete(5)}),
    "box_f16": lambda: spaces.Box(low=-1.0, high=1.0, shape=(3,), dtype=np.float16),
    "slow": lambda: spaces.Box(low=0, high=255, shape=(64, 64, 3), dtype=np.uint8),
    "slow_action": lambda: spaces.Box(low=0.0, high=1.0, shape=(), dtype=np.float32),
    "custom": lambda: CustomSpace(),
}


class CustomSpace(gym.Space):
    """tests/vector/testing_utils.py's minimal custom space."""

    def sample(self):
        """An int in [0, 10)."""
        return self.np_random.integers(0, 10, ())

    def contains(self, x):
        """Whether x is in [0, 10]."""
        return 0 <= x <= 10

    def __eq__(self, other):
        return isinstance(other, CustomSpace)


@functools.cache
def testing_spaces():
    """testing_spaces.py beside this file (Gymnasium's TESTING_SPACES), loaded by path on first use, so
    neither the sandbox nor the tests' process needs this directory on sys.path."""
    path = pathlib.Path(__file__).with_name("testing_spaces.py")
    spec = importlib.util.spec_from_file_location("gymnasium_vector_testing_spaces", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def space(name: str) -> gym.Space:
    """The space a name stands for: a key of SPACES or "testing:<index>" into TESTING_SPACES."""
    if name.startswith("testing:"):
        return testing_spaces().TESTING_SPACES[int(name.split(":", 1)[1])]
    return SPACES[name]()


class GenericTestEnv(gym.Env):
    """Gymnasium's GenericTestEnv, its reset and step picked by name (`behaviour`)."""

    def __init__(self, obs="box01", act="box01", behaviour="basic", max_count=None, episode_length=3,
                 slow_reset=0.0, render_mode=None):
        self.observation_space = space(obs)
        self.action_space = space(act)
        self.behaviour = behaviour
        self.max_count = max_count
        self.episode_length = episode_length
        self.slow_reset = slow_reset
        self.metadata = {"render_modes": []}
        self.render_mode = render_mode
        self._reset, self._step = BEHAVIOURS[behaviour]

    def reset(self, *, seed=None, options=None):
        """The named behaviour's reset."""
        return self._reset(self, seed=seed, options=options)

    def step(self, action):
        """The named behaviour's step."""
        return self._step(self, action)

    def render(self):
        """basic_render_func: nothing."""
        return None


# -- tests/testing_env.py -----------------------------------------------------------------------------

def basic_reset(self, seed=None, options=None):
    gym.Env.reset(self, seed=seed)
    self.observation_space.seed(self.np_random_seed)
    return self.observation_space.sample(), {"options": options}


def basic_step(self, action):
    return self.observation_space.sample(), 0, False, False, {}


# -- tests/vector/test_vector_env.py ------------------------------------------------------------------

def debug_step(self, action):
    assert action in self.action_space
    return self.observation_space.sample(), 0, False, False, {}


def final_obs_reset(self, seed=None, options=None):
    return 0, {"reset": True}


def final_obs_step(self, action):
    return action if action < 3 else 0, 0, action >= 3, False, {"action": action}


# -- tests/vector/test_autoreset_mode.py --------------------------------------------------------------

def count_reset(self, seed=None, options=None):
    gym.Env.reset(self, seed=seed)
    self.count = seed if seed is not None else 0
    return self.count, {}


def count_step(self, action):
    self.count += 1
    return self.count, action, self.count == self.max_count, False, {}


def count_reset_obs(self, seed=None, options=None):
    gym.Env.reset(self, seed=seed)
    self.count = seed if seed is not None else 0
    return self.observation_space.sample(), {}


def count_step_obs(self, action):
    self.count += 1
    return self.observation_space.sample(), action, self.count == self.max_count, False, {}


# -- tests/wrappers/vector: test_record_episode_statistics.py, test_normalize_reward.py --------------

def fixed_length_reset(self, seed=None, options=None):
    self.timestep = 0
    return self.observation_space.sample(), {}


def fixed_length_step(self, action):
    self.timestep += 1
    return self.observation_space.sample(), 1.0, self.timestep >= self.episode_length, False, {}


def ten_step_reset(self, seed=None, options=None):
    self.step_id = 0
    return self.observation_space.sample(), {}


def ten_step_step(self, action):
    self.step_id += 1
    terminated = self.step_id == 10
    return self.observation_space.sample(), float(terminated), terminated, False, {}


# -- tests/vector/testing_utils.py: CustomSpaceEnv (its reset/step over a custom space) ---------------

def custom_reset(self, seed=None, options=None):
    gym.Env.reset(self, seed=seed)
    return "reset", {}


def custom_step(self, action):
    return f"step({action:s})", 0.0, False, False, {}


# -- tests/vector/testing_utils.py: SlowEnv; test_async_vector_env.py: raise_error_reset/step --------

def slow_reset(self, seed=None, options=None):
    import time

    gym.Env.reset(self, seed=seed)
    if self.slow_reset > 0:
        time.sleep(self.slow_reset)
    return self.observation_space.sample(), {}


def slow_step(self, action):
    import time

    time.sleep(action)
    return self.observation_space.sample(), 0.0, False, False, {}


def raise_error_reset(self, seed=None, options=None):
    gym.Env.reset(self, seed=seed, options=options)
    if seed == 1:
        raise ValueError("Error in reset")
    return self.observation_space.sample(), {}


def raise_error_step(self, action):
    if action >= 1:
        raise ValueError(f"Error in step with {action}")
    return self.observation_space.sample(), 0, False, False, {}


BEHAVIOURS = {
    "basic": (basic_reset, basic_step),
    "debug": (basic_reset, debug_step),
    "final_obs": (final_obs_reset, final_obs_step),
    "count": (count_reset, count_step),
    "count_obs": (count_reset_obs, count_step_obs),
    "fixed_length": (fixed_length_reset, fixed_length_step),
    "ten_step": (ten_step_reset, ten_step_step),
    "custom": (custom_reset, custom_step),
    "slow": (slow_reset, slow_step),
    "raise_error": (raise_error_reset, raise_error_step),
}


def make(**kwargs) -> GenericTestEnv:
    """The env these params describe (the same in process and in the sandbox)."""
    return GenericTestEnv(**kwargs)


if __name__ == "__main__":
    from boltzlabs.env import params, serve

    env = make(**params())
    serve(reset=lambda seed, options=None: env.reset(seed=seed, options=options), step=env.step,
          observation_space=env.observation_space, action_space=env.action_space,
          metadata=env.metadata, render=env.render, render_mode=env.render_mode, target=env)
