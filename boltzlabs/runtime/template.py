"""The warm template: one pre-imported env that forks every env of the pool.

    worker ==control socket (SOCK_SEQPACKET, fds by SCM_RIGHTS)==> template
        [FORK, lane, generation] + (channel fd(s), log fd) --> fork a child (a socket, or 2 pipes)
        [KILL, lane, generation]                          --> kill that child
    worker <== [FORKED, lane, generation] + (the child's pidfd) / [EXITED, lane, generation, status]

`python -m boltzlabs.runtime.template /env/env.py` runs inside a bubblewrap sandbox
built from the same plan as an exec-mode env's (boltzlabs/sandbox/plan.py),
which keeps the capabilities of the policy's [template] cap_add (shipped:
CAP_SYS_ADMIN, CAP_SETPCAP and CAP_SETFCAP) in the sandbox's user namespace
only, and only for the template's own set-up: it mounts its workspace and
devpts, a second, fully visible proc at a hidden path, enters a user
namespace of its own as the plan's template ids (CAP_SETFCAP is for that
map), drops every capability, sets no_new_privs, reads the seccomp program
its children will load (compiled by boltzlabs/sandbox/seccomp.py), and only
then runs env.py, under the template's looser filter (bwrap --seccomp).
env.py's `serve()` sees BOLTZLABS_TEMPLATE and turns into the fork server
(`fork_server`). The template never runs reset or step, so each child starts
from the same pristine state: a hard reset is "kill the child, fork another".

The template decides nothing about a child's sandbox: $BOLTZLABS_CONFINE,
the plan's child part (boltzlabs.runtime.confine.parse), says which
namespaces it unshares, its ids, hostname, workspace path and size, inode
and pty caps, where /dev and /proc are, its rlimits and quotas; the template
prepares those calls once (`_ChildPlan`) and each child makes them.

Before its HELLO, the template warms itself for the env's real work
(`warm_up`): a throwaway child, made exactly like an env's, runs reset and a
few steps and reports the modules they imported; the template imports those
(and serve(preload=...)), then freezes its heap and forks. Lazily imported
modules (numpy.random: ~5 MiB) are then shared by every env instead of
copied into each. The report travels in the HELLO (`pool.env_contract["warmup"]`).

Each child becomes its own sandbox before any env code runs in it:

    template --clone(NEWUSER|NEWPID)-->
        child: pid 1 of its pid namespace; writes its own uid/gid maps (the
               plan's ids inside); unshare(NS and the plan's others of
               NET|IPC|UTS|CGROUP); mounts its own tmpfs (workspace and
               /dev/shm, size and inode caps), devpts (pty cap) and /proc,
               writes its user namespace's quotas (no more namespaces, no
               inotify/fanotify), lo up (with a net namespace of its own),
               hostname (with a uts one), every capability dropped, the
               env's full seccomp filter loaded; then serves on its channel
    the template, its parent (and a child subreaper), reaps it.

Kernel facts this depends on:
- A nested user namespace may mount a fresh proc only if its mount namespace
  already holds a *fully visible* proc: one with no locked mount over a
  non-empty directory. bwrap's --proc adds read-only overmounts (/proc/sys,
  ...), which become locked in a child's namespace. So the template mounts
  a plain proc (BOLTZLABS_HIDDEN_PROC) before it drops its capabilities and
  covers its parent directory with an empty tmpfs: the kernel's check reads
  the mount table, not paths, so children may mount their own /proc while
  nobody can reach the template's.
- sysctl writes are checked against the writer's uid, not its capabilities,
  so each child's /proc/sys is bound read-only.
- clone(CLONE_NEWUSER | CLONE_NEWPID) makes the child pid 1 of a new pid
  namespace owned by its new user namespace, with no intermediate process
  (unshare(CLONE_NEWPID) would move only the caller's future children,
  costing a second fork and an exit per env: most of a hard reset's time
  is the kernel copying and tearing down address spaces, see
  docs/hard-reset.md). The child, with every capability in its user
  namespace, unshares the others itself, so they are owned by it as well;
  that work (a network namespace costs most) then runs in the children in
  parallel, not in the template's one-at-a-time loop. A process may write
  its own uid/gid maps when the single id it maps to is the euid that
  created the namespace, so the child needs nothing from the template.
- Python has no clone(): the raw system call is made through ctypes with the
  interpreter's own fork hooks around it (PyOS_BeforeFork and friends, as
  os.fork does), like bubblewrap's raw_clone(). glibc's atfork handlers do
  not run and the thread id it caches is the template's in the child; the
  template has one thread, and raise() asks the kernel for the tid (checked
  on glibc 2.36).
- When the template dies, bwrap's init exits and the kernel kills its whole
  pid namespace, nested ones included: no child outlives its template.

Standard library only: every env pays for what the template imports.
"""

from __future__ import annotations

import _signal
import _socket
import array
import ctypes
import errno
import fcntl
import gc
import importlib
import os
import select
import signal
import socket
import struct
import sys
import threading
import time

