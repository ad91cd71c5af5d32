"""The client: `RLPool`, what a training loop holds.

    RLPool --CALL frames over a socketpair--> worker process (boltzlabs.worker)
    RLPool <--REPLY/ERROR/PROGRESS frames---- worker process

The client validates every argument before a byte is sent (a Gymnasium
source's id and params included, see sources.py), turns the worker's replies
into numpy arrays, keeps each lane's latest observation (so a partial reset
can splice) and each lane's episode (id, seed, length, return), and owns the
worker's life: `close()`, the context manager, garbage collection and
interpreter exit all end it, and a call interrupted by Ctrl-C kills it
rather than leave it half way.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from boltzlabs import wire
from boltzlabs.pool import sources
from boltzlabs.sandbox.cgroups import remove_pool_dir
from boltzlabs.errors import EnvError, EnvStartError, PoolClosedError, SandboxUnavailable, WorkerError
from boltzlabs.pool.ids import uuid7
from boltzlabs.units import parse_size

__all__ = ["RLPool", "Timing", "MemoryReport", "EnvContract"]

_PROGRESS_MIN_ENVS = 64
# Reads from the worker. Not 1 MiB: a buffer that large is an mmap, mremap and
# munmap per read (~90 us here), most of the hop at small n.
_RECV_SIZE = 1 << 16


@dataclass
class Timing:
    """Timing of the latest call (`step()`, `reset()`, `send()`, `recv()`, ...).

    worker_ms: the call as measured on the worker (fan-out, env code,
    gather); roundtrip_ms: this process's wall clock around the whole call;
    stragglers: lanes that missed their deadline in that call (for recv(),
    the received lanes that did).

    For asynchronous stepping, set by each recv() (0 after other calls):
    wait_ms: how long recv() blocked waiting for envs to finish (0 when
    batch_size results were already there). High: the trainer waits for
    envs; a smaller batch_size (or more envs) keeps it busy.
    queued_ms: the mean time the received results had been sitting
    finished in the worker before this recv() took them. High: envs wait
    for the trainer; a larger batch_size (or fewer envs) keeps them busy.

    nodes: for a pool spread over a cluster (RLPool(cluster=...)), each
    node's worker_ms in that call; worker_ms is then the slowest node's.
    """

    worker_ms: float = 0.0
    roundtrip_ms: float = 0.0
    stragglers: list = field(default_factory=list)
    wait_ms: float = 0.0
    queued_ms: float = 0.0
    nodes: dict = field(default_factory=dict)

    def __str__(self) -> str:
        text = (f"worker {self.worker_ms:.2f} ms, roundtrip {self.roundtrip_ms:.2f} ms, "
                f"{len(self.stragglers)} straggler(s)")
        if self.wait_ms or self.queued_ms:
            text += f", waited {self.wait_ms:.2f} ms, results queued {self.queued_ms:.2f} ms"
        return text


@dataclass
class MemoryReport:
    """Memory in bytes: each env's own, what the pool shares, and the source.

    per_env: each env's charge (its cgroup: its processes, the pages they
    wrote, its kernel objects). shared: what the pool itself holds (the warm
    template and every page it imported, shared by all envs). total and
    mean include both: mean is what one env costs, the number on the bill.
    """

    per_env: list
    source: str
    note: str = ""
    shared: int = 0

    @property
    def total(self) -> int:
        return int(sum(self.per_env)) + self.shared

    @property
    def mean(self) -> float:
        return self.total / max(1, len(self.per_env))


@dataclass(frozen=True)
class EnvContract:
    """What the env declared in its handshake (env 0's; every env runs the same code).

    observation_space and action_space are space specs (boltzlabs.pool.spaces;
    `from_spec` rebuilds the Gymnasium space), None when the env declared none.
    """

    id: str
    protocol_version: int
    observation_space: dict | None
    action_space: dict | None
    metadata: dict
    render_mode: str | None
    # The template's warm-up (spawn="template"; boltzlabs.runtime.template.warm_up):
    # {"modules": what the env's first reset and steps imported, "preload":
    # serve(preload=...), "imported", "failed": {name: error}, "private_birth"/
    # "private_after": the probe's Private_Dirty bytes before reset and after
    # its steps, "steps", "seconds", "error": None or why the probe failed}.
    # None in exec mode or with RLPool(warmup=False).
    warmup: dict | None = None
    # What pool.call / get_attr / set_attr reach (boltzlabs.env.serve's
    # methods=, attributes=, target=): {"methods": [names], "attributes":
    # {name: writable}, "target": the target's type name or None (None: only
    # the names listed)}.
    attributes: dict | None = None

    def __getitem__(self, key: str):
        """`contract["warmup"]` is `contract.warmup`, and so on for every field."""
        if key not in self.__dataclass_fields__:
            raise KeyError(key)
        return getattr(self, key)


def _positive(name: str, value, allow_none: bool = True):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")
    return float(value)


class RLPool:
    """n live envs, each in its own bubblewrap sandbox, behind one batched step.

        with RLPool("./my_env", 1000) as pool:
            obs = pool.reset(seed=0)
            obs, rewards, dones, infos = pool.step(actions)
            obs = pool.reset(where=dones)

    Parameters:
      source: directory holding env.py (which calls boltzlabs.env.serve).
      n: number of envs.
      step_timeout: seconds an env has to answer a step or reset; one that
        misses it is a straggler (done, reward 0, info["straggler"]). None
        takes the policy default (sandbox/policy.toml). With
        serialize_measurement it bounds each env's turn at the gate.
      serialize_measurement: at most one env's step code runs at any instant.
      memory_limit: per-env memory limit (bytes or '512M'); an env over it is
        killed by the kernel and reported on its lane. Needs a memory cgroup.
      limits: per-env limits overriding the policy's [env_limits] for this
        pool, e.g. {"pids": 64, "open_files": 256, "file_size": "16M",
        "straggler_grace": 2.0}; see docs/limits.md.
      workspace_size: size of each env's private tmpfs workspace; None: the
        sandbox policy's [workspace] default_size (64M as shipped).
      spawn: "template" (default) forks every env from one warm template
        that has already imported env.py: a fraction of the memory and
        start-up time. "exec" starts one interpreter per env. An env that
        cannot be forked safely (threads or sockets at import) falls back
        to "exec" with a warning; `pool.spawn` says which is in use.
      start_timeout: seconds each env has to complete its handshake.
      warmup: with spawn="template", run the env's reset and a few steps
        once in a throwaway sandbox before the first fork and import in the
        template what they imported (numpy.random, say), so no env pays for
        it on its own; the template's own state stays as env.py's import left
        it. A probe that fails is a warning, never a failed pool.
        `env_contract["warmup"]` reports it. False turns it off.
      batch_size: the default batch_size of recv() (asynchronous stepping:
        send() actions, recv() the first batch_size envs to finish).
      progress: show a progress bar while starting (default: on a terminal,
        for 64 envs or more).
      worker: None runs the pool here, in a worker process of this machine.
        "tcp://host:port" (or "tls://host:port") runs it on a remote
        `boltzlabs worker --listen`: the env directory is shipped there
        (content-addressed, cached), and every call keeps its meaning;
        timing.worker_ms is measured there, roundtrip_ms here.
      token: the remote worker's token (default: $BOLTZLABS_TOKEN).
      tls_ca: for tls://, the worker's certificate or its CA (PEM) to verify it.
      cluster: "ray" (or a Ray cluster's address) spreads the pool over the
        cluster's nodes, one boltzlabs worker per node; the result is a
        boltzlabs.cluster.ClusterPool with this same API (see its docstring;
        `envs_per_node=` sizes it).
      **params: construction params. A Gymnasium source passes them to
        gymnasium.make(id, **params), checked against the env's constructor
        here; an env directory reads them with boltzlabs.env.params().

    `source` is a directory holding env.py, "gym://<id>" for a Gymnasium env,
    or a bare Gymnasium id ("CartPole-v1") when no such path exists.

    Episodes: every reset mints a UUIDv7 episode id per lane
    (`episode_ids`); `finished_episodes` lists the episodes the latest step
    ended (lane, id, seed, length, return, terminated). `env_id` is this
    pool's UUIDv7, `env_contract` the env's handshake.
    """

    def __new__(cls, *args, cluster=None, **kwargs):
        if cluster is not None and cls is RLPool:
            from boltzlabs.cluster import ClusterPool

            return ClusterPool(*args, cluster=cluster, **kwargs)
        return super().__new__(cls)

    def __init__(self, source, n: int, *, step_timeout=None, serialize_measurement: bool = False,
                 memory_limit=None, workspace_size=None, spawn: str = "template", start_timeout=None,
                 progress=None, batch_size=None, limits=None, worker=None, token=None, tls_ca=None, cluster=None,
                 warmup: bool = True, **params):
        self._closed = True
        self._closed_reason = None
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"n must be a whole number of envs, at least 1; got {n!r}")
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer))
                                       or not 1 <= batch_size <= n):
            raise ValueError(f"batch_size must be a whole number in [1, n={n}], or None; got {batch_size!r}")
        self.batch_size = None if batch_size is None else int(batch_size)
        _warn_pool_option_typos(params)
        resolved = sources.resolve(source, params)
        self.n = n = int(n)
        config = {
            "source_dir": str(resolved.env_dir),
            # As the sandbox will see them (JSON: a tuple is a list), not as the wire
            # would carry them: the worker writes them out as JSON.
            "params": json.loads(json.dumps(resolved.params, allow_nan=True)),
            "n": n,
            "step_timeout": _positive("step_timeout", step_timeout),
            "start_timeout": _positive("start_timeout", start_timeout),
            "serialize_measurement": bool(serialize_measurement),
            "memory_limit": parse_size(memory_limit) if memory_limit is not None else None,
            "workspace_size": None if workspace_size is None else parse_size(workspace_size),
            "spawn": spawn,
            "limits": limits,
            "warmup": bool(warmup),
        }
        # The limits (against the policy of the worker that runs the pool, local
        # or remote) and bwrap are checked by the worker, before any sandbox
        # starts: its refusal comes back as ValueError/TypeError/SandboxUnavailable.
        if spawn not in ("template", "exec"):
            raise ValueError(f"spawn must be 'template' or 'exec', not {spawn!r}")
        if worker is not None and not isinstance(worker, str):
            raise TypeError(f"worker must be an address like 'tcp://host:port', not {type(worker).__name__}")
        self.source = str(source)
        self._resolved = resolved
        self.env_id = uuid7()
        self.timing = Timing()
        self.reset_infos: list = [None] * n
        self._obs: list = [None] * n
        self.terminated = np.zeros(n, dtype=np.bool_)
        self.truncated = np.zeros(n, dtype=np.bool_)
        self.rewards = np.zeros(n, dtype=np.float64)  # the latest step's, exactly as the envs returned them
        self.episode_ids: list = [None] * n
        self.finished_episodes: list = []
        self._episode_seeds: list = [None] * n
        self._episode_lengths = np.zeros(n, dtype=np.int64)
        self._episode_returns = np.zeros(n, dtype=np.float64)
        self._episode_open = np.zeros(n, dtype=np.bool_)
        self._pending_resets: set = set()  # lanes sent as autoresets, not yet received
        self._seq = 0
        self._reader = wire.FrameReader(wire.Limits(1 << 30))
        self._inbox: list = []
        self._start_worker(worker, token, tls_ca, resolved)
        if progress is None:
            progress = n >= _PROGRESS_MIN_ENVS and sys.stderr.isatty()
        try:
            ready = self._open(config, progress)
        except BaseException:
            self._shutdown()
            raise
        self.memory_source = ready["memory_source"]
        self.hello = hello = ready["hello"] or {}
        self.env_contract = EnvContract(
            id=resolved.name, protocol_version=wire.PROTOCOL_VERSION,
            observation_space=hello.get("observation_space"), action_space=hello.get("action_space"),
            metadata=hello.get("metadata") or {}, render_mode=hello.get("render_mode"), warmup=ready.get("warmup"),
            attributes=_offered(hello.get("attributes")))
        self.step_timeout = ready["step_timeout"]
        self._cgroup = ready["cgroup"]
        self.spawn = ready["spawn"]
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, self._link.shutdown, self._cgroup)
        for note in (ready["memory_note"], ready["warning"]):
            if note:
                import warnings

                warnings.warn(note, RuntimeWarning, stacklevel=2)

    # -- worker life --------------------------------------------------------------

    def _start_worker(self, worker, token, tls_ca, resolved) -> None:
        if worker is None:
            self._link = _LocalLink()
            self._proc = self._link.proc
        else:
            from boltzlabs.pool.remote_link import connect

            self._link = connect(worker, token, resolved, tls_ca)
        self.worker = worker or "local"
        self._conn = self._link.conn
        self._conn.settimeout(1.0)  # _receive wakes each second to check that the worker lives
        self._closed = False
        self._finalizer = weakref.finalize(self, self._link.shutdown, None)

    def _open(self, config: dict, progress: bool) -> dict:
        self._conn.sendall(wire.encode([wire.OPEN, config]))
        bar = None
        try:
            while True:
                message = self._receive()
                code = message[0]
                if code == wire.PROGRESS:
                    if progress:
                        if bar is None:
                            from tqdm import tqdm

                            bar = tqdm(total=message[2], desc="starting envs", unit="env", leave=False)
                        bar.update(message[1] - bar.n)
                elif code == wire.READY:
                    return message[1]
                elif code == wire.ERROR:
                    _, _, kind, text, detail = message
                    if kind == "start":
                        others = detail["failed"] - 1
                        more = f" ({others} other env(s) failed too)" if others > 0 else ""
                        gym_id = self._resolved.gym_id
                        fix = (f"gymnasium.make({gym_id!r}, **{config['params']['kwargs']!r}) failed inside the "
                               "sandbox (its traceback is above)." if gym_id else
                               f"Fix the error in {config['source_dir']}/env.py (its traceback is above).")
                        raise EnvStartError(
                            f"{text}{more}.\n--- the tail of env {detail['env']}'s output ---\n{detail['log']}\n"
                            f"--- end ---\n{fix}",
                            env_index=detail["env"], log=detail["log"])
                    if kind == "TypeError":  # e.g. limits= of the wrong type, as the worker's policy says
                        raise TypeError(text)
                    if kind == "ValueError":
                        raise ValueError(text)
                    if kind == "SandboxUnavailable":  # the host or the policy: the text says what to change
                        raise SandboxUnavailable(text)
                    raise WorkerError(f"the worker could not start the pool: {kind}: {text}")
        finally:
            if bar is not None:
                bar.close()

    def _receive(self) -> list:
        """Next message from the worker; never blocks past the worker's death."""
        while not self._inbox:
            try:
                data = self._conn.recv(_RECV_SIZE)
            except socket.timeout:
                if not self._link.alive():
                    raise self._worker_died() from None
                continue
            except OSError:
                data = b""
            if not data:
                self._link.wait_dead()
                raise self._worker_died()
            self._inbox.extend(self._reader.feed(data))
        return self._inbox.pop(0)

    def _worker_died(self) -> WorkerError:
        self._closed = True
        return self._link.died()

    def _call(self, name: str, *args, diagnose=None):
        if self._closed:
            if self._closed_reason is not None:
                raise PoolClosedError(f"this RLPool was shut down ({self._closed_reason}); create a new one")
            raise PoolClosedError("this RLPool is closed; create a new one")
        try:
            frame = wire.encode([wire.CALL, self._seq + 1, name, list(args)])
        except (TypeError, ValueError, OverflowError) as exc:
            if diagnose is not None:
                diagnose()  # raises, naming the culprit
            raise TypeError(f"{name}() arguments cannot be serialized: {exc}") from None
        self._seq += 1
        seq = self._seq
        started = time.perf_counter()
        try:
            try:
                self._conn.sendall(frame)
            except OSError:
                self._link.wait_dead()
                raise self._worker_died() from None
            while True:
                message = self._receive()
                if message[0] == wire.REPLY and message[1] == seq:
                    self.timing.roundtrip_ms = (time.perf_counter() - started) * 1000.0
                    self.timing.worker_ms = message[2]
                    self.timing.wait_ms = self.timing.queued_ms = 0.0
                    return message[3]
                if message[0] == wire.ERROR:
                    _, _, kind, text, _ = message
                    if kind in ("ValueError", "TypeError", "IndexError", "KeyError"):
                        raise ValueError(text)
                    raise WorkerError(f"{kind}: {text}")
        except (ValueError, WorkerError):
            raise
        except BaseException:
            # Interrupted half way (Ctrl-C): the stream is out of step; end it.
            self._shutdown()
            raise

    def _shutdown(self) -> None:
        self._closed = True
        self._finalizer()

    def shutdown(self, reason: str = "owner shutdown") -> bool:
        """Ask the worker to stop this pool now, saying why (the worker logs it).

        Every sandbox ends; the pool is closed, and later calls raise
        PoolClosedError naming `reason`. True when the worker confirmed it,
        False when the pool was already closed or the worker was gone.
        """
        if self._closed:
            return False
        try:
            confirmed = bool(self._call("shutdown", str(reason)))
        except (WorkerError, PoolClosedError):
            confirmed = False
        self._closed_reason = str(reason)
        self._shutdown()
        return confirmed

    def close(self) -> None:
        """Stop every env and the worker; remove every cgroup. Idempotent."""
        self._closed = True
        if hasattr(self, "_finalizer"):
            self._finalizer()

    def __enter__(self) -> "RLPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __len__(self) -> int:
        return self.n

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"RLPool({self.source!r}, {self.n}, {state})"

    @property
    def closed(self) -> bool:
        return self._closed

    # -- the API --------------------------------------------------------------------

    def step(self, actions):
        """Step every env with its action. ONE request to the worker.

        `actions`: a length-n sequence of msgpack-able values or numpy
        arrays, or an array whose first dimension is n (a 1-d array gives
        each env a Python scalar, an (n, ...) array each env its row as an
        array). Returns (obs: list, rewards: float32[n], dones: bool[n],
        infos: list). A lane that failed (exception, death, bad frame, missed
        deadline) comes back done with reward 0, obs None and
        `info["error"]` saying why (`info["straggler"]` for a missed
        deadline). `self.terminated` and `self.truncated` keep the two kinds
        of `done` apart (failures count as truncated); `self.rewards` holds
        the rewards as float64, exactly as the envs returned them.
        """
        obs, rewards, terminated, truncated, infos = self._step(actions)
        return obs, rewards.astype(np.float32), terminated | truncated, infos

    def _step(self, actions, resets=None):
        """step() with exact float64 rewards; the lanes in `resets` (indices)
        are reset instead of stepped, in the same request (next-step autoreset)."""
        n = self.n
        actions = self._actions(actions, n, "step()")
        resets = list(resets) if resets is not None and len(resets) else None
        obs, rewards, terminated, truncated, infos, stragglers = self._call(
            "step", actions, resets, diagnose=lambda: self._raise_unserializable(actions))
        # Hot path: the arrays come as raw bytes, one copy each.
        self.terminated = np.frombuffer(terminated, dtype=np.bool_).copy()
        self.truncated = np.frombuffer(truncated, dtype=np.bool_).copy()
        self.rewards = np.frombuffer(rewards, dtype=np.float64).copy()
        self.timing.stragglers = stragglers
        self._obs = obs
        self._count_episodes(resets)
        return obs, self.rewards, self.terminated, self.truncated, infos

    # -- asynchronous stepping ----------------------------------------------------------

    def send(self, actions, env_ids=None) -> None:
        """Hand `actions` to the envs `env_ids` (all when None) and return at once.

        `actions` is aligned with `env_ids` (a sequence or an array whose first
        dimension is len(env_ids)). Each env then runs its step; `recv()`
        collects the results. Refused (ValueError, nothing sent) when an env
        is in flight or has a result not yet received. A dead env, or a
        straggler still busy, gets a failure result at once (as in step()).
        """
        self._send(actions, env_ids)

    def _send(self, actions, env_ids=None, resets=None) -> None:
        lanes = list(range(self.n)) if env_ids is None else self._env_ids(env_ids)
        actions = self._actions(actions, len(lanes), "send()")
        resets = list(resets) if resets is not None and len(resets) else None
        self._call("send", actions, lanes, resets, diagnose=lambda: self._raise_unserializable(actions))
        if resets:
            self._begin_episodes(resets, None)
            self._pending_resets.update(resets)

    def recv(self, batch_size=None, timeout=None):
        """The first `batch_size` envs to finish since their send().

        Returns (env_ids: int64[k], obs: list, rewards: float32[k], dones:
        bool[k], infos: list), aligned with env_ids, in the order the envs
        finished. batch_size defaults to the pool's batch_size, else every
        env in flight or finished. k < batch_size only when `timeout`
        (seconds; 0 takes only what has finished) passes first. An env that missed its deadline (counted from
        its send) or failed comes back as in step(): done, reward 0, obs
        None, info["error"] (and info["straggler"]). Refused (ValueError)
        when batch_size is more than can come.
        """
        env_ids, obs, rewards, terminated, truncated, infos = self._recv(batch_size, timeout)
        return env_ids, obs, rewards.astype(np.float32), terminated | truncated, infos

    def _recv(self, batch_size=None, timeout=None):
        """recv() with float64 rewards and terminated/truncated apart."""
        if batch_size is None:
            batch_size = self.batch_size
        if batch_size is not None and (isinstance(batch_size, bool)
                                       or not isinstance(batch_size, (int, np.integer)) or batch_size < 1):
            raise ValueError(f"recv() batch_size must be a whole number >= 1, not {batch_size!r}")
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
                raise ValueError(f"recv() timeout must be a number of seconds >= 0 (0: only what has finished), "
                                 f"not {timeout!r}")
            timeout = float(timeout)
        lanes, obs, rewards, terminated, truncated, infos, stragglers, wait_ms, queued_ms = self._call(
            "recv", None if batch_size is None else int(batch_size), timeout)
        env_ids = np.array(lanes, dtype=np.int64)
        rewards = np.frombuffer(rewards, dtype=np.float64).copy()
        terminated = np.frombuffer(terminated, dtype=np.bool_).copy()
        truncated = np.frombuffer(truncated, dtype=np.bool_).copy()
        self.timing.wait_ms, self.timing.queued_ms, self.timing.stragglers = wait_ms, queued_ms, stragglers
        # New arrays and list, not in-place writes: what earlier calls returned stays as it was.
        self._obs = list(self._obs)
        for i, o in zip(lanes, obs):
            if o is not None:
                self._obs[i] = o
        self.rewards = self.rewards.copy()
        self.terminated = self.terminated.copy()
        self.truncated = self.truncated.copy()
        self.rewards[env_ids] = rewards
        self.terminated[env_ids] = terminated
        self.truncated[env_ids] = truncated
        # Autoreset lanes (sent with resets) began their episode at send: not a step.
        stepped = [i for i in lanes if i not in self._pending_resets]
        self._pending_resets.difference_update(lanes)
        self._count_episodes(None, stepped)
        return env_ids, obs, rewards, terminated, truncated, infos

    def lane_states(self) -> list:
        """Each env's one state: 'idle', 'in_flight' (sent, not finished),
        'finished' (a result waiting for recv), 'straggler' (its result was
        given, it is still busy; reset it) or 'dead' (reset it to respawn)."""
        return self._call("lane_states")

    def _env_ids(self, env_ids) -> list:
        ids = np.asarray(env_ids)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)) or ids.dtype == np.bool_:
            raise ValueError("env_ids must be a sequence of env indices")
        lanes = [int(i) for i in ids]
        if any(not 0 <= i < self.n for i in lanes):
            raise ValueError(f"env_ids has an env index outside [0, {self.n})")
        if len(set(lanes)) != len(lanes):
            raise ValueError("env_ids has an env index twice")
        return lanes

    def _actions(self, actions, count: int, what: str) -> list:
        if isinstance(actions, np.ndarray):
            if actions.ndim == 0 or actions.shape[0] != count:
                raise ValueError(f"{what} needs {count} actions (an array whose first dimension is {count}); "
                                 f"got an array of shape {actions.shape}")
            return actions.tolist() if actions.ndim == 1 else list(actions)
        try:
            got = len(actions)
        except TypeError:
            raise TypeError(f"{what} needs a sequence of {count} actions, not {type(actions).__name__}") from None
        if got != count:
            raise ValueError(f"{what} needs {count} actions, one per env; got {got}")
        return list(actions)

    def _count_episodes(self, resets, lanes=None) -> None:
        """Episode bookkeeping after a step (of `lanes` only, when given):
        lengths, returns, finished episodes."""
        stepped = self._episode_open.copy()
        if lanes is not None:
            received = np.zeros(self.n, dtype=np.bool_)
            received[lanes] = True
            stepped &= received
        if resets:
            stepped[resets] = False
            self._begin_episodes(resets, None)
        self._episode_lengths[stepped] += 1
        self._episode_returns[stepped] += self.rewards[stepped]
        ended = stepped & (self.terminated | self.truncated)
        self._episode_open[ended] = False
        self.finished_episodes = [
            {"env": i, "id": self.episode_ids[i], "seed": self._episode_seeds[i],
             "length": int(self._episode_lengths[i]), "return": float(self._episode_returns[i]),
             "terminated": bool(self.terminated[i])}
            for i in np.flatnonzero(ended).tolist()]

    def _begin_episodes(self, lanes, seeds) -> None:
        for k, i in enumerate(lanes):
            self.episode_ids[i] = uuid7()
            self._episode_seeds[i] = None if seeds is None else seeds[k]
        self._episode_lengths[lanes] = 0
        self._episode_returns[lanes] = 0.0
        self._episode_open[lanes] = True

    @staticmethod
    def _raise_unserializable(actions):
        for i, action in enumerate(actions):
            try:
                wire.encode(action)
            except (TypeError, ValueError, OverflowError) as exc:
                raise TypeError(f"the action for env {i} cannot be sent ({exc}); actions must be msgpack-able "
                                "values (numbers, str, bytes, lists, dicts, None) or numpy arrays") from None

    def _lanes(self, where) -> list:
        n = self.n
        if where is None:
            return list(range(n))
        mask = np.asarray(where)
        if mask.dtype == np.bool_:
            if mask.shape != (n,):
                raise ValueError(f"reset(where=...) as a mask needs {n} booleans; got shape {mask.shape}")
            return np.flatnonzero(mask).tolist()
        if mask.ndim != 1 or (mask.size and not np.issubdtype(mask.dtype, np.integer)):
            raise ValueError("reset(where=...) takes a boolean mask of length n or a list of env indices")
        lanes = sorted(set(int(i) for i in mask))
        if lanes and (lanes[0] < 0 or lanes[-1] >= n):
            raise ValueError(f"reset(where=...) has an env index outside [0, {n})")
        return lanes

    def reset(self, seed=None, where=None, hard: bool = False, options=None) -> list:
        """Reset envs and return all n observations.

        seed: an int gives env i the seed `seed + i`; a list gives one per env
        (length n); None lets each env choose. where: a bool mask or a list of
        indices; only those lanes reset, the others' latest observations are
        spliced in place. hard=True kills and respawns the selected sandboxes
        on a fresh workspace before resetting them (byte-identical starts).
        A lane whose reset failed gets obs None and `reset_infos[i]["error"]`.
        """
        lanes = self._lanes(where)
        if seed is None:
            seeds = None
        elif isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
            seeds = [int(seed) + i for i in lanes]
        elif isinstance(seed, (list, tuple, np.ndarray)):
            if len(seed) != self.n:
                raise ValueError(f"reset(seed=[...]) needs one seed per env ({self.n}); got {len(seed)}")
            seeds = [None if seed[i] is None else _whole(seed[i], i) for i in lanes]
        else:
            raise TypeError(f"seed must be an int, a list of n ints or None, not {type(seed).__name__}")
        if not lanes:
            return list(self._obs)
        _, obs, infos = self._call("reset", lanes, seeds, bool(hard), options)
        self.timing.stragglers = [i for i, info in zip(lanes, infos) if info.get("straggler")]
        # New list and arrays, not in-place writes: what step() returned stays as it was.
        self._obs = list(self._obs)
        for i, o, info in zip(lanes, obs, infos):
            self._obs[i] = o
            self.reset_infos[i] = info
        self.terminated = self.terminated.copy()
        self.truncated = self.truncated.copy()
        self.terminated[lanes] = False
        self.truncated[lanes] = False
        self._begin_episodes(lanes, seeds)
        return list(self._obs)

    def render(self, env_index: int = 0):
        """The frame of env `env_index` (from its `serve(render=...)`; for a
        gym source, `env.render()` with the pool's render_mode), or None when
        the env has no frame. Raises EnvError if the env could not render."""
        if isinstance(env_index, bool) or not isinstance(env_index, (int, np.integer)) or not 0 <= env_index < self.n:
            raise ValueError(f"env index must be in [0, {self.n}); got {env_index!r}")
        return self._render([int(env_index)])[0]

    def _render(self, lanes: list) -> list:
        frames, errors = self._call("render", lanes)
        if errors:
            index, error = min((int(k), v) for k, v in errors.items())
            raise EnvError(f"env {index} could not render: {error}", env_index=index)
        return frames

    # -- methods and attributes of the envs (serve(methods=, attributes=, target=)) ------

    def call(self, name: str, *args, env_ids=None, **kwargs) -> list:
        """Call the env's method `name(*args, **kwargs)` in every env (or those
        in `env_ids`); one result per lane, in lane order. For an attribute
        that is not callable, its value (Gymnasium's VectorEnv.call).

        A gym source reaches its Gymnasium env through its wrappers; an env
        directory reaches only what its serve(methods=, attributes=, target=)
        offers. Raises AttributeError (naming what the env offers) for any
        other name, before anything is sent when the env listed its names;
        EnvError (with the lane and the env's traceback) when an env raised,
        died, missed the step deadline or returned a value that cannot cross
        the wire; arguments and results travel like actions and observations.
        """
        return self._attr("call", name, env_ids, list(args), kwargs)

    def get_attr(self, name: str, env_ids=None) -> list:
        """The value of the env attribute `name` in every env (or those in
        `env_ids`), one per lane. A method is not called (use call())."""
        return self._attr("get", name, env_ids, [], {})

    def set_attr(self, name: str, values, env_ids=None) -> None:
        """Set the env attribute `name` in every env (or those in `env_ids`):
        `values` is one value for all, or a list or tuple of one per lane
        (Gymnasium's rule: a list meant for every env goes as [v] * n)."""
        lanes = list(range(self.n)) if env_ids is None else self._env_ids(env_ids)
        if not isinstance(values, (list, tuple)):
            values = [values] * len(lanes)
        if len(values) != len(lanes):
            raise ValueError("Values must be a list or tuple with length equal to the number of environments. "
                             f"Got `{len(values)}` values for {len(lanes)} environments.")
        self._attr("set", name, lanes, [], {}, list(values))

    def _attr(self, op: str, name, env_ids, args: list, kwargs: dict, values=None) -> list:
        if not isinstance(name, str):
            raise TypeError(f"the attribute name must be a str, not {type(name).__name__}")
        lanes = list(range(self.n)) if env_ids is None else self._env_ids(env_ids)
        offered = self.env_contract.attributes
        if offered is not None and offered["target"] is None:  # the env listed everything it offers
            methods, attributes = offered["methods"], offered["attributes"]
            if not (name in attributes or (op == "call" and name in methods)):
                raise AttributeError(_missing(op, name, methods, attributes, self.env_contract.id))
            if op == "set" and not attributes[name]:
                raise AttributeError(f"the env's attribute {name!r} is read-only (its serve(attributes=) gave it no "
                                     "setter)")
        if not lanes:
            return []
        verb = {"call": "call", "get": "get the attribute", "set": "set the attribute"}[op]
        try:
            results, errors = self._call("attr", lanes, op, name, args, kwargs, values)
        except TypeError as exc:
            raise TypeError(f"{verb} {name!r}: the arguments cannot cross the wire ({exc}); they must be "
                            "msgpack-able values or numpy arrays, like actions") from None
        if errors:
            index, (message, detail) = min((int(k), v) for k, v in errors.items())
            if message.startswith("AttributeError: "):  # the env's own: no such name (Gymnasium raises it too)
                raise AttributeError(f"env {index}: {message[len('AttributeError: '):]}")
            others = f" ({len(errors) - 1} other env(s) failed too)" if len(errors) > 1 else ""
            raise EnvError(f"env {index} could not {verb} {name!r}{others}: {detail or message}", env_index=index)
        return results

    def memory(self) -> MemoryReport:
        """Each env's memory in bytes (kernel accounting) and its source."""
        report = self._call("memory")
        return MemoryReport(report["per_env"], report["source"], report["note"], report["shared"])

    def envs_per_gb(self) -> float:
        """Envs per GiB: 2**30 / (pool memory / n), from the kernel's accounting.

        Pool memory is every env's charge plus what they share (the template).
        """
        return (1 << 30) / max(1.0, self.memory().mean)

    def log(self, index: int) -> str:
        """The tail of env `index`'s stdout and stderr (bounded; see policy log_tail)."""
        if not isinstance(index, (int, np.integer)) or not 0 <= index < self.n:
            raise ValueError(f"env index must be in [0, {self.n}); got {index!r}")
        return self._call("log", int(index))

    def states(self) -> list:
        """Each lane's state: 'idle', 'busy' (a straggler), 'starting' or 'dead'."""
        return self._call("states")

    def pids(self) -> list:
        """Host pid of each env's sandbox (its bwrap process), -1 when dead."""
        return self._call("pids")


