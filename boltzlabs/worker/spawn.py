r"""How the worker makes sandboxes: one interpreter per env, or forks of a template.

    lifecycle --spawn(env)--> ExecSpawner:     posix_spawn(bwrap ... python env.py), per env
                          \-> TemplateSpawner: [FORK] to one warm template (boltzlabs.runtime.template)
    lifecycle <--context.on_exit(env, status)-- either, when an env's process is gone

Both implement Spawner (the Protocol below) and are handed a SpawnContext:
what they may use of the pool (its plan, config, channel, cgroups, the
confinement check, the slots, the reactor's watch/unwatch), nothing else.

Both hand the env its channel (two pipes, the one it writes as fd 3 and the
one it reads as fd 4, or a socketpair end as fd 3: `SpawnContext.channel`,
docs/wire.md#the-channel) and its log pipe (fds 1 and 2), start it inside its own cgroup, and report its exit status.
The worker owns everything else (the channel protocol, deadlines, state).

Signals go through pidfds only, never to a pid number learnt later: a pid
is freed when its process is reaped, and the host may hand it to anything.
Exec mode holds a pidfd of the bwrap it spawned; in template mode the
template opens one for each child it forks and passes it with FORKED, and
the worker finds the template itself below its own bwrap (`sandbox_process`).
What an env says about itself (its handshake, its message credentials)
never names a process to signal or move.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import math
import os
import select
import signal
import socket
import time
from dataclasses import dataclass
from contextlib import AbstractContextManager as ContextManager
from typing import Any, Literal, Protocol
from collections.abc import Callable

from boltzlabs import abi, wire
from boltzlabs.abi import CHANNEL_FD
from boltzlabs.runtime import probe, template
from boltzlabs.runtime.rlimits import read_file
from boltzlabs.host import seccomp
from boltzlabs.host.builder import SandboxSpec
from boltzlabs.host.cgroups import CgroupPool
from boltzlabs.worker.config import PIPES, SOCKETPAIR, PoolConfig
from boltzlabs.worker.confinement import Confinement
from boltzlabs.worker.lanes import Lane
from boltzlabs.worker.reactor import HEARTBEAT_AFTER
from boltzlabs.worker.slots import Slots
from boltzlabs.errors import ProtocolError, TemplateUnavailable, describe_status

TEMPLATE_LANE = "template"  # the template's cgroup name
LOG_PIPE_SIZE = 4096  # one page: an env's output is rarely written, and every page counts against the pipe quota
F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ from Python 3.10 on; the number is the kernel's


@dataclass(frozen=True)
class SpawnContext:
    """What a spawner is handed by the worker (lifecycle.py): everything it may use of the pool."""

    spec: SandboxSpec  # the pool's compiled plan: argv, programs, fds to hand over
    config: PoolConfig  # n, start_timeout, memory_limit, warmup, preload, trust_env
    channel: str  # each env's channel: config.PIPES or config.SOCKETPAIR
    cgroups: CgroupPool | None  # the pool's cgroups, None without them
    confinement: Confinement  # the check from outside of each lane (and the template, the probe)
    slots: Slots | None  # the envs' observation slots, None without them
    watch: Callable[[int, Callable[[Any], None], Any], None]  # reactor.watch: call back when an fd is readable
    unwatch: Callable[[int], None]  # reactor.unwatch: before an fd is closed
    on_exit: Callable[..., None]  # lifecycle.on_exit(env, status, cause=""): an env's process is gone
    thawed: Callable[[], ContextManager[None]]  # lifecycle.template_thawed: the template runs (forks) within it
    beat: Callable[[], None]  # reactor.beat: the client's call goes on (waits outside the reactor's loop)


class Spawner(Protocol):
    """What the worker asks of a spawner (ExecSpawner, TemplateSpawner)."""

    kind: str  # "exec" or "template": RLPool(spawn=...) as it is served
    processes_at_rest: int  # a live sandbox's processes: what a scrubbed lane's cgroup may hold

    def spawn(self, lane: Lane) -> None:
        """Start env's sandbox: set lane.chan, lane.wchan, lane.logfd (and lane.pid when known)."""

    def kill(self, lane: Lane) -> None:
        """Kill env's sandbox now; its exit comes to context.on_exit, or it is reaped quietly."""

    def batching_kills(self) -> ContextManager[None]:
        """Context of many kill() calls, sent together where the spawner can."""

    def process(self, lane: Lane) -> tuple[int, int, bool]:
        """(pid, pidfd, whether the caller closes it) of env's own process; (-1, -1, False) if gone."""

    def close(self, deadline: float) -> None:
        """Stop: reap what can be reaped by `deadline`, close every fd."""


def channel_fds(channel: str) -> tuple[int, ...]:
    """The fd numbers an env finds its channel on ($BOLTZLABS_FD), the one it
    reads first: (4, 3) for pipes, (3,) for a socket. An env writes its
    replies on fd 3 either way."""
    return (CHANNEL_FD + 1, CHANNEL_FD) if channel == PIPES else (CHANNEL_FD,)


