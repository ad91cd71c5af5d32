"""The worker's event loop: one epoll over every fd, the client's connection, an env's fds, the byte budget.

    client socket --frames--> _read_client --> client_inbox --> server.Worker.serve
    env channel   --readable--> the callback lifecycle.py registered (watch_channel): its frames
    env log pipe, pidfds, the template's control socket --> their callbacks (watch)
    write / flush: frames to an env's channel (its write end, wchan), buffered when it is full

A Reactor is one object, handed to the parts that use it (lifecycle.py,
requests.py, stepping.py, the spawners through spawn.SpawnContext): it
knows fds and callbacks, never what a lane's frames mean. Budget counts
the bytes the pool holds for replies not yet returned (limits.max_pool_bytes).

The client's socket stays in the epoll set during every wait, so a client
that dies tears the pool down even in the middle of a step. A timerfd in the
set ticks once a second; a tick during a call that has run HEARTBEAT_AFTER
seconds sends the client a HEARTBEAT (beat): the client's deadline for the
call moves on while the loop runs, and only then. It costs a step nothing (no
clock read, no system call: most steps see no tick). The shape of a
valid reply (check_reply) and the bounded repr of what an env sent
(describe) live here for every part that reads frames.
"""

from __future__ import annotations

import ctypes
import os
import reprlib
import select
import socket
import time
from typing import Any
from collections.abc import Callable

from boltzlabs import abi, wire
from boltzlabs.errors import PROTOCOL, ClientGone, ProtocolError
from boltzlabs.worker.lanes import Lane

# Seconds a call runs before the worker's first HEARTBEAT to the client, and between two (wire.md#heartbeats).
HEARTBEAT_AFTER = 1.0
OBJECT_COST = 64  # bytes a decoded object is charged to the pool's budget (an empty list is 56, a dict 64+)
READ_SIZE = 1 << 16


class Budget:
    """The bytes the pool holds for replies not yet returned (limits.max_pool_bytes).

    Every byte a lane sends, and ~OBJECT_COST per object it decodes to, is
    charged to the lane (`Lane.held`) and to this sum until the reply leaves
    in a REPLY or the lane dies. Over `limit`, the lane charged is killed
    (by its caller) before what it sent is decoded."""

    def __init__(self, limit: int):
        self.limit: int = limit  # limits.max_pool_bytes of sandbox/policy.toml
        self.held: int = 0  # the sum of every lane's `held`: at most `limit` after a charge that succeeds

    def charge(self, lane: Lane, amount: int) -> bool:
        """Count `amount` against env and the pool; whether the pool is still within its limit."""
        lane.held += amount
        self.held += amount
        return self.held <= self.limit

    def over(self, lane: Lane) -> str:
        """Why env is killed for going over."""
        return (
            f"killed: the pool would hold more than limits.max_pool_bytes={self.limit} bytes of "
            f"replies not yet returned (this env's: {lane.held}, decoded objects counted at {OBJECT_COST} "
            "bytes each); send less per step, or raise the limit in sandbox/policy.toml"
        )

    def unhold(self, lane: Lane) -> None:
        """The pool no longer holds what env sent (but a partial frame it buffers)."""
        keep = lane.reader.pending
        self.held -= lane.held - keep
        lane.held = keep

    def release(self, lane: Lane) -> None:
        """Nothing of env's is held any more (it died)."""
        self.held -= lane.held
        lane.held = 0

    def add(self, amount: int) -> None:
        """Bytes held outside any lane's count (the native step's replies, until its REPLY)."""
        self.held += amount

    def free(self, amount: int) -> None:
        """Bytes that left with a REPLY (their lanes' counts already cleared by the caller)."""
        self.held -= amount

    def room(self) -> int:
        """How many more bytes the pool may hold."""
        return self.limit - self.held


# What the epoll table says of an fd: its kind and the callback for it.
CHAN, WCHAN, CALL, CLIENT = "chan", "wchan", "call", "client"


def ticker(interval: float) -> int:
    """A timerfd (non-blocking, close-on-exec) that turns readable every `interval` seconds."""
    fd = abi.libc.timerfd_create(abi.CLOCK_MONOTONIC, abi.TFD_NONBLOCK | abi.TFD_CLOEXEC)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"timerfd_create: {os.strerror(err)}")
    seconds, fraction = divmod(interval, 1.0)
    every = (int(seconds), int(fraction * 1e9))
    spec = (ctypes.c_long * 4)(*every, *every)  # struct itimerspec: it_interval, then it_value
    try:
        abi.check(abi.libc.timerfd_settime(fd, 0, spec, None), "timerfd_settime")
    except OSError:
        os.close(fd)
        raise
    return fd


