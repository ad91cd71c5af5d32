"""The worker: one process that owns every sandbox of a pool.

    RLPool (client) ==one frame per call==> Worker --one frame per env--> sandboxes
                                             |  epoll over every env's channel,
                                             |  log pipe and pidfd
    RLPool (client) <==one frame per call== Worker <--one frame per env-- sandboxes

`python -m boltzlabs.worker --fd N` talks to its client over the socket on fd
N. The client sends OPEN, then CALLs (step, reset, send, recv, render, attr,
memory, log, close) one at a time; the worker answers each with one REPLY or ERROR
frame. `send` returns before the envs answer: their replies are taken by the
event loop, which also runs between calls, and held until a `recv`.

Arrays in observations and actions are passed through, never decoded: an
array is a msgpack ExtType whose header the worker checks (wire "check"
limits) and re-packs as is. The rest of a reply is decoded under the limits
below and re-encoded into the client's REPLY; the depth cap keeps that
re-encoding (three levels deeper) inside msgpack's own limit.

Everything an env writes is untrusted: frames are capped and decoded with
limits (size, lengths, objects per frame, nesting depth: wire.Limits, from
[limits] in sandbox/policy.toml; the handshake has caps of its own), replies
are checked for shape, logs keep a bounded tail, the bytes the pool holds for
replies not yet returned are bounded (limits.max_pool_bytes), and an env that
breaks any rule is killed and reported on its lane. Nothing here walks an
env's value recursively: decoding is msgpack's C code under those limits,
descriptions in errors go through reprlib (bounded depth and width).

Which frames are due. Each request to an env (STEP, RESET, RENDER, ATTR) carries a
fresh sequence number, and exactly one reply carrying that number is due
until it comes. The env is BUSY from the request until that reply; a
straggler (past its deadline) stays BUSY, so its one late reply to the number
it was given is legitimate: it frees the lane and is dropped, as the README
says. Every other frame is a protocol violation that kills the lane at once,
before anything else it sent is decoded: a frame when no reply is due (a
second reply, anything after a dropped late one, anything from an idle env),
a frame with any other sequence number (older or newer), and a reply of the
wrong kind or shape. So an env cannot make the worker decode frames it then
ignores.

The client's socket stays in the epoll set during every wait, so a client
that dies tears the pool down even in the middle of a step; bubblewrap's
--die-with-parent does the same if the worker itself dies.
"""

from __future__ import annotations

import argparse
import array
import collections
import json
import os
import reprlib
import resource
import select
import signal
import socket
import sys
import time
import traceback

import msgpack

from boltzlabs import wire
from boltzlabs.errors import ClientGone, StartFailure as _StartFailure
from boltzlabs.worker import native
from boltzlabs.sandbox.cgroups import CgroupPool, CgroupUnavailable
from boltzlabs.sandbox.identity import host_account
from boltzlabs.sandbox.builder import SandboxSpec
from boltzlabs.sandbox.policy import find_bwrap, load_policy
from boltzlabs.worker.spawn import TEMPLATE_LANE, ExecSpawner, TemplateSpawner, TemplateUnavailable, reap_orphans

# Env lane states (the sandbox's side). A lane is in exactly one.
STARTING, IDLE, BUSY, DEAD = "starting", "idle", "busy", "dead"

# Asynchronous stepping (send/recv), a second axis per lane: no async action
# outstanding, an action sent and not answered, or a result held for recv.
# Every action sent ends in exactly one result, so FLYING always ends FINISHED.
NONE, FLYING, FINISHED = 0, 1, 2

_ABANDONED = "start-up abandoned after another env failed"
_OBJECT_COST = 64  # bytes a decoded object is charged to the pool's budget (an empty list is 56, a dict 64+)
_READ_SIZE = 1 << 16


def _exit_signal(status) -> int:
    """The signal that ended a process, from its waitpid status (0: none).
    bwrap reports a sandboxed process killed by signal S as exit 128+S."""
    if not isinstance(status, int):
        return 0
    if os.WIFSIGNALED(status):
        return os.WTERMSIG(status)
    code = os.waitstatus_to_exitcode(status)
    return code - 128 if code > 128 and code - 128 in signal.valid_signals() else 0


def describe_exit(status: int) -> str:
    """Plain words for a waitpid status of a bwrap process."""
    if os.WIFSIGNALED(status):
        return f"was killed by signal {signal.Signals(os.WTERMSIG(status)).name}"
    code = os.waitstatus_to_exitcode(status)
    if code > 128 and code - 128 in signal.valid_signals():
        # bwrap reports a sandboxed process killed by signal S as exit 128+S.
        return f"was killed by signal {signal.Signals(code - 128).name} (exit code {code})"
    return f"exited with code {code}"


class Env:
    """One lane: its sandbox process, channel, log and state."""

    __slots__ = ("index", "state", "pid", "chan", "logfd", "reader", "log", "seq",
                 "out", "cause", "held", "started", "events_base", "generation", "expect",
                 "flight", "result", "deadline", "done_at")

    def __init__(self, index: int, limits: wire.Limits):
        self.index = index
        self.state = DEAD
        self.pid = self.chan = self.logfd = -1
        self.reader = wire.FrameReader(limits)
        self.log = bytearray()
        self.seq = -1
        self.out = b""
        self.cause = "not started"
        self.held = 0  # what the pool holds of its replies: bytes read, 64 per decoded object
        self.started = 0.0
        self.events_base = (0, 0)  # the cgroup's (OOM kills, refused forks) at spawn
        self.generation = 0
        self.expect = None  # the reply code due for the request in flight
        self.flight = NONE  # the async axis: NONE, FLYING or FINISHED
        self.result = None  # FINISHED: (obs, reward, terminated, truncated, info)
        self.deadline = 0.0  # FLYING: when it becomes a straggler (inf while queued at the gate)
        self.done_at = 0.0  # FINISHED: when the result was ready (for queued_ms)


class Op:
    """A request in progress: which lanes it waits for and what came back."""

    __slots__ = ("seq", "waiting", "results")

    def __init__(self, seq: int):
        self.seq = seq
        self.waiting: set[int] = set()
        self.results: dict[int, list] = {}




def _warmup_note(report: dict | None) -> str:
    """The warning for a warm-up that failed (template.warm_up), or ''."""
    if report is None:
        return ""
    notes = []
    if report["error"]:
        notes.append(f"the warm template's probe failed, so each env imports on its own what its reset and step "
                     f"import (more memory per env); the pool runs. {report['error']}. Fix the env's reset/step, "
                     "or pass serve(preload=[...]) the modules they import, or RLPool(warmup=False) to skip it")
    failed = sorted(set(report["failed"]) & set(report["preload"]))
    if failed:
        notes.append("serve(preload=...) named modules the template could not import: "
                     + "; ".join(f"{name}: {report['failed'][name]}" for name in failed[:8]))
    return "\n".join(notes)


