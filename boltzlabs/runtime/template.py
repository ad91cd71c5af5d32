"""The warm template: a zygote that forks every env of the pool, and never runs env code.

    worker ==control socket (SOCK_SEQPACKET, fds by SCM_RIGHTS)==> template
        [FORK, lane, generation, probe, slot] + (channel fd(s), log fd[, slot]) --> fork a child
        [WARM, module names, code] (+ a memfd)           --> import them: library modules only
        [KILL, lane, generation]                         --> kill that child
    worker <== [HELLO, ...] / [WARMED, report] / [FORKED, lane, generation] + (the child's pidfd)
               / [EXITED, lane, generation, status]

`python -c BOOTSTRAP /env/env.py` runs inside a bubblewrap sandbox built
from the same plan as an exec-mode env's (boltzlabs/host/plan.py), which
keeps the capabilities of the policy's [template] cap_add (shipped:
CAP_SYS_ADMIN, CAP_SETPCAP and CAP_SETFCAP) in the sandbox's user namespace
only, and only for the template's own set-up: it mounts its workspace and
devpts, a second, fully visible proc at a hidden path, enters a user
namespace of its own as the plan's template ids (CAP_SETFCAP is for that
map), writes that namespace's quotas (what all its children together may
make), drops every capability, sets no_new_privs and reads the seccomp
program its children will load (compiled by boltzlabs/host/seccomp.py).

Then, as Android's zygote preloads the framework and never an app's code,
the template imports library modules only (`warm`: names from the worker,
resolved on the read-only mounts of the interpreter, its site-packages and
the runtime) and forks. Each child becomes its own sandbox first and only
then runs env.py, which calls serve() and serves its channel as in exec
mode (`_lane_main`). What to import is data: the pool's preload list
(RLPool(preload=...), the env directory's boltzlabs.toml) and the report of
the warm-up probe, a throwaway child confined exactly like an env (and in a
memory cgroup of its own with the env's limit) that runs env.py, its reset
and a few steps, and reports which library modules that work imported
(`_probe_main`, boltzlabs/runtime/probe.py). The template never runs reset or step,
so each child starts from the same pristine state: a hard reset is "kill
the child, fork another".

RLPool(trust_env=True) is the trusted mode: env.py is imported here, before
the first fork, and its serve() becomes the fork server; module state made
at import is then shared copy on write by every child, and the env's
import-time code keeps every power this process has over its children
(docs/templates.md says exactly what that gives up).

The template decides nothing about a child's sandbox: $BOLTZLABS_CONFINE,
the plan's child part (boltzlabs.runtime.confine.parse), says which
namespaces it unshares, its ids, hostname, workspace path and size, inode
and pty caps, where /dev and /proc are, its rlimits and quotas; the template
prepares those calls once (`_ChildPlan`) and each child makes them.

Each child becomes its own sandbox before any env code runs in it:

    template --clone(NEWUSER|NEWPID)-->
        child: pid 1 of its pid namespace; writes its own uid/gid maps (the
               plan's ids inside); unshare(NS and the plan's others of
               NET|IPC|UTS|CGROUP); mounts its own tmpfs (workspace and
               /dev/shm, size and inode caps), devpts (pty cap) and /proc,
               writes its user namespace's quotas (no more namespaces, no
               inotify/fanotify), lo up (with a net namespace of its own),
               hostname (with a uts one), every capability dropped, the
               env's full seccomp filter loaded; then runs env.py
    the template, its parent (and a child subreaper), reaps it.

The worker checks each child from outside before its first request (its
/proc/<pid>/status and /proc/<pid>/ns/*: boltzlabs/worker/confinement.py).

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
  so each child's /proc/sys is bound read-only. The sysctls of /proc/sys/user
  belong to the user namespace of whoever looks them up, and need
  CAP_SYS_RESOURCE there: the template writes its own namespace's through
  an fd on the hidden proc, after it enters that namespace.
- User-namespace counts (ucounts) are hierarchical: a namespace a child
  makes counts in the child's user namespace and in every parent, this
  template's included, so a cap here bounds what the whole pool can make.
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
import marshal
import os
import select
import signal
import socket
import struct
import sys
import threading
import time

from boltzlabs import abi, wire
from boltzlabs.runtime import confine, origins, probe
from boltzlabs.runtime import filter as seccomp
from boltzlabs.runtime import rlimits as limits

TYPE_CHECKING = False  # typing is not imported at run time: every env would pay for it
if TYPE_CHECKING:
    from typing import Any

# Entry point inside the template's sandbox. Not `-m`: that imports runpy (and
# runs this module as __main__, a second copy beside the one env.py's serve()
# imports).
BOOTSTRAP = "import boltzlabs.runtime.template as t; t.main()"
# The plan says: warmup= (the seconds the warm-up's imports may take,
# [template] warmup_timeout of sandbox/policy.toml), memory= (the env's memory
# limit, which holds the probe; 0: none), trusted= (1: RLPool(trust_env=True))
# and namespaces= (what all children together may make of each namespace kind).
# Caps on names (the probe's report is as hostile as anything an env sends,
# and the worker checks it; WARM brings what is left), their length, failures
# reported, and one SOCK_SEQPACKET packet the worker reads with a 64 KiB buffer.
_MAX_FAILED, _MAX_HELLO = 32, 60000
MAX_NAMES, MAX_NAME_LEN = probe.MAX_NAMES, probe.MAX_NAME_LEN

# The GIL stays held across clone(), as in os.fork.
_syscall = ctypes.PyDLL(None, use_errno=True).syscall
# Resolved once here: a CDLL attribute met for the first time runs ctypes'
# Python code, which in a child would copy the template's pages it touches.
_before_fork = ctypes.pythonapi.PyOS_BeforeFork
_after_fork_child = ctypes.pythonapi.PyOS_AfterFork_Child
_after_fork_parent = ctypes.pythonapi.PyOS_AfterFork_Parent
_NAMESPACE_FLAGS = (
    ("net", abi.CLONE_NEWNET),
    ("ipc", abi.CLONE_NEWIPC),
    ("uts", abi.CLONE_NEWUTS),
    ("cgroup", abi.CLONE_NEWCGROUP),
)


def _mount(source: Any, target: Any, fstype: Any, flags: Any, data: Any = None) -> None:
    abi.check(
        abi.libc.mount(
            source and source.encode(),
            target.encode(),
            fstype and fstype.encode(),
            ctypes.c_ulong(flags),
            data and data.encode(),
        ),
        f"mount {target}",
    )


def drop_capabilities() -> None:
    """No capabilities now or after any execve, and no way to gain privileges."""
    confine.Capabilities().drop()


# Built once: what the template does between two forks is copied into the
# older child (every page it writes), so the fork path allocates nothing.
_CLONE_ARGUMENTS = tuple(
    ctypes.c_long(value)
    for value in (abi.SYS_CLONE or -1, abi.CLONE_NEWUSER | abi.CLONE_NEWPID | signal.SIGCHLD, 0, 0, 0, 0)
)


def _clone_sandbox() -> int:
    """fork() into a new user and pid namespace: 0 in the child, its pid here."""
    if abi.SYS_CLONE is None:
        raise OSError(errno.ENOSYS, f'no clone() number known for {os.uname().machine}: use spawn="exec"')
    _before_fork()
    pid: int = _syscall(*_CLONE_ARGUMENTS)
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

    def __init__(self) -> None:
        self.hooks: list[Any] | None = None
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
            self.hooks.insert(self.index, threading._after_fork)  # type: ignore[attr-defined]  # CPython's own hook
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

    def __init__(self, confined: confine.Plan, outside: tuple[Any, ...]) -> None:
        flags = abi.MS_NOSUID | abi.MS_NODEV
        self.id_maps = confine.id_maps(confined.ids, outside)  # the plan's ids inside, the template outside
        # A mount namespace always (the set-up mounts); the others the plan
        # names (the user and pid namespaces are made by the clone itself).
        unshare = confined.unshare
        self.namespaces = ctypes.c_int(
            abi.CLONE_NEWNS | sum(flag for name, flag in _NAMESPACE_FLAGS if name in unshare)
        )
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
            ("proc", proc, "proc", flags | abi.MS_NOEXEC, None, f"mount {proc}"),
            (f"{proc}/sys", f"{proc}/sys", None, abi.MS_BIND, None, f"bind {proc}/sys"),
            (
                None,
                f"{proc}/sys",
                None,
                abi.MS_BIND | abi.MS_REMOUNT | abi.MS_RDONLY | flags | abi.MS_NOEXEC,
                None,
                f"make {proc}/sys read-only",
            ),
        ]
        self.mounts = confined.mounts + confine.mount_calls(mounts)
        self.after_quotas = len(confined.mounts) + 1
        # The per-user-namespace quotas ([quotas] in sandbox/policy.toml),
        # max_user_namespaces=0 among them: written in the child's own user
        # namespace, which counts everything the env makes.
        self.sysctls = confined.sysctls
        self.hostname = confined.hostname.encode()  # empty: no uts namespace of its own, nothing to name
        self.sethostname = abi.libc.sethostname  # resolved here, not in every child
        self.workspace = confined.workspace
        self.lo_request = struct.pack("16sH14x", b"lo", 0)
        self.capabilities = confined.capabilities

    def become_sandbox(self, lane: int, fds: list[Any], slot: int = -1) -> None:
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
        abi.check(abi.libc.unshare(self.namespaces), "unshare namespaces")
        os.environ[abi.ENV_INDEX_VARIABLE] = str(lane)
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
            os.dup2(slot, abi.SLOT_FD)
            os.closerange(2 + len(fds), abi.SLOT_FD)
            os.closerange(abi.SLOT_FD + 1, self.open_max)
        else:
            os.closerange(2 + len(fds), self.open_max)
        # The env's own rlimits: the template's file limit has room for the
        # pipes it holds (closed above, before the limit drops below them).
        limits.apply_parsed(self.rlimits)
        mounts = self.mounts
        abi.check(abi.libc.mount(*mounts[0][0]), mounts[0][1])
        for shm_dir, mode in self.shm_dirs:
            os.mkdir(shm_dir)
            os.chmod(shm_dir, mode)  # past the umask
        after = self.after_quotas
        for arguments, what in mounts[1:after]:
            abi.check(abi.libc.mount(*arguments), what)
        for sysctl, data in self.sysctls:
            fd = os.open(sysctl, os.O_WRONLY)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        for arguments, what in mounts[after:]:
            abi.check(abi.libc.mount(*arguments), what)
        if self.hostname:
            abi.check(self.sethostname(self.hostname, len(self.hostname)), "sethostname")
        if self.net:
            # Interface ioctls on any socket reach its net namespace's devices, Unix
            # ones included: so the template's filter may refuse every other family.
            unix = _socket.socket(_socket.AF_UNIX, _socket.SOCK_DGRAM)
            try:
                flags = int.from_bytes(fcntl.ioctl(unix.fileno(), abi.SIOCGIFFLAGS, self.lo_request)[16:18], "little")
                fcntl.ioctl(
                    unix.fileno(),
                    abi.SIOCSIFFLAGS,
                    self.lo_request[:16]
                    + (flags | abi.IFF_UP | abi.IFF_RUNNING).to_bytes(2, "little")
                    + self.lo_request[18:],
                )
            finally:
                unix.close()
        os.chdir(self.workspace)
        self.capabilities.drop()


def _unsafe_to_fork(channel_fd: int, origin: str) -> str:
    """Why this process cannot be forked safely, or '' if it can. `origin`
    names what ran here (env.py's import in a trusted template, library
    imports in a zygote)."""
    threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if threads:
        return f"{origin} started threads ({', '.join(threads)}); forked children would lack them"
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
        return f"{origin} left sockets open (fds {sockets}); forked children would share them"
    others = _other_processes()
    if others:
        return (
            f"{origin} left processes running (pids {others[:8]} in the template's sandbox); forked "
            "children would not have them, and nothing would freeze them under serialize_measurement"
        )
    shared = _shared_writable_mappings()
    if shared:
        return (
            f"{origin} made a shared writable memory mapping ({'; '.join(shared[:4])}); forked "
            "children would all read and write the same memory, kept across hard resets"
        )
    return ""


def _other_processes() -> list[int]:
    """Live processes of the template's pid namespace besides its init (pid 1)
    and the template: whatever import-time code started and left running,
    daemons reparented to init included (zombies have ended and are skipped)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in (1, os.getpid()):
            continue
        fields = limits.stat_fields(name)
        if fields is not None and fields[0] not in (b"Z", b"X"):  # None: gone meanwhile
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