def _open_channel(start, channel: str = SOCKETPAIR, kind=socket.SOCK_STREAM, log_size: int | None = LOG_PIPE_SIZE):
    """Make a sandbox's channel and log pipe, and run `start(channel_fds, log_w)`
    with the sandbox's ends (a tuple: the socket, or the pipes' read then
    write end). Returns ours: (read fd, write fd, log pipe read end); the two
    are one fd for a socket.

    Pipes cost the worker fewer system calls per frame than a socket (issue
    16: ~3.5 us of kernel time per round trip against ~7 us). The sandbox's
    ends are closed once `start` returns; ours too if it raises.
    """
    ours: tuple[int, ...]  # the pipes' (read, write) ends, or the socket's fd twice
    theirs: tuple[int, ...]
    if channel == PIPES:
        to_env_r, to_env_w = os.pipe()
        from_env_r, from_env_w = os.pipe()
        ours, theirs = (from_env_r, to_env_w), (to_env_r, from_env_w)
    else:
        a, b = socket.socketpair(socket.AF_UNIX, kind)
        ours, theirs = (a.detach(),) * 2, (b.detach(),)
    log_r, log_w = os.pipe()
    if log_size is not None:
        try:
            fcntl.fcntl(log_r, F_SETPIPE_SZ, log_size)  # shrinking is always allowed
        except OSError:
            pass
    try:
        start(theirs, log_w)
    except BaseException:
        _close_all(set(ours))
        os.close(log_r)
        raise
    finally:
        _close_all(theirs)
        os.close(log_w)
    return ours[0], ours[1], log_r


def slot_fd(context: SpawnContext, lane: Lane) -> int:
    """The hook for an env's observation slot: its memfd (context.slots, boltzlabs/worker/slots.py), passed
    at each spawn of the lane and kept by the worker, or -1 when the pool has none."""
    slots = context.slots
    return slots.fd_for(lane.index) if slots is not None else -1


def _charged_to(context: SpawnContext, key, pid: int = 0, home=None) -> ContextManager:
    """Context in which process `pid` (0: the worker) sits in `key`'s cgroup, if
    there are cgroups: what it forks meanwhile is born there."""
    if context.cgroups is None:
        return contextlib.nullcontext()
    return context.cgroups.moving(pid, key, home)


# Every process this worker started itself and will reap through its pidfd.
# The worker is a child subreaper (worker.main), so it also adopts the
# orphans of killed sandboxes (an exec sandbox's inner bwrap, once the outer
# one is gone): reap_orphans() reaps those and leaves these alone.
SPAWNED: set[int] = set()


def reap_orphans() -> None:
    """Reap every exited child that is not one of SPAWNED (adopted orphans).

    A zombie stays in its cgroup's pids count until reaped, and a host init
    may reap slowly; a respawn into that cgroup would wait for it.
    """
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None or info.si_pid in SPAWNED:
            return  # nothing exited, or ours: its pidfd handler reaps it (with its status)
        try:
            os.waitpid(info.si_pid, 0)
        except ChildProcessError:
            return


def _reaped(pid: int) -> None:
    SPAWNED.discard(pid)


