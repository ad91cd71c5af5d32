"""A pool's env thunks (`BoltzLabsVecEnv(env_fns)`): the file that carries them into every sandbox.

    trainer: cloudpickle.dumps(env_fns[i]) for each lane i (boltzlabs/pool/sources.py)
        --OPEN {"env_fns": [bytes, ...]}--> worker: write(path, blobs), one file per pool
        --bound read-only at $BOLTZLABS_ENV_FNS (mounts/env.toml, boltzlabs/host/plan.py)-->
    sandbox: boltzlabs/runtime/fn_env/env.py: build() unpickles lane i's thunk and calls it

The trainer is the trusted side: it pickles its own callables, as
AsyncVectorEnv does, and the sandbox unpickles and calls them, confined.
Nothing pickled ever travels back: every reply is the env's bounded msgpack,
as for any env. A file and not the params (an environment variable, capped at
128 KiB by the kernel and the same for every lane) or an fd (which would have
to survive bubblewrap and, in template mode, the template's forks): a file
bound read-only is seen the same way by every spawn mode, and no lane can
change what another lane builds. Every lane can read every lane's pickle;
they are the trainer's own code and arguments.

The file: MAGIC, the lane count n (8 bytes), n (offset, length) pairs (8 bytes
each, little-endian), then the pickles, each stored once however many lanes
share it. A lane reads its own pair and its own pickle, never the whole file.

Standard library only; `write` runs on the host (the worker), `read` and
`build` in the sandbox.
"""

from __future__ import annotations

import os
import struct

from boltzlabs import abi

TYPE_CHECKING = False  # typing is not imported at run time: every env would pay for it
if TYPE_CHECKING:
    from typing import Any

__all__ = ["VARIABLE", "write", "read", "build"]

VARIABLE = abi.ENV_FNS_VARIABLE  # the file's path inside the sandbox (set by the builder)
MAGIC = b"BLZFNS1\n"
_HEAD = struct.Struct("<8sQ")
_PAIR = struct.Struct("<QQ")
MAX_LANES = 1 << 20


def write(path: str, blobs: list[Any]) -> None:
    """Write lane i's pickle `blobs[i]` (bytes) to a new file at `path` (mode 0644)."""
    if not 0 < len(blobs) <= MAX_LANES or not all(isinstance(b, bytes) for b in blobs):
        raise ValueError(f"env_fns: expected 1 to {MAX_LANES} pickles (bytes), got {len(blobs)}")
    offsets, data, where = [], [], _HEAD.size + _PAIR.size * len(blobs)
    stored: dict[str, Any] = {}
    for blob in blobs:
        if blob not in stored:
            stored[blob] = where
            data.append(blob)
            where += len(blob)
        offsets.append(_PAIR.pack(stored[blob], len(blob)))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "wb", closefd=False) as f:
            f.write(_HEAD.pack(MAGIC, len(blobs)))
            f.writelines(offsets)
            f.writelines(data)
    finally:
        os.close(fd)


def read(path: str, lane: int) -> bytes:
    """Lane `lane`'s pickle from the file at `path`; ValueError if the file is not one of ours."""
    with open(path, "rb") as f:
        head = f.read(_HEAD.size)
        if len(head) != _HEAD.size or _HEAD.unpack(head)[0] != MAGIC:
            raise ValueError(f"{path} is not a boltzlabs env_fns file")
        count = _HEAD.unpack(head)[1]
        if not 0 <= lane < count:
            raise ValueError(f"lane {lane} has no thunk: the pool's env_fns file holds {count}")
        f.seek(_HEAD.size + _PAIR.size * lane)
        offset, length = _PAIR.unpack(f.read(_PAIR.size))
        f.seek(offset)
        blob = f.read(length)
    if len(blob) != length:
        raise ValueError(f"{path} is truncated (lane {lane}'s thunk)")
    return blob


def build(modules: Any = ()) -> Any:
    """This lane's env: env_fns[i]() for i = $BOLTZLABS_ENV_INDEX, unpickled here,
    once `modules` are imported (the plugins that registered the trainer's
    Gymnasium ids: the thunk's gymnasium.make needs their ids registered here too).

    Raises with what to do when the thunk cannot be unpickled (a module the
    trainer imports that this sandbox cannot see) or returns no env."""
    import importlib
    import pickle

    for module in modules:
        importlib.import_module(module)

    lane = int(os.environ[abi.ENV_INDEX_VARIABLE])
    blob = read(os.environ[VARIABLE], lane)
    try:
        thunk = pickle.loads(blob)
    except ImportError as exc:
        raise ImportError(
            f"env_fns[{lane}] could not be unpickled in its sandbox: {exc}. The sandbox imports what the "
            "trainer's interpreter has installed (its site-packages, editable installs and $PYTHONPATH, bound "
            "read-only); a module the trainer imports from elsewhere (its script's directory) travels with the "
            "thunk only when the thunk's own code is in it. Install the package (pip install -e .) or put its "
            "directory on PYTHONPATH"
        ) from exc
    env = thunk()
    if not all(hasattr(env, name) for name in ("reset", "step", "observation_space", "action_space")):
        raise TypeError(
            f"env_fns[{lane}]() returned {type(env).__name__}, not a Gymnasium env (an object with "
            "reset, step, observation_space and action_space)"
        )
    return env
