"""What a grouped step costs beyond its envs: a pool of groups against the same groups with nothing around them.

    python benchmarks/bench_group_floor.py                          # HalfCheetah-v5, n = 32, k = 16
    python benchmarks/bench_group_floor.py --env LunarLander-v3 --n 8 --k 4

Three implementations of one synchronous step of n envs, open at once and
taking turns (`--rounds` rounds of `--chunk` seconds each):

- sync: Gymnasium's SyncVectorEnv, every env in this process;
- floor: n / k plain processes of k envs each (the last holds the rest), no
  sandbox, no worker, nothing checked: the actions and observations in shared
  memory, one pipe message per group per step (rewards and done flags in it),
  autoreset in the same step. What grouping gives before anything of ours
  (the prototype docs/performance.md names);
- lean k=K: our sandboxes and our direct C step (the same fan-out, the same
  check of each reply in C, the same frames and slots) with the least Python
  around them: the decode, whether each group answered every env as asked with
  no error, its slot's sequence number, the obs rows copied into one batch,
  rewards and flags as arrays. None of the adapter, the pool's input checks,
  episode bookkeeping, infos or per-env obs: what our layers cost is
  boltzlabs' step less this one (a measurement, not a product path; left out
  where the C step is not built);
- boltzlabs k=K: BoltzLabsVecEnv over RLPool(env, n, envs_per_sandbox=k).

Then where a step of ours goes, medians over its steps, from the pool's own
`timing`: the worker's part (`worker_ms`: fan-out, the groups' turns,
gather; run in this process by a direct step, docs/native-step.md), the
transport (the `roundtrip_ms` of the call less the worker's part: two
wake-ups and the reply's decoding, 0 for a direct step) and the trainer's
(the adapter's step less the call: batching actions and results, and a
direct step's decoding). The floor's step pays only its groups' turns and
one wake-up each way.

Figures go to stdout; nothing is written. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from multiprocessing import shared_memory

import gymnasium as gym
import numpy as np

from boltzlabs import RLPool
from boltzlabs.gym import BoltzLabsVecEnv

BANK = 32  # batches of actions drawn once, stepped in turn


def _group(env_id: str, first: int, count: int, conn, names: tuple, shapes: tuple) -> None:
    """One floor group: envs first..first+count-1, stepped in turn at each message."""
    envs = [gym.make(env_id) for _ in range(count)]
    for j, env in enumerate(envs):
        env.reset(seed=first + j)
    memory = [shared_memory.SharedMemory(name) for name in names]
    actions = np.ndarray(shapes[0][0], shapes[0][1], memory[0].buf)
    observations = np.ndarray(shapes[1][0], shapes[1][1], memory[1].buf)
    out = np.zeros((3, count))
    try:
        while conn.recv_bytes():
            for j, env in enumerate(envs):
                obs, reward, terminated, truncated, _ = env.step(actions[first + j])
                if terminated or truncated:
                    obs, _ = env.reset()
                observations[first + j] = obs
                out[:, j] = reward, terminated, truncated
            conn.send_bytes(out.tobytes())
    finally:
        del actions, observations
        for block in memory:
            block.close()


class Floor:
    name = "floor"

    def __init__(self, env_id: str, n: int, k: int) -> None:
        probe = gym.make(env_id)
        act, obs = probe.action_space, probe.observation_space
        shapes = (((n, *act.shape), act.dtype), ((n, *obs.shape), obs.dtype))
        self.memory = [
            shared_memory.SharedMemory(create=True, size=max(1, int(np.prod(shape)) * np.dtype(dtype).itemsize))
            for shape, dtype in shapes
        ]
        self.actions = np.ndarray(shapes[0][0], shapes[0][1], self.memory[0].buf)
        self.observations = np.ndarray(shapes[1][0], shapes[1][1], self.memory[1].buf)
        names = tuple(block.name for block in self.memory)
        context = multiprocessing.get_context("fork")
        self.conns, self.procs = [], []
        for first in range(0, n, k):
            ours, theirs = context.Pipe()
            proc = context.Process(target=_group, args=(env_id, first, min(k, n - first), theirs, names, shapes))
            proc.start()
            self.conns.append(ours)
            self.procs.append(proc)

    def step(self, actions) -> None:
        self.actions[:] = actions
        for conn in self.conns:
            conn.send_bytes(b"s")
        parts = [np.frombuffer(conn.recv_bytes()).reshape(3, -1) for conn in self.conns]
        rewards, terminated, truncated = np.concatenate(parts, axis=1)
        self.last = self.observations.copy(), rewards, terminated.astype(bool), truncated.astype(bool)

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send_bytes(b"")
            except OSError:
                pass
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        del self.actions, self.observations
        for block in self.memory:
            block.close()
            block.unlink()


class Sync:
    name = "sync"

    def __init__(self, env_id: str, n: int, k: int) -> None:
        self.vec = gym.vector.SyncVectorEnv([lambda: gym.make(env_id) for _ in range(n)])
        self.vec.reset(seed=0)

    def step(self, actions) -> None:
        self.vec.step(actions)

    def close(self) -> None:
        self.vec.close()


class Lean:
    """Our groups stepped by the direct C step with the least Python around it (the docstring above)."""

    def __init__(self, env_id: str, n: int, k: int) -> None:
        self.name = f"lean k={k}"
        self.pool = RLPool(f"gym://{env_id}", n, envs_per_sandbox=k, progress=False)
        self.pool.reset(seed=0)
        self.inner = self.pool.inner
        self.counts = [len(self.pool.members(g)) for g in range(self.pool.sandboxes)]
        self.k, self.n = k, n
        self.autoreset = np.zeros(n, dtype=np.bool_)
        if self.inner._lend() is None:
            self.pool.close()
            raise RuntimeError("no direct step here (the C step is not built)")

    def step(self, actions) -> None:
        from boltzlabs import wire
        from boltzlabs.pool import client, groups

        inner, k = self.inner, self.k
        lent = inner._lent
        if lent.next >= lent.end:  # the lending's sequence numbers are used up
            inner._unlend()
            lent = inner._lend()
        resets = np.flatnonzero(self.autoreset).tolist()
        listed: list = [[] for _ in self.counts]
        for i in resets:
            listed[i // k].append(i % k)
        packed = wire.pack(
            [
                wire.pack([wire.STEP, actions[g * k : g * k + count]] + ([listed[g]] if listed[g] else []))
                for g, count in enumerate(self.counts)
            ]
        )
        batch = lent.fastpath.step(
            lent.epoll.fileno(),
            lent.chans,
            lent.wchans,
            packed,
            lent.next,
            lent.no_resets,
            time.monotonic() + lent.step_timeout,
            lent.caps,
            lent.room,
        )
        lent.next += 1
        if batch is None or batch.rest:
            raise RuntimeError("a group did not answer the direct step plainly")
        obs, _, _, _, infos, _ = wire.decode(
            client._REPLY_OF_TWO + batch.compose({}, wire.pack([])), inner._reader.limits
        )[1]
        slots = inner._slots
        _, dtype, shape, _ = slots.leaves[0]
        out = np.empty((self.n, *shape[1:]), dtype)
        rewards: list = []
        terminated: list = []
        truncated: list = []
        for g, count in enumerate(self.counts):
            if wire.SLOT_HEADER.unpack(slots.maps[g][: wire.SLOT_HEADER.size])[2] != obs[g].seq:
                raise RuntimeError(f"group {g}'s slot is not of this step")
            out[g * k : g * k + count] = slots.views[g][0][:count]
            kinds, group_rewards, group_terminated, group_truncated, _, errors = infos[g][groups.GROUP_KEY]
            sent = [groups.RESET if j in listed[g] else groups.STEPPED for j in range(count)]
            if kinds != sent or errors.count(None) != count:
                raise RuntimeError(f"group {g} did not answer every env as asked: {errors}")
            rewards += group_rewards
            terminated += group_terminated
            truncated += group_truncated
        ends = np.array(terminated, dtype=np.bool_) | np.array(truncated, dtype=np.bool_)
        ends[resets] = False
        self.autoreset = ends
        self.last = out, np.array(rewards), ends

    def close(self) -> None:
        self.pool.close()


class Ours:
    def __init__(self, env_id: str, n: int, k: int) -> None:
        self.name = f"boltzlabs k={k}"
        self.pool = RLPool(f"gym://{env_id}", n, envs_per_sandbox=k, progress=False)
        self.vec = BoltzLabsVecEnv(self.pool)
        self.vec.reset(seed=0)
        self.parts: list = []  # (step, roundtrip, worker) in ms, per step

    def step(self, actions) -> None:
        started = time.perf_counter()
        self.vec.step(actions)
        timing = self.pool.timing
        self.parts.append(((time.perf_counter() - started) * 1e3, timing.roundtrip_ms, timing.worker_ms))

    def close(self) -> None:
        self.vec.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="HalfCheetah-v5", help="a Gymnasium id with a Box observation space")
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--k", type=int, default=16, help="envs per group (per sandbox, for ours)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--chunk", type=float, default=3.0, help="seconds each implementation steps per round")
    args = parser.parse_args(argv)
    if not (args.n >= 1 and 1 <= args.k <= args.n and args.rounds >= 1 and args.chunk > 0):
        parser.error("needs n >= 1, 1 <= k <= n, rounds >= 1 and chunk > 0")
    impls: list = []
    try:
        for make in (Sync, Floor, Lean, Ours):
            try:
                impls.append(make(args.env, args.n, args.k))
            except RuntimeError as exc:  # Lean, where there is no direct step
                print(f"{make.__name__}: left out ({exc})", file=sys.stderr)
        space = impls[0].vec.action_space
        space.seed(0)
        bank = [space.sample() for _ in range(BANK)]
        rates: dict = {impl.name: [] for impl in impls}
        for _ in range(args.rounds):
            for impl in impls:
                steps, started = 0, time.perf_counter()
                while time.perf_counter() - started < args.chunk:
                    impl.step(bank[steps % BANK])
                    steps += 1
                rates[impl.name].append(steps * args.n / (time.perf_counter() - started))
    finally:
        for impl in impls:
            impl.close()
    sync = statistics.median(rates["sync"])
    print(f"{args.env}, n = {args.n}, k = {args.k}: medians of {args.rounds} rounds\n")
    print("| implementation | env-steps/s | / SyncVectorEnv |")
    print("|---|---|---|")
    for name, values in rates.items():
        rate = statistics.median(values)
        print(f"| {name} | {rate:,.0f} | {rate / sync:.2f}x |")
    step, roundtrip, worker = (statistics.median(column) * 1e3 for column in zip(*impls[-1].parts))
    print(
        f"\nA step of ours, {step:,.0f} us: the worker's part {worker:,.0f} us (fan-out, the groups' turns, "
        f"gather), transport {roundtrip - worker:,.0f} us (wake-ups, the reply's decoding), the trainer's "
        f"{step - roundtrip:,.0f} us (the adapter and the grouped pool around the call). The floor's step: "
        f"{args.n / statistics.median(rates['floor']) * 1e6:,.0f} us."
    )
    lean = [name for name in rates if name.startswith("lean")]
    if lean:
        print(
            f"The lean step: {args.n / statistics.median(rates[lean[0]]) * 1e6:,.0f} us (our sandboxes and C step, "
            "the least Python around them)."
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