def warm(names: Any, timeout: float, env_dir: str, workspace: str) -> dict[str, Any]:
    """Import `names` (the worker's WARM: the pool's preload list and what its
    probe found) here, library modules only; returns what happened, for the
    pool's warm-up report: {"imported", "failed", "refused", "import_seconds"}.

    The zygote's rule: the template never imports code of the env's author.
    Its sys.path holds the read-only mounts of the interpreter, its
    site-packages and the runtime (main() takes the working directory off
    it; the env's directory is never on it), so a name resolves to a library
    module or to nothing. A name whose top-level package the env's directory
    holds too is skipped: the env's own `import x` must find its own x, as in
    exec mode. So is a program's entry point (`is_program`). A module whose
    file lies in the env's directory or the workspace, reached by any path (a
    $PYTHONPATH root that holds the env's directory binds it a second time),
    is refused by the import hook main() puts first on sys.meta_path
    (`LibrariesOnly`), before any of its code runs; every module the
    preloads brought in is checked again afterwards (`foreign_modules`).
    The template never runs reset or step: its module state stays as the
    imports left it, so episodes match exec mode's and hard resets stay
    byte-identical.
    """
    report: dict[str, Any] = {"imported": [], "failed": {}, "refused": 0}
    own = own_names(env_dir)
    had_numpy_random = "numpy.random" in sys.modules
    started = time.monotonic()
    deadline = started + timeout  # a library's import can hang as well
    for name in sorted({name for name in names if valid_name(name)})[:MAX_NAMES]:
        if name.split(".", 1)[0] in own:
            _note_failure(
                report,
                name,
                f"not imported here: the env's directory has its own "
                f"{name.split('.', 1)[0]!r}, which each env imports itself",
            )
            continue
        if is_program(name):
            _note_failure(
                report,
                name,
                "not imported here: it is a program, not a library (importing it runs it); "
                "the template imports libraries only",
            )
            continue
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
    for name in names:
        if not valid_name(name):
            _note_failure(
                report,
                name[:MAX_NAME_LEN] if type(name) is str else repr(name)[:MAX_NAME_LEN],
                "not a module name (dotted identifiers only)",
            )
    if not had_numpy_random and "numpy.random" in sys.modules:
        _reseed_numpy_in_children()
    report["import_seconds"] = round(time.monotonic() - started, 4)
    return report


