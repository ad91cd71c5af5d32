"""UUIDv7 (RFC 9562): time-ordered ids for pools and episodes.

Python 3.11 has no uuid.uuid7. Layout: 48 bits of Unix time in milliseconds,
the version nibble 7, 74 random bits and the RFC 4122 variant. Ids minted in
the same millisecond are not ordered among themselves (no counter): they
correlate records, they do not sequence them.
"""

from __future__ import annotations

import os
import time

__all__ = ["uuid7", "uuid7s"]

_TIME = (1 << 48) - 1
_VERSION = ~(0xF << 76) & ((1 << 128) - 1), 0x7 << 76  # the version nibble: cleared, then 7
_VARIANT = ~(0x3 << 62) & ((1 << 128) - 1), 0x2 << 62  # the variant bits: cleared, then 10


def uuid7() -> str:
    """A new UUIDv7, as its canonical string."""
    return uuid7s(1)[0]


def uuid7s(count: int) -> list[str]:
    """`count` new UUIDv7s, as canonical strings: one clock read and one read of the system's
    random bytes for all of them (the episodes a step begins: each env that resets)."""
    ms = (time.time_ns() // 1_000_000 & _TIME) << 80
    noise = os.urandom(10 * count)
    out = []
    for at in range(0, 10 * count, 10):
        value = ms | int.from_bytes(noise[at : at + 10], "big")
        value = value & _VERSION[0] | _VERSION[1]
        value = value & _VARIANT[0] | _VARIANT[1]
        digits = f"{value:032x}"
        out.append(f"{digits[:8]}-{digits[8:12]}-{digits[12:16]}-{digits[16:20]}-{digits[20:]}")
    return out
