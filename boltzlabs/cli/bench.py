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
"""

from __future__ import annotations

import time

__all__ = ["measure", "action_batches", "WARMUP_STEPS"]

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


def measure(source, n: int, steps: int, *, spawn: str = "template", actions=None, params=None, bar=None) -> dict:
    """Start a pool of n envs, step it `steps` times, and return its figures.

    `bar`: a tqdm bar (or None) advanced once per timed step. Lanes that
    failed during the loop are counted in "failed_steps" (their
    info["error"] in "first_error").
    """
    from boltzlabs import RLPool

    started = time.perf_counter()
    pool = RLPool(source, n, spawn=spawn, params=params)
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