def foreign_modules(env_dir: str, workspace: str) -> list[str]:
    """Modules of this process loaded from the env's directory or the
    workspace, by whatever path: code the template must never hold (see `warm`)."""
    env_files = origins.EnvFiles(env_dir, workspace)
    return sorted(str(name) for name, module in list(sys.modules.items()) if env_files.holds(module))


class LibrariesOnly:
    """The template's first finder on sys.meta_path (untrusted mode): it asks the
    others, and refuses a module whose file lies in the env's directory or the
    workspace, by device and inode (boltzlabs/runtime/origins.py), before any of
    its code runs. In a child (another pid: the env's own code is the env's to
    import) it steps aside, left in place: removing it would copy the page
    of sys.meta_path into every env. A pid alone does not say which process
    this is: every env is pid 1 of a namespace of its own, so a process the
    env forks may have the template's number (2, say) in another namespace;
    where the numbers match, the pid namespace decides."""

    def __init__(self, env_files: origins.EnvFiles) -> None:
        self.env_files = env_files
        self.pid = os.getpid()
        self.namespace = _pid_namespace()

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if os.getpid() != self.pid or _pid_namespace() != self.namespace:
            return None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if self.env_files.holds(spec):
            raise ImportError(
                f"{name} lies in the env's directory or the workspace ({self.env_files.where(spec)}): "
                f"each env imports it itself, the template never does",
                name=name,
            )
        return spec


