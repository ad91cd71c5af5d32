"""UUIDv7 (RFC 9562): time-ordered ids for pools and episodes.

Python 3.11 has no uuid.uuid7. Layout: 48 bits of Unix time in milliseconds,
the version nibble 7, 74 random bits and the RFC 4122 variant. Ids minted in
the same millisecond are not ordered among themselves (no counter): they
correlate records, they do not sequence them.
"""

from __future__ import annotations

import os
import time
import uuid

__all__ = ["uuid7"]


def uuid7() -> str:
    """A new UUIDv7, as its canonical string."""
    ms = time.time_ns() // 1_000_000
    value = (ms & ((1 << 48) - 1)) << 80 | int.from_bytes(os.urandom(10), "big")
    value = value & ~(0xF << 76) | 0x7 << 76  # version 7
    value = value & ~(0x3 << 62) | 0x2 << 62  # variant 10
    return str(uuid.UUID(int=value))
