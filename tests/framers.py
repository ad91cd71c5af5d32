"""The two ways a worker reads an env's bytes, for tests that must hold on both.

`make_reader("pure", limits)` is wire.FrameReader: the event loop's os.read
chunks fed straight in. `make_reader("native", limits)` sends each chunk
through a real AF_UNIX socketpair and reads it back with
boltzlabs.worker._fastpath.step() on a real epoll set, as the worker's native
step path does (one lane: step() writes its request, reads the env side's
bytes as the reply), then feeds what step() read into a FrameReader. On the
way it checks each read step() vouched for against Python: the same bytes,
decoded alone, must be the reply due and reach the client as the same values.

`Lanes` is the socket harness both use: n socketpairs in one epoll set,
driven by step().
"""

from __future__ import annotations

import math
import select
import socket
import struct
import time

import msgpack
import numpy as np
import pytest

from boltzlabs.errors import ProtocolError
from boltzlabs import wire
from boltzlabs.worker import native
from boltzlabs.worker.reactor import check_reply

try:  # the C module itself, whichever path pools run (BOLTZLABS_PURE only steers the worker)
    from boltzlabs.worker import _fastpath as fp
except ImportError:
    fp = None

FASTPATH, _ = native.load()  # what the worker runs: None under BOLTZLABS_PURE=1
PATHS = [
    "pure",
    pytest.param(
        "native", marks=pytest.mark.skipif(FASTPATH is None, reason="boltzlabs.worker._fastpath is not built")
    ),
]

# The worker's env limits with sandbox/policy.toml's defaults (config.parse_open).
ENV = wire.Limits(16 << 20, 4 << 20, 16 << 20, 1 << 20, 1 << 18, arrays="check", max_depth=512, max_objects=1 << 19)
WORKER_PACK = msgpack.Packer(use_bin_type=True)  # the worker's packer of requests to envs
SEQ = 77


def use_path(request, monkeypatch) -> str:
    """For a fixture parametrized over PATHS: pools made in the test run the
    worker's step path request.param (BOLTZLABS_PURE=1 for "pure")."""
    if request.param == "pure":
        monkeypatch.setenv("BOLTZLABS_PURE", "1")
    else:
        monkeypatch.delenv("BOLTZLABS_PURE", raising=False)
    return request.param


def pools_on_path(source, pool_factory, path):
    """`make(n=2, **kwargs)`: a pool of `source` (pool_factory's) that steps through the worker's
    step path `path` (use_path), which it checks."""

    def make(n=2, **kwargs):
        pool = pool_factory(source, n, **kwargs)
        assert pool.fast_path == (path == "native")
        return pool

    return make


def same(a, b) -> bool:
    """Equal and of the same types all the way down (dict key order included)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if type(a) is float:
        return struct.pack("<d", a) == struct.pack("<d", b) or (math.isnan(a) and math.isnan(b))
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if type(a) is dict:
        return len(a) == len(b) and all(same(x, y) and same(a[x], b[y]) for x, y in zip(a, b))
    return a == b


def caps_of(limits: wire.Limits) -> tuple:
    """step()'s caps for `limits`. An unguarded Limits (no object cap: the
    tests' plain ones) gets wire.MAX_DEPTH and no object cap: walk() is then
    at least as strict as Python's decode under those limits."""
    if limits.max_objects is not None:
        return native.caps(limits)
    kw = limits.kwargs
    return (
        limits.max_frame,
        kw["max_str_len"],
        kw["max_bin_len"],
        kw["max_array_len"],
        kw["max_map_len"],
        kw["max_ext_len"],
        wire.MAX_DEPTH,
        2**64 - 1,
    )


def request(action, seq: int, reset: bool) -> bytes:
    """The frame step() writes to a lane, as wire.encode frames it."""
    body = WORKER_PACK.pack([wire.RESET, seq, None, None] if reset else [wire.STEP, seq, action, False])
    return wire.HEADER.pack(len(body)) + body


class Lanes:
    """n socketpairs: `ours[i]` (non-blocking, in an epoll set) as the
    worker's channel, `theirs[i]` (`env(i)`) as the env's end."""

    def __init__(self, n: int):
        self.epoll = select.epoll()
        self.pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(n)]
        for ours, _ in self.pairs:
            ours.setblocking(False)
            self.epoll.register(ours.fileno(), select.EPOLLIN)

    @property
    def fds(self) -> list:
        return [ours.fileno() for ours, _ in self.pairs]

    def env(self, i: int) -> socket.socket:
        return self.pairs[i][1]

    def step(
        self, actions=None, seq=SEQ, resets=None, timeout=2.0, budget=1 << 30, limits=ENV, fds=None, ordered=False
    ):
        """_fastpath.step() over these lanes (`fds`: each lane's fd, -1 for a
        lane not in the call): actions default to 0, resets to none; `ordered`: the
        lent step's wait, lane by lane."""
        n = len(self.pairs)
        fds = self.fds if fds is None else fds
        return fp.step(
            self.epoll.fileno(),
            fds,
            fds,
            WORKER_PACK.pack([0] * n if actions is None else actions),
            seq,
            bytes(resets or bytes(n)),
            time.monotonic() + timeout,
            caps_of(limits),
            budget,
            ordered,
        )

    def close(self):
        self.epoll.close()
        for a, b in self.pairs:
            a.close()
            b.close()


