"""RLPool(workers=k) for k = 1, 2, 4 against each other (and AsyncVectorEnv), one run.

    python benchmarks/bench_shards.py                                 # counter and HalfCheetah-v5, n = 64 512 1000
    python benchmarks/bench_shards.py --env counter --n 512 1000 --workers 1 2 4
    python benchmarks/bench_shards.py --env halfcheetah --n 64 --no-async
    python benchmarks/bench_shards.py --env counter --pin   # the client alone on a CPU, the workers on the rest
    python benchmarks/bench_shards.py --env counter --n 64 --workers 1 2 --unpinned   # also k > 1 with cpus=False

For each env and n, every contender is open at once (a pool per k, as
RLPool makes it: for k > 1 each shard on its own slice of the CPUs; with
--unpinned also each k > 1 with cpus=False; and gymnasium's AsyncVectorEnv
where --async-max allows) and they take turns in
--rounds chunks of S steps, so load from elsewhere on a shared machine slows
them alike; the figures are medians over the rounds:
  * env-steps/s of the chunk (n * S / wall time);
  * the client's CPU per env-step (time.process_time() in this process, the
    trainer: what sharding must not make the bottleneck);
  * for the pools, the workers' CPU per env-step (all shards summed, and the
    busiest shard's), from each worker's own scheduler counter: the serial
    cost a shard takes off the others, what decides k on a many-core node;
  * for the pools, where a step's other costs land: how often the workers
    block per step (voluntary context switches, summed), the machine's
    context switches per step (/proc/stat ctxt: every process's, so a quiet
    machine is needed), and the CPU of every process under the workers
    (templates and sandboxes) per env-step.
Actions: all 1 for the counter (reset(where=dones) when an episode ends),
a fixed random array for HalfCheetah-v5 (truncated at 1000 steps by its
TimeLimit; the chunks are shorter, so no reset happens inside them).
A markdown table goes to stdout, progress to stderr, every figure to
benchmarks/results/shards-<envs>.json.
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
sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    import boltzlabs  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT))

import gymnasium as gym
import numpy as np
import psutil
from gymnasium.vector import AsyncVectorEnv, AutoresetMode

from bench_pool import CounterEnv, _runtime_ns
from boltzlabs import RLPool

COUNTER = ROOT / "examples" / "counter"
CPUS = sorted(os.sched_getaffinity(0))  # before --pin narrows this process's
RESULTS = ROOT / "benchmarks" / "results" / "shards-{env}.json"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _cheetah():
    return gym.make("HalfCheetah-v5")


class Ours:
    def __init__(self, env: str, n: int, k: int, cpus=None):
        self.label, self.n, self.env = f"workers={k}" + (", unpinned" if cpus is False else ""), n, env
        started = time.perf_counter()
        source = COUNTER if env == "counter" else "HalfCheetah-v5"
        # A generous start_timeout: on a loaded machine 64 MuJoCo envs can take over a minute to start.
        self.pool = RLPool(source, n, workers=k, cpus=cpus, progress=False, start_timeout=600)
        self.ready_s = time.perf_counter() - started
        self.workers = [shard._proc.pid for shard in self.pool._shards] if k > 1 else [self.pool._proc.pid]
        self.actions = (
            np.ones(n, np.int64)
            if env == "counter"
            else np.random.default_rng(0).uniform(-1, 1, (n, 6)).astype(np.float32)
        )

    def reset(self) -> None:
        self.pool.reset(seed=0)

    def pin(self, cpus: set) -> None:
        """Every worker and each process below it (templates, sandboxes) on `cpus` only."""
        for pid in self.workers:
            self._pin_tree(pid, cpus)

    @staticmethod
    def _pin_tree(pid: int, cpus: set) -> None:
        worker = psutil.Process(pid)
        for proc in [worker, *worker.children(recursive=True)]:
            try:
                os.sched_setaffinity(proc.pid, cpus)
            except OSError as exc:  # gone, or a cpuset that holds none of `cpus`
                log(f"could not pin {proc.pid} ({proc.name()}): {exc}")

    def chunk(self, steps: int) -> tuple:
        pool, actions = self.pool, self.actions
        below = self._below()
        worker_before = [_runtime_ns(pid) or 0 for pid in self.workers]
        blocks_before = _blocks(self.workers)
        below_before = _cpu_ns(below)
        switches_before = _switches()
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(steps):
            _, _, dones, _ = pool.step(actions)
            if dones.any():
                pool.reset(where=dones)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        worker = [(_runtime_ns(pid) or 0) - b for pid, b in zip(self.workers, worker_before)]
        extra = {
            "blocks": (_blocks(self.workers) - blocks_before) / steps,
            "envs_ns": _cpu_ns(below) - below_before,
            "switches": (_switches() - switches_before) / steps,
        }
        return wall, cpu, worker, extra

    def _below(self) -> list:
        """The pids of every process under the workers (templates and sandboxes)."""
        pids = []
        for pid in self.workers:
            try:
                pids += [p.pid for p in psutil.Process(pid).children(recursive=True)]
            except psutil.Error:
                pass
        return pids

    def close(self) -> None:
        self.pool.close()


class Async:
    def __init__(self, env: str, n: int):
        self.label, self.n = "AsyncVectorEnv", n
        started = time.perf_counter()
        fn = CounterEnv if env == "counter" else _cheetah
        self.envs = AsyncVectorEnv([fn] * n, context="fork", autoreset_mode=AutoresetMode.SAME_STEP)
        self.ready_s = time.perf_counter() - started
        self.actions = (
            np.ones(n, np.int64)
            if env == "counter"
            else np.random.default_rng(0).uniform(-1, 1, (n, 6)).astype(np.float32)
        )

    def reset(self) -> None:
        self.envs.reset(seed=0)

    def chunk(self, steps: int) -> tuple:
        envs, actions = self.envs, self.actions
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(steps):
            envs.step(actions)
        return time.perf_counter() - wall, time.process_time() - cpu, None, None

    def close(self) -> None:
        self.envs.close()


def _blocks(pids: list) -> int:
    """How many times the processes `pids` have blocked (voluntary context switches), summed."""
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).num_ctx_switches().voluntary
        except psutil.Error:
            pass
    return total


def _switches() -> int:
    """The machine's context switches so far (/proc/stat ctxt)."""
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("ctxt "):
                return int(line.split()[1])
    return 0


