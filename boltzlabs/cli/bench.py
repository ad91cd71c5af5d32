"""`boltzlabs bench`: what a pool of one env source costs and delivers, per n.

    measure(source, n, steps) --> {"n", "start_s", "env_steps_per_s", "worker_ms",
                                   "roundtrip_ms", "mib_per_env", "envs_per_gb", ...}

For each n: RLPool(source, n) is constructed (start_s: every sandbox spawned
and handshaken), reset(seed=0), stepped WARMUP_STEPS times untimed, reset
again, then stepped `steps` times with reset(where=dones) whenever an env is
done (resets are inside the timed loop, as in a training loop). Throughput is
n x steps / wall time of that loop; worker_ms and roundtrip_ms are the means
of pool.timing over its steps (their difference is the hop between this
process and the worker); memory is pool.memory() after the loop.

    compare(source, n, ks, steps) --> [{"n", "k", "sandboxes", "env_steps_per_s",
                                        "cpu_us_per_env_step", "envs_per_gb", "vs_async", ...}, ...]

`boltzlabs bench --envs-per-sandbox 1,4,16`, for choosing k: one pool per k
(RLPool(source, n, envs_per_sandbox=k)) and, for a Gymnasium id or env_fns,
Gymnasium's AsyncVectorEnv over the same envs, all open at once and taking
turns in chunks (docs/groups.md). CPU per env-step is this process's CPU
plus that of the side's processes (a pool's worker and everything below
it; AsyncVectorEnv's workers), from the scheduler's counters read around
each chunk.
"""

from __future__ import annotations

import os
import time

__all__ = ["measure", "compare", "action_batches", "group_sizes", "twin", "WARMUP_STEPS"]

WARMUP_STEPS = 5
_MIB = float(1 << 20)
_BATCHES = 8  # distinct sampled action batches, cycled through the loop


def _batch(samples: list):
    """n sampled actions in the form the pool sends fastest."""
    import numpy as np

    if all(isinstance(s, np.generic) for s in samples):
        return [s.item() for s in samples]
    if all(isinstance(s, np.ndarray) for s in samples) and len({s.shape for s in samples}) == 1:
        return np.stack(samples)
    return samples


def action_batches(pool, actions, seed: int = 0) -> list:
    """Batches of pool.n actions to cycle through: each given action for every
    env in turn, else samples from the declared action space, else all 0."""
    n = pool.n
    if actions is not None:
        return [[action] * n for action in actions]
    spec = pool.env_contract.action_space
    if spec is not None:
        try:
            from boltzlabs.pool.spaces import from_spec

            space = from_spec(spec)
        except (ImportError, ValueError):
            space = None
        if space is not None:
            space.seed(seed)
            return [_batch([space.sample() for _ in range(n)]) for _ in range(_BATCHES)]
    return [[0] * n]


def measure(
    source,
    n: int,
    steps: int,
    *,
    spawn: str = "template",
    actions=None,
    params=None,
    bar=None,
    pin_sandboxes: bool = False,
    eager_reset: bool = False,
) -> dict:
    """Start a pool of n envs, step it `steps` times, and return its figures.

    `bar`: a tqdm bar (or None) advanced once per timed step. Lanes that
    failed during the loop are counted in "failed_steps" (their
    info["error"] in "first_error").
    """
    from boltzlabs import RLPool

    started = time.perf_counter()
    pool = RLPool(source, n, spawn=spawn, params=params, pin_sandboxes=pin_sandboxes, eager_reset=eager_reset)
    start_s = time.perf_counter() - started
    try:
        batches = action_batches(pool, actions)
        pool.reset(seed=0)
        for t in range(WARMUP_STEPS):
            _, _, dones, _ = pool.step(batches[t % len(batches)])
            if dones.any():
                pool.reset(where=dones)
        pool.reset(seed=0)
        worker_ms = roundtrip_ms = 0.0
        failed, first_error = 0, None
        loop_started = time.perf_counter()
        for t in range(steps):
            _, _, dones, infos = pool.step(batches[t % len(batches)])
            worker_ms += pool.timing.worker_ms
            roundtrip_ms += pool.timing.roundtrip_ms
            if dones.any():
                for info in infos:
                    if "error" in info:
                        failed += 1
                        first_error = first_error or info["error"]
                pool.reset(where=dones)
            if bar is not None:
                bar.update(1)
        elapsed = time.perf_counter() - loop_started
        memory = pool.memory()
        envs_per_gb = pool.envs_per_gb()
        used = pool.spawn
    finally:
        closing = time.perf_counter()
        pool.close()
        close_s = time.perf_counter() - closing
    return {
        "n": n,
        "steps": steps,
        "spawn": used,
        "start_s": start_s,
        "env_steps_per_s": n * steps / elapsed if elapsed > 0 else float("inf"),
        "loop_s": elapsed,
        "worker_ms": worker_ms / max(1, steps),
        "roundtrip_ms": roundtrip_ms / max(1, steps),
        "mib_per_env": memory.mean / _MIB,
        "shared_mib": memory.shared / _MIB,
        "envs_per_gb": envs_per_gb,
        "memory_source": memory.source,
        "close_s": close_s,
        "failed_steps": failed,
        "first_error": first_error,
    }