class Worker:
    """Owns the sandboxes of one pool and serves one client."""

    def __init__(self, conn: socket.socket, remote: dict | None = None):
        self.conn = conn
        # A remote pool (remote.py): the listener chose the env directory (a
        # client never names a path on this host) and caps what it may ask for.
        self.remote = remote
        max_frame = remote["max_frame"] if remote else 1 << 30
        # A remote client is as hostile as an env: its frames make a bounded
        # number of objects (~64 bytes each) nested a bounded depth. A local
        # client is the trainer itself, and its big batches stay hook-free.
        guard = dict(max_depth=wire.MAX_DEPTH, max_objects=max(1 << 20, max_frame // 32)) if remote else {}
        self.client_reader = wire.FrameReader(wire.Limits(max_frame, max_array_len=1 << 24, max_map_len=1 << 20,
                                                          arrays="pass", **guard))
        self.shutdown_reason = None
        self.client_inbox: list = []
        self.epoll = select.epoll()
        # The step's hot path in C (native.py), or None for pure Python; the
        # client warns with the note when the extension is missing.
        self.fastpath, self.fastpath_note = native.load()
        self.handlers: dict[int, tuple] = {}
        self.epoll.register(conn.fileno(), select.EPOLLIN)
        self.handlers[conn.fileno()] = ("client", None)
        self.envs: list[Env] = []
        self.spawner = None
        self.warning = ""
        self.op: Op | None = None
        self.cgroups: CgroupPool | None = None
        self.account = None
        self.memory_note = ""
        self.limits_note = ""
        self._seq = 0
        self._packer = msgpack.Packer(use_bin_type=True)
        # Async stepping: lanes FLYING, lanes FINISHED in the order they
        # finished (recv hands out the first ones), and the gate's queue.
        self.flying: set[int] = set()
        self.finished: collections.deque[int] = collections.deque()
        self.gate_queue: collections.deque[int] = collections.deque()
        self.gate_holder = -1
        # (deadline, lane, seq) in the order set. Every deadline is "now +
        # step_timeout" when set (at send, or at GO for a gated lane), so the
        # deque is sorted and the earliest is at its head: O(1) per poll, not
        # O(lanes in flight). Entries of lanes that finished are dropped lazily.
        self.deadlines: collections.deque[tuple] = collections.deque()
        # (kill time, lane, seq) of stragglers: a lane still busy with request
        # seq at its kill time (deadline + straggler_grace) is killed. Sorted
        # the same way (each is "now + grace" when set).
        self.overdue: collections.deque[tuple] = collections.deque()
        self.straggler_grace = float("inf")
        self.hello = None  # lane 0's handshake info, for the client's READY
        self.held = 0  # the sum of every lane's `held`: bounded by max_pool_bytes
        self.max_pool_bytes = 1 << 30
        # serialize_measurement with a freezer: every env is frozen outside its
        # turn and its own requests (see _freeze); `freeze_pending`: lanes asked to
        # freeze whose freeze is not confirmed yet.
        self.freezing = False
        self.freeze_pending: set[int] = set()
        self.gate_note = ""

    # -- configuration and start-up -------------------------------------------------

    def open(self, config: dict) -> dict:
        if not isinstance(config, dict):
            raise ValueError("OPEN needs the pool's configuration")
        if self.remote:
            config = dict(config, source_dir=self.remote["source_dir"])
            if not isinstance(config.get("n"), int) or not 1 <= config["n"] <= self.remote["max_envs"]:
                raise ValueError(f"this worker serves pools of 1 to {self.remote['max_envs']} envs (its --max-envs); "
                                 f"asked for {config.get('n')!r}")
        self.policy = load_policy()
        if self.remote:  # the listener's ceilings, before anything starts (remote.py)
            from boltzlabs.worker.ceilings import apply_ceilings

            config = apply_ceilings(config, self.remote["ceilings"], self.policy)
        limits = self.policy.limits
        lengths = (limits["max_str_len"], limits["max_bin_len"], limits["max_array_len"], limits["max_map_len"])
        depth = limits.get("max_depth", wire.MAX_DEPTH)
        self.env_limits = wire.Limits(limits["max_frame"], *lengths, arrays="check", max_depth=depth,
                                      max_objects=limits.get("max_objects_per_frame", 1 << 19))
        # The handshake is kept (lane 0's, for the client), so it has caps of its own.
        self.hello_limits = wire.Limits(min(limits.get("max_hello", 4 << 20), limits["max_frame"]), *lengths,
                                        arrays="check", max_depth=depth,
                                        max_objects=limits.get("max_hello_objects", 1 << 16))
        self.max_pool_bytes = int(limits.get("max_pool_bytes", 1 << 30))
        self.log_tail = int(limits["log_tail"])
        self.start_timeout = float(config.get("start_timeout") or limits["start_timeout"])
        self.step_timeout = float(config.get("step_timeout") or limits["step_timeout"])
        self.gated = bool(config.get("serialize_measurement"))
        # Per env: [env_limits] of the policy, with the pool's overrides (docs/limits.md).
        self.limits = self.policy.env_limits(config.get("limits"), config.get("memory_limit"))
        self.memory_limit = self.limits.get("memory") or None
        self.straggler_grace = self.limits.get("straggler_grace", float("inf"))
        find_bwrap()  # before the account's checks: a host without bwrap is told that first
        self.account = host_account(self.policy.sandbox.get("identity", {}))
        # The policy compiled once (boltzlabs.sandbox.plan); both spawners use this spec's plan.
        self.spec = SandboxSpec(self.policy, config["source_dir"], config.get("workspace_size"),
                                config.get("params") or {}, self.account, self.limits)
        n = int(config["n"])
        _raise_fd_limit(n)
        guardian = None
        try:
            self.cgroups = CgroupPool(self.memory_limit, self.limits.get("pids"), freezer=self.gated)
            if self.limits.get("pids") and not self.cgroups.limits_pids:
                self.limits_note = (f"no writable pids cgroup here: the per-env pids limit "
                                    f"({self.limits['pids']} tasks) is not enforced")
            self.memory_source = f"cgroup {self.cgroups.version} working set (usage - inactive file), kernel memory included"
        except CgroupUnavailable as exc:
            self.cgroups = None
            self.memory_source = "psutil PSS of each sandbox's processes (no writable memory cgroup)"
            self.memory_note = f"no cgroup memory accounting: {exc}; envs_per_gb() uses PSS instead"
            if self.limits.get("pids"):
                self.limits_note = f"no cgroups here: the per-env pids limit ({self.limits['pids']} tasks) is not enforced"
            if self.memory_limit:
                raise ValueError(f"memory_limit needs a writable memory cgroup, and this host has none ({exc})")
        if self.cgroups is not None:
            guardian = _guard_cgroups(self.cgroups.paths)  # however this worker dies, its cgroups go with it
        if self.gated:
            self.freezing = self.cgroups is not None and self.cgroups.freezes
            if self.freezing:
                self._on_message = self._on_message_freezing
            else:
                why = self.cgroups.freezer_note if self.cgroups is not None else "no writable cgroups here"
                self.gate_note = (f"serialize_measurement cannot freeze envs outside their turn ({why}): "
                                  "step calls still run one at a time, but threads or child processes an env "
                                  "leaves running after its reply keep running during other envs' turns")
        self.envs = [Env(i, self.env_limits) for i in range(n)]
        self.warmup = bool(config.get("warmup", True))
        self.warmup_timeout = self.spec.plan.warmup_timeout if self.warmup else 0.0
        self.spawner = ExecSpawner(self)
        if config.get("spawn", "template") == "template":
            try:
                self.spawner = TemplateSpawner(self)
            except TemplateUnavailable as exc:
                self.warning = (f"spawn='template' is not possible for this env, so every env runs its own "
                                f"interpreter (spawn='exec'), which costs more memory and start-up time: {exc}")
        warmup = self.spawner.warmup if self.spawner.kind == "template" else None
        warmup_note = _warmup_note(warmup)
        self._start(self.envs, progress=True)
        failed = [e for e in self.envs if e.state != IDLE]
        if failed:
            first = min(failed, key=lambda e: e.cause == _ABANDONED)
            raise _StartFailure(first.index, f"env {first.index} failed to start: {first.cause}",
                                _tail(first.log), len(failed))
        return {
            "n": n,
            "memory_source": self.memory_source,
            "memory_note": self.memory_note,
            "cgroup": self.cgroups.paths if self.cgroups else None,  # for tests and diagnostics only
            "guardian": guardian,
            "hello": self.hello,
            "step_timeout": self.step_timeout,
            "spawn": self.spawner.kind,
            "fast_path": self.fastpath is not None,
            "fast_path_note": self.fastpath_note,
            "warning": "\n".join(note for note in (self.warning, self.limits_note, self.gate_note, warmup_note)
                                 if note),
            "warmup": warmup,
        }

    def _spawn(self, env: Env) -> None:
        """Start env's sandbox. Its fds are registered; it is STARTING."""
        if self.spawner.kind == "template" and not self.spawner.alive():
            self.spawner = TemplateSpawner(self)  # the last one died; a new one for respawns
        env.generation += 1
        if self.cgroups is not None:
            self._settle(env)
            env.events_base = self.cgroups.events(env.index)
        if self.freezing:
            self._thaw(env)  # the template forks while in the env's cgroups: never into a frozen one
        self.spawner.spawn(env)  # sets env.chan, env.logfd (and env.pid when known)
        os.set_blocking(env.chan, False)
        os.set_blocking(env.logfd, False)
        env.state = STARTING
        env.seq = -1
        env.out = b""
        env.reader = wire.FrameReader(self.hello_limits)
        self._unhold(env)
        env.started = time.monotonic()
        for fd, kind in ((env.chan, "chan"), (env.logfd, "log")):
            self.epoll.register(fd, select.EPOLLIN)
            self.handlers[fd] = (kind, env)
        if self.spawner.kind == "template":
            self.spawner.deliver_exits()  # exits read while waiting for the fork

    def _settle(self, env: Env) -> None:
        """Before env's sandbox is (re)spawned into its cgroup: wait until the
        tasks of its last one are gone, killing any still there. They count
        against pids.max until reaped (exec mode's bwrap is reaped by this
        loop), and a fork bomb's leftovers would refuse the new sandbox's forks."""
        deadline = time.monotonic() + 5.0
        while self.cgroups.tasks(env.index) and time.monotonic() < deadline:
            self.cgroups.kill(env.index)
            self._poll(0.005)
            reap_orphans()

    def watch(self, fd: int, callback, arg) -> None:
        """Call `callback(arg)` whenever fd is readable (for the spawners)."""
        self.epoll.register(fd, select.EPOLLIN)
        self.handlers[fd] = ("call", (callback, arg))

    def unwatch(self, fd: int) -> None:
        self._unregister(fd)

    def _start(self, envs: list[Env], progress: bool = False) -> None:
        """Spawn envs, overlapping spawns with handshakes, until all are IDLE or DEAD."""
        deadline_of = lambda env: env.started + self.start_timeout  # noqa: E731
        last_report = 0.0
        for env in envs:
            if env.state != DEAD:
                self._kill(env, "restarted")
            try:
                self._spawn(env)
            except (OSError, TemplateUnavailable) as exc:
                env.state = DEAD
                env.cause = f"could not spawn its sandbox: {exc}"
            self._poll(0)
            if progress and time.monotonic() - last_report > 0.1:
                last_report = time.monotonic()
                self._progress(envs)
        while True:
            starting = [e for e in envs if e.state == STARTING]
            if not starting:
                break
            now = time.monotonic()
            for env in starting:
                if now >= deadline_of(env):
                    self._kill(env, f"did not complete its handshake within {self.start_timeout:g} s")
            earliest = min((deadline_of(e) for e in starting if e.state == STARTING), default=now)
            self._poll(max(0.0, min(earliest - now, 0.1)))
            if progress and time.monotonic() - last_report > 0.1:
                last_report = time.monotonic()
                self._progress(envs)
            if progress and any(e.state == DEAD for e in envs):
                # Fail fast: at pool start-up one broken env fails the pool.
                for env in envs:
                    if env.state == STARTING:
                        self._kill(env, _ABANDONED)
        if progress:
            self._progress(envs)

    def _progress(self, envs: list[Env]) -> None:
        ready = sum(e.state == IDLE for e in envs)
        self._send([wire.PROGRESS, ready, len(envs)])

    # -- the event loop -------------------------------------------------------------

    def _poll(self, timeout: float) -> None:
        """One round of epoll: read every ready fd, handle what arrived; then
        kill the stragglers past their grace (waking up in time for them)."""
        overdue = self.overdue
        if overdue:
            due = max(0.0, overdue[0][0] - time.monotonic())
            timeout = due if timeout is None or timeout < 0 else min(timeout, due)
        for fd, events in self.epoll.poll(timeout):
            kind, env = self.handlers.get(fd, (None, None))
            if kind == "chan":
                if events & select.EPOLLOUT:
                    self._flush(env)
                if events & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR):
                    self._read_channel(env)
            elif kind == "log":
                self._read_log(env)
            elif kind == "call":
                env[0](env[1])
            elif kind == "client":
                self._read_client()
        if overdue:
            self._kill_overdue()

    def _straggling(self, env: Env) -> None:
        """env missed its deadline and is still running: it has straggler_grace
        seconds more to answer, then it is killed (its CPU time is bounded)."""
        self.overdue.append((time.monotonic() + self.straggler_grace, env.index, env.seq))

    def _kill_overdue(self) -> None:
        now = time.monotonic()
        overdue = self.overdue
        while overdue and overdue[0][0] <= now:
            _, index, seq = overdue.popleft()
            env = self.envs[index]
            if env.state == BUSY and env.seq == seq:
                self._kill(env, f"killed: still running {self.straggler_grace:g} s after missing its deadline "
                                f"of {self.step_timeout:g} s (limits.straggler_grace)")

    def _read_client(self) -> None:
        try:
            data = self.conn.recv(_READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            raise ClientGone
        try:
            messages = self.client_reader.feed(data)
        except wire.ProtocolError as exc:
            # The stream's frame boundaries are lost: say why, then end the pool.
            try:
                self._send([wire.ERROR, 0, "ProtocolError", f"the client sent a bad frame: {exc}", {}])
            except OSError:
                pass
            raise ClientGone from None
        if any(m[0] == wire.CLOSE for m in messages):
            raise ClientGone  # close wins, even in the middle of a step
        self.client_inbox.extend(messages)

    def _read_channel(self, env: Env) -> None:
        data = _read_ready(env.chan)
        if data is None:
            return
        if not data:
            self._close_channel(env)
            return
        self._take(env, data)

    def _take(self, env: Env, data: bytes) -> None:
        """Bytes read from env's channel (by the event loop, or by the native
        step path): charged, framed, decoded under the limits, and handled."""
        if not self._charge(env, len(data)):
            return
        try:
            messages = env.reader.feed(data)
            limits = env.reader.limits
            if limits.made:
                # What the decoded frames cost beyond their bytes, ~64 bytes
                # per object (a list, a dict entry, a str), is charged too.
                cost = limits.made * _OBJECT_COST
                limits.made = 0
                if not self._charge(env, cost):
                    return
        except wire.ProtocolError as exc:
            env.reader.limits.made = 0
            if env.state == STARTING:
                self._kill(env, f"sent an invalid frame as its handshake (HELLO) and was killed: {exc} (its caps are "
                                f"limits.max_hello={self.hello_limits.max_frame} bytes and "
                                f"limits.max_hello_objects={self.hello_limits.max_objects})")
            else:
                self._kill(env, f"sent an invalid frame ({exc}) and was killed")
            return
        for message in messages:
            self._on_message(env, message)
            if env.state == DEAD:
                return

    def _on_message(self, env: Env, message: list) -> None:
        code = message[0]
        if env.state == STARTING:
            if code == wire.HELLO and len(message) == 3 and message[1] == wire.PROTOCOL_VERSION:
                env.state = IDLE
                env.reader.limits = self.env_limits
                if env.index == 0 and self.hello is None:  # only lane 0's is ever read: keep no other
                    self.hello = message[2] if isinstance(message[2], dict) else {}
                self._unhold(env)
                return
            self._kill(env, f"sent {_describe(message)} instead of its handshake (protocol {wire.PROTOCOL_VERSION})")
            return
        # Exactly one reply is due per request, carrying its sequence number
        # (module docstring): anything else is killed at the first frame.
        if env.state != BUSY:
            self._kill(env, f"sent {_describe(message)} when no reply was due (a protocol violation) and was killed")
            return
        if len(message) < 2 or message[1] != env.seq:
            self._kill(env, f"sent {_describe(message)} with the wrong sequence number while the reply to request "
                            f"{env.seq} was due (a protocol violation) and was killed")
            return
        result = _check_reply(message)
        if result is None or result[0] not in (env.expect, wire.FAILED):
            self._kill(env, f"sent a malformed reply {_describe(message)}")
            return
        env.state = IDLE  # a late reply frees a straggler; the reply itself is dropped below
        if env.flight == FLYING:
            self._finish(env, _outcome(result, env.cause))
            return
        op = self.op
        if op is not None and message[1] == op.seq and env.index in op.waiting:
            op.waiting.discard(env.index)
            op.results[env.index] = result
            return
        self._unhold(env)  # a straggler's one late reply: dropped

    def _on_message_freezing(self, env: Env, message: list) -> None:
        """_on_message of a pool that freezes its envs (serialize_measurement):
        an env's handshake or reply ends its work, so it is frozen first, before
        the reply can pass the gate on. If the message is refused, the kill thaws."""
        if env.state == STARTING or (env.state == BUSY and len(message) >= 2 and message[1] == env.seq):
            self._freeze(env)
        Worker._on_message(self, env, message)

    def _freeze(self, env: Env) -> None:
        try:
            self.cgroups.freeze(env.index)
        except OSError:
            return  # its cgroup is gone: so is the env
        self.freeze_pending.add(env.index)

    def _thaw(self, env: Env) -> None:
        self.freeze_pending.discard(env.index)
        try:
            self.cgroups.thaw(env.index)
        except OSError:
            pass

    def _all_frozen(self) -> None:
        """Before a turn at the gate: wait until every env asked to freeze is
        frozen. Freezing takes each task out of whatever it runs; one that
        cannot be frozen in time is killed, so the gate's promise holds."""
        now = time.monotonic()
        deadline = now + min(self.step_timeout, 2.0)
        spin_until = now + 0.002  # a freeze mostly lands within ~0.1 ms: re-read before sleeping
        pause = 0.0001
        while self.freeze_pending:
            for index in list(self.freeze_pending):
                env = self.envs[index]
                try:
                    done = env.state == DEAD or self.cgroups.frozen(index)
                except OSError:
                    done = True
                if done:
                    self.freeze_pending.discard(index)
            if not self.freeze_pending:
                return
            if time.monotonic() >= deadline:
                for index in list(self.freeze_pending):
                    self.freeze_pending.discard(index)
                    self._kill(self.envs[index], "could not be frozen outside its turn (serialize_measurement) "
                                                 "and was killed")
                return
            if time.monotonic() >= spin_until:
                time.sleep(pause)
                pause = min(pause * 2, 0.005)

    def _read_log(self, env: Env) -> None:
        data = _read_ready(env.logfd)
        if data is None:
            return
        if not data:
            self._unregister(env.logfd)
            os.close(env.logfd)
            env.logfd = -1
            return
        log = env.log
        log += data
        if len(log) > self.log_tail:
            del log[:len(log) - self.log_tail]

    def _drain_log(self, env: Env) -> None:
        for _ in range(64):  # at most 4 MiB: the tail is what matters
            if env.logfd < 0:
                return
            before = len(env.log), env.logfd
            self._read_log(env)
            if (len(env.log), env.logfd) == before:
                return

    def _charge(self, env: Env, amount: int) -> bool:
        """Count `amount` against env and the pool's budget; over it, env is
        killed (before what it sent is decoded, when that is what is charged)."""
        env.held += amount
        self.held += amount
        if self.held <= self.max_pool_bytes:
            return True
        self._kill(env, self._over_budget(env))
        return False

    def _over_budget(self, env: Env) -> str:
        return (f"killed: the pool would hold more than limits.max_pool_bytes={self.max_pool_bytes} bytes of "
                f"replies not yet returned (this env's: {env.held}, decoded objects counted at {_OBJECT_COST} "
                "bytes each); send less per step, or raise the limit in sandbox/policy.toml")

    def _unhold(self, env: Env) -> None:
        """The pool no longer holds what env sent (but a partial frame it buffers)."""
        keep = env.reader.pending
        self.held -= env.held - keep
        env.held = keep

    def _close_channel(self, env: Env) -> None:
        if env.chan >= 0:
            self._unregister(env.chan)
            os.close(env.chan)
            env.chan = -1

    def _unregister(self, fd: int) -> None:
        self.handlers.pop(fd, None)
        try:
            self.epoll.unregister(fd)
        except (OSError, ValueError):
            pass

    def on_exit(self, env: Env, status, cause: str = "") -> None:
        """env's process is gone (the spawner reaped it): record why."""
        if env.state == DEAD:
            return
        self._drain_log(env)
        if not cause:
            cause = describe_exit(status) + self._limits_hit(env, status)
        self._release(env, f"died: {cause}")

    def _limits_hit(self, env: Env, status) -> str:
        """What limit an env that died had hit, by name ('' if none is known)."""
        notes = []
        if self.cgroups is not None:
            oom, refused = (now - base for now, base in zip(self.cgroups.events(env.index), env.events_base))
            if oom > 0:
                notes.append(f"OOM: killed by the kernel's OOM killer over its memory limit "
                             f"(memory_limit={self.memory_limit} bytes)")
            if refused > 0:
                notes.append(f"pids limit: {refused} fork(s) refused at its limit of {self.limits['pids']} tasks")
        signum = _exit_signal(status)
        if signum == signal.SIGXFSZ:
            notes.append(f"file size limit: it wrote past limits.file_size={self.limits.get('file_size')} bytes")
        elif signum == signal.SIGXCPU:
            notes.append("CPU time limit (RLIMIT_CPU)")
        return "".join(f"; {note}" for note in notes)

    def _release(self, env: Env, cause: str) -> None:
        """Mark env DEAD with `cause`; close its fds; the op stops waiting for it."""
        self._close_channel(env)
        if env.logfd >= 0:
            self._unregister(env.logfd)
            os.close(env.logfd)
            env.logfd = -1
        env.pid = -1
        env.state = DEAD
        env.cause = cause
        self.held -= env.held
        env.held = 0
        if env.flight == FLYING:
            self._finish(env, _outcome(None, cause))
        op = self.op
        if op is not None and env.index in op.waiting:
            op.waiting.discard(env.index)
            op.results[env.index] = None  # failure: see env.cause

    def _kill(self, env: Env, cause: str) -> None:
        """Kill env's sandbox now, its whole tree; the spawner reaps it."""
        if env.state == DEAD:
            return
        self.spawner.kill(env)
        if self.cgroups is not None:
            self.cgroups.kill(env.index)  # and thaws it: killed tasks die on the way out
        self.freeze_pending.discard(env.index)
        self._drain_log(env)
        self._release(env, cause)

    # -- writing to envs --------------------------------------------------------------

    def _write(self, env: Env, data: bytes) -> None:
        if env.out:
            env.out += data
            return
        try:
            sent = os.write(env.chan, data)
        except BlockingIOError:
            sent = 0
        except OSError:
            return  # the channel is gone; EOF or the pidfd will tell why
        if sent < len(data):
            env.out = data[sent:]
            self.epoll.modify(env.chan, select.EPOLLIN | select.EPOLLOUT)

    def _flush(self, env: Env) -> None:
        try:
            sent = os.write(env.chan, env.out)
        except BlockingIOError:
            return
        except OSError:
            env.out = b""
            return
        env.out = env.out[sent:]
        if not env.out:
            self.epoll.modify(env.chan, select.EPOLLIN)

    # -- requests -------------------------------------------------------------------

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _wait(self, op: Op, deadline: float) -> None:
        while op.waiting:
            now = time.monotonic()
            if now >= deadline:
                return
            self._poll(deadline - now)

    def step(self, actions: list, resets=None) -> list:
        """Step every env; the lanes in `resets` are reset (seed and options
        None) instead, their actions ignored: Gymnasium's next-step autoreset
        in the same round trip."""
        n = len(self.envs)
        if not isinstance(actions, list) or len(actions) != n:
            raise ValueError(f"step() needs {n} actions, one per env; got {len(actions) if isinstance(actions, list) else type(actions).__name__}")
        resets = set(self._check_lanes(resets or []))
        self._refuse_async("step() cannot run")
        if resets:
            self._respawn([self.envs[i] for i in sorted(resets)], hard=False)
        seq = self._next_seq()
        op = Op(seq)
        self.op = op
        pack = self._packer.pack
        header = wire.HEADER.pack
        gated = self.gated
        freezing = self.freezing
        immediate: dict[int, str] = {}
        # The native path writes, waits and reads in one call (_step_fast);
        # the gate's turns stay in Python.
        fast = self.fastpath is not None and not gated
        lanes, frames = [], []
        # Hot path: one frame per idle env, written straight to its channel.
        for env, action in zip(self.envs, actions):
            if env.state == IDLE:
                if resets and env.index in resets:
                    body = pack([wire.RESET, seq, None, None])
                    env.expect = wire.RESET_DONE
                    if freezing:
                        self._thaw(env)  # resets are not gated
                else:
                    body = pack([wire.STEP, seq, action, gated])
                    env.expect = wire.STEPPED
                env.seq = seq
                env.state = BUSY
                op.waiting.add(env.index)
                if fast and not env.out:
                    lanes.append(env)
                    frames.append(header(len(body)) + body)
                else:
                    self._write(env, header(len(body)) + body)
            elif env.state == BUSY:
                immediate[env.index] = "straggler"
            else:
                immediate[env.index] = "dead"
        deadline = time.monotonic() + self.step_timeout
        if lanes:
            self._step_fast(lanes, frames, deadline)
        stragglers = []
        if gated:
            for index in sorted(op.waiting - resets):
                env = self.envs[index]
                if index not in op.waiting:
                    continue
                if freezing:
                    self._all_frozen()
                    if index not in op.waiting:
                        continue
                    self._thaw(env)  # its STEP is waiting in its channel: decoded in its own turn
                self._write(env, wire.encode([wire.GO, seq]))
                self._wait_one(op, index, time.monotonic() + self.step_timeout)
                if index in op.waiting:
                    # The gate promises one env's code at a time, so a holder
                    # that overruns is killed before the next one goes.
                    self._kill(env, f"missed the step deadline of {self.step_timeout:g} s while holding the "
                                    "serialize_measurement gate, and was killed")
                    stragglers.append(index)
        if op.waiting:  # ungated steps, and resets (which the gate does not serialize)
            self._wait(op, deadline if fast else time.monotonic() + self.step_timeout)
            stragglers.extend(op.waiting)
            for index in op.waiting:
                self._straggling(self.envs[index])
        self.op = None
        rewards = array.array("d", bytes(8 * n))
        terminated = bytearray(n)
        truncated = bytearray(n)
        obs = [None] * n
        infos = [None] * n
        results = op.results
        released = 0
        for env in self.envs:
            i = env.index
            result = results.get(i, False)
            if result:
                released += env.held  # its reply leaves with this call's REPLY
                env.held = 0
                kind = result[0]
                if kind == wire.STEPPED:
                    obs[i] = result[2]
                    rewards[i] = result[3]
                    terminated[i] = result[4]
                    truncated[i] = result[5]
                    infos[i] = result[6]
                    continue
                if kind == wire.RESET_DONE:  # an autoreset lane: reward 0, not done
                    obs[i] = result[2]
                    infos[i] = result[3]
                    continue
                infos[i] = {"error": result[4] or result[3]}  # the env's exception, with traceback
            elif i in stragglers and env.state != DEAD:
                infos[i] = {"straggler": True, "error": f"missed the step deadline of {self.step_timeout:g} s"}
            elif i in stragglers:
                infos[i] = {"straggler": True, "error": env.cause}
            elif immediate.get(i) == "straggler":
                infos[i] = {"straggler": True, "error": "still busy with an earlier step it has not answered; "
                                                        "reset it (it will be killed and respawned)"}
            elif immediate.get(i) == "dead":
                infos[i] = {"error": f"env is dead ({env.cause}); reset it to respawn"}
            else:
                infos[i] = {"error": env.cause}
            truncated[i] = 1
        self.held -= released
        return [obs, rewards.tobytes(), bytes(terminated), bytes(truncated), infos, stragglers]

    def _step_fast(self, lanes: list, frames: list, deadline: float) -> None:
        """Hot path, native (native/fastpath.c): write every lane's frame, wait
        on epoll until each has answered or `deadline`, read each reply once,
        all in one C call. Every byte read goes through _take, as the event
        loop's reads do. Whatever it leaves (lanes not read yet: it returns
        early when a log, pidfd, straggler or the client is ready, or at the
        byte budget; short writes) is left to the pure path's _wait."""
        fastpath = self.fastpath
        why, results = fastpath.exchange(self.epoll.fileno(), [env.chan for env in lanes], frames, deadline,
                                         self.env_limits.max_frame, self.max_pool_bytes - self.held)
        limits = self.env_limits
        small = limits.max_depth if limits.guarded is not None else -1  # env limits are always guarded
        kwargs = limits.kwargs
        unpackb = msgpack.unpackb
        op = self.op
        for env, frame, result in zip(lanes, frames, results):
            if result is None:
                continue
            if type(result) is bytes:  # one whole reply
                # The common case inline: a small frame (it can neither nest
                # deeper nor hold more objects than limits.max_depth, so it is
                # decoded with no hook, as wire.decode does) that is the reply
                # due, well formed, within the budget. Anything else, and any
                # decoding error, goes through _take, which says what is wrong.
                size = len(result)
                cost = size + (size - 4) * _OBJECT_COST
                if (size - 4 <= small and not env.reader.pending and env.reader.limits is limits
                        and self.held + cost <= self.max_pool_bytes):
                    try:
                        message = unpackb(memoryview(result)[4:], **kwargs)
                    except Exception:  # noqa: BLE001 (msgpack raises several types; _take names it)
                        message = None
                    if (type(message) is list and len(message) > 1 and type(message[0]) is int
                            and message[0] == env.expect and message[1] == env.seq and env.state == BUSY
                            and env.flight == NONE and _check_reply(message)):
                        env.held += cost
                        self.held += cost
                        env.state = IDLE
                        op.waiting.discard(env.index)
                        op.results[env.index] = message
                        continue
                self._take(env, result)
                continue
            kind, value = result
            if kind == fastpath.UNUSUAL:  # not exactly one frame: FrameReader sorts it out
                self._take(env, value)
            elif kind == fastpath.EOF:
                self._close_channel(env)
            else:  # SHORT_WRITE_KIND: the rest is flushed by the event loop, as _write does
                env.out = frame[value:]
                self.epoll.modify(env.chan, select.EPOLLIN | select.EPOLLOUT)

    # -- asynchronous stepping (send / recv) ---------------------------------------------
    #
    # send() writes one frame per lane and returns; the lane is FLYING with a
    # deadline counted from its send. Replies are taken by _on_message whenever
    # the event loop runs: inside any call, and between calls too (the worker
    # idles in epoll, see _next_request), so a result waits in the worker, not
    # in a socket. A lane whose deadline passes, or that dies, is FINISHED with
    # a failure result, exactly as step() reports it. recv() hands out FINISHED
    # lanes in the order they finished.
    #
    # serialize_measurement: the STEP frames of a send carry gated=True and the
    # lanes queue; the gate goes (GO) to one FLYING lane at a time, the next as
    # soon as the holder answers or dies, and the holder's deadline counts from
    # its GO (as in step()). A holder that overruns is killed, so the gate holds.

    def send(self, actions: list, indices: list, resets=None) -> list:
        """Hand actions to the lanes in `indices` (resets: lanes reset instead);
        returns at once. Everything is checked before the first byte is written."""
        if not isinstance(indices, list) or len(set(indices)) != len(indices):
            raise ValueError("send() env_ids must be distinct env indices")
        indices = self._check_lanes(indices)
        if not isinstance(actions, list) or len(actions) != len(indices):
            raise ValueError(f"send() needs one action per env id ({len(indices)}); "
                             f"got {len(actions) if isinstance(actions, list) else type(actions).__name__}")
        resets = set(self._check_lanes(resets or []))
        if not resets <= set(indices):
            raise ValueError("send() can only autoreset lanes it sends to")
        self._pump()
        for index in indices:
            self._refuse_outstanding(index, "send to")
        if resets:
            self._respawn([self.envs[i] for i in sorted(resets)], hard=False)
        seq = self._next_seq()
        now = time.monotonic()
        pack = self._packer.pack
        header = wire.HEADER.pack
        gated = self.gated
        deadline = now + self.step_timeout
        # Hot path: one frame per lane, written straight to its channel.
        for index, action in zip(indices, actions):
            env = self.envs[index]
            env.flight = FLYING
            self.flying.add(index)
            if env.state != IDLE:  # dead, or a straggler still busy: a failure result at once, as in step()
                self._finish(env, (None, 0.0, False, True, _unavailable(env)))
                continue
            if index in resets:
                body = pack([wire.RESET, seq, None, None])
                env.expect = wire.RESET_DONE
                if self.freezing:
                    self._thaw(env)  # resets are not gated
                env.deadline = deadline
                self.deadlines.append((deadline, index, seq))
            else:
                body = pack([wire.STEP, seq, action, gated])
                env.expect = wire.STEPPED
                if gated:
                    env.deadline = float("inf")  # until its turn at the gate
                    self.gate_queue.append(index)
                else:
                    env.deadline = deadline
                    self.deadlines.append((deadline, index, seq))
            env.seq = seq
            env.state = BUSY
            self._write(env, header(len(body)) + body)
        self._advance_gate()
        return [len(self.flying), len(self.finished)]

    def recv(self, batch_size, timeout) -> list:
        """The first `batch_size` lanes to finish (fewer if `timeout` passes):
        [indices, obs, rewards f64 bytes, terminated, truncated, infos, stragglers,
        wait_ms, queued_ms]."""
        self._pump()
        can_come = len(self.flying) + len(self.finished)
        if batch_size is None:
            batch_size = can_come
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 0:
            raise ValueError(f"recv() batch_size must be a whole number, not {batch_size!r}")
        if batch_size > can_come:
            raise ValueError(f"recv(batch_size={batch_size}) would wait forever: only {can_come} result(s) can come "
                             f"({len(self.flying)} env(s) in flight, {len(self.finished)} finished and not received)")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0):
            raise ValueError(f"recv() timeout must be a number of seconds >= 0 or None, not {timeout!r}")
        started = time.monotonic()
        give_up = float("inf") if timeout is None else started + timeout
        while len(self.finished) < batch_size:
            now = time.monotonic()
            if now >= give_up:
                break
            wake = min(give_up, self._next_deadline())
            self._poll(max(0.0, min(wake - now, 1.0)))
            self._expire()
        wait_ms = (time.monotonic() - started) * 1000.0
        k = min(batch_size, len(self.finished))
        rewards = array.array("d", bytes(8 * k))
        terminated = bytearray(k)
        truncated = bytearray(k)
        indices, obs, infos, stragglers = [0] * k, [None] * k, [None] * k, []
        now = time.monotonic()
        queued = 0.0
        released = 0
        # Hot path: the results were shaped when they arrived; here they are only copied out.
        for j in range(k):
            index = self.finished.popleft()
            env = self.envs[index]
            if env.state != BUSY:  # its reply came (a straggler's is still to come, or not)
                released += env.held
                env.held = 0
            indices[j] = index
            obs[j], rewards[j], terminated[j], truncated[j], infos[j] = env.result
            if infos[j].get("straggler") is True and "error" in infos[j] and obs[j] is None:
                stragglers.append(index)
            queued += now - env.done_at
            env.flight = NONE
            env.result = None
        self.held -= released
        queued_ms = queued * 1000.0 / k if k else 0.0
        return [indices, obs, rewards.tobytes(), bytes(terminated), bytes(truncated), infos, stragglers,
                wait_ms, queued_ms]

    def lane_states(self) -> list:
        """Each lane's one state: idle, in_flight, finished (a result waiting for
        recv), straggler (busy past its deadline, result already given), dead."""
        self._pump()
        out = []
        for env in self.envs:
            if env.flight == FLYING:
                out.append("in_flight")
            elif env.flight == FINISHED:
                out.append("finished")
            elif env.state == BUSY:
                out.append("straggler")
            else:
                out.append(env.state)  # idle, dead (starting never outlives a call)
        return out

    def _refuse_outstanding(self, index: int, what: str) -> None:
        env = self.envs[index]
        if env.flight == FLYING:
            raise ValueError(f"cannot {what} env {index}: it is in flight (an action was sent and its result has "
                             "not been received); recv it first")
        if env.flight == FINISHED:
            raise ValueError(f"cannot {what} env {index}: it has finished and its result has not been received; "
                             "recv it first")

    def _refuse_async(self, what: str) -> None:
        if self.flying or self.finished:
            raise ValueError(f"{what} while {len(self.flying)} env(s) are in flight and {len(self.finished)} "
                             "finished but not received: recv them first (send/recv and step() do not mix)")

    def _finish(self, env: Env, outcome: tuple) -> None:
        """env's async action has its one result: hold it for recv."""
        env.flight = FINISHED
        env.result = outcome
        env.done_at = time.monotonic()
        self.flying.discard(env.index)
        self.finished.append(env.index)
        if env.index == self.gate_holder:
            self.gate_holder = -1
            self._advance_gate()

    def _next_deadline(self) -> float:
        """The earliest deadline of a FLYING lane (inf when none)."""
        deadlines = self.deadlines
        while deadlines:
            deadline, index, seq = deadlines[0]
            env = self.envs[index]
            if env.flight == FLYING and env.seq == seq and env.deadline == deadline:
                return deadline
            deadlines.popleft()  # finished since
        return float("inf")

    def _expire(self) -> None:
        """Lanes FLYING past their deadline become straggler results."""
        now = time.monotonic()
        while self._next_deadline() <= now:
            index = self.deadlines.popleft()[1]
            env = self.envs[index]
            if index == self.gate_holder:
                # The gate promises one env's code at a time: kill the holder before the next one goes.
                self._kill(env, f"missed the step deadline of {self.step_timeout:g} s while holding the "
                                "serialize_measurement gate, and was killed")
                env.result = (None, 0.0, False, True, {"straggler": True, "error": env.cause})
                continue
            self._finish(env, (None, 0.0, False, True,
                               {"straggler": True, "error": f"missed the step deadline of {self.step_timeout:g} s"}))
            self._straggling(env)

    def _advance_gate(self) -> None:
        """Give the gate to the next queued lane when nobody holds it."""
        while self.gate_holder < 0 and self.gate_queue:
            index = self.gate_queue.popleft()
            env = self.envs[index]
            if env.flight != FLYING or env.state != BUSY:
                continue  # died while queued: already finished
            if self.freezing:
                self._all_frozen()
                if env.flight != FLYING or env.state != BUSY:
                    continue
                self._thaw(env)
            self.gate_holder = index
            env.deadline = time.monotonic() + self.step_timeout
            self.deadlines.append((env.deadline, index, env.seq))
            self._write(env, wire.encode([wire.GO, env.seq]))

    def _pump(self) -> None:
        """Take whatever arrived and apply deadlines, without waiting."""
        self._poll(0)
        self._expire()

    def _wait_one(self, op: Op, index: int, deadline: float) -> None:
        while index in op.waiting:
            now = time.monotonic()
            if now >= deadline:
                return
            self._poll(deadline - now)

    def _check_lanes(self, indices) -> list:
        n = len(self.envs)
        if indices is None:
            return list(range(n))
        if not isinstance(indices, list) or any(not isinstance(i, int) or not 0 <= i < n for i in indices):
            raise ValueError(f"lanes must be indices in [0, {n})")
        return indices

    def _respawn(self, envs: list[Env], hard: bool) -> None:
        """Respawn those of envs that need it before a reset: all when hard,
        else the dead and those still busy with an unanswered step."""
        respawn = [e for e in envs if hard or e.state in (DEAD, BUSY)]
        cause = "killed for a hard reset" if hard else "killed at reset: it had not answered its last step"
        with self.spawner.batching_kills():
            for env in respawn:
                if env.state != DEAD:
                    self._kill(env, cause)
                env.log += b"\n--- boltzlabs: sandbox respawned ---\n"
        if respawn:
            self._start(respawn)

    def reset(self, indices, seeds, hard: bool, options=None) -> list:
        indices = self._check_lanes(indices)
        if seeds is not None and (not isinstance(seeds, list) or len(seeds) != len(indices)):
            raise ValueError("reset() needs one seed per selected env")
        self._pump()
        for index in indices:
            self._refuse_outstanding(index, "reset")
        envs = [self.envs[i] for i in indices]
        self._respawn(envs, hard)
        seq = self._next_seq()
        op = Op(seq)
        self.op = op
        for env, seed in zip(envs, seeds or [None] * len(envs)):
            if env.state != IDLE:
                continue
            env.seq = seq
            env.state = BUSY
            env.expect = wire.RESET_DONE
            op.waiting.add(env.index)
            if self.freezing:
                self._thaw(env)
            self._write(env, wire.encode([wire.RESET, seq, seed, options]))
        self._wait(op, time.monotonic() + self.step_timeout)
        self.op = None
        for index in op.waiting:
            self._straggling(self.envs[index])
        obs, infos = [], []
        for env in envs:
            if env.state != BUSY:
                self._unhold(env)
            result = op.results.get(env.index)
            if result and result[0] == wire.RESET_DONE:
                obs.append(result[2])
                infos.append(result[3])
                continue
            obs.append(None)
            if result:
                infos.append({"error": result[4] or result[3]})
            elif env.index in op.waiting:
                infos.append({"straggler": True, "error": f"missed the reset deadline of {self.step_timeout:g} s"})
            else:
                infos.append({"error": f"could not be reset: {env.cause}", "log": _tail(env.log)})
        return [indices, obs, infos]

    def render(self, indices) -> list:
        """One frame per lane in `indices` (None for a lane that has none)."""
        indices = self._check_lanes(indices)
        frames, errors = self._ask(indices, wire.RENDERED, lambda seq, k: wire.encode([wire.RENDER, seq]), "render")
        return [frames, {index: why for index, (_, why) in errors.items()}]

    def attr(self, indices, op, name, args, kwargs, values=None) -> list:
        """call / get_attr / set_attr on the lanes in `indices`: one ATTR
        request each, as render(). `values` (set): one per lane, for args."""
        indices = self._check_lanes(indices)
        if op not in ("call", "get", "set") or not isinstance(name, str) or not isinstance(args, list) \
                or not isinstance(kwargs, dict) or (values is not None and (not isinstance(values, list)
                                                                           or len(values) != len(indices))):
            raise ValueError("attr() takes an op (call, get, set), a name, args, kwargs and one value per lane")
        same = {}

        def frame(seq, k):
            if values is not None:
                return wire.encode([wire.ATTR, seq, op, name, [values[k]], kwargs])
            if not same:  # the same request for every lane: encoded once
                same[0] = wire.encode([wire.ATTR, seq, op, name, args, kwargs])
            return same[0]

        results, errors = self._ask(indices, wire.ATTR_DONE, frame, {"get": "get_attr", "set": "set_attr"}.get(op, op))
        return [results, {index: list(error) for index, error in errors.items()}]

    def _ask(self, indices, expect, frame, what: str):
        """One request to each idle lane in `indices` (`frame(seq, k)` is the
        k-th lane's, encoded), answered within the step deadline (render,
        attr). Returns each lane's value (None if it has none) and, for each
        lane that could not answer, (the env's exception message or "", why:
        its traceback, the missed deadline, or the lane's state)."""
        seq = self._next_seq()
        op = Op(seq)
        self.op = op
        for k, index in enumerate(indices):
            env = self.envs[index]
            if env.state == IDLE:
                env.seq = seq
                env.state = BUSY
                env.expect = expect
                op.waiting.add(index)
                if self.freezing:
                    self._thaw(env)
                self._write(env, frame(seq, k))
        self._wait(op, time.monotonic() + self.step_timeout)
        self.op = None
        for index in op.waiting:
            self._straggling(self.envs[index])
        values, errors = [], {}
        for index in indices:
            env = self.envs[index]
            if env.state != BUSY:
                self._unhold(env)
            result = op.results.get(index)
            if result and result[0] == expect:
                values.append(result[2])
                continue
            values.append(None)
            if result:  # FAILED: the env's exception, with its traceback
                errors[index] = (result[3], result[4] or result[3])
            elif index in op.waiting:
                errors[index] = ("", f"missed the {what} deadline of {self.step_timeout:g} s")
            else:
                errors[index] = ("", f"env is {env.state} ({env.cause})")
        return values, errors

    def memory(self) -> dict:
        shared = 0
        if self.cgroups is not None:
            per_env = [self.cgroups.usage(e.index) if e.state != DEAD else 0 for e in self.envs]
            if self.spawner.kind == "template":
                shared = self.cgroups.usage(TEMPLATE_LANE)
        else:
            per_env = [_pss_tree(e.pid) if e.pid > 0 else 0 for e in self.envs]
            if self.spawner.kind == "template" and self.spawner.alive():
                shared = _pss_tree(self.spawner.bwrap_pid)
        return {"per_env": per_env, "shared": shared, "source": self.memory_source, "note": self.memory_note}

    def log(self, index: int) -> str:
        env = self.envs[index]
        self._drain_log(env)
        text = bytes(env.log).decode("utf-8", "replace")
        if self.spawner.kind == "template":
            # What env.py printed at import, it printed once, in the template.
            shared = bytes(self.spawner.log).decode("utf-8", "replace")
            text = f"--- the template's output (env.py at import) ---\n{shared}--- env {index} ---\n{text}"
        return text

    def states(self) -> list:
        return [e.state for e in self.envs]

    def pids(self) -> list:
        return [e.pid for e in self.envs]

    # -- teardown -------------------------------------------------------------------

    def shutdown(self, reason) -> bool:
        """The owner's request to stop the pool now: every sandbox ends, the
        client is told, and the worker exits once the client closes."""
        self.shutdown_reason = str(reason)[:1000]
        print(f"boltzlabs worker: pool shut down by its owner: {self.shutdown_reason}", file=sys.stderr, flush=True)
        self.close()
        return True

    def close(self) -> None:
        for env in self.envs:
            self._kill(env, "pool closed")
        deadline = time.monotonic() + 5.0
        if self.spawner is not None:
            self.spawner.close(deadline)
        if self.cgroups is not None:
            self.cgroups.close(deadline, reap_orphans)
            self.cgroups = None
        if self.account is not None:
            self.account.close()

    # -- the client connection ------------------------------------------------------

    def _send(self, message) -> None:
        self.conn.sendall(wire.encode(message))

    def _next_request(self) -> list:
        while not self.client_inbox:
            # Between calls the loop still runs: async results are taken as they
            # come, the gate moves on, and deadlines are kept.
            wake = self._next_deadline()
            self._poll(None if wake == float("inf") else max(0.0, wake - time.monotonic()))
            self._expire()
        return self.client_inbox.pop(0)

    def serve(self) -> None:
        message = self._next_request()
        if message[0] != wire.OPEN or len(message) != 2:
            self._send([wire.ERROR, 0, "ProtocolError", f"expected OPEN first, got {_describe(message)}", {}])
            return
        try:
            ready = self.open(message[1])
        except _StartFailure as exc:
            self._send([wire.ERROR, 0, "start", str(exc), {"env": exc.index, "log": exc.log, "failed": exc.count}])
            return
        except (ValueError, OSError, Exception) as exc:  # noqa: B014
            self._send([wire.ERROR, 0, type(exc).__name__, str(exc), {}])
            return
        self._send([wire.READY, ready])
        calls = {"step": self.step, "reset": self.reset, "render": self.render, "attr": self.attr,
                 "memory": self.memory, "log": self.log,
                 "states": self.states, "pids": self.pids, "send": self.send, "recv": self.recv,
                 "lane_states": self.lane_states, "shutdown": self.shutdown}
        while True:
            message = self._next_request()
            if message[0] != wire.CALL or len(message) != 4:
                self._send([wire.ERROR, 0, "ProtocolError", f"unexpected message {_describe(message)}", {}])
                continue
            _, seq, name, args = message
            started = time.perf_counter()
            if name not in calls or not isinstance(args, list):
                self._send([wire.ERROR, seq, "ProtocolError", f"no call {_describe(name)} with those arguments", {}])
                continue
            try:
                result = calls[name](*args)
            except (ValueError, TypeError, KeyError, IndexError) as exc:
                self._send([wire.ERROR, seq, type(exc).__name__, str(exc), {}])
                continue
            worker_ms = (time.perf_counter() - started) * 1000.0
            self._send([wire.REPLY, seq, worker_ms, result])




def _read_ready(fd: int):
    """One read of a non-blocking fd: its bytes, b"" at end of file or on an
    error (the peer is gone either way), None when nothing was there."""
    try:
        return os.read(fd, _READ_SIZE)
    except BlockingIOError:
        return None
    except OSError:
        return b""


def _check_reply(message: list):
    """The reply if it has a valid shape, else None. Hostile envs send anything."""
    code = message[0]
    if code == wire.STEPPED:
        if (len(message) == 7 and type(message[3]) in (float, int) and type(message[4]) is bool
                and type(message[5]) is bool and type(message[6]) is dict):
            return message
    elif code == wire.RESET_DONE:
        if len(message) == 4 and type(message[3]) is dict:
            return message
    elif code == wire.RENDERED or code == wire.ATTR_DONE:
        if len(message) == 3:
            return message
    elif code == wire.FAILED:
        if len(message) == 5 and all(type(x) is str for x in message[2:]):
            return message
    return None


def _outcome(result, cause: str) -> tuple:
    """An async lane's result as (obs, reward, terminated, truncated, info);
    failures as step() reports them: truncated, reward 0, info["error"]."""
    if result is None:
        return (None, 0.0, False, True, {"error": cause})
    code = result[0]
    if code == wire.STEPPED:
        return (result[2], float(result[3]), result[4], result[5], result[6])
    if code == wire.RESET_DONE:  # an autoreset lane: reward 0, not done
        return (result[2], 0.0, False, False, result[3])
    return (None, 0.0, False, True, {"error": result[4] or result[3]})  # FAILED, with the traceback


def _unavailable(env) -> dict:
    if env.state == DEAD:
        return {"error": f"env is dead ({env.cause}); reset it to respawn"}
    return {"straggler": True, "error": "still busy with an earlier step it has not answered; "
                                        "reset it (it will be killed and respawned)"}


def _describe(message) -> str:
    """A short repr of what an env sent: bounded in depth and width (reprlib
    stops at maxlevel), so a hostile value cannot make it recurse or grow."""
    text = _REPR.repr(message)
    return text if len(text) <= 80 else text[:77] + "..."


_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxlist = _REPR.maxdict = _REPR.maxtuple = 6
_REPR.maxstring = _REPR.maxother = 40


def _tail(log: bytearray, size: int = 4000) -> str:
    return bytes(log[-size:]).decode("utf-8", "replace")


def _pss_tree(pid: int) -> int:
    import psutil

    try:
        root = psutil.Process(pid)
        total = 0
        for proc in [root] + root.children(recursive=True):
            try:
                total += proc.memory_full_info().pss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return total
    except psutil.NoSuchProcess:
        return 0


# File descriptors the worker plans per env (channel, log pipe and a pidfd:
# of its bwrap in exec mode, of its pid 1 in template mode) and for itself.
FDS_PER_ENV, FD_SLACK = 3, 256


def fds_needed(n: int) -> int:
    """The open-file limit a worker needs for a pool of n envs."""
    return FDS_PER_ENV * n + FD_SLACK


def envs_within(fd_limit: int) -> int:
    """How many envs one worker can hold under an open-file limit of fd_limit."""
    return max(0, (fd_limit - FD_SLACK) // FDS_PER_ENV)


def _raise_fd_limit(n: int) -> None:
    """Make room for fds_needed(n) open files."""
    want = fds_needed(n)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= want or soft == resource.RLIM_INFINITY:
        return
    if hard != resource.RLIM_INFINITY and hard < want:
        try:  # only with CAP_SYS_RESOURCE (root): raise the hard limit too
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
            return
        except (ValueError, OSError):
            pass
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard) if hard != resource.RLIM_INFINITY else want, hard))
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < want:
        raise ValueError(f"a pool of {n} envs needs about {want} file descriptors and the limit is {soft}; "
                         f"raise it (ulimit -n {want}, or LimitNOFILE= for a service) or use fewer envs")