def _cpu_ns(pids: list) -> int:
    """The CPU time of the processes `pids`, summed (those gone since count 0)."""
    return sum(_runtime_ns(pid) or 0 for pid in pids)


def bench(
    env: str, n: int, ks: list, rounds: int, steps: int, with_async: bool, pin: bool = False, unpinned: bool = False
) -> list:
    contenders = []
    try:
        for k in ks:
            log(f"{env} n={n}: starting workers={k}")
            contenders.append(Ours(env, n, k))
            if unpinned and k > 1:
                log(f"{env} n={n}: starting workers={k}, unpinned")
                contenders.append(Ours(env, n, k, cpus=False))
            if pin:  # the client alone on its CPU: its CPU figure without a worker on its core
                client, *rest = CPUS
                contenders[-1].pin(set(rest))
                os.sched_setaffinity(0, {client})
        if with_async:
            log(f"{env} n={n}: starting AsyncVectorEnv")
            contenders.append(Async(env, n))
        for c in contenders:
            c.reset()
            c.chunk(max(2, steps // 5))  # warm-up
        samples = {c.label: [] for c in contenders}
        for r in range(rounds):
            order = contenders if r % 2 == 0 else contenders[::-1]
            for c in order:
                samples[c.label].append(c.chunk(steps))
        rows = []
        for c in contenders:
            got = samples[c.label]
            env_steps = n * steps
            row = {
                "env": env,
                "n": n,
                "who": c.label,
                "steps": steps,
                "rounds": rounds,
                "ready_s": c.ready_s,
                "env_steps_per_s": statistics.median(env_steps / wall for wall, *_ in got),
                "client_us": statistics.median(cpu * 1e6 / env_steps for _, cpu, *_ in got),
            }
            if got[0][2] is not None:
                row["worker_us"] = statistics.median(sum(w) / 1e3 / env_steps for _, _, w, _ in got)
                row["busiest_worker_us"] = statistics.median(max(w) / 1e3 / env_steps for _, _, w, _ in got)
                row["worker_blocks_per_step"] = statistics.median(x["blocks"] for *_, x in got)
                row["envs_us"] = statistics.median(x["envs_ns"] / 1e3 / env_steps for *_, x in got)
                row["switches_per_step"] = statistics.median(x["switches"] for *_, x in got)
                row["fast_path"] = c.pool.fast_path
            rows.append(row)
        return rows
    finally:
        for c in contenders:
            c.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", nargs="+", default=["counter", "halfcheetah"], choices=["counter", "halfcheetah"])
    parser.add_argument("--n", nargs="+", type=int, default=[64, 512, 1000])
    parser.add_argument("--workers", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--env-steps", type=int, default=40_000, help="env-steps per chunk (S = this / n)")
    parser.add_argument(
        "--async-max", type=int, default=1000, help="largest n AsyncVectorEnv runs at (HalfCheetah: a quarter of it)"
    )
    parser.add_argument("--no-async", action="store_true")
    parser.add_argument(
        "--unpinned",
        action="store_true",
        help="also run each k > 1 with cpus=False: every shard's processes free to run on any CPU",
    )
    parser.add_argument(
        "--results", type=Path, help="where the JSON goes (default benchmarks/results/shards-<envs>.json)"
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="this process (the client) alone on its first CPU, every worker and sandbox on the others: "
        "the client's CPU per env-step without core sharing (throughput then is not comparable)",
    )
    args = parser.parse_args()
    rows = []
    for env in args.env:
        scale = 1 if env == "counter" else 8  # HalfCheetah's step costs ~8x the counter's
        for n in args.n:
            steps = max(5, args.env_steps // scale // n)
            limit = args.async_max if env == "counter" else args.async_max // 4
            with_async = not args.no_async and not args.pin and n <= limit
            rows += bench(
                env, n, args.workers, args.rounds, steps, with_async, args.pin, args.unpinned and not args.pin
            )
            log(json.dumps([row for row in rows if row["env"] == env and row["n"] == n]))
    results = args.results or Path(str(RESULTS).format(env="-".join(args.env) + ("-pinned" if args.pin else "")))
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(
        json.dumps(
            {
                "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "cores": len(CPUS),
                "pinned": args.pin,
                "load": os.getloadavg(),
                "rows": rows,
            },
            indent=1,
        )
    )
    print(f"cores {len(CPUS)}, load {os.getloadavg()[0]:.1f}, medians of {args.rounds} rounds\n")
    print(
        "| env | n | who | env-steps/s | vs workers=1 | client us/env-step | workers us/env-step (busiest) "
        "| worker blocks/step | machine switches/step | envs us/env-step | ready s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        base = next(r for r in rows if r["env"] == row["env"] and r["n"] == row["n"] and r["who"] == "workers=1")
        ours = "worker_us" in row
        worker = f"{row['worker_us']:.2f} ({row['busiest_worker_us']:.2f})" if ours else "-"
        blocks = f"{row['worker_blocks_per_step']:.0f}" if ours else "-"
        envs = f"{row['envs_us']:.1f}" if ours else "-"
        switches = f"{row['switches_per_step']:,.0f}" if ours else "-"
        print(
            f"| {row['env']} | {row['n']} | {row['who']} | {row['env_steps_per_s']:,.0f} | "
            f"{row['env_steps_per_s'] / base['env_steps_per_s']:.2f}x | {row['client_us']:.2f} | {worker} | "
            f"{blocks} | {switches} | {envs} | {row['ready_s']:.1f} |"
        )


if __name__ == "__main__":
    main()
