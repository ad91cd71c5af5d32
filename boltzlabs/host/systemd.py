"""A cgroup of the worker's own from systemd: a transient scope with Delegate=yes.

    CgroupPool (cgroups.py), on cgroup v2 where systemd is the init and the
    worker's unit was not delegated
        --busctl: StartTransientUnit("boltzlabs-<pid>.scope", PIDs=[pid], Delegate=yes, ...)-->
            systemd (the system manager for root, the user's own manager otherwise)
        <-- the worker alone in .../boltzlabs-<pid>.scope, memory and pids its to hand down
    CgroupPool then makes its room there as in any delegated cgroup (cgroups._V2).

What this does is what podman's and crun's systemd cgroup manager do. The
systemd facts it rests on (systemd 252, Debian 12):
- systemd owns the cgroup of every unit. Below a unit that was not delegated
  it may move processes or remove cgroups, and it counts an OOM kill anywhere
  below a unit as the unit's: with the default OOMPolicy=stop one env killed
  at its memory_limit stops the whole unit, the trainer with it (exit 143).
  So the worker leaves the trainer's unit instead of making room in it.
- StartTransientUnit with PIDs=[pid] makes a scope and moves pid into it when
  its job runs; the call returns the job, not the move, so we wait for
  /proc/self/cgroup to name the scope. A user's manager moves a process out of
  a login session's scope (the system manager's) by asking the system manager.
- Delegate=yes: the scope's cgroup is the worker's (chowned to the user by a
  user's manager) with memory and pids to hand down. OOMPolicy=continue: an
  env's OOM kill is its lane's business. CollectMode=inactive-or-failed: the
  unit is unloaded once it stops, whether it ended well or not.
- A scope whose last process exits is stopped, and its cgroup removed with
  the empty cgroups below it: the scope goes when the worker and its guardian
  have exited, SIGKILL included. No AddRef: it ties a unit to the caller's bus
  connection, which is busctl's and ends with the call.
- busctl (systemd's own client) needs a bus: the system bus (dbus-daemon or
  dbus-broker) for root, the user's session bus ($DBUS_SESSION_BUS_ADDRESS or
  $XDG_RUNTIME_DIR/bus) for a user. systemd's private socket
  /run/systemd/private is no bus: busctl's Hello is refused there.
- systemd marks a delegated unit's cgroup with the xattrs trusted.delegate
  and user.delegate; a user's manager sets neither (252), so for a user's
  unit we ask the manager for the unit's Delegate property.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import time
from pathlib import Path

from boltzlabs.errors import CgroupUnavailable

BUSCTL = "busctl"
PREFIX = "boltzlabs-"  # the scopes the worker asks for: boltzlabs-<worker pid>.scope
OURS = re.compile(r"boltzlabs-\d+(-[0-9a-f]+)?\.scope")  # ... or boltzlabs-<pid>-<hex>.scope (own_scope)
_DEST, _OBJECT = "org.freedesktop.systemd1", "/org/freedesktop/systemd1"
_MANAGER = "org.freedesktop.systemd1.Manager"
CALL_TIMEOUT = 25.0  # busctl's own default method-call timeout (s)
MOVE_TIMEOUT = 30.0  # how long systemd may take to run the job that moves us (ms, usually)


def running() -> bool:
    """Whether systemd is this system's init (sd_booted(3)'s test)."""
    return Path("/run/systemd/system").is_dir()


def unit_of(group: Path, root: Path) -> Path | None:
    """The cgroup of the innermost unit (a .scope or .service) at or above `group`, below the
    hierarchy's root `root`; None where there is none (the root, a cgroup systemd did not make)."""
    for path in [group, *group.parents]:
        if path == root or not str(path).startswith(str(root)):
            return None
        if path.name.endswith((".scope", ".service")):
            return path
    return None


def delegated(unit: Path) -> bool:
    """Whether systemd delegated this unit's cgroup: its xattrs for the system manager's units,
    the unit's Delegate property for a user's (whose manager sets no xattr), or one of our own
    scopes (always asked for with Delegate=yes)."""
    try:
        if {"trusted.delegate", "user.delegate"} & set(os.listxattr(unit)):
            return True
    except OSError:
        pass
    if OURS.fullmatch(unit.name):
        return True
    if "/user@" not in str(unit) or os.geteuid() == 0:
        return False
    kind = "Scope" if unit.name.endswith(".scope") else "Service"
    try:
        out = _busctl(["get-property", _DEST, _unit_object(unit.name), f"org.freedesktop.systemd1.{kind}", "Delegate"])
    except CgroupUnavailable:
        return False
    return bool(out.get("data"))