def _guard_cgroups(paths: list[str]) -> int:
    """Make sure the pool's cgroups and every task in them go with this worker,
    however it dies (SIGKILL included). Returns the guardian's pid.

    A killed worker removes nothing itself, and a task frozen by the cgroup v1
    freezer (serialize_measurement) does not act on SIGKILL until it is
    thawed, so bwrap's --die-with-parent (and every other kill) would wait
    forever for it. A forked guardian in a session of its own (a kill of our
    process group misses it) waits for the end of a pipe this process holds,
    which closes only when this process is gone, then kills, thaws and
    removes what is left of the pool's cgroups: nothing, after a clean close.
    The client, which only kills the worker, waits for the guardian to end.
    A fork shares the worker's pages; it writes little (measured in
    tests/test_protocol.py).
    """
    from boltzlabs.sandbox.cgroups import remove_pool_dir

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            _prctl(_PR_SET_NAME, GUARDIAN_NAME)  # what ps and /proc/<pid>/comm show
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(signum, signal.SIG_IGN)
            # Nothing of the worker's but the pipe: the client's socket held
            # here would hide the worker's death from the client.
            os.closerange(3, r)
            os.closerange(r + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
            while os.read(r, 1):
                pass
            remove_pool_dir(paths)
        finally:
            os._exit(0)
    os.close(r)
    _GUARD.append(w)  # held (close-on-exec, so no sandbox gets it) until this process ends
    return pid


_GUARD: list[int] = []


def _terminate(signum, frame):
    raise ClientGone


_PR_SET_PDEATHSIG, _PR_SET_NAME, _PR_SET_CHILD_SUBREAPER = 1, 15, 36
GUARDIAN_NAME = b"boltzlabs-guard"  # 15 bytes: the kernel's comm holds at most 15


def _prctl(option: int, value) -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def _die_with(parent: int) -> None:
    """SIGKILL us if `parent` dies (then bwrap's --die-with-parent ends every sandbox)."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent and os.getppid() != parent:  # it died before the prctl
        os._exit(1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="boltzlabs worker (started by RLPool)")
    parser.add_argument("--fd", type=int, required=True, help="socket to the client")
    parser.add_argument("--remote", action="store_true", help="serve a remote client (started by remote.Listener)")
    parser.add_argument("--source-dir", help="remote: the env directory, whatever the client says")
    parser.add_argument("--max-envs", type=int, default=4096, help="remote: the largest pool")
    parser.add_argument("--max-frame", type=int, default=64 << 20, help="remote: the largest frame from the client")
    parser.add_argument("--parent", type=int, default=0, help="remote: die with this process (the listener)")
    parser.add_argument("--ceilings", default=None, help="remote: JSON of the listener's ceilings (remote.CEILINGS)")
    args = parser.parse_args(argv)
    # The client passed this fd inheritable; left so, every sandbox spawned
    # below would hold a socket to the client and could forge its replies.
    os.set_inheritable(args.fd, False)
    conn = socket.socket(fileno=args.fd)
    remote = None
    if args.remote:
        from boltzlabs.worker.ceilings import default_ceilings

        remote = {"source_dir": args.source_dir, "max_envs": args.max_envs, "max_frame": args.max_frame,
                  "ceilings": json.loads(args.ceilings) if args.ceilings else default_ceilings()}
        _die_with(args.parent)
    # Orphans of killed sandboxes (an exec sandbox's inner bwrap) come to us,
    # not to a host init that may reap them late: reap_orphans() takes them.
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    # SIGTERM (the listener stopping, a service manager) ends the pool cleanly.
    signal.signal(signal.SIGTERM, _terminate)
    worker = Worker(conn, remote)
    code = 0
    try:
        worker.serve()
    except ClientGone:
        code = 0
    except BaseException:
        code = 1
        try:
            worker._send([wire.ERROR, -1, "WorkerError", "the worker failed:\n" + traceback.format_exc(), {}])
        except OSError:
            pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # already ending: let close() finish
        worker.close()
        try:
            worker._send([wire.CLOSE])
        except OSError:
            pass
        conn.close()
    return code


if __name__ == "__main__":  # `python -m boltzlabs.worker.worker`, as before the package
    sys.exit(main())