# -- envs_per_sandbox: one pool per k, and AsyncVectorEnv beside ------------------------------


def twin(source, params=None, n: int | None = None):
    """The env_fns of Gymnasium's AsyncVectorEnv over the same envs, or None when the source is an
    env directory (it has no Gymnasium twin): a Gymnasium id's gymnasium.make(id, **params), n
    times, or env_fns themselves."""
    import functools

    from boltzlabs.pool import sources

    if isinstance(source, (list, tuple)):
        return list(source)
    resolved = sources.resolve(source, dict(params or {}), n)
    if resolved.gym_id is None:
        return None
    import gymnasium

    return [functools.partial(gymnasium.make, resolved.gym_id, **resolved.params["kwargs"])] * (n or 1)


def sched_ns(pid: int) -> int | None:
    """CPU time of every thread of pid in ns, from the scheduler's own counter (se.sum_exec_runtime
    of /proc/PID/task/TID/sched, exact where utime and stime are sampled at the 10 ms tick); None
    when it cannot be read."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/sched") as f:
                for line in f:
                    if line.startswith("se.sum_exec_runtime"):
                        total += int(float(line.split(":", 1)[1]) * 1e6)
                        break
                else:
                    return None
        except FileNotFoundError:
            continue  # the thread ended
        except OSError:
            return None
    return total


def cpu_seconds(proc) -> float:
    """CPU seconds a process has used (0 once it is gone)."""
    import psutil

    ns = sched_ns(proc.pid)
    if ns is not None:
        return ns / 1e9
    try:
        times = proc.cpu_times()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0.0
    return times.user + times.system


class _Side:
    """One contender at one n: a pool of envs_per_sandbox=k, or AsyncVectorEnv (k "async"),
    stepped in chunks; the CPU of its processes (`roots` and everything below them) and of
    this process is read around each chunk."""

    def __init__(self, k, sandboxes, roots: list, start_s: float, pinned: bool = False, eager: bool = False) -> None:
        self.k, self.sandboxes, self.roots, self.start_s = k, sandboxes, roots, start_s
        self.pinned = pinned  # a pool made with pin_sandboxes=True
        self.eager = eager  # a pool made with eager_reset=True
        self.rounds: list = []  # (seconds, steps, CPU seconds of this process, of the side's processes)
        self.failed, self.first_error = 0, None

    def processes(self) -> list:
        import psutil

        procs = []
        for root in self.roots:
            try:
                procs += [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        return procs

    def timed(self, steps: int, bar) -> None:
        import psutil

        me = psutil.Process()
        procs = self.processes()  # enumerated before the chunk; one born inside it is not counted
        theirs = sum(cpu_seconds(p) for p in procs)
        mine = cpu_seconds(me)  # this process last before the loop, first after it: the readings stay out
        started = time.perf_counter()
        for _ in range(steps):
            self.step()
            if bar is not None:
                bar.update(1)
        seconds = time.perf_counter() - started
        mine = cpu_seconds(me) - mine
        theirs = sum(cpu_seconds(p) for p in procs) - theirs
        self.rounds.append((seconds, steps, mine, theirs))

    def step(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def figures(self, n: int) -> dict:
        import statistics

        rates = [n * steps / seconds if seconds > 0 else float("inf") for seconds, steps, _, _ in self.rounds]
        cpu = [1e6 * (mine + theirs) / (n * steps) for _, steps, mine, theirs in self.rounds]
        client = [1e6 * mine / (n * steps) for _, steps, mine, _ in self.rounds]
        return {
            "n": n,
            "k": self.k,
            "pinned": self.pinned,
            "eager": self.eager,
            "sandboxes": self.sandboxes,
            "steps": sum(steps for _, steps, _, _ in self.rounds),
            "rounds": len(self.rounds),
            "start_s": self.start_s,
            "env_steps_per_s": statistics.median(rates),
            "rates": rates,
            "cpu_us_per_env_step": statistics.median(cpu),
            "client_cpu_us_per_env_step": statistics.median(client),
            "failed_steps": self.failed,
            "first_error": self.first_error,
        }


class _PoolSide(_Side):
    """RLPool(source, n, envs_per_sandbox=k), stepped with step_full: the envs done at the previous
    step are reset in the same request (next-step autoreset, as AsyncVectorEnv's default)."""

    def __init__(
        self, pool, roots: list, start_s: float, batches: list, pinned: bool = False, eager: bool = False
    ) -> None:
        k = getattr(pool, "envs_per_sandbox", 1)
        super().__init__(k, getattr(pool, "sandboxes", pool.n), roots, start_s, pinned, eager)
        self.pool, self.batches, self.t, self.resets = pool, batches, 0, None

    def step(self) -> None:
        result = self.pool.step_full(self.batches[self.t % len(self.batches)], self.resets)
        self.t += 1
        done = (result.terminated | result.truncated).nonzero()[0].tolist()
        self.resets = done or None
        for i in done:
            info = result.infos[i]
            if "error" in info:
                self.failed += 1
                self.first_error = self.first_error or info["error"]

    def close(self) -> None:
        self.pool.close()

    def figures(self, n: int) -> dict:
        pool = self.pool
        memory = pool.memory()
        return {
            **super().figures(n),
            "spawn": pool.spawn,
            "mib_per_env": memory.mean / _MIB,
            "envs_per_gb": pool.envs_per_gb(),
            "memory_source": memory.source,
        }


class _AsyncSide(_Side):
    """Gymnasium's AsyncVectorEnv (shared memory, next-step autoreset: its defaults) over the same envs."""

    def __init__(self, envs, batches: list, start_s: float) -> None:
        import psutil

        super().__init__("async", None, [psutil.Process(p.pid) for p in envs.processes], start_s)
        self.envs, self.batches, self.t = envs, batches, 0

    def step(self) -> None:
        self.envs.step(self.batches[self.t % len(self.batches)])
        self.t += 1

    def close(self) -> None:
        self.envs.close()

    def figures(self, n: int) -> dict:
        return {**super().figures(n), "spawn": None, "mib_per_env": None, "envs_per_gb": None, "memory_source": None}


def _async_batches(envs, batches: list) -> list:
    """The pool's action batches in AsyncVectorEnv's batched form (the same actions), else
    samples of its own batched action space (seed 0)."""
    from gymnasium.vector.utils import concatenate, create_empty_array

    space, n = envs.single_action_space, envs.num_envs
    try:
        return [concatenate(space, list(batch), create_empty_array(space, n)) for batch in batches]  # type: ignore[arg-type]
    except Exception:  # a form concatenate does not take: the same space's own samples
        envs.action_space.seed(0)
        return [envs.action_space.sample() for _ in range(len(batches))]


def group_sizes(ks, n: int) -> list:
    """The distinct envs_per_sandbox values to measure at n, each at most n (a group holds at
    most n envs: RLPool takes a larger k as n), in the order given."""
    return list(dict.fromkeys(min(int(k), n) for k in ks))


def pool_sides(ks, n: int, pin_sandboxes: bool = False, eager_reset: bool = False) -> list:
    """The pools compare() makes at n: (k, pinned, eager) for each k of group_sizes, as the
    kernel places its sandboxes; with pin_sandboxes, each k pinned too; with eager_reset, each
    k once more with eager resets (and pinned, with pin_sandboxes), in turn."""
    variants = [(False, False)] + [(True, False)] * pin_sandboxes + [(pin_sandboxes, True)] * eager_reset
    return [(k, pinned, eager) for k in group_sizes(ks, n) for pinned, eager in variants]


def compare(
    source,
    n: int,
    ks,
    steps: int,
    *,
    rounds: int = 5,
    spawn: str = "template",
    actions=None,
    params=None,
    bar=None,
    pin_sandboxes: bool = False,
    eager_reset: bool = False,
) -> list:
    """A pool of n envs for each k of `ks` (RLPool(source, n, envs_per_sandbox=k); k = 1 a sandbox
    per env) and, when the source is a Gymnasium id or env_fns, Gymnasium's AsyncVectorEnv over the
    same envs: all open at once, warmed up, then `steps` timed steps each, cut into `rounds`
    chunks that take turns (the order rotating), so a burst of other work hits every side alike.
    With pin_sandboxes, each k twice: as the kernel places its sandboxes, then with
    RLPool(pin_sandboxes=True) ("pinned": true in its dict); with eager_reset, once more with
    RLPool(eager_reset=True) ("eager": true), pinned too with pin_sandboxes.

    One dict per side, the pools in k order then AsyncVectorEnv (k "async"): env-steps/s and CPU
    microseconds per env-step (this process plus the side's processes, from the scheduler's
    counters) are medians over the rounds; envs_per_gb is pool.envs_per_gb() after the loop (None
    for AsyncVectorEnv); vs_async is the env-steps/s over AsyncVectorEnv's (None without it)."""
    import psutil

    from boltzlabs import RLPool

    rounds = max(1, min(rounds, steps))
    chunks = [steps * (r + 1) // rounds - steps * r // rounds for r in range(rounds)]
    sides: list = []
    me = psutil.Process()
    try:
        # AsyncVectorEnv first: its forked workers must not inherit the pools' sockets.
        fns = twin(source, params, n)
        async_fns = None
        if fns is not None:
            from gymnasium.vector import AsyncVectorEnv

            started = time.perf_counter()
            envs = AsyncVectorEnv(fns)
            async_fns = (envs, time.perf_counter() - started)
        batches = None
        for k, pinned, eager in pool_sides(ks, n, pin_sandboxes, eager_reset):
            before = {p.pid for p in me.children()}
            started = time.perf_counter()
            pool = RLPool(
                source,
                n,
                spawn=spawn,
                envs_per_sandbox=k,
                progress=False,
                pin_sandboxes=pinned,
                eager_reset=eager,
                **(params or {}),
            )
            start_s = time.perf_counter() - started
            # The pool's processes: what this process started for it (its worker, and below it every sandbox).
            roots = [p for p in me.children() if p.pid not in before]
            if batches is None:
                batches = action_batches(pool, actions)
            sides.append(_PoolSide(pool, roots, start_s, batches, pinned, eager))
        if async_fns is not None:
            envs, start_s = async_fns
            sides.append(_AsyncSide(envs, _async_batches(envs, batches or [[0] * n]), start_s))
        for side in sides:
            if isinstance(side, _PoolSide):
                side.pool.reset(seed=0)
            else:
                side.envs.reset(seed=0)
            for _ in range(WARMUP_STEPS):
                side.step()
        for r, chunk in enumerate(chunks):
            for side in sides[r % len(sides) :] + sides[: r % len(sides)]:
                side.timed(chunk, bar)
        results = [side.figures(n) for side in sides]
    finally:
        for side in sides:
            side.close()
        if async_fns is not None and not any(isinstance(side, _AsyncSide) for side in sides):
            async_fns[0].close()
    theirs = next((r["env_steps_per_s"] for r in results if r["k"] == "async"), None)
    for r in results:
        r["vs_async"] = r["env_steps_per_s"] / theirs if theirs else None
    return results
