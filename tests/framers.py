"""The two ways a worker reads an env's bytes, for tests that must hold on both.

`make_reader("pure", limits)` is wire.FrameReader: the event loop's os.read
chunks fed straight in. `make_reader("native", limits)` sends each chunk
through a real AF_UNIX socketpair and reads it back with
boltzlabs.worker._fastpath.exchange() on a real epoll set, as the worker's native
step path does, then feeds what exchange returned into a FrameReader; on
the way it checks the C framer's verdict against the Python framer's.
"""

from __future__ import annotations

import select
import socket
import time

import pytest

from boltzlabs import wire
from boltzlabs.worker import native

FASTPATH, _ = native.load()
PATHS = ["pure", pytest.param("native", marks=pytest.mark.skipif(FASTPATH is None,
                                                                  reason="boltzlabs.worker._fastpath is not built"))]


def use_path(request, monkeypatch) -> str:
    """For a fixture parametrized over PATHS: pools made in the test run the
    worker's step path request.param (BOLTZLABS_PURE=1 for "pure")."""
    if request.param == "pure":
        monkeypatch.setenv("BOLTZLABS_PURE", "1")
    else:
        monkeypatch.delenv("BOLTZLABS_PURE", raising=False)
    return request.param


class NativeReader:
    """FrameReader's interface over a socketpair read by _fastpath.exchange()."""

    def __init__(self, limits: wire.Limits):
        self.limits = limits
        self._reader = wire.FrameReader(limits)
        self._ours, self._theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._ours.setblocking(False)
        self._epoll = select.epoll()
        self._epoll.register(self._ours.fileno(), select.EPOLLIN)

    @property
    def pending(self) -> int:
        return self._reader.pending

    def feed(self, data) -> list:
        data = bytes(data)
        if not data:
            return self._reader.feed(data)
        self._theirs.sendall(data)
        got = b""
        while len(got) < len(data):
            fd = self._ours.fileno()
            why, (result,) = FASTPATH.exchange(self._epoll.fileno(), [fd], [fd], [None],
                                               time.monotonic() + 5.0, self.limits.max_frame, 1 << 40)
            assert why == FASTPATH.DONE, why
            if type(result) is bytes:
                chunk = result
                # The C framer said "exactly one frame, message-shaped": so
                # must the Python one, when it starts from an empty buffer.
                assert FASTPATH.frame_kind(chunk, self.limits.max_frame) == FASTPATH.FRAME_ONE
                assert len(chunk) >= 6 and int.from_bytes(chunk[:4], "little") == len(chunk) - 4
                assert int.from_bytes(chunk[:4], "little") <= self.limits.max_frame
            else:
                kind, chunk = result
                assert kind == FASTPATH.UNUSUAL, result
            got += chunk
        assert got == data  # nothing lost, nothing added, in order
        return self._reader.feed(got)

    def close(self) -> None:
        self._epoll.close()
        self._ours.close()
        self._theirs.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


def make_reader(path: str, limits: wire.Limits):
    """A reader of one peer's stream on `path` ("pure" or "native")."""
    return wire.FrameReader(limits) if path == "pure" else NativeReader(limits)
