"""The seccomp filter: sandbox/seccomp.toml in, BPF programs out, and how they are loaded.

    host (worker): seccomp.toml --policy.load_policy()--> rules --compile_rules(), libseccomp--> Filters(env, template)
    spawn="exec":     Filters.env      --fd FILTER_FD--> bwrap --seccomp: every env's interpreter
    spawn="template": Filters.template --fd FILTER_FD--> bwrap --seccomp: the template (before env.py)
                      Filters.env      --fd CHILD_FILTER_FD--> template --apply()--> each forked env,
                                       after its namespace set-up and before any env code

This module is the host half: compilation happens on the host only, through
pyseccomp, a ctypes binding of the system's libseccomp.so.2 (`import
pyseccomp` is deferred to it). What runs inside a sandbox
(boltzlabs/runtime/filter.py) is standard library only and loads
precompiled bytes with prctl(2): nothing in the sandbox needs libseccomp.

Kernel facts this depends on:
- Filters stack and are inherited across fork and execve; a process can add
  filters, never remove one. So the template's looser filter binds every env
  it forks, and each env's full filter adds to it.
- Loading a filter without CAP_SYS_ADMIN requires no_new_privs, which the
  env set when it dropped its capabilities (set again here, idempotently).
- The kernel runs every filter on every syscall; the strictest action wins.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from dataclasses import dataclass
from typing import Any

from boltzlabs import abi
from boltzlabs.errors import SandboxUnavailable, SeccompPolicyError

__all__ = ["Filters", "compile_rules", "compile_filter", "program_fd"]


_BPF_MAXINSNS = 4096
_INSTRUCTION = abi.BPF_INSTRUCTION


@dataclass(frozen=True)
class Filters:
    """The compiled programs (classic BPF, struct sock_filter[]): `env` binds
    every env; `template` (env less [template].allow) binds the template."""

    env: bytes
    template: bytes


def compile_rules(rules: dict[str, Any]) -> Filters:
    """Both programs of a parsed seccomp.toml (Policy.seccomp, read by
    boltzlabs.host.policy.load_policy with the rest of the policy)."""
    return Filters(env=compile_filter(rules), template=compile_filter(rules, template=True))


def _libseccomp() -> Any:
    try:
        import pyseccomp
    except (ImportError, RuntimeError, OSError) as exc:  # RuntimeError: pyseccomp found no libseccomp
        raise SandboxUnavailable(
            f"the seccomp filter needs libseccomp, which could not be loaded ({exc}); on Debian/Ubuntu run: "
            "sudo apt-get install -y libseccomp2, then pip install pyseccomp"
        ) from None
    return pyseccomp


def _errno(name: Any, where: str) -> int:
    value = getattr(errno, str(name), None)
    if not isinstance(value, int):
        raise SeccompPolicyError(f"{where}: unknown errno {name!r}; use a name from the errno module, like 'EPERM'")
    return value


def _value(value: Any, constants: dict[str, Any], where: str) -> int:
    if isinstance(value, str):
        if value not in constants:
            raise SeccompPolicyError(f"{where}: {value!r} is not defined in [constants]")
        value = constants[value]
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 64:
        raise SeccompPolicyError(f"{where}: {value!r} is not a 64-bit unsigned integer")
    return value


def _conditions(sc: Any, when: Any, constants: dict[str, Any], where: str) -> list[tuple[Any, ...]]:
    """A rule's `when` as alternatives, each a tuple of libseccomp comparisons."""
    if when is None:
        return [()]
    if not isinstance(when, dict) or not isinstance(when.get("arg"), int) or not 0 <= when["arg"] <= 5:
        raise SeccompPolicyError(f"{where}: `when` needs arg = 0..5 and one comparison")
    arg = when["arg"]
    if "any_bit" in when:  # one alternative per bit: libseccomp ORs rules, ANDs comparisons
        return [
            (sc.Arg(arg, sc.MASKED_EQ, bit, bit),) for bit in (_value(b, constants, where) for b in when["any_bit"])
        ]
    if "not_equal" in when:
        return [(sc.Arg(arg, sc.NE, _value(when["not_equal"], constants, where)),)]
    if "equals" in when:
        value = _value(when["equals"], constants, where)
        if "mask" in when:
            return [(sc.Arg(arg, sc.MASKED_EQ, _value(when["mask"], constants, where), value),)]
        return [(sc.Arg(arg, sc.EQ, value),)]
    raise SeccompPolicyError(f"{where}: `when` needs one of equals, not_equal or any_bit")


