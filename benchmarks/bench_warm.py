"""Warm templates for the env's real work: memory, hard reset and start-up per env and mode.

    python benchmarks/bench_warm.py                                 # n = 1000, every env and mode (~15 min)
    python benchmarks/bench_warm.py --n 200                         # a quick check
    python benchmarks/bench_warm.py --modes template async          # a subset of the modes
    python benchmarks/bench_warm.py --envs lazy_rng counter         # a subset of the envs
    python benchmarks/bench_warm.py --exec-n 1000                   # exec mode at the full n (slow)

Envs (each as an env directory for boltzlabs and as an equivalent in-process
gymnasium.Env for AsyncVectorEnv; every one imports numpy at module level
except the counter):
  counter      examples/counter: no numpy, the floor
  numpy_env    benchmarks/envs/numpy_env: makes a numpy Generator AT IMPORT,
               so numpy.random is loaded before the template forks
  lazy_rng     benchmarks/envs/lazy_rng: numpy.random first touched in reset
  lazy_linalg  benchmarks/envs/lazy_linalg: numpy.random in reset,
               numpy.linalg.solve in step
  lazy_heavy   benchmarks/envs/lazy_heavy: scipy.special imported in reset,
               expit in step (needs scipy: pip install 'boltzlabs[bench]';
               skipped with a note without it)

Modes:
  template         RLPool(env, n) - with warmup=True when the installed
                   boltzlabs takes `warmup` (the probe of issue 14), as-is
                   otherwise (the row then says "template")
  template-nowarm  RLPool(env, n, warmup=False); only when `warmup` is taken
  exec             RLPool(env, n, spawn="exec") at min(n, --exec-n) envs
                   (default 200: one interpreter per env is ~12-15 MiB and
                   ~40 ms of start-up each; the table says which n ran)
  async            gymnasium AsyncVectorEnv(context="fork", shared memory)
                   over the in-process twin

For every combination, in one run: start the pool; reset(seed=0); --steps
batched steps (every action 1); then read memory; then time
reset(seed=0, hard=True); one more step; close. A combination that would
not fit (projected from a --pilot-n pool of the same env and mode: the
shared part once plus the per-env part x n, against --mem-budget-gib,
default 60% of the memory available then) runs at the largest multiple of
100 that fits, and the table says so.

Columns of the markdown table (stdout; every figure also goes to
benchmarks/results/warm.json, progress to stderr):

  env, mode, n     what was measured
  start (s)        wall time of the constructor (RLPool: every env
                   handshaken, the probe included; async: n workers forked
                   and their spaces checked)
  probe (s)        the probe's own wall time, from
                   pool.env_contract["warmup"]["seconds"] ("-": no probe)
  reset (s)        wall time of the first reset(seed=0) of all n envs (what
                   the env's reset imports lazily, every env imports here)
  hard reset (s)   wall time of pool.reset(seed=0, hard=True), after one
                   reset and --steps steps; async has none ("n/a")
  MiB/env          boltzlabs: pool.memory().mean (the kernel's figure: each
                   env's cgroup, kernel memory included, plus the shared
                   template over n); async: mean USS per worker
  USS MiB/env      mean USS of each env's process tree (boltzlabs: under
                   pool.pids()[i]; async: the worker), sampled over at most
                   --uss-sample envs: the like-for-like column
  envs/GiB         boltzlabs: pool.envs_per_gb(); async: 2**30 / USS
  env-steps/s      n x steps / wall time of the --steps batched steps
                   (short: a sanity figure, not a throughput benchmark)
  modules          how many modules the probe found the env's work imports
                   (pool.env_contract["warmup"]["modules"])
  note             caps, and lanes that failed (reset, steps, hard reset:
                   a failed lane's memory is not an env's, so such a row's
                   memory figures are not comparable); the first error is
                   in the JSON

Pools get --step-timeout (default 120 s, not the policy's 30 s): on 2 cores
1000 envs each importing scipy in their first reset take longer than 30 s,
and every lane would come back a straggler (the start and reset columns
show that cost; a training run with the default timeout would see it as
failed lanes).
"""

from __future__ import annotations

import argparse
import inspect
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

import gymnasium as gym
import numpy as np
import psutil
from gymnasium.vector import AsyncVectorEnv

from bench_pool import CounterEnv, run_record  # benchmarks/ is sys.path[0] when run as a script
from bench_spawn import (
    NumpyEnv,
    error_record,
    fmt,
    log,
    reset_failures,
    sampled_uss,
    settle,
    timed_steps,
    used_bytes,
    wait_for_quiet,
)
from boltzlabs import RLPool