def _whole(seed, index: int) -> int:
    # A float seed is refused, not truncated: 1.5 and 1 must not seed alike.
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"reset(seed=[...]) takes whole numbers or None; env {index}'s seed is {seed!r}")
    return int(seed)


def _offered(described):
    """The env's handshake's list of methods and attributes, checked: an
    env sends anything. None (ask the env) when it is missing or malformed."""
    if not isinstance(described, dict):
        return None
    methods, attributes, target = described.get("methods"), described.get("attributes"), described.get("target")
    if (not isinstance(methods, list) or not all(isinstance(m, str) for m in methods)
            or not isinstance(attributes, dict) or not all(isinstance(k, str) and isinstance(v, bool)
                                                           for k, v in attributes.items())
            or not (target is None or isinstance(target, str))):
        return None
    return {"methods": methods, "attributes": attributes, "target": target}


def _missing(op: str, name: str, methods: list, attributes: dict, source: str) -> str:
    if op != "call" and name in methods:
        return f"{name!r} is a method of the env, not an attribute: use call({name!r}, ...)"
    return (f"the env {source!r} has no method or attribute {name!r}; it offers methods {sorted(methods)} and "
            f"attributes {sorted(attributes)} (name them in serve(..., methods=, attributes=) in its env.py)")


_POOL_OPTIONS = ("step_timeout", "serialize_measurement", "memory_limit", "workspace_size", "start_timeout",
                 "progress", "batch_size", "limits", "worker", "token", "tls_ca", "cluster", "envs_per_node",
                 "warmup")