def compile_filter(rules: dict[str, Any], *, template: bool = False) -> bytes:
    """Compile a parsed seccomp.toml to a BPF program for this machine's ABI.

    `template=True` leaves out the syscalls in [template].allow."""
    sc = _libseccomp()
    constants = rules.get("constants", {})
    allowed = set(rules.get("template", {}).get("allow", [])) if template else set()
    known = {name for rule in rules.get("deny", []) for name in rule.get("syscalls", [])}
    if allowed - known:
        raise SeccompPolicyError(
            f"seccomp.toml [template].allow names {sorted(allowed - known)}, which no [[deny]] rule lists"
        )
    program = sc.SyscallFilter(sc.ALLOW)
    try:  # a binary tree on the syscall number: ~12 instructions per allowed call, not ~50
        program.set_attr(sc.Attr.CTL_OPTIMIZE, 2)
    except OSError:
        pass  # libseccomp < 2.5.0: a linear program, slower but the same verdicts
    program.set_attr(
        sc.Attr.ACT_BADARCH,
        sc.ERRNO(_errno(rules.get("abi", {}).get("foreign", "ENOSYS"), "seccomp.toml [abi].foreign")),
    )
    for index, rule in enumerate(rules.get("deny", [])):
        where = f"seccomp.toml [[deny]] #{index + 1} ({rule.get('why', 'no why')!r})"
        action = sc.ERRNO(_errno(rule.get("errno"), where))
        names = rule.get("syscalls")
        if not names or not all(isinstance(n, str) for n in names):
            raise SeccompPolicyError(f"{where}: `syscalls` must be a non-empty list of names")
        alternatives = _conditions(sc, rule.get("when"), constants, where)
        for name in names:
            number = sc.resolve_syscall(sc.Arch.NATIVE, name)
            if number == -1:  # __NR_SCMP_ERROR: no architecture has it
                raise SeccompPolicyError(f"{where}: libseccomp knows no system call named {name!r}")
            if name in allowed:
                continue
            for comparisons in alternatives:
                try:
                    program.add_rule(action, name, *comparisons)
                except OSError as exc:
                    raise SeccompPolicyError(f"{where}: libseccomp refused the rule for {name!r}: {exc}") from exc
    read_fd, write_fd = os.pipe()
    try:
        with os.fdopen(write_fd, "wb") as out:
            program.export_bpf(out)
        data = _read_all(read_fd)
    finally:
        os.close(read_fd)
    if not data or len(data) % _INSTRUCTION or len(data) // _INSTRUCTION > _BPF_MAXINSNS:
        raise SeccompPolicyError(f"libseccomp produced a program of {len(data)} bytes, which the kernel would refuse")
    return data


@contextlib.contextmanager
def program_fd(program: bytes) -> Any:
    """`with program_fd(program) as fd:` a sealed memfd holding `program` at
    offset 0, at fd >= 10 (so that dup2 onto FILTER_FD and CHILD_FILTER_FD in
    a spawned process never overwrites a source), closed on exit."""
    fd = os.memfd_create("boltzlabs-seccomp", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.write(fd, program)
        os.lseek(fd, 0, os.SEEK_SET)
        fcntl.fcntl(
            fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
        )
        high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    finally:
        os.close(fd)
    try:
        yield high
    finally:
        os.close(high)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)
