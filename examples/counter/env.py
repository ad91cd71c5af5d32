"""The example env from the product page: a counter that ends at t = 100."""

from boltzlabs.env import serve

state = {"t": 0}


def reset(seed):
    state["t"] = 0
    return {"t": 0}


def step(action):
    state["t"] += 1
    return {"t": state["t"]}, float(action), state["t"] >= 100, {}


serve(reset=reset, step=step)
