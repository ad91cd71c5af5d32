"""What a remote client may ask of a worker: the listener's ceilings, applied by the worker.

    boltzlabs worker --listen --max-memory ... (boltzlabs/remote/listener.py) --ceilings JSON-->
    worker process --apply_ceilings(OPEN config)--> the config Worker.open uses, or ValueError

Runs in the worker (host). It sits below the listener so the worker never
imports the listener: the listener passes its ceilings on the command line.
"""

from __future__ import annotations

from boltzlabs.host import limits as _limits
from boltzlabs.host.policy import Policy
from boltzlabs.units import parse_size

__all__ = ["CEILINGS", "NO_LIMIT", "ceiling_value", "default_ceilings", "apply_ceilings"]

# -- what a remote client may ask for ------------------------------------------------------

# The listener's ceilings on what one remote pool may ask for, per env: the
# parameter (an [env_limits] key of sandbox/policy.toml, or an RLPool
# argument), its flag, its default and its kind. A client above one is
# refused before anything starts; a client that asks nothing gets the policy's
# default tightened to the ceiling ("no limit", as memory's default 0 is,
# becomes the ceiling). A limit a client may set and that has no ceiling
# here is refused outright (fail closed when the policy grows a key).
CEILINGS = {
    "memory": ("--max-memory", "1G", "size"),
    "workspace_size": ("--max-workspace", "256M", "size"),
    "pids": ("--max-pids", 256, "count"),
    # The whole pool's tasks (every env, the template, its probe): a count or a
    # share of the worker host's task limit (host/limits.py's task_count).
    "pool_pids": ("--max-pool-pids", "25%", "tasks"),
    "open_files": ("--max-open-files", 1024, "count"),
    "file_size": ("--max-file-size", "1G", "size"),
    "core_size": ("--max-core-size", "0", "size"),
    "straggler_grace": ("--max-straggler-grace", 60.0, "seconds"),
    "step_timeout": ("--max-step-timeout", 300.0, "seconds"),
    "start_timeout": ("--max-start-timeout", 300.0, "seconds"),
}
NO_LIMIT = ("memory", "file_size")  # where 0 means "no limit"


def default_ceilings() -> dict:
    """CEILINGS' defaults as numbers (bytes, counts, seconds)."""
    return {key: ceiling_value(key, default) for key, (_, default, _) in CEILINGS.items()}


def ceiling_value(key: str, value):
    """A ceiling given as text or a default (CEILINGS[key]) as a number, or None for none."""
    if value is None or str(value).lower() == "none":
        return None  # no ceiling: what the client asks goes (a private listener, e.g. a ClusterPool's)
    kind = CEILINGS[key][2]
    if kind == "size":
        return 0 if value in (0, "0") else parse_size(value)
    if kind == "tasks":
        text = str(value).strip()
        return _limits.task_count(int(text) if text.lstrip("-").isdigit() else text, CEILINGS[key][0])
    if kind == "count":
        value = int(value)
        if value < 1:
            raise ValueError(f"{CEILINGS[key][0]} must be at least 1")
        return value
    value = float(value)
    if not 0 < value < float("inf"):
        raise ValueError(f"{CEILINGS[key][0]} must be a positive number of seconds")
    return value


def _shown(key: str, value) -> str:
    kind = CEILINGS[key][2]
    if kind == "size":
        if value == 0:
            return "0 (no limit)" if key in NO_LIMIT else "0"
        for unit, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
            if value % (1 << shift) == 0:
                return f"{value} bytes ({value >> shift}{unit})"
        return f"{value} bytes"
    return f"{value:g}" if kind == "seconds" else str(value)


def _ceiling_shown(key: str, ceiling) -> str:
    kind = CEILINGS[key][2]
    if kind == "size":
        for unit, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
            if ceiling and ceiling % (1 << shift) == 0:
                return f"{ceiling >> shift}{unit}"
        return str(ceiling)
    return f"{ceiling:g} s" if kind == "seconds" else str(ceiling)


def _over(name: str, key: str, asked, ceiling) -> ValueError:
    flag = CEILINGS[key][0]
    return ValueError(
        f"{name}={_shown(key, asked)} is over this worker's ceiling of {_ceiling_shown(key, ceiling)} "
        f"({flag}); ask for less, or start the worker (boltzlabs worker) with a larger {flag}"
    )


def apply_ceilings(config: dict, ceilings: dict, policy: Policy) -> dict:
    """A remote client's OPEN config within the listener's `ceilings`
    (CEILINGS' keys, as numbers), for Worker.open. Raises ValueError naming
    the parameter, what was asked, the ceiling and its flag; returns the
    config with every limit explicit (policy defaults tightened to the
    ceilings)."""
    out = dict(config)
    asked = config.get("limits")
    if asked is not None and not isinstance(asked, dict):
        raise TypeError(f"limits must be a dict like {{'pids': 64}}, not {type(asked).__name__}")
    asked = dict(asked or {})
    names = {key: f"limits[{key!r}]" for key in asked}
    if config.get("memory_limit") is not None:
        if asked.get("memory", config["memory_limit"]) != config["memory_limit"]:
            raise ValueError("give memory_limit= or limits={'memory': ...}, not both")
        asked["memory"] = config["memory_limit"]
        names["memory"] = "memory_limit"
    resolved = _limits.resolve(policy.env_limits_table(), asked)  # types and minimums
    for key, value in resolved.items():
        if key not in ceilings:
            if key in asked:
                raise ValueError(f"this worker does not let a remote client set {names[key]}; leave it out")
            continue
        ceiling = ceilings[key]
        if ceiling is None:
            continue
        over = (value == 0 and key in NO_LIMIT and ceiling != 0) or value > ceiling
        if over and key in asked:
            raise _over(names[key], key, value, ceiling)
        if over:
            resolved[key] = ceiling
    out["limits"], out["memory_limit"] = resolved, None

    inf = float("inf")
    workspace, ceiling = config.get("workspace_size"), ceilings.get("workspace_size") or inf
    if workspace is None:
        workspace = min(policy.default_workspace_size(), ceiling)
    elif isinstance(workspace, bool) or not isinstance(workspace, int) or workspace <= 0:
        raise ValueError(f"workspace_size must be a positive number of bytes, not {workspace!r}")
    elif workspace > ceiling:
        raise _over("workspace_size", "workspace_size", workspace, ceiling)
    out["workspace_size"] = workspace

    limits = policy.pool_limits()
    for key, default in (("step_timeout", limits.step_timeout), ("start_timeout", limits.start_timeout)):
        value, ceiling = config.get(key), ceilings.get(key) or inf
        if value is None:
            out[key] = min(default, ceiling)
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < inf:
            raise ValueError(f"{key} must be a positive number of seconds, not {value!r}")
        if value > ceiling:
            raise _over(key, key, value, ceiling)
        out[key] = float(value)
    return out
