"""How the worker makes sandboxes: one interpreter per env, or forks of a template.

    Worker --spawn(env)--> ExecSpawner:     posix_spawn(bwrap ... python env.py), per env
                       \-> TemplateSpawner: [FORK] to one warm template (boltzlabs.template)
    Worker <--on_exit(env, status)-- either, when an env's process is gone

Both hand the env its channel (a socketpair end, as fd 3) and its log pipe
(fds 1 and 2), start it inside its own cgroup, and report its exit status.
The worker owns everything else (the channel protocol, deadlines, state).
"""

from __future__ import annotations

import array
import contextlib
import os
import select
import signal
import socket
import struct
import time

from boltzlabs import seccomp, template, wire
from boltzlabs.errors import BoltzLabsError

CHANNEL_FD = 3  # where an env (and the template) finds its channel
TEMPLATE_LANE = "template"  # the template's cgroup name


class TemplateUnavailable(BoltzLabsError):
    """The env cannot be forked from a template; the message says why."""


def _open_channel(start, kind=socket.SOCK_STREAM, passcred=False):
    """Make a sandbox's channel and log pipe, and run `start(channel_fd, log_w)`
    with the sandbox's ends. Returns ours: (socket, log pipe read end).

    The sandbox's ends are closed once `start` returns; ours too if it raises.
    `passcred`: receive the sender's host pid with each message (SO_PASSCRED).
    """
    parent, child = socket.socketpair(socket.AF_UNIX, kind)
    log_r, log_w = os.pipe()
    try:
        if passcred:
            parent.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        start(child.fileno(), log_w)
    except BaseException:
        parent.close()
        os.close(log_r)
        raise
    finally:
        child.close()
        os.close(log_w)
    return parent, log_r


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