RESULTS = ROOT / "benchmarks" / "results" / "warm.json"
MIB = float(1 << 20)
GIB = float(1 << 30)
HORIZON = 100
MODES = ("template", "template-nowarm", "exec", "async")
ENV_DIRS = {
    "counter": ROOT / "examples" / "counter",
    "numpy_env": ROOT / "benchmarks" / "envs" / "numpy_env",
    "lazy_rng": ROOT / "benchmarks" / "envs" / "lazy_rng",
    "lazy_linalg": ROOT / "benchmarks" / "envs" / "lazy_linalg",
    "lazy_heavy": ROOT / "benchmarks" / "envs" / "lazy_heavy",
}


# -- the gymnasium twins of the env directories (same logic, in-process) ----------------------


class _Twin(gym.Env):
    """What the twins share: a float64[4] observation, actions 0 and 1."""

    metadata = {"render_modes": []}

    def __init__(self):
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, shape=(4,), dtype=np.float64)
        self.action_space = gym.spaces.Discrete(2)


class LazyRngEnv(_Twin):
    """benchmarks/envs/lazy_rng as a gymnasium.Env (the Generator made in reset)."""

    def __init__(self):
        super().__init__()
        self.t, self.x, self.rng = 0, np.zeros(4), None

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.rng = np.random.default_rng(seed)
        self.t = 0
        self.x = self.rng.uniform(-0.05, 0.05, size=4)
        return self.x.copy(), {}

    def step(self, action):
        self.t += 1
        self.x = x = 0.99 * self.x + 0.01 * (float(action) - 0.5) + self.rng.normal(0.0, 0.01, size=4)
        return x.copy(), float(-np.dot(x, x)), self.t >= HORIZON, False, {}


class LazyLinalgEnv(_Twin):
    """benchmarks/envs/lazy_linalg as a gymnasium.Env (np.linalg.solve in step)."""

    SIZE = 16

    def __init__(self):
        super().__init__()
        self.t, self.x, self.a, self.b, self.rng = 0, None, None, None, None

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.rng = rng = np.random.default_rng(seed)
        self.a = np.eye(self.SIZE) * 1.05 + rng.uniform(-0.02, 0.02, size=(self.SIZE, self.SIZE))
        self.b = rng.uniform(-0.1, 0.1, size=self.SIZE)
        self.x = rng.uniform(-0.05, 0.05, size=self.SIZE)
        self.t = 0
        return self.x[:4].copy(), {}

    def step(self, action):
        self.t += 1
        rhs = self.x + (float(action) - 0.5) * self.b
        self.x = x = np.linalg.solve(self.a, rhs) + self.rng.normal(0.0, 0.01, size=self.SIZE)
        return x[:4].copy(), float(-np.dot(x, x)), self.t >= HORIZON, False, {}


class LazyHeavyEnv(_Twin):
    """benchmarks/envs/lazy_heavy as a gymnasium.Env (scipy.special imported in reset)."""

    SIZE = 64

    def __init__(self):
        super().__init__()
        self.t, self.x, self.w, self.rng, self.expit = 0, None, None, None, None

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        from scipy import special  # in the worker, as the env directory does in each env

        self.expit = special.expit
        self.rng = rng = np.random.default_rng(seed)
        self.w = rng.normal(0.0, 1.0 / self.SIZE, size=(self.SIZE, self.SIZE))
        self.x = rng.uniform(0.4, 0.6, size=self.SIZE)
        self.t = 0
        return self.x[:4].copy(), {}

    def step(self, action):
        self.t += 1
        self.x = x = self.expit(self.w @ self.x + (float(action) - 0.5)) + self.rng.normal(0.0, 0.01, size=self.SIZE)
        d = x - 0.5
        return x[:4].copy(), float(-np.dot(d, d)), self.t >= HORIZON, False, {}


TWINS = {
    "counter": CounterEnv,
    "numpy_env": NumpyEnv,
    "lazy_rng": LazyRngEnv,
    "lazy_linalg": LazyLinalgEnv,
    "lazy_heavy": LazyHeavyEnv,
}


# -- what the installed boltzlabs can do -------------------------------------------------------


def takes_warmup() -> bool:
    """Whether RLPool takes `warmup=` (issue 14's probe); on older code it would be an env param."""
    return "warmup" in inspect.signature(RLPool.__init__).parameters


def warmup_report(pool) -> dict | None:
    """pool.env_contract's "warmup" entry (a mapping or an attribute), or None."""
    contract = pool.env_contract
    if isinstance(contract, dict):
        return contract.get("warmup")
    try:
        return contract["warmup"]
    except (TypeError, KeyError):
        return getattr(contract, "warmup", None)