class NativeReader:
    """FrameReader's interface over a socketpair read by _fastpath.step()."""

    def __init__(self, limits: wire.Limits):
        self.limits = limits
        self.vouched = 0  # reads step() vouched for: the tests of this file can ask for some
        self._reader = wire.FrameReader(limits)
        self._lanes = Lanes(1)
        self._env = self._lanes.env(0)
        self._env.setblocking(False)

    @property
    def pending(self) -> int:
        return self._reader.pending

    def _due(self, data: bytes) -> tuple:
        """(seq, reset) of the reply the lane waits for when `data` is read:
        those of `data`'s message when it is one whole frame Python decodes,
        so a valid reply among the fuzzed bytes is the reply due and walk()
        must judge it; else (0, False)."""
        if self._reader.pending:
            return 0, False  # the worker runs the pure path for a lane holding part of a frame
        reader = wire.FrameReader(self.limits)
        try:
            messages = reader.feed(data)
        except ProtocolError:
            return 0, False
        if len(messages) != 1 or reader.pending or len(messages[0]) < 2:
            return 0, False
        seq = messages[0][1]
        if type(seq) is not int or not 0 <= seq < 2**64:
            return 0, False
        return seq, messages[0][0] == wire.RESET_DONE

    def _check_vouched(self, batch, data: bytes, seq: int, reset: bool) -> None:
        """step() vouched for `data` as the reply due: Python, decoding it
        alone, must agree, and the REPLY must hold the values it decodes."""
        reader = wire.FrameReader(self.limits)
        try:
            messages = reader.feed(data)
        except ProtocolError as exc:
            raise AssertionError(f"step() vouched for a read Python refuses ({exc}): {data[:200]!r}") from exc
        assert len(messages) == 1 and not reader.pending, data[:200]
        message = messages[0]
        assert check_reply(message) is not None and message[1] == seq, message
        assert message[0] == (wire.RESET_DONE if reset else wire.STEPPED), message
        obs, rewards, terminated, truncated, infos, stragglers = msgpack.unpackb(
            batch.compose({}, wire.pack([])), **self.limits.kwargs
        )
        assert stragglers == [] and same(obs[0], message[2])
        if reset:
            assert same(infos[0], message[3]) and (rewards, terminated, truncated) == (bytes(8), b"\0", b"\0")
        else:
            assert same(struct.unpack("<d", rewards)[0], float(message[3]))
            assert (terminated, truncated) == (bytes([message[4]]), bytes([message[5]]))
            assert same(infos[0], message[6])

    def feed(self, data) -> list:
        data = bytes(data)
        if not data:
            return self._reader.feed(data)
        seq, reset = self._due(data)
        sent = got = 0
        pieces = []  # what step() read, call after call
        while got < len(data):
            if sent < len(data):  # a chunk over the socket's buffer goes in as step() reads it
                try:
                    sent += self._env.send(data[sent:])
                except BlockingIOError:
                    pass
            # What step() will do with the bytes in the socket: a first read whose
            # prefix announces a longer frame (within the caps) is completed in C,
            # or, when the rest is not there, handed back as read at the deadline.
            first = data[got:sent][: fp.READ_SIZE]
            want = 4 + struct.unpack("<I", first[:4])[0] if len(first) >= 4 else 0
            long_frame = want > len(first) and want - 4 <= self.limits.max_frame
            cut = long_frame and got + want > sent
            batch = self._lanes.step(
                [0], seq=seq, resets=bytes([reset]), timeout=0.02 if cut else 5.0, budget=1 << 40, limits=self.limits
            )
            want_request = request(0, seq, reset)
            assert self._env.recv(len(want_request) + 1) == want_request  # the lane's request, written whole
            assert batch.why == (fp.TIMEOUT if cut else fp.DONE), batch.why
            if cut and batch.rest == [(0, fp.PENDING, None)]:
                # The 20 ms deadline passed before step() first looked (this process was not run
                # for that long: CI runs its stages side by side): nothing was read. Again.
                continue
            if batch.done:
                # Vouched: step() read batch.held bytes, which its REPLY holds undecoded.
                piece = data[got : got + batch.held]
                self._check_vouched(batch, piece, seq, reset)
                self.vouched += 1
            else:
                ((lane, kind, piece),) = batch.rest
                assert lane == 0 and kind == fp.UNUSUAL and 0 < len(piece), (lane, kind)
                if long_frame:  # read whole (a frame walk() refused) or as far as it came (cut)
                    assert len(piece) == (sent - got if cut else want), (len(piece), want)
                else:
                    assert len(piece) <= fp.READ_SIZE, len(piece)
            pieces.append(piece)
            got += len(piece)
            seq, reset = 0, False  # the rest of a chunk that took several calls: no reply is whole
        read = b"".join(pieces)
        assert read == data  # nothing lost, nothing added, in order
        return self._reader.feed(read)

    def close(self) -> None:
        self._lanes.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def make_reader(path: str, limits: wire.Limits):
    """A reader of one peer's stream on `path` ("pure" or "native")."""
    return wire.FrameReader(limits) if path == "pure" else NativeReader(limits)
