"""boltzlabs RLPool vs gymnasium AsyncVectorEnv on the same counter env.

    python benchmarks/bench_pool.py                  # n = 64, 256, 1000; steps adapted
    python benchmarks/bench_pool.py --n 64 256 --steps 2000

For each n, in one run:
  * RLPool("examples/counter", n): start-up (construction), env-steps/s over
    reset(seed) + S steps of actions all 1 with reset(where=dones) when any
    env is done, mean timing.worker_ms / roundtrip_ms of the steps, memory
    per env (pool.memory().mean) and pool.envs_per_gb().
  * gymnasium.vector.AsyncVectorEnv (fork, shared memory, SAME_STEP
    autoreset) over an equivalent gymnasium.Env: start-up, env-steps/s over
    the same S steps, USS per worker process.
A markdown table goes to stdout, progress to stderr, and every figure to
benchmarks/results/pool.json.
"""

from __future__ import annotations

import argparse
import gc
import json
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

import gymnasium as gym
import numpy as np
import psutil
from gymnasium.vector import AsyncVectorEnv, AutoresetMode

import boltzlabs
from boltzlabs import RLPool

COUNTER = ROOT / "examples" / "counter"
RESULTS = ROOT / "benchmarks" / "results" / "pool.json"
MIB = float(1 << 20)
WARMUP_STEPS = 20
HORIZON = 100  # the counter's episode length


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- the gymnasium twin of examples/counter ---------------------------------------------


class CounterEnv(gym.Env):
    """examples/counter/env.py as a gymnasium.Env: obs t, reward float(action), ends at t >= 100."""

    metadata = {"render_modes": []}

    def __init__(self):
        self.observation_space = gym.spaces.Discrete(HORIZON + 1)
        self.action_space = gym.spaces.Discrete(2)
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self.t, {}

    def step(self, action):
        self.t += 1
        return self.t, float(action), self.t >= HORIZON, False, {}


# -- helpers -------------------------------------------------------------------------------


def uss_of_tree(pid: int) -> int:
    """USS of a process and all its descendants, in bytes (0 if it is gone)."""
    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_full_info().uss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def pick_steps(per_step_s: float, target_s: float, lo: int = 200, hi: int = 100_000) -> int:
    """Steps that make a timed loop last about target_s, rounded to whole episodes."""
    steps = int(target_s / max(per_step_s, 1e-6))
    steps = max(lo, min(hi, steps))
    return max(HORIZON, round(steps / HORIZON) * HORIZON)


# -- boltzlabs -------------------------------------------------------------------------------


def pool_loop(pool: RLPool, actions: list, steps: int, record: bool):
    """S steps with reset(where=dones); returns (seconds, worker_ms list, roundtrip_ms list)."""
    worker, roundtrip = [], []
    started = time.perf_counter()
    for _ in range(steps):
        _, _, dones, _ = pool.step(actions)
        if record:
            worker.append(pool.timing.worker_ms)
            roundtrip.append(pool.timing.roundtrip_ms)
        if dones.any():
            pool.reset(where=dones)
    return time.perf_counter() - started, worker, roundtrip


def bench_pool(n: int, steps: int | None, target_s: float) -> dict:
    log(f"[boltzlabs n={n}] starting pool")
    gc.collect()
    started = time.perf_counter()
    pool = RLPool(COUNTER, n, progress=False)
    startup = time.perf_counter() - started
    try:
        pool.reset(seed=0)
        reset_ms = pool.timing.roundtrip_ms
        actions = [1] * n
        pool_loop(pool, actions, WARMUP_STEPS, record=False)
        if steps is None:
            probe_s, _, _ = pool_loop(pool, actions, 50, record=False)
            steps = pick_steps(probe_s / 50, target_s)
        pool.reset(seed=0)
        log(f"[boltzlabs n={n}] start-up {startup:.2f} s; timing {steps} steps")
        seconds, worker, roundtrip = pool_loop(pool, actions, steps, record=True)
        report = pool.memory()
        per_gb = pool.envs_per_gb()
        uss = [uss_of_tree(pid) for pid in pool.pids()]
        stragglers = sum(s != "idle" for s in pool.states())
    finally:
        pool.close()
    result = {
        "startup_s": startup,
        "steps": steps,
        "seconds": seconds,
        "env_steps_per_s": n * steps / seconds,
        "ms_per_step": 1000.0 * seconds / steps,
        "worker_ms_mean": float(np.mean(worker)),
        "roundtrip_ms_mean": float(np.mean(roundtrip)),
        "worker_ms_median": float(np.median(worker)),
        "roundtrip_ms_median": float(np.median(roundtrip)),
        "first_reset_ms": reset_ms,
        "memory_per_env_mib": report.mean / MIB,
        "memory_source": report.source,
        "memory_note": report.note,
        "envs_per_gb": per_gb,
        "uss_per_env_mib": float(np.mean(uss)) / MIB,
        "lanes_not_idle_after": stragglers,
    }
    log(f"[boltzlabs n={n}] {result['env_steps_per_s']:,.0f} env-steps/s, "
        f"worker {result['worker_ms_mean']:.2f} ms, roundtrip {result['roundtrip_ms_mean']:.2f} ms, "
        f"{result['memory_per_env_mib']:.2f} MiB/env")
    return result