def scipy_available() -> bool:
    try:
        import importlib.util

        return importlib.util.find_spec("scipy") is not None
    except Exception:
        return False


# -- one measurement -------------------------------------------------------------------------


def pool_kwargs(mode: str, warm: bool) -> dict:
    if mode == "exec":
        return {"spawn": "exec"}
    if mode == "template-nowarm":
        return {"spawn": "template", "warmup": False}
    return {"spawn": "template", **({"warmup": True} if warm else {})}


def first_error(pool, infos) -> str | None:
    for info in infos:
        if info and info.get("error"):
            return str(info["error"])[:500]
    return None


def bench_pool(
    env: str, mode: str, n: int, steps: int, uss_sample: int, warm: bool, step_timeout: float, full: bool = True
) -> dict:
    result: dict = {"env": env, "mode": mode, "n": n}
    source = ENV_DIRS[env]
    settle()
    used_before = used_bytes()
    stage, pool = "start", None
    label = f"[{env} {mode} n={n}{'' if full else ' pilot'}]"
    log(f"{label} starting pool")
    try:
        started = time.perf_counter()
        pool = RLPool(source, n, progress=False, step_timeout=step_timeout, **pool_kwargs(mode, warm))
        result["start_s"] = time.perf_counter() - started
        result["spawn_in_use"] = pool.spawn
        report = warmup_report(pool)
        if report is not None:
            result["warmup"] = report
        log(f"{label} ready in {result['start_s']:.2f} s")
        stage = "reset"
        started = time.perf_counter()
        obs = pool.reset(seed=0)
        result["reset_s"] = time.perf_counter() - started
        result["reset_failures"] = reset_failures(pool, obs)
        result["first_error"] = first_error(pool, pool.reset_infos)
        stage = "step"
        actions = [1] * n
        seconds, _, _, failed = timed_steps(pool, actions, steps)
        result.update(steps=steps, env_steps_per_s=n * steps / seconds, step_failures=failed)
        stage = "memory"
        memory = pool.memory()
        result.update(
            mem_per_env_mib=memory.mean / MIB,
            mem_shared_mib=memory.shared / MIB,
            envs_per_gib=pool.envs_per_gb(),
            mem_source=memory.source,
            sys_per_env_mib=(used_bytes() - used_before) / n / MIB,
        )
        if full:
            result.update(uss_per_env_mib=sampled_uss(pool.pids(), uss_sample) / MIB, uss_sampled=min(n, uss_sample))
            stage = "hard reset"
            log(f"{label} {result['mem_per_env_mib']:.2f} MiB/env; hard reset")
            started = time.perf_counter()
            obs = pool.reset(seed=0, hard=True)
            result["hard_reset_s"] = time.perf_counter() - started
            result["hard_reset_failures"] = reset_failures(pool, obs)
            stage = "step after hard reset"
            _, _, _, failed = timed_steps(pool, actions, 1)
            result["step_failures_after_hard_reset"] = failed
            log(f"{label} hard reset in {result['hard_reset_s']:.2f} s")
        stage = "close"
        pool.close()
    except Exception as exc:  # report it and go on with the next combination
        result.update(error_record(exc, stage))
        log(f"{label} FAILED at {stage}: {result['error']}")
        if pool is not None:
            pool.close()
    return result


def bench_async(env: str, n: int, steps: int, uss_sample: int, full: bool = True) -> dict:
    result: dict = {"env": env, "mode": "async", "n": n}
    settle()
    used_before = used_bytes()
    stage, envs = "start", None
    label = f"[{env} async n={n}{'' if full else ' pilot'}]"
    log(f"{label} starting AsyncVectorEnv")
    try:
        started = time.perf_counter()
        envs = AsyncVectorEnv([TWINS[env]] * n, context="fork", shared_memory=True)
        result["start_s"] = time.perf_counter() - started
        log(f"{label} ready in {result['start_s']:.2f} s")
        stage = "reset"
        started = time.perf_counter()
        envs.reset(seed=0)
        result["reset_s"] = time.perf_counter() - started
        stage = "step"
        actions = np.ones(n, dtype=np.int64)
        started = time.perf_counter()
        for _ in range(steps):
            envs.step(actions)
        seconds = time.perf_counter() - started
        result.update(steps=steps, env_steps_per_s=n * steps / seconds)
        stage = "memory"
        uss = sampled_uss([p.pid for p in envs.processes], uss_sample)
        result.update(
            uss_per_env_mib=uss / MIB,
            uss_sampled=min(n, uss_sample),
            mem_per_env_mib=uss / MIB,
            mem_shared_mib=0.0,
            envs_per_gib=GIB / uss,
            sys_per_env_mib=(used_bytes() - used_before) / n / MIB,
            mem_source="USS (psutil memory_full_info().uss) per worker process",
            hard_reset_s=None,
        )
        log(f"{label} {result['uss_per_env_mib']:.2f} MiB/env (USS)")
        stage = "close"
        envs.close()
    except Exception as exc:
        result.update(error_record(exc, stage))
        log(f"{label} FAILED at {stage}: {result['error']}")
        if envs is not None:
            try:
                envs.close(terminate=True)
            except Exception:
                pass
    return result


