"""Real Gymnasium envs: BoltzLabsVecEnv and RLPool against AsyncVectorEnv, SyncVectorEnv and EnvPool.

    python benchmarks/bench_envs.py                          # every env, n = 8 and 32 (~10 minutes)
    python benchmarks/bench_envs.py --envs halfcheetah --n 8 --rounds 7
    python benchmarks/bench_envs.py --only boltzlabs rlpool async   # a subset of the implementations
    python benchmarks/bench_envs.py --envs halfcheetah --n 32 --envs-per-sandbox 4 16   # grouped pools too

Envs (`pip install -e ".[bench]"` brings them: mujoco, box2d, ale-py with its
ROMs, opencv, envpool):
  halfcheetah  HalfCheetah-v5 (mujoco): obs float64[17], info four numpy scalars
  lunarlander  LunarLander-v3 (box2d): obs float32[8], discrete actions
  pong         ALE/Pong-v5 raw: obs uint8[210, 160, 3] (100,800 bytes)
  pong84       ALE/Pong-v5 with AtariPreprocessing and FrameStackObservation(4): uint8[4, 84, 84]
               (benchmarks/envs/pong84)

At each (env, n) every implementation is open at once, and they take turns:
the timed steps are cut into --rounds rounds, and in each round every
implementation runs one chunk of --chunk seconds' worth of steps (the order
rotates from round to round), so a burst of other work on this shared machine
hits them all alike. Figures are medians over the rounds:

  env-steps/s          n x steps / wall time of the chunk
  CPU us per env-step  each process's own scheduler counter (bench_pool.cpu_split),
                       read before and after every chunk, by role: client (this
                       process: the trainer, and for SyncVectorEnv and EnvPool
                       everything), worker and template (ours), envs
  overhead us          CPU per env-step minus the in-process cost: the same env
                       stepped here by one gymnasium.make, with the same actions
                       and autoresets, CPU time per step

Every implementation steps the same pre-drawn actions (a bank of 64 batches
sampled from the batched action space, seeded) with next-step autoreset:
BoltzLabsVecEnv, AsyncVectorEnv (fork, shared memory) and SyncVectorEnv
in their default NEXT_STEP mode, RLPool through step_full(actions,
resets=the lanes done at the previous step), EnvPool as it always autoresets.
EnvPool runs where it has the env (its Pong-v5 is made to emit raw RGB frames
for `pong`, 84 x 84 x 4 grey for `pong84`); it is the reference for what a C++
pool without isolation reaches.

--envs-per-sandbox K [K ...] adds, for each K > 1, BoltzLabsVecEnv over
RLPool(source, n, envs_per_sandbox=K) ("boltzlabs k=K": ceil(n / K) sandboxes
of K envs each, docs/groups.md), open and taking turns with the others (a K
past n is n; K = 1 is "boltzlabs" itself); with --pin-sandboxes, each of them
twice, the second with RLPool(pin_sandboxes=True) ("boltzlabs k=K pinned": each
sandbox on one CPU, in turn); with --eager-reset, once more with
RLPool(eager_reset=True) (and pinned with --pin-sandboxes: "boltzlabs k=K pinned
eager"; an ended episode's env resets while the trainer works). --pin-trainer
steps every implementation from this thread pinned to the first CPU, once all
have started (os.sched_setaffinity(0, {cpu}), as a trainer may). A second table gives each of ours
against AsyncVectorEnv, SyncVectorEnv, EnvPool and the limit: the cores this
process may use x SyncVectorEnv's rate, every core stepping envs and doing
nothing else.

A markdown table goes to stdout, progress to stderr, every figure (and the
load average before and after) to benchmarks/results/envs.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pool import ROOT, cpu_split, log, ours_groups, run_record, uss_of_tree

import gymnasium as gym
import numpy as np
import psutil

from boltzlabs import RLPool
from boltzlabs.cli import _positive_int  # the CLI's argparse type for a whole number >= 1
from boltzlabs.cli.bench import pool_sides  # the grouped pools to make: each k, pinned, eager
from boltzlabs.gym import BoltzLabsVecEnv

RESULTS = ROOT / "benchmarks" / "results" / "envs.json"
PONG84 = ROOT / "benchmarks" / "envs" / "pong84"
MIB = float(1 << 20)
BANK = 64  # batches of actions drawn once, stepped in turn


def _pong84():
    sys.path.insert(0, str(PONG84))
    try:
        from env import make  # benchmarks/envs/pong84/env.py (its serve() runs only as __main__)
    finally:
        sys.path.remove(str(PONG84))
    return make()


# name -> (RLPool source, a thunk making the same env here, EnvPool's id and kwargs or None)
ENVS = {
    "halfcheetah": ("gym://HalfCheetah-v5", lambda: gym.make("HalfCheetah-v5"), ("HalfCheetah-v5", {})),
    "lunarlander": ("gym://LunarLander-v3", lambda: gym.make("LunarLander-v3"), ("LunarLander-v3", {})),
    "pong": (
        "gym://ale_py:ALE/Pong-v5",
        lambda: gym.make("ale_py:ALE/Pong-v5"),
        (
            "Pong-v5",
            dict(
                img_height=210, img_width=160, gray_scale=False, stack_num=1, noop_max=1, repeat_action_probability=0.25
            ),
        ),
    ),
    "pong84": (str(PONG84), _pong84, ("Pong-v5", {})),
}
IMPLEMENTATIONS = ("boltzlabs", "rlpool", "async", "sync", "envpool")
OURS = ("boltzlabs", "rlpool")  # and "boltzlabs k=K" for each --envs-per-sandbox K > 1


VARIANTS = ("", " pinned", " eager", " pinned eager")  # a grouped pool's name ends in one of these


def grouped(k: int, pinned: bool = False, eager: bool = False) -> str:
    """The name of BoltzLabsVecEnv over RLPool(envs_per_sandbox=k), with pin_sandboxes=pinned and
    eager_reset=eager."""
    return f"boltzlabs k={k}{VARIANTS[pinned + 2 * eager]}"


def names_of(rows: list) -> list:
    """Every implementation of the rows, the fixed ones first, then the grouped ones by k."""
    found = {name for row in rows for name in row["results"]}
    ks = []
    for name in found:
        if name.startswith("boltzlabs k="):
            k, _, variant = name.removeprefix("boltzlabs k=").partition(" ")
            ks.append((int(k), VARIANTS.index(f" {variant}" if variant else "")))
    return [name for name in IMPLEMENTATIONS if name in found] + [
        grouped(k, bool(v & 1), bool(v & 2)) for k, v in sorted(ks)
    ]


def ours(name: str) -> bool:
    return name in OURS or name.startswith("boltzlabs k=")


def action_bank(space, n: int, seed: int = 0) -> list:
    batched = gym.vector.utils.batch_space(space, n)
    batched.seed(seed)
    return [batched.sample() for _ in range(BANK)]


class Impl:
    """One implementation at one (env, n): steps in chunks, keeps each chunk's figures."""

    name = ""

    def __init__(self, n: int, bank: list):
        self.n, self.bank, self.k = n, bank, 0
        self.groups: dict = {}  # role -> psutil.Process objects whose CPU counts here (client is this process)
        self.chunks: list = []  # (seconds, steps, {role: CPU seconds})

    def step(self, actions) -> None:
        raise NotImplementedError

    def warm(self, steps: int) -> None:
        for _ in range(steps):
            self.step(self.bank[self.k % BANK])
            self.k += 1

    def timed(self, steps: int) -> None:
        before = cpu_split(self.groups, self_last=True)
        started = time.perf_counter()
        bank, k = self.bank, self.k
        for i in range(steps):
            self.step(bank[(k + i) % BANK])
        seconds = time.perf_counter() - started
        after = cpu_split(self.groups, self_last=False)
        self.k += steps
        self.chunks.append((seconds, steps, {role: after[role] - before[role] for role in after}))

    def figures(self) -> dict:
        n = self.n
        rates = [n * steps / seconds for seconds, steps, _ in self.chunks]
        roles = sorted({role for _, _, cpu in self.chunks for role in cpu})
        by = {
            role: statistics.median(1e6 * cpu.get(role, 0.0) / (n * steps) for _, steps, cpu in self.chunks)
            for role in roles
        }
        total = statistics.median(1e6 * sum(cpu.values()) / (n * steps) for _, steps, cpu in self.chunks)
        return {
            "env_steps_per_s": statistics.median(rates),
            "rates": rates,
            "cpu_us_per_env_step": total,
            "cpu_us_per_env_step_by": by,
            "steps": sum(s for _, s, _ in self.chunks),
        }

    def close(self) -> None:
        pass