from boltzlabs import wire
from boltzlabs.runtime import confine
from boltzlabs.runtime import filter as seccomp
from boltzlabs.runtime import rlimits as limits

FORK, KILL, FORKED, EXITED = 30, 31, 32, 33
WARMED = 34  # the probe's report (warm_up)
# The worker's word on the probe comes in the plan: warmup= (the seconds it
# may take, [template] warmup_timeout of sandbox/policy.toml; 0: no probe, as
# with RLPool(warmup=False)) and memory= (the env's memory limit; 0: none).
# Caps on what the probe reports (env code ran there: its report is as
# hostile as anything an env sends): names, their length, the frame, and how
# much of it goes into the HELLO (one SOCK_SEQPACKET packet the worker reads
# with a 64 KiB buffer).
_MAX_NAMES, _MAX_NAME_LEN, _MAX_REPORT, _MAX_FAILED, _MAX_HELLO = 2048, 200, 1 << 20, 32, 60000

_libc = ctypes.CDLL(None, use_errno=True)
# The GIL stays held across clone(), as in os.fork.
_syscall = ctypes.PyDLL(None, use_errno=True).syscall
# Resolved once here: a CDLL attribute met for the first time runs ctypes'
# Python code, which in a child would copy the template's pages it touches.
_before_fork = ctypes.pythonapi.PyOS_BeforeFork
_after_fork_child = ctypes.pythonapi.PyOS_AfterFork_Child
_after_fork_parent = ctypes.pythonapi.PyOS_AfterFork_Parent
_SYS_CLONE = {"x86_64": 56, "aarch64": 220}.get(os.uname().machine)
_CLONE_NEWNS, _CLONE_NEWCGROUP, _CLONE_NEWUTS = 0x00020000, 0x02000000, 0x04000000
_CLONE_NEWIPC, _CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x08000000, 0x10000000, 0x20000000, 0x40000000
_NAMESPACE_FLAGS = (("net", _CLONE_NEWNET), ("ipc", _CLONE_NEWIPC), ("uts", _CLONE_NEWUTS),
                    ("cgroup", _CLONE_NEWCGROUP))
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_BIND = 1, 2, 4, 8, 32, 4096
_PR_SET_CHILD_SUBREAPER = 36
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP, _IFF_RUNNING = 0x8913, 0x8914, 0x1, 0x40


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None) -> None:
    _check(_libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(),
                       ctypes.c_ulong(flags), data and data.encode()), f"mount {target}")


def drop_capabilities() -> None:
    """No capabilities now or after any execve, and no way to gain privileges."""
    confine.Capabilities().drop()


# Built once: what the template does between two forks is copied into the
# older child (every page it writes), so the fork path allocates nothing.
_CLONE_ARGUMENTS = tuple(ctypes.c_long(value) for value in (
    _SYS_CLONE or -1, _CLONE_NEWUSER | _CLONE_NEWPID | signal.SIGCHLD, 0, 0, 0, 0))


def _clone_sandbox() -> int:
    """fork() into a new user and pid namespace: 0 in the child, its pid here."""
    if _SYS_CLONE is None:
        raise OSError(errno.ENOSYS, f"no clone() number known for {os.uname().machine}: use spawn=\"exec\"")
    _before_fork()
    pid = _syscall(*_CLONE_ARGUMENTS)
    err = ctypes.get_errno()
    if pid == 0:
        _after_fork_child()
        _child_hooks.restore()
        return 0
    _after_fork_parent()
    if pid < 0:
        raise OSError(err, f"clone into a new user and pid namespace: {os.strerror(err)}")
    return pid


class _ChildForkHooks:
    """Keeps threading's after-fork hook from running in the template's children.

    PyOS_AfterFork_Child runs every `os.register_at_fork(after_in_child=...)`
    hook. threading's rebuilds its bookkeeping for the threads a fork left
    behind; the template has exactly one thread (`_unsafe_to_fork`), so in its
    children that hook changes nothing, yet the interpreter code it runs
    copies ~0.45 MiB of the template's pages into every env (measured with
    /proc/self/smaps_rollup, CPython 3.11). So the template takes it out of
    the interpreter's hook list (a plain list, found through the collector)
    before it forks, and each child puts it back, so that an env that forks
    threads' children of its own still gets it. Every other hook (random's
    reseed, so unseeded `random` differs per env as in exec mode, and any a
    library registered) still runs. If the list cannot be found, nothing
    changes but the memory.
    """

    def __init__(self):
        self.hooks: list | None = None
        self.index = 0

    def take_out_threading(self) -> None:
        hook = getattr(threading, "_after_fork", None)
        found = [r for r in gc.get_referrers(hook) if type(r) is list and any(h is hook for h in r)]
        if hook is None or len(found) != 1:
            return
        self.hooks = found[0]
        self.index = next(i for i, h in enumerate(self.hooks) if h is hook)
        del self.hooks[self.index]

    def restore(self) -> None:
        if self.hooks is not None:
            self.hooks.insert(self.index, threading._after_fork)
            self.hooks = None


