"""The worker's event loop: one epoll over every fd, frames in and out, the byte budget.

    client socket --frames--> _read_client --> client_inbox --> server.Worker.serve
    env channel   --bytes---> _read_channel --FrameReader(limits)--> _on_message --lane.on("reply")-->
                                                the sync request's Op (requests.py) or recv's queue (stepping.py)
    env log pipe  --bytes---> _read_log (a bounded tail)
    pidfds, the template's control socket --> the spawners' callbacks (spawn.py, via watch())
    _write / _flush: frames to an env's channel (its write end, wchan), buffered when it is full

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
until it comes (State.due, lanes.py). A straggler (past its deadline) still
owes it, so its one late reply is legitimate: it frees the lane and is
dropped, as the README says. Every other frame is a protocol violation that
kills the lane at once, before anything else it sent is decoded: a frame when
no reply is due (a second reply, anything after a dropped late one, anything
from an idle env), a frame with any other sequence number (older or newer),
and a reply of the wrong kind or shape. So an env cannot make the worker
decode frames it then ignores.

The client's socket stays in the epoll set during every wait, so a client
that dies tears the pool down even in the middle of a step. Stragglers past
their grace are killed from here (`overdue`), whatever call is running.

A mixin of server.Worker: lifecycle.py kills and releases lanes, stepping.py
holds async results (`_finish`), requests.py owns `op`.
"""

from __future__ import annotations

import collections
import os
import reprlib
import select
import time

import msgpack

from boltzlabs import wire
from boltzlabs.errors import PROTOCOL, ClientGone, ProtocolError
from boltzlabs.worker.lanes import BUSY, IN_FLIGHT, STARTING, Lane
from boltzlabs.worker.stepping import outcome

OBJECT_COST = 64  # bytes a decoded object is charged to the pool's budget (an empty list is 56, a dict 64+)
READ_SIZE = 1 << 16