# -- gymnasium ------------------------------------------------------------------------------


def async_loop(envs: AsyncVectorEnv, actions: np.ndarray, steps: int) -> float:
    started = time.perf_counter()
    for _ in range(steps):
        envs.step(actions)  # SAME_STEP autoreset: done envs are reset inside this call
    return time.perf_counter() - started


def bench_async(n: int, steps: int) -> dict:
    log(f"[async n={n}] starting AsyncVectorEnv")
    gc.collect()
    started = time.perf_counter()
    envs = AsyncVectorEnv([CounterEnv] * n, context="fork", autoreset_mode=AutoresetMode.SAME_STEP)
    startup = time.perf_counter() - started
    try:
        envs.reset(seed=0)
        actions = np.ones(n, dtype=np.int64)
        async_loop(envs, actions, WARMUP_STEPS)
        envs.reset(seed=0)
        log(f"[async n={n}] start-up {startup:.2f} s; timing {steps} steps")
        seconds = async_loop(envs, actions, steps)
        uss = [uss_of_tree(p.pid) for p in envs.processes]
    finally:
        envs.close()
    result = {
        "startup_s": startup,
        "steps": steps,
        "seconds": seconds,
        "env_steps_per_s": n * steps / seconds,
        "ms_per_step": 1000.0 * seconds / steps,
        "uss_per_env_mib": float(np.mean(uss)) / MIB,
    }
    log(f"[async n={n}] {result['env_steps_per_s']:,.0f} env-steps/s, {result['uss_per_env_mib']:.2f} MiB USS/env")
    return result


# -- report ------------------------------------------------------------------------------------


def table(rows: list) -> str:
    head = ["n", "steps", "ours start (s)", "async start (s)", "ours env-steps/s", "async env-steps/s",
            "speed ours/async", "worker ms", "roundtrip ms", "ours MiB/env", "ours USS MiB/env",
            "async USS MiB/env", "mem ours/async", "envs/GiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        o, a = row["boltzlabs"], row["async"]
        cells = [
            str(row["n"]), str(o["steps"]),
            f"{o['startup_s']:.2f}", f"{a['startup_s']:.2f}",
            f"{o['env_steps_per_s']:,.0f}", f"{a['env_steps_per_s']:,.0f}",
            f"{row['speed_ratio']:.2f}x",
            f"{o['worker_ms_mean']:.2f}", f"{o['roundtrip_ms_mean']:.2f}",
            f"{o['memory_per_env_mib']:.2f}", f"{o['uss_per_env_mib']:.2f}", f"{a['uss_per_env_mib']:.2f}",
            f"{row['memory_ratio']:.2f}x",
            f"{o['envs_per_gb']:.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[64, 256, 1000], help="pool sizes (default 64 256 1000)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per measurement (default: adapted so each boltzlabs loop takes ~--target s)")
    parser.add_argument("--target", type=float, default=5.0,
                        help="seconds a boltzlabs timed loop should take when --steps is not given (default 5)")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"JSON output (default {RESULTS.relative_to(ROOT)})")
    args = parser.parse_args(argv)
    if any(n < 1 for n in args.n) or (args.steps is not None and args.steps < 1):
        parser.error("--n and --steps must be positive")

    run_started = time.perf_counter()
    rows = []
    for n in args.n:
        ours = bench_pool(n, args.steps, args.target)
        theirs = bench_async(n, ours["steps"])  # same n, same steps
        rows.append({
            "n": n,
            "boltzlabs": ours,
            "async": theirs,
            "speed_ratio": ours["env_steps_per_s"] / theirs["env_steps_per_s"],
            "memory_ratio": ours["memory_per_env_mib"] / theirs["uss_per_env_mib"],
            "uss_ratio": ours["uss_per_env_mib"] / theirs["uss_per_env_mib"],
        })
    total = time.perf_counter() - run_started

    print(table(rows))
    print()
    print(f"speed ours/async: env-steps/s ratio (higher is better for boltzlabs). mem ours/async: "
          f"pool.memory().mean / AsyncVectorEnv worker USS (lower is better). Total run {total:.0f} s.")
    note = rows[0]["boltzlabs"]["memory_note"] if rows else ""
    if note:
        print(f"note: {note}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "command": " ".join([Path(sys.argv[0]).name] + (sys.argv[1:] if argv is None else list(argv))),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "total_s": total,
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "memory_gib": psutil.virtual_memory().total / (1 << 30),
        },
        "versions": {"boltzlabs": boltzlabs.__version__, "gymnasium": gym.__version__, "numpy": np.__version__},
        "settings": {"warmup_steps": WARMUP_STEPS, "target_s": args.target, "steps": args.steps,
                     "async": {"context": "fork", "shared_memory": True, "autoreset_mode": "SameStep"}},
        "results": rows,
    }
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