class Ours(Impl):
    """BoltzLabsVecEnv over an RLPool (name "boltzlabs"), or the RLPool itself ("rlpool"); with
    k > 1, BoltzLabsVecEnv over RLPool(envs_per_sandbox=k) ("boltzlabs k=K"), with
    pin_sandboxes=True when pinned ("boltzlabs k=K pinned") and eager_reset=True when eager."""

    def __init__(self, n, bank, source, adapter: bool, k: int = 1, pinned: bool = False, eager: bool = False):
        super().__init__(n, bank)
        self.name = grouped(k, pinned, eager) if k > 1 else "boltzlabs" if adapter else "rlpool"
        options: dict = {"envs_per_sandbox": k} if k > 1 else {}
        if pinned:
            options["pin_sandboxes"] = True
        if eager:
            options["eager_reset"] = True
        started = time.perf_counter()
        self.pool = RLPool(source, n, progress=False, **options)
        self.startup = time.perf_counter() - started
        self.vec = BoltzLabsVecEnv(self.pool) if adapter else None
        if self.vec is not None:
            self.vec.reset(seed=0)
        else:
            self.pool.reset(seed=0)
        self.resets = None

    def step(self, actions) -> None:
        if self.vec is not None:
            self.vec.step(actions)
            return
        result = self.pool.step_full(actions, self.resets)
        done = np.flatnonzero(result.terminated | result.truncated)
        self.resets = done.tolist() if done.size else None

    @property
    def sandboxes_pool(self):
        """The pool whose lanes are the sandboxes: the pool itself, or a grouped pool's inner one."""
        return getattr(self.pool, "inner", self.pool)

    @property
    def worker_pid(self) -> int:
        return self.sandboxes_pool._proc.pid

    def figures(self) -> dict:
        pool = self.pool
        # A sandbox's tree once, however many envs it holds (pids() repeats it for each).
        uss = [uss_of_tree(pid) for pid in set(pool.pids()) if pid > 0]
        return {
            **super().figures(),
            "envs_per_sandbox": getattr(pool, "envs_per_sandbox", 1),
            "sandboxes": getattr(pool, "sandboxes", pool.n),
            "envs_per_gb": pool.envs_per_gb(),
            "startup_s": self.startup,
            "fast_path": pool.fast_path,
            "channel": pool.channel,
            "spawn": pool.spawn,
            "memory_per_env_mib": pool.memory().mean / MIB,
            "uss_per_env_mib": sum(uss) / self.n / MIB if uss else None,
            "failed_lanes": sum(state != "idle" for state in pool.states()),
        }

    def close(self) -> None:
        (self.vec or self.pool).close()


