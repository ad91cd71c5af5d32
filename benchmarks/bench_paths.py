"""The worker's step paths and channels side by side: native (boltzlabs.worker._fastpath)
vs pure Python, and pipes vs the socketpair channel (docs/wire.md#the-channel).

    python benchmarks/bench_paths.py                     # n = 64 and 512, counter env
    python benchmarks/bench_paths.py --n 64 --steps 3000 --env numpy
    python benchmarks/bench_paths.py --channels pipes socketpair   # four pools per n

For each n, a pool per (path, channel) of the same env is open at once, each
started with BOLTZLABS_PURE=1 or not and BOLTZLABS_CHANNEL (the worker reads
both at start), and they take turns in
--rounds chunks of the same steps (ABBA), so load from other work on a shared
machine hits both alike: a paired comparison where bench_pool.py's absolute
figures swing with the load. For each path: env-steps/s, and the worker's CPU
per env-step split into user and system time (psutil, from the kernel's
per-process counters), and the envs' and client's CPU per env-step
(scheduler counters, as bench_pool.py). A markdown table goes to stdout,
every figure to benchmarks/results/paths.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pool import COUNTER, HORIZON, NUMPY_ENV, ROOT, cpu_split, log, ours_groups, run_record

from boltzlabs import RLPool

RESULTS = ROOT / "benchmarks" / "results" / "paths.json"


class Lane:
    """One pool on one path, with its counters."""

    def __init__(self, path: str, channel: str, source: Path, n: int):
        if path == "pure":
            os.environ["BOLTZLABS_PURE"] = "1"
        else:
            os.environ.pop("BOLTZLABS_PURE", None)
        os.environ["BOLTZLABS_CHANNEL"] = channel
        try:
            self.pool = RLPool(source, n, progress=False)
        finally:
            os.environ.pop("BOLTZLABS_PURE", None)
            os.environ.pop("BOLTZLABS_CHANNEL", None)
        assert self.pool.fast_path == (path == "native"), f"asked for {path}, got fast_path={self.pool.fast_path}"
        assert self.pool.channel == channel, f"asked for {channel}, got {self.pool.channel}"
        self.path, self.channel, self.n = path, channel, n
        self.worker = psutil.Process(self.pool._proc.pid)
        everything = psutil.Process().children(recursive=True)
        mine = {self.worker.pid} | {p.pid for p in self.worker.children(recursive=True)}
        self.groups = ours_groups([p for p in everything if p.pid in mine], self.pool)
        self.seconds = self.user = self.system = 0.0
        self.cpu: dict = {}
        self.steps = 0
        self.pool.reset(seed=0)

    def run(self, steps: int, timed: bool = True) -> None:
        pool, actions = self.pool, [1] * self.n
        if timed:
            before = cpu_split(self.groups, self_last=True)
            times = self.worker.cpu_times()
            started = time.perf_counter()
        for _ in range(steps):
            _, _, dones, _ = pool.step(actions)
            if dones.any():
                pool.reset(where=dones)
        if not timed:
            return
        self.seconds += time.perf_counter() - started
        after_times = self.worker.cpu_times()
        after = cpu_split(self.groups, self_last=False)
        self.user += after_times.user - times.user
        self.system += after_times.system - times.system
        for name, value in after.items():
            self.cpu[name] = self.cpu.get(name, 0.0) + value - before[name]
        self.steps += steps

    def figures(self) -> dict:
        env_steps = self.n * self.steps
        return {
            "path": self.path,
            "channel": self.channel,
            "n": self.n,
            "steps": self.steps,
            "env_steps_per_s": env_steps / self.seconds,
            "worker_user_us": 1e6 * self.user / env_steps,
            "worker_system_us": 1e6 * self.system / env_steps,
            "cpu_us_per_env_step_by": {k: 1e6 * v / env_steps for k, v in self.cpu.items()},
        }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--steps", type=int, default=2000, help="timed steps per path (default 2000)")
    parser.add_argument("--rounds", type=int, default=10, help="chunks the two paths alternate in (default 10)")
    parser.add_argument("--env", choices=["counter", "numpy"], default="counter")
    parser.add_argument("--paths", nargs="+", choices=["native", "pure"], default=["native", "pure"])
    parser.add_argument("--channels", nargs="+", choices=["pipes", "socketpair"], default=["pipes"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    source = COUNTER if args.env == "counter" else NUMPY_ENV
    load_before = os.getloadavg()
    started = time.perf_counter()
    rows = []
    for n in args.n:
        log(f"[n={n}] starting a pool of {args.env} per path {args.paths} and channel {args.channels}")
        lanes = [Lane(path, channel, source, n) for path in args.paths for channel in args.channels]
        try:
            for lane in lanes:
                lane.run(HORIZON // 5, timed=False)  # warm-up
            chunks = [args.steps // args.rounds] * args.rounds
            for i, chunk in enumerate(chunks):
                for lane in lanes if i % 2 == 0 else lanes[::-1]:
                    lane.run(chunk)
            rows.append([lane.figures() for lane in lanes])
        finally:
            for lane in lanes:
                lane.pool.close()
        log(f"[n={n}] " + ", ".join(f"{f['path']}/{f['channel']} {f['env_steps_per_s']:,.0f}/s" for f in rows[-1]))
    total = time.perf_counter() - started
    load_after = os.getloadavg()
    head = [
        "n",
        "path",
        "channel",
        "env-steps/s",
        "worker user us",
        "worker sys us",
        "worker us",
        "envs us",
        "client us",
    ]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for pair in rows:
        for f in pair:
            by = f["cpu_us_per_env_step_by"]
            print(
                f"| {f['n']} | {f['path']} | {f['channel']} | {f['env_steps_per_s']:,.0f} | {f['worker_user_us']:.1f} | "
                f"{f['worker_system_us']:.1f} | {by.get('worker', 0):.1f} | {by.get('envs', 0):.1f} | "
                f"{by.get('client', 0):.1f} |"
            )
    print(
        f"\n{args.env} env; {args.steps} timed steps per pool in {args.rounds} alternating chunks; "
        f"1-min load average {load_before[0]:.1f} before, {load_after[0]:.1f} after; {total:.0f} s."
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                **run_record(argv, total, load_before, load_after),
                "settings": vars(args) | {"out": str(args.out)},
                "results": rows,
            },
            indent=2,
            default=str,
        )
        + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