def _posix_spawn(argv, channel: tuple, log_w: int, programs: dict, slot: int = -1) -> int:
    """Start bwrap with the channel (`channel`: the socket, or the pipes' read
    and write ends) on channel_fds, the log pipe on 1 and 2, each of
    `programs` ({fd number: bytes}: the seccomp programs, bwrap's options) in
    a sealed memfd on its fd, and the env's observation slot (a memfd, or -1:
    none) on abi.SLOT_FD."""
    with contextlib.ExitStack() as stack:
        # The actions run in order, so no source may be a target met earlier:
        # sources are moved to fd 10 or above (as program_fd's are).
        def above(fd: int) -> int:
            if fd >= 10:
                return fd
            high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
            stack.callback(os.close, high)
            return high

        sources, log_w = [above(fd) for fd in channel], above(log_w)
        slots = [(os.POSIX_SPAWN_DUP2, above(slot), abi.SLOT_FD)] if slot >= 0 else []
        targets = channel_fds(PIPES if len(sources) == 2 else SOCKETPAIR)
        actions = (
            [(os.POSIX_SPAWN_DUP2, fd, target) for fd, target in zip(sources, targets)]
            + [
                (os.POSIX_SPAWN_DUP2, log_w, 1),
                (os.POSIX_SPAWN_DUP2, log_w, 2),
                (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
            ]
            + [
                (os.POSIX_SPAWN_DUP2, stack.enter_context(seccomp.program_fd(program)), target)
                for target, program in programs.items()
            ]
            + slots
        )
        pid = os.posix_spawn(argv[0], argv, {}, file_actions=actions)
        SPAWNED.add(pid)
        return pid


class ExecSpawner:
    """spawn="exec": each env is its own bubblewrap sandbox and interpreter."""

    kind = "exec"
    # A live sandbox's processes: bwrap, its init (pid 1 inside) and the env's server.
    processes_at_rest = 3

    def __init__(self, context: SpawnContext):
        self.context: SpawnContext = context  # what it may use of the pool
        self.pidfds: dict[int, int] = {}  # lane -> pidfd of its bwrap
        self.reaping: dict[int, int] = {}  # pidfd -> pid of a killed bwrap not yet reaped

    def spawn(self, lane: Lane) -> None:
        context = self.context
        argv, handed = context.spec.hand_over(context.spec.argv(channel_fds(context.channel), lane.index))

        def start(channel: tuple, log_w: int) -> None:
            with _charged_to(context, lane.index):
                lane.pid = _posix_spawn(
                    argv, channel, log_w, {**context.spec.programs(), **handed}, slot_fd(context, lane)
                )

        lane.chan, lane.wchan, lane.logfd = _open_channel(start, context.channel)
        pidfd = os.pidfd_open(lane.pid)
        self.pidfds[lane.index] = pidfd
        context.watch(pidfd, self._exited, lane)

    def _exited(self, lane) -> None:
        pidfd = self.pidfds.pop(lane.index)
        self.context.unwatch(pidfd)
        os.close(pidfd)
        try:
            pid, status = os.waitpid(lane.pid, os.WNOHANG)
            if pid:
                _reaped(pid)
        except ChildProcessError:
            status = 0
        self.context.on_exit(lane, status)

    def kill(self, lane) -> None:
        pidfd = self.pidfds.pop(lane.index, None)
        if pidfd is None:
            return
        _signal_pidfd(pidfd)  # bwrap; --die-with-parent takes the rest
        # Keep the pidfd to reap the zombie when it is ready.
        self.context.unwatch(pidfd)
        self.reaping[pidfd] = lane.pid
        self.context.watch(pidfd, self._reap, pidfd)

    @contextlib.contextmanager
    def batching_kills(self):
        """Context of many kill() calls (each is a signal here: nothing to batch)."""
        yield

    def process(self, lane) -> tuple[int, int, bool]:
        """(pid, pidfd, whether the caller closes the pidfd) of env's own
        process, the command below its bwrap's init; (-1, -1, False) if it is
        not there (it has exited: its death is on its way)."""
        try:
            pidfd, pid = sandbox_process(lane.pid)
        except OSError:
            return -1, -1, False
        return pid, pidfd, True

    def _reap(self, pidfd: int) -> None:
        pid = self.reaping.pop(pidfd)
        self.context.unwatch(pidfd)
        os.close(pidfd)
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                _reaped(pid)
        except ChildProcessError:
            pass

    def close(self, deadline: float) -> None:
        for pidfd, _pid in list(self.reaping.items()):
            remaining = max(0.0, deadline - time.monotonic())
            if _readable([pidfd], remaining, self.context.beat):
                self._reap(pidfd)
        for pidfd, _pid in self.reaping.items():
            os.close(pidfd)  # a zombie we could not wait for: init will
        self.reaping.clear()


class TemplateSpawner:
    """spawn="template": one warm template under bubblewrap forks every env.

    The template (and everything it imported) is charged to the pool's
    "template" cgroup, which holds the env's memory limit too. For each fork
    the worker moves the template into the env's cgroup and back, so the
    child, its namespaces and every page it copies are charged to the env
    from its first instant. Before the first env, the warm-up probe (a child
    like any env's, in a "probe" cgroup with the env's limits) runs env.py's
    real work once; its report (untrusted: env code wrote it) names library
    modules, which the template then imports (WARM), with the pool's own
    preload list.

    The template's control channel is bounded: one FORKED per fork asked
    for, one EXITED per child forked, one WARMED per WARM; any other frame,
    or a second one, means the template has failed (in a trusted template,
    env.py's import-time code can write on it).
    """

    kind = "template"
    # A live sandbox's processes: the env's server alone (pid 1 of its namespace).
    processes_at_rest = 1

    def __init__(self, context: SpawnContext):
        self.context: SpawnContext = context  # what it may use of the pool
        # Control frames are flat messages of one packet; a WARMED names up to MAX_NAMES modules.
        self.reader = wire.FrameReader(wire.Limits(1 << 16, max_depth=4, max_objects=2 * template.MAX_NAMES + 64))
        self.pending: list = []  # EXITED messages read, not yet delivered
        self.lanes: dict[tuple, Lane] = {}  # (lane, generation) -> env, while it lives
        self.unexited: set[tuple] = set()  # every (lane, generation) forked whose EXITED has not come
        self.pidfds: dict[tuple, int] = {}  # (lane, generation) -> pidfd of the env's pid 1
        self.forking: tuple | None = None  # the (lane, generation) whose FORKED is due
        self.forked: tuple | None = None  # ... and came
        self.warmed: dict | Literal[False] | None = None  # the template's WARMED, when due (False) and once come
        self.exits: dict[tuple, int] = {}  # probes' wait statuses (their EXITED)
        self.failure = ""  # why the template was given up, for the lanes it takes with it
        self.control: socket.socket | None = None  # the control channel (SOCK_SEQPACKET), None once it is gone
        self.bwrap_pid = -1
        self.template_pidfd = -1  # the template process itself (below bwrap and its init)
        self.log = bytearray()
        self.warmup: dict | None = None  # the warm-up report (env_contract["warmup"]), checked
        self.kills: bytearray | None = None  # KILL frames held by batching_kills()
        self.probes = 0
        self.env_code: bytes | None = None  # env.py's code, marshalled by the probe (bytes, unread here)
        self._start()

    def _start(self) -> None:
        context = self.context
        n = context.config.n
        # What its children may make of each namespace kind, together: a
        # hard reset's new namespaces come before the kernel has freed all
        # the old ones (network namespaces are torn down by a work queue).
        namespaces = 4 * n + 64
        # Room for the fds of a child being made (a channel's, a log pipe), beyond the env's file limit.
        argv, handed = context.spec.hand_over(
            context.spec.template_argv(
                channel_fds(SOCKETPAIR), open_files=n + 64, trusted=context.config.trust_env, namespaces=namespaces
            )
        )

        def start(channel: tuple, log_w: int) -> None:
            with _charged_to(context, TEMPLATE_LANE):
                self.bwrap_pid = _posix_spawn(argv, channel, log_w, {**context.spec.programs(), **handed})

        # Its control channel is a socket whatever the envs' channels are: fds travel on it (SCM_RIGHTS).
        control, _, log_r = _open_channel(start, SOCKETPAIR, socket.SOCK_SEQPACKET, log_size=None)
        parent = socket.socket(fileno=control)
        os.set_blocking(log_r, False)
        # Sends to the template never block for long: a template that stops
        # reading is treated as dead, not waited for.
        parent.settimeout(10.0)
        self.control = parent
        self.logfd = log_r
        self.pidfd = os.pidfd_open(self.bwrap_pid)
        try:
            # A trusted template imports env.py first: its import has the start-up's time.
            hello = self._handshake(time.monotonic() + context.config.start_timeout)
            if not hello.get("forkable"):
                raise TemplateUnavailable(str(hello.get("reason") or "the template refused to fork")[:2000])
            try:
                self.template_pidfd, self.pid = sandbox_process(self.bwrap_pid)
            except OSError as exc:
                raise TemplateUnavailable(f"the template: {exc}") from exc
            context.confinement.outside(self.pid, "the template")
            self.warmup = self._warmup()
        except BaseException:
            self.close(time.monotonic() + 5)
            raise
        context.watch(parent.fileno(), self._on_control, None)
        context.watch(self.logfd, self._on_log, None)

    def _handshake(self, deadline: float) -> dict:
        """Wait for the template's HELLO, reading its log meanwhile (output at
        start-up must never stall it on a full pipe); returns its info."""
        control = self.control
        assert control is not None, "_start opens the control channel before the handshake"
        while True:
            remaining = deadline - time.monotonic()
            ready = _readable([control, self.pidfd, self.logfd], remaining, self.context.beat)
            if self.logfd in ready:
                self._take_log()
            if control.fileno() in ready:
                data = control.recv(1 << 16)
                reader = wire.FrameReader(wire.Limits(1 << 16, max_depth=3, max_objects=64))
                try:
                    messages = reader.feed(data) if data else []
                except ProtocolError:
                    messages = []
                if (
                    len(messages) == 1
                    and messages[0][0] == wire.HELLO
                    and len(messages[0]) == 3
                    and isinstance(messages[0][2], dict)
                ):
                    return messages[0][2]
                _readable([self.pidfd], deadline - time.monotonic(), self.context.beat)
                ready = {self.pidfd}  # EOF or anything but a HELLO: it is done for
            if self.pidfd in ready or remaining <= 0:
                self.log += _drain(self.logfd)
                what = (
                    "exited" if self.pidfd in ready else f"did not start within {self.context.config.start_timeout:g} s"
                )
                cgroups = self.context.cgroups
                if cgroups is not None and cgroups.events(TEMPLATE_LANE)[0]:
                    what += (
                        f", killed by the kernel's OOM killer over the env's memory limit "
                        f"(memory_limit={self.context.config.memory_limit} bytes), which holds the template too"
                    )
                raise TemplateUnavailable(
                    f"the template {what}; its output:\n" + bytes(self.log[-4000:]).decode("utf-8", "replace")
                )

    # -- the warm-up ----------------------------------------------------------------------

    def _warmup(self) -> dict | None:
        """The probe (when the pool warms up), then WARM: the pool's preload list
        and the library modules the probe found. The report, or None when
        there was nothing to do."""
        context = self.context
        preload = list(context.config.preload)
        report = self._probe() if context.config.warmup else None
        names = [RUNTIME_ENTRY] + preload
        if report is not None:
            names += report["modules"] + report["preload"]
            report["preload"] = _unique(preload + report["preload"])
        elif preload:
            report = _warmup_report({"preload": preload, "error": None})
        names, cut = _fit_names(_unique(names))
        if self.control is None or self.failure:
            raise TemplateUnavailable(
                f"the template failed during its warm-up ({self.failure or 'it exited'}): "
                f"{bytes(self.log[-2000:]).decode('utf-8', 'replace')}"
            )
        self.warmed = False
        code = self.env_code
        if code is None:
            self._send(wire.encode([wire.WARM, names, False]))
        else:
            # env.py's code, marshalled by the probe: a sealed memfd the template
            # keeps unread and its children unmarshal (runtime/probe.py).
            with seccomp.program_fd(code) as fd:
                self._sendmsg(wire.encode([wire.WARM, names, True]), [fd])
        deadline = time.monotonic() + context.spec.plan.warmup_timeout + context.config.start_timeout
        while self.warmed is False:
            remaining = deadline - time.monotonic()
            ready = _readable([self.control, self.logfd], remaining, self.context.beat)
            if self.logfd in ready:
                self._take_log()
            if remaining <= 0:
                raise TemplateUnavailable(
                    f"the template did not finish its warm-up imports in time: "
                    f"{bytes(self.log[-2000:]).decode('utf-8', 'replace')}"
                )
            if self.control.fileno() in ready and not self._read_control():
                raise TemplateUnavailable(
                    f"the template failed during its warm-up imports ({self.failure or 'it exited'}): "
                    f"{bytes(self.log[-2000:]).decode('utf-8', 'replace')}"
                )
        warmed = self.warmed
        if not warmed.get("forkable"):
            raise TemplateUnavailable(str(warmed.get("reason") or "the template refused to fork")[:2000])
        if report is not None:
            failed = warmed.get("failed") if isinstance(warmed.get("failed"), dict) else {}
            imported = warmed.get("imported") if isinstance(warmed.get("imported"), list) else []
            seconds = warmed.get("import_seconds")
            report.update(
                imported=[name for name in imported if type(name) is str],
                failed={k: v for k, v in failed.items() if type(k) is str and type(v) is str},
                import_seconds=float(seconds) if type(seconds) in (int, float) else 0.0,
                refused=report["refused"] + cut + (warmed["refused"] if type(warmed.get("refused")) is int else 0),
            )
            if cut or warmed.get("truncated") is True:
                report["truncated"] = True
        return report

    def _probe(self) -> dict:
        """Run the warm-up probe: a child confined like an env, in the pool's
        "probe" cgroup (the env's memory and pids limits), checked from
        outside like an env; read its report within [template]
        warmup_timeout; kill it and remove its cgroup. The report is env
        code's: every field is checked (`_take_probe_report`)."""
        context = self.context
        timeout = context.spec.plan.warmup_timeout
        self.probes += 1
        key = (PROBE_LANE, self.probes)
        report = _warmup_report({"error": None})
        started = time.monotonic()
        try:
            chan, wchan, logfd = self._fork(key, PROBE_CGROUP, True, PIPES)
        except OSError as exc:
            report["error"] = f"the probe could not run: {exc}"
            self._remove_probe_cgroup()
            return report
        pidfd = self.pidfds.pop(key, -1)
        message, log, error = None, bytearray(), None
        try:
            message, error = self._read_probe(chan, logfd, pidfd, log, started + timeout, timeout)
            # Checked from outside like an env, once it has reported (it waits for
            # us then): a report from a process that fails the check is not used.
            if message is not None:
                problem = context.confinement.check(PROBE_LANE, _pidfd_pid(pidfd), pidfd)
                if problem:
                    message, error = None, f"the probe failed the confinement check and was killed: {problem}"
        finally:
            if pidfd >= 0:
                _signal_pidfd(pidfd)  # pid 1 of its namespace: everything it started goes with it
            if context.cgroups is not None:
                context.cgroups.kill(PROBE_CGROUP)
            status = self._wait_exit(key, time.monotonic() + 5.0)
            oom = context.cgroups.events(PROBE_CGROUP)[0] if context.cgroups is not None else 0
            context.confinement.forget(PROBE_LANE)
            _close_all({chan, wchan} | {logfd})
            _close_pidfd(pidfd)
            self._remove_probe_cgroup()
        report["seconds"] = round(time.monotonic() - started, 4)
        self.env_code = _take_probe_report(message, status, error, oom, context.config.memory_limit, report)
        self.log += log[-4096:]
        return report

    def _read_probe(self, chan: int, logfd: int, pidfd: int, log: bytearray, deadline: float, timeout: float):
        """(the probe's one frame or None, an error or None), read until it
        comes, the probe ends, or the deadline. Its log is kept (its tail)."""
        limits = wire.Limits(
            _MAX_PROBE_REPORT + probe.MAX_CODE,
            max_str_len=4096,
            max_bin_len=probe.MAX_CODE,
            max_array_len=template.MAX_NAMES,
            max_map_len=0,
            max_depth=3,
            max_objects=2 * template.MAX_NAMES + 16,
        )
        reader = wire.FrameReader(limits)
        os.set_blocking(chan, False)
        os.set_blocking(logfd, False)
        control = self.control
        # Only close() drops the channel, and the probe runs within _start, before anything could close it.
        assert control is not None, "the probe runs while the template's control channel is open"
        watched = [chan, logfd, control] + ([pidfd] if pidfd >= 0 else [])
        exited = False
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None, f"the probe did not finish within {timeout:g} s ([template] warmup_timeout): killed"
            ready = _readable(watched, remaining, self.context.beat)
            if logfd in ready:
                log += _drain(logfd)
                del log[:-65536]
            if control.fileno() in ready and not self._read_control():
                return None, f"the template failed while its probe ran ({self.failure or 'it exited'})"
            if chan in ready:
                try:
                    data = os.read(chan, 1 << 16)
                except BlockingIOError:
                    data = None
                if data == b"":
                    return None, None
                if data:
                    try:
                        messages = reader.feed(data)
                    except ProtocolError as exc:
                        return None, f"the probe sent no valid report (it was refused: {exc})"
                    if messages:
                        return messages[0], None
            if pidfd in ready:
                if exited:
                    return None, None
                exited = True  # one more round for what it wrote just before
                watched.remove(pidfd)
                deadline = min(deadline, time.monotonic() + 0.2)

    def _wait_exit(self, key: tuple, deadline: float):
        """The wait status of child `key` from its EXITED (the template reaps it), or None."""
        self.deliver_exits()  # an EXITED read while the probe ran waits in self.pending
        while key not in self.exits and self.control is not None:
            if not _readable([self.control], deadline - time.monotonic(), self.context.beat):
                return None
            if not self._read_control():
                return None
            self.deliver_exits()
        return self.exits.pop(key, None)

    def _remove_probe_cgroup(self) -> None:
        if self.context.cgroups is not None:
            self.context.cgroups.remove(PROBE_CGROUP, time.monotonic() + 5.0, reap_orphans)

    # -- forking ----------------------------------------------------------------------------

    def alive(self) -> bool:
        return self.control is not None

    def _fork(self, key: tuple, cgroup_key, probe: bool, channel: str, slot: int = -1) -> tuple:
        """FORK child `key` into cgroup `cgroup_key`: our ends of its channel and
        log. `slot`: its observation slot's memfd (kept by the worker), or -1."""
        context = self.context
        control = self.control
        if control is None:
            raise OSError("the template is gone")
        frame = wire.encode([wire.FORK, key[0], key[1], probe, slot >= 0])

        def start(channel: tuple, log_w: int) -> None:
            # The child's channel ends (one socket, or the read then the write pipe), its log pipe, then
            # its observation slot if it has one (the template puts it on abi.SLOT_FD).
            fds = array.array("i", [*channel, log_w] + ([slot] if slot >= 0 else [])).tobytes()
            # The template's pid is moved between cgroups: it must still be ours.
            if _readable([self.template_pidfd], 0):
                raise OSError("the template is gone")
            with _charged_to(context, cgroup_key, self.pid, TEMPLATE_LANE), context.thawed():
                control.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
                self.unexited.add(key)
                self._wait_forked(key)

        self.forking, self.forked = key, None
        try:
            return _open_channel(start, channel)
        except OSError:
            self._lost()
            raise
        finally:
            self.forking = self.forked = None

    def spawn(self, lane) -> None:
        key = (lane.index, lane.generation)
        chan, wchan, lane.logfd = self._fork(key, lane.index, False, self.context.channel, slot_fd(self.context, lane))
        self.lanes[key] = lane
        pidfd = self.pidfds.get(key, -1)
        lane.pid = _pidfd_pid(pidfd) if pidfd >= 0 else -1
        lane.chan, lane.wchan = chan, wchan

    def process(self, lane) -> tuple[int, int, bool]:
        """(pid, pidfd, whether the caller closes the pidfd) of env's process,
        pid 1 of its sandbox; (-1, -1, False) if unknown. The pidfd stays ours."""
        pidfd = self.pidfds.get((lane.index, lane.generation), -1)
        return (_pidfd_pid(pidfd), pidfd, False) if pidfd >= 0 else (-1, -1, False)

    def _wait_forked(self, key: tuple) -> None:
        deadline = time.monotonic() + self.context.config.start_timeout
        while self.forked != key:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not _readable([self.control], remaining, self.context.beat):
                raise OSError("the template did not answer a fork request in time")
            if not self._read_control():
                raise OSError(f"the template failed: {self.failure}" if self.failure else "the template is gone")

    def _read_control(self) -> bool:
        """Read one packet of the template's; False if it is gone or broke the
        protocol (self.failure says how): only what is due is taken."""
        control = self.control
        if control is None:  # closed: the template is gone
            return False
        try:
            data, ancillary, _, _ = control.recvmsg(1 << 16, _PIDFD_SPACE)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            data, ancillary = b"", []
        fds = _received_fds(ancillary)
        try:
            if not data:
                return False
            try:
                messages = self.reader.feed(data)
            except ProtocolError as exc:
                self.failure = f"it sent a malformed control frame ({exc})"
                return False
            for message in messages:
                problem = self._take(message, fds)
                if problem:
                    self.failure = f"it sent {describe_control(message)}, {problem}"
                    return False
            return True
        finally:
            _close_all(fds)

    def _take(self, message: list, fds: list) -> str:
        """Take one control message; why it is not due, or ''."""
        code = message[0]
        if code == wire.WARMED and len(message) == 2:
            if self.warmed is not False or type(message[1]) is not dict:
                return "which was not due"
            self.warmed = message[1]
            return ""
        if len(message) not in (3, 4) or type(message[1]) is not int or type(message[2]) is not int:
            return "which is no control message"
        key = (message[1], message[2])
        if code == wire.FORKED and len(message) == 3:
            if key != self.forking or self.forked == key:
                return "but no such fork was asked for"
            self.forked = key
            # Its pidfd, if one came alone with it. The template can send any fd,
            # but a pidfd it can make names a process of its own sandbox.
            if len(fds) == 1 and _pidfd_pid(fds[0]) > 0:
                self.pidfds[key] = fds.pop()
            return ""
        if code == wire.EXITED and len(message) == 4:
            if key not in self.unexited:
                return "but that child was never forked, or has exited already"
            if type(message[3]) is not int:
                return "whose wait status is not a number"
            self.unexited.discard(key)
            self.pending.append(message)
            return ""
        return "which is no control message"

    def _on_control(self, _) -> None:
        if not self._read_control():
            self._lost()
            return
        self.deliver_exits()

    def deliver_exits(self) -> None:
        """Report the EXITED messages read so far. _wait_forked reads the
        control socket too, and an exit it read must not wait there for the
        next message (with async stepping, other envs run during a respawn).
        The worker calls this once the env just spawned is registered."""
        pending, self.pending = self.pending, []
        for message in pending:
            key = (message[1], message[2])
            lane = self.lanes.pop(key, None)
            pidfd = self.pidfds.pop(key, -1)
            # A no-op if it has exited; in a trusted template, a forged EXITED's
            # env goes now, not at its next respawn.
            if pidfd >= 0:
                _signal_pidfd(pidfd)
            _close_pidfd(pidfd)
            if lane is not None:
                self.context.on_exit(lane, message[3])
            elif key[0] == PROBE_LANE:
                self.exits[key] = message[3]

    def _on_log(self, _) -> None:
        if not self._take_log():
            self.context.unwatch(self.logfd)  # the template is gone; _on_control will say so

    def _take_log(self) -> bool:
        """Read the template's log into its tail; False at its end."""
        try:
            data = os.read(self.logfd, 1 << 16)
        except BlockingIOError:
            return True
        if not data:
            return False
        self.log += data
        del self.log[:-65536]
        return True

    def _send(self, frame: bytes) -> None:
        self._sendmsg(frame, [])

    def _sendmsg(self, frame: bytes, fds: list) -> None:
        control = self.control
        if control is None:
            raise TemplateUnavailable("the template is gone (its control channel is closed)")
        try:
            ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
            control.sendmsg([frame], ancillary)
        except OSError as exc:
            raise TemplateUnavailable(f"the template stopped reading its control channel ({exc})") from exc

    def give_up(self, why: str) -> None:
        """Kill the template for `why` (it could not be frozen): its lanes die with it, saying so."""
        self.failure = why
        self._lost()

    def _lost(self) -> None:
        """The template died, or broke its protocol and is killed: so did every child (its pid namespace went)."""
        if self.control is None:
            return
        self.log += _drain(self.logfd)
        lanes, self.lanes = self.lanes, {}
        self.close(time.monotonic() + 5)
        tail = bytes(self.log[-2000:]).decode("utf-8", "replace")
        why = f"the template failed: {self.failure}; " if self.failure else ""
        for lane in lanes.values():
            self.context.on_exit(lane, None, f"died with its template ({why}the template's output: {tail!r})")

    def kill(self, lane) -> None:
        key = (lane.index, lane.generation)
        if self.lanes.pop(key, None) is None or self.control is None:
            return
        pidfd = self.pidfds.pop(key, -1)
        if pidfd >= 0:
            _signal_pidfd(pidfd)  # pid 1 of its namespace: the whole tree goes
            _close_pidfd(pidfd)
            return
        # No pidfd came with its FORKED: the template, its parent, kills it.
        frame = wire.encode([wire.KILL, lane.index, lane.generation])
        if self.kills is not None:
            self.kills += frame
            return
        try:
            self.control.sendall(frame)
        except OSError:
            self._lost()

    @contextlib.contextmanager
    def batching_kills(self):
        """Context of many kill() calls: their KILL frames go to the template
        in a few packets at the end, not one packet (and one turn of the
        template's loop) each, which held up a 1000-env hard reset."""
        self.kills = bytearray()
        try:
            yield
        finally:
            kills, self.kills = self.kills, None
            try:
                # The template reads at most 64 KiB per packet.
                for start in range(0, len(kills), 1 << 15):
                    if self.control is not None:
                        self.control.sendall(kills[start : start + (1 << 15)])
            except OSError:
                self._lost()

    def close(self, deadline: float) -> None:
        if self.control is None:
            return
        self.context.confinement.gone("the template")
        self.context.unwatch(self.control.fileno())
        self.context.unwatch(self.logfd)
        self.control.close()
        self.control = None
        for pidfd in self.pidfds.values():
            _close_pidfd(pidfd)
        self.pidfds.clear()
        _close_pidfd(self.template_pidfd)
        self.template_pidfd = -1
        _signal_pidfd(self.pidfd)  # our own child: bwrap's pid namespace takes every env with it
        _readable([self.pidfd], deadline - time.monotonic(), self.context.beat)
        try:
            if os.waitpid(self.bwrap_pid, os.WNOHANG)[0]:
                _reaped(self.bwrap_pid)
        except ChildProcessError:
            pass
        os.close(self.pidfd)
        os.close(self.logfd)


PROBE_LANE = -1  # the probe's lane number on the template's control channel
RUNTIME_ENTRY = "boltzlabs.env"  # what every env.py imports first: the template imports it for them all
PROBE_CGROUP = "probe"  # its cgroup: the env's limits, removed once it is done
_MAX_PROBE_REPORT = 1 << 20
_MAX_WARM = 60000  # one packet the template reads with a 64 KiB buffer


def _unique(names: list) -> list:
    return list(dict.fromkeys(names))


def _fit_names(names: list) -> tuple[list, int]:
    """The names that fit one WARM packet (in order: the pool's preload list
    first), and how many were left out."""
    kept, size = [], 16
    for name in names[: template.MAX_NAMES]:
        size += len(name) + 3
        if size > _MAX_WARM:
            break
        kept.append(name)
    return kept, len(names) - len(kept)


def _take_probe_report(message, status, error, oom: int, memory_limit, report: dict) -> bytes | None:
    """Fill `report` from the probe's frame, trusting nothing in it: [PROBED,
    names, how many, private bytes at birth, after, steps, error, serve(preload=)
    names, env.py's marshalled code or None]. Returns that code (bytes this
    process never reads: the template's children unmarshal them), or None."""
    valid = (
        type(message) is list
        and len(message) == 9
        and message[0] == wire.PROBED
        and type(message[1]) is list
        and all(type(x) is int and x >= 0 for x in message[2:6])
        and (message[6] is None or type(message[6]) is str)
        and type(message[7]) is list
        and (message[8] is None or (type(message[8]) is bytes and len(message[8]) <= probe.MAX_CODE))
    )
    code = None
    if valid:
        _, names, total, birth, after, steps, raised, wanted, code = message
        good = sorted({name for name in names if template.valid_name(name)})
        report.update(
            modules=good,
            private_birth=birth,
            private_after=after,
            steps=steps,
            preload=[name[: template.MAX_NAME_LEN] for name in wanted if type(name) is str][: template.MAX_NAMES],
            refused=report["refused"] + max(0, total - len(good)),
        )
        if raised is not None and error is None:
            error = raised[:1000]
    if error is None and status is not None and status != 0 and not valid:
        error = f"the probe (the env's reset and steps, run once in a throwaway sandbox) {describe_status(status)}"
    elif error is None and not valid:
        error = "the probe sent no valid report (its output was refused)"
    if oom and (error is not None or not valid):
        error = (f"{error}; " if error else "") + (
            f"OOM: the kernel's OOM killer ended it over the env's memory limit (memory_limit={memory_limit} bytes)"
        )
    report["error"] = error
    return code


_CONTROL_NAMES = {
    wire.HELLO: "HELLO",
    wire.FORK: "FORK",
    wire.KILL: "KILL",
    wire.WARM: "WARM",
    wire.FORKED: "FORKED",
    wire.EXITED: "EXITED",
    wire.WARMED: "WARMED",
}


def describe_control(message) -> str:
    """A control message in a few words, for an error: [EXITED, 0, 1, 'xxx...']."""
    if isinstance(message, list) and message and message[0] in _CONTROL_NAMES:
        text = "[" + ", ".join([_CONTROL_NAMES[message[0]], *(repr(item) for item in message[1:])]) + "]"
    else:
        text = repr(message)
    return text if len(text) <= 120 else text[:117] + "..."


_WARMUP_TYPES = {
    "modules": list,
    "preload": list,
    "imported": list,
    "failed": dict,
    "private_birth": int,
    "private_after": int,
    "steps": int,
    "seconds": float,
    "import_seconds": float,
    "error": (str, type(None)),
    "refused": int,
    "truncated": bool,
}


def _warmup_report(fields: dict) -> dict:
    """A warm-up report (env_contract["warmup"]) with every key, from `fields`."""
    out = {
        "modules": [],
        "preload": [],
        "imported": [],
        "failed": {},
        "private_birth": 0,
        "private_after": 0,
        "steps": 0,
        "seconds": 0.0,
        "import_seconds": 0.0,
        "error": None,
        "refused": 0,
    }
    out.update(fields)
    return out


_PIDFD_SPACE = socket.CMSG_SPACE(4 * 4)  # a FORKED brings one fd; more are closed (or cut by the kernel)


def _readable(fds, timeout: float, beat: Callable[[], None] | None = None) -> set[int]:
    """The fd numbers among `fds` (ints, or objects with fileno()) that are
    readable, closed or in error within `timeout` seconds. poll, not select:
    select refuses fd numbers from 1024 up, and a worker with a thousand envs
    holds thousands. With `beat` (Reactor.beat), a long wait is cut into
    seconds with a beat() after each: the client hears that its call goes on."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    if beat is None:
        return {fd for fd, _ in poller.poll(math.ceil(max(0.0, timeout) * 1000))}
    end = time.monotonic() + timeout
    while True:
        left = end - time.monotonic()
        ready = {fd for fd, _ in poller.poll(math.ceil(max(0.0, min(left, HEARTBEAT_AFTER)) * 1000))}
        if ready or left <= HEARTBEAT_AFTER:
            return ready
        beat()


def _received_fds(ancillary) -> list[int]:
    fds = array.array("i")
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return list(fds)


def _close_all(fds) -> None:
    for fd in fds:
        os.close(fd)


def _close_pidfd(pidfd: int) -> None:
    if pidfd >= 0:
        os.close(pidfd)


def _signal_pidfd(pidfd: int, signum: int = signal.SIGKILL) -> None:
    """Signal the process a pidfd holds: that process or nobody, whatever
    has been given its pid number since."""
    try:
        signal.pidfd_send_signal(pidfd, signum)
    except ProcessLookupError:
        pass  # it has exited


def _pidfd_nspids(pidfd: int) -> list[int]:
    """The pids of a pidfd's process, in our pid namespace then each nested one
    (its fdinfo's NSpid line); [] if it has been reaped or fd is no pidfd."""
    try:
        for line in read_file(f"/proc/self/fdinfo/{pidfd}").split(b"\n"):
            if line.startswith(b"NSpid:"):
                pids = [int(x) for x in line.split()[1:]]
                return pids if pids and pids[0] > 0 else []
    except (OSError, ValueError):
        pass
    return []


def _pidfd_pid(pidfd: int) -> int:
    """The pid, in our namespace, of a pidfd's process (-1 if gone or no pidfd)."""
    pids = _pidfd_nspids(pidfd)
    return pids[0] if pids else -1


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return []


def sandbox_process(bwrap_pid: int) -> tuple[int, int]:
    """(pidfd, host pid) of the process a sandbox runs (the template, or an
    exec-mode env), found below our own bwrap.

    bwrap (our child) -> its init, pid 1 of the sandbox's pid namespace ->
    the command it ran, pid 2 there: the template. Nothing the template says
    is used (import-time code could speak for it from a process that exits,
    leaving a pid for the host to reuse); no other process can be pid 2 of
    that namespace while the template lives, and the namespace dies with it.
    """
    depth = len(_own_nspids()) + 1
    for init in _children(bwrap_pid):
        for pid in _children(init):
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                continue
            nspids = _pidfd_nspids(pidfd)
            if len(nspids) == depth and nspids[-1] == 2:
                return pidfd, nspids[0]
            os.close(pidfd)
    raise ProcessLookupError(f"could not find the sandboxed process below its bwrap (pid {bwrap_pid})")


def _own_nspids() -> list[int]:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return [int(x) for x in line.split()[1:]]
    return [os.getpid()]


def _drain(fd: int) -> bytes:
    out = bytearray()
    for _ in range(64):
        try:
            data = os.read(fd, 1 << 16)
        except (BlockingIOError, OSError):
            break
        if not data:
            break
        out += data
    return bytes(out[-65536:])
