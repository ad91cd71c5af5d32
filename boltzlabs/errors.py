"""Every exception boltzlabs raises, in one place, and how an ERROR frame names its category
(imports only boltzlabs.abi, whose exit codes describe_exit names).

    BoltzLabsError
    ├── PoolClosedError      the pool was closed; make a new one
    ├── EnvStartError        an env never completed its handshake (start-up log attached)
    ├── EnvError             an env failed a request that has no lane to report on (render)
    ├── WorkerError          the worker process failed or died (.kind, .signal; the cause attached)
    │   └── WorkerSideError  an exception raised inside the worker, carried over the wire (the cause)
    ├── SandboxUnavailable   this host cannot build the sandbox (what to install)
    │   ├── TemplateUnavailable  the env cannot be forked from a template (falls back to exec)
    │   ├── CgroupUnavailable    no writable memory cgroup here
    │   └── PolicyError          the policy (or a remote worker's ceilings) refuses what was asked
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

An ERROR frame from the worker is [ERROR, seq, category, text, detail]. The
category (CATEGORIES) is decided in the worker, where the fault is known
(`category_of`), and the client raises exactly one exception per category
(`CATEGORY_RAISES`), chained from a WorkerSideError that holds the worker's
own text: a worker's bug is never turned into a caller's ValueError.
"""

import os as _os
import signal as _signal

from boltzlabs import abi as _abi


class BoltzLabsError(Exception):
    """Base class of boltzlabs' own exceptions."""


class PoolClosedError(BoltzLabsError):
    """The pool was closed (or broken by an interrupted call); create a new pool."""


class EnvStartError(BoltzLabsError):
    """An env failed before completing its handshake.

    `env_index` is the lane, `log` the tail of what the env wrote to
    stdout/stderr (usually its traceback).
    """

    def __init__(self, message: str, env_index: int | None = None, log: str = ""):
        super().__init__(message)
        self.env_index = env_index
        self.log = log


class EnvError(BoltzLabsError):
    """An env failed a request whose answer has no lane to carry the error
    (render). `env_index` is the env; the message holds its traceback."""

    def __init__(self, message: str, env_index: int | None = None):
        super().__init__(message)
        self.env_index = env_index


class WorkerError(BoltzLabsError):
    """The worker (the process that owns the sandboxes) failed or died.

    `kind`: the category of the worker's ERROR frame ("internal", "protocol",
    ...: CATEGORIES), "protocol" for a frame the client refused, "deadline"
    (DEADLINE) when the worker did not answer a call by its deadline (it was
    then killed, or its connection closed), or None when the worker died or
    was unreachable.
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
    `kind` is its ERROR category, the message its text (for an internal fault, its traceback)."""

    def __init__(self, kind: str, text: str):
        super().__init__(f"{kind} in the worker process:\n{text}", kind=kind)
        self.text = text


def exit_signal(code: int | None) -> int | None:
    """The signal that ended a process, from its exit code as subprocess gives it
    (negative: killed by that signal) or bwrap reports it (128 + the signal); else None."""
    if code is None:
        return None
    if code < 0:
        return -code
    if code > 128 and code - 128 in _signal.valid_signals():
        return code - 128
    return None


def stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP, ^Z, a debugger): the state in /proc/<pid>/stat,
    after the command's closing parenthesis, is T or t. A stopped worker reads nothing: neither a
    CLOSE from its client nor the end of the connection when the client dies."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    at = stat.rfind(b")") + 2
    return stat[at : at + 1] in (b"T", b"t")


def describe_exit(code: int) -> str:
    """How a process died, in words: "was killed by SIGKILL (signal 9)", "exited with code 3", or what
    one of abi's exit codes means. `code` is an exit code as subprocess.Popen.returncode and
    os.waitstatus_to_exitcode give it (negative: the signal that killed it); bwrap reports a sandboxed
    process killed by signal S as exit 128 + S, named as that signal."""
    signum = exit_signal(code)
    if signum is not None:
        try:
            name = _signal.Signals(signum).name
        except ValueError:
            name = "an unknown signal"
        return f"was killed by {name} (signal {signum})" + (f" (exit code {code})" if code > 0 else "")
    if code == _abi.NO_SERVE_EXIT:
        return (
            f"exited with code {code}: its env.py returned without calling serve() (an env.py must end with "
            "boltzlabs.env.serve(reset=..., step=...), or serve_env(env))"
        )
    if code == _abi.SET_UP_EXIT:
        return f"exited with code {code}: the sandbox's own set-up failed before any env code ran"
    if code == _abi.REFUSED_EXIT:
        return (
            f"exited with code {code}: its serve() refused a request from the worker that it could not decode "
            "(a str over the pool's max_str_len, limits={'max_str_len': ...}, in reset options or call "
            "arguments, say); the env's log says what"
        )
    return f"exited with code {code}"