class Reactor:
    """The epoll set, the table of who serves each fd, and the client's connection.

    An env's channel (CHAN) is read by the callback its owner registered
    (lifecycle.Lifecycle._read_channel) and flushed here when EPOLLOUT says
    it can take the rest of a frame; a pipe channel's write end (WCHAN) is in
    the set only while a frame waits; every other fd (CALL: a log pipe,
    a pidfd, the template's control socket) has a callback of its own."""

    def __init__(self, conn: socket.socket, remote: dict | None):
        self.conn: socket.socket = conn  # the client's socket (one frame per call each way)
        max_frame = remote["max_frame"] if remote else 1 << 30
        # A remote client is as hostile as an env: its frames make a bounded
        # number of objects (~64 bytes each) nested a bounded depth. A local
        # client is the trainer itself, and its big batches stay hook-free.
        guard: dict[str, Any] = (
            dict(max_depth=wire.MAX_DEPTH, max_objects=max(1 << 20, max_frame // 32)) if remote else {}
        )
        # The client's frames: decoded as they come, whatever call is running.
        self.client_reader: wire.FrameReader = wire.FrameReader(
            wire.Limits(max_frame, max_array_len=1 << 24, max_map_len=1 << 20, arrays="pass", **guard)
        )
        self.client_inbox: list = []  # the client's messages not yet served (server.Worker._next_request)
        self.epoll: select.epoll = select.epoll()  # every fd the worker waits on
        # fd -> (kind, callback, argument): what poll() does when fd is ready.
        self.handlers: dict[int, tuple[str, Callable[[Any], None], Any]] = {}
        self.epoll.register(conn.fileno(), select.EPOLLIN)
        self.handlers[conn.fileno()] = (CLIENT, self._read_client_ready, None)
        # The call being served (server.Worker.serve; OPEN is 0), -1 between calls; when it began
        # and when its last HEARTBEAT went (time.perf_counter()).
        self.calling: int = -1
        self.call_started: float = 0.0
        self.beaten: float = 0.0
        self.ticks: int = ticker(HEARTBEAT_AFTER)  # readable once a second: beat() from the loop
        self.watch(self.ticks, self._tick, None)

    def poll(self, timeout: float | None) -> None:
        """One round of epoll: every ready fd served by its handler (None: wait until one is)."""
        handlers = self.handlers
        for fd, events in self.epoll.poll(timeout):
            kind, callback, arg = handlers.get(fd, _NOBODY)
            if kind is CHAN:
                if events & select.EPOLLOUT:
                    self.flush(arg)
                if events & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR):
                    callback(arg)
            elif callback is not None:
                callback(arg)

    def watch(self, fd: int, callback: Callable[[Any], None], arg: Any) -> None:
        """Call `callback(arg)` whenever fd is readable (a log pipe, the spawners' fds)."""
        self.epoll.register(fd, select.EPOLLIN)
        self.handlers[fd] = (CALL, callback, arg)

    def watch_channel(self, lane: Lane, callback: Callable[[Lane], None]) -> None:
        """Call `callback(env)` whenever env's channel is readable (or at its end)."""
        self.epoll.register(lane.chan, select.EPOLLIN)
        self.handlers[lane.chan] = (CHAN, callback, lane)

    def unwatch(self, fd: int) -> None:
        """Stop watching fd (before it is closed: the number may be reused at once)."""
        self.handlers.pop(fd, None)
        try:
            self.epoll.unregister(fd)
        except (OSError, ValueError):
            pass

    # -- the client -------------------------------------------------------------------

    def begin_call(self, seq: int, started: float) -> None:
        """Call `seq` (started at time.perf_counter() `started`) is being served: heartbeats may go."""
        self.calling = seq
        self.call_started = self.beaten = started

    def end_call(self) -> None:
        """The call is answered (before its REPLY goes): no heartbeat until the next."""
        self.calling = -1

    def beat(self) -> None:
        """A HEARTBEAT to the client when the call being served has run HEARTBEAT_AFTER seconds
        since it began or since the last one. The loop's ticks call it; so do waits outside
        the loop (the template's start, its warm-up probe, long kill loops)."""
        if self.calling < 0:
            return
        now = time.perf_counter()
        if now - self.beaten >= HEARTBEAT_AFTER:
            self.beaten = now
            self.send([wire.HEARTBEAT, self.calling, round(now - self.call_started, 3)])

    def _tick(self, _: None) -> None:
        try:
            os.read(self.ticks, 8)  # how many ticks passed: one beat says enough
        except BlockingIOError:
            return
        self.beat()

    def _read_client_ready(self, _: None) -> None:
        self._read_client()

    def _read_client(self) -> None:
        try:
            data = self.conn.recv(READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            raise ClientGone
        try:
            messages = self.client_reader.feed(data)
        except ProtocolError as exc:
            # The stream's frame boundaries are lost: say why, then end the pool.
            try:
                self.send([wire.ERROR, 0, PROTOCOL, f"the client sent a bad frame: {exc}", {}])
            except OSError:
                pass
            raise ClientGone from None
        if any(m[0] == wire.CLOSE for m in messages):
            raise ClientGone  # close wins, even in the middle of a step
        self.client_inbox.extend(messages)

    def send(self, message) -> None:
        """One frame to the client."""
        self.conn.sendall(wire.encode(message))

    # -- an env's fds -------------------------------------------------------------------

    def write(self, lane: Lane, data: bytes) -> None:
        """A frame to env's channel; what it cannot take now waits in lane.out."""
        if lane.out:
            lane.out += data
            return
        try:
            sent = os.write(lane.wchan, data)
        except BlockingIOError:
            sent = 0
        except OSError:
            # EPIPE (the worker ignores SIGPIPE, as Python does): the env closed
            # its end or exited; EBADF: closed already. The channel is gone, as
            # at EOF; the pidfd or the deadline says what became of the env.
            self.close_channel(lane)
            return
        if sent < len(data):
            lane.out = data[sent:]
            self.watch_out(lane, True)

    def flush(self, lane: Lane) -> None:
        try:
            sent = os.write(lane.wchan, lane.out)
        except BlockingIOError:
            return
        except OSError:
            self.close_channel(lane)
            return
        lane.out = lane.out[sent:]
        if not lane.out:
            self.watch_out(lane, False)

    def watch_out(self, lane: Lane, on: bool) -> None:
        """Wake the loop when env's channel can take more (EPOLLOUT) while
        lane.out holds a frame's rest, and only then: a pipe's write end is
        always writable while the env reads, so it is in the epoll set only
        with something to write. A socket is one fd: its EPOLLIN stays."""
        if lane.wchan == lane.chan:
            self.epoll.modify(lane.chan, select.EPOLLIN | select.EPOLLOUT if on else select.EPOLLIN)
        elif on:
            self.epoll.register(lane.wchan, select.EPOLLOUT)
            self.handlers[lane.wchan] = (WCHAN, self.flush, lane)
        else:
            self.unwatch(lane.wchan)

    def close_channel(self, lane: Lane) -> None:
        """Close both ends the worker holds (one fd for a socket, two for pipes)."""
        if lane.wchan >= 0 and lane.wchan != lane.chan:
            self.unwatch(lane.wchan)
            os.close(lane.wchan)
        lane.wchan = -1
        if lane.chan >= 0:
            self.unwatch(lane.chan)
            os.close(lane.chan)
            lane.chan = -1
        lane.out = b""

    def close_log(self, lane: Lane) -> None:
        if lane.logfd >= 0:
            self.unwatch(lane.logfd)
            os.close(lane.logfd)
            lane.logfd = -1


_NOBODY: tuple[str, Any, Any] = ("", None, None)


def read_fd(fd: int) -> bytes | None:
    """What a non-blocking fd has: bytes, b"" at its end (or an error), None for nothing yet."""
    try:
        return os.read(fd, READ_SIZE)
    except BlockingIOError:
        return None
    except OSError:
        return b""


def check_reply(message: list):
    """The reply if it has a valid shape, else None. Hostile envs send anything."""
    code = message[0]
    if code == wire.STEPPED:
        if (
            len(message) == 7
            and type(message[3]) in (float, int)
            and type(message[4]) is bool
            and type(message[5]) is bool
            and type(message[6]) is dict
        ):
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


def describe(message) -> str:
    """A short repr of what an env sent: bounded in depth and width (reprlib
    stops at maxlevel), so a hostile value cannot make it recurse or grow."""
    text = _REPR.repr(message)
    return text if len(text) <= 80 else text[:77] + "..."


_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxlist = _REPR.maxdict = _REPR.maxtuple = 6
_REPR.maxstring = _REPR.maxother = 40