def _pid_namespace() -> str:
    """This process's pid namespace ("pid:[inode]"), or "" where /proc does not say."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def own_names(env_dir: str) -> set[str]:
    """The top-level module names the env's directory holds: its packages
    (directories) and modules (files with a module suffix), not its other files."""
    import importlib.machinery

    suffixes = tuple(importlib.machinery.all_suffixes())
    own: set[str] = set()
    try:
        entries = list(os.scandir(env_dir))
    except OSError:
        return own
    for entry in entries:
        name = entry.name
        try:
            is_dir = entry.is_dir()
        except OSError:
            is_dir = False
        if is_dir:
            own.add(name)
        elif name.endswith(suffixes):
            own.add(name.split(".", 1)[0])
    return own


# Modules whose import runs a program, besides every `__main__` module (the
# entry point of `python -m <package>`: IPython.__main__ starts IPython, which
# runs the command line's script): the standard library's own, that run at
# import. The template imports libraries only.
_PROGRAMS = frozenset({"this", "antigravity", "idlelib.idle", "test.autotest", "test.regrtest", "turtledemo"})


def is_program(name: str) -> bool:
    """Whether importing module `name` runs a program rather than defining a library."""
    parts = name.split(".")
    return "__main__" in parts or any(".".join(parts[: i + 1]) in _PROGRAMS for i in range(len(parts)))


def _note_failure(report: dict[str, Any], name: str, text: str) -> None:
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
    `random` does (one C-level call; measured ~0 MiB per env)."""
    mtrand = sys.modules.get("numpy.random.mtrand")
    seed = getattr(getattr(mtrand, "_rand", None), "seed", None)
    if callable(seed):
        os.register_at_fork(after_in_child=seed)


def valid_name(name: Any) -> bool:
    """A module name worth an import attempt: dotted ASCII identifiers, bounded."""
    return (
        type(name) is str
        and 0 < len(name) <= MAX_NAME_LEN
        and name.isascii()
        and all(part.isidentifier() for part in name.split("."))
    )


def _warmup(values: dict[str, Any]) -> tuple[float, int]:
    """(seconds the warm-up's imports, and the probe, may take; the env's memory
    limit in bytes, 0: none) from the template's plan."""
    try:
        timeout, memory = float(values["warmup"]), int(values["memory"])
    except (KeyError, ValueError):
        raise ValueError("the template's plan has no valid warmup= and memory=") from None
    if not 0 <= timeout < float("inf") or memory < 0:
        raise ValueError(f"the template's plan: warmup={timeout!r}, memory={memory!r} are out of range")
    return timeout, memory


# -- the children's main functions ------------------------------------------------------


def _sandboxed(channel: tuple[Any, ...]) -> None:
    """A child's first steps once it is a sandbox, before any env code: its
    channel handed to serve() directly (an environment variable set here would
    copy the environment's pages into every env), no fork server of a trusted
    template's, and a place on sys.path that limits.run gives env.py's directory."""
    from boltzlabs.runtime import serve as serving  # main() imported it already

    serving.channel = channel
    serving._fork_server = None
    sys.path.insert(0, "")


def _env_code() -> Any:
    """env.py's code from the warm-up probe (unmarshalled here, in a child), or None."""
    code = _ENV_CODE[0]
    if code is None:
        return None
    try:
        code = marshal.loads(code)
    except Exception:  # the probe is env code: what it sent may be anything
        return None
    return code if type(code) is type(_env_code.__code__) else None


