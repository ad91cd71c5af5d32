"""Text in, text out at scale: str actions and str observations of S bytes, n lanes, one pool.

    python benchmarks/bench_text.py                              # n = 1000, S = 64K
    python benchmarks/bench_text.py --n 1000 --sizes 1K 64K 256K
    python benchmarks/bench_text.py --n 16 --sizes 1K --target 1 # a quick check that it runs
    BOLTZLABS_PURE=1 python benchmarks/bench_text.py             # the worker's pure-Python step path

One RLPool("benchmarks/envs/text_env", n): each step, every env takes an
action of S ASCII bytes (the "program": a str) and answers a "test log" of S
bytes (a str), reward S; episodes end every 100 steps. For each S in turn,
two ways of stepping take turns in --rounds chunks of the timed steps (ABBA
order, so a burst of other work on the machine hits both alike):

  * step   pool.step(actions), then reset(where=dones) when any env is done
           (a prompt of S bytes each: a reset is text too)
  * async  pool.send(actions) to every env, then pool.recv(batch_size=n); the
           envs done at the last recv are reset in the same send (send(resets=))

Per S and way, from the timed chunks only: env-steps/s; MB/s of text (an
action and an observation of S bytes per env-step: 2 S bytes); CPU per
env-step by process (this process, the worker, the envs, the template), each
read from the process's own scheduler counter around every chunk, as
bench_pool.py reads it; the worker's and the round trip's mean ms per call;
failed lanes (every obs is checked: a str of S bytes, else counted).

Memory with text in flight, once per S: after a send() to every env, once
every env has answered (the worker holds n replies of S bytes), and after
their recv() (this process holds n observations): pool.memory() per env (the
envs' cgroups), envs_per_gb(), and the worker's and this process's RSS.

--max-str-len sets the pool's cap (RLPool(limits={"max_str_len": ...}), at
most the policy's 4M). A markdown table goes to stdout, progress to stderr,
every figure (with the machine, its load before and after, the commit) to
benchmarks/results/text.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
try:
    import boltzlabs  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT))

import numpy as np
import psutil

from bench_pool import cpu_split, ours_groups, run_record  # benchmarks/ is sys.path[0] when run as a script

from boltzlabs import RLPool
from boltzlabs.units import parse_size

TEXT_ENV = ROOT / "benchmarks" / "envs" / "text_env"
RESULTS = ROOT / "benchmarks" / "results" / "text.json"
MIB = float(1 << 20)
WARMUP_STEPS = 5
HORIZON = 100  # the text env's episode length


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def program(size: int, variant: int) -> str:
    """An ASCII "program" of exactly `size` bytes (a few variants, so lanes do not share one object)."""
    line = f"def f_{variant}(x):  # generated\n    return x * {variant} + 1\n\n"
    return (line * (size // len(line) + 1))[:size]


class Way:
    """One way of stepping the pool (step, or send/recv) at one size, and its score."""

    def __init__(self, name: str, pool, size: int):
        self.name, self.pool, self.size = name, pool, size
        n = pool.n
        self.actions = [program(size, i % 8) for i in range(n)]
        self.done: list = []  # lanes done at the latest step or recv, reset at the next turn
        self.seconds = 0.0
        self.steps = 0
        self.cpu: dict = {}
        self.worker_ms: list = []
        self.roundtrip_ms: list = []
        self.failed = 0
        self.first_error = None

    def check(self, obs, infos, lanes) -> None:
        size = self.size
        for i, o in enumerate(obs):
            if type(o) is not str or len(o) != size:
                self.failed += 1
                if self.first_error is None:
                    self.first_error = (lanes[i] if lanes is not None else i, (infos[i] or {}).get("error"))

    def loop(self, steps: int, record: bool = False) -> None:
        pool, n = self.pool, self.pool.n
        for _ in range(steps):
            if self.name == "step":
                obs, _, dones, infos = pool.step(self.actions)
                self.check(obs, infos, None)
                if dones.any():
                    pool.reset(where=dones, options={"size": self.size})
            else:
                pool.send(self.actions, resets=self.done or None)
                env_ids, obs, _, dones, infos = pool.recv(batch_size=n)
                self.check(obs, infos, env_ids)
                self.done = env_ids[dones].tolist()
            if record:
                self.worker_ms.append(pool.timing.worker_ms)
                self.roundtrip_ms.append(pool.timing.roundtrip_ms)

    def timed(self, steps: int, groups: dict) -> None:
        before = cpu_split(groups, self_last=True)
        started = time.perf_counter()
        self.loop(steps, record=True)
        self.seconds += time.perf_counter() - started
        after = cpu_split(groups, self_last=False)
        for name, value in after.items():
            self.cpu[name] = self.cpu.get(name, 0.0) + value - before[name]
        self.steps += steps

    def figures(self) -> dict:
        n, steps = self.pool.n, self.steps
        env_steps = n * steps
        return {
            "steps": steps,
            "seconds": self.seconds,
            "env_steps_per_s": env_steps / self.seconds,
            "mb_per_s": 2 * self.size * env_steps / self.seconds / 1e6,
            "cpu_us_per_env_step": 1e6 * sum(self.cpu.values()) / env_steps,
            "cpu_us_per_env_step_by": {name: 1e6 * value / env_steps for name, value in self.cpu.items()},
            "worker_ms_mean": float(np.mean(self.worker_ms)),
            "roundtrip_ms_mean": float(np.mean(self.roundtrip_ms)),
            "failed_lanes": self.failed,
            "first_error": self.first_error,
        }


def memory_in_flight(pool, size: int, worker: psutil.Process) -> dict:
    """Memory while every env's reply of `size` bytes is held by the worker, then by this process."""
    actions = [program(size, i % 8) for i in range(pool.n)]
    pool.send(actions)
    deadline = time.monotonic() + 60
    while any(state == "busy" for state in pool.states()) and time.monotonic() < deadline:
        time.sleep(0.01)
    report = pool.memory()
    held = {
        "memory_per_env_mib": report.mean / MIB,
        "memory_shared_mib": getattr(report, "shared", 0) / MIB,
        "envs_per_gb": pool.envs_per_gb(),
        "worker_rss_mib": worker.memory_info().rss / MIB,
        "client_rss_mib": psutil.Process().memory_info().rss / MIB,
        "memory_source": report.source,
    }
    env_ids, obs, _, dones, _ = pool.recv(batch_size=pool.n)
    held["client_rss_after_recv_mib"] = psutil.Process().memory_info().rss / MIB
    held["worker_rss_after_recv_mib"] = worker.memory_info().rss / MIB
    if dones.any():
        pool.reset(where=env_ids[dones].tolist(), options={"size": size})
    return held


