"""A numpy env that imports scipy lazily (for benchmarks/bench_warm.py).

What it models: an env that keeps its module import light and pulls in a
second heavy package where it is first needed, as real envs do with scipy,
torch or a simulator: `scipy.special` is imported in reset (with numpy.random
for the seeded Generator), and `scipy.special.expit` runs in every step.
reset allocates a 64x64 weight matrix and a start state; each step squashes
W x + action through expit, adds a little noise, rewards -|x - 0.5|^2 and
ends at t >= 100. Observations are lists of 4 floats. Needs scipy
(`pip install 'boltzlabs[bench]'`).
"""

import numpy as np

from boltzlabs.env import serve

HORIZON = 100
SIZE = 64
state = {"t": 0, "x": None, "w": None, "rng": None, "expit": None}


def reset(seed):
    from scipy import special  # lazily, on first use: what the template never sees at import

    state["expit"] = special.expit
    state["rng"] = rng = np.random.default_rng(seed)
    state["w"] = rng.normal(0.0, 1.0 / SIZE, size=(SIZE, SIZE))
    state["x"] = rng.uniform(0.4, 0.6, size=SIZE)
    state["t"] = 0
    return state["x"][:4].tolist()


def step(action):
    state["t"] += 1
    x = state["expit"](state["w"] @ state["x"] + (float(action) - 0.5)) + state["rng"].normal(0.0, 0.01, size=SIZE)
    state["x"] = x
    d = x - 0.5
    return x[:4].tolist(), float(-np.dot(d, d)), state["t"] >= HORIZON, {}


# Actions for the warm template's probe (this env declares no action space);
# passed only to a serve() that takes them, so the env also runs on older boltzlabs.
_extra = {"warmup_actions": [0, 1]} if "warmup_actions" in serve.__code__.co_varnames else {}
serve(reset=reset, step=step, **_extra)
