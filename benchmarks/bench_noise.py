"""What a host's own kernel threads cost a pool's step, one worker against k pinned and unpinned.

    python benchmarks/bench_noise.py                                  # 1000 HalfCheetah-v5 envs, workers 1 and 2
    python benchmarks/bench_noise.py --env counter --n 512 --steps 300
    python benchmarks/bench_noise.py --thread ksoftirqd               # another host thread

A synchronous step lasts as long as its slowest shard. On a shard pinned to
a slice of one CPU (RLPool's default for k > 1 on 2 CPUs), CPU time a host
kernel thread takes on that CPU is time the shard's envs wait, and the other
shard's CPU idles meanwhile; under one worker the scheduler spreads it over
every CPU's envs. This benchmark measures that split: for workers=1,
workers=k (pinned, the default) and workers=k with cpus=False, one pool at a
time (three pools of 1000 MuJoCo envs do not fit in 24 GiB), it times each
of --steps steps and reads the CPU of every host thread whose name starts
with --thread (default kdamond, this VM's DAMON monitor) from /proc before
and after it. It prints, per pool:
  * env-steps/s over the timed steps and the median step;
  * how many steps the thread ran in (took CPU), and the median step
    without it and with it: without it, the pools' own costs compared;
    with it, what the thread's bursts add;
  * for k > 1, how often each shard was the late one (timing.shards).
A markdown table goes to stdout, progress to stderr, every step's figures
to --results (default benchmarks/results/noise-<env>.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
try:
    import boltzlabs  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT))

import numpy as np

from boltzlabs import RLPool
from boltzlabs.runtime.rlimits import stat_fields

COUNTER = ROOT / "examples" / "counter"
TICKS = os.sysconf("SC_CLK_TCK")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def threads_named(prefix: str) -> list[int]:
    """The pids of every process whose name (comm) starts with `prefix`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/comm") as comm:
                    if comm.read().startswith(prefix):
                        found.append(int(entry))
            except OSError:
                continue
    return found


def cpu_ms(pids: list[int]) -> float:
    """The CPU (user + system) the processes have used, in ms (those gone count 0)."""
    total = 0
    for pid in pids:
        fields = stat_fields(pid)
        if fields is not None:
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total * 1000.0 / TICKS


def run(env: str, n: int, k: int, cpus, steps: int, watched: list[int]) -> dict:
    label = f"workers={k}" + (", cpus=False" if cpus is False else "")
    log(f"{env} n={n}: {label}: starting")
    source = COUNTER if env == "counter" else "HalfCheetah-v5"
    pool = RLPool(source, n, workers=k, cpus=cpus, progress=False, start_timeout=600)
    try:
        actions = (
            np.ones(n, np.int64)
            if env == "counter"
            else np.random.default_rng(0).uniform(-1, 1, (n, 6)).astype(np.float32)
        )
        pool.reset(seed=0)
        rows = []
        elapsed = 0.0
        for i in range(steps + 20):  # the first 20 warm the pool up and are not counted
            before = cpu_ms(watched)
            started = time.perf_counter()
            _, _, dones, _ = pool.step(actions)
            took = time.perf_counter() - started
            thread = cpu_ms(watched) - before
            if dones.any():
                pool.reset(where=dones)
            if i >= 20:
                elapsed += took
                rows.append({"ms": took * 1000.0, "thread_ms": thread, "shards": list(pool.timing.shards or [])})
    finally:
        pool.close()
    quiet = [r["ms"] for r in rows if r["thread_ms"] == 0]
    noisy = [r["ms"] for r in rows if r["thread_ms"] > 0]
    late = [0] * k
    if k > 1:
        for r in rows:
            if len(r["shards"]) == k:
                late[max(range(k), key=r["shards"].__getitem__)] += 1
    return {
        "who": label,
        "env": env,
        "n": n,
        "env_steps_per_s": n * len(rows) / elapsed,
        "median_ms": statistics.median(r["ms"] for r in rows),
        "thread_steps": len(noisy),
        "thread_ms": sum(r["thread_ms"] for r in rows),
        "quiet_median_ms": statistics.median(quiet) if quiet else None,
        "noisy_median_ms": statistics.median(noisy) if noisy else None,
        "late": late if k > 1 else None,
        "steps": rows,
    }


def _ms(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", choices=["counter", "halfcheetah"], default="halfcheetah")
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2, help="k: the sharded pools' workers (against 1)")
    parser.add_argument("--steps", type=int, default=150, help="timed steps per pool")
    parser.add_argument("--thread", default="kdamond", help="watch host threads whose name starts with this")
    parser.add_argument("--results", type=Path, help="where the JSON goes")
    args = parser.parse_args()
    if args.workers < 2 or args.n < args.workers or args.steps < 1:
        parser.error("--workers must be at least 2, --n at least --workers and --steps at least 1")
    watched = threads_named(args.thread)
    if not watched:
        log(f"no process named {args.thread}* on this host: every step counts as one without it")
    results = [
        run(args.env, args.n, k, cpus, args.steps, watched)
        for k, cpus in [(1, None), (args.workers, None), (args.workers, False)]
    ]
    path = args.results or ROOT / "benchmarks" / "results" / f"noise-{args.env}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
    print(f"cores {len(os.sched_getaffinity(0))}, {args.thread}* pids {watched}, {args.steps} steps per pool\n")
    print(
        f"| env | n | who | env-steps/s | vs workers=1 | median step ms | steps with {args.thread} "
        f"| its CPU ms | median ms without / with | late shard (counts) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    base = results[0]["env_steps_per_s"]
    for r in results:
        late = "-" if r["late"] is None else " / ".join(map(str, r["late"]))
        print(
            f"| {r['env']} | {r['n']} | {r['who']} | {r['env_steps_per_s']:,.0f} | {r['env_steps_per_s'] / base:.2f}x "
            f"| {r['median_ms']:.1f} | {r['thread_steps']} of {len(r['steps'])} | {r['thread_ms']:.0f} "
            f"| {_ms(r['quiet_median_ms'])} / {_ms(r['noisy_median_ms'])} | {late} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