def _lane_main(body: Any) -> Any:
    """What an env's child runs once it is a sandbox, on its channel ((3,): a
    socket; (4, 3): pipes): `body()`, which ends in serve() (env.py as exec
    mode runs it; or a trusted template's serve_each main). One that returns
    never served: the lane's exit says so."""

    def run(channel: tuple[Any, ...]) -> None:
        _sandboxed(channel)
        body()
        sys.stderr.write("boltzlabs: the env was built but serve() was never called\n")
        sys.stderr.flush()
        os._exit(abi.NO_SERVE_EXIT)

    return run


def _probe_main(body: Any, memory: int, workspace: str) -> Any:
    """What the probe's child runs once it is a sandbox: `body()`, whose serve()
    finds $BOLTZLABS_PROBE and calls probe.finish."""

    def run(channel: tuple[Any, ...]) -> None:
        probe.current = probe.ProbeRun(channel, memory, os.path.dirname(_ENV_FILE[0]), workspace)
        _sandboxed(channel)
        os.environ[abi.PROBE_VARIABLE] = "1"
        try:
            body()
            error = "the env was built but serve() was never called"
        except BaseException as exc:
            error = f"env.py raised {type(exc).__name__}: {exc}"
        probe.current.report(0, error, ())

    return run


def _run_env_file(env_file: str) -> Any:
    """env.py as exec mode runs it, from the probe's compiled code when there is one."""
    return lambda: limits.run(env_file, _env_code())


def _compile_and_run_env_file(env_file: str) -> Any:
    """The probe's env.py: compiled here once, its code marshalled for every env."""

    def body() -> None:
        code = compile(limits.read_file(env_file), env_file, "exec")
        probe.current.code = marshal.dumps(code)  # type: ignore[union-attr]  # set by the probe's fork
        limits.run(env_file, code)

    return body


def trusted_probe_main(work: Any, memory: int, workspace: str) -> Any:
    """A trusted template's probe child: env.py was imported in the template,
    so its reset and step are here already (`work`, serve's _Probe)."""

    def run(channel: tuple[Any, ...]) -> None:
        probe.current = probe.ProbeRun(channel, memory, os.path.dirname(_ENV_FILE[0]), workspace)
        probe.finish(work)

    return run


def serve_trusted(run: Any, channel_fd: int, work: Any) -> None:
    """serve() in a trusted template (RLPool(trust_env=True)): env.py was
    imported here, so children run the serve loop over its callables (`run`)
    and the probe runs them (`work`, serve's _Probe). From serve_each (an env
    built per lane), `run` is None and `work` the function that builds it and
    serves: every child and the probe call it once they are sandboxes. Never
    returns. main() hands it to serve() (boltzlabs.runtime.serve._fork_server)."""
    assert confine.prepared is not None  # main() parsed the plan before env.py ran
    _, memory = _warmup(confine.prepared)
    workspace = confine.path_of(confine.prepared, "workspace")
    if run is None:
        child, probe_child = _lane_main(work), _probe_main(work, memory, workspace)
    else:
        child, probe_child = run, trusted_probe_main(work, memory, workspace)
    fork_server(child, channel_fd, probe_child, "env.py's import", trusted=True)


# -- the fork server -----------------------------------------------------------------


