"""Spawn-time, hard-reset and memory benchmark: template vs exec vs AsyncVectorEnv.

    python benchmarks/bench_spawn.py                          # n = 100 1000 10000 (~10 min)
    python benchmarks/bench_spawn.py --n 100                  # a quick check
    python benchmarks/bench_spawn.py --modes template async   # a subset of the modes
    python benchmarks/bench_spawn.py --counter-n 0            # without the 10,000-env counter line

Modes, each measured for every n, in one run:
  template  RLPool("benchmarks/envs/numpy_env", n, spawn="template")
  exec      RLPool("benchmarks/envs/numpy_env", n, spawn="exec")
  async     gymnasium.vector.AsyncVectorEnv(context="fork", shared memory) over
            NumpyEnv, an in-process gymnasium.Env with the same logic (imports
            numpy, a float64[4] state, a seeded numpy Generator, ends at t >= 100)

and a separate line: RLPool("examples/counter", --counter-n, spawn="template")
started, reset, stepped 20 times, hard-reset and closed.

Columns of the markdown table (stdout; every figure also goes to
benchmarks/results/spawn.json, progress to stderr):

  mode, n         what was measured
  start (s)       wall time of the constructor: RLPool(...) returns when every
                  env has handshaken; AsyncVectorEnv(...) returns after forking
                  n workers and checking every worker's spaces
  hard reset (s)  wall time of pool.reset(seed=0, hard=True): every sandbox
                  killed and respawned, then reset. AsyncVectorEnv has no hard
                  reset: "n/a"
  env-steps/s     n x S / wall time of S batched steps (--steps, default 30,
                  after 3 untimed warm-up steps; no episode ends in the loop)
  worker/roundtrip ms  boltzlabs only: mean pool.timing of the timed steps
  MiB/env         boltzlabs: pool.memory().mean, the kernel's accounting (each
                  env's cgroup working set, kernel memory included, plus the
                  shared template spread over the n envs; PSS when no memory
                  cgroup). async: mean USS (psutil memory_full_info().uss) of
                  a worker process. DIFFERENT ACCOUNTING METHODS: USS leaves
                  out every page a forked worker still shares copy-on-write
                  with its parent and all kernel memory (page tables, pipes),
                  so it flatters AsyncVectorEnv; do not read the two as
                  like-for-like.
  USS MiB/env     the like-for-like column: mean USS of each env's process tree
                  (boltzlabs: the tree under pool.pids()[i]; async: the worker),
                  over a sample of at most --uss-sample envs
  envs/GiB        boltzlabs: pool.envs_per_gb(); async: 2**30 / USS per worker
  sys MiB/env     drop in the machine's available memory (psutil) from before
                  construction to after the step loop, per env: all costs, all
                  methods alike, but noisy when other jobs share the machine
  close (s)       wall time of pool.close() / AsyncVectorEnv.close()

A combination that cannot fit is skipped, not run: its memory need is
projected from the largest smaller n measured in the same mode (shared part
once + per-env part x n) and compared with --mem-budget-gib (default 80% of
the memory available just before that run). The counter line is sized the
same way from a 200-env counter pool started first, but runs whenever it
fits at all (available memory minus 1 GiB).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
try:
    import boltzlabs  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT))

import gymnasium as gym
import numpy as np
import psutil
from gymnasium.vector import AsyncVectorEnv

from bench_pool import run_record, uss_of_tree  # benchmarks/ is sys.path[0] when run as a script
from boltzlabs import RLPool

NUMPY_ENV = ROOT / "benchmarks" / "envs" / "numpy_env"
COUNTER = ROOT / "examples" / "counter"
RESULTS = ROOT / "benchmarks" / "results" / "spawn.json"
MIB = float(1 << 20)
GIB = float(1 << 30)
WARMUP_STEPS = 3
HORIZON = 100
MODES = ("template", "exec", "async")
COUNTER_PROBE_N = 200  # the small counter pool that sizes the big one


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- the gymnasium twin of benchmarks/envs/numpy_env ---------------------------------------


class NumpyEnv(gym.Env):
    """benchmarks/envs/numpy_env/env.py as a gymnasium.Env (numpy imported at module level)."""

    metadata = {"render_modes": []}

    def __init__(self):
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, shape=(4,), dtype=np.float64)
        self.action_space = gym.spaces.Discrete(2)
        self.t = 0
        self.x = np.zeros(4)
        self.rng = np.random.default_rng(0)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.rng = np.random.default_rng(seed)
        self.t = 0
        self.x = self.rng.uniform(-0.05, 0.05, size=4)
        return self.x.copy(), {}

    def step(self, action):
        self.t += 1
        x = 0.99 * self.x + 0.01 * (float(action) - 0.5) + self.rng.normal(0.0, 0.01, size=4)
        self.x = x
        return x.copy(), float(-np.dot(x, x)), self.t >= HORIZON, False, {}


# -- helpers -------------------------------------------------------------------------------


def sampled_uss(pids: list, sample: int) -> float:
    """Mean USS (bytes) of the trees under a random sample of pids (NaN when none)."""
    pids = [p for p in pids if p > 0]
    if len(pids) > sample:
        pids = random.Random(0).sample(pids, sample)
    values = [uss_of_tree(p) for p in pids]
    return float(np.mean(values)) if values else float("nan")


def used_bytes() -> int:
    vm = psutil.virtual_memory()
    return vm.total - vm.available


def settle() -> None:
    gc.collect()
    time.sleep(1.0)  # let the kernel finish tearing down the previous run's processes


def wait_for_quiet(max_load: float, max_wait_s: float) -> None:
    waited = 0.0
    while os.getloadavg()[0] > max_load and waited < max_wait_s:
        log(f"1-min load average {os.getloadavg()[0]:.1f} > {max_load}; waiting 30 s ({waited:.0f}/{max_wait_s:.0f} s)")
        time.sleep(30)
        waited += 30
    if os.getloadavg()[0] > max_load:
        log(f"warning: load average still {os.getloadavg()[0]:.1f}; measuring anyway")


def error_record(exc: BaseException, stage: str) -> dict:
    return {
        "error": f"{type(exc).__name__}: {exc}",
        "stage": stage,
        "traceback": "".join(traceback.format_exception(exc)),
    }


# -- boltzlabs -------------------------------------------------------------------------------


def timed_steps(pool: RLPool, actions: list, steps: int):
    worker, roundtrip, failed = [], [], 0
    started = time.perf_counter()
    for _ in range(steps):
        _, _, dones, infos = pool.step(actions)
        worker.append(pool.timing.worker_ms)
        roundtrip.append(pool.timing.roundtrip_ms)
        if dones.any():
            failed += sum(1 for info in infos if info and ("error" in info or "straggler" in info))
    return time.perf_counter() - started, worker, roundtrip, failed


def reset_failures(pool: RLPool, obs: list) -> int:
    return sum(1 for o, info in zip(obs, pool.reset_infos) if o is None or (info and "error" in info))


def bench_pool(source: Path, n: int, spawn: str, steps: int, uss_sample: int, hard_reset: bool = True) -> dict:
    result: dict = {"n": n, "mode": spawn, "source": str(source.relative_to(ROOT))}
    settle()
    used_before = used_bytes()
    stage = "start"
    log(f"[{source.name} {spawn} n={n}] starting pool")
    pool = None
    try:
        started = time.perf_counter()
        pool = RLPool(source, n, spawn=spawn, progress=False)
        result["start_s"] = time.perf_counter() - started
        result["spawn_in_use"] = pool.spawn
        log(f"[{source.name} {spawn} n={n}] ready in {result['start_s']:.2f} s")
        stage = "reset"
        obs = pool.reset(seed=0)
        result["reset_ms"] = pool.timing.roundtrip_ms
        result["reset_failures"] = reset_failures(pool, obs)
        stage = "step"
        actions = [1] * n
        timed_steps(pool, actions, WARMUP_STEPS)
        seconds, worker, roundtrip, failed = timed_steps(pool, actions, steps)
        result.update(
            steps=steps,
            step_s=seconds,
            env_steps_per_s=n * steps / seconds,
            worker_ms_mean=float(np.mean(worker)),
            roundtrip_ms_mean=float(np.mean(roundtrip)),
            step_failures=failed,
        )
        log(f"[{source.name} {spawn} n={n}] {result['env_steps_per_s']:,.0f} env-steps/s")
        stage = "memory"
        report = pool.memory()
        result.update(
            mem_per_env_mib=report.mean / MIB,
            mem_shared_mib=report.shared / MIB,
            mem_total_gib=report.total / GIB,
            envs_per_gib=pool.envs_per_gb(),
            mem_source=report.source,
            mem_note=report.note,
            sys_per_env_mib=(used_bytes() - used_before) / n / MIB,
            uss_per_env_mib=sampled_uss(pool.pids(), uss_sample) / MIB,
            uss_sampled=min(n, uss_sample),
        )
        if hard_reset:
            stage = "hard reset"
            log(f"[{source.name} {spawn} n={n}] hard reset")
            started = time.perf_counter()
            obs = pool.reset(seed=0, hard=True)
            result["hard_reset_s"] = time.perf_counter() - started
            result["hard_reset_failures"] = reset_failures(pool, obs)
            stage = "step after hard reset"
            _, _, _, failed = timed_steps(pool, actions, 1)
            result["step_failures_after_hard_reset"] = failed
            result["lanes_not_idle"] = sum(s != "idle" for s in pool.states())
            log(f"[{source.name} {spawn} n={n}] hard reset in {result['hard_reset_s']:.2f} s")
        stage = "close"
        started = time.perf_counter()
        pool.close()
        result["close_s"] = time.perf_counter() - started
    except Exception as exc:  # report it and go on with the next combination
        result.update(error_record(exc, stage))
        log(f"[{source.name} {spawn} n={n}] FAILED at {stage}: {result['error']}")
        if pool is not None:
            pool.close()
    return result


# -- gymnasium ------------------------------------------------------------------------------


def bench_async(n: int, steps: int, uss_sample: int) -> dict:
    result: dict = {"n": n, "mode": "async"}
    settle()
    used_before = used_bytes()
    stage = "start"
    log(f"[async n={n}] starting AsyncVectorEnv")
    envs = None
    try:
        started = time.perf_counter()
        envs = AsyncVectorEnv([NumpyEnv] * n, context="fork", shared_memory=True)
        result["start_s"] = time.perf_counter() - started
        log(f"[async n={n}] ready in {result['start_s']:.2f} s")
        stage = "reset"
        started = time.perf_counter()
        envs.reset(seed=0)
        result["reset_ms"] = (time.perf_counter() - started) * 1000.0
        stage = "step"
        actions = np.ones(n, dtype=np.int64)
        for _ in range(WARMUP_STEPS):
            envs.step(actions)
        started = time.perf_counter()
        for _ in range(steps):
            envs.step(actions)
        seconds = time.perf_counter() - started
        result.update(steps=steps, step_s=seconds, env_steps_per_s=n * steps / seconds)
        log(f"[async n={n}] {result['env_steps_per_s']:,.0f} env-steps/s")
        stage = "memory"
        uss = sampled_uss([p.pid for p in envs.processes], uss_sample)
        result.update(
            uss_per_env_mib=uss / MIB,
            uss_sampled=min(n, uss_sample),
            mem_per_env_mib=uss / MIB,
            envs_per_gib=GIB / uss,
            sys_per_env_mib=(used_bytes() - used_before) / n / MIB,
            mem_source="USS (psutil memory_full_info().uss) per worker process",
        )
        result["hard_reset_s"] = None  # AsyncVectorEnv has no hard reset
        stage = "close"
        started = time.perf_counter()
        envs.close()
        result["close_s"] = time.perf_counter() - started
    except Exception as exc:
        result.update(error_record(exc, stage))
        log(f"[async n={n}] FAILED at {stage}: {result['error']}")
        if envs is not None:
            try:
                envs.close(terminate=True)
            except Exception:
                pass
    return result


# -- skipping what cannot fit ------------------------------------------------------------------


def projected_gib(measured: dict, n: int) -> float | None:
    """Memory n envs of this mode would need, from a smaller measurement of the same mode."""
    if "error" in measured or "mem_per_env_mib" not in measured:
        return None
    m = measured["n"]
    shared = measured.get("mem_shared_mib", 0.0)
    private = (measured["mem_per_env_mib"] * m - shared) / m  # mean spreads the shared part over m envs
    if measured["mode"] == "async":
        private, shared = measured["uss_per_env_mib"], 0.0
    return (shared + private * n) / 1024.0


def skip_reason(mode: str, n: int, done: list, budget_gib: float) -> tuple[str, float] | None:
    smaller = [r for r in done if r["mode"] == mode and r["n"] < n and "error" not in r and "skipped" not in r]
    if not smaller:
        return None
    base = max(smaller, key=lambda r: r["n"])
    need = projected_gib(base, n)
    if need is not None and need > budget_gib:
        return f"skipped (would need ~{need:.1f} GiB; budget {budget_gib:.1f} GiB, from n={base['n']})", need
    return None


# -- report ------------------------------------------------------------------------------------


def fmt(value, spec: str, missing: str = "-") -> str:
    if value is None:
        return missing
    if isinstance(value, float) and value != value:
        return missing
    return format(value, spec)


def table(rows: list) -> str:
    head = [
        "mode",
        "n",
        "start (s)",
        "hard reset (s)",
        "env-steps/s",
        "worker ms",
        "roundtrip ms",
        "MiB/env",
        "USS MiB/env",
        "envs/GiB",
        "sys MiB/env",
        "close (s)",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "skipped" in r:
            cells = [r["mode"], str(r["n"]), r["skipped"]] + [""] * (len(head) - 3)
        elif "error" in r:
            cells = [r["mode"], str(r["n"]), f"FAILED at {r['stage']}: {r['error'][:200]}"] + [""] * (len(head) - 3)
        else:
            boltz = r["mode"] != "async"
            cells = [
                r["mode"]
                if r.get("spawn_in_use", r["mode"]) == r["mode"]
                else f"{r['mode']} (fell back to {r['spawn_in_use']})",
                str(r["n"]),
                fmt(r.get("start_s"), ".2f"),
                fmt(r.get("hard_reset_s"), ".2f", "n/a" if not boltz else "-"),
                fmt(r.get("env_steps_per_s"), ",.0f"),
                fmt(r.get("worker_ms_mean"), ".2f"),
                fmt(r.get("roundtrip_ms_mean"), ".2f"),
                fmt(r.get("mem_per_env_mib"), ".2f") + ("" if boltz else " (USS)"),
                fmt(r.get("uss_per_env_mib"), ".2f"),
                fmt(r.get("envs_per_gib"), ",.0f"),
                fmt(r.get("sys_per_env_mib"), ".2f"),
                fmt(r.get("close_s"), ".2f"),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def counter_line(c: dict) -> str:
    if "skipped" in c:
        return f"counter (template), n={c['n']}: {c['skipped']}"
    if "error" in c:
        return f"counter (template), n={c['n']}: FAILED at {c['stage']}: {c['error']}"
    return (
        f"counter (template), n={c['n']:,}: start {c['start_s']:.2f} s, "
        f"{c['env_steps_per_s']:,.0f} env-steps/s over {c['steps']} steps "
        f"(worker {c['worker_ms_mean']:.1f} ms, roundtrip {c['roundtrip_ms_mean']:.1f} ms per step), "
        f"hard reset {c['hard_reset_s']:.2f} s ({c['hard_reset_failures']} lane(s) failed), "
        f"{c['envs_per_gib']:,.0f} envs/GiB ({c['mem_per_env_mib']:.2f} MiB/env), close {c['close_s']:.2f} s"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--n", type=int, nargs="+", default=[100, 1000, 10000], help="pool sizes (default 100 1000 10000)"
    )
    parser.add_argument(
        "--modes", nargs="+", choices=MODES, default=list(MODES), help="what to measure (default: template exec async)"
    )
    parser.add_argument("--steps", type=int, default=30, help="timed batched steps per measurement (default 30)")
    parser.add_argument(
        "--counter-n",
        type=int,
        default=10000,
        help="size of the examples/counter template pool line (default 10000; 0 skips it)",
    )
    parser.add_argument(
        "--mem-budget-gib",
        type=float,
        default=None,
        help="skip a combination projected to need more (default: 80%% of available memory)",
    )
    parser.add_argument("--uss-sample", type=int, default=200, help="envs whose USS is read (default 200)")
    parser.add_argument(
        "--max-load",
        type=float,
        default=3.0,
        help="wait (up to --max-wait s) until the 1-min load average is below this",
    )
    parser.add_argument("--max-wait", type=float, default=300.0, help="seconds to wait for a quiet machine")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"JSON output (default {RESULTS.relative_to(ROOT)})")
    args = parser.parse_args(argv)
    if any(n < 1 for n in args.n) or args.steps < 1 or args.counter_n < 0:
        parser.error("--n and --steps must be positive, --counter-n at least 0")

    def budget() -> float:  # what is available now: other jobs may share the machine
        return args.mem_budget_gib or 0.8 * psutil.virtual_memory().available / GIB

    wait_for_quiet(args.max_load, args.max_wait)
    load_before = os.getloadavg()
    run_started = time.perf_counter()
    rows: list = []
    for n in sorted(args.n):
        for mode in args.modes:
            skip = skip_reason(mode, n, rows, budget())
            if skip:
                log(f"[{mode} n={n}] {skip[0]}")
                rows.append({"mode": mode, "n": n, "skipped": skip[0], "projected_gib": skip[1]})
                continue
            if mode == "async":
                rows.append(bench_async(n, args.steps, args.uss_sample))
            else:
                rows.append(bench_pool(NUMPY_ENV, n, mode, args.steps, args.uss_sample))
            rows[-1]["loadavg_1min_after"] = os.getloadavg()[0]
    counter = probe = None
    if args.counter_n:
        if args.counter_n > COUNTER_PROBE_N:
            # A small pool first, so that a pool that cannot fit is skipped, not run into the OOM killer.
            probe = bench_pool(COUNTER, COUNTER_PROBE_N, "template", 5, args.uss_sample, hard_reset=False)
        # The counter line is the stress test asked for: run it whenever it fits at all (1 GiB headroom).
        counter_budget = args.mem_budget_gib or psutil.virtual_memory().available / GIB - 1.0
        skip = skip_reason("template", args.counter_n, [probe] if probe else [], counter_budget)
        if skip:
            log(f"[counter n={args.counter_n}] {skip[0]}")
            counter = {"mode": "template", "n": args.counter_n, "skipped": skip[0], "projected_gib": skip[1]}
        else:
            counter = bench_pool(COUNTER, args.counter_n, "template", 20, args.uss_sample)
            counter["loadavg_1min_after"] = os.getloadavg()[0]
    total = time.perf_counter() - run_started
    load_after = os.getloadavg()

    print(table(rows))
    print()
    if counter is not None:
        print(counter_line(counter))
        print()
    sources = sorted({r["mem_source"] for r in rows + ([counter] if counter else []) if r.get("mem_source")})
    print(
        "MiB/env: boltzlabs rows are pool.memory().mean (kernel accounting, the shared template included); "
        "async rows are mean worker USS - different accounting methods, not like-for-like. "
        "USS MiB/env is the like-for-like column (sampled); sys MiB/env is the drop in available memory "
        "(noisy on a shared machine)."
    )
    for source in sources:
        print(f"memory source: {source}")
    print(
        f"memory budget for skipping: {budget():.1f} GiB now (--mem-budget-gib, else 80% of available "
        f"memory, checked before each run). Total run {total:.0f} s; 1-min load average "
        f"{load_before[0]:.2f} before, {load_after[0]:.2f} after; {os.cpu_count()} CPUs, "
        f"{psutil.virtual_memory().total / GIB:.0f} GiB."
    )

    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        **run_record(argv, total, load_before, load_after),
        "settings": {
            "steps": args.steps,
            "warmup_steps": WARMUP_STEPS,
            "modes": args.modes,
            "n": args.n,
            "mem_budget_gib": args.mem_budget_gib,
            "uss_sample": args.uss_sample,
            "async": {"context": "fork", "shared_memory": True},
        },
        "results": rows,
        "counter": counter,
        "counter_probe": probe,
    }
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
