"""Every exception boltzlabs raises, in one place.

    BoltzLabsError
    ├── PoolClosedError      the pool was closed; make a new one
    ├── EnvStartError        an env never completed its handshake (start-up log attached)
    ├── EnvError             an env failed a request that has no lane to report on (render)
    ├── WorkerError          the worker process failed or died (its cause attached)
    └── SandboxUnavailable   this host cannot build the sandbox (what to install)
    SeccompPolicyError       sandbox/seccomp.toml cannot be compiled (a ValueError)

Bad arguments raise `ValueError`/`TypeError` with what to do. A failure of a
single env while the pool runs is never an exception: it is reported on that
env's lane (`info["error"]`) and the pool goes on.
"""


class BoltzLabsError(Exception):
    """Base class of boltzlabs' own exceptions."""


class PoolClosedError(BoltzLabsError):
    """The pool was closed (or broken by an interrupted call); create a new RLPool."""


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
    """The worker (the process that owns the sandboxes) failed or died."""


class SandboxUnavailable(BoltzLabsError):
    """The host lacks what the sandbox needs (bubblewrap, user namespaces)."""


class SeccompPolicyError(ValueError):
    """sandbox/seccomp.toml says something that cannot be compiled; the message says what and where."""