def fork_server(child_main: Any, channel_fd: int, probe_main: Any, origin: str, trusted: bool = False) -> None:
    """The template's loop: fork a child per request. Never returns.

    `child_main(channel)` is what an env's child runs once it is a sandbox
    (untrusted: env.py; trusted: the serve loop over env.py's callables),
    `probe_main(channel)` what the probe's child runs; `origin` names what
    ran in this process before (for why it cannot fork); `trusted`: env.py
    was imported here (else no module may come from the env's directory or
    the workspace). The worker drives:

        template: [HELLO, protocol, {pid, forkable, reason}]
        worker:   [FORK, -1, g, True, False] + fds  (the probe, if the pool warms up)
        worker:   [WARM, names, code] (+ env.py's code, marshalled by the probe, in a memfd)
                                             --> [WARMED, {imported, failed, ..., forkable, reason}]
        worker:   [FORK, lane, g, False, slot?] + fds, [KILL, lane, g] ...
        template: [FORKED, lane, g] + pidfd, [EXITED, lane, g, status] ...
    """
    control = socket.socket(fileno=channel_fd)
    reason = _unsafe_to_fork(channel_fd, origin)
    control.sendall(
        wire.encode([wire.HELLO, wire.PROTOCOL_VERSION, {"pid": os.getpid(), "forkable": not reason, "reason": reason}])
    )
    if reason:
        os._exit(0)
    if confine.prepared is None:
        raise RuntimeError("the template's set-up did not run (boltzlabs.runtime.template.main); refusing to fork envs")
    abi.check(abi.libc.prctl(abi.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "child subreaper")
    timeout, _ = _warmup(confine.prepared)
    env_dir = os.path.dirname(_ENV_FILE[0])
    workspace = confine.path_of(confine.prepared, "workspace")
    # The probe's child is made from a plan of its own: the envs' plan is
    # made after the imports, next to the fork path (see WARM below).
    probe_plan = _ChildPlan(confine.Plan(confine.prepared), (os.geteuid(), os.getegid()))
    plan = None
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, tuple[Any, ...]] = {}  # pid (our namespace) -> (lane, generation)
    lanes: dict[tuple[Any, ...], int] = {}
    # Replies queue here and go out only when the socket takes them: the
    # template must never block on a send while the worker is blocked
    # sending to it (1000 kills answered by 1000 exits would deadlock).
    outbox = bytearray()
    forked: list[Any] = []  # (FORKED frame, the child's pidfd or -1): one packet each, sent before outbox
    control.setblocking(False)
    poller = select.poll()
    poller.register(wake_r, select.POLLIN)
    reader = wire.FrameReader(wire.Limits(1 << 16, max_array_len=MAX_NAMES + 8, max_objects=MAX_NAMES + 64))
    control_fd = control.fileno()
    waiting_to_send = None
    while True:
        if waiting_to_send is not bool(outbox or forked):
            waiting_to_send = bool(outbox or forked)
            poller.register(control_fd, select.POLLIN | (select.POLLOUT if waiting_to_send else 0))
        reap = False
        for fd, events in poller.poll():
            if fd == wake_r:
                try:
                    os.read(wake_r, 4096)
                except BlockingIOError:
                    pass
                reap = True  # a SIGCHLD came
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
                code = message[0]
                # The channel (a socket; or two pipes, read then write) and the log pipe.
                if code == wire.FORK and len(message) == 5 and len(fds) - (message[4] is True) in (2, 3):
                    _, lane, generation, probe, has_slot = message
                    key = (lane, generation)
                    if probe is not True and plan is None:
                        _protocol_error("an env's FORK came before WARM")
                    slot = fds.pop() if has_slot is True else -1
                    main, child_plan = (probe_main, probe_plan) if probe is True else (child_main, plan)
                    try:
                        pid = _fork_child(
                            main,
                            0 if probe is True else lane,
                            fds,
                            child_plan,  # type: ignore[arg-type]
                            slot,
                        )  # (a FORK before WARM ended above)
                    except OSError as exc:  # pids.max, memory, a namespace limit: the lane's failure
                        os.write(2, f"boltzlabs: could not make env {lane}'s sandbox: {exc}\n".encode())
                        forked.append((wire.encode([wire.FORKED, lane, generation]), -1))
                        outbox += wire.encode([wire.EXITED, lane, generation, 1 << 8])
                    else:
                        children[pid] = key
                        lanes[key] = pid
                        # The worker signals the child through this, never by pid:
                        # we reap it, and its pid is free for anyone from then on.
                        forked.append((wire.encode([wire.FORKED, lane, generation]), os.pidfd_open(pid)))
                    fds = []  # closed by _fork_child
                elif code == wire.KILL and len(message) == 3:
                    target = lanes.get((message[1], message[2]))
                    if target is not None:
                        _kill(target)
                elif code == wire.WARM and len(message) == 3 and plan is None and type(message[1]) is list:
                    if message[2] is True and len(fds) == 1:
                        _ENV_CODE[0] = _read_code(fds[0])  # unread here: see _env_code
                    report = warm(message[1], timeout, env_dir, workspace)
                    reason = _unsafe_to_fork(channel_fd, f"{origin} or the warm-up's imports")
                    foreign = [] if trusted else foreign_modules(env_dir, workspace)
                    if foreign and not reason:
                        reason = (
                            f"the warm-up's imports loaded code from the env's directory or the "
                            f"workspace ({', '.join(foreign[:4])}); the template holds library modules only"
                        )
                    report.update(forkable=not reason, reason=reason)
                    outbox += _fit_warmed(report)
                    if reason:
                        _flush_all(control, outbox)
                        os._exit(0)
                    plan = _ready_to_fork()
                else:
                    _protocol_error(f"unexpected control message {str(message)[:100]}")
                for fd_ in fds:
                    os.close(fd_)
                fds = []
        # Reap only after a SIGCHLD: each waitpid(-1) walks every child, so
        # reaping after each FORK made a pool's start quadratic in its size
        # (6% of the machine's CPU in wait_consider_task at 10,000 envs, perf).
        while reap:  # we are the subreaper of every child
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            key = children.pop(pid, None)  # type: ignore[arg-type]
            if key is not None:
                lanes.pop(key, None)
                outbox += wire.encode([wire.EXITED, key[0], key[1], status])
        _flush(control, forked, outbox)


def _ready_to_fork() -> _ChildPlan:
    """After WARM: the envs' plan, and everything imported frozen, shared copy
    on write by every child."""
    from boltzlabs.runtime import serve as serving  # imported by main() already

    serving._warmup()  # the serve loop's bytecode settled once, here (its docstring)
    # A Plan of its own, made now rather than main()'s: objects made just
    # before the forks share pages with the rest of the fork path, which
    # children touch anyway; main()'s sit among the imports' objects
    # (a child touching them copied ~70 KiB more per env, measured).
    assert confine.prepared is not None  # main() parsed it
    plan = _ChildPlan(confine.Plan(confine.prepared), (os.geteuid(), os.getegid()))
    # Freezing keeps the collector from writing to (and so copying) them.
    _child_hooks.take_out_threading()  # before freeze: get_referrers skips frozen objects
    gc.collect()
    gc.freeze()
    return plan