_child_hooks = _ChildForkHooks()


class _ChildPlan:
    """Everything a child does to become a sandbox, prepared in the template.

    Each page of the template a child writes is copied into that env (copy
    on write), and the first run of Python code in a process writes many:
    refcounts, the interpreter's caches, the io stack's objects. So the
    template builds the system calls' arguments once (bytes, ctypes values,
    the rlimits parsed) and a child only makes the calls: os.open/os.write,
    not open(); _signal, not signal's enum wrappers; prepared ctypes
    arguments. Measured on the counter env: ~0.3 MiB less per env.
    """

    def __init__(self, confined: confine.Plan, outside: tuple):
        flags = _MS_NOSUID | _MS_NODEV
        self.id_maps = confine.id_maps(confined.ids, outside)  # the plan's ids inside, the template outside
        # A mount namespace always (the set-up mounts); the others the plan
        # names (the user and pid namespaces are made by the clone itself).
        unshare = confined.unshare
        self.namespaces = ctypes.c_int(_CLONE_NEWNS | sum(flag for name, flag in _NAMESPACE_FLAGS if name in unshare))
        self.net = "net" in unshare  # bring up loopback: only in a namespace of its own
        self.rlimits = limits.parse(confined.rlimits)
        self.open_max = min(os.sysconf("SC_OPEN_MAX"), 1 << 16)
        # (mount(2)'s five arguments, what it is for an error message):
        # boltzlabs.runtime.confine's (the workspace tmpfs, whose two directories are
        # made next; the workspace and /dev/shm bound from it; a devpts of the
        # env's own, with its pty cap), then its own /proc, then (after the
        # quotas: the sysctls are written through it) /proc/sys read-only,
        # since sysctl writes are checked against the uid, not capabilities.
        self.shm_dirs = confined.shm_dirs
        proc = confined.proc
        mounts = [
            ("proc", proc, "proc", flags | _MS_NOEXEC, None, f"mount {proc}"),
            (f"{proc}/sys", f"{proc}/sys", None, _MS_BIND, None, f"bind {proc}/sys"),
            (None, f"{proc}/sys", None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | flags | _MS_NOEXEC, None,
             f"make {proc}/sys read-only")]
        self.mounts = confined.mounts + [
            ((a and a.encode(), b.encode(), c and c.encode(), ctypes.c_ulong(f), d and d.encode()), what)
            for a, b, c, f, d, what in mounts]
        self.after_quotas = len(confined.mounts) + 1
        # The per-user-namespace quotas ([quotas] in sandbox/policy.toml),
        # max_user_namespaces=0 among them: written in the child's own user
        # namespace, which counts everything the env makes.
        self.sysctls = confined.sysctls
        self.hostname = confined.hostname.encode()  # empty: no uts namespace of its own, nothing to name
        self.sethostname = _libc.sethostname  # resolved here, not in every child
        self.workspace = confined.workspace
        self.lo_request = struct.pack("16sH14x", b"lo", 0)
        self.capabilities = confined.capabilities

    def become_sandbox(self, lane: int, fds: list, slot: int = -1) -> None:
        """In the child, pid 1 of its new user and pid namespace.

        The os.open/os.write/os.close writes below stay inline: moving
        them into a helper function costs ~25 KiB more per env (measured,
        counter env, n=100), the pages a first call copies in a child."""
        for path, data in self.id_maps:
            fd = os.open(path, os.O_WRONLY)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        _check(_libc.unshare(self.namespaces), "unshare namespaces")
        os.environ["BOLTZLABS_ENV_INDEX"] = str(lane)
        # fds: the channel (a socket; or the pipe it reads, the pipe it writes)
        # and the log. The log onto 1 and 2, the socket or the pipe it writes
        # onto 3, the pipe it reads onto 4. No source is a target met earlier:
        # the template holds 0-3 (3, its control socket, is replaced here), so
        # a received fd is 4 or above, and 4 is the last target.
        log = fds[-1]
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.dup2(fds[-2], 3)
        if len(fds) == 3:
            os.dup2(fds[0], 4)
        _signal.set_wakeup_fd(-1)
        _signal.signal(_signal.SIGCHLD, _signal.SIG_DFL)
        if slot >= 0:
            # The observation slot came last, so its number is above every target met so far (1-4).
            if slot <= 4:
                raise OSError(f"the observation slot came on fd {slot}, among the channel's")
            os.dup2(slot, wire.SLOT_FD)
            os.closerange(2 + len(fds), wire.SLOT_FD)
            os.closerange(wire.SLOT_FD + 1, self.open_max)
        else:
            os.closerange(2 + len(fds), self.open_max)
        # The env's own rlimits: the template's file limit has room for the
        # pipes it holds (closed above, before the limit drops below them).
        limits.apply_parsed(self.rlimits)
        mounts = self.mounts
        _check(_libc.mount(*mounts[0][0]), mounts[0][1])
        for path, mode in self.shm_dirs:
            os.mkdir(path)
            os.chmod(path, mode)  # past the umask
        after = self.after_quotas
        for arguments, what in mounts[1:after]:
            _check(_libc.mount(*arguments), what)
        for path, data in self.sysctls:
            fd = os.open(path, os.O_WRONLY)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        for arguments, what in mounts[after:]:
            _check(_libc.mount(*arguments), what)
        if self.hostname:
            _check(self.sethostname(self.hostname, len(self.hostname)), "sethostname")
        if self.net:
            # Interface ioctls on any socket reach its net namespace's devices, Unix
            # ones included: so the template's filter may refuse every other family.
            unix = _socket.socket(_socket.AF_UNIX, _socket.SOCK_DGRAM)
            try:
                flags = int.from_bytes(fcntl.ioctl(unix.fileno(), _SIOCGIFFLAGS, self.lo_request)[16:18], "little")
                fcntl.ioctl(unix.fileno(), _SIOCSIFFLAGS,
                            self.lo_request[:16] + (flags | _IFF_UP | _IFF_RUNNING).to_bytes(2, "little")
                            + self.lo_request[18:])
            finally:
                unix.close()
        os.chdir(self.workspace)
        self.capabilities.drop()


