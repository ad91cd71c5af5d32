"""A pixel env: Atari-sized RGB frames (210 x 160 x 3 uint8, 100,800 bytes), for
benchmarks/bench_pool.py --env image.

numpy is imported at module level, but the frame is allocated in reset (after
the fork, as a real env's emulator state is), and each step does some real
drawing: the sprite (a 12 x 12 block) moves by the action, its old square is
cleared and the new one drawn. The reward is the sprite's column over the
width; an episode ends at t >= 100. Observations are the frame itself (a
numpy array of 100,800 bytes), in the env's slot when the pool has slots.
"""

import numpy as np
from gymnasium import spaces

from boltzlabs.env import serve

HEIGHT, WIDTH, SPRITE, HORIZON = 210, 160, 12, 100
state = {"t": 0, "y": 0, "x": 0, "frame": None}


def _draw(value: int) -> None:
    y, x = state["y"], state["x"]
    state["frame"][y : y + SPRITE, x : x + SPRITE] = value


def reset(seed):
    rng = np.random.default_rng(seed)
    state["frame"] = np.zeros((HEIGHT, WIDTH, 3), np.uint8)
    state["t"], state["y"], state["x"] = 0, int(rng.integers(HEIGHT - SPRITE)), int(rng.integers(WIDTH - SPRITE))
    _draw(255)
    return state["frame"]


def step(action):
    state["t"] += 1
    _draw(0)
    state["x"] = (state["x"] + (3 if action else -3)) % (WIDTH - SPRITE)
    state["y"] = (state["y"] + 1) % (HEIGHT - SPRITE)
    _draw(255)
    return state["frame"], state["x"] / WIDTH, state["t"] >= HORIZON, {}


# The declared space lets a local pool pass each frame through the env's slot (docs/wire.md).
serve(
    reset=reset,
    step=step,
    observation_space=spaces.Box(0, 255, (HEIGHT, WIDTH, 3), np.uint8),
    action_space=spaces.Discrete(2),
)
