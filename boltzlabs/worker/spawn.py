r"""How the worker makes sandboxes: one interpreter per env, or forks of a template.

    Worker --spawn(env)--> ExecSpawner:     posix_spawn(bwrap ... python env.py), per env
                       \-> TemplateSpawner: [FORK] to one warm template (boltzlabs.runtime.template)
    Worker <--on_exit(env, status)-- either, when an env's process is gone

Both hand the env its channel (two pipes, the one it writes as fd 3 and the
one it reads as fd 4, or a socketpair end as fd 3: `Worker.channel`,
docs/wire.md#the-channel) and its log pipe (fds 1 and 2), start it inside its own cgroup, and report its exit status.
The worker owns everything else (the channel protocol, deadlines, state).

Signals go through pidfds only, never to a pid number learnt later: a pid
is freed when its process is reaped, and the host may hand it to anything.
Exec mode holds a pidfd of the bwrap it spawned; in template mode the
template opens one for each child it forks and passes it with FORKED, and
the worker finds the template itself below its own bwrap (`_template_pid`).
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

from boltzlabs import wire
from boltzlabs.runtime import template
from boltzlabs.sandbox import seccomp
from boltzlabs.worker.config import PIPES, SOCKETPAIR
from boltzlabs.errors import TemplateUnavailable  # noqa: F401 - spawn.TemplateUnavailable, its old home

CHANNEL_FD = 3  # where an env (and the template) finds its channel: a socket, or the pipe it writes (then 4: reads)
TEMPLATE_LANE = "template"  # the template's cgroup name
LOG_PIPE_SIZE = 4096  # one page: an env's output is rarely written, and every page counts against the pipe quota
F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ from Python 3.10 on; the number is the kernel's


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


def slot_fd(worker, env) -> int:
    """The hook for an env's observation slot: its memfd (worker.slots, boltzlabs/worker/slots.py), passed
    at each spawn of the lane and kept by the worker, or -1 when the pool has none."""
    slots = getattr(worker, "slots", None)
    return slots.fd_for(env.index) if slots is not None else -1


def _charged_to(worker, key, pid: int = 0, home=None):
    """Context in which process `pid` (0: the worker) sits in `key`'s cgroup, if
    there are cgroups: what it forks meanwhile is born there."""
    if worker.cgroups is None:
        return contextlib.nullcontext()
    return worker.cgroups.moving(pid, key, home)


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
    and write ends) on channel_fds, the log pipe on 1 and 2, each seccomp
    program of `programs` ({fd number: BPF bytes}) on its fd, and the env's
    observation slot (a memfd, or -1: none) on wire.SLOT_FD."""
    with contextlib.ExitStack() as stack:
        # The actions run in order, so no source may be a target met earlier:
        # sources are moved to fd 10 or above (as program_fd's are).
        def above(fd: int) -> int:
            if fd >= 10:
                return fd
            high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
            stack.callback(os.close, high)
            return high

        channel, log_w = [above(fd) for fd in channel], above(log_w)
        slots = [(os.POSIX_SPAWN_DUP2, above(slot), wire.SLOT_FD)] if slot >= 0 else []
        targets = channel_fds(PIPES if len(channel) == 2 else SOCKETPAIR)
        actions = [(os.POSIX_SPAWN_DUP2, fd, target) for fd, target in zip(channel, targets)] + [
            (os.POSIX_SPAWN_DUP2, log_w, 1),
            (os.POSIX_SPAWN_DUP2, log_w, 2),
            (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
        ] + [(os.POSIX_SPAWN_DUP2, stack.enter_context(seccomp.program_fd(program)), target)
             for target, program in programs.items()] + slots
        pid = os.posix_spawn(argv[0], argv, {}, file_actions=actions)
        SPAWNED.add(pid)
        return pid


class ExecSpawner:
    """spawn="exec": each env is its own bubblewrap sandbox and interpreter."""

    kind = "exec"

    def __init__(self, worker):
        self.worker = worker
        self.pidfds: dict[int, int] = {}  # lane -> pidfd of its bwrap
        self.reaping: dict[int, int] = {}  # pidfd -> pid of a killed bwrap not yet reaped

    def spawn(self, env) -> None:
        worker = self.worker
        argv = worker.spec.argv(channel_fds(worker.channel), env.index)

        def start(channel: tuple, log_w: int) -> None:
            with _charged_to(worker, env.index):
                env.pid = _posix_spawn(argv, channel, log_w, worker.spec.programs(), slot_fd(worker, env))

        env.chan, env.wchan, env.logfd = _open_channel(start, worker.channel)
        pidfd = os.pidfd_open(env.pid)
        self.pidfds[env.index] = pidfd
        worker.watch(pidfd, self._exited, env)

    def _exited(self, env) -> None:
        pidfd = self.pidfds.pop(env.index)
        self.worker.unwatch(pidfd)
        os.close(pidfd)
        try:
            pid, status = os.waitpid(env.pid, os.WNOHANG)
            if pid:
                _reaped(pid)
        except ChildProcessError:
            status = 0
        self.worker.on_exit(env, status)

    def kill(self, env) -> None:
        pidfd = self.pidfds.pop(env.index, None)
        if pidfd is None:
            return
        _signal_pidfd(pidfd)  # bwrap; --die-with-parent takes the rest
        # Keep the pidfd to reap the zombie when it is ready.
        self.worker.unwatch(pidfd)
        self.reaping[pidfd] = env.pid
        self.worker.watch(pidfd, self._reap, pidfd)

    @contextlib.contextmanager
    def batching_kills(self):
        """Context of many kill() calls (each is a signal here: nothing to batch)."""
        yield

    def _reap(self, pidfd: int) -> None:
        pid = self.reaping.pop(pidfd)
        self.worker.unwatch(pidfd)
        os.close(pidfd)
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                _reaped(pid)
        except ChildProcessError:
            pass

    def close(self, deadline: float) -> None:
        for pidfd, pid in list(self.reaping.items()):
            remaining = max(0.0, deadline - time.monotonic())
            if _readable([pidfd], remaining):
                self._reap(pidfd)
        for pidfd, pid in self.reaping.items():
            os.close(pidfd)  # a zombie we could not wait for: init will
        self.reaping.clear()


class TemplateSpawner:
    """spawn="template": one warm template under bubblewrap forks every env.

    The template (and everything it imported) is charged to the pool's
    "template" cgroup. For each fork the worker moves the template into the
    env's cgroup and back, so the child, its namespaces and every page it
    copies are charged to the env from its first instant.
    """

    kind = "template"

    def __init__(self, worker):
        self.worker = worker
        # The template ran env.py's import-time code: its control frames are
        # small, flat messages, and anything else is refused as malformed.
        self.reader = wire.FrameReader(wire.Limits(1 << 16, max_depth=4, max_objects=256))
        self.pending: list = []
        self.lanes: dict[tuple, object] = {}  # (lane, generation) -> env
        self.pidfds: dict[tuple, int] = {}  # (lane, generation) -> pidfd of the env's pid 1
        self.forking: tuple | None = None  # the (lane, generation) whose FORKED may bring a pidfd
        self.control = None
        self.bwrap_pid = -1
        self.template_pidfd = -1  # the template process itself (below bwrap and its init)
        self.log = bytearray()
        self.warmup = None  # the template's warm-up report (template.warm_up), checked
        self.kills: bytearray | None = None  # KILL frames held by batching_kills()
        self._start()

    def _start(self) -> None:
        worker = self.worker
        # Room for the fds of a child being made (a channel's, a log pipe), beyond the env's file limit.
        argv = worker.spec.template_argv(channel_fds(SOCKETPAIR), open_files=len(worker.envs) + 64,
                                         warmup=worker.warmup)

        def start(channel: tuple, log_w: int) -> None:
            with _charged_to(worker, TEMPLATE_LANE):
                self.bwrap_pid = _posix_spawn(argv, channel, log_w, worker.spec.programs())

        # Its control channel is a socket whatever the envs' channels are: fds travel on it (SCM_RIGHTS).
        # Its log pipe keeps its 64 KiB: the handshake below does not read it,
        # and env.py's import-time output must not stall the template there.
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
            # The warm-up runs before the HELLO: its time comes on top.
            hello = self._handshake(time.monotonic() + worker.start_timeout + 2 * worker.warmup_timeout)
            self.warmup = _warmup_report(hello.get("warmup"))
            if not hello.get("forkable"):
                raise TemplateUnavailable(hello.get("reason") or "the template refused to fork")
            self.template_pidfd, self.pid = _template_pid(self.bwrap_pid)
        except BaseException:
            self.close(time.monotonic() + 5)
            raise
        worker.watch(self.control.fileno(), self._on_control, None)
        worker.watch(self.logfd, self._on_log, None)

    def _handshake(self, deadline: float) -> dict:
        """Wait for the template's HELLO; returns its info."""
        while True:
            remaining = deadline - time.monotonic()
            ready = _readable([self.control, self.pidfd], remaining)
            if self.control.fileno() in ready:
                data = self.control.recv(1 << 16)
                # The handshake's own caps: a warm-up report has more items than a control message.
                reader = wire.FrameReader(wire.Limits(1 << 16, max_depth=5, max_objects=1 << 13))
                try:
                    messages = reader.feed(data) if data else []
                except wire.ProtocolError:
                    messages = []
                if messages and messages[0][0] == wire.HELLO and len(messages[0]) == 3 \
                        and isinstance(messages[0][2], dict):
                    return messages[0][2]
                _readable([self.pidfd], deadline - time.monotonic())
                ready = {self.pidfd}  # EOF or anything but a HELLO: it is done for
            if self.pidfd in ready or remaining <= 0:
                self.log += _drain(self.logfd)
                what = "exited" if self.pidfd in ready else f"did not start within {self.worker.start_timeout:g} s"
                raise TemplateUnavailable(f"the template {what}; its output:\n"
                                          + bytes(self.log[-4000:]).decode("utf-8", "replace"))

    def alive(self) -> bool:
        return self.control is not None

    def spawn(self, env) -> None:
        worker = self.worker
        if self.control is None:
            raise OSError("the template is gone")
        slot = slot_fd(worker, env)
        frame = wire.encode([template.FORK, env.index, env.generation] + ([True] if slot >= 0 else []))

        def start(channel: tuple, log_w: int) -> None:
            # The child's channel ends (one socket, or the read then the write pipe), its log pipe, then
            # its observation slot if it has one (the template puts it on wire.SLOT_FD).
            fds = array.array("i", [*channel, log_w] + ([slot] if slot >= 0 else [])).tobytes()
            # The template's pid is moved between cgroups: it must still be ours.
            if _readable([self.template_pidfd], 0):
                raise OSError("the template is gone")
            with _charged_to(worker, env.index, self.pid, TEMPLATE_LANE):
                self.control.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
                self._wait_forked(env)

        key = (env.index, env.generation)
        self.forking = key
        try:
            chan, wchan, env.logfd = _open_channel(start, worker.channel)
        except OSError:
            self._lost()
            raise
        finally:
            self.forking = None
        self.lanes[key] = env
        pidfd = self.pidfds.get(key, -1)
        env.pid = _pidfd_pid(pidfd) if pidfd >= 0 else -1
        env.chan, env.wchan = chan, wchan

    def _wait_forked(self, env) -> None:
        deadline = time.monotonic() + self.worker.start_timeout
        while True:
            for message in self.pending:
                if message[0] == template.FORKED and message[1:] == [env.index, env.generation]:
                    self.pending = [m for m in self.pending if m[0] != template.FORKED]
                    return
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not _readable([self.control], remaining):
                raise OSError("the template did not answer a fork request in time")
            if not self._read_control():
                raise OSError("the template is gone")

    def _read_control(self) -> bool:
        try:
            data, ancillary, _, _ = self.control.recvmsg(1 << 16, _PIDFD_SPACE)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            data, ancillary = b"", []
        fds = _received_fds(ancillary)
        if not data:
            _close_all(fds)
            return False
        try:
            messages = self.reader.feed(data)
        except wire.ProtocolError:
            _close_all(fds)
            return False
        # Only what can be due is kept: import-time code can write anything here.
        for message in messages:
            if len(message) not in (3, 4) or type(message[1]) is not int or type(message[2]) is not int:
                continue
            key = (message[1], message[2])
            if (message[0] == template.FORKED and len(message) == 3 and key == self.forking) or \
                    (message[0] == template.EXITED and len(message) == 4 and (key in self.lanes or key == self.forking)):
                self.pending.append(message)
        self._take_pidfd(messages, fds)
        return True

    def _take_pidfd(self, messages: list, fds: list) -> None:
        """Keep the pidfd a FORKED packet brings for the child being forked now.
        Import-time code in the template can send anything on this socket, but
        a pidfd it can make names a process of its own sandbox, never a host
        one; any other fd, or one for another lane, is closed."""
        key = self.forking
        if (len(fds) == 1 and len(messages) == 1 and key is not None and key not in self.pidfds
                and messages[0][:1] == [template.FORKED] and messages[0][1:] == list(key)
                and _pidfd_pid(fds[0]) > 0):
            self.pidfds[key] = fds.pop()
        _close_all(fds)

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
        keep = []
        for message in self.pending:
            if message[0] == template.EXITED and len(message) == 4:
                key = (message[1], message[2])
                env = self.lanes.pop(key, None)
                if env is not None:
                    # A no-op if it has exited; if import-time code forged this
                    # EXITED, the env it names goes now, not at its next respawn.
                    pidfd = self.pidfds.pop(key, -1)
                    if pidfd >= 0:
                        _signal_pidfd(pidfd)
                    _close_pidfd(pidfd)
                if env is not None and isinstance(message[3], int):
                    self.worker.on_exit(env, message[3])
            else:
                keep.append(message)
        self.pending = keep

    def _on_log(self, _) -> None:
        try:
            data = os.read(self.logfd, 1 << 16)
        except BlockingIOError:
            return
        if not data:
            self.worker.unwatch(self.logfd)  # the template is gone; _on_control will say so
            return
        self.log += data
        del self.log[:-65536]

    def _lost(self) -> None:
        """The template died: so did every child (its pid namespace went)."""
        if self.control is None:
            return
        self.log += _drain(self.logfd)
        lanes, self.lanes = self.lanes, {}
        self.close(time.monotonic() + 5)
        tail = bytes(self.log[-2000:]).decode("utf-8", "replace")
        for env in lanes.values():
            self.worker.on_exit(env, None, f"died with its template (the template's output: {tail!r})")

    def kill(self, env) -> None:
        key = (env.index, env.generation)
        if self.lanes.pop(key, None) is None or self.control is None:
            return
        pidfd = self.pidfds.pop(key, -1)
        if pidfd >= 0:
            _signal_pidfd(pidfd)  # pid 1 of its namespace: the whole tree goes
            _close_pidfd(pidfd)
            return
        # No pidfd came with its FORKED: the template, its parent, kills it.
        frame = wire.encode([template.KILL, env.index, env.generation])
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
                        self.control.sendall(kills[start:start + (1 << 15)])
            except OSError:
                self._lost()

    def close(self, deadline: float) -> None:
        if self.control is None:
            return
        self.worker.unwatch(self.control.fileno())
        self.worker.unwatch(self.logfd)
        self.control.close()
        self.control = None
        for pidfd in self.pidfds.values():
            _close_pidfd(pidfd)
        self.pidfds.clear()
        _close_pidfd(self.template_pidfd)
        self.template_pidfd = -1
        _signal_pidfd(self.pidfd)  # our own child: bwrap's pid namespace takes every env with it
        _readable([self.pidfd], deadline - time.monotonic())
        try:
            if os.waitpid(self.bwrap_pid, os.WNOHANG)[0]:
                _reaped(self.bwrap_pid)
        except ChildProcessError:
            pass
        os.close(self.pidfd)
        os.close(self.logfd)


_WARMUP_TYPES = {"modules": list, "preload": list, "imported": list, "failed": dict, "private_birth": int,
                 "private_after": int, "steps": int, "seconds": float, "import_seconds": float, "error": (str, type(None)), "refused": int,
                 "truncated": bool}


def _warmup_report(report) -> dict | None:
    """The template's warm-up report with the keys and types template.warm_up
    makes, or None. The template ran env.py's import code: it may send anything."""
    if type(report) is not dict:
        return None
    out = {}
    for key, kind in _WARMUP_TYPES.items():
        value = report.get(key)
        if key in ("seconds", "import_seconds") and type(value) is int:
            value = float(value)
        if type(value) is bool if kind is bool else isinstance(value, kind) and type(value) is not bool:
            out[key] = value
    for key in ("modules", "preload", "imported"):
        out[key] = [name for name in out.get(key, []) if type(name) is str]
    out["failed"] = {k: v for k, v in out.get("failed", {}).items() if type(k) is str and type(v) is str}
    out.setdefault("error", "the template's warm-up report was malformed")
    for key in ("private_birth", "private_after", "steps", "refused"):
        out.setdefault(key, 0)
    out.setdefault("seconds", 0.0)
    out.setdefault("import_seconds", 0.0)
    return out


_PIDFD_SPACE = socket.CMSG_SPACE(4 * 4)  # a FORKED brings one fd; more are closed (or cut by the kernel)


def _readable(fds, timeout: float) -> set[int]:
    """The fd numbers among `fds` (ints, or objects with fileno()) that are
    readable, closed or in error within `timeout` seconds. poll, not select:
    select refuses fd numbers from 1024 up, and a worker with a thousand envs
    holds thousands."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return {fd for fd, _ in poller.poll(math.ceil(max(0.0, timeout) * 1000))}


def _received_fds(ancillary) -> list[int]:
    fds = array.array("i")
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
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
        with open(f"/proc/self/fdinfo/{pidfd}") as f:
            for line in f:
                if line.startswith("NSpid:"):
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


def _template_pid(bwrap_pid: int) -> tuple[int, int]:
    """(pidfd, host pid) of the template process, found below our own bwrap.

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
    raise TemplateUnavailable(f"could not find the template process below its bwrap (pid {bwrap_pid})")


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
