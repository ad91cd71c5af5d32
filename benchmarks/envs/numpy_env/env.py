"""A small env that imports numpy at module level (for benchmarks/bench_spawn.py).

State: a float64 vector of 4. reset(seed) seeds a numpy Generator and draws
the start state; step(action) nudges the state by the action plus a little
noise, rewards -|state|^2, and ends at t >= 100. Observations are lists.
"""

import numpy as np

from boltzlabs.env import serve

HORIZON = 100
state = {"t": 0, "x": np.zeros(4), "rng": np.random.default_rng(0)}


def reset(seed):
    state["rng"] = rng = np.random.default_rng(seed)
    state["t"] = 0
    state["x"] = rng.uniform(-0.05, 0.05, size=4)
    return state["x"].tolist()


def step(action):
    state["t"] += 1
    x = state["x"]
    x = 0.99 * x + 0.01 * (float(action) - 0.5) + state["rng"].normal(0.0, 0.01, size=4)
    state["x"] = x
    reward = float(-np.dot(x, x))
    return x.tolist(), reward, state["t"] >= HORIZON, {}


serve(reset=reset, step=step)
