"""Per-env resource limits, the host half: policy data in, checked limits and the rlimits' text out.

sandbox/policy.toml [env_limits] + RLPool(limits=...) --resolve()--> limits (worker)
    memory, pids        --> the env's cgroup (boltzlabs/host/cgroups.py)
    pool_pids           --> the pool's cgroup, all envs together (host_tasks() bounds it)
    straggler_grace     --> the worker's deadline kill (boltzlabs/worker/lifecycle.py)
    open_files, file_size, core_size, msgqueue --encode()--> rlimits= of the plan's
        $BOLTZLABS_CONFINE (boltzlabs/host/plan.py)
        --> boltzlabs/runtime/rlimits.py applies them inside the sandbox
sandbox/policy.toml [limits] max_str_len + RLPool(limits={"max_str_len": ...}) --split(), bound()-->
    the pool's own cap on a str, at most the policy's (worker/config.py: the env limits' decoder,
    the envs' $BOLTZLABS_MAX_STR_LEN, the trainer's check of actions)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from boltzlabs.runtime.rlimits import RLIMITS
from boltzlabs.units import parse_size

__all__ = ["RLIMITS", "BOUNDS", "resolve", "split", "bound", "encode", "host_tasks", "task_count"]

_SIZES = ("memory", "file_size", "core_size", "msgqueue")
_ZERO_MEANS_ZERO = ("core_size", "msgqueue")  # the others: 0 is "no limit"
# The least an env can start with: bwrap and the interpreter need a few
# tasks and a few dozen files before env.py runs.
_MINIMUM = {"pids": 8, "pool_pids": 8, "open_files": 32}
# Keys of the policy's [limits] (bounds on what crosses between the trainer and an env, not
# per-env kernel limits) that RLPool(limits={...}) may set for one pool, each at most the
# policy's own value, with the least each may be (tracebacks and error messages are strs too).
BOUNDS = {"max_str_len": 1024}


def host_tasks() -> int:
    """How many tasks this host can hold: every task needs a pid (kernel.pid_max)
    and a task_struct (kernel.threads-max), so the smaller of the two."""
    return min(int(Path("/proc/sys/kernel", name).read_text()) for name in ("pid_max", "threads-max"))


def task_count(value: Any, what: str = "env limit pool_pids") -> int:
    """A whole pool's task cap: a count, or "N%" of host_tasks(); always below
    host_tasks(). ValueError names `what` and the host's figures."""
    host = host_tasks()
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            share = float(value.strip()[:-1])
        except ValueError:
            share = -1.0
        if not 0 < share < 100:
            raise ValueError(f"{what} must be a count or a share below 100% like '25%', not {value!r}")
        value = int(host * share / 100)
    elif isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be a whole number of tasks or a share like '25%', not {value!r}")
    if value < _MINIMUM["pool_pids"]:
        raise ValueError(f"{what} must be at least {_MINIMUM['pool_pids']} tasks, not {value!r}")
    if value >= host:
        raise ValueError(
            f"{what}={value} is not below this host's task limit of {host} (the smaller of "
            "kernel.pid_max and kernel.threads-max): the pool could take every task of the host"
        )
    count: int = value
    return count


def resolve(table: dict[str, Any], overrides: dict[str, Any] | None = None, memory_limit: Any = None) -> dict[str, Any]:
    """The pool's env limits: the policy's [env_limits] `table` with `overrides`
    (RLPool(limits=...)) and `memory_limit` applied, checked. Raises
    ValueError/TypeError naming the key and what it accepts."""
    if overrides is not None and not isinstance(overrides, dict):
        raise TypeError(f"limits must be a dict like {{'pids': 64}}, not {type(overrides).__name__}")
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(table))
    if unknown:
        raise ValueError(
            f"unknown env limit(s) {unknown}; the policy's limits are {sorted(table)}, and a pool's bounds "
            f"{sorted(BOUNDS)}"
        )
    if memory_limit is not None:
        if overrides.get("memory", memory_limit) != memory_limit:
            raise ValueError("give memory_limit= or limits={'memory': ...}, not both")
        overrides["memory"] = memory_limit
    out = {}
    for key, value in {**table, **overrides}.items():
        if key == "straggler_grace":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"env limit straggler_grace must be a positive number of seconds, not {value!r}")
            out[key] = float(value)
        elif key in _SIZES:
            out[key] = 0 if value == 0 else parse_size(value)
        elif key == "pool_pids":
            out[key] = task_count(value)
        elif isinstance(value, bool) or not isinstance(value, int) or value < _MINIMUM.get(key, 1):
            raise ValueError(
                f"env limit {key} must be a whole number of at least {_MINIMUM.get(key, 1)}, not {value!r}"
            )
        else:
            out[key] = value
    return out


def split(overrides: Any) -> tuple[Any, dict[str, Any]]:
    """RLPool(limits=...) as (the env limits, for resolve(); the pool's BOUNDS keys, for bound()).
    Anything but a dict is left whole to resolve(), which names what it takes."""
    if not isinstance(overrides, dict) or not set(BOUNDS) & set(overrides):
        return overrides, {}
    env = {key: value for key, value in overrides.items() if key not in BOUNDS}
    return env, {key: value for key, value in overrides.items() if key in BOUNDS}


def bound(key: str, value: Any, ceiling: int) -> int:
    """A pool's `key` of BOUNDS (bytes, or a size like "512K"), at least BOUNDS[key] and at most
    `ceiling`, the policy's [limits] value. Above it is refused, never clamped: a pool sized
    for 8 MiB logs would otherwise fail its lanes at 4 MiB, far from the line that asked."""
    if value is None:
        return ceiling
    try:
        size = parse_size(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"limits[{key!r}] must be a size in bytes, like 524288 or '512K', not {value!r:.80}") from None
    if size < BOUNDS[key]:
        raise ValueError(f"limits[{key!r}]={size} is below the least a pool may have, {BOUNDS[key]} bytes")
    if size > ceiling:
        raise ValueError(
            f"limits[{key!r}]={size:,} bytes is over the sandbox policy's [limits] {key} of {ceiling:,} bytes, the "
            f"most a pool may ask for; ask for at most that, or run the pool under a policy that allows more (a copy "
            "of sandbox/policy.toml with a larger [limits] value, named by BOLTZLABS_POLICY: docs/limits.md)"
        )
    return size


def encode(limits: dict[str, Any], open_files: int | None = None) -> str:
    """The rlimits of `limits` as the text `apply` reads ("NOFILE=1024,..."),
    with `open_files` in place of the env's own when given (the template's)."""
    values = {key: limits[key] for key in RLIMITS if key in limits}
    if open_files is not None:
        values["open_files"] = max(values.get("open_files", 0), open_files)
    # A file size of 0 means "no limit" in the policy, not "no file at all".
    return ",".join(
        f"{RLIMITS[key][0]}={value if value or key in _ZERO_MEANS_ZERO else 'unlimited'}"
        for key, value in values.items()
    )