class Vector(Impl):
    """Gymnasium's AsyncVectorEnv (fork, shared memory) or SyncVectorEnv, NEXT_STEP autoreset."""

    def __init__(self, n, bank, make, kind: str):
        super().__init__(n, bank)
        self.name = kind
        started = time.perf_counter()
        if kind == "async":
            self.envs = gym.vector.AsyncVectorEnv([make] * n, context="fork")
        else:
            self.envs = gym.vector.SyncVectorEnv([make] * n)
        self.startup = time.perf_counter() - started
        self.envs.reset(seed=0)

    def step(self, actions) -> None:
        self.envs.step(actions)

    def figures(self) -> dict:
        out = {**super().figures(), "startup_s": self.startup}
        if self.name == "async":
            out["uss_per_env_mib"] = float(np.mean([uss_of_tree(p.pid) for p in self.envs.processes])) / MIB
        return out

    def close(self) -> None:
        self.envs.close()


class EnvPool(Impl):
    """envpool.make_gymnasium(id, num_envs=n): its own threads, in this process."""

    name = "envpool"

    def __init__(self, n, bank, envpool_id, kwargs):
        super().__init__(n, bank)
        import envpool

        started = time.perf_counter()
        self.envs = envpool.make_gymnasium(envpool_id, num_envs=n, seed=0, **kwargs)
        self.startup = time.perf_counter() - started
        self.envs.reset()
        self.discrete = isinstance(self.envs.action_space, gym.spaces.Discrete)

    def step(self, actions) -> None:
        self.envs.step(actions)

    def figures(self) -> dict:
        return {**super().figures(), "startup_s": self.startup}

    def close(self) -> None:
        self.envs.close()


