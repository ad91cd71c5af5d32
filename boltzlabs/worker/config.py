"""A pool's configuration: the client's OPEN request, checked against the policy.

    client --OPEN {n, source_dir, workspace_size, limits, ...}--> server.Worker.open
        --parse_open(request, remote, policy)--> PoolConfig --> the worker's start-up (lifecycle.py)

The OPEN request is untrusted when the client is remote: the listener's
ceilings (ceilings.py) cap what it may ask, and it never names the env
directory. Everything here is parsing; nothing starts. The open-file limit a
pool of n envs needs, and so which channel its envs get (pipes, or the
socketpair when the limit cannot hold two pipes per env), is decided here
too (the CLI's doctor and bench_scale read it).
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

from boltzlabs import wire
from boltzlabs.host import limits as _limits
from boltzlabs.host.policy import Policy
from boltzlabs.worker import affinity


@dataclass(frozen=True)
class PoolConfig:
    """What one pool is: its size, its env, its limits and deadlines."""

    n: int
    source_dir: str
    workspace_size: int | None  # None: the policy's default_size
    params: dict
    spawn: str  # "template" or "exec"
    warmup: bool
    trust_env: bool  # template mode: env.py imported in the template (RLPool(trust_env=True))
    preload: tuple[str, ...]  # library modules the template imports: RLPool(preload=), boltzlabs.toml
    start_timeout: float
    step_timeout: float
    gated: bool  # serialize_measurement: one env's step at a time
    # RLPool(cpu_budget=): CPU seconds a lane's sandbox may use per step, all its processes
    # (worker/cpu_budget.py); None: no budget.
    cpu_budget: float | None
    # RLPool(cpu_share=True): each sandbox a group of the cpu controller, weighing as one
    # (host/cgroups.py), whatever processes or sessions it makes.
    cpu_share: bool
    limits: dict  # per env: the policy's [env_limits] with the pool's overrides (docs/limits.md)
    memory_limit: int | None
    straggler_grace: float
    env_limits: wire.Limits  # how an env's frames are decoded
    # The most UTF-8 bytes one str may hold, each way: in an env's frame (env_limits), in a request
    # the env decodes ($BOLTZLABS_MAX_STR_LEN) and in an action (the trainer's check, from READY).
    # RLPool(limits={"max_str_len": ...}), at most the policy's [limits] max_str_len.
    max_str_len: int
    hello_limits: wire.Limits  # how its handshake is: kept (lane 0's), so capped on its own
    max_pool_bytes: int
    log_tail: int
    env_fns: tuple | None = None  # an env_fns pool: one pickled thunk (bytes) per lane (runtime/env_fns.py)
    import_roots: tuple = ()  # what the trainer imports from outside site-packages (pool/imports.py); local only
    expose: tuple = ()  # paths below those roots bound besides, whole (RLPool(expose=)); local only
    env_vars: dict | None = None  # RLPool(env_vars=): variables for every env (host/plan.py checks them)
    affinity: affinity.Affinity | None = None  # RLPool(cpus=), a shard's slice (affinity.py); None: not pinned
    # RLPool(envs_per_sandbox=k): (k, envs), each of the n lanes a sandbox of k envs (the last
    # of envs - (n - 1) * k); None: an env per sandbox (runtime/group.py, pool/groups.py).
    group: tuple[int, int] | None = None
    # RLPool(eager_reset=True): an env (a group's member) whose episode ended resets as soon as
    # its step's reply is sent (runtime/serve.py's Eager); never with serialize_measurement.
    eager_reset: bool = False


def parse_open(request, remote: dict | None, policy: Policy) -> PoolConfig:
    """The pool OPEN asks for, or ValueError/KeyError/TypeError saying what is wrong."""
    if not isinstance(request, dict):
        raise ValueError("OPEN needs the pool's configuration")
    limits = policy.pool_limits()  # [limits], every key typed and checked (host/policy.py)
    # A pool's own bounds (limits={"max_str_len": ...}) are [limits] keys, not [env_limits] ones:
    # taken out first, each capped by the policy itself, for a remote client as for a local one.
    env_asked, bounds = _limits.split(request.get("limits"))
    request = dict(request, limits=env_asked)
    max_str_len = _limits.bound("max_str_len", bounds.get("max_str_len"), limits.max_str_len)
    if remote:
        # A remote pool (remote/listener.py): the listener chose the env
        # directory (a client never names a path on this host) and caps what it may ask for.
        request = dict(request, source_dir=remote["source_dir"])
        if not isinstance(request.get("n"), int) or not 1 <= request["n"] <= remote["max_envs"]:
            raise ValueError(
                f"this worker serves pools of 1 to {remote['max_envs']} envs (its --max-envs); "
                f"asked for {request.get('n')!r}"
            )
        from boltzlabs.worker.ceilings import apply_ceilings

        request = apply_ceilings(request, remote["ceilings"], policy)
        if _flag(request, "trust_env", False) and not remote.get("allow_trust_env"):
            raise ValueError(
                "this worker does not import a remote client's env code in its template: "
                "trust_env=True is refused (its operator allows it with `boltzlabs worker "
                "--allow-trust-env`); leave trust_env out"
            )
    lengths = (limits.max_str_len, limits.max_bin_len, limits.max_array_len, limits.max_map_len)
    depth = limits.max_depth
    start_timeout = float(request.get("start_timeout") or limits.start_timeout)
    step_timeout = float(request.get("step_timeout") or limits.step_timeout)
    env_limits = policy.env_limits(request.get("limits"), request.get("memory_limit"))
    group = _group(request.get("group"), request["n"])
    gated = _flag(request, "serialize_measurement", False)
    eager_reset = _flag(request, "eager_reset", False)
    if eager_reset and gated:
        raise ValueError(
            "eager_reset=True runs an env's reset outside its turn, and serialize_measurement=True lets "
            "one env's code run at a time, in turn: ask for one of them"
        )
    if remote and group and group[1] > remote["max_envs"]:
        # Its cap counts envs, however many share a sandbox.
        raise ValueError(
            f"this worker serves pools of 1 to {remote['max_envs']} envs (its --max-envs); "
            f"asked for {group[1]} envs in {request['n']} sandboxes"
        )
    return PoolConfig(
        n=int(request["n"]),
        source_dir=request["source_dir"],
        workspace_size=request.get("workspace_size"),
        params=request.get("params") or {},
        spawn="template" if request.get("spawn", "template") == "template" else "exec",
        warmup=_flag(request, "warmup", True),
        trust_env=_flag(request, "trust_env", False),
        preload=preload_names(request.get("preload"), request["source_dir"]),
        start_timeout=start_timeout,
        step_timeout=step_timeout,
        gated=gated,
        cpu_budget=cpu_budget(request.get("cpu_budget")),
        cpu_share=_flag(request, "cpu_share", False),
        limits=env_limits,
        memory_limit=env_limits.get("memory") or None,
        straggler_grace=env_limits.get("straggler_grace", float("inf")),
        env_limits=wire.Limits(
            limits.max_frame,
            max_str_len,
            *lengths[1:],
            arrays="check",
            max_depth=depth,
            max_objects=limits.max_objects_per_frame,
            str_fix=_str_fix(max_str_len, limits.max_str_len),
        ),
        max_str_len=min(max_str_len, limits.max_frame),
        hello_limits=wire.Limits(
            min(limits.max_hello, limits.max_frame),
            *lengths,
            arrays="check",
            max_depth=depth,
            max_objects=limits.max_hello_objects,
        ),
        max_pool_bytes=limits.max_pool_bytes,
        log_tail=limits.log_tail,
        env_fns=_env_fns(request.get("env_fns"), group[1] if group else int(request["n"])),
        # Paths of the client's machine: a remote worker binds none of its own host's for a client.
        import_roots=() if remote else tuple(request.get("import_roots") or ()),
        expose=() if remote else tuple(request.get("expose") or ()),
        env_vars=request.get("env_vars"),
        affinity=affinity.parse(request.get("affinity")),
        group=group,
        eager_reset=eager_reset,
    )


def _flag(request: dict, name: str, default: bool) -> bool:
    """OPEN's yes-or-no option `name`: true, false, or absent (None: `default`). Anything else is
    refused, naming it: a remote client's "yes" or 0 is never read as either."""
    value = request.get(name)
    if value is None:
        return default
    if type(value) is not bool:
        raise ValueError(f"OPEN's {name} must be true or false, not {value!r:.40}")
    return value


