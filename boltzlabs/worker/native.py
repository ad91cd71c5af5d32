"""Which step path the worker runs: native (the C extension boltzlabs.worker._fastpath,
source in native/fastpath.c) or pure Python. Worker side: only the worker
imports this (the client learns the answer from the worker's READY), never an env.

    worker.step() --native: one _fastpath.step() call per batch--> channels
                  --pure: one os.write / epoll round / os.read per lane--> channels

Both paths put the same frames on the wire. The native one vouches in C for
each reply that wire.decode and the reply checks would accept (a bounded
msgpack walker, native/fastpath.c) and splices those replies' bytes into the
REPLY undecoded; every other read goes to the same Python code as the pure
path's (FrameReader, wire.Limits, the reply checks). The native path is picked when the extension was
built; `BOLTZLABS_PURE=1` in the environment forces the pure path (the worker
inherits the client's environment). A missing extension comes with a note the
client turns into one RuntimeWarning (the same text from the same line, which
Python shows once per process), not one per pool or per step.
"""

from __future__ import annotations

import os

PURE_ENV = "BOLTZLABS_PURE"


def load():
    """(the _fastpath module or None, note): None for the pure path, with a
    note saying why and what to do when the extension is missing ('' when it
    was chosen with BOLTZLABS_PURE=1, or when the native path runs)."""
    if os.environ.get(PURE_ENV, "").strip() not in ("", "0"):
        return None, ""
    try:
        from boltzlabs.worker import _fastpath
    except ImportError as exc:
        return None, (
            f"boltzlabs: the native step path (boltzlabs.worker._fastpath) is not built on the worker's host "
            f"({exc}); the worker runs the pure-Python path, which costs more CPU per env-step. Install "
            "gcc and the Python headers (bash ci/setup.sh does) and reinstall boltzlabs to build it; set "
            f"{PURE_ENV}=1 to choose the pure path and silence this."
        )
    return _fastpath, ""


def caps(limits) -> tuple:
    """The caps of `limits` (a guarded wire.Limits: the worker's env limits)
    as _fastpath.step() takes them: (max_frame, max_str_len, max_bin_len,
    max_array_len, max_map_len, max_ext_len, max_depth, max_objects, slots),
    slots 1 when a reply's obs may be a SLOT_EXT marker (the pool has
    observation slots: wire.Limits.slot_marks counts them), else 0."""
    kwargs = limits.kwargs
    return (
        limits.max_frame,
        kwargs["max_str_len"],
        kwargs["max_bin_len"],
        kwargs["max_array_len"],
        kwargs["max_map_len"],
        kwargs["max_ext_len"],
        limits.max_depth,
        limits.max_objects,
        1 if limits.slot_marks[0] >= 0 else 0,
    )