def in_process(make, bank: list, steps: int) -> float:
    """CPU microseconds of one env.step (autoresets included) in this process, with lane 0's actions."""
    env = make()
    env.reset(seed=0)
    actions = [batch[0] for batch in bank]
    for _ in range(2):  # a warm pass, then the timed one
        started = time.process_time()
        for i in range(steps):
            _, _, terminated, truncated, _ = env.step(actions[i % BANK])
            if terminated or truncated:
                env.reset()
        seconds = time.process_time() - started
    env.close()
    return 1e6 * seconds / steps


def bench(
    env: str,
    n: int,
    rounds: int,
    chunk_s: float,
    only,
    ks=(),
    pinned: bool = False,
    eager: bool = False,
    pin_trainer: bool = False,
) -> dict:
    source, make, envpool_spec = ENVS[env]
    probe = make()
    bank = action_bank(probe.action_space, n)
    probe.close()
    gc.collect()
    impls = []
    allowed = os.sched_getaffinity(0)
    try:
        # Forked workers first: they must not inherit the pools' sockets.
        if "async" in only:
            log(f"[{env} n={n}] starting AsyncVectorEnv")
            impls.append(Vector(n, bank, make, "async"))
        if "sync" in only:
            impls.append(Vector(n, bank, make, "sync"))
        for adapter in (True, False):
            if ("boltzlabs" if adapter else "rlpool") in only:
                log(f"[{env} n={n}] starting {'BoltzLabsVecEnv' if adapter else 'RLPool'}")
                impls.append(Ours(n, bank, source, adapter))
        for k, pin, early in pool_sides(ks, n, pinned, eager):
            if k == 1:  # "boltzlabs" itself, above
                continue
            log(
                f"[{env} n={n}] starting BoltzLabsVecEnv over "
                f"RLPool(envs_per_sandbox={k}, pin_sandboxes={pin}, eager_reset={early})"
            )
            impls.append(Ours(n, bank, source, True, k, pin, early))
        if "envpool" in only and envpool_spec is not None:
            impls.append(EnvPool(n, bank, *envpool_spec))
        for impl in impls:
            if isinstance(impl, Vector) and impl.name == "async":
                impl.groups = {"envs": [psutil.Process(p.pid) for p in impl.envs.processes]}
        for impl in impls:
            if isinstance(impl, Ours):
                worker = psutil.Process(impl.worker_pid)
                impl.groups = ours_groups([worker] + worker.children(recursive=True), impl.sandboxes_pool)
        if pin_trainer:
            # This thread (every implementation's trainer) on the first CPU, once every process
            # has started with all of them: what a user does with os.sched_setaffinity(0, {cpu}).
            os.sched_setaffinity(0, {min(allowed)})
        for impl in impls:
            impl.warm(20)
        # Steps per chunk, per implementation: about chunk_s seconds each.
        steps = {}
        for impl in impls:
            started = time.perf_counter()
            impl.warm(10)
            per_step = (time.perf_counter() - started) / 10
            steps[impl.name] = max(10, int(chunk_s / max(per_step, 1e-6)))
        cost = in_process(make, bank, max(200, min(steps.values()) * 2))
        log(
            f"[{env} n={n}] in-process {cost:.1f} us/step; timing {rounds} rounds of "
            + ", ".join(f"{k} {v}" for k, v in steps.items())
            + " steps"
        )
        for r in range(rounds):
            for impl in impls[r % len(impls) :] + impls[: r % len(impls)]:
                impl.timed(steps[impl.name])
        figures = {impl.name: impl.figures() for impl in impls}
    finally:
        os.sched_setaffinity(0, allowed)
        for impl in impls:
            impl.close()
    for fig in figures.values():
        fig["overhead_us"] = fig["cpu_us_per_env_step"] - cost
    log(
        f"[{env} n={n}] "
        + "; ".join(f"{k} {v['env_steps_per_s']:,.0f}/s {v['cpu_us_per_env_step']:.1f} us" for k, v in figures.items())
    )
    cores = len(os.sched_getaffinity(0))
    sync = figures.get("sync", {}).get("env_steps_per_s")
    return {
        "env": env,
        "n": n,
        "in_process_us": cost,
        "cores": cores,
        # All cores stepping envs and nothing else: what no pool of processes can pass here.
        "limit_env_steps_per_s": cores * sync if sync else None,
        "load": os.getloadavg(),
        "results": figures,
    }


