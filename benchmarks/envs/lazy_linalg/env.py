"""A numpy env that solves a linear system every step (for benchmarks/bench_warm.py).

What it models: a physics-style env with an implicit integrator, the usual
numpy user: numpy at module level, a seeded Generator made in reset (first
touch of numpy.random) and `np.linalg.solve` in step (first touch of
numpy.linalg, also loaded lazily by numpy 2.x). reset draws a well
conditioned 16x16 system matrix A and a start state; each step solves
A x' = x + action * b, adds a little noise, rewards -|x'|^2 and ends at
t >= 100. Observations are lists of 4 floats (the first entries of x).
"""

import numpy as np

from boltzlabs.env import serve

HORIZON = 100
SIZE = 16
state = {"t": 0, "x": None, "a": None, "b": None, "rng": None}


def reset(seed):
    state["rng"] = rng = np.random.default_rng(seed)
    # Diagonally dominant: always solvable, and the state stays bounded.
    state["a"] = np.eye(SIZE) * 1.05 + rng.uniform(-0.02, 0.02, size=(SIZE, SIZE))
    state["b"] = rng.uniform(-0.1, 0.1, size=SIZE)
    state["x"] = rng.uniform(-0.05, 0.05, size=SIZE)
    state["t"] = 0
    return state["x"][:4].tolist()


def step(action):
    state["t"] += 1
    rhs = state["x"] + (float(action) - 0.5) * state["b"]
    x = np.linalg.solve(state["a"], rhs) + state["rng"].normal(0.0, 0.01, size=SIZE)
    state["x"] = x
    return x[:4].tolist(), float(-np.dot(x, x)), state["t"] >= HORIZON, {}


# Actions for the warm template's probe (this env declares no action space);
# passed only to a serve() that takes them, so the env also runs on older boltzlabs.
_extra = {"warmup_actions": [0, 1]} if "warmup_actions" in serve.__code__.co_varnames else {}
serve(reset=reset, step=step, **_extra)
