"""A Gymnasium env with a Dict observation, a MultiDiscrete action, array
infos, both terminations and truncations, and an rgb_array render.

Imported in process by the parity tests (for gymnasium.vector.SyncVectorEnv)
and served in each sandbox when run as a script (RLPool(this dir, n)).
"""

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class DictEnv(gym.Env):
    metadata = {"render_modes": ["rgb_array"], "render_fps": 4}

    def __init__(self, render_mode=None, horizon=12):
        self.render_mode = render_mode
        self.horizon = horizon
        self.observation_space = spaces.Dict(
            {
                "pos": spaces.Box(-10.0, 10.0, (2,), np.float32),
                "t": spaces.Discrete(1000),
                "flags": spaces.MultiBinary(3),
                "grid": spaces.Box(0, 255, (3, 4), np.uint8),
            }
        )
        self.action_space = spaces.MultiDiscrete([3, 2])
        self.pos = np.zeros(2, np.float32)
        self.t = 0

    def _obs(self):
        flags = np.array([self.pos[0] > 0, self.pos[1] > 0, self.t % 2 == 0], dtype=np.int8)
        grid = np.full((3, 4), self.t % 256, dtype=np.uint8)
        return {"pos": self.pos.copy(), "t": self.t, "flags": flags, "grid": grid}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.pos = self.np_random.uniform(-1, 1, 2).astype(np.float32)
        self.t = 0
        info = {"start": float(self.pos[0])}
        if options and "tag" in options:
            info["tag"] = options["tag"]
        return self._obs(), info

    def step(self, action):
        move = (int(action[0]) - 1) * 0.6 * (1 if int(action[1]) else -1)
        noise = self.np_random.normal(0, 0.3, 2)
        self.pos = np.clip(self.pos + move + noise, -10, 10).astype(np.float32)
        self.t += 1
        dist = float(np.linalg.norm(self.pos))
        terminated = dist > 2.5
        truncated = self.t >= self.horizon
        info = {"dist": dist, "vec": self.pos.astype(np.float64) * 2}
        return self._obs(), -dist, terminated, truncated, info

    def render(self):
        if self.render_mode != "rgb_array":
            return None
        return np.full((8, 8, 3), self.t % 256, dtype=np.uint8)


if __name__ == "__main__":
    from boltzlabs.env import params, serve

    env = DictEnv(**params())
    serve(
        reset=lambda seed, options=None: env.reset(seed=seed, options=options),
        step=env.step,
        observation_space=env.observation_space,
        action_space=env.action_space,
        metadata=env.metadata,
        render=env.render,
        render_mode=env.render_mode,
    )
