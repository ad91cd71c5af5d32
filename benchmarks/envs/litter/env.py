"""What a code action leaves behind, on demand (benchmarks/bench_scrub.py, tests/test_scrub.py's census).

step(k): the episode's "action" writes k files in a directory of the workspace
and one in /dev/shm, and leaves a `setsid` process sleeping: what a scrub or a
hard reset must remove. `pool.call("census")`: the sandbox's processes (pids in
its namespace) and the workspace tmpfs's inodes in use beyond its empty state.
"""

import os
import subprocess

from boltzlabs.env import serve


def inodes() -> int:
    """Inodes in use in the workspace's tmpfs (/dev/shm is the same one): any depth, any mode."""
    st = os.statvfs("/dev/shm")
    return st.f_files - st.f_ffree


EMPTY = inodes()


def census() -> dict:
    return {"procs": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()), "entries": inodes() - EMPTY}


def reset(seed=None):
    return 0, {}


def step(k):
    os.makedirs("out", exist_ok=True)
    for i in range(int(k)):
        with open(f"out/{i}", "w") as f:
            f.write("x")
    with open("/dev/shm/seg", "w") as f:
        f.write("x")
    subprocess.Popen(["sleep", "3600"], start_new_session=True, stdout=subprocess.DEVNULL)
    return 0, 0.0, False, {}


serve(reset=reset, step=step, methods={"census": census})