def table(rows: list) -> str:
    names = names_of(rows)
    head = (
        ["env", "n"]
        + [f"{name} env-steps/s" for name in names]
        + ["ours / async", "ours / envpool", "boltzlabs / rlpool", "load"]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        res = row["results"]
        rate = {k: v["env_steps_per_s"] for k, v in res.items()}

        def ratio(a, b):
            return f"{rate[a] / rate[b]:.2f}x" if a in rate and b in rate else "n/a"

        cells = [row["env"], str(row["n"])] + [f"{rate[k]:,.0f}" if k in rate else "n/a" for k in names]
        cells += [
            ratio("boltzlabs", "async"),
            ratio("boltzlabs", "envpool"),
            ratio("boltzlabs", "rlpool"),
            f"{row['load'][0]:.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratio_table(rows: list) -> str:
    """Each of ours against AsyncVectorEnv, SyncVectorEnv, EnvPool and the limit (cores x SyncVectorEnv)."""
    head = ["env", "n", "impl", "env-steps/s", "/ async", "/ sync", "/ envpool", "/ limit"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        res = row["results"]
        rate = {k: v["env_steps_per_s"] for k, v in res.items()}
        if row.get("limit_env_steps_per_s"):
            rate["limit"] = row["limit_env_steps_per_s"]
        for name in names_of([row]):
            if not ours(name):
                continue
            cells = [row["env"], str(row["n"]), name, f"{rate[name]:,.0f}"]
            cells += [
                f"{rate[name] / rate[b]:.2f}x" if b in rate else "n/a" for b in ("async", "sync", "envpool", "limit")
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cpu_table(rows: list) -> str:
    head = ["env", "n", "impl", "client", "worker", "template", "envs", "total", "in-process", "overhead"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        for name in names_of([row]):
            fig = row["results"].get(name)
            if fig is None:
                continue
            by = fig["cpu_us_per_env_step_by"]
            cells = [row["env"], str(row["n"]), name] + [
                f"{by[k]:.1f}" if k in by else "" for k in ("client", "worker", "template", "envs")
            ]
            cells += [f"{fig['cpu_us_per_env_step']:.1f}", f"{row['in_process_us']:.1f}", f"{fig['overhead_us']:.1f}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", nargs="+", choices=sorted(ENVS), default=list(ENVS))
    parser.add_argument("--n", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of chunks, the implementations taking turns")
    parser.add_argument("--chunk", type=float, default=1.0, help="seconds each implementation's chunk should take")
    parser.add_argument("--only", nargs="+", choices=IMPLEMENTATIONS, default=list(IMPLEMENTATIONS))
    parser.add_argument(
        "--envs-per-sandbox",
        type=_positive_int,
        nargs="+",
        default=[],
        metavar="K",
        help="also BoltzLabsVecEnv over RLPool(envs_per_sandbox=K) for each K > 1 (docs/groups.md)",
    )
    parser.add_argument(
        "--pin-sandboxes",
        action="store_true",
        help="each grouped pool twice: as the kernel places its sandboxes, and with RLPool(pin_sandboxes=True)",
    )
    parser.add_argument(
        "--eager-reset",
        action="store_true",
        help="each grouped pool once more with RLPool(eager_reset=True) (pinned too with --pin-sandboxes)",
    )
    parser.add_argument(
        "--pin-trainer",
        action="store_true",
        help="step every implementation from a thread pinned to the first CPU (once all have started)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    started = time.perf_counter()
    rows = [
        bench(
            env,
            n,
            args.rounds,
            args.chunk,
            args.only,
            args.envs_per_sandbox,
            args.pin_sandboxes,
            args.eager_reset,
            args.pin_trainer,
        )
        for env in args.envs
        for n in args.n
    ]
    total = time.perf_counter() - started
    load_after = os.getloadavg()
    print(table(rows))
    print()
    print(ratio_table(rows))
    print()
    print(
        f"limit: {rows[0]['cores']} cores x SyncVectorEnv's env-steps/s (every core stepping envs, nothing else); "
        "n/a where SyncVectorEnv or EnvPool was not run"
    )
    print()
    print(cpu_table(rows))
    print()
    print(
        f"CPU microseconds per env-step, medians over {args.rounds} rounds; 1-min load average "
        f"{load_before[0]:.2f} before, {load_after[0]:.2f} after; {total:.0f} s."
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                **run_record(argv, total, load_before, load_after),
                "settings": vars(args) | {"out": str(args.out)},
                "rows": rows,
            },
            indent=2,
            default=str,
        )
        + "\n"
    )
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
