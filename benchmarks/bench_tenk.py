"""Thousands of counter envs on one machine: what each costs, the kernel's share included.

    python benchmarks/bench_tenk.py --n 1000 5000 10000      # each n in turn
    python benchmarks/bench_tenk.py --n 1000 --memory-limit 256M   # per-env memory cgroups

n envs run as ceil(n / --per-pool) pools in this process (one worker each:
a worker's fd table holds ~6,500 envs here), started one after another, or
with --sharded as one pool over that many workers (RLPool(..., workers=k)).
For each n it prints: the time until every env is ready, env-steps/s over
--steps batched steps of all pools, the time to hard-reset every env, and
memory per env three ways:

  cgroup   pool.memory(): the pools' cgroup accounting (kernel memory
           charged to them included), per env;
  kernel   what /proc/meminfo's kernel lines (Slab, KernelStack,
           PageTables, Percpu, VmallocUsed) grew by while the pools were
           up, per env: most of it is charged to no cgroup;
  machine  how much MemAvailable fell, per env.

It also prints the slab caches that grew most, how many memory cgroups
(/proc/cgroups) and distinct superblocks (the devices in every env's
mountinfo) the pools added, and after close() what is left: processes
that were this process's descendants (workers, sandboxes), their cgroups, mounts seen by this process and this
process's fds against before, all of which must be 0. Memory figures
include whatever other jobs on the machine did meanwhile: read them on a
quiet machine, and compare n against n within one run.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from boltzlabs import RLPool  # noqa: E402

KERNEL = ("Slab", "KernelStack", "PageTables", "Percpu", "VmallocUsed")
MEMINFO = KERNEL + ("SReclaimable", "SUnreclaim", "MemAvailable")


def meminfo() -> dict:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        if key in MEMINFO:
            out[key] = int(value.split()[0]) * 1024
    return out


def slabs() -> dict:
    """{cache: bytes of its slabs}"""
    out = {}
    for line in Path("/proc/slabinfo").read_text().splitlines()[2:]:
        f = line.split()
        # name active num objsize objperslab pagesperslab : tunables ... : slabdata active_slabs num_slabs
        out[f[0]] = int(f[14]) * int(f[5]) * 4096
    return out


def memcgs() -> int:
    for line in Path("/proc/cgroups").read_text().splitlines():
        f = line.split()
        if f[0] == "memory":
            return int(f[2])
    return 0


def leftovers(ours=()) -> dict:
    """What of this process's pools is on the host: `ours`, the processes that
    were its descendants (workers, templates, envs), those still running; the
    cgroups named after those workers; this process's mounts and fds."""
    alive = set()
    for process in ours:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.add(process.pid)
        except psutil.Error:
            pass
    workers = {f"boltzlabs-{p.pid}-" for p in ours}
    groups = set()
    for top, dirs, _ in os.walk("/sys/fs/cgroup"):
        groups.update(
            os.path.join(top, d) for d in dirs if d.startswith("boltzlabs-") and d[: d.rindex("-") + 1] in workers
        )
    return {
        "processes": alive,
        "cgroups": groups,
        "mounts": set(Path("/proc/self/mountinfo").read_text().splitlines()),
        "fds": set(os.listdir("/proc/self/fd")),
    }


def superblocks(pools) -> tuple[int, dict]:
    """(distinct superblocks in the envs' mount tables, {fstype: count})."""
    seen: dict = {}
    host = os.readlink("/proc/self/ns/mnt")
    for pool in pools:
        for pid in pool.pids():
            try:  # a lane's pid is its env's process (template mode) or its bwrap (exec: the host's mounts)
                if os.readlink(f"/proc/{pid}/ns/mnt") == host:
                    continue
                text = Path(f"/proc/{pid}/mountinfo").read_text()
            except OSError:
                continue
            for line in text.splitlines():
                left, right = line.split(" - ", 1)
                seen[left.split(" ")[2]] = right.split(" ", 1)[0]
    kinds: dict = {}
    for fstype in seen.values():
        kinds[fstype] = kinds.get(fstype, 0) + 1
    return len(seen), kinds