def _str_fix(asked: int, ceiling: int) -> str:
    """What a lane killed for a str over the pool's max_str_len is told to do."""
    if asked < ceiling:
        return (
            f"; this pool's cap, RLPool(..., limits={{'max_str_len': ...}}): raise it, up to the policy's "
            f"{ceiling:,} bytes, or send less"
        )
    return (
        "; the sandbox policy's [limits] max_str_len, the most a pool may ask for: send less, or run the pool "
        "under a policy that allows more (BOLTZLABS_POLICY: docs/limits.md)"
    )


def cpu_budget(asked) -> float | None:
    """OPEN's cpu_budget: None (no budget), or a finite number of seconds > 0; else ValueError.
    A remote client's is taken as asked: it only ever restricts that client's own pool."""
    if asked is None:
        return None
    if isinstance(asked, bool) or not isinstance(asked, (int, float)) or not 0 < asked < float("inf"):
        raise ValueError(
            f"cpu_budget must be a positive, finite number of CPU seconds per step (None: no budget), not {asked!r:.80}"
        )
    return float(asked)


PRELOAD_FILE = "boltzlabs.toml"  # beside env.py: [boltzlabs] preload = ["scipy.special", ...]
_MAX_PRELOAD, _MAX_PRELOAD_FILE = 2048, 1 << 16