def describe_status(status: int) -> str:
    """describe_exit for a waitpid status."""
    return describe_exit(_os.waitstatus_to_exitcode(status))


# -- ERROR frames' categories: decided where the fault is known ---------------------------
USAGE = "usage"  # a request the caller got wrong (a bad value): ValueError
USAGE_TYPE = "usage-type"  # a request argument of the wrong type: TypeError
POLICY = "policy"  # the policy, or a remote worker's ceilings, refuse what was asked: SandboxUnavailable
HOST = "host"  # the host lacks what a sandbox needs: SandboxUnavailable
START = "start"  # an env failed its start-up (detail: env, log, failed, set_up): EnvStartError
PROTOCOL = "protocol"  # the peer broke the protocol: WorkerError
INTERNAL = "internal"  # anything else: a fault of the worker (detail: its traceback): WorkerError
REFUSED = "refused"  # a remote listener refused the connection: WorkerError
CATEGORIES = (USAGE, USAGE_TYPE, POLICY, HOST, START, PROTOCOL, INTERNAL, REFUSED)
# The client's own, never on the wire: the worker did not answer a call by its deadline (WorkerError.kind).
DEADLINE = "deadline"


def category_of(exc: BaseException) -> str:
    """The category of an exception the worker caught. Only what the worker's own checks raise counts
    as the caller's mistake (ValueError and TypeError are what they raise; a KeyError or IndexError
    anywhere is a fault of the worker); a policy error is the policy's; a missing host feature the host's."""
    if isinstance(exc, StartFailure):
        return START
    if isinstance(exc, SeccompPolicyError | PolicyError):
        return POLICY
    if isinstance(exc, SandboxUnavailable):
        return HOST
    if isinstance(exc, ProtocolError):
        return PROTOCOL
    if isinstance(exc, TypeError):
        return USAGE_TYPE
    if isinstance(exc, ValueError) and not isinstance(exc, UnicodeError):
        return USAGE
    return INTERNAL


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


class PolicyError(SandboxUnavailable):
    """The policy (sandbox/policy.toml, or a remote worker's ceilings) refuses what a pool asks for, or
    cannot be read; the message names the key and the file."""


# -- internal: raised and caught within one module --------------------------------------


class ClientGone(Exception):
    """The worker's client closed its end: the worker tears everything down."""


class StartFailure(Exception):
    """An env of the pool failed its start-up (in the worker): which one, its
    log, how many failed; the client raises EnvStartError from it."""

    def __init__(self, index: int, message: str, log: str, count: int, set_up: bool = False, limit: str = ""):
        super().__init__(message)
        self.index, self.log, self.count = index, log, count
        self.set_up = set_up  # the sandbox's own set-up failed (it exited abi.SET_UP_EXIT), not the env's code
        self.limit = limit  # the limit the env died at, as `limits` names it ("pids", "memory", ...), or ''


class HandshakeRefused(Exception):
    """The remote listener ends a handshake here; the message goes to the client."""


class UnpackRefused(Exception):
    """A shipped env archive is not a plain tree of files and directories within the caps."""


class TooMany(Exception):
    """wire: a decoded message holds more objects than its Limits allow."""


class MemberServed(BaseException):
    """Raised by serve() in one env of a sandbox of several (RLPool(envs_per_sandbox=k)) to end
    its env.py there: runtime/group.py serves every member at once. A BaseException, so an
    env.py's `except Exception` does not swallow it."""


class ScrubError(RuntimeError):
    """Raised inside a sandbox when reset(scrub=True) cannot finish (runtime/scrub.py): a process
    would not die, or the workspace could not be emptied. The lane's reset fails with it, named;
    `reset(hard=True)` is the way on."""


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
