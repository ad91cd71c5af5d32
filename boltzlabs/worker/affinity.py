"""Where a pool's processes run: RLPool(cpus=), each shard's slice of the CPUs, and
RLPool(pin_sandboxes=True), each sandbox on one CPU of its worker's.

    client: RLPool(cpus=..., workers=k) --OPEN {"affinity": {"cpus": [...] | None, "shard": s, "of": k}}-->
    worker: parse() --> slice s of k of (the CPUs it may use, or those asked of them) -->
        pin(): sched_setaffinity of every thread of the worker, before its guardian, template
        or any sandbox exists, so each of them and every env forked or respawned later inherits it
    pin_sandboxes=True adds "spread": true: sandbox i (an env's, or a group's) is pinned at its
        handshake to the (i mod C)-th of the C CPUs its worker runs on (place()), respawns too

Spreading keeps a sandbox's envs, and their caches, on one core: a grouped pool whose
sandboxes each take a core steps faster (2 groups on this 2-core machine: 1.02x-1.17x
its kernel-placed rate on HalfCheetah-v5 and LunarLander-v3, docs/performance.md). It is asked for, never a default:
two pools on one node would both put their first sandboxes on the first CPUs.

A sharded pool's envs on shared cores cost more CPU per env-step than under
one worker (docs/sharding.md measures it): shard i on the i-th slice keeps
each shard's envs, template and worker on cores of their own. The slice is
cut from the worker's own os.sched_getaffinity, so a remote or Ray worker
pins within its node's CPUs, and a cpuset the worker runs in is respected.

Placement, not a limit: an env may widen its own affinity again within the
CPUs its cgroup's cpuset allows (sched_setaffinity is not filtered, as
OpenMP runtimes call it), which costs only that env's own pace.

The OPEN request is untrusted when the client is remote: everything here is
bounded and checked before anything is applied.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["Affinity", "parse", "pin", "place", "slice_of", "MAX_CPUS"]

# CPU ids and the length of a list of them (the kernel's CONFIG_NR_CPUS tops out at 8192);
# and the most shards a pool is split into (a shard holds at least one env).
MAX_CPUS = 1 << 13
_MAX_SHARDS = 1 << 20


@dataclass(frozen=True)
class Affinity:
    """What OPEN asks: shard `shard` of `of`, within `cpus` (None: the CPUs the worker may use)."""

    cpus: tuple[int, ...] | None
    shard: int
    of: int
    spread: bool = False  # RLPool(pin_sandboxes=True): each sandbox on one CPU of the worker's (place())


def _whole(value, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < high:
        raise ValueError(f"affinity: {name} must be a whole number in [{low}, {high}), not {value!r:.40}")
    return value


def parse(asked) -> Affinity | None:
    """OPEN's "affinity" (None: the pool is not pinned), or ValueError saying what is wrong."""
    if asked is None:
        return None
    if not isinstance(asked, dict) or not {"cpus", "shard", "of"} <= set(asked) <= {"cpus", "shard", "of", "spread"}:
        raise ValueError("affinity must be a map of exactly cpus, shard and of, and optionally spread")
    spread = asked.get("spread", False)
    if not isinstance(spread, bool):
        raise ValueError(f"affinity: spread must be true or false, not {spread!r:.40}")
    of = _whole(asked["of"], "of", 1, _MAX_SHARDS + 1)
    shard = _whole(asked["shard"], "shard", 0, of)
    cpus = asked["cpus"]
    if cpus is not None:
        if not isinstance(cpus, list) or not 1 <= len(cpus) <= MAX_CPUS:
            raise ValueError(f"affinity: cpus must be a list of 1 to {MAX_CPUS} CPU ids, or None")
        cpus = tuple(sorted({_whole(c, "a CPU id", 0, MAX_CPUS) for c in cpus}))
    return Affinity(cpus, shard, of, spread)


def slice_of(cpus: list[int], shard: int, of: int) -> list[int]:
    """The shard-th of `of` contiguous equal slices of `cpus` (sorted), or all of `cpus` when
    they do not divide evenly: the lanes split evenly, so a shard with fewer CPUs than
    another would hold every step back (3 shards on 2 CPUs: one CPU's envs twice the other's)."""
    if len(cpus) % of:
        return list(cpus)
    size = len(cpus) // of
    return cpus[shard * size : (shard + 1) * size]


def pin(affinity: Affinity | None) -> list[int] | None:
    """Pin this process, every thread of it, to its slice; the CPUs it now runs on, or None
    when nothing is narrowed (not asked, or the slice is every CPU it may use). ValueError
    names asked CPUs this process may not use."""
    if affinity is None:
        return None
    allowed = sorted(os.sched_getaffinity(0))
    if affinity.cpus is None:
        base = allowed
    else:
        outside = sorted(set(affinity.cpus) - set(allowed))
        if outside:
            raise ValueError(
                f"cpus={list(affinity.cpus)[:16]}: CPU {outside[0]} is not one this worker may use "
                f"(it may use {_ranges(allowed)}); give CPUs of the machine that runs the pool's workers"
            )
        base = list(affinity.cpus)
    cpus = slice_of(base, affinity.shard, affinity.of)
    if cpus == allowed:
        return None
    # sched_setaffinity(0) sets the calling thread's only: each of the worker's threads is pinned,
    # so whichever thread forks, its child is.
    _pin_threads("self", cpus)
    return sorted(os.sched_getaffinity(0))


def place(pid: int, cpu: int) -> None:
    """Pin every thread of process `pid` (a sandbox's env process, at its handshake) to `cpu`.
    A process that has just ended is left (its death is reported on its lane); OSError for any
    other failure."""
    try:
        _pin_threads(str(pid), (cpu,))
    except FileNotFoundError:
        pass


def _pin_threads(process: str, cpus) -> None:
    """sched_setaffinity of every thread of /proc/`process` ("self", or a pid); a thread started
    later inherits its creator's, and one that has just ended is skipped."""
    for task in os.listdir(f"/proc/{process}/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except ProcessLookupError:
            pass


def _ranges(cpus: list[int]) -> str:
    """0-3,8,10-11: as /sys/devices/system/cpu/online writes a CPU list."""
    out, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            out.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(out)
