"""The sandbox policy as data: sandbox/policy.toml, mounts/*.toml and sandbox/seccomp.toml, read and located.

    sandbox/policy.toml + mounts/*.toml + sandbox/seccomp.toml --load_policy()--> Policy
        --> plan.compile_plan (what every sandbox is made of), limits.resolve
        --> Policy.reader() / pool_limits() / identity() / ...: every other read, typed

Runs on the host (worker, and the trainer's early checks). The policy files
are the reviewable part (what an env may see and do); this module finds them
in the installation and reads them. Every value is read through Reader,
whose failures name the key and the file; no module outside boltzlabs/host/
indexes the policy's tables (tests/test_layout.py checks it), and no
default lives in code: each key and its default are in sandbox/policy.toml.
"""

from __future__ import annotations

import os
import shutil
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from boltzlabs.errors import PolicyError, SandboxUnavailable
from boltzlabs.wire import MAX_DEPTH
from boltzlabs.host import limits as _limits
from boltzlabs.units import parse_size

__all__ = [
    "PACKAGE_DIR",
    "MOUNT_PROFILES",
    "Policy",
    "PoolLimits",
    "Reader",
    "load_policy",
    "find_bwrap",
    "parse_size",
    "compile_sandbox_code",
]

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # the boltzlabs package (bound into every sandbox)
MOUNT_PROFILES = ("system", "interpreter", "runtime", "env")


def compile_sandbox_code() -> None:
    """Byte-compile, on the host, what every sandbox imports from this package
    (boltzlabs/runtime/ and the package's top-level modules), best effort.

    The package is bound read-only into every sandbox, where Python cannot
    write __pycache__: a module without a current .pyc (an editable install or
    a fresh checkout whose host side never imported it) is compiled from
    source by every template and every exec-mode env, and each env forked from
    the template carries the compiler's leftovers in pages it copies: measured
    ~80 KiB more private memory per env with runtime/serve.py uncompiled. An
    up-to-date .pyc costs one stat here; a directory we cannot write is left
    as it is (a wheel installed by pip carries its .pyc files already).
    """
    import compileall

    try:
        compileall.compile_dir(PACKAGE_DIR, maxlevels=0, quiet=2)
        compileall.compile_dir(PACKAGE_DIR / "runtime", maxlevels=1, quiet=2)  # and runtime/gym_env
    except OSError:
        pass


def _data_dir(name: str) -> Path:
    # Installed wheels carry sandbox/ and mounts/ inside the package; a source
    # checkout has them beside it.
    for candidate in (PACKAGE_DIR / "_data" / name, PACKAGE_DIR.parent / name):
        if candidate.is_dir():
            return candidate
    raise SandboxUnavailable(f"the boltzlabs installation is missing its {name}/ policy data; reinstall boltzlabs")


class Reader:
    """Typed reads of the policy's tables (sandbox/policy.toml), each failure naming its key and file.

    Every read of the policy goes through one of these (Policy.reader(),
    and the typed accessors on Policy built on it): a key the file lacks, a
    value of the wrong type or out of its range is a PolicyError
    that names the key, the file and the fix. No default lives in code: an
    operator's policy.toml is a whole copy of the shipped one."""

    def __init__(self, policy: Policy):
        self.policy: Policy = policy  # what is read
        self.source: str = policy.path or "sandbox/policy.toml"  # the file, for error messages

    def fail(self, key: str, what: str, value: Any) -> PolicyError:
        hint = (
            "fix it, or unset BOLTZLABS_POLICY to use the shipped one"
            if os.environ.get("BOLTZLABS_POLICY")
            else "fix it, or reinstall boltzlabs"
        )
        if value is _MISSING:
            return PolicyError(
                f"the sandbox policy {self.source} has no {key}; it must be {what} "
                f"(sandbox/policy.toml has each key with its comment); {hint}"
            )
        return PolicyError(f"the sandbox policy {self.source}: {key} must be {what}, not {value!r}; {hint}")

    def table(self, table: str) -> dict[str, Any]:
        """The table [table] (dotted: "quotas.user_namespace"), which must be there."""
        node: object = self.policy.sandbox
        for part in table.split("."):
            node = node.get(part, _MISSING) if isinstance(node, dict) else _MISSING
        if not isinstance(node, dict):
            raise self.fail(f"[{table}]", "a table", node)
        return node

    def get(self, table: str, name: str, what: str = "set") -> Any:
        """[table] name, whatever its type (the callers below check it); `what`: what it must be, if missing."""
        node = self.table(table)
        if name not in node:
            raise self.fail(f"[{table}] {name}", what, _MISSING)
        return node[name]

    def integer(self, table: str, name: str, low: int, high: int = 1 << 62) -> int:
        what = f"a whole number from {low} to {high}"
        value = self.get(table, name, what)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise self.fail(f"[{table}] {name}", what, value)
        return value

    def number(self, table: str, name: str) -> float:
        what = "a number of seconds, 0 or more"
        value = self.get(table, name, what)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
            raise self.fail(f"[{table}] {name}", what, value)
        return float(value)

    def flag(self, table: str, name: str) -> bool:
        value = self.get(table, name, "true or false")
        if not isinstance(value, bool):
            raise self.fail(f"[{table}] {name}", "true or false", value)
        return value

    def path(self, table: str, name: str) -> str:
        what = "an absolute path (normalized, not /, no ',')"
        value = self.get(table, name, what)
        if (
            not isinstance(value, str)
            or not value.startswith("/")
            or os.path.normpath(value) != value
            or value == "/"
            or any(c in value for c in ",\n\0")
        ):
            raise self.fail(f"[{table}] {name}", what, value)
        return value

    def names(self, table: str, name: str) -> tuple[str, ...]:
        value = self.get(table, name, "a list of strings")
        if not isinstance(value, list) or not all(isinstance(v, str) and v and "\n" not in v for v in value):
            raise self.fail(f"[{table}] {name}", "a list of strings", value)
        return tuple(value)

    def size(self, table: str, name: str) -> int:
        """A positive size in bytes, written as a number or like "64M"."""
        what = 'a positive size like "64M"'
        value = self.get(table, name, what)
        try:
            size = parse_size(value)
        except (TypeError, ValueError):
            raise self.fail(f"[{table}] {name}", what, value) from None
        if size <= 0:
            raise self.fail(f"[{table}] {name}", what, value)
        return size


