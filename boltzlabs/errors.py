"""Every exception boltzlabs raises, in one place (imports nothing of ours).

    BoltzLabsError
    ├── PoolClosedError      the pool was closed; make a new one
    ├── EnvStartError        an env never completed its handshake (start-up log attached)
    ├── EnvError             an env failed a request that has no lane to report on (render)
    ├── WorkerError          the worker process failed or died (.kind, .signal; the cause attached)
    │   └── WorkerSideError  an exception raised inside the worker, carried over the wire (the cause)
    ├── SandboxUnavailable   this host cannot build the sandbox (what to install)
    │   ├── TemplateUnavailable  the env cannot be forked from a template (falls back to exec)
    │   └── CgroupUnavailable    no writable memory cgroup here
    ├── ProtocolError        a peer sent bytes that are not a valid frame
    └── UsageError           the command line asks for something that cannot be done (exit 2)
    SeccompPolicyError       sandbox/seccomp.toml cannot be compiled (a ValueError)
    UnsupportedSpace         a space the handshake cannot describe, and no override given (a ValueError)

Internal control flow of one module each, never seen by a user of the pool:
ClientGone (worker), StartFailure (worker, becomes EnvStartError on the
client), HandshakeRefused (remote listener), UnpackRefused (remote env cache),
TooMany (wire's depth count).

Bad arguments raise `ValueError`/`TypeError` with what to do. A failure of a
single env while the pool runs is never an exception: it is reported on that
env's lane (`info["error"]`) and the pool goes on. An error translated from
another is raised `from` it, so the traceback shows both.
"""

import signal as _signal


class BoltzLabsError(Exception):
    """Base class of boltzlabs' own exceptions."""


class PoolClosedError(BoltzLabsError):
    """The pool was closed (or broken by an interrupted call); create a new pool."""


class EnvStartError(BoltzLabsError):
    """An env failed before completing its handshake.

    `env_index` is the lane, `log` the tail of what the env wrote to
    stdout/stderr (usually its traceback).
    """

    def __init__(self, message: str, env_index: int = None, log: str = ""):
        super().__init__(message)
        self.env_index = env_index
        self.log = log


class EnvError(BoltzLabsError):
    """An env failed a request whose answer has no lane to carry the error
    (render). `env_index` is the env; the message holds its traceback."""

    def __init__(self, message: str, env_index: int = None):
        super().__init__(message)
        self.env_index = env_index


class WorkerError(BoltzLabsError):
    """The worker (the process that owns the sandboxes) failed or died.

    `kind`: the class name of what failed inside the worker ("RuntimeError",
    "ProtocolError", ...), or None when the worker died or was unreachable.
    `signal`: the signal that killed the worker (signal.Signals), else None.
    When the failure happened inside the worker, `__cause__` is a
    WorkerSideError holding the worker's own text (its traceback).
    """

    def __init__(self, message: str, kind: str | None = None, signal: int | None = None):
        super().__init__(message)
        self.kind = kind
        self.signal = None if signal is None else _signal.Signals(signal)


class WorkerSideError(WorkerError):
    """An exception raised inside the worker process, as the worker reported it:
    `kind` is its class name, the message its text (usually a traceback)."""

    def __init__(self, kind: str, text: str):
        super().__init__(f"{kind} in the worker process:\n{text}", kind=kind)
        self.text = text


def describe_returncode(returncode: int) -> tuple[str, int | None]:
    """("exited with code 3" or "was killed by SIGKILL (signal 9)", the signal or None)
    for a subprocess returncode (negative: killed by that signal)."""
    if returncode is not None and returncode < 0:
        try:
            name = _signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name} (signal {-returncode})", -returncode
    return f"exited with code {returncode}", None


class SandboxUnavailable(BoltzLabsError):
    """The host lacks what the sandbox needs (bubblewrap, user namespaces)."""


class TemplateUnavailable(SandboxUnavailable):
    """The env cannot be forked from a template; the message says why."""


class CgroupUnavailable(SandboxUnavailable):
    """No writable memory cgroup here; the message says why."""


class ProtocolError(BoltzLabsError):
    """A peer sent bytes that are not a valid frame."""


class UsageError(BoltzLabsError):
    """The command line asks for something that cannot be done (exit 2)."""


class SeccompPolicyError(ValueError):
    """sandbox/seccomp.toml says something that cannot be compiled; the message says what and where."""


# -- internal: raised and caught within one module --------------------------------------


class ClientGone(Exception):
    """The worker's client closed its end: the worker tears everything down."""


class StartFailure(Exception):
    """An env of the pool failed its start-up (in the worker): which one, its
    log, how many failed; the client raises EnvStartError from it."""

    def __init__(self, index: int, message: str, log: str, count: int):
        super().__init__(message)
        self.index, self.log, self.count = index, log, count


class HandshakeRefused(Exception):
    """The remote listener ends a handshake here; the message goes to the client."""


class UnpackRefused(Exception):
    """A shipped env archive is not a plain tree of files and directories within the caps."""


class TooMany(Exception):
    """wire: a decoded message holds more objects than its Limits allow."""


class LaneStateError(BoltzLabsError):
    """The worker tried a lane state change its transition table does not
    declare (boltzlabs/worker/lanes.py): a bug in the worker, which then ends
    with its traceback. Deliberately not a ValueError (not a bad argument)."""


class UnsupportedSpace(ValueError):
    """A Gymnasium space the handshake cannot describe (boltzlabs.pool.spaces):
    `where` is its place in the space ("['mission']"), `kind` its class as the
    env named it. The message says which override to pass."""

    def __init__(self, message: str, where: str = "", kind: str = ""):
        super().__init__(message)
        self.where, self.kind = where, kind
