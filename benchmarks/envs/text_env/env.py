"""A text env: a program in, a test log out, for benchmarks/bench_text.py.

Each action is a str (the "program"); the observation is a "test log" of the
same length in UTF-8 bytes (pytest-like lines, made once per size and kept,
so each step's own work is one slice, not the measurement), the reward the
action's length. An episode ends at t >= 100. reset(seed, options) answers a
"prompt" of options["size"] characters (default: the latest action's length,
1 KiB before any).
"""

from boltzlabs.env import serve

HORIZON = 100
LINE = "tests/test_module.py::test_case_{:06d} PASSED                                    [ 42%]\n"
state = {"t": 0, "log": "", "size": 1024}


def log(size: int) -> str:
    """A test log of `size` characters (ASCII: as many bytes); the longest asked so far is kept."""
    if len(state["log"]) < size:
        lines = size // len(LINE.format(0)) + 1
        state["log"] = "".join(LINE.format(i) for i in range(lines))
    return state["log"][:size]


def reset(seed, options=None):
    state["t"] = 0
    return log((options or {}).get("size", state["size"])), {}


def step(action):
    state["t"] += 1
    size = state["size"] = len(action)  # an ASCII program: characters are bytes
    return log(size), float(size), state["t"] >= HORIZON, {}


serve(reset=reset, step=step)
