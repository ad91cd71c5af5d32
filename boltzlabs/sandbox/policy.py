"""The sandbox policy as data: sandbox/policy.toml, mounts/*.toml and sandbox/seccomp.toml, read and located.

    sandbox/policy.toml + mounts/*.toml + sandbox/seccomp.toml --load_policy()--> Policy
        --> plan.compile_plan (what every sandbox is made of), limits.resolve

Runs on the host (worker, and the trainer's early checks). The policy files
are the reviewable part (what an env may see and do); this module finds them
in the installation and reads them, and nothing more.
"""

from __future__ import annotations

import os
import shutil
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from boltzlabs.errors import PolicyError, SandboxUnavailable
from boltzlabs.sandbox import limits as _limits
from boltzlabs.units import parse_size

__all__ = ["PACKAGE_DIR", "MOUNT_PROFILES", "Policy", "load_policy", "find_bwrap", "parse_size", "compile_sandbox_code"]

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


@dataclass(frozen=True)
class Policy:
    """The sandbox policy, every file read once: sandbox/policy.toml (`sandbox`,
    from `path`), the mount profiles (`mounts`) and sandbox/seccomp.toml (`seccomp`)."""

    sandbox: dict[str, Any]
    mounts: dict[str, Any]  # profile name -> list of mount entries
    seccomp: dict[str, Any] = field(default_factory=dict)
    path: str = ""

    @property
    def limits(self) -> dict[str, Any]:
        """[limits]: deadlines and the bounds on what an env sends."""
        limits: dict[str, Any] = self.sandbox["limits"]
        return limits

    def env_limits(self, overrides: dict[str, Any] | None = None, memory_limit: Any=None) -> dict[str, Any]:
        """[env_limits] with a pool's overrides, checked (boltzlabs.sandbox.limits.resolve)."""
        return _limits.resolve(self.sandbox.get("env_limits", {}), overrides, memory_limit)


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
    Policy into each pool's plan (boltzlabs.sandbox.plan)."""
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
            "bubblewrap (bwrap) is not installed; on Debian/Ubuntu run: sudo apt-get install -y bubblewrap")
    return path
