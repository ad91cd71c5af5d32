"""boltzlabs RLPool vs gymnasium AsyncVectorEnv on the same counter env.

    python benchmarks/bench_pool.py                  # n = 64, 256, 1000; steps adapted
    python benchmarks/bench_pool.py --n 64 256 --steps 2000
    python benchmarks/bench_pool.py --env numpy      # benchmarks/envs/numpy_env and its twin
    python benchmarks/bench_pool.py --env image      # benchmarks/envs/image_env: Atari-sized frames

For each n, in one run:
  * RLPool("examples/counter", n): start-up (construction), env-steps/s over
    reset(seed) + S steps of actions all 1 with reset(where=dones) when any
    env is done, mean timing.worker_ms / roundtrip_ms of the steps, memory
    per env (pool.memory().mean) and pool.envs_per_gb().
  * gymnasium.vector.AsyncVectorEnv (fork, shared memory, SAME_STEP
    autoreset) over an equivalent gymnasium.Env: start-up, env-steps/s over
    the same S steps, USS per worker process.
  * CPU microseconds per env-step by process, from each process's own
    scheduler counter read before and after every timed chunk: client (this
    process), worker, template and envs for boltzlabs; client and envs for
    AsyncVectorEnv. Which step path the worker ran (pool.fast_path: native
    or pure Python, BOLTZLABS_PURE=1) is in the table.
Both stay open at one n and take turns in --rounds chunks of the S steps, so
other work on a shared machine slows both alike. A markdown table goes to
stdout, progress to stderr, and every figure to benchmarks/results/pool.json.
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
    import boltzlabs
except ImportError:
    sys.path.insert(0, str(ROOT))

import gymnasium as gym
import numpy as np
import psutil

from boltzlabs.cli.bench import cpu_seconds, sched_ns
from gymnasium.vector import AsyncVectorEnv, AutoresetMode

import boltzlabs
from boltzlabs import RLPool

COUNTER = ROOT / "examples" / "counter"
NUMPY_ENV = ROOT / "benchmarks" / "envs" / "numpy_env"
IMAGE_ENV = ROOT / "benchmarks" / "envs" / "image_env"
SOURCES = {"counter": COUNTER, "numpy": NUMPY_ENV, "image": IMAGE_ENV}
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


class ImageEnv(gym.Env):
    """benchmarks/envs/image_env/env.py as a gymnasium.Env: the same frames and
    drawing (AsyncVectorEnv passes observations through shared memory)."""

    metadata = {"render_modes": []}
    HEIGHT, WIDTH, SPRITE = 210, 160, 12

    def __init__(self):
        self.observation_space = gym.spaces.Box(0, 255, (self.HEIGHT, self.WIDTH, 3), np.uint8)
        self.action_space = gym.spaces.Discrete(2)
        self.frame, self.t, self.y, self.x = None, 0, 0, 0

    def _draw(self, value: int) -> None:
        self.frame[self.y : self.y + self.SPRITE, self.x : self.x + self.SPRITE] = value

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        rng = np.random.default_rng(seed)
        self.frame = np.zeros((self.HEIGHT, self.WIDTH, 3), np.uint8)
        self.t = 0
        self.y, self.x = int(rng.integers(self.HEIGHT - self.SPRITE)), int(rng.integers(self.WIDTH - self.SPRITE))
        self._draw(255)
        return self.frame, {}

    def step(self, action):
        self.t += 1
        self._draw(0)
        self.x = (self.x + (3 if action else -3)) % (self.WIDTH - self.SPRITE)
        self.y = (self.y + 1) % (self.HEIGHT - self.SPRITE)
        self._draw(255)
        return self.frame, self.x / self.WIDTH, self.t >= HORIZON, False, {}


# -- helpers -------------------------------------------------------------------------------


def uss_of_tree(pid: int) -> int:
    """USS of a process and all its descendants, in bytes (0 if it is gone)."""
    if pid <= 0:
        return 0
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


# CPU time from the scheduler's own counters (boltzlabs bench reads them the same way).
_runtime_ns = sched_ns
_proc_seconds = cpu_seconds


def cpu_split(groups: dict, self_last: bool) -> dict:
    """CPU seconds of this process ("client") and of each group of `groups`
    (name -> psutil.Process objects), each from the process's own counters.

    CPU time moves less than wall time when other work shares the machine.
    Read this process last before a loop and first after it, so the reading
    itself is left out. A process that ended between two readings drops out
    of the second: the counter envs never end inside the timed loop (their
    resets are soft), so nothing is lost there.
    """
    me = psutil.Process()
    out = {}
    if not self_last:
        out["client"] = _proc_seconds(me)
    for name, procs in groups.items():
        out[name] = sum(_proc_seconds(proc) for proc in procs)
    if self_last:
        out["client"] = _proc_seconds(me)
    return out


def pick_steps(per_step_s: float, target_s: float, lo: int = HORIZON, hi: int = 100_000) -> int:
    """Steps that make a timed loop last about target_s, rounded to whole episodes."""
    steps = int(target_s / max(per_step_s, 1e-6))
    steps = max(lo, min(hi, steps))
    return max(HORIZON, round(steps / HORIZON) * HORIZON)


def check(label: str, n: int, steps: int, reward: float | None, episodes: int) -> None:
    """Every env must have stepped every time: reward 1 per env-step (the
    counter; None: not checked), one episode end per 100 steps."""
    want_episodes = n * (steps // HORIZON)
    if (reward is not None and reward != n * steps) or episodes != want_episodes:
        log(
            f"WARNING [{label}]: total reward {reward:g} (expected {n * steps}), episodes ended {episodes} "
            f"(expected {want_episodes}): some env-steps did not happen as they should"
        )


class Side:
    """One contender: a vector of n counters that steps in chunks and keeps score.

    Both sides stay open for the whole measurement at one n and take turns,
    chunk by chunk, so a burst of other work on the machine hits both alike.
    """

    name = ""
    exact_reward = True  # the counter's reward is 1 per env-step; the numpy env's is not

    def __init__(self, n: int):
        self.n = n
        self.seconds = 0.0
        self.cpu: dict = {}  # group -> CPU seconds over the timed loops
        self.steps = 0
        self.reward = 0.0
        self.episodes = 0
        self.groups: dict = {}  # group name -> psutil.Process objects whose CPU counts for this side

    def loop(self, steps: int, record: bool = False) -> tuple:
        """Run `steps` steps; returns (total reward, episodes ended)."""
        raise NotImplementedError

    def timed(self, steps: int) -> None:
        before = cpu_split(self.groups, self_last=True)
        started = time.perf_counter()
        reward, episodes = self.loop(steps, record=True)
        self.seconds += time.perf_counter() - started
        after = cpu_split(self.groups, self_last=False)
        for name, value in after.items():
            self.cpu[name] = self.cpu.get(name, 0.0) + value - before[name]
        self.steps += steps
        self.reward += reward
        self.episodes += episodes

    def figures(self) -> dict:
        n, steps = self.n, self.steps
        check(f"{self.name} n={n}", n, steps, self.reward if self.exact_reward else None, self.episodes)
        return {
            "steps": steps,
            "seconds": self.seconds,
            "env_steps_per_s": n * steps / self.seconds,
            "ms_per_step": 1000.0 * self.seconds / steps,
            "cpu_us_per_env_step": 1e6 * sum(self.cpu.values()) / (n * steps),
            # Per process group: client (this process), worker, template, envs.
            "cpu_us_per_env_step_by": {name: 1e6 * value / (n * steps) for name, value in self.cpu.items()},
            "total_reward": self.reward,
            "episodes_ended": self.episodes,
        }


class Ours(Side):
    """RLPool over examples/counter: step all ones, reset(where=dones) when any is done."""

    name = "boltzlabs"

    def __init__(self, n: int, spawn: str | None, env: str = "counter", k: int = 1):
        super().__init__(n)
        self.exact_reward = env == "counter"
        options: dict = {"spawn": spawn} if spawn else {}  # else the library's default
        if k > 1:
            options["envs_per_sandbox"] = k
            self.name = f"boltzlabs k={k}"
        started = time.perf_counter()
        self.pool = RLPool(SOURCES[env], n, progress=False, **options)
        self.startup = time.perf_counter() - started
        self.actions = [1] * n
        self.worker_ms: list = []
        self.roundtrip_ms: list = []

    def reset(self) -> None:
        self.pool.reset(seed=0)

    def loop(self, steps: int, record: bool = False) -> tuple:
        pool, actions = self.pool, self.actions
        reward = 0.0
        episodes = 0
        for _ in range(steps):
            _, rewards, dones, _ = pool.step(actions)
            reward += float(rewards.sum())
            if record:
                self.worker_ms.append(pool.timing.worker_ms)
                self.roundtrip_ms.append(pool.timing.roundtrip_ms)
            if dones.any():
                episodes += int(dones.sum())
                pool.reset(where=dones)
        return reward, episodes

    def figures(self) -> dict:
        pool = self.pool
        report = pool.memory()
        uss = [uss_of_tree(pid) for pid in pool.pids() if pid > 0]
        return {
            "startup_s": self.startup,
            **super().figures(),
            "worker_ms_mean": float(np.mean(self.worker_ms)),
            "roundtrip_ms_mean": float(np.mean(self.roundtrip_ms)),
            "worker_ms_median": float(np.median(self.worker_ms)),
            "roundtrip_ms_median": float(np.median(self.roundtrip_ms)),
            "spawn": getattr(pool, "spawn", None),
            "fast_path": getattr(pool, "fast_path", None),
            "channel": getattr(pool, "channel", None),  # "pipes" or "socketpair" (docs/wire.md#the-channel)
            "memory_per_env_mib": report.mean / MIB,
            "memory_shared_mib": getattr(report, "shared", 0) / MIB,
            "memory_source": report.source,
            "memory_note": report.note,
            "envs_per_gb": pool.envs_per_gb(),
            "uss_per_env_mib": float(np.mean(uss)) / MIB if uss else None,
            "lanes_not_idle_after": sum(state != "idle" for state in pool.states()),
        }

    def close(self) -> None:
        self.pool.close()


class Async(Side):
    """gymnasium AsyncVectorEnv (fork, shared memory, SAME_STEP autoreset) over CounterEnv."""

    name = "async"

    def __init__(self, n: int, env: str = "counter"):
        super().__init__(n)
        self.exact_reward = env == "counter"
        if env == "counter":
            twin = CounterEnv
        elif env == "image":
            twin = ImageEnv
        else:
            from bench_spawn import NumpyEnv  # benchmarks/ is sys.path[0] when run as a script

            twin = NumpyEnv
        started = time.perf_counter()
        self.envs = AsyncVectorEnv([twin] * n, context="fork", autoreset_mode=AutoresetMode.SAME_STEP)
        self.startup = time.perf_counter() - started
        self.actions = np.ones(n, dtype=np.int64)

    def reset(self) -> None:
        self.envs.reset(seed=0)

    def loop(self, steps: int, record: bool = False) -> tuple:
        envs, actions = self.envs, self.actions
        reward = 0.0
        episodes = 0
        for _ in range(steps):
            # SAME_STEP autoreset: a done env is reset inside the step that ended it.
            _, rewards, terminated, truncated, _ = envs.step(actions)
            reward += float(rewards.sum())
            episodes += int(np.count_nonzero(terminated | truncated))
        return reward, episodes

    def figures(self) -> dict:
        uss = [uss_of_tree(p.pid) for p in self.envs.processes]
        return {
            "startup_s": self.startup,
            **super().figures(),
            "uss_per_env_mib": float(np.mean(uss)) / MIB,
        }

    def close(self) -> None:
        self.envs.close()


def ours_groups(procs: list, pool) -> dict:
    """The pool's processes by role: the worker, the envs (each env's host
    pid and everything under it) and the template (the rest: its bwrap and
    the warm interpreter the envs fork from)."""
    worker = getattr(pool, "inner", pool)._proc.pid  # a grouped pool's inner pool holds the worker
    env_pids = {pid for pid in pool.pids() if pid > 0}
    parents = {p.pid: p.ppid() for p in procs}
    groups = {"worker": [], "template": [], "envs": []}
    for proc in procs:
        pid, role = proc.pid, "template"
        if pid == worker:
            role = "worker"
        else:
            while pid in parents:  # an env's own children count as the env
                if pid in env_pids:
                    role = "envs"
                    break
                pid = parents[pid]
        groups[role].append(proc)
    return groups


def bench(
    n: int, steps: int | None, target_s: float, spawn: str | None, rounds: int, env: str = "counter", k: int = 1
) -> tuple:
    """Both sides at one n: (ours figures, async figures)."""
    gc.collect()
    # AsyncVectorEnv first: its forked workers must not inherit the pool's socket.
    log(f"[n={n}] starting AsyncVectorEnv")
    theirs = Async(n, env)
    ours = None
    try:
        log(f"[n={n}] async start-up {theirs.startup:.2f} s; starting RLPool")
        ours = Ours(n, spawn, env, k)
        log(f"[n={n}] boltzlabs start-up {ours.startup:.2f} s")
        mine = {p.pid for p in theirs.envs.processes}
        everything = psutil.Process().children(recursive=True)
        theirs.groups = {"envs": [p for p in everything if p.pid in mine]}
        ours.groups = ours_groups([p for p in everything if p.pid not in mine], ours.pool)
        for side in (ours, theirs):
            side.reset()
            side.loop(WARMUP_STEPS)
        if steps is None:
            started = time.perf_counter()
            ours.loop(50)
            steps = pick_steps((time.perf_counter() - started) / 50, target_s)
        for side in (ours, theirs):
            side.reset()
        rounds = max(1, min(rounds, steps // 10))
        chunks = [steps // rounds + (i < steps % rounds) for i in range(rounds)]
        log(f"[n={n}] timing {steps} steps each, in {rounds} alternating chunks")
        for i, chunk in enumerate(chunks):
            for side in (ours, theirs) if i % 2 == 0 else (theirs, ours):
                side.timed(chunk)
        results = ours.figures(), theirs.figures()
    finally:
        if ours is not None:
            ours.close()
        theirs.close()
    o, a = results
    log(
        f"[n={n}] boltzlabs {o['env_steps_per_s']:,.0f} env-steps/s (worker {o['worker_ms_mean']:.2f} ms, "
        f"roundtrip {o['roundtrip_ms_mean']:.2f} ms), {o['memory_per_env_mib']:.2f} MiB/env; "
        f"async {a['env_steps_per_s']:,.0f} env-steps/s, {a['uss_per_env_mib']:.2f} MiB USS/env"
    )
    return results


def git_state() -> dict:
    """The commit measured, and whether boltzlabs/ had uncommitted changes."""
    import subprocess

    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {
        "commit": git("rev-parse", "HEAD") or None,
        "dirty": bool(git("status", "--porcelain", "--", "boltzlabs", "sandbox", "mounts", "examples")),
    }


def run_record(argv, total: float, load_before, load_after) -> dict:
    """What every benchmark's JSON starts with: the command, when, how long,
    the load around it, the machine, the commit and the versions measured."""
    return {
        "command": " ".join([Path(sys.argv[0]).name] + (sys.argv[1:] if argv is None else list(argv))),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "total_s": total,
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "memory_gib": psutil.virtual_memory().total / (1 << 30),
        },
        "git": git_state(),
        "versions": {"boltzlabs": boltzlabs.__version__, "gymnasium": gym.__version__, "numpy": np.__version__},
    }


# -- report ------------------------------------------------------------------------------------


def _num(value) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def table(rows: list) -> str:
    head = [
        "n",
        "steps",
        "ours start (s)",
        "async start (s)",
        "ours env-steps/s",
        "async env-steps/s",
        "speed ours/async",
        "ours CPU us/env-step",
        "async CPU us/env-step",
        "worker ms",
        "roundtrip ms",
        "ours MiB/env",
        "ours USS MiB/env",
        "async USS MiB/env",
        "mem ours/async",
        "envs/GiB",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        o, a = row["boltzlabs"], row["async"]
        cells = [
            str(row["n"]),
            str(o["steps"]),
            f"{o['startup_s']:.2f}",
            f"{a['startup_s']:.2f}",
            f"{o['env_steps_per_s']:,.0f}",
            f"{a['env_steps_per_s']:,.0f}",
            f"{row['speed_ratio']:.2f}x",
            f"{o['cpu_us_per_env_step']:.1f}",
            f"{a['cpu_us_per_env_step']:.1f}",
            f"{o['worker_ms_mean']:.2f}",
            f"{o['roundtrip_ms_mean']:.2f}",
            f"{o['memory_per_env_mib']:.2f}",
            _num(o["uss_per_env_mib"]),
            _num(a["uss_per_env_mib"]),
            f"{row['memory_ratio']:.2f}x",
            f"{o['envs_per_gb']:.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cpu_table(rows: list) -> str:
    """CPU microseconds per env-step, by process: where the time goes."""
    head = [
        "n",
        "path",
        "client",
        "worker",
        "template",
        "envs",
        "ours total",
        "async client",
        "async envs",
        "async total",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        o, a = row["boltzlabs"], row["async"]
        by, theirs = o["cpu_us_per_env_step_by"], a["cpu_us_per_env_step_by"]
        path = {True: "native", False: "pure", None: "n/a"}[o.get("fast_path")]
        cells = [str(row["n"]), path] + [f"{by.get(k, 0.0):.1f}" for k in ("client", "worker", "template", "envs")]
        cells += [
            f"{o['cpu_us_per_env_step']:.1f}",
            f"{theirs.get('client', 0.0):.1f}",
            f"{theirs.get('envs', 0.0):.1f}",
            f"{a['cpu_us_per_env_step']:.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[64, 256, 1000], help="pool sizes (default 64 256 1000)")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps per measurement (default: adapted so each boltzlabs loop takes ~--target s)",
    )
    parser.add_argument(
        "--target",
        type=float,
        default=5.0,
        help="seconds a boltzlabs timed loop should take when --steps is not given (default 5)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=10,
        help="chunks the timed steps are split into, the two sides taking turns (default 10)",
    )
    parser.add_argument(
        "--spawn", choices=["template", "exec"], default=None, help="RLPool(spawn=...) (default: the library's default)"
    )
    parser.add_argument(
        "--env",
        choices=sorted(SOURCES),
        default="counter",
        help="examples/counter (default), benchmarks/envs/numpy_env or benchmarks/envs/image_env "
        "(Atari-sized frames), each against its gymnasium twin",
    )
    parser.add_argument(
        "--envs-per-sandbox", type=int, default=1, help="RLPool(envs_per_sandbox=k): k envs per sandbox (default 1)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"JSON output (default {RESULTS.relative_to(ROOT)})")
    args = parser.parse_args(argv)
    if any(n < 1 for n in args.n) or (args.steps is not None and args.steps < 1) or args.rounds < 1:
        parser.error("--n, --steps and --rounds must be positive")

    load_before = os.getloadavg()
    if load_before[0] > 1.5:
        log(
            f"warning: load average is {load_before[0]:.1f} before the run; other work on this machine "
            "will slow both sides (compare the ratios and the CPU columns, not absolute rates)"
        )
    run_started = time.perf_counter()
    rows = []
    for n in args.n:
        ours, theirs = bench(
            n, args.steps, args.target, args.spawn, args.rounds, args.env, args.envs_per_sandbox
        )  # same n, same steps
        rows.append(
            {
                "n": n,
                "boltzlabs": ours,
                "async": theirs,
                "speed_ratio": ours["env_steps_per_s"] / theirs["env_steps_per_s"],
                "memory_ratio": ours["memory_per_env_mib"] / theirs["uss_per_env_mib"],
                "uss_ratio": (
                    ours["uss_per_env_mib"] / theirs["uss_per_env_mib"] if ours["uss_per_env_mib"] is not None else None
                ),
            }
        )
    total = time.perf_counter() - run_started
    load_after = os.getloadavg()

    print(table(rows))
    print()
    print(cpu_table(rows))
    print()
    print(
        f"speed ours/async: env-steps/s ratio (higher is better for boltzlabs). mem ours/async: "
        f"pool.memory().mean / AsyncVectorEnv worker USS (lower is better). Total run {total:.0f} s; "
        f"1-min load average {load_before[0]:.2f} before, {load_after[0]:.2f} after."
    )
    if rows:
        spawn = rows[0]["boltzlabs"]["spawn"]
        print(f"boltzlabs spawn mode: {spawn or 'n/a'}; memory source: {rows[0]['boltzlabs']['memory_source']}.")
    note = rows[0]["boltzlabs"]["memory_note"] if rows else ""
    if note:
        print(f"note: {note}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        **run_record(argv, total, load_before, load_after),
        "settings": {
            "warmup_steps": WARMUP_STEPS,
            "target_s": args.target,
            "steps": args.steps,
            "rounds": args.rounds,
            "spawn": args.spawn,
            "env": args.env,
            "async": {"context": "fork", "shared_memory": True, "autoreset_mode": "SameStep"},
        },
        "results": rows,
    }
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
