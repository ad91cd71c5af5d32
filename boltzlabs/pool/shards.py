"""One pool over several worker processes: `RLPool(source, n, workers=k)`.

    ShardedPool --k CALL frames, all written first--> k worker processes (one RLPool link each)
        |                                              shard s holds lanes [bounds[s], bounds[s+1])
        +<--k REPLY frames, taken as they land (epoll over the k sockets)--+
        +--> n results in lane order, in arrays allocated once per call

One worker process steps its lanes serially (its CPU per env-step is the
pool's ceiling) and holds every env's fds (the open-file limit caps its
size). A sharded pool splits the lanes into k contiguous ranges, each an
ordinary single-worker RLPool with its own sandboxes, epoll and fd table,
and drives them from this one client: a call encodes every shard's request
(so a bad argument is refused before any byte is sent), writes them all,
then decodes each shard's reply as its socket turns readable and copies it
into its range. Everything keeps its meaning across shards: the lanes are
global in every result and message, seeds are `seed + i` for global lane i,
`timing.worker_ms` is the slowest shard's (`timing.shards` each shard's),
`memory()` covers the whole pool, and a shard's worker that dies ends the
pool with an error naming the shard and its lanes.

serialize_measurement: each worker's gate lets one of its envs step at a time
and keeps the others frozen; the shards take turns here (a step is shard 0's
request, then shard 1's, ...; sends are held back and released one shard at
a time by recv), so at most one env of the whole pool runs its step code at
any instant.

send/recv: the client keeps which lanes are in flight (the workers refuse a
lane twice only within their shard) and the results it has taken from a
worker but not yet handed out (`_ready`): recv(M) asks every shard with lanes
in flight for what it has, a few milliseconds at a time when several do, and
hands out the first M.
"""

from __future__ import annotations

import inspect
import math
import os
import re
import resource
import select
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from typing import Any

import numpy as np

from boltzlabs.errors import EnvStartError, PoolClosedError, WorkerError
from boltzlabs.pool import keywords, sources
from boltzlabs.pool.progress import StartProgress, shown
from boltzlabs.pool.protocol import Pool, RecvResult, StepResult, check_batch_size, check_cpus, check_n

__all__ = ["Sharding", "default_workers", "workers_for"]

# The default rule (docs/sharding.md has the measurements): one worker per
# CORES_PER_WORKER cores the process may use, each shard holding at least
# MIN_SHARD envs (below that a shard's fixed costs, its template and its hop,
# outweigh what it takes off the others), and as many shards as the open-file
# limit needs (FDS_PER_ENV per env with pipes, FD_RESERVE for the worker's own).
CORES_PER_WORKER = 8
MIN_SHARD = 256
FDS_PER_ENV = 4
FD_RESERVE = 256
# recv() over several shards with lanes in flight asks each for what it has,
# waiting at most this long per round: one shard slow to finish must not hold
# back results another already has.
_RECV_SLICE = 0.002
_ENV_INDEX = re.compile(r"\benv (\d+)\b")