class Reactor:
    """The epoll loop and the fds it serves (a mixin of server.Worker)."""

    def _init_reactor(self, conn, remote: dict | None) -> None:
        self.conn = conn
        max_frame = remote["max_frame"] if remote else 1 << 30
        # A remote client is as hostile as an env: its frames make a bounded
        # number of objects (~64 bytes each) nested a bounded depth. A local
        # client is the trainer itself, and its big batches stay hook-free.
        guard = dict(max_depth=wire.MAX_DEPTH, max_objects=max(1 << 20, max_frame // 32)) if remote else {}
        self.client_reader = wire.FrameReader(wire.Limits(max_frame, max_array_len=1 << 24, max_map_len=1 << 20,
                                                          arrays="pass", **guard))
        self.client_inbox: list = []
        self.epoll = select.epoll()
        self.handlers: dict[int, tuple] = {}
        self.epoll.register(conn.fileno(), select.EPOLLIN)
        self.handlers[conn.fileno()] = ("client", None)
        # (kill time, lane, seq) of stragglers: a lane still owing the reply to
        # request seq at its kill time (deadline + straggler_grace) is killed.
        # Each is "now + grace" when set, so the deque is sorted.
        self.overdue: collections.deque[tuple] = collections.deque()
        self.straggler_grace = float("inf")
        self.held = 0  # the sum of every lane's `held`: bounded by max_pool_bytes
        self.max_pool_bytes = 1 << 30

    # -- the loop ---------------------------------------------------------------------

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
            elif kind == "wchan":  # a pipe channel's write end, watched only while a frame waits
                self._flush(env)
            elif kind == "log":
                self._read_log(env)
            elif kind == "call":
                env[0](env[1])
            elif kind == "client":
                self._read_client()
        if overdue:
            self._kill_overdue()

    def watch(self, fd: int, callback, arg) -> None:
        """Call `callback(arg)` whenever fd is readable (for the spawners)."""
        self.epoll.register(fd, select.EPOLLIN)
        self.handlers[fd] = ("call", (callback, arg))

    def unwatch(self, fd: int) -> None:
        """Stop watching fd (before it is closed: the number may be reused at once)."""
        self._unregister(fd)

    def _unregister(self, fd: int) -> None:
        self.handlers.pop(fd, None)
        try:
            self.epoll.unregister(fd)
        except (OSError, ValueError):
            pass

    def _straggling(self, env: Lane) -> None:
        """env missed its deadline and is still running: it has straggler_grace
        seconds more to answer, then it is killed (its CPU time is bounded)."""
        if env.state is BUSY:  # a sync request's (an async one's is expired by stepping.py)
            env.on("deadline")
        self.overdue.append((time.monotonic() + self.straggler_grace, env.index, env.seq))

    def _kill_overdue(self) -> None:
        now = time.monotonic()
        overdue = self.overdue
        while overdue and overdue[0][0] <= now:
            _, index, seq = overdue.popleft()
            env = self.envs[index]
            if env.state.due and env.seq == seq:
                self._kill(env, f"killed: still running {self.straggler_grace:g} s after missing its deadline "
                                f"of {self.step_timeout:g} s (limits.straggler_grace)")

    # -- the client -------------------------------------------------------------------

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
                self._send([wire.ERROR, 0, PROTOCOL, f"the client sent a bad frame: {exc}", {}])
            except OSError:
                pass
            raise ClientGone from None
        if any(m[0] == wire.CLOSE for m in messages):
            raise ClientGone  # close wins, even in the middle of a step
        self.client_inbox.extend(messages)

    def _send(self, message) -> None:
        self.conn.sendall(wire.encode(message))

    # -- reading an env ---------------------------------------------------------------

    def _read_channel(self, env: Lane) -> None:
        data = _read(env.chan)
        if data is None:
            return
        if not data:
            self._close_channel(env)
            # It has ended (or is ending): a template frozen for a turn must
            # run to reap it and say how it died.
            self._thaw_template()
            return
        self._take(env, data)

    def _take(self, env: Lane, data: bytes) -> None:
        """Bytes read from env's channel (by the event loop, or by the native
        step path, requests._step_native): charged, framed, decoded under the
        limits, and handled."""
        if not self._charge(env, len(data)):
            return
        try:
            messages = env.reader.feed(data)
            limits = env.reader.limits
            if limits.made:
                # What the decoded frames cost beyond their bytes, ~64 bytes
                # per object (a list, a dict entry, a str), is charged too.
                cost = limits.made * OBJECT_COST
                limits.made = 0
                if not self._charge(env, cost):
                    return
        except ProtocolError as exc:
            env.reader.limits.made = 0
            if env.state is STARTING:
                self._kill(env, f"sent an invalid frame as its handshake (HELLO) and was killed: {exc} (its caps are "
                                f"limits.max_hello={self.hello_limits.max_frame} bytes and "
                                f"limits.max_hello_objects={self.hello_limits.max_objects})")
            else:
                self._kill(env, f"sent an invalid frame ({exc}) and was killed")
            return
        for message in messages:
            self._on_message(env, message)
            if env.state.dead:
                return

    def _on_message(self, env: Lane, message: list) -> None:
        code = message[0]
        if env.state is STARTING:
            if code == wire.HELLO and len(message) == 3 and message[1] == wire.PROTOCOL_VERSION:
                problem = self._confinement_problem(env)
                if problem:
                    self._kill(env, f"failed the confinement check (what the kernel says of its process, read "
                                    f"by the worker) and was killed: {problem}")
                    return
                env.on("hello")
                env.reader.limits = self.env_limits
                if env.index == 0 and self.hello is None:  # only lane 0's is ever read: keep no other
                    self.hello = message[2] if isinstance(message[2], dict) else {}
                self._unhold(env)
                if self.slots is not None:  # sized and sealed from lane 0's space (worker/slots.py)
                    self.slots.on_hello(self, env)
                return
            self._kill(env, f"sent {describe(message)} instead of its handshake (protocol {wire.PROTOCOL_VERSION})")
            return
        # Exactly one reply is due per request, carrying its sequence number
        # (module docstring): anything else is killed at the first frame.
        if not env.state.due:
            self._kill(env, f"sent {describe(message)} when no reply was due (a protocol violation) and was killed")
            return
        if len(message) < 2 or message[1] != env.seq:
            self._kill(env, f"sent {describe(message)} with the wrong sequence number while the reply to request "
                            f"{env.seq} was due (a protocol violation) and was killed")
            return
        result = check_reply(message)
        if result is None or result[0] not in (env.expect, wire.FAILED):
            self._kill(env, f"sent a malformed reply {describe(message)}")
            return
        obs = result[2] if result[0] != wire.FAILED else None
        if type(obs) is msgpack.ExtType and obs.code == wire.SLOT_EXT:
            # (wire.decode lets a marker through only as the obs of a step or reset, and only with slots on.)
            if self.slots is None or not self.slots.sealed[env.index]:
                self._kill(env, "sent its obs as a slot marker but has no observation slot (a protocol violation) "
                                "and was killed")
                return
            if obs.data != env.seq.to_bytes(8, "little"):
                self._kill(env, f"sent an observation in its slot for request {int.from_bytes(obs.data, 'little')} "
                                f"while the reply to request {env.seq} was due (a protocol violation) and was killed")
                return
        if env.on("reply") is IN_FLIGHT:  # an async action's result, held for recv
            self._finish(env, outcome(result, env.cause))
            return
        op = self.op
        if op is not None and message[1] == op.seq and env.index in op.waiting:
            op.waiting.discard(env.index)
            op.results[env.index] = result
            return
        self._unhold(env)  # a straggler's one late reply: dropped

    def _read_log(self, env: Lane) -> None:
        data = _read(env.logfd)
        if data is None:
            return
        if not data:
            self._close_log(env)
            return
        log = env.log
        log += data
        if len(log) > self.log_tail:
            del log[:len(log) - self.log_tail]

    def _drain_log(self, env: Lane) -> None:
        for _ in range(64):  # at most 4 MiB: the tail is what matters
            if env.logfd < 0:
                return
            before = len(env.log), env.logfd
            self._read_log(env)
            if (len(env.log), env.logfd) == before:
                return

    def _close_channel(self, env: Lane) -> None:
        """Close both ends the worker holds (one fd for a socket, two for pipes)."""
        if env.wchan >= 0 and env.wchan != env.chan:
            self._unregister(env.wchan)
            os.close(env.wchan)
        env.wchan = -1
        if env.chan >= 0:
            self._unregister(env.chan)
            os.close(env.chan)
            env.chan = -1
        env.out = b""

    def _close_log(self, env: Lane) -> None:
        if env.logfd >= 0:
            self._unregister(env.logfd)
            os.close(env.logfd)
            env.logfd = -1

    # -- the pool's byte budget ---------------------------------------------------------

    def _charge(self, env: Lane, amount: int) -> bool:
        """Count `amount` against env and the pool's budget; over it, env is
        killed (before what it sent is decoded, when that is what is charged)."""
        env.held += amount
        self.held += amount
        if self.held <= self.max_pool_bytes:
            return True
        self._kill(env, self._over_budget(env))
        return False

    def _over_budget(self, env: Lane) -> str:
        return (f"killed: the pool would hold more than limits.max_pool_bytes={self.max_pool_bytes} bytes of "
                f"replies not yet returned (this env's: {env.held}, decoded objects counted at {OBJECT_COST} "
                "bytes each); send less per step, or raise the limit in sandbox/policy.toml")

    def _unhold(self, env: Lane) -> None:
        """The pool no longer holds what env sent (but a partial frame it buffers)."""
        keep = env.reader.pending
        self.held -= env.held - keep
        env.held = keep

    # -- writing to an env --------------------------------------------------------------

    def _write(self, env: Lane, data: bytes) -> None:
        if env.out:
            env.out += data
            return
        try:
            sent = os.write(env.wchan, data)
        except BlockingIOError:
            sent = 0
        except OSError:
            # EPIPE (the worker ignores SIGPIPE, as Python does): the env closed
            # its end or exited; EBADF: closed already. The channel is gone, as
            # at EOF; the pidfd or the deadline says what became of the env.
            self._close_channel(env)
            return
        if sent < len(data):
            env.out = data[sent:]
            self._watch_out(env, True)

    def _flush(self, env: Lane) -> None:
        try:
            sent = os.write(env.wchan, env.out)
        except BlockingIOError:
            return
        except OSError:
            self._close_channel(env)
            return
        env.out = env.out[sent:]
        if not env.out:
            self._watch_out(env, False)

    def _watch_out(self, env: Lane, on: bool) -> None:
        """Wake the loop when env's channel can take more (EPOLLOUT) while
        env.out holds a frame's rest, and only then: a pipe's write end is
        always writable while the env reads, so it is in the epoll set only
        with something to write. A socket is one fd: its EPOLLIN stays."""
        if env.wchan == env.chan:
            self.epoll.modify(env.chan, select.EPOLLIN | select.EPOLLOUT if on else select.EPOLLIN)
        elif on:
            self.epoll.register(env.wchan, select.EPOLLOUT)
            self.handlers[env.wchan] = ("wchan", env)
        else:
            self._unregister(env.wchan)


def _read(fd: int) -> bytes | None:
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


def describe(message) -> str:
    """A short repr of what an env sent: bounded in depth and width (reprlib
    stops at maxlevel), so a hostile value cannot make it recurse or grow."""
    text = _REPR.repr(message)
    return text if len(text) <= 80 else text[:77] + "..."


_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxlist = _REPR.maxdict = _REPR.maxtuple = 6
_REPR.maxstring = _REPR.maxother = 40
