"""The env side's per-step cost (issue 16): what an env pays per step, seen from inside the env."""

from boltzlabs import RLPool

SWITCHES = """
from boltzlabs.env import serve

def switches():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("voluntary_ctxt_switches"):
                return int(line.split()[1])

def reset(seed):
    return switches()

def step(action):
    return switches(), 0.0, False, {}

serve(reset=reset, step=step)
"""

BIG = """
from boltzlabs.env import serve

def reset(seed):
    return b""

def step(action):
    return bytes([action]) * (3 << 20), 0.0, False, {}  # over any socket buffer: the reply's write is short

serve(reset=reset, step=step)
"""


def test_an_env_sleeps_once_per_step(env_dir, spawn):
    """An env blocked in read() on its socket was woken twice per step: by the
    worker's request, and for nothing when the worker read the env's reply
    (the socket's write-space wake-up). It now waits in poll(POLLIN): once."""
    steps = 300
    with RLPool(env_dir(SWITCHES), 2, spawn=spawn) as pool:
        pool.reset(seed=0)
        first, *_ = pool.step([0, 0])
        for _ in range(steps):
            last, *_ = pool.step([0, 0])
    for lane in range(2):
        per_step = (last[lane] - first[lane]) / steps
        # 1 when every request finds the env asleep; ~2 before this change.
        assert per_step <= 1.25, f"env {lane} slept {per_step:.2f} times per step"


def test_a_reply_larger_than_the_socket_buffer_arrives_whole(env_dir, spawn):
    """The one-write reply path: a short write sends the rest."""
    with RLPool(env_dir(BIG), 2, spawn=spawn) as pool:
        pool.reset(seed=0)
        for action in (7, 9):
            obs, *_ = pool.step([action, action])
            assert [len(o) for o in obs] == [3 << 20, 3 << 20]
            assert all(o == bytes([action]) * (3 << 20) for o in obs)