def _fd_capacity() -> int:
    """Envs one worker's open-file table holds (its hard limit: a worker raises its soft limit to it)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        return 1 << 30
    return max(1, (hard - FD_RESERVE) // FDS_PER_ENV)


def default_workers(n: int, cores: int | None = None, gated: bool = False, fd_capacity: int | None = None) -> int:
    """The workers a pool of n envs gets when RLPool(workers=) is None.

    max(the shards the fd limit needs, min(cores // CORES_PER_WORKER, n // MIN_SHARD)), at least 1;
    1 under serialize_measurement (the gate steps one env at a time: more workers add nothing) unless
    the fd limit needs more.
    """
    if cores is None:
        cores = len(os.sched_getaffinity(0))
    capacity = _fd_capacity() if fd_capacity is None else fd_capacity
    needed = math.ceil(n / capacity)
    wanted = 1 if gated else min(cores // CORES_PER_WORKER, n // MIN_SHARD)
    return max(1, min(n, max(needed, wanted)))


def workers_for(args: tuple, kwargs: dict, workers) -> int:
    """How many workers RLPool(*args, workers=workers, **kwargs) runs; the
    refusal of a bad `workers` (0, more than n, not a whole number)."""
    n = args[1] if len(args) > 1 else kwargs.get("n")
    if n is None:
        return 1  # RLPool.__init__ says what is missing
    n = check_n(n)
    if workers is None and kwargs.get("worker") is not None:
        return 1  # a remote node's cores and fd limit are not this machine's: one worker unless asked
    if workers is None:
        return default_workers(n, gated=bool(kwargs.get("serialize_measurement")))
    if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)):
        raise TypeError(
            f"workers must be a whole number of worker processes (or None: chosen from n and the "
            f"cores this process may use), not {workers!r:.80}"
        )
    if not 1 <= workers <= n:
        group = kwargs.get("_group")
        if group:  # RLPool(envs_per_sandbox=k): n here is the sandboxes (pool/groups.py), not the envs asked for
            raise ValueError(
                f"workers must be in [1, {n}]: each worker process holds at least one sandbox, and n={group[1]} "
                f"envs at envs_per_sandbox={group[0]} make {n}; got {workers}"
            )
        raise ValueError(f"workers must be in [1, n={n}]: each worker process holds at least one env; got {workers}")
    return int(workers)


def _global_text(text: str, start: int) -> str:
    """A shard's message with its env indices made the pool's ("env 3" of the shard from lane 500: "env 503")."""
    return _ENV_INDEX.sub(lambda m: f"env {int(m.group(1)) + start}", text)


class Sharding(Pool):
    """RLPool's hooks over several worker processes (see the module docstring).

    client.ShardedPool is this over RLPool, made by RLPool(source, n,
    workers=k) (k > 1, or chosen so); its API is RLPool's. `shards` lists
    each shard's (first lane, end) range. The one-worker pool class and the
    report classes come from client.py (`_one_worker`, `_timing`, `_memory`),
    which imports this module, not the other way round.
    """

    # Set by client.ShardedPool (client.py imports this module, not the other way round): the
    # one-worker pool class, the report classes, and RLPool's naming of an action that does not encode.
    _one_worker: Callable[..., Pool]
    _timing: Callable[..., Any]
    _memory: Callable[..., Any]
    _raise_unserializable: Callable[..., None]

    def __init__(
        self,
        source,
        n: int,
        *,
        workers=None,
        batch_size=None,
        progress=None,
        serialize_measurement: bool = False,
        cpus=None,
        _progress: StartProgress | None = None,
        **options,
    ):
        self._closed = True
        self._closed_reason: str | None = None
        self._shards: list = []
        n = check_n(n)
        k = workers_for((source, n), {"serialize_measurement": serialize_measurement}, workers)
        self.batch_size = check_batch_size(batch_size, n)
        cpus = check_cpus(cpus)  # refused here, before any worker starts
        self.workers = k
        self._bounds = [n * s // k for s in range(k + 1)]
        self._gated = bool(serialize_measurement)
        # env_fns: each shard gets its lanes' callables; any other source is the same for every shard.
        # A grouped pool's lanes are sandboxes of k envs (pool/groups.py): its envs split with them.
        fns = isinstance(source, (list, tuple))
        group = options.pop("_group", None)
        envs = group[1] if group else n
        if fns and len(source) != envs:
            raise ValueError(f"env_fns has {len(source)} callables but n={envs}: one env per callable")
        if not fns:
            # The keywords checked once here, in the caller's thread, before the shards' threads check
            # them again: a misspelt option refused, unread params warned about at the caller's line.
            init = self._one_worker.__init__
            signature = inspect.signature(init).parameters
            accepted = {name for name, p in signature.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
            bare = {name: value for name, value in options.items() if name not in accepted}
            merged = keywords.merge(bare, options.get("params"))
            sources.resolve(source, merged, envs, bare=bare, options=keywords.options(init))

        def open_shard(s):
            start, end = self._bounds[s], self._bounds[s + 1]
            first, last, mine = start, end, options
            if group:
                first, last = start * group[0], min(end * group[0], envs)
                mine = dict(options, _group=[group[0], last - first])
            return self._one_worker(
                source[first:last] if fns else source,
                end - start,
                workers=1,
                progress=False,
                serialize_measurement=serialize_measurement,
                cpus=cpus,
                _shard=(s, k),
                _progress=bar,
                **mine,
            )

        # One bar for the pool, each shard's worker reporting its own envs to it (unless this pool is
        # itself part of a larger one, a ClusterPool's node, whose bar it reports to). The workers
        # start at once, each spawning its own sandboxes (RLPool's start waits on the worker's
        # socket, which releases the GIL).
        with (
            shown(progress, n, _progress, "sandbox" if group else "env") as bar,
            ThreadPoolExecutor(max_workers=k, thread_name_prefix="boltzlabs-shard") as starting,
        ):
            futures = [starting.submit(open_shard, s) for s in range(k)]
            errors = []
            for s, future in enumerate(futures):
                try:
                    self._shards.append(future.result())
                except BaseException as exc:  # noqa: BLE001 - every shard is closed, the first failure raised
                    errors.append((s, exc))
        if errors:
            for shard in self._shards:
                shard.close()
            self._shards = []
            s, failure = errors[0]
            if isinstance(failure, EnvStartError):
                start = self._bounds[s]
                raise EnvStartError(
                    _global_text(str(failure), start), env_index=start + (failure.env_index or 0), log=failure.log
                ) from failure
            raise failure
        first = self._shards[0]
        # As one worker's pool names it (env_fns by their count and first callable).
        self.source = re.sub(r"^env_fns\[\d+", f"env_fns[{n}", first.source) if fns else first.source
        self._init_lanes(n)
        self.timing = self._timing(shards=[0.0] * k)
        self.env_contract, self.hello = first.env_contract, first.hello
        self.memory_source, self.step_timeout, self.spawn = first.memory_source, first.step_timeout, first.spawn
        caps = [shard.max_str_len for shard in self._shards if shard.max_str_len is not None]
        self.max_str_len = min(caps) if caps else None
        self.cpu_budget = first.cpu_budget
        self.cpu_share = first.cpu_share
        self.fast_path = all(shard.fast_path for shard in self._shards)
        self.channel = first.channel if len({s.channel for s in self._shards}) == 1 else "mixed"
        self.shared_memory = all(shard.shared_memory for shard in self._shards)
        self.worker = first.worker
        self.affinity = [shard.affinity[0] for shard in self._shards]
        # One epoll over the k sockets, used raw: the selectors module's wrapper cost ~10 us a wait.
        self._epoll = select.epoll()
        self._epoll_closer = weakref.finalize(self, self._epoll.close)  # with the pool, or when dropped
        self._fd_shard = {}
        for s, shard in enumerate(self._shards):
            self._epoll.register(shard._conn.fileno(), select.EPOLLIN)
            self._fd_shard[shard._conn.fileno()] = s
        # Shards whose link is TLS: a decrypted record it holds is data epoll cannot see.
        self._buffered = [s for s, shard in enumerate(self._shards) if hasattr(shard._conn, "pending")]
        # send/recv: lanes sent and not yet handed out; per shard, lanes sent to its worker whose
        # results it still holds; results taken from a worker, not yet handed out; under the gate,
        # sends held back and the shard whose turn it is.
        self._flying = np.zeros(n, dtype=np.bool_)
        self._out = [0] * k
        self._ready: list = []
        self._held: list = []
        self._turn: int | None = None  # under the gate: the shard whose sends are out
        self._closed = False

    # -- the fan-out -------------------------------------------------------------------

    @property
    def shards(self) -> list:
        """Each shard's lanes as (first, end), in shard order."""
        return [(self._bounds[s], self._bounds[s + 1]) for s in range(self.workers)]

    def _shard_of(self, lanes) -> dict:
        """{shard: [local lane, ...]} for sorted or unsorted global `lanes`, each shard's in the given order."""
        out: dict = {}
        bounds = self._bounds
        for lane in lanes:
            s = int(np.searchsorted(bounds, lane, side="right")) - 1
            out.setdefault(s, []).append(lane - bounds[s])
        return out

    def _gather(self, calls: dict, land) -> None:
        """Send {shard: (name, args)} to every shard, then land(shard, value) each reply as it arrives.

        Every request is encoded before the first is sent. A ValueError from a shard's worker (its
        check of an argument) is raised once every reply is in, in the pool's lane numbers; a shard
        whose worker is gone ends the pool (WorkerError naming the shard and its lanes).
        """
        shards = self._shards
        frames = {s: shards[s]._frame(name, args) for s, (name, args) in calls.items()}
        started = time.perf_counter()
        pending = {}
        for s, frame in frames.items():
            name, args = calls[s]
            try:
                pending[s] = shards[s]._send_frame(frame, name, shards[s]._budget(name, args))
            except WorkerError as exc:
                raise self._lost(s, exc) from exc
        shown = self.timing.shards = [0.0] * self.workers
        refused = None
        try:
            while pending:
                ready = [s for s in self._buffered if s in pending and shards[s]._conn.pending()]
                if not ready:
                    events = self._epoll.poll(1.0)
                    if not events:  # a second of silence: is a shard's worker dead, or stuck?
                        self._check_shards(pending)
                        continue
                    ready = [self._fd_shard[fd] for fd, _ in events]
                for s in ready:
                    shard = shards[s]
                    try:
                        shard._read()
                        if s not in pending:
                            continue
                        found, value = shard._take(calls[s][0], pending[s])
                    except ValueError as exc:
                        refused = refused or (s, exc)
                        del pending[s]
                        continue
                    except WorkerError as exc:
                        raise self._lost(s, exc) from exc
                    if found:
                        del pending[s]
                        shown[s] = shard.timing.worker_ms
                        land(s, value)
                    else:  # part of a frame, or a heartbeat: another shard may be stuck meanwhile
                        self._check_shards(pending)
        except (ValueError, WorkerError, PoolClosedError):
            raise
        except BaseException:
            self._shutdown()  # interrupted half way (Ctrl-C): the streams are out of step
            raise
        self.timing.roundtrip_ms = (time.perf_counter() - started) * 1000.0
        self.timing.worker_ms = sum(shown) if self._gated else max(shown)
        self.timing.wait_ms = self.timing.queued_ms = 0.0
        if refused is not None:
            s, refusal = refused
            raise ValueError(_global_text(str(refusal), self._bounds[s])) from None

    def _check_shards(self, pending) -> None:
        """A pending shard whose worker is dead, or past its call's deadline (client.py), ends the pool."""
        shards = self._shards
        for s in pending:
            if not shards[s]._link.alive():
                raise self._lost(s, shards[s]._worker_died())
            if shards[s]._overdue():
                raise self._lost(s, shards[s]._stuck())

    def _lost(self, s: int, exc: Exception) -> WorkerError:
        """Shard s's worker is gone: close every shard; the error naming it."""
        start, end = self._bounds[s], self._bounds[s + 1]
        self._shutdown()
        return WorkerError(
            f"shard {s} of {self.workers} of this pool (envs {start}-{end - 1}) lost its worker; every "
            f"shard was closed: create a new RLPool. {exc}",
            kind=getattr(exc, "kind", None),
            signal=getattr(exc, "signal", None),
        )

    def _in_turns(self, calls: dict, land) -> None:
        """_gather, or under serialize_measurement one shard after the other (the gate spans the pool)."""
        if not self._gated or len(calls) < 2:
            self._gather(calls, land)
            return
        total, shown, started = 0.0, [0.0] * self.workers, time.perf_counter()
        for s in sorted(calls):
            self._gather({s: calls[s]}, land)
            total += self.timing.worker_ms
            shown[s] = self.timing.shards[s]
        self.timing.worker_ms, self.timing.shards = total, shown
        self.timing.roundtrip_ms = (time.perf_counter() - started) * 1000.0

    # -- the protocol's hooks (boltzlabs.pool.protocol.Pool) -------------------------------

    def _check_open(self) -> None:
        if self._closed:
            if self._closed_reason is not None:
                raise PoolClosedError(f"this RLPool was shut down ({self._closed_reason}); create a new one")
            raise PoolClosedError("this RLPool is closed; create a new one")

    def _refuse_async(self, what: str) -> None:
        if self._flying.any():
            flying, finished = int(self._flying.sum()), len(self._ready)
            raise ValueError(
                f"{what} while {flying - finished} env(s) are in flight and {finished} finished but not "
                "received: recv them first (send/recv and step() do not mix)"
            )

    def _refuse_outstanding(self, lanes, what: str) -> None:
        busy = [lane for lane in lanes if self._flying[lane]]
        if busy:
            raise ValueError(
                f"cannot {what} env {busy[0]}: it is in flight or has finished and its result has not "
                "been received; recv it first"
            )

    def _step_lanes(self, actions: list, resets, whole=None) -> StepResult:
        # `whole`: RLPool's reader of a direct step, which a sharded pool never takes (no lending).
        self._refuse_async("step()")
        n, bounds, shards = self.n, self._bounds, self._shards
        # Hot path: one array of each, filled shard by shard as the replies land.
        obs, infos = [None] * n, [None] * n
        rewards = np.empty(n, dtype=np.float64)
        terminated = np.empty(n, dtype=np.bool_)
        truncated = np.empty(n, dtype=np.bool_)
        stragglers = []
        local_resets = self._shard_of(resets) if resets else {}

        def land(s, reply):
            start, end = bounds[s], bounds[s + 1]
            result = shards[s]._stepped(reply)
            obs[start:end] = result.obs
            infos[start:end] = result.infos
            rewards[start:end] = result.rewards
            terminated[start:end] = result.terminated
            truncated[start:end] = result.truncated
            if shards[s].timing.stragglers:
                stragglers.extend(start + i for i in shards[s].timing.stragglers)

        try:
            self._in_turns(
                {s: ("step", [actions[bounds[s] : bounds[s + 1]], local_resets.get(s)]) for s in range(self.workers)},
                land,
            )
        except TypeError:
            self._raise_unserializable(actions)  # names the global lane
            raise
        stragglers.sort()
        self.timing.stragglers = stragglers
        return StepResult(obs, rewards, terminated, truncated, infos)

    def _reset_lanes(self, lanes: list, seeds, hard: bool, options, scrub: bool = False) -> tuple:
        self._refuse_outstanding(lanes, "reset")
        bounds, shards = self._bounds, self._shards
        position = {lane: k for k, lane in enumerate(lanes)}
        # Every slot is filled by land() before they are returned (_gather raises otherwise).
        obs: list[Any] = [None] * len(lanes)
        infos: list[Any] = [None] * len(lanes)
        calls, mine = {}, {}
        for s, local in self._shard_of(lanes).items():
            globals_ = [bounds[s] + i for i in local]
            mine[s] = (local, globals_)
            calls[s] = (
                "reset",
                [local, None if seeds is None else [seeds[position[g]] for g in globals_], hard, options, scrub],
            )

        def land(s, reply):
            local, globals_ = mine[s]
            got, got_infos = shards[s]._was_reset(local, reply)
            for g, o, info in zip(globals_, got, got_infos):
                obs[position[g]], infos[position[g]] = o, info

        self._gather(calls, land)  # resets are not gated (as in one worker)
        self.timing.stragglers = [lane for lane, info in zip(lanes, infos) if info.get("straggler")]
        return obs, infos

    def _send_lanes(self, actions: list, lanes: list, resets, how=None) -> None:
        self._refuse_outstanding(lanes, "send to")
        bounds = self._bounds
        by_lane = dict(zip(lanes, actions))
        local_resets = self._shard_of(resets) if resets else {}
        seed_of = dict(zip(resets, how[0])) if how is not None and how[0] is not None else None
        calls = {}
        for s, local in self._shard_of(lanes).items():
            calls[s] = ("send", [[by_lane[bounds[s] + i] for i in local], local, local_resets.get(s)])
            if how is not None and s in local_resets:  # each shard its own resets' seeds, in their order
                seeds = None if seed_of is None else [seed_of[bounds[s] + i] for i in local_resets[s]]
                calls[s][1].append([seeds, how[1], how[2]])
        if self._gated:  # one shard's turn at a time: the others' sends wait for recv to release them
            for s in sorted(calls):
                if self._turn is None or (self._turn == s and not self._held):
                    self._dispatch(s, calls[s])
                else:
                    self._frame_check(s, calls[s])
                    self._held.append((s, calls[s]))
        else:
            try:
                self._gather(calls, lambda s, reply: None)
            except TypeError:
                self._raise_unserializable(actions)
                raise
            for s, (_, args) in calls.items():
                self._out[s] += len(args[1])
        self._flying[lanes] = True

    def _frame_check(self, s: int, call) -> None:
        """A held send's arguments are checked now, as if it were sent."""
        self._shards[s]._frame(*call)

    def _dispatch(self, s: int, call) -> None:
        self._gather({s: call}, lambda s, reply: None)
        self._out[s] += len(call[1][1])
        self._turn = s

    def _release(self) -> None:
        """Under the gate: once the shard whose turn it was has handed back every result, the next
        shard's held sends go."""
        if self._turn is not None and self._out[self._turn] == 0:
            self._turn = None
        while self._held and (self._turn is None or self._turn == self._held[0][0]):
            s, call = self._held.pop(0)
            self._dispatch(s, call)

    def _recv_lanes(self, batch_size, timeout) -> RecvResult:
        flying = int(self._flying.sum())
        want = flying if batch_size is None else batch_size
        if want > flying:
            raise ValueError(
                f"recv(batch_size={want}) would wait forever: only {flying} result(s) can come "
                f"({flying - len(self._ready)} env(s) in flight, {len(self._ready)} finished and not "
                "received)"
            )
        bounds, shards = self._bounds, self._shards
        started = time.perf_counter()
        deadline = None if timeout is None else time.monotonic() + timeout
        queued = [0.0, 0]

        def land(s, reply):
            result = shards[s]._received(reply)
            self._out[s] -= len(result.env_ids)
            queued[0] += shards[s].timing.queued_ms * len(result.env_ids)
            queued[1] += len(result.env_ids)
            for k, local in enumerate(result.env_ids.tolist()):
                self._ready.append(
                    (
                        bounds[s] + local,
                        result.obs[k],
                        float(result.rewards[k]),
                        bool(result.terminated[k]),
                        bool(result.truncated[k]),
                        result.infos[k],
                    )
                )

        while len(self._ready) < want:
            if self._gated:
                self._release()
            pending = {s: out for s, out in enumerate(self._out) if out > 0}
            if not pending:
                break
            need = want - len(self._ready)
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            wait = left if len(pending) == 1 else (_RECV_SLICE if left is None else min(_RECV_SLICE, left))
            self._gather({s: ("recv", [min(need, out), wait]) for s, out in pending.items()}, land)
            if deadline is not None and time.monotonic() >= deadline:
                break
        if self._gated:
            self._release()
        taken, self._ready = self._ready[:want], self._ready[want:]
        env_ids = np.array([r[0] for r in taken], dtype=np.int64)
        self._flying[env_ids] = False
        infos = [r[5] for r in taken]
        obs = [r[1] for r in taken]
        self.timing.roundtrip_ms = (time.perf_counter() - started) * 1000.0
        self.timing.wait_ms = self.timing.roundtrip_ms
        self.timing.queued_ms = queued[0] / queued[1] if queued[1] else 0.0
        self.timing.stragglers = [r[0] for r in taken if r[1] is None and r[5].get("straggler") is True]
        return RecvResult(
            env_ids,
            obs,
            np.array([r[2] for r in taken], dtype=np.float64),
            np.array([r[3] for r in taken], dtype=np.bool_),
            np.array([r[4] for r in taken], dtype=np.bool_),
            infos,
        )

    def _render_request(self, lanes: list) -> tuple:
        return self._lanes_request(lanes, lambda local: ("render", [local]))

    def _attr_request(self, lanes: list, op: str, name: str, args: list, kwargs: dict, values) -> tuple:
        by_lane = None if values is None else dict(zip(lanes, values))

        def call(s, local):
            vals = None if by_lane is None else [by_lane[self._bounds[s] + i] for i in local]
            return "attr", [local, op, name, args, kwargs, vals]

        return self._lanes_request(lanes, call, with_shard=True)

    def _lanes_request(self, lanes: list, call, with_shard: bool = False) -> tuple:
        """A per-lane request (render, attr) split by shard: (values aligned with lanes, {global lane: error})."""
        position = {lane: k for k, lane in enumerate(lanes)}
        values, errors, mine = [None] * len(lanes), {}, {}
        calls = {}
        for s, local in self._shard_of(lanes).items():
            mine[s] = local
            calls[s] = call(s, local) if with_shard else call(local)

        def land(s, reply):
            got, failed = reply
            start = self._bounds[s]
            for i, value in zip(mine[s], got or [None] * len(mine[s])):
                values[position[start + i]] = value
            for key, error in (failed or {}).items():
                errors[start + int(key)] = error

        self._gather(calls, land)
        return values, errors

    def _log(self, index: int) -> str:
        s = int(np.searchsorted(self._bounds, index, side="right")) - 1
        return self._shards[s]._log(index - self._bounds[s])

    def _everywhere(self, name: str) -> list:
        """One call on every shard; the replies in shard order."""
        replies = [None] * self.workers
        self._gather({s: (name, []) for s in range(self.workers)}, replies.__setitem__)
        return replies

    def memory(self):
        """Each env's memory in lane order, and what every shard's worker shares (its template), summed."""
        reports = self._everywhere("memory")
        notes = [report["note"] for report in reports if report["note"]]
        return self._memory(
            [value for report in reports for value in report["per_env"]],
            reports[0]["source"],
            "; ".join(dict.fromkeys(notes)),
            sum(report["shared"] for report in reports),
        )

    def states(self) -> list:
        shown = [state for states in self._everywhere("lane_states") for state in states]
        for lane in [r[0] for r in self._ready]:
            shown[lane] = "finished"  # taken from its worker, not yet handed out
        for s, (_, args) in self._held:
            for local in args[1]:
                shown[self._bounds[s] + local] = "in_flight"  # held back at the gate
        return shown

    def pids(self) -> list:
        return [pid for pids in self._everywhere("pids") for pid in pids]

    # -- life ----------------------------------------------------------------------------

    def shutdown(self, reason: str = "owner shutdown") -> bool:
        if self._closed:
            return False
        try:
            confirmed = all(bool(reply) for reply in self._everywhere("shutdown"))
        except (WorkerError, PoolClosedError):
            confirmed = False
        self._closed_reason = str(reason)
        self._shutdown()
        return confirmed

    def _shutdown(self) -> None:
        self._closed = True
        self._close_shards()

    def _close_shards(self) -> None:
        shards, self._shards = self._shards, []
        if getattr(self, "_epoll_closer", None) is not None:
            self._epoll_closer()
        if not shards:
            return
        # Each close waits for its worker and its cgroups to be gone: all at once, not in turn.
        with ThreadPoolExecutor(max_workers=len(shards), thread_name_prefix="boltzlabs-shard") as closing:
            list(closing.map(lambda shard: shard.close(), shards))

    def close(self) -> None:
        """Stop every shard's envs and worker; remove every cgroup. Idempotent."""
        self._closed = True
        self._close_shards()
        self._failure_summary()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"RLPool({self.source!r}, {self.n}, workers={self.workers}, {state})"