def bench(n: int, sizes: list, steps: int | None, target_s: float, rounds: int, max_str_len) -> list:
    limits = {"max_str_len": max_str_len} if max_str_len else None
    started = time.perf_counter()
    pool = RLPool(TEXT_ENV, n, progress=False, limits=limits)
    startup = time.perf_counter() - started
    log(f"[n={n}] pool ready in {startup:.2f} s (max_str_len {pool.max_str_len:,}, fast path {pool.fast_path})")
    rows = []
    try:
        worker = psutil.Process(pool._proc.pid)
        everything = psutil.Process().children(recursive=True)
        groups = ours_groups(everything, pool)
        for size in sizes:
            if size > pool.max_str_len:
                log(f"[n={n}] S={size:,} is over the pool's max_str_len of {pool.max_str_len:,}: skipped")
                continue
            pool.reset(seed=0, options={"size": size})
            ways = [Way("step", pool, size), Way("async", pool, size)]
            for way in ways:
                way.loop(WARMUP_STEPS)
            if steps is None:
                t = time.perf_counter()
                ways[0].loop(WARMUP_STEPS)
                per_step = (time.perf_counter() - t) / WARMUP_STEPS
                count = max(10, min(10_000, int(target_s / max(per_step, 1e-6))))
            else:
                count = steps
            chunks_n = max(1, min(rounds, count // 2))
            chunks = [count // chunks_n + (i < count % chunks_n) for i in range(chunks_n)]
            log(f"[n={n}] S={size:,}: {count} timed steps each way, in {chunks_n} alternating chunks")
            for i, chunk in enumerate(chunks):
                for way in ways if i % 2 == 0 else ways[::-1]:
                    way.timed(chunk, groups)
            memory = memory_in_flight(pool, size, worker)
            row = {"n": n, "size": size, "startup_s": startup, "memory_in_flight": memory}
            for way in ways:
                row[way.name] = way.figures()
            rows.append(row)
            s, a = row["step"], row["async"]
            log(
                f"[n={n}] S={size:,}: step {s['env_steps_per_s']:,.0f} env-steps/s {s['mb_per_s']:,.0f} MB/s "
                f"{s['cpu_us_per_env_step']:.1f} us CPU/env-step; async {a['env_steps_per_s']:,.0f} env-steps/s "
                f"{a['mb_per_s']:,.0f} MB/s; worker RSS with replies held {memory['worker_rss_mib']:.0f} MiB"
            )
        row_meta = {"fast_path": pool.fast_path, "channel": pool.channel, "max_str_len": pool.max_str_len}
        for row in rows:
            row.update(row_meta)
    finally:
        pool.close()
    return rows


def _us(row: dict, way: str, group: str) -> str:
    return f"{row[way]['cpu_us_per_env_step_by'].get(group, 0.0):.1f}"


def table(rows: list) -> str:
    head = [
        "n",
        "S",
        "way",
        "env-steps/s",
        "MB/s (both ways)",
        "client us/env-step",
        "worker us/env-step",
        "envs us/env-step",
        "worker ms/call",
        "failed",
        "MiB/env (in flight)",
        "envs/GiB",
        "worker RSS MiB (in flight)",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        memory = row["memory_in_flight"]
        for way in ("step", "async"):
            f = row[way]
            lines.append(
                "| "
                + " | ".join(
                    [
                        str(row["n"]),
                        f"{row['size'] >> 10}K",
                        way,
                        f"{f['env_steps_per_s']:,.0f}",
                        f"{f['mb_per_s']:,.0f}",
                        _us(row, way, "client"),
                        _us(row, way, "worker"),
                        _us(row, way, "envs"),
                        f"{f['worker_ms_mean']:.2f}",
                        str(f["failed_lanes"]),
                        f"{memory['memory_per_env_mib']:.2f}",
                        f"{memory['envs_per_gb']:,.0f}",
                        f"{memory['worker_rss_mib']:.0f}",
                    ]
                )
                + " |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[1000], help="pool sizes (default 1000)")
    parser.add_argument("--sizes", nargs="+", default=["64K"], help="action and observation sizes, like 1K 64K 256K")
    parser.add_argument("--steps", type=int, default=None, help="timed steps each way (default: --target seconds)")
    parser.add_argument("--target", type=float, default=5.0, help="seconds of timed steps each way per size")
    parser.add_argument("--rounds", type=int, default=6, help="alternating chunks each way")
    parser.add_argument("--max-str-len", default=None, help="the pool's cap, like \"512K\" (default: the policy's)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON goes")
    args = parser.parse_args(argv)
    sizes = [parse_size(size) for size in args.sizes]
    load_before = os.getloadavg()
    started = time.perf_counter()
    rows = []
    for n in args.n:
        rows += bench(n, sizes, args.steps, args.target, args.rounds, args.max_str_len)
    record = run_record(argv, time.perf_counter() - started, load_before, os.getloadavg())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**record, "rows": rows}, indent=2, default=str))
    print(table(rows))
    log(f"figures in {args.out}; load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after")
    failed = sum(row[way]["failed_lanes"] for row in rows for way in ("step", "async"))
    if failed:
        first = next(row[way]["first_error"] for row in rows for way in ("step", "async") if row[way]["first_error"])
        log(f"WARNING: {failed} lane results were not a str of S bytes; the first (lane, error): {first}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
