"""Which step path the worker runs: native (the C extension boltzlabs._fastpath,
source in native/fastpath.c) or pure Python. Host side only: the worker and the
client import this, never an env.

    worker.step() --native: one _fastpath.exchange() call per batch--> channels
                  --pure: one os.write / epoll round / os.read per lane--> channels

Both paths put the same frames on the wire and hand what they read to the same
Python code (FrameReader, wire.Limits, the reply checks), so they differ only in
who does the system calls. The native path is picked when the extension was
built; `BOLTZLABS_PURE=1` in the environment forces the pure path (the worker
inherits the client's environment). A missing extension is said once, by the
client at import, not per pool or per step.
"""

from __future__ import annotations

import os
import warnings

PURE_ENV = "BOLTZLABS_PURE"


def load(warn: bool = False):
    """The _fastpath module, or None for the pure path (BOLTZLABS_PURE=1, or
    the extension was not built: then a RuntimeWarning when `warn`)."""
    if os.environ.get(PURE_ENV, "").strip() not in ("", "0"):
        return None
    try:
        from boltzlabs import _fastpath
    except ImportError as exc:
        if warn:
            warnings.warn(f"boltzlabs: the native step path (boltzlabs._fastpath) is not built here ({exc}); the "
                          "worker runs the pure-Python path, which costs more CPU per env-step. Install gcc and "
                          "the Python headers (bash ci/setup.sh does) and reinstall boltzlabs to build it; set "
                          f"{PURE_ENV}=1 to choose the pure path and silence this.", RuntimeWarning, stacklevel=2)
        return None
    return _fastpath