def _unit_object(name: str) -> str:
    """The unit's D-Bus object path (sd-bus escapes every byte but [A-Za-z0-9] as _xx)."""
    return "/org/freedesktop/systemd1/unit/" + "".join(
        c if c.isascii() and c.isalnum() else f"_{ord(c):02x}" for c in name
    )


def _busctl(args: list[str]) -> dict[str, object]:
    """busctl on the manager's bus (the system's for root, the user's otherwise), its JSON answer;
    CgroupUnavailable with what busctl said when it fails."""
    argv = [BUSCTL, "--json=short", f"--timeout={CALL_TIMEOUT:g}"]
    argv += ["--system"] if os.geteuid() == 0 else ["--user"]
    try:
        out = subprocess.run(
            argv + args,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=CALL_TIMEOUT + 5,
        )
    except FileNotFoundError as exc:
        raise CgroupUnavailable(f"no {BUSCTL} on PATH (systemd's D-Bus client)") from exc
    except subprocess.TimeoutExpired as exc:
        raise CgroupUnavailable(f"{BUSCTL} got no answer in {CALL_TIMEOUT + 5:g} s") from exc
    if out.returncode != 0:
        said = (out.stderr.strip() or out.stdout.strip() or f"exit {out.returncode}").splitlines()[-1]
        raise CgroupUnavailable(f"{' '.join(argv[:1] + argv[3:] + args[:1])} on {bus()}: {said}")
    try:
        answer = json.loads(out.stdout or "{}")
    except ValueError as exc:
        raise CgroupUnavailable(f"{BUSCTL} answered what is not JSON: {out.stdout[:200]!r}") from exc
    return answer if isinstance(answer, dict) else {}


def bus() -> str:
    """The bus busctl uses here, as sd-bus finds it, in words."""
    if os.geteuid() == 0:
        return "the system bus " + os.environ.get("DBUS_SYSTEM_BUS_ADDRESS", "unix:path=/run/dbus/system_bus_socket")
    if os.environ.get("DBUS_SESSION_BUS_ADDRESS"):
        return "the session bus " + os.environ["DBUS_SESSION_BUS_ADDRESS"]
    if os.environ.get("XDG_RUNTIME_DIR"):
        return f"the session bus unix:path={os.environ['XDG_RUNTIME_DIR']}/bus"
    return "no session bus (neither DBUS_SESSION_BUS_ADDRESS nor XDG_RUNTIME_DIR is set: no login session)"


def manager() -> str:
    """Which systemd manager this process asks, in words."""
    return "the system manager" if os.geteuid() == 0 else f"the user manager of uid {os.geteuid()}"


def own_scope(root: Path, slice_: str | None) -> Path:
    """Move this process, alone, into a new delegated transient scope of systemd's, and return its
    cgroup (below `root`, the cgroup2 mount). `slice_`: the slice to make it in (None: the
    manager's default). CgroupUnavailable saying what systemd or busctl said, where it cannot."""
    pid = os.getpid()
    names = [f"{PREFIX}{pid}.scope", f"{PREFIX}{pid}-{secrets.token_hex(3)}.scope"]
    for attempt, name in enumerate(names):
        props = [
            "Description", "s", f"boltzlabs pool of worker {pid} (trainer {os.getppid()})",
            "PIDs", "au", "1", str(pid),
            "Delegate", "b", "true",
            "OOMPolicy", "s", "continue",
            "CollectMode", "s", "inactive-or-failed",
        ]  # fmt: skip
        if slice_:
            props += ["Slice", "s", slice_]
        try:
            _busctl(
                ["call", _DEST, _OBJECT, _MANAGER, "StartTransientUnit", "ssa(sv)a(sa(sv))", name, "fail"]
                + [str(len(props) // 3), *props, "0"]
            )
            break
        except CgroupUnavailable as exc:
            # A unit of that name still loaded (a worker of the same pid before, its guardian
            # not yet done): once more under a name of its own.
            if attempt == 0 and "exists" in str(exc):
                continue
            raise CgroupUnavailable(f"{manager()} gave no scope: {exc}") from exc
    deadline = time.monotonic() + MOVE_TIMEOUT
    while True:
        path = Path("/proc/self/cgroup").read_text().strip().split(":", 2)[2]
        if path.rstrip("/").endswith("/" + name):
            return root / path.lstrip("/")
        if time.monotonic() >= deadline:
            break
        time.sleep(0.005)
    try:
        state = _busctl(["get-property", _DEST, _unit_object(name), "org.freedesktop.systemd1.Unit", "ActiveState"])
        said = f"the unit is {state.get('data')}"
    except CgroupUnavailable as exc:
        said = str(exc)
    raise CgroupUnavailable(
        f"{manager()} made {name} but did not move this process into it within {MOVE_TIMEOUT:g} s ({said})"
    )
