"""A pool's configuration: the client's OPEN request, checked against the policy.

    client --OPEN {n, source_dir, workspace_size, limits, ...}--> server.Worker.open
        --parse_open(request, remote, policy)--> PoolConfig --> the worker's start-up (lifecycle.py)

The OPEN request is untrusted when the client is remote: the listener's
ceilings (ceilings.py) cap what it may ask, and it never names the env
directory. Everything here is parsing; nothing starts. The open-file limit a
pool of n envs needs is computed here too (the CLI's doctor and bench_scale
read it).
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

from boltzlabs import wire
from boltzlabs.sandbox.policy import Policy


@dataclass(frozen=True)
class PoolConfig:
    """What one pool is: its size, its env, its limits and deadlines."""

    n: int
    source_dir: str
    workspace_size: int | None  # None: the policy's default_size
    params: dict
    spawn: str  # "template" or "exec"
    warmup: bool
    start_timeout: float
    step_timeout: float
    gated: bool  # serialize_measurement: one env's step at a time
    limits: dict  # per env: the policy's [env_limits] with the pool's overrides (docs/limits.md)
    memory_limit: int | None
    straggler_grace: float
    env_limits: wire.Limits  # how an env's frames are decoded
    hello_limits: wire.Limits  # how its handshake is: kept (lane 0's), so capped on its own
    max_pool_bytes: int
    log_tail: int


def parse_open(request, remote: dict | None, policy: Policy) -> PoolConfig:
    """The pool OPEN asks for, or ValueError/KeyError/TypeError saying what is wrong."""
    if not isinstance(request, dict):
        raise ValueError("OPEN needs the pool's configuration")
    if remote:
        # A remote pool (remote/listener.py): the listener chose the env
        # directory (a client never names a path on this host) and caps what it may ask for.
        request = dict(request, source_dir=remote["source_dir"])
        if not isinstance(request.get("n"), int) or not 1 <= request["n"] <= remote["max_envs"]:
            raise ValueError(f"this worker serves pools of 1 to {remote['max_envs']} envs (its --max-envs); "
                             f"asked for {request.get('n')!r}")
        from boltzlabs.worker.ceilings import apply_ceilings

        request = apply_ceilings(request, remote["ceilings"], policy)
    limits = policy.limits
    lengths = (limits["max_str_len"], limits["max_bin_len"], limits["max_array_len"], limits["max_map_len"])
    depth = limits.get("max_depth", wire.MAX_DEPTH)
    start_timeout = float(request.get("start_timeout") or limits["start_timeout"])
    step_timeout = float(request.get("step_timeout") or limits["step_timeout"])
    env_limits = policy.env_limits(request.get("limits"), request.get("memory_limit"))
    return PoolConfig(
        n=int(request["n"]),
        source_dir=request["source_dir"],
        workspace_size=request.get("workspace_size"),
        params=request.get("params") or {},
        spawn="template" if request.get("spawn", "template") == "template" else "exec",
        warmup=bool(request.get("warmup", True)),
        start_timeout=start_timeout,
        step_timeout=step_timeout,
        gated=bool(request.get("serialize_measurement")),
        limits=env_limits,
        memory_limit=env_limits.get("memory") or None,
        straggler_grace=env_limits.get("straggler_grace", float("inf")),
        env_limits=wire.Limits(limits["max_frame"], *lengths, arrays="check", max_depth=depth,
                               max_objects=limits.get("max_objects_per_frame", 1 << 19)),
        hello_limits=wire.Limits(min(limits.get("max_hello", 4 << 20), limits["max_frame"]), *lengths,
                                 arrays="check", max_depth=depth,
                                 max_objects=limits.get("max_hello_objects", 1 << 16)),
        max_pool_bytes=int(limits.get("max_pool_bytes", 1 << 30)),
        log_tail=int(limits["log_tail"]),
    )


# File descriptors the worker plans per env (channel, log pipe and a pidfd:
# of its bwrap in exec mode, of its pid 1 in template mode) and for itself.
FDS_PER_ENV, FD_SLACK = 3, 256


def fds_needed(n: int) -> int:
    """The open-file limit a worker needs for a pool of n envs."""
    return FDS_PER_ENV * n + FD_SLACK


def envs_within(fd_limit: int) -> int:
    """How many envs one worker can hold under an open-file limit of fd_limit."""
    return max(0, (fd_limit - FD_SLACK) // FDS_PER_ENV)


def raise_fd_limit(n: int) -> None:
    """Make room for fds_needed(n) open files, or ValueError saying how."""
    want = fds_needed(n)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= want or soft == resource.RLIM_INFINITY:
        return
    if hard != resource.RLIM_INFINITY and hard < want:
        try:  # only with CAP_SYS_RESOURCE (root): raise the hard limit too
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
            return
        except (ValueError, OSError):
            pass
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard) if hard != resource.RLIM_INFINITY else want, hard))
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < want:
        raise ValueError(f"a pool of {n} envs needs about {want} file descriptors and the limit is {soft}; "
                         f"raise it (ulimit -n {want}, or LimitNOFILE= for a service) or use fewer envs")