def _posix_spawn(argv, channel_fd: int, log_w: int, programs: dict) -> int:
    """Start bwrap with the channel on fd 3, the log pipe on 1 and 2, and each
    seccomp program of `programs` ({fd number: BPF bytes}) on its fd."""
    with contextlib.ExitStack() as stack:
        actions = [
            (os.POSIX_SPAWN_DUP2, channel_fd, CHANNEL_FD),
            (os.POSIX_SPAWN_DUP2, log_w, 1),
            (os.POSIX_SPAWN_DUP2, log_w, 2),
            (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
        ] + [(os.POSIX_SPAWN_DUP2, stack.enter_context(seccomp.program_fd(program)), target)
             for target, program in programs.items()]
        pid = os.posix_spawn(argv[0], argv, {}, file_actions=actions)
        SPAWNED.add(pid)
        return pid


class ExecSpawner:
    """spawn="exec": each env is its own bubblewrap sandbox and interpreter."""

    kind = "exec"
    wants_credentials = False

    def __init__(self, worker):
        self.worker = worker
        self.pidfds: dict[int, int] = {}  # lane -> pidfd of its bwrap
        self.reaping: dict[int, int] = {}  # pidfd -> pid of a killed bwrap not yet reaped

    def spawn(self, env) -> None:
        worker = self.worker
        argv = worker.spec.argv(CHANNEL_FD, env.index)

        def start(channel_fd: int, log_w: int) -> None:
            with _charged_to(worker, env.index):
                env.pid = _posix_spawn(argv, channel_fd, log_w, worker.spec.programs())

        parent, env.logfd = _open_channel(start)
        env.chan = parent.detach()
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
        try:
            os.kill(env.pid, signal.SIGKILL)  # bwrap; --die-with-parent takes the rest
        except ProcessLookupError:
            pass
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
            if select.select([pidfd], [], [], remaining)[0]:
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
    wants_credentials = True

    def __init__(self, worker):
        self.worker = worker
        # The template ran env.py's import-time code: its control frames are
        # small, flat messages, and anything else is refused as malformed.
        self.reader = wire.FrameReader(wire.Limits(1 << 16, max_depth=4, max_objects=256))
        self.pending: list = []
        self.lanes: dict[tuple, object] = {}  # (lane, generation) -> env
        self.control = None
        self.bwrap_pid = -1
        self.log = bytearray()
        self.kills: bytearray | None = None  # KILL frames held by batching_kills()
        self._start()

    def _start(self) -> None:
        worker = self.worker
        # Room for a pipe per child being made, beyond the env's file limit.
        argv = worker.spec.template_argv(CHANNEL_FD, open_files=len(worker.envs) + 64)

        def start(channel_fd: int, log_w: int) -> None:
            filters = worker.spec.filters
            with _charged_to(worker, TEMPLATE_LANE):
                self.bwrap_pid = _posix_spawn(argv, channel_fd, log_w, {
                    seccomp.FILTER_FD: filters.template, seccomp.CHILD_FILTER_FD: filters.env})

        parent, log_r = _open_channel(start, socket.SOCK_SEQPACKET, passcred=True)
        os.set_blocking(log_r, False)
        # Sends to the template never block for long: a template that stops
        # reading is treated as dead, not waited for.
        parent.settimeout(10.0)
        self.control = parent
        self.logfd = log_r
        self.pidfd = os.pidfd_open(self.bwrap_pid)
        try:
            hello, self.pid = self._handshake(time.monotonic() + worker.start_timeout)
        except BaseException:
            self.close(time.monotonic() + 5)
            raise
        if not hello.get("forkable"):
            self.close(time.monotonic() + 5)
            raise TemplateUnavailable(hello.get("reason") or "the template refused to fork")
        worker.watch(self.control.fileno(), self._on_control, None)
        worker.watch(self.logfd, self._on_log, None)

    def _handshake(self, deadline: float):
        """Wait for the template's HELLO; returns (info, host pid of the template)."""
        while True:
            remaining = deadline - time.monotonic()
            ready = select.select([self.control, self.pidfd], [], [], max(0.0, remaining))[0]
            if self.control in ready:
                data, ancillary, _, _ = self.control.recvmsg(1 << 16, socket.CMSG_SPACE(12))
                pid = _sender_pid(ancillary)
                try:
                    messages = self.reader.feed(data) if data else []
                except wire.ProtocolError:
                    messages = []
                if messages and messages[0][0] == wire.HELLO and len(messages[0]) == 3 \
                        and isinstance(messages[0][2], dict) and pid:
                    return messages[0][2], pid
                select.select([self.pidfd], [], [], max(0.0, deadline - time.monotonic()))
                ready = [self.pidfd]  # EOF or anything but a HELLO: it is done for
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
        frame = wire.encode([template.FORK, env.index, env.generation])

        def start(channel_fd: int, log_w: int) -> None:
            fds = array.array("i", [channel_fd, log_w]).tobytes()
            with _charged_to(worker, env.index, self.pid, TEMPLATE_LANE):
                self.control.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
                self._wait_forked(env)

        try:
            parent, env.logfd = _open_channel(start, passcred=True)
        except OSError:
            self._lost()
            raise
        self.lanes[(env.index, env.generation)] = env
        env.pid = -1  # known at its HELLO (SO_PASSCRED gives the host pid)
        env.chan = parent.detach()

    def _wait_forked(self, env) -> None:
        deadline = time.monotonic() + self.worker.start_timeout
        while True:
            for message in self.pending:
                if message[0] == template.FORKED and message[1:] == [env.index, env.generation]:
                    self.pending.remove(message)
                    return
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self.control], [], [], remaining)[0]:
                raise OSError("the template did not answer a fork request in time")
            if not self._read_control():
                raise OSError("the template is gone")

    def _read_control(self) -> bool:
        try:
            data = self.control.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            data = b""
        if not data:
            return False
        try:
            self.pending.extend(self.reader.feed(data))
        except wire.ProtocolError:
            return False
        return True

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
                env = self.lanes.pop((message[1], message[2]), None)
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
        if self.lanes.pop((env.index, env.generation), None) is None or self.control is None:
            return
        if env.pid > 0:
            try:
                os.kill(env.pid, signal.SIGKILL)  # pid 1 of its namespace: the whole tree goes
            except ProcessLookupError:
                pass
        # And through the template, which knows the child's pid 1 for sure (the
        # HELLO could have come from another process of the env, or not at all).
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
        try:
            os.kill(self.bwrap_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        select.select([self.pidfd], [], [], max(0.0, deadline - time.monotonic()))
        try:
            if os.waitpid(self.bwrap_pid, os.WNOHANG)[0]:
                _reaped(self.bwrap_pid)
        except ChildProcessError:
            pass
        os.close(self.pidfd)
        os.close(self.logfd)


def _sender_pid(ancillary) -> int:
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(payload) >= 12:
            return struct.unpack("3i", payload[:12])[0]
    return 0


def receive_hello(fd: int):
    """Read from an env's channel with its sender's host pid (SO_PASSCRED)."""
    sock = socket.socket(fileno=fd)
    try:
        data, ancillary, _, _ = sock.recvmsg(1 << 16, socket.CMSG_SPACE(12))
    finally:
        sock.detach()
    return data, _sender_pid(ancillary)


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