def preload_names(asked, source_dir: str) -> tuple[str, ...]:
    """The modules a pool's template imports besides what its probe finds:
    RLPool(preload=[...]) and the env directory's boltzlabs.toml
    (`[boltzlabs] preload = [...]`). Names only, which the template resolves
    on the library mounts; each is checked here (ValueError naming it)."""
    from boltzlabs.runtime.template import valid_name

    names = []
    if asked is not None:
        if not isinstance(asked, (list, tuple)) or not all(isinstance(name, str) for name in asked):
            raise TypeError(f"preload must be a list of module names, not {type(asked).__name__}")
        names += list(asked)
    path = os.path.join(source_dir, PRELOAD_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        fd = None
    except OSError as exc:
        raise ValueError(f"{path}: cannot be read ({exc.strerror}); it must be a plain file") from exc
    if fd is not None:
        import stat
        import tomllib

        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError(f"{path} must be a plain file")
            data = os.read(fd, _MAX_PRELOAD_FILE + 1)
        finally:
            os.close(fd)
        if len(data) > _MAX_PRELOAD_FILE:
            raise ValueError(f"{path} is over {_MAX_PRELOAD_FILE} bytes")
        try:
            table = tomllib.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"{path} is not valid TOML: {exc}") from exc
        section = table.get("boltzlabs", {})
        listed = section.get("preload", []) if isinstance(section, dict) else None
        if not isinstance(listed, list) or not all(isinstance(name, str) for name in listed):
            raise ValueError(
                f'{path}: [boltzlabs] preload must be a list of module names, like preload = ["scipy.special"]'
            )
        names += listed
    bad = [name for name in names if not valid_name(name)]
    if bad:
        raise ValueError(f"preload: {bad[0][:100]!r} is not a module name (dotted identifiers, at most 200 characters)")
    names = list(dict.fromkeys(names))
    if len(names) > _MAX_PRELOAD:
        raise ValueError(f"preload names {len(names)} modules; at most {_MAX_PRELOAD}")
    return tuple(names)


