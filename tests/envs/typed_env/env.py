"""A Gymnasium env whose values plain msgpack would change (issue 17):
a Dict observation whose keys are not sorted (with a Tuple holding another
unsorted Dict), infos of numpy scalars and tuples, tuples in its metadata,
and a method and attributes for call / get_attr / set_attr.

Imported in process by tests/test_gym_compat.py (for SyncVectorEnv) and
served in each sandbox when run as a script (RLPool(this dir, n)).
"""

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class TypedEnv(gym.Env):
    metadata = {"render_fps": 4, "sizes": (3, 4), "nested": {"pair": (1, (2, 3))}}

    def __init__(self, horizon=5):
        self.horizon = horizon
        self.gain = 1.0
        self.label = "typed"
        self.observation_space = spaces.Dict(
            [
                ("z", spaces.Box(-100.0, 100.0, (1,), np.float32)),
                ("a", spaces.Box(-100.0, 100.0, (2,), np.float32)),
                (
                    "tup",
                    spaces.Tuple(
                        [
                            spaces.Discrete(100),
                            spaces.Dict([("y", spaces.Discrete(100)), ("b", spaces.Box(0.0, 1.0, (1,)))]),
                        ]
                    ),
                ),
            ]
        )
        self.action_space = spaces.Discrete(3)
        self.t = 0
        self.x = np.zeros(1, np.float32)

    def _obs(self):
        return {
            "z": self.x * 10,
            "a": np.array([self.x[0], self.t], np.float32),
            "tup": (self.t, {"y": self.t + 1, "b": np.full(1, 0.5, np.float32)}),
        }

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        self.x = self.np_random.uniform(-1, 1, 1).astype(np.float32)
        return self._obs(), {"f32": np.float32(self.x[0]), "pair": (0, -1)}

    def step(self, action):
        self.t += 1
        self.x = (self.x + float(action) * self.gain + self.np_random.normal(0, 0.1, 1)).astype(np.float32)
        info = {
            "f32": np.float32(self.x[0] / 2),
            "i32": np.int32(self.t),
            "u8": np.uint8(self.t % 256),
            "pair": (self.t, self.t * 2),
            "flag": np.bool_(self.t % 2 == 0),
            "array": self.x.copy(),
        }
        return self._obs(), np.float32(self.gain), False, self.t >= self.horizon, info

    def scaled(self, value, *, by=2):
        """A method for call(): a tuple and a numpy scalar back."""
        return (value * by, np.float32(self.gain))


if __name__ == "__main__":
    from boltzlabs.env import params, serve

    env = TypedEnv(**params())

    def set_gain(value):
        env.gain = float(value)

    serve(
        reset=lambda seed, options=None: env.reset(seed=seed, options=options),
        step=env.step,
        observation_space=env.observation_space,
        action_space=env.action_space,
        metadata=env.metadata,
        methods={"scaled": env.scaled, "explode": lambda: 1 / 0},
        attributes={
            "gain": (lambda: env.gain, set_gain),
            "label": lambda: env.label,
            "np_random_seed": lambda: env.np_random_seed,
        },
    )