def _protocol_error(what: str) -> None:
    """The worker broke the control protocol: nothing here can be trusted to go on."""
    os.write(2, f"boltzlabs template: {what}; exiting\n".encode())
    os._exit(3)


def _fit_warmed(report: dict[str, Any]) -> bytes:
    """The WARMED frame, its lists cut (and marked "truncated") until it fits
    one packet the worker reads."""
    frame = wire.encode([wire.WARMED, report])
    while len(frame) > _MAX_HELLO:
        report["truncated"] = True
        if len(report["imported"]) > 1:
            report["imported"] = report["imported"][: len(report["imported"]) // 2]
        elif report["failed"]:
            report["failed"] = {}
        else:
            break
        frame = wire.encode([wire.WARMED, report])
    return frame


def _flush_all(control: socket.socket, outbox: bytearray) -> None:
    """Send what is queued, waiting for the socket (the template is about to exit)."""
    control.setblocking(True)
    control.settimeout(5.0)
    try:
        control.sendall(outbox)
    except OSError:
        pass


def _flush(control: socket.socket, forked: list[Any], outbox: bytearray) -> None:
    """Send what the socket takes now: each FORKED in a packet of its own, with
    the child's pidfd, ahead of the rest (so before that child's EXITED); then
    the other frames, many to a packet."""
    while forked:
        frame, pidfd = forked[0]
        try:
            control.sendmsg(
                [frame],
                [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [pidfd]).tobytes())] if pidfd >= 0 else [],
            )
        except (BlockingIOError, InterruptedError):
            return
        del forked[0]
        if pidfd >= 0:
            os.close(pidfd)
    while outbox:
        try:
            with memoryview(outbox) as view:
                sent = control.send(view[: 1 << 15])
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


def _receive(control: socket.socket) -> Any:
    fds = array.array("i")
    size, ancillary, _, _ = control.recvmsg_into([_RECEIVE_BUFFER], _ANCILLARY_SPACE)
    data = bytes(_RECEIVE_BUFFER[:size])
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return data, list(fds)


def _fork_child(main: Any, index: int, fds: Any, plan: _ChildPlan, slot: int = -1) -> int:
    """Clone a child into a new user and pid namespace (it makes the others)
    that becomes a sandbox and runs main(channel); returns its pid. The
    template is in the child's cgroup meanwhile (the worker moves it), so
    the child and its namespaces are charged there. `slot`: the child's
    observation slot (a memfd), or -1; closed here like the rest, so the
    template keeps no child's slot."""
    try:
        pid = _clone_sandbox()
        if pid == 0:
            _child(main, index, fds, plan, slot)
    finally:
        for fd in fds:
            os.close(fd)
        if slot >= 0:
            os.close(slot)
    return pid


def _child(main: Any, index: int, fds: Any, plan: _ChildPlan, slot: int = -1) -> None:
    """The env process. Becomes a sandbox, then runs main. Never returns.
    A failure before any env code ran exits abi.SET_UP_EXIT (the sandbox's fault, not the env's)."""
    code = 1
    try:
        plan.become_sandbox(index, fds, slot)
        seccomp.apply_child_filter()  # the env's full filter, before any env code
    except BaseException as exc:
        try:
            os.write(2, f"boltzlabs: env child failed before serving: {exc!r}\n".encode())
        except OSError:
            pass
        os._exit(abi.SET_UP_EXIT)
    try:
        main((3,) if len(fds) == 2 else (4, 3))  # (the fd it reads, the fd it writes)
        code = 0
    except SystemExit as exc:  # env.py's sys.exit(), as an interpreter would exit
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            _print_exception(exc, traceback=False)
    except BaseException as exc:  # env.py's error: its traceback, as an interpreter prints it
        _print_exception(exc)
    finally:
        os._exit(code)


def _print_exception(exc: BaseException, traceback: bool = True) -> None:
    try:
        if traceback:
            import traceback as tb  # only on failure: what an interpreter would print

            text = "".join(tb.format_exception(exc))
        else:
            text = f"{getattr(exc, 'code', None)}\n"  # a SystemExit's
        sys.stdout.flush()
        sys.stderr.flush()
        os.write(2, text.encode("utf-8", "replace"))
    except BaseException:
        pass


_ENV_FILE: list[str] = []  # env.py's path inside, from main's argv
# env.py's code, marshalled by the warm-up probe (WARM brings it in a memfd),
# or None: each child compiles env.py itself. The template never reads these
# bytes; only its children unmarshal them, each a sandbox of env.py's own.
_ENV_CODE: list[Any] = [None]


def _read_code(fd: int) -> bytes | None:
    """The bytes of a memfd WARM brought (at most probe.MAX_CODE), or None."""
    data = bytearray()
    while len(data) <= probe.MAX_CODE:
        chunk = os.pread(fd, 1 << 20, len(data))
        if not chunk:
            return bytes(data) or None
        data += chunk
    return None


