"""Stable-Baselines3's test envs (CustomGymEnv, StepEnv), for tests/test_sb3.py.

Ported from SB3's tests/test_vec_envs.py (https://github.com/DLR-RM/stable-baselines3,
MIT License, Copyright (c) 2019 Antonin Raffin). Changes: the space is named by
a param (params are JSON) and StepEnv takes its episode length from its reset
seed when max_steps is 0 (a pool's envs share their params; seeds differ per
lane). Imported in process by the tests (for SB3's DummyVecEnv) and served in
each sandbox when run as a script (RLPool(this dir, n, env=..., space=...)).
"""

from collections import OrderedDict

import gymnasium as gym
import numpy as np
from gymnasium import spaces

SPACES = OrderedDict(
    [
        ("discrete", spaces.Discrete(2)),
        ("multidiscrete", spaces.MultiDiscrete([2, 3])),
        ("multibinary", spaces.MultiBinary(3)),
        ("continuous", spaces.Box(low=np.zeros(2, dtype=np.float32), high=np.ones(2, dtype=np.float32))),
    ]
)


class _UnorderedDictSpace(spaces.Dict):
    """Like DictSpace, but returns an unordered dict when sampling."""

    def sample(self, *args, **kwargs):
        return dict(super().sample(*args, **kwargs))


def make_space(name: str):
    """The space a test names: one of SPACES, or a composite / image space."""
    if name in SPACES:
        return SPACES[name]
    image_shape = [12, 8, 3]
    return {
        "box2": lambda: spaces.Box(low=np.zeros(2), high=np.ones(2)),
        "dict": lambda: spaces.Dict(SPACES),
        "unordered_dict": lambda: _UnorderedDictSpace(SPACES),
        "tuple": lambda: spaces.Tuple(tuple(SPACES.values())),
        "image": lambda: spaces.Box(low=np.zeros(image_shape), high=np.ones(image_shape) * 255, dtype=np.uint8),
        "image_transposed": lambda: spaces.Box(
            low=np.zeros(image_shape[::-1]), high=np.ones(image_shape[::-1]) * 255, dtype=np.uint8
        ),
    }[name]()


class CustomGymEnv(gym.Env):
    def __init__(self, space, render_mode: str = "rgb_array"):
        """
        Custom gym environment for testing purposes
        """
        self.action_space = space
        self.observation_space = space
        self.current_step = 0
        self.ep_length = 4
        self.render_mode = render_mode
        self.current_options = None

    def reset(self, *, seed=None, options=None):
        if seed is not None:
            self.seed(seed)
        self.current_step = 0
        self.current_options = options
        self._choose_next_state()
        return self.state, {}

    def step(self, action):
        reward = float(np.random.rand())
        self._choose_next_state()
        self.current_step += 1
        terminated = False
        truncated = self.current_step >= self.ep_length
        return self.state, reward, terminated, truncated, {}

    def _choose_next_state(self):
        self.state = self.observation_space.sample()

    def render(self):
        if self.render_mode == "rgb_array":
            return np.zeros((4, 4, 3))

    def seed(self, seed=None):
        if seed is not None:
            np.random.seed(seed)
            self.observation_space.seed(seed)

    @staticmethod
    def custom_method(dim_0=1, dim_1=1):
        """
        Dummy method to test call to custom method
        from VecEnv

        :param dim_0: (int)
        :param dim_1: (int)
        :return: (np.ndarray)
        """
        return np.ones((dim_0, dim_1))


class StepEnv(gym.Env):
    def __init__(self, max_steps):
        """Gym environment for testing that terminal observation is inserted
        correctly."""
        self.action_space = spaces.Discrete(2)
        self.observation_space = spaces.Box(np.array([0]), np.array([999]), dtype="int")
        self.max_steps = max_steps
        self.from_seed = max_steps == 0  # boltzlabs: the episode length is the reset's seed
        self.current_step = 0

    def reset(self, *, seed=None, options=None):
        if self.from_seed and seed is not None:
            self.max_steps = seed
        self.current_step = 0
        return np.array([self.current_step], dtype="int"), {}

    def step(self, action):
        prev_step = self.current_step
        self.current_step += 1
        terminated = False
        truncated = self.current_step >= self.max_steps
        return np.array([prev_step], dtype="int"), 0.0, terminated, truncated, {}


def make_env(env: str = "custom", space: str = "box2", max_steps: int = 0, render_mode: str = "rgb_array"):
    """One env as a test names it (the same call in process and in a sandbox)."""
    if env == "step":
        return StepEnv(max_steps)
    return CustomGymEnv(make_space(space), render_mode=render_mode)


if __name__ == "__main__":
    from boltzlabs.env import params, serve

    env = make_env(**params())
    # target=: pool.call / get_attr / set_attr reach this env as SB3's DummyVecEnv reaches its own.
    serve(
        reset=lambda seed, options=None: env.reset(seed=seed, options=options),
        step=env.step,
        observation_space=env.observation_space,
        action_space=env.action_space,
        metadata=env.metadata,
        render=env.render,
        render_mode=getattr(env, "render_mode", None),
        target=env,
    )
