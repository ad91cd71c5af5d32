"""An env whose observations come from os.urandom, not from the seed:
`boltzlabs check` must find that a hard reset does not replay its episode."""

import os

from boltzlabs.env import serve


def reset(seed):
    return {"noise": os.urandom(4).hex()}


def step(action):
    return {"noise": os.urandom(4).hex()}, 1.0, False, {}


serve(reset=reset, step=step)
