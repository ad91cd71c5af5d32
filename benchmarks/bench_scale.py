"""One big pool of the example env: start, reset, step, hard reset, close, and nothing left.

    python benchmarks/bench_scale.py                 # 10,000 counter envs
    python benchmarks/bench_scale.py --n 2000
    python benchmarks/bench_scale.py --n 100000 --envs-per-sandbox 100   # 1,000 sandboxes of 100 envs

A worker plans three file descriptors per env (a template-mode env holds
two: its channel and its log pipe; exec mode adds a pidfd). When this process's hard RLIMIT_NOFILE cannot
hold the whole pool in one worker and cannot be raised (no
CAP_SYS_RESOURCE), the pool is split over local worker processes: a Ray
cluster of that many nodes on this machine (`ray.cluster_utils`, every node
127.0.0.1), i.e. ClusterPool(..., cluster=address, envs_per_node=...). The line
says which. Needs `pip install 'boltzlabs[ray]'` only in that case.

Prints the wall time of each phase, env-steps/s over --steps batched steps,
memory per env and envs/GiB (pool.memory(), pool.envs_per_gb()), and after
close() the number of sandboxes (bwrap processes) and boltzlabs pool
cgroups on the host that were not there before the run, which must be 0.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psutil

from boltzlabs import RLPool
from boltzlabs.worker.config import envs_within


def _fd_room() -> int:
    """The most fds a worker started from here can have."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        return 1 << 30
    try:  # with CAP_SYS_RESOURCE the hard limit can go up to fs.nr_open
        with open("/proc/sys/fs/nr_open") as f:
            ceiling = int(f.read())
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, ceiling))
        return ceiling
    except (OSError, ValueError):
        return hard


def _leftovers() -> tuple[set, set]:
    """(bwrap pids, boltzlabs pool cgroup directories) on the host now."""
    sandboxes = {p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == "bwrap"}
    groups = set()
    for top, dirs, _ in os.walk("/sys/fs/cgroup"):
        groups.update(os.path.join(top, d) for d in dirs if d.startswith("boltzlabs-"))
    return sandboxes, groups


def main() -> None:
    """Run the phases and print one report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--source", default=str(ROOT / "examples" / "counter"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--envs-per-sandbox", type=int, default=1, help="k envs in each sandbox (RLPool(envs_per_sandbox=))"
    )
    args = parser.parse_args()
    n, k = args.n, args.envs_per_sandbox
    room = _fd_room()
    per_worker = max(1, envs_within(room)) * k  # the fds are per sandbox
    nodes = math.ceil(n / per_worker)
    kwargs: dict = {"envs_per_sandbox": k} if k > 1 else {}
    cluster = None
    if nodes > 1:
        print(
            f"the fd limit here ({room}, not raisable) holds ~{per_worker} envs per worker: "
            f"splitting {n} envs over {nodes} local workers (a {nodes}-node Ray cluster)",
            flush=True,
        )
        from bench_cluster import local_cluster  # imports ray: only when it is needed

        cluster = local_cluster(nodes)
        kwargs.update(cluster=cluster.address, envs_per_node=math.ceil(n / nodes))
    before = _leftovers()  # another job's pools are not ours to count
    try:
        available = psutil.virtual_memory().available
        started = time.monotonic()
        if cluster is not None:
            from boltzlabs.cluster import ClusterPool

            pool = ClusterPool(args.source, n, start_timeout=600, **kwargs)
        else:
            pool = RLPool(args.source, n, start_timeout=600, **kwargs)
        start = time.monotonic() - started
        print(f"{n} envs ready in {start:.1f} s ({math.ceil(n / k)} sandboxes of {k})", flush=True)
        pool.reset(seed=0)
        actions = [1] * n
        pool.step(actions)
        started = time.monotonic()
        errors = 0
        for _ in range(args.steps):
            _, _, _, infos = pool.step(actions)
            errors += sum("error" in info for info in infos)
        rate = n * args.steps / (time.monotonic() - started)
        memory = pool.memory()
        per_gb = pool.envs_per_gb()
        used = (available - psutil.virtual_memory().available) / n / 2**20
        started = time.monotonic()
        pool.reset(seed=0, hard=True)
        hard = time.monotonic() - started
        _, _, _, infos = pool.step(actions)
        errors += sum("error" in info for info in infos)
        started = time.monotonic()
        pool.close()
        close = time.monotonic() - started
    finally:
        if cluster is not None:
            import ray

            ray.shutdown()
            cluster.shutdown()
    time.sleep(2)
    sandboxes, groups = (len(now - then) for now, then in zip(_leftovers(), before))
    print(
        f"n={n} envs_per_sandbox={k} workers={nodes} start={start:.1f}s env-steps/s={rate:,.0f} lane errors={errors} "
        f"MiB/env={memory.mean / 2**20:.2f} envs/GiB={per_gb:.0f} (machine: {used:.2f} MiB/env) "
        f"hard reset={hard:.1f}s close={close:.1f}s left after close: {sandboxes} sandboxes, {groups} cgroups"
    )
    if errors or sandboxes or groups:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