def fitting_n(pilot: dict, n: int, budget_gib: float) -> tuple[int, float]:
    """(the n to run, its projected GiB): n itself, or the largest multiple of 100 that fits."""
    m = pilot["n"]
    shared = pilot.get("mem_shared_mib", 0.0)
    private = (pilot["mem_per_env_mib"] * m - shared) / m
    if pilot["mode"] == "async":  # USS leaves out what workers share with the parent: count it once more
        private, shared = pilot["mem_per_env_mib"], 0.0
    need = (shared + private * n) / 1024.0
    if need <= budget_gib:
        return n, need
    fits = int((budget_gib * 1024.0 - shared) / max(private, 1e-9)) // 100 * 100
    return max(fits, 0), need


# -- report ----------------------------------------------------------------------------------


def mode_label(r: dict, warm: bool) -> str:
    mode = r["mode"]
    if mode == "template":
        mode = "template (probe on)" if warm else "template"
    if r.get("spawn_in_use") and r["spawn_in_use"] != ("exec" if r["mode"] == "exec" else "template"):
        mode += f" (fell back to {r['spawn_in_use']})"
    return mode


def table(rows: list, warm: bool) -> str:
    head = [
        "env",
        "mode",
        "n",
        "start (s)",
        "probe (s)",
        "reset (s)",
        "hard reset (s)",
        "MiB/env",
        "USS MiB/env",
        "envs/GiB",
        "env-steps/s",
        "modules",
        "note",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        note = r.get("note", "")
        if "skipped" in r:
            cells = [r["env"], r["mode"], str(r["n"])] + [""] * (len(head) - 4) + [r["skipped"]]
        elif "error" in r:
            cells = (
                [r["env"], r["mode"], str(r["n"])]
                + [""] * (len(head) - 4)
                + [f"FAILED at {r['stage']}: {r['error'][:160]}"]
            )
        else:
            report = r.get("warmup") or {}
            boltz = r["mode"] != "async"
            if report.get("error"):
                note = (note + "; " if note else "") + f"probe failed: {str(report['error'])[:80]}"
            failed = {
                what: r.get(key)
                for what, key in (
                    ("reset", "reset_failures"),
                    ("step", "step_failures"),
                    ("hard reset", "hard_reset_failures"),
                )
            }
            if any(failed.values()):
                note = (
                    (note + "; " if note else "")
                    + "FAILED lanes: "
                    + ", ".join(f"{count} at {what}" for what, count in failed.items() if count)
                )
            cells = [
                r["env"],
                mode_label(r, warm),
                str(r["n"]),
                fmt(r.get("start_s"), ".2f"),
                fmt(report.get("seconds"), ".2f"),
                fmt(r.get("reset_s"), ".2f"),
                fmt(r.get("hard_reset_s"), ".2f", "-" if boltz else "n/a"),
                fmt(r.get("mem_per_env_mib"), ".2f") + ("" if boltz else " (USS)"),
                fmt(r.get("uss_per_env_mib"), ".2f"),
                fmt(r.get("envs_per_gib"), ",.0f"),
                fmt(r.get("env_steps_per_s"), ",.0f"),
                str(len(report["modules"])) if report.get("modules") is not None else "-",
                note,
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1000, help="envs per pool (default 1000)")
    parser.add_argument(
        "--exec-n",
        type=int,
        default=200,
        help="cap on n in exec mode (default 200; one interpreter per env is slow to start)",
    )
    parser.add_argument(
        "--envs", nargs="+", choices=list(ENV_DIRS), default=list(ENV_DIRS), help="envs to measure (default: all)"
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=MODES,
        default=list(MODES),
        help="modes to measure (default: all; template-nowarm only where warmup= exists)",
    )
    parser.add_argument("--steps", type=int, default=10, help="batched steps before the memory reading (default 10)")
    parser.add_argument(
        "--pilot-n",
        type=int,
        default=50,
        help="size of the pool that projects a combination's memory first (default 50; 0: none)",
    )
    parser.add_argument(
        "--mem-budget-gib",
        type=float,
        default=None,
        help="largest projected pool memory to run (default: 60%% of available memory)",
    )
    parser.add_argument(
        "--step-timeout",
        type=float,
        default=120.0,
        help="the pools' step_timeout in seconds (default 120; see the docstring)",
    )
    parser.add_argument("--uss-sample", type=int, default=200, help="envs whose USS is read (default 200)")
    parser.add_argument(
        "--max-load",
        type=float,
        default=3.0,
        help="wait (up to --max-wait s) until the 1-min load average is below this",
    )
    parser.add_argument("--max-wait", type=float, default=120.0, help="seconds to wait for a quiet machine")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"JSON output (default {RESULTS.relative_to(ROOT)})")
    args = parser.parse_args(argv)
    if args.n < 1 or args.exec_n < 1 or args.steps < 1 or args.pilot_n < 0:
        parser.error("--n, --exec-n and --steps must be positive, --pilot-n at least 0")

    def budget() -> float:  # what is available now: other jobs may share the machine
        return args.mem_budget_gib or 0.6 * psutil.virtual_memory().available / GIB

    warm = takes_warmup()
    modes = [m for m in args.modes if m != "template-nowarm" or warm]
    if "template-nowarm" in args.modes and not warm:
        log("this boltzlabs takes no warmup= (no probe): template-nowarm is skipped, template runs as-is")
    wait_for_quiet(args.max_load, args.max_wait)
    load_before = os.getloadavg()
    run_started = time.perf_counter()
    rows: list = []
    for env in args.envs:
        if env == "lazy_heavy" and not scipy_available():
            log("lazy_heavy needs scipy (pip install 'boltzlabs[bench]'): skipped")
            rows.append({"env": env, "mode": "all", "n": args.n, "skipped": "scipy is not installed"})
            continue
        for mode in modes:
            n = min(args.n, args.exec_n) if mode == "exec" else args.n
            note = f"exec capped at --exec-n {args.exec_n}" if mode == "exec" and n < args.n else ""
            if args.pilot_n and n > args.pilot_n:
                pilot = (
                    bench_async(env, args.pilot_n, 3, args.uss_sample, full=False)
                    if mode == "async"
                    else bench_pool(env, mode, args.pilot_n, 3, args.uss_sample, warm, args.step_timeout, full=False)
                )
                if "error" in pilot:
                    rows.append(pilot)
                    continue
                fits, need = fitting_n(pilot, n, budget())
                if fits < n:
                    note = (
                        note + "; " if note else ""
                    ) + f"n={n} would need ~{need:.1f} GiB (from n={args.pilot_n}), budget {budget():.1f} GiB"
                    log(f"[{env} {mode}] {note}: running n={fits}")
                    n = fits
                if n < 1:
                    rows.append({"env": env, "mode": mode, "n": 0, "skipped": note})
                    continue
            row = (
                bench_async(env, n, args.steps, args.uss_sample)
                if mode == "async"
                else bench_pool(env, mode, n, args.steps, args.uss_sample, warm, args.step_timeout)
            )
            row["note"] = note
            row["loadavg_1min_after"] = os.getloadavg()[0]
            rows.append(row)
    total = time.perf_counter() - run_started
    load_after = os.getloadavg()

    print(table(rows, warm))
    print()
    print(
        f"boltzlabs {'takes warmup= (the probe): template is probe on, template-nowarm probe off' if warm else 'takes no warmup= (no probe): template is as-is'}. "
        "MiB/env: boltzlabs rows are pool.memory().mean (kernel accounting, the shared template included); "
        "async rows are mean worker USS (pages shared with the parent left out): not like-for-like; "
        "USS MiB/env is the like-for-like column (sampled). Hard reset after reset(seed=0) and the steps."
    )
    for source in sorted({r["mem_source"] for r in rows if r.get("mem_source")}):
        print(f"memory source: {source}")
    print(
        f"Total run {total:.0f} s; 1-min load average {load_before[0]:.2f} before, {load_after[0]:.2f} after; "
        f"{os.cpu_count()} CPUs, {psutil.virtual_memory().total / GIB:.0f} GiB."
    )

    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        **run_record(argv, total, load_before, load_after),
        "takes_warmup": warm,
        "settings": {
            "n": args.n,
            "exec_n": args.exec_n,
            "envs": args.envs,
            "modes": modes,
            "steps": args.steps,
            "pilot_n": args.pilot_n,
            "step_timeout": args.step_timeout,
            "mem_budget_gib": args.mem_budget_gib,
            "uss_sample": args.uss_sample,
        },
        "results": rows,
    }
    args.out.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
