"""An env whose reset raises: `boltzlabs check` must report it with the traceback."""

from boltzlabs.env import serve


def reset(seed):
    raise RuntimeError("reset_crash env: reset is broken on purpose")


def step(action):
    return 0, 0.0, False, {}


serve(reset=reset, step=step)