def _unsafe_to_fork(channel_fd: int) -> str:
    """Why this process cannot be forked safely, or '' if it can."""
    threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if threads:
        return f"env.py started threads at import ({', '.join(threads)}); forked children would lack them"
    sockets = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd in (0, 1, 2, channel_fd):
            continue
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:"):
            sockets.append(fd)
    if sockets:
        return f"env.py holds open sockets at import (fds {sockets}); forked children would share them"
    others = _other_processes()
    if others:
        return (f"env.py left processes running at import (pids {others[:8]} in the template's sandbox); forked "
                "children would not have them, and nothing would freeze them under serialize_measurement")
    shared = _shared_writable_mappings()
    if shared:
        return (f"env.py made a shared writable memory mapping at import ({'; '.join(shared[:4])}); forked "
                "children would all read and write the same memory, kept across hard resets")
    return ""


def _other_processes() -> list[int]:
    """Live processes of the template's pid namespace besides its init (pid 1)
    and the template: whatever import-time code started and left running,
    daemons reparented to init included (zombies have ended and are skipped)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in (1, os.getpid()):
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # gone meanwhile
        if state not in (b"Z", b"X"):
            found.append(int(name))
    return sorted(found)


def _shared_writable_mappings() -> list[str]:
    """The mappings of this process that a fork would share writably: VM_SHARED
    and VM_MAYWRITE ("sh", "mw" in smaps' VmFlags). A MAP_SHARED mapping made
    read-only is caught too: mprotect may make it writable later. The kernel
    clears VM_SHARED for a MAP_SHARED mapping of a file opened read-only
    (those "r--s" lines are harmless), and VM_MAYWRITE for a write-sealed memfd."""
    found, mapping = [], ""
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if line.startswith("VmFlags:"):
                flags = line.split()[1:]
                if "sh" in flags and "mw" in flags:
                    found.append(mapping)
            elif "-" in line.split(" ", 1)[0] and not line[0].isupper():
                fields = line.split(maxsplit=5)
                path = fields[5].strip() if len(fields) > 5 else ""
                if path == "/dev/zero (deleted)" or not path:
                    path = "anonymous shared memory"
                elif path.startswith("/SYSV"):
                    path = f"SysV shared memory {path}"
                mapping = f"{path} at {fields[0]}"
    return found


def warm_up(plan: _ChildPlan, probe, preload, timeout: float, memory: int = 0) -> dict:
    """Make the template warm for the env's real work; returns the report
    (`pool.env_contract["warmup"]`).

    env.py's import is all the template ran; numpy's random, linalg, ... and
    whatever else reset and step import on first use would otherwise be
    imported by every env, each writing its own private copy (~5.6 MiB for
    numpy.random). So the env's work runs once in a throwaway child that is a
    sandbox like any env's (`_probe_child`), which reports the modules it
    imported; the template imports those (and `preload`), nothing else. The
    template never runs reset or step itself: its module globals and RNGs
    stay as env.py's import left them, so episodes match exec mode's and hard
    resets stay byte-identical. The child's files die with its tmpfs.
    `memory`: the env's memory limit, held to in the child (`_probe_child`).
    """
    report = {"modules": [], "preload": [], "imported": [], "failed": {}, "private_birth": 0, "private_after": 0,
              "steps": 0, "seconds": 0.0, "error": None, "refused": 0}
    preload = [name for name in (preload or ()) if type(name) is str][:_MAX_NAMES]
    report["preload"] = preload
    if probe is not None:
        try:
            _run_probe(plan, probe, timeout, memory, report)
        except Exception as exc:  # a limit hit making the child: the pool still starts
            report["error"] = f"the probe could not run: {exc}"
    had_numpy_random = "numpy.random" in sys.modules
    names = sorted(set(report["modules"]) | {name for name in preload if _valid_name(name)})
    for name in preload:
        if not _valid_name(name) and len(report["failed"]) < _MAX_FAILED:
            report["failed"][name[:_MAX_NAME_LEN]] = "not a module name (dotted identifiers only)"
    deadline = time.monotonic() + timeout  # import-time code can hang as well
    for name in names:
        if name in sys.modules:
            report["imported"].append(name)
            continue
        if time.monotonic() > deadline:
            _note_failure(report, name, f"not imported: the warm-up's {timeout:g} s were up")
            continue
        try:
            importlib.import_module(name)
        except BaseException as exc:  # whatever a module's import raises (SystemExit included)
            _note_failure(report, name, f"{type(exc).__name__}: {exc}")
        else:
            report["imported"].append(name)
    if not had_numpy_random and "numpy.random" in sys.modules:
        _reseed_numpy_in_children()
    report["import_seconds"] = round(time.monotonic() - deadline + timeout, 4)
    return report


def _note_failure(report: dict, name: str, text: str) -> None:
    if len(report["failed"]) < _MAX_FAILED:
        report["failed"][name] = text[:300]
    else:
        report["refused"] += 1


def _reseed_numpy_in_children() -> None:
    """numpy.random's legacy global RandomState (np.random.rand() and friends)
    seeds itself from the OS at import. Imported in an env on first use (exec
    mode, or a template without the warm-up) each env gets its own stream;
    imported here by the warm-up it would be one stream, the same in every
    child. So each child reseeds it from the OS at fork, as CPython's
    `random` does (one C-level call; measured ~0 MiB per env). If env.py
    imported numpy.random itself, nothing changes: that template already
    shared it before the warm-up existed."""
    mtrand = sys.modules.get("numpy.random.mtrand")
    seed = getattr(getattr(mtrand, "_rand", None), "seed", None)
    if callable(seed):
        os.register_at_fork(after_in_child=seed)


def _valid_name(name) -> bool:
    """A module name worth an import attempt: dotted ASCII identifiers, bounded."""
    return (type(name) is str and 0 < len(name) <= _MAX_NAME_LEN and name.isascii()
            and all(part.isidentifier() for part in name.split(".")))


def _run_probe(plan: _ChildPlan, probe, timeout: float, memory: int, report: dict) -> None:
    """Fork the probe's child, read its report within `timeout`, kill and reap it."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    log = os.dup(2)  # what the probe prints goes to the template's log
    started = time.monotonic()
    try:
        pid = _fork_child(_probe_child(probe, memory), 0, [theirs.detach(), log], plan)
    except BaseException:
        ours.close()
        raise
    pidfd = os.pidfd_open(pid)
    data, status, deadline = bytearray(), None, started + timeout
    try:
        ours.setblocking(False)
        poller = select.poll()
        poller.register(ours.fileno(), select.POLLIN)
        poller.register(pidfd, select.POLLIN)
        reading = True
        while status is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for fd, _ in poller.poll(remaining * 1000):
                if fd == pidfd:
                    status = os.waitpid(pid, 0)[1]
                elif reading:
                    chunk = b""
                    try:
                        chunk = ours.recv(1 << 16)
                    except BlockingIOError:
                        continue
                    data += chunk
                    if not chunk or len(data) > _MAX_REPORT:
                        reading = False
                        poller.unregister(ours.fileno())
        if status is None:
            _kill(pid)  # pid 1 of its namespace: everything it started goes with it
            os.waitpid(pid, 0)
            report["error"] = f"the probe did not finish within {timeout:g} s ([template] warmup_timeout): killed"
        while reading and len(data) <= _MAX_REPORT:  # what it wrote before it exited
            try:
                chunk = ours.recv(1 << 16)
            except OSError:  # BlockingIOError: nothing more
                break
            if not chunk:
                break
            data += chunk
    finally:
        os.close(pidfd)
        ours.close()
    report["seconds"] = round(time.monotonic() - started, 4)
    _take_report(bytes(data), status, report)


def _take_report(data: bytes, status, report: dict) -> None:
    """Fill `report` from the probe's frame, trusting nothing in it."""
    message = None
    if len(data) <= _MAX_REPORT:
        reader = wire.FrameReader(wire.Limits(_MAX_REPORT, max_str_len=4096, max_bin_len=0,
                                              max_array_len=_MAX_NAMES, max_map_len=0, max_depth=3,
                                              max_objects=_MAX_NAMES + 16))
        try:
            messages = reader.feed(data)
            message = messages[0] if len(messages) == 1 else None
        except Exception:
            message = None
    valid = (type(message) is list and len(message) == 7 and message[0] == WARMED and type(message[1]) is list
             and all(type(x) is int and x >= 0 for x in message[2:6])
             and (message[6] is None or type(message[6]) is str))
    if valid:
        _, names, total, birth, after, steps, error = message
        good = sorted({name for name in names if _valid_name(name)})
        report.update(modules=good, private_birth=birth, private_after=after, steps=steps,
                      refused=report["refused"] + max(0, total - len(good)))
        if error is not None and report["error"] is None:
            report["error"] = f"the probe's reset/step raised {error[:1000]}"
    if report["error"] is not None:
        return
    if status is not None and status != 0:
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            try:
                what = f"was killed by {signal.Signals(sig).name}"
            except ValueError:
                what = f"was killed by signal {sig}"
        else:
            what = f"exited with status {os.waitstatus_to_exitcode(status)}"
        report["error"] = f"the probe (the env's reset and steps, run once in a throwaway sandbox) {what}"
    elif not valid:
        report["error"] = "the probe sent no valid report (its output was refused)"


def _probe_child(probe, memory: int):
    """What the probe's child runs once it is a sandbox: the env's real work,
    then its report on its channel: [WARMED, new module names, how many,
    Private_Dirty before reset, after the work, steps, error text or None].

    It is born in the template's cgroup, which has no memory limit (the
    template's imports are the pool's), so the env's limit, if any, is an
    rlimit here: the data it holds now (the template's, shared) plus the
    limit. An env over it fails in the probe with MemoryError, not the host."""

    def run(channel: tuple) -> None:
        error = None
        report = {"steps": 0}
        if memory > 0:
            import resource

            with open("/proc/self/status") as status:
                held = next((int(line.split()[1]) * 1024 for line in status if line.startswith("VmData:")), 0)
            resource.setrlimit(resource.RLIMIT_DATA, (held + memory, held + memory))
        try:
            probe.prepare()  # actions sampled first: what sampling imports is not the env's work
        except BaseException as exc:
            error = f"{type(exc).__name__}: {exc}"
        before = set(sys.modules)
        birth = _private_dirty()
        if error is None:
            try:
                probe.run(report)
            except BaseException as exc:
                error = f"{type(exc).__name__}: {exc}"
        # Only modules an import made (with a spec): Cython, for one, puts
        # a bookkeeping module of its own in sys.modules that nobody can import.
        names = [name for name, module in list(sys.modules.items())
                 if type(name) is str and name not in before and getattr(module, "__spec__", None) is not None]
        after = _private_dirty()
        frame = wire.encode([WARMED, sorted(name[:_MAX_NAME_LEN + 1] for name in names)[:_MAX_NAMES], len(names), birth,
                             after, int(report["steps"]), error and error[:2000]])
        view = memoryview(frame)
        while view:
            view = view[os.write(channel[-1], view):]

    return run


def _warmup(values: dict) -> tuple[float, int]:
    """(seconds the warm-up's probe may take, 0: none; the env's memory limit
    in bytes, 0: none) from the template's plan."""
    try:
        timeout, memory = float(values["warmup"]), int(values["memory"])
    except (KeyError, ValueError):
        raise ValueError("the template's plan has no valid warmup= and memory=") from None
    if not 0 <= timeout < float("inf") or memory < 0:
        raise ValueError(f"the template's plan: warmup={timeout!r}, memory={memory!r} are out of range")
    return timeout, memory


def _private_dirty() -> int:
    """Private_Dirty of this process, in bytes (its own /proc)."""
    try:
        with open("/proc/self/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Private_Dirty:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _fit_hello(hello: dict) -> bytes:
    """The HELLO frame, its warm-up lists cut (and marked "truncated") until
    it fits one packet the worker reads."""
    frame = wire.encode([wire.HELLO, wire.PROTOCOL_VERSION, hello])
    report = hello.get("warmup")
    while len(frame) > _MAX_HELLO and report is not None:
        longest = max(("modules", "imported", "preload"), key=lambda key: len(report[key]))
        if not report[longest]:
            if not report["failed"]:
                break  # nothing of ours left to cut: the worker refuses the HELLO, the pool runs exec mode
            report["failed"] = {}
        report[longest] = report[longest][:len(report[longest]) // 2]
        report["truncated"] = True
        frame = wire.encode([wire.HELLO, wire.PROTOCOL_VERSION, hello])
    return frame


def fork_server(serve_child, channel_fd: int, probe=None, preload=()) -> None:
    """serve()'s template mode: fork a child per request. Never returns.

    `serve_child(channel)` is what a child runs once it is a sandbox: the
    ordinary serve loop on its own channel ((3,): a socket; (4, 3): the pipe
    it reads, the pipe it writes). `probe` (boltzlabs.runtime.serve._Probe:
    `prepare()`, then `run(report)`) is the env's real work, run once in a
    throwaway child before the first fork (`warm_up`); `preload` names
    modules to import here besides what the probe's work imported.
    """
    control = socket.socket(fileno=channel_fd)
    reason = _unsafe_to_fork(channel_fd)
    hello = {"pid": os.getpid(), "forkable": not reason, "reason": reason, "warmup": None}
    if reason:
        control.sendall(wire.encode([wire.HELLO, wire.PROTOCOL_VERSION, hello]))
        os._exit(0)
    if confine.prepared is None:
        raise RuntimeError("the template's set-up did not run (boltzlabs.runtime.template.main); refusing to fork envs")
    _check(_libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "child subreaper")
    timeout, memory = _warmup(confine.prepared)
    if timeout > 0:
        # The probe's child is made from a plan of its own: the envs' plan is
        # made after the imports, next to the fork path (see below).
        probe_plan = _ChildPlan(confine.Plan(confine.prepared), (os.geteuid(), os.getegid()))
        hello["warmup"] = warm_up(probe_plan, probe, preload, timeout, memory)
        del probe_plan
        if hello["warmup"]["imported"]:
            reason = _unsafe_to_fork(channel_fd)
            if reason:
                reason = f"after importing what the env's reset/step import (the warm-up): {reason}"
                hello.update(forkable=False, reason=reason)
    control.sendall(_fit_hello(hello))
    if reason:
        os._exit(0)
    # A Plan of its own, made now rather than main()'s: objects made just
    # before the forks share pages with the rest of the fork path, which
    # children touch anyway; main()'s sit among env.py's import-time objects
    # (a child touching them copied ~70 KiB more per env, measured).
    plan = _ChildPlan(confine.Plan(confine.prepared), (os.geteuid(), os.getegid()))
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, tuple] = {}  # pid (our namespace) -> (lane, generation)
    lanes: dict[tuple, int] = {}
    # Everything imported so far is shared, copy-on-write, by every child;
    # freezing keeps the collector from writing to (and so copying) it.
    _child_hooks.take_out_threading()  # before freeze: get_referrers skips frozen objects
    gc.collect()
    gc.freeze()
    # Replies queue here and go out only when the socket takes them: the
    # template must never block on a send while the worker is blocked
    # sending to it (1000 kills answered by 1000 exits would deadlock).
    outbox = bytearray()
    forked: list = []  # (FORKED frame, the child's pidfd or -1): one packet each, sent before outbox
    control.setblocking(False)
    poller = select.poll()
    poller.register(wake_r, select.POLLIN)
    reader = wire.FrameReader(wire.Limits(1 << 16))
    control_fd = control.fileno()
    waiting_to_send = None
    while True:
        if waiting_to_send is not bool(outbox or forked):
            waiting_to_send = bool(outbox or forked)
            poller.register(control_fd, select.POLLIN | (select.POLLOUT if waiting_to_send else 0))
        for fd, events in poller.poll():
            if fd == wake_r:
                try:
                    os.read(wake_r, 4096)
                except BlockingIOError:
                    pass
                continue
            if events & select.POLLOUT:
                _flush(control, forked, outbox)
            if not events & (select.POLLIN | select.POLLHUP | select.POLLERR):
                continue
            try:
                data, fds = _receive(control)
            except BlockingIOError:
                continue
            if not data:
                os._exit(0)  # the worker is gone
            for message in reader.feed(data):
                # The channel (a socket; or two pipes, read then write) and the log pipe.
                if message[0] == FORK and len(fds) - _has_slot(message) in (2, 3):
                    lane, generation = message[1], message[2]
                    key = (lane, generation)
                    slot = fds.pop() if _has_slot(message) else -1
                    try:
                        pid = _fork_child(serve_child, lane, fds, plan, slot)
                    except OSError as exc:  # pids.max, memory, a namespace limit: the lane's failure
                        os.write(2, f"boltzlabs: could not make env {lane}'s sandbox: {exc}\n".encode())
                        forked.append((wire.encode([FORKED, lane, generation]), -1))
                        outbox += wire.encode([EXITED, lane, generation, 1 << 8])
                    else:
                        children[pid] = key
                        lanes[key] = pid
                        # The worker signals the child through this, never by pid:
                        # we reap it, and its pid is free for anyone from then on.
                        forked.append((wire.encode([FORKED, lane, generation]), os.pidfd_open(pid)))
                    fds = []  # closed by _fork_child
                elif message[0] == KILL:
                    pid = lanes.get((message[1], message[2]))
                    if pid is not None:
                        _kill(pid)
                for fd_ in fds:
                    os.close(fd_)
                fds = []
        while True:  # reap: we are the subreaper of every child
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            key = children.pop(pid, None)
            if key is not None:
                lanes.pop(key, None)
                outbox += wire.encode([EXITED, key[0], key[1], status])
        _flush(control, forked, outbox)


def _flush(control: socket.socket, forked: list, outbox: bytearray) -> None:
    """Send what the socket takes now: each FORKED in a packet of its own, with
    the child's pidfd, ahead of the rest (so before that child's EXITED); then
    the other frames, many to a packet."""
    while forked:
        frame, pidfd = forked[0]
        try:
            control.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [pidfd]).tobytes())]
                           if pidfd >= 0 else [])
        except (BlockingIOError, InterruptedError):
            return
        del forked[0]
        if pidfd >= 0:
            os.close(pidfd)
    while outbox:
        try:
            with memoryview(outbox) as view:
                sent = control.send(view[:1 << 15])
        except (BlockingIOError, InterruptedError):
            return
        del outbox[:sent]


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


