"""Asynchronous stepping against step() on a heavy-tailed env (issue 7).

    python benchmarks/bench_async.py                 # n = 64 and 512, 4 s per loop
    python benchmarks/bench_async.py --n 64 --seconds 10

The env (benchmarks/heavy_tail) sleeps 1 ms per step, 50 ms one time in a
hundred, so a batched step() nearly always waits for a 50 ms env. For each n,
in one run, on one pool:
  * step():  pool.step(actions) in a loop; env-steps/s = n * steps / time.
  * recv(n/2): send to every env, then recv(batch_size=n/2) and send again to
    the envs received, in a loop; env-steps/s = results received / time.
Also the mean timing.wait_ms and queued_ms of the recvs. A markdown table goes
to stdout, progress to stderr. Numbers depend on the host (cores, load).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
try:
    import boltzlabs  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT))

from boltzlabs import RLPool

HEAVY_TAIL = ROOT / "benchmarks" / "heavy_tail"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def bench_step(pool: RLPool, seconds: float) -> float:
    actions = [0] * pool.n
    for _ in range(3):
        pool.step(actions)
    steps = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        pool.step(actions)
        steps += pool.n
    return steps / (time.perf_counter() - started)


def bench_recv(pool: RLPool, batch_size: int, seconds: float) -> tuple:
    pool.send([0] * pool.n)
    for _ in range(3):
        ids, *_ = pool.recv(batch_size)
        pool.send([0] * len(ids), env_ids=ids)
    steps = 0
    waits, queued = [], []
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        ids, *_ = pool.recv(batch_size)
        waits.append(pool.timing.wait_ms)
        queued.append(pool.timing.queued_ms)
        steps += len(ids)
        pool.send([0] * len(ids), env_ids=ids)
    rate = steps / (time.perf_counter() - started)
    pool.recv()  # everything outstanding, so step() may run again
    return rate, sum(waits) / len(waits), sum(queued) / len(queued)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--seconds", type=float, default=4.0, help="wall time of each loop")
    args = parser.parse_args()
    rows = []
    for n in args.n:
        log(f"n={n}: starting the pool")
        with RLPool(HEAVY_TAIL, n, step_timeout=10) as pool:
            pool.reset(seed=0)
            log(f"n={n}: step()")
            sync = bench_step(pool, args.seconds)
            log(f"n={n}: recv(batch_size={n // 2})")
            rate, wait_ms, queued_ms = bench_recv(pool, n // 2, args.seconds)
        rows.append((n, sync, rate, wait_ms, queued_ms))
        log(f"n={n}: step() {sync:,.0f}/s, recv(n/2) {rate:,.0f}/s")
    print(
        f"Heavy-tailed env (1 ms, 50 ms one step in 100); {os.cpu_count()} cores, {platform.machine()}, "
        f"Python {platform.python_version()}, {args.seconds:g} s per loop.\n"
    )
    print("| n | step() env-steps/s | recv(n/2) env-steps/s | speed-up | recv wait_ms | recv queued_ms |")
    print("|---|---|---|---|---|---|")
    for n, sync, rate, wait_ms, queued_ms in rows:
        print(f"| {n} | {sync:,.0f} | {rate:,.0f} | {rate / sync:.1f}x | {wait_ms:.2f} | {queued_ms:.2f} |")


if __name__ == "__main__":
    main()
