"""The kernel's floor under a hard reset: fork, namespaces and exit, nothing else.

    python benchmarks/bench_floor.py            # 1000 children per line
    python benchmarks/bench_floor.py --n 200

A template-mode hard reset kills every env and forks a fresh sandbox for
each from the template (docs/hard-reset.md). This measures what the kernel
alone charges for that on this machine, with no boltzlabs code: n times,
this (small) Python process forks a child that makes the namespaces a
sandbox has and exits at once; the parent reaps them all. Each line gives
the wall time of the n forks and reaps, and the CPU time of the whole
machine over that and the following second (network namespaces are torn
down later, by a kernel workqueue), from /proc/stat.

Needs root, or unprivileged user namespaces for the namespace lines.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time

_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000

LINES = {
    "fork + exit": 0,
    "+ network namespace": _CLONE_NEWUSER | _CLONE_NEWNET,
    "+ user, pid, mount, net, ipc, uts": (
        _CLONE_NEWUSER | _CLONE_NEWPID | _CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWIPC | _CLONE_NEWUTS
    ),
}


def _busy_seconds() -> float:
    """CPU-seconds spent by the whole machine so far (user, nice, system, irq, softirq)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:3]) + fields[5] + fields[6]) / os.sysconf("SC_CLK_TCK")


def measure(n: int, flags: int) -> tuple[float, float]:
    """(wall seconds, machine CPU-seconds) for n children that unshare `flags` and exit."""
    unshare = ctypes.CDLL(None, use_errno=True).unshare
    busy = _busy_seconds()
    started = time.monotonic()
    pids = []
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            os._exit(1 if flags and unshare(flags) != 0 else 0)
        pids.append(pid)
    failed = sum(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0 for pid in pids)
    wall = time.monotonic() - started
    time.sleep(1.0)  # the deferred namespace teardown
    if failed:
        raise SystemExit(f"{failed} of {n} children could not unshare {flags:#x}: needs root or user namespaces")
    return wall, _busy_seconds() - busy


def main() -> None:
    """Print one line per kind of child."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1000, help="children per line (default 1000)")
    args = parser.parse_args()
    print(f"{'children':<36} {'wall (s)':>9} {'CPU-s':>7}   ({os.cpu_count()} CPUs, n={args.n})")
    for name, flags in LINES.items():
        wall, cpu = measure(args.n, flags)
        print(f"{name:<36} {wall:>9.2f} {cpu:>7.2f}")


if __name__ == "__main__":
    main()