def _warn_pool_option_typos(params: dict) -> None:
    # Env params share RLPool's keywords, so a misspelt pool option would reach
    # an env directory (which nobody checks) as a param, silently.
    import difflib
    import warnings

    for name in params:
        close = difflib.get_close_matches(name, _POOL_OPTIONS, n=1, cutoff=0.8)
        if close:
            warnings.warn(f"{name!r} is passed to the env as a param; did you mean the pool option {close[0]!r}?",
                          UserWarning, stacklevel=3)


def _worker_environment() -> dict:
    env = dict(os.environ)
    # The worker must import this very boltzlabs, installed or not.
    root = str(Path(__file__).resolve().parent.parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


class _LocalLink:
    """The worker as our child process, over a socketpair (RLPool without worker=)."""

    kind = "local"

    def __init__(self):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.stderr = tempfile.TemporaryFile()  # unlinked at once: nothing left behind
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "boltzlabs.worker", "--fd", str(theirs.fileno())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=self.stderr,
                stderr=self.stderr, start_new_session=True,  # Ctrl-C reaches us, not the worker
                env=_worker_environment())
        except BaseException:
            ours.close()
            self.stderr.close()
            raise
        finally:
            theirs.close()
        self.conn = ours

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_dead(self) -> None:
        self.proc.wait(timeout=10)

    def died(self) -> WorkerError:
        self.stderr.seek(0)
        tail = self.stderr.read()[-4000:].decode("utf-8", "replace")
        return WorkerError(f"the boltzlabs worker (pid {self.proc.pid}) exited with code {self.proc.poll()}; "
                           f"its output:\n{tail or '(none)'}")

    def shutdown(self, cgroup) -> None:
        """End the worker: ask, then insist. Runs once, from close(), GC or exit."""
        proc, conn = self.proc, self.conn
        try:
            if proc.poll() is None:
                try:
                    conn.settimeout(5.0)
                    conn.sendall(wire.encode([wire.CLOSE]))
                    proc.wait(timeout=10)
                except (OSError, subprocess.TimeoutExpired):
                    pass
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the worker and every bwrap it started
                except ProcessLookupError:
                    pass
                proc.wait()
            if cgroup:
                # A list, one per cgroup hierarchy. Also when the worker died on
                # its own: envs it had frozen (serialize_measurement) ignore
                # even SIGKILL until thawed, which this does.
                remove_pool_dir(cgroup)
        finally:
            conn.close()
            self.stderr.close()