def _group(asked, n) -> tuple[int, int] | None:
    """OPEN's group: [k, envs] with n == ceil(envs / k) lanes, each a sandbox of k envs; None: one each."""
    if asked is None:
        return None
    if (
        not isinstance(asked, list)
        or len(asked) != 2
        or not all(type(v) is int for v in asked)
        or not (1 <= asked[0] < 1 << 32 and 1 <= asked[1] < 1 << 32)
        or type(n) is not int
        or -(-asked[1] // asked[0]) != n
    ):
        raise ValueError(
            f"group must be [k, envs], k >= 1 envs per sandbox, with n = ceil(envs / k) sandboxes; got {asked!r:.80} for n={n!r:.20}"
        )
    return asked[0], asked[1]


def _env_fns(blobs, n: int) -> tuple | None:
    """An env_fns pool's pickles: one bytes object per lane, or None for other sources."""
    if blobs is None:
        return None
    if not isinstance(blobs, list) or len(blobs) != n or not all(isinstance(b, bytes) for b in blobs):
        raise ValueError(f"env_fns must be one pickled thunk (bytes) per env, {n} of them")
    return tuple(blobs)


# An env's channel (docs/wire.md#the-channel): two pipes (worker -> env,
# env -> worker), the default, or one AF_UNIX socketpair, which costs the
# worker more kernel time per frame but one fd fewer.
PIPES, SOCKETPAIR = "pipes", "socketpair"
CHANNEL_ENV = "BOLTZLABS_CHANNEL"  # "socketpair" in the pool's environment forces the socketpair
# File descriptors the worker holds per env (its channel's one or two, the log
# pipe's read end and a pidfd: of its bwrap in exec mode, of its pid 1 in
# template mode), and for itself.
FDS_PER_ENV = {PIPES: 4, SOCKETPAIR: 3}
FD_SLACK = 256


def fds_needed(n: int, channel: str = PIPES) -> int:
    """The open-file limit a worker needs for a pool of n envs on `channel`."""
    return FDS_PER_ENV[channel] * n + FD_SLACK


def envs_within(fd_limit: int, channel: str = SOCKETPAIR) -> int:
    """How many envs one worker can hold under an open-file limit of fd_limit
    (the most with the socketpair channel, which the pool falls back to)."""
    return max(0, (fd_limit - FD_SLACK) // FDS_PER_ENV[channel])


def raise_fd_limit(n: int) -> str:
    """Make room for a pool of n envs: the channel it will use (PIPES when the
    open-file limit can be raised to hold 4 fds per env, else SOCKETPAIR if it
    can hold 3), or ValueError saying how to raise the limit."""
    forced = os.environ.get(CHANNEL_ENV, "").strip()
    if forced not in ("", PIPES, SOCKETPAIR):
        raise ValueError(f"{CHANNEL_ENV}={forced[:40]!r}: use {PIPES!r} (the default) or {SOCKETPAIR!r}")
    for channel in (SOCKETPAIR,) if forced == SOCKETPAIR else (PIPES, SOCKETPAIR):
        if _fd_room(fds_needed(n, channel)):
            return channel
    want = fds_needed(n, SOCKETPAIR)
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    raise ValueError(
        f"a pool of {n} envs needs about {want} file descriptors and the limit is {soft}; "
        f"raise it (ulimit -n {fds_needed(n)}, or LimitNOFILE= for a service) or use fewer envs"
    )


def _fd_room(want: int) -> bool:
    """Raise the soft open-file limit to `want` if it can be (the hard limit
    too, with CAP_SYS_RESOURCE); whether it now holds `want`."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= want or soft == resource.RLIM_INFINITY:
        return True
    if hard != resource.RLIM_INFINITY and hard < want:
        try:  # only with CAP_SYS_RESOURCE (root): raise the hard limit too
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
            return True
        except (ValueError, OSError):
            return False
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= want
