"""Per-env resource limits: policy data in, kernel limits on every env process.

    sandbox/policy.toml [env_limits] + RLPool(limits=...) --resolve()--> limits (worker)
        memory, pids        --> the env's cgroup (boltzlabs/cgroups.py)
        straggler_grace     --> the worker's deadline kill (boltzlabs/worker.py)
        open_files, file_size, core_size, msgqueue --encode()--> $BOLTZLABS_RLIMITS
            --apply()--> setrlimit inside the sandbox, before any env code runs:
                exec mode:     `python -c BOOTSTRAP /env/env.py` (boltzlabs.confine.main)
                template mode: the template before it imports env.py, and each
                               child again right after its fork (template.py)

rlimits are per process and inherited by every child; a process may lower
its own hard limit but never raise it without CAP_SYS_RESOURCE, which no env
holds. So setting soft = hard before env.py is imported makes them binding
on the env and everything it starts.

The in-sandbox part (apply, main) imports the standard library only: every
env pays for what it imports.
"""

from __future__ import annotations

import os
import resource
import sys

VARIABLE = "BOLTZLABS_RLIMITS"

# Policy key -> resource. Values are bytes (sizes) or counts.
RLIMITS = {
    "open_files": ("NOFILE", resource.RLIMIT_NOFILE),
    "file_size": ("FSIZE", resource.RLIMIT_FSIZE),
    "core_size": ("CORE", resource.RLIMIT_CORE),
    "msgqueue": ("MSGQUEUE", resource.RLIMIT_MSGQUEUE),
}
_BY_NAME = {name: number for name, number in RLIMITS.values()}
_SIZES = ("memory", "file_size", "core_size", "msgqueue")
_ZERO_MEANS_ZERO = ("core_size", "msgqueue")  # the others: 0 is "no limit"
# The least an env can start with: bwrap and the interpreter need a few
# tasks and a few dozen files before env.py runs.
_MINIMUM = {"pids": 8, "open_files": 32}


def resolve(table: dict, overrides: dict | None = None, memory_limit=None) -> dict:
    """The pool's env limits: the policy's [env_limits] `table` with `overrides`
    (RLPool(limits=...)) and `memory_limit` applied, checked. Raises
    ValueError/TypeError naming the key and what it accepts."""
    from boltzlabs.sandbox import parse_size

    if overrides is not None and not isinstance(overrides, dict):
        raise TypeError(f"limits must be a dict like {{'pids': 64}}, not {type(overrides).__name__}")
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(table))
    if unknown:
        raise ValueError(f"unknown env limit(s) {unknown}; the policy's limits are {sorted(table)}")
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
        elif isinstance(value, bool) or not isinstance(value, int) or value < _MINIMUM.get(key, 1):
            raise ValueError(f"env limit {key} must be a whole number of at least {_MINIMUM.get(key, 1)}, "
                             f"not {value!r}")
        else:
            out[key] = value
    return out


def encode(limits: dict, open_files: int | None = None) -> str:
    """The rlimits of `limits` as the text `apply` reads ("NOFILE=1024,..."),
    with `open_files` in place of the env's own when given (the template's)."""
    values = {key: limits[key] for key in RLIMITS if key in limits}
    if open_files is not None:
        values["open_files"] = max(values.get("open_files", 0), open_files)
    # A file size of 0 means "no limit" in the policy, not "no file at all".
    return ",".join(f"{RLIMITS[key][0]}={value if value or key in _ZERO_MEANS_ZERO else 'unlimited'}"
                    for key, value in values.items())


def parse(text: str | None) -> list[tuple[int, int]]:
    """[(RLIMIT_* number, value)] from the "name=value,..." text of VARIABLE."""
    parsed = []
    for item in (text or "").split(","):
        if item:
            name, _, value = item.partition("=")
            parsed.append((_BY_NAME[name], resource.RLIM_INFINITY if value == "unlimited" else int(value)))
    return parsed


def apply_parsed(parsed: list[tuple[int, int]]) -> None:
    """setrlimit(soft = hard = value) for each (number, value). Never raises a
    hard limit (the env may have lowered one already; that binds it)."""
    for number, want in parsed:
        _, hard = resource.getrlimit(number)
        if hard != resource.RLIM_INFINITY and (want == resource.RLIM_INFINITY or want > hard):
            want = hard
        resource.setrlimit(number, (want, want))


def apply(text: str | None) -> None:
    """apply_parsed(parse(text))."""
    apply_parsed(parse(text))


def run(argv=None) -> None:
    """Exec mode: run env.py as __main__ (as `python /env/env.py` would; runpy
    would cost every env ~5 ms of imports). boltzlabs.confine.main calls it."""
    argv = sys.argv[1:] if argv is None else argv
    path = argv[0]
    sys.argv = argv
    sys.path[0] = os.path.dirname(path)  # -c put the working directory there
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec")
    module = type(sys)("__main__")
    module.__file__ = path
    module.__builtins__ = __builtins__
    sys.modules["__main__"] = module
    exec(code, module.__dict__)