_MISSING = object()  # a key or table the policy lacks


@dataclass(frozen=True)
class PoolLimits:
    """[limits] of the policy, typed: deadlines and the bounds on what an env sends (the comments in
    sandbox/policy.toml say what each bounds)."""

    step_timeout: float
    start_timeout: float
    max_frame: int
    max_str_len: int
    max_bin_len: int
    max_array_len: int
    max_map_len: int
    max_objects_per_frame: int
    max_depth: int
    max_hello: int
    max_hello_objects: int
    max_pool_bytes: int
    log_tail: int


@dataclass(frozen=True)
class Policy:
    """The sandbox policy, every file read once: sandbox/policy.toml (`sandbox`,
    from `path`), the mount profiles (`mounts`) and sandbox/seccomp.toml (`seccomp`)."""

    sandbox: dict[str, Any]
    mounts: dict[str, Any]  # profile name -> list of mount entries
    seccomp: dict[str, Any] = field(default_factory=dict)
    path: str = ""

    def reader(self) -> Reader:
        """Typed reads of sandbox/policy.toml, each failure naming its key and this file."""
        return Reader(self)

    def pool_limits(self) -> PoolLimits:
        """[limits], every key checked (a whole number or seconds, in its range)."""
        read = self.reader()

        def count(name: str) -> int:
            return read.integer("limits", name, 1)

        return PoolLimits(
            step_timeout=read.number("limits", "step_timeout"),
            start_timeout=read.number("limits", "start_timeout"),
            max_frame=count("max_frame"),
            max_str_len=count("max_str_len"),
            max_bin_len=count("max_bin_len"),
            max_array_len=count("max_array_len"),
            max_map_len=count("max_map_len"),
            max_objects_per_frame=count("max_objects_per_frame"),
            # Replies are re-encoded a few levels deeper than they came: within msgpack's own limit.
            max_depth=read.integer("limits", "max_depth", 1, MAX_DEPTH),
            max_hello=count("max_hello"),
            max_hello_objects=count("max_hello_objects"),
            max_pool_bytes=count("max_pool_bytes"),
            log_tail=read.integer("limits", "log_tail", 0),
        )

    def env_limits_table(self) -> dict[str, Any]:
        """[env_limits] as written (boltzlabs.host.limits.resolve checks each value)."""
        return self.reader().table("env_limits")

    def env_limits(self, overrides: dict[str, Any] | None = None, memory_limit: Any = None) -> dict[str, Any]:
        """[env_limits] with a pool's overrides, checked (boltzlabs.host.limits.resolve)."""
        return _limits.resolve(self.env_limits_table(), overrides, memory_limit)

    def identity(self) -> dict[str, Any]:
        """[identity]: the host account every sandbox runs as (boltzlabs.host.identity.host_account)."""
        return self.reader().table("identity")

    def default_workspace_size(self) -> int:
        """[workspace] default_size in bytes: what a pool gets without RLPool(workspace_size=)."""
        return self.reader().size("workspace", "default_size")


def load_policy() -> Policy:
    """Read the policy shipped with this installation.

    `BOLTZLABS_POLICY=/path/policy.toml` in the environment of the process
    that starts the worker (the trainer, or `boltzlabs worker --listen`) puts
    an operator's own policy.toml in place of the shipped one, whole: start
    from a copy of sandbox/policy.toml. `BOLTZLABS_SECCOMP=/path/seccomp.toml`
    does the same for the seccomp filter's deny list (start from a copy of
    sandbox/seccomp.toml: an env that needs a call the shipped list refuses,
    or a host that wants more refused). The mount profiles stay the
    installation's. Nothing else reads these files: the worker compiles this
    Policy into each pool's plan (boltzlabs.host.plan)."""
    path = os.environ.get("BOLTZLABS_POLICY") or _data_dir("sandbox") / "policy.toml"
    sandbox = _read(path, "BOLTZLABS_POLICY")
    mounts = {profile: _read(_data_dir("mounts") / f"{profile}.toml") for profile in MOUNT_PROFILES}
    seccomp_path = os.environ.get("BOLTZLABS_SECCOMP") or _data_dir("sandbox") / "seccomp.toml"
    seccomp = _read(seccomp_path, "BOLTZLABS_SECCOMP")
    return Policy(sandbox, mounts, seccomp, str(path))


def _read(path: Any, variable: str | None = None) -> dict[str, Any]:
    """A policy file as TOML; PolicyError naming it (and `variable`, the
    environment variable that can name an operator's own file instead) if not."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        if variable and os.environ.get(variable):
            fix = f"fix it, or unset {variable} to use the shipped one"
        else:
            fix = "reinstall boltzlabs"
        raise PolicyError(f"cannot read the sandbox policy file {path} ({exc}); {fix}") from exc


def find_bwrap() -> str:
    """The path of bwrap, or SandboxUnavailable saying how to install it."""
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxUnavailable(
            "bubblewrap (bwrap) is not installed; on Debian/Ubuntu run: sudo apt-get install -y bubblewrap"
        )
    return path
