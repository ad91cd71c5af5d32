"""A scrub: what `reset(scrub=True)` does inside a sandbox before the env's own reset.

    worker --[RESET, seq, seed, options, True]--> serve loop --> scrub() --> your reset(seed, options)
                                                                  │ 1. SIGKILL every other process of the
                                                                  │    sandbox's pid namespace, reaped
                                                                  │ 2. empty the workspace and /dev/shm
                                                                  └ 3. remove every SysV IPC object

For envs whose action is code (docs/code-rl.md): a process an action left
running (a `setsid` writer, a forked server) or a file it left in the
workspace would otherwise reach the next episode, and only a hard reset
(a new sandbox) removed them. A scrub keeps the sandbox, its server process
and everything that process holds in memory (imports, the env object).

Why from inside: the sandbox's server is pid 1 of its pid namespace in
template mode (pid 2 under bubblewrap's init in exec mode), so `kill(-1,
SIGKILL)` reaches every other process of the sandbox and nothing outside it
(the namespace holds no other), and a process can neither block SIGKILL nor
leave the namespace (seccomp and the user-namespace quotas forbid new ones).
The worker then counts the lane's cgroup from outside (worker/requests.py):
a scrub that left a process is refused and the lane killed. The workspace is
emptied by the server, which is the only process left: nothing can race the
walk (no rename or symlink swap), and the walk keeps one directory open at a
time, so neither a tree deeper than the fd limit nor one past PATH_MAX stops it.

Imports only the standard library and `abi` (ctypes is abi's already): rlimits
imports it, so a template's children share it and an exec-mode env pays ~0.1 ms.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time

from boltzlabs import abi
from boltzlabs.errors import ScrubError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

# How long the kill loop waits while every process left is in the kernel's uninterruptible
# sleep (it cannot die until it wakes) before the scrub fails: the lane then needs a hard reset.
# A process that is runnable, or a zombie not yet reaped, is on its way out and is waited for:
# it needs a core to exit, and on a loaded node (1000 busy sandboxes, each one share of the
# CPU) it may wait seconds for one. The worker's deadline for the reset bounds the whole wait.
KILL_SECONDS = 5.0
# The sandbox's workspace: the cwd the set-up left when rlimits.run began, before any env code.
workspace = ""
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_IPC_RMID = 0


def scrub(workspace: str, ipc: bool = False) -> dict[str, Any]:
    """Kill every other process of this sandbox, empty `workspace` (and /dev/shm when it is the
    same tmpfs) and, with `ipc` (the sandbox has an IPC namespace of its own), remove every SysV
    IPC object; back in `workspace` as the cwd. Returns what was removed: {"processes": n,
    "entries": n, "ipc": n, "seconds": s}."""
    started = time.monotonic()
    processes = _kill_others(started + KILL_SECONDS)
    entries = 0
    device = _chmod_open(workspace)
    for path in (workspace, "/dev/shm"):
        try:
            if path != workspace and os.stat(path).st_dev != device:
                continue  # not the workspace's tmpfs (a policy without it): nothing of ours
        except FileNotFoundError:
            continue
        entries += _empty(path)
    os.chdir(workspace)
    removed = _remove_ipc() if ipc else 0
    return {"processes": processes, "entries": entries, "ipc": removed, "seconds": time.monotonic() - started}


def asked(what: Any) -> dict[str, Any]:
    """The scrub of this sandbox's workspace that a RESET frame's scrub field asks for:
    {"ipc": bool} (whether the sandbox's IPC namespace is its own, so its objects go too)."""
    return scrub(workspace, ipc=type(what) is dict and what.get("ipc") is True)


def _kill_others(deadline: float) -> int:
    """SIGKILL every process of the pid namespace but this one and pid 1 until none is left
    (kill(-1) fails with ESRCH once it reaches none), reaping our children; how many there were.
    A zombie still counts for kill(-1) until its parent (we, or bubblewrap's init) reaps it."""
    others = sum(1 for name in os.listdir("/proc") if name.isdigit()) - 1 - (os.getpid() != 1)
    pause = 0.0002
    while True:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            return max(others, 0)
        _reap()
        now = time.monotonic()
        if now >= deadline:
            states = _states()
            if not _stuck(states):
                deadline = now + KILL_SECONDS  # still dying, waiting for a core: wait on
            else:
                raise ScrubError(
                    f"{len(states)} process(es) of the sandbox did not die within {KILL_SECONDS:g} s of SIGKILL "
                    "(in the kernel's uninterruptible sleep); reset the env with hard=True"
                )
        time.sleep(pause)
        pause = min(pause * 2, 0.01)


def _stuck(states: dict[int, str]) -> bool:
    """Whether the processes left (_states()) cannot die now: every one in uninterruptible sleep.
    A runnable one (R), one going to sleep or waking (S), a zombie (Z) are on their way out."""
    return bool(states) and all(state == "D" for state in states.values())


def _states() -> dict[int, str]:
    """{pid: its state letter (R, S, D, Z, ...)} of every process of the pid namespace but this
    one and pid 1."""
    states = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) not in (1, os.getpid()):
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    states[int(name)] = f.read().rsplit(b")", 1)[1].split()[0].decode()
            except (OSError, IndexError):
                pass  # gone meanwhile
    return states


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _chmod_open(path: str) -> int:
    """The workspace's device; its own mode back to 0700 (an action may have taken it away)."""
    os.chmod(path, 0o700)
    return os.stat(path).st_dev


def _empty(path: str) -> int:
    """Remove everything below the directory `path`, depth first, keeping one directory fd open
    (the parent is reached again by ".."); how many entries were removed. Each directory is made
    0700 before it is opened: we own every entry (one uid in the sandbox) but have no capability
    that would pass a mode an action set."""
    removed = 0
    current = os.open(path, _DIRECTORY)
    try:
        names = [os.listdir(current)]  # what is left to remove in each directory on the way down
        below: list[str] = []  # the name of each directory on the way down
        while names:
            if names[-1]:
                name = names[-1].pop()
                try:
                    os.unlink(name, dir_fd=current)
                    removed += 1
                    continue
                except FileNotFoundError:
                    continue
                except IsADirectoryError:
                    pass
                os.chmod(name, 0o700, dir_fd=current)  # a directory (unlink said so); nothing else runs
                child = os.open(name, _DIRECTORY | os.O_NOFOLLOW, dir_fd=current)
                os.close(current)
                current = child
                below.append(name)
                names.append(os.listdir(current))
                continue
            names.pop()
            if not below:
                break
            parent = os.open("..", _DIRECTORY, dir_fd=current)
            os.close(current)
            current = parent
            os.rmdir(below.pop(), dir_fd=current)
            removed += 1
    except OSError as exc:
        raise ScrubError(f"could not empty {path}: {exc}; reset the env with hard=True") from None
    finally:
        os.close(current)
    return removed


def _remove_ipc() -> int:
    """Remove every SysV shared memory segment, semaphore set and message queue of the sandbox's
    IPC namespace (called only when it is its own: the policy unshares ipc); how many."""
    removed = 0
    for kind, call in (("shm", "shmctl"), ("sem", "semctl"), ("msg", "msgctl")):
        try:
            with open(f"/proc/sysvipc/{kind}", "rb") as table:
                lines = table.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 2:
                continue
            ident = ctypes.c_int(int(fields[1]))
            if kind == "sem":
                result = getattr(abi.libc, call)(ident, ctypes.c_int(0), ctypes.c_int(_IPC_RMID))
            else:
                result = getattr(abi.libc, call)(ident, ctypes.c_int(_IPC_RMID), None)
            removed += result == 0
    return removed
