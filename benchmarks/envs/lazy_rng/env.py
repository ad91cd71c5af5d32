"""A numpy env that first touches numpy.random in reset (for benchmarks/bench_warm.py).

What it models: the ordinary numpy env a new user writes. numpy is imported
at module level, but the seeded Generator is made only in reset, as the
seed arrives there. numpy 2.x loads numpy.random lazily, so the first
reset imports it: in a forked env that is ~5.6 MiB of private pages per env
unless the template imported it first. Same dynamics as
benchmarks/envs/numpy_env (which makes a Generator at import and so hides
the cost): a float64 vector of 4, nudged by the action plus noise, reward
-|x|^2, ends at t >= 100. Observations are lists.
"""

import numpy as np

from boltzlabs.env import serve

HORIZON = 100
state = {"t": 0, "x": np.zeros(4), "rng": None}  # no numpy.random here: that is the point


def reset(seed):
    state["rng"] = rng = np.random.default_rng(seed)
    state["t"] = 0
    state["x"] = rng.uniform(-0.05, 0.05, size=4)
    return state["x"].tolist()


def step(action):
    state["t"] += 1
    x = 0.99 * state["x"] + 0.01 * (float(action) - 0.5) + state["rng"].normal(0.0, 0.01, size=4)
    state["x"] = x
    return x.tolist(), float(-np.dot(x, x)), state["t"] >= HORIZON, {}


# Actions for the warm template's probe (this env declares no action space);
# passed only to a serve() that takes them, so the env also runs on older boltzlabs.
_extra = {"warmup_actions": [0, 1]} if "warmup_actions" in serve.__code__.co_varnames else {}
serve(reset=reset, step=step, **_extra)
