"""An env that leaks one kind of entropy into its episodes, chosen by the
pool's param `leak`:

    none     deterministic: everything comes from the seed and the actions
    clock    info["clock"] = time.time()
    urandom  obs["x"][1] from os.urandom
    random   the reward from a random.Random() made at import, unseeded (in
             template mode every child inherits its state: only a second
             pool shows the leak)
    random_module  the reward from the random module's own generator (which
             Python reseeds in every forked child: a hard reset shows it)
    uuid     obs["id"] = uuid.uuid4()
    reset    obs["x"][1] from os.urandom in a reset without a seed (an autoreset)

Only the lane reset with seed 2 leaks, and only from step 3 on (or at an
autoreset), so a test can check that a failure names lane 2, step 3 and the
field. Episodes end at step `length` (param, default 1000). Actions are ints,
summed into obs["sum"]; `fail_at` (param) makes the lane with seed 1 raise
at that step.
"""

import os
import random
import time
import uuid

from boltzlabs.env import params, serve

PARAMS = params()
LEAK = PARAMS.get("leak", "none")
LENGTH = int(PARAMS.get("length", 1000))
FAIL_AT = PARAMS.get("fail_at")
_unseeded = random.Random()  # the leak "random": drawn from os.urandom once, at import

state = {"t": 0, "sum": 0, "seed": None, "rng": random.Random(0)}


def reset(seed=None):
    leaking = state["seed"] == 2 or seed == 2
    if seed is not None:
        state["seed"] = seed
        state["rng"] = random.Random(seed)
    state["t"] = state["sum"] = 0
    obs = {"t": 0, "sum": 0, "x": [state["rng"].random(), 0], "id": "none"}
    if LEAK == "reset" and seed is None and leaking:
        obs["x"][1] = int.from_bytes(os.urandom(4), "little")
    return obs, {}


def step(action):
    if not isinstance(action, int):
        raise TypeError(f"an action is an int, not {type(action).__name__}")
    state["t"] += 1
    state["sum"] += action
    t = state["t"]
    if FAIL_AT is not None and state["seed"] == 1 and t == FAIL_AT:
        raise RuntimeError(f"lane with seed 1 fails at step {t} on purpose")
    obs = {"t": t, "sum": state["sum"], "x": [state["rng"].random(), 0], "id": "none"}
    reward, info = float(action), {"t": t}
    if state["seed"] == 2 and t >= 3:
        if LEAK == "clock":
            info["clock"] = time.time()
        elif LEAK == "urandom":
            obs["x"][1] = int.from_bytes(os.urandom(4), "little")
        elif LEAK == "random":
            reward = _unseeded.random()
        elif LEAK == "random_module":
            reward = random.random()
        elif LEAK == "uuid":
            obs["id"] = str(uuid.uuid4())
    return obs, reward, t >= LENGTH, False, info


serve(reset=reset, step=step)