def _write_own_quotas(proc_root: int, values: dict[str, Any]) -> None:
    """The [quotas] sysctls of the template's own user namespace, the one
    every child's namespaces are made in and counted against (ucounts are
    hierarchical): what the children make is capped at namespaces= of each
    kind (the worker's figure for this pool), everything else at the
    children's own values. Written through the fully visible proc (proc_root,
    an O_PATH fd on it): a sysctl of /proc/sys/user belongs to the user
    namespace of the process that looks it up, so the lookup is made here,
    in the template's namespace, where /proc/sys itself is already read-only."""
    count = str(confine.number_of(values, "namespaces", 1)).encode()
    for key, value in values.items():
        if not key.startswith("sysctl."):
            continue
        name = key[7:]
        data = count if name.endswith("_namespaces") and name != "max_time_namespaces" else value.encode()
        fd = os.open(f"sys/user/{name}", os.O_WRONLY | os.O_CLOEXEC, dir_fd=proc_root)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)


def main(argv: Any = None) -> None:
    """Template entry point: set up, drop privileges, then serve forks of the
    env (untrusted: the zygote, which never runs env code; trusted: env.py,
    imported here first)."""
    argv = sys.argv[1:] if argv is None else argv
    # The plan (host/plan.py on the host), parsed once: popped, so a
    # child's environment is an exec-mode env's environment exactly. Every
    # setting below comes from it; a missing one is an error, never a default.
    values = confine.parse(os.environ.pop(confine.VARIABLE, ""))
    missing = confine.TEMPLATE_KEYS - set(values)
    if missing:
        raise RuntimeError(f"the template's plan lacks {sorted(missing)}; refusing to start")
    _, memory = _warmup(values)  # checked now, before anything else
    trusted = values["trusted"] == "1"
    confine.prepared = values
    limits.apply(values["template_rlimits"])
    # The template's own workspace (inode cap) and devpts (pty cap); each
    # child mounts its own the same way.
    own = confine.Plan(values)
    own.mount_workspace_and_devpts()
    proc = own.proc
    del own  # not kept alive in this frame (the children's pages sit among what follows)
    flags = abi.MS_NOSUID | abi.MS_NODEV | abi.MS_NOEXEC
    hidden = confine.path_of(values, "hidden_proc")
    _mount("proc", hidden, "proc", flags)
    proc_root = os.open(hidden, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)  # for our own quotas, closed below
    # Cover its parent: the proc stays in the mount table, no path reaches it.
    _mount("tmpfs", os.path.dirname(hidden), "tmpfs", flags | abi.MS_RDONLY, "size=4k,mode=0000")
    # /proc stays writable here (children write their uid maps through it),
    # but not the sysctls: they are checked against the uid, not capabilities.
    for path in (f"{proc}/sys", f"{proc}/sysrq-trigger"):
        if os.path.exists(path):
            _mount(path, path, None, abi.MS_BIND)
            _mount(None, path, None, abi.MS_BIND | abi.MS_REMOUNT | abi.MS_RDONLY | flags)
    # A non-zero uid of our own, so that children may map their root to it
    # without CAP_SETFCAP (see sandbox/policy.toml, [template]).
    uid, gid = confine.number_of(values, "template_uid", 1), confine.number_of(values, "template_gid", 1)
    seccomp.receive_child_filter(int(os.environ.pop(abi.CHILD_FILTER_VARIABLE)))
    confine.enter_user_namespace((uid, gid), (os.geteuid(), os.getegid()))
    try:
        _write_own_quotas(proc_root, values)
    finally:
        os.close(proc_root)
    drop_capabilities()
    # `python -c` put the working directory first on sys.path: the template
    # imports from the read-only library mounts only.
    if sys.path and sys.path[0] in ("", os.getcwd()):
        del sys.path[0]
    env_file = argv[0]
    _ENV_FILE[:] = [env_file]
    # What a library's import sees of the command line names no env path (a
    # program's entry point would run it; each child's runner sets its own).
    sys.argv = ["-c"]
    workspace = confine.path_of(values, "workspace")
    # The serve loop every env runs is imported here, so it is shared by every
    # child (the worker's WARM names boltzlabs.env, env.py's own import, too).
    from boltzlabs.runtime import serve as serving

    if trusted:
        # RLPool(trust_env=True): env.py is imported here, and its serve()
        # becomes the fork server (docs/templates.md says what that gives up).
        serving._fork_server = serve_trusted
        sys.path.insert(0, "")
        limits.run(env_file)  # its serve() never returns; one that is never called exits NO_SERVE_EXIT
    # The zygote: library modules only, by any path.
    sys.meta_path.insert(0, LibrariesOnly(origins.EnvFiles(os.path.dirname(env_file), workspace)))
    fork_server(
        _lane_main(_run_env_file(env_file)),
        int(os.environ.pop(abi.FD_VARIABLE)),
        _probe_main(_compile_and_run_env_file(env_file), memory, workspace),
        "the template's own set-up",
    )