def run(n: int, args) -> None:
    per_pool = min(n, args.per_pool)
    sizes = [per_pool] * (n // per_pool) + ([n % per_pool] if n % per_pool else [])
    before = leftovers()
    mem0, slab0, cg0 = meminfo(), slabs(), memcgs()
    kwargs = {"start_timeout": 600}
    if args.memory_limit:
        kwargs["memory_limit"] = args.memory_limit
    pools = []
    try:
        started = time.monotonic()
        if args.sharded:  # one pool, a worker per --per-pool envs
            sizes = [n]
            pools.append(RLPool(args.source, n, workers=math.ceil(n / per_pool), **kwargs))
        else:
            for size in sizes:
                pools.append(RLPool(args.source, size, **kwargs))
        for pool in pools:
            pool.reset(seed=0)
        ready = time.monotonic() - started
        for pool in pools:
            pool.step([1] * len(pool.pids()))
        errors = 0
        started = time.monotonic()
        for _ in range(args.steps):
            for pool in pools:
                _, _, _, infos = pool.step([1] * len(pool.pids()))
                errors += sum("error" in info for info in infos)
        rate = n * args.steps / (time.monotonic() - started)
        time.sleep(1)
        mem1, slab1, cg1 = meminfo(), slabs(), memcgs()
        cgroup = sum(sum(p.memory().per_env) + p.memory().shared for p in pools) / n
        sbs, kinds = superblocks(pools)
        started = time.monotonic()
        for pool in pools:
            if args.hard_reset:
                pool.reset(seed=0, hard=True)
        hard = time.monotonic() - started
        for pool in pools:
            _, _, _, infos = pool.step([1] * len(pool.pids()))
            errors += sum("error" in info for info in infos)
    finally:
        ours = psutil.Process().children(recursive=True)
        started = time.monotonic()
        for pool in pools:
            pool.close()
        close = time.monotonic() - started
    time.sleep(2)
    after = leftovers(ours)
    left = {k: len(after[k] - before[k]) for k in before}
    kernel = sum(mem1[k] - mem0[k] for k in KERNEL) / n
    machine = (mem0["MemAvailable"] - mem1["MemAvailable"]) / n
    mib = 2**20
    print(
        f"n={n} pools={len(pools)}{' sharded' if args.sharded else ''} memory_limit={args.memory_limit or 'none'} ready={ready:.1f}s "
        f"env-steps/s={rate:,.0f} hard-reset={f'{hard:.1f}s' if args.hard_reset else 'skipped'} close={close:.1f}s lane-errors={errors}"
    )
    print(
        f"  MiB/env: cgroup {cgroup / mib:.3f}  kernel {kernel / mib:.3f} "
        f"(SUnreclaim {(mem1['SUnreclaim'] - mem0['SUnreclaim']) / n / mib:.3f}, "
        f"SReclaimable {(mem1['SReclaimable'] - mem0['SReclaimable']) / n / mib:.3f}, "
        + ", ".join(f"{k} {(mem1[k] - mem0[k]) / n / mib:.3f}" for k in KERNEL[1:])
        + f")  machine {machine / mib:.3f}"
    )
    grown = sorted(((slab1.get(k, 0) - slab0.get(k, 0), k) for k in slab1), reverse=True)[:8]
    print("  slab growth, KiB/env: " + ", ".join(f"{k} {d / n / 1024:.1f}" for d, k in grown))
    print(
        f"  memory cgroups +{cg1 - cg0}, superblocks in the envs' mount tables {sbs} "
        f"({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))})"
    )
    print(
        f"  left after close: {left['processes']} processes, {left['cgroups']} cgroups, "
        f"{left['mounts']} mounts, {left['fds']} fds",
        flush=True,
    )
    if errors or any(left.values()):
        raise SystemExit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[1000, 5000, 10_000])
    parser.add_argument("--per-pool", type=int, default=5000)
    parser.add_argument("--source", default=str(ROOT / "examples" / "counter"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--sharded", action="store_true", help="one pool, RLPool(..., workers=ceil(n / per-pool)), not several pools"
    )
    parser.add_argument(
        "--no-hard-reset",
        dest="hard_reset",
        action="store_false",
        help="skip the hard reset of every env (memory figures only)",
    )
    parser.add_argument("--memory-limit", default=None, help='a per-env memory limit ("256M"): per-env memory cgroups')
    args = parser.parse_args()
    for n in args.n:
        run(n, args)
        time.sleep(3)


if __name__ == "__main__":
    main()