_RECEIVE_BUFFER = bytearray(1 << 16)
_ANCILLARY_SPACE = socket.CMSG_SPACE(4 * 4)  # a FORK brings two or three fds, and a slot; extra ones are closed


def _receive(control: socket.socket):
    fds = array.array("i")
    size, ancillary, _, _ = control.recvmsg_into([_RECEIVE_BUFFER], _ANCILLARY_SPACE)
    data = bytes(_RECEIVE_BUFFER[:size])
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    return data, list(fds)


def _has_slot(message) -> int:
    """1 when a FORK brings the child's observation slot as its last fd ([FORK, lane, generation, True]:
    the worker's spawn.py), else 0. The slot goes to wire.SLOT_FD in the child (_ChildPlan.take_slot)."""
    return 1 if len(message) == 4 and message[3] is True else 0


def _fork_child(serve_child, lane, fds, plan: _ChildPlan, slot: int = -1) -> int:
    """Clone the env's child into a new user and pid namespace (it makes the
    others); returns its pid. The template is in the env's cgroup meanwhile
    (the worker moves it), so the child and its namespaces are charged there.
    `slot`: the child's observation slot (a memfd), or -1; closed here like
    the rest, so the template keeps no child's slot."""
    try:
        pid = _clone_sandbox()
        if pid == 0:
            _child(serve_child, lane, fds, plan, slot)
    finally:
        for fd in fds:
            os.close(fd)
        if slot >= 0:
            os.close(slot)
    return pid


