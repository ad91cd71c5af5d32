"""The wire: length-prefixed msgpack frames, shared by every hop.

    client --(one frame per batch)--> worker --(one frame per env)--> env
    client <--(one frame per batch)-- worker <--(one frame per env)-- env

A frame is a 4-byte little-endian body length followed by one msgpack value,
always an array whose first item is a message code (below). The length prefix
lets a reader refuse an oversized frame before it buffers a byte of it.

Everything a peer sends may be hostile: `FrameReader` caps the frame size and
decodes with msgpack's length limits, and a malformed frame raises
`ProtocolError` for its caller to attribute to the peer that sent it.

This module imports only the standard library and msgpack: it runs inside
every env, and what an env imports every env pays for.
"""

from __future__ import annotations

import struct

import msgpack

PROTOCOL_VERSION = 1

HEADER = struct.Struct("<I")

# env -> worker
HELLO = 0  # [HELLO, protocol, info]
STEPPED = 1  # [STEPPED, seq, obs, reward, terminated, truncated, info]
RESET_DONE = 2  # [RESET_DONE, seq, obs, info]
FAILED = 3  # [FAILED, seq, phase, message, traceback]
# worker -> env
STEP = 10  # [STEP, seq, action, gated]
RESET = 11  # [RESET, seq, seed, options]
GO = 12  # [GO, seq]: the serialize_measurement gate is yours
# client <-> worker
OPEN = 20
PROGRESS = 21
READY = 22
BATCH = 23
RESULT = 24
CALL = 25
REPLY = 26
ERROR = 27
CLOSE = 28


class ProtocolError(Exception):
    """A peer sent bytes that are not a valid frame."""


def _default(obj):
    # numpy values are converted only when they appear, so numpy is never
    # imported here: an env that does not use it does not pay for it.
    tolist = getattr(obj, "tolist", None)
    if tolist is not None and type(obj).__module__ == "numpy":
        return tolist()
    if isinstance(obj, int):
        raise TypeError(f"integer {obj} is out of msgpack's 64-bit range")
    raise TypeError(f"cannot serialize object of type {type(obj).__name__}")


_packer = msgpack.Packer(default=_default, use_bin_type=True)


def encode(message) -> bytes:
    """One frame: length prefix and msgpack body. Raises TypeError/ValueError."""
    body = _packer.pack(message)
    return HEADER.pack(len(body)) + body


class Limits:
    """Caps applied to what a peer sends: frame size and msgpack lengths."""

    __slots__ = ("max_frame", "kwargs")

    def __init__(self, max_frame: int, max_str_len: int = None, max_bin_len: int = None,
                 max_array_len: int = None, max_map_len: int = None):
        self.max_frame = int(max_frame)
        cap = self.max_frame

        def clamp(limit):  # None: only the frame cap applies
            return cap if limit is None else min(int(limit), cap)

        self.kwargs = dict(
            raw=False,
            strict_map_key=False,
            max_str_len=clamp(max_str_len),
            max_bin_len=clamp(max_bin_len),
            max_array_len=clamp(max_array_len),
            max_map_len=clamp(max_map_len),
            max_ext_len=cap,
        )


def decode(body, limits: Limits):
    """Decode one frame body (bytes or memoryview) under `limits`."""
    message = None
    try:
        message = msgpack.unpackb(body, **limits.kwargs)
    except Exception as exc:  # msgpack raises several types for bad input
        error = f"malformed frame ({type(exc).__name__}: {exc})"
    else:
        error = None
        if type(message) is not list or not message or type(message[0]) is not int:
            error = "frame is not a message (an array led by an integer code)"
    if error is not None:
        # Raised outside the except block with the view released, so the
        # traceback pins no export of the caller's buffer (it could not grow).
        if isinstance(body, memoryview):
            body.release()
        raise ProtocolError(error)
    return message


class FrameReader:
    """Incremental frame parser for one peer's byte stream.

    `feed(data)` returns every whole message the bytes complete, in order, and
    keeps a partial frame for the next call. A length over the cap or a body
    that does not decode raises `ProtocolError`; after that the stream is
    unusable (frame boundaries are lost) and the peer must be dropped.
    """

    __slots__ = ("limits", "_buf")

    def __init__(self, limits: Limits):
        self.limits = limits
        self._buf = bytearray()

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame held back."""
        return len(self._buf)

    def feed(self, data) -> list:
        # Hot path: most reads deliver exactly one whole frame and nothing else.
        buf = self._buf
        if not buf and len(data) >= 4:
            (length,) = HEADER.unpack_from(data)
            if length + 4 == len(data):
                if length > self.limits.max_frame:
                    self._too_big(length)
                with memoryview(data) as view:
                    return [decode(view[4:], self.limits)]
        buf += data
        out = []
        start = 0
        end = len(buf)
        while end - start >= 4:
            (length,) = HEADER.unpack_from(buf, start)
            if length > self.limits.max_frame:
                self._too_big(length)
            if end - start - 4 < length:
                break
            with memoryview(buf) as view:
                out.append(decode(view[start + 4:start + 4 + length], self.limits))
            start += 4 + length
        if start:
            del buf[:start]
        return out

    def _too_big(self, length: int):
        raise ProtocolError(f"frame of {length} bytes is over the cap of {self.limits.max_frame} bytes")