def _child(serve_child, lane, fds, plan: _ChildPlan, slot: int = -1) -> None:
    """The env process. Becomes a sandbox, then serves. Never returns."""
    code = 1
    try:
        plan.become_sandbox(lane, fds, slot)
        seccomp.apply_child_filter()  # the env's full filter, before any env code
        serve_child((3,) if len(fds) == 2 else (4, 3))  # (the fd it reads, the fd it writes)
        code = 0
    except BaseException as exc:
        try:
            os.write(2, f"boltzlabs: env child failed before serving: {exc!r}\n".encode())
        except OSError:
            pass
    finally:
        os._exit(code)


def main(argv=None) -> None:
    """Template entry point: set up, drop privileges, run env.py as __main__."""
    import runpy

    argv = sys.argv[1:] if argv is None else argv
    # The plan (sandbox/plan.py on the host), parsed once: popped, so a
    # child's environment is an exec-mode env's environment exactly. Every
    # setting below comes from it; a missing one is an error, never a default.
    # (Kept in boltzlabs.runtime.confine: this module runs as __main__ here, and
    # env.py's serve() imports it again as boltzlabs.runtime.template.)
    values = confine.parse(os.environ.pop(confine.VARIABLE, ""))
    missing = {"template_rlimits", "hidden_proc", "template_uid", "template_gid", "warmup", "memory"} - set(values)
    if missing:
        raise RuntimeError(f"the template's plan lacks {sorted(missing)}; refusing to start")
    _warmup(values)  # checked now, not after env.py's import
    confine.prepared = values
    # Binding on env.py's import code and everything it starts (limits.py).
    limits.apply(values["template_rlimits"])
    # The template's own workspace (inode cap) and devpts (pty cap), for
    # env.py's import code; each child mounts its own the same way.
    own = confine.Plan(values)
    own.mount_workspace_and_devpts()
    proc = own.proc
    del own  # not kept alive in this frame under env.py's import (the children's pages sit among what follows)
    flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
    hidden = confine.path_of(values, "hidden_proc")
    _mount("proc", hidden, "proc", flags)
    # Cover its parent: the proc stays in the mount table, no path reaches it.
    _mount("tmpfs", os.path.dirname(hidden), "tmpfs", flags | _MS_RDONLY, "size=4k,mode=0000")
    # /proc stays writable here (children write their uid maps through it),
    # but not the sysctls: they are checked against the uid, not capabilities.
    for path in (f"{proc}/sys", f"{proc}/sysrq-trigger"):
        if os.path.exists(path):
            _mount(path, path, None, _MS_BIND)
            _mount(None, path, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | flags)
    # A non-zero uid of our own, so that children may map their root to it
    # without CAP_SETFCAP (see sandbox/policy.toml, [template]).
    uid, gid = confine.number_of(values, "template_uid", 1), confine.number_of(values, "template_gid", 1)
    seccomp.receive_child_filter(int(os.environ.pop("BOLTZLABS_CHILD_FILTER_FD")))
    confine.enter_user_namespace((uid, gid), (os.geteuid(), os.getegid()))
    drop_capabilities()
    os.environ["BOLTZLABS_TEMPLATE"] = "1"
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(argv[0]))
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
