"""The last steps of a sandbox, made inside it before any env code runs: in both spawn modes.

    host: boltzlabs/host/plan.py compiles the policy --Plan.child_text()--> $BOLTZLABS_CONFINE
    here: parse() (bounded, checked) --> Plan: prepared system-call arguments, then
            exec mode:     `python -c BOOTSTRAP /env/env.py` (main below): rlimits, then
                           Plan.finish(): workspace, devpts, the env's ids ([identity]),
                           quotas, /proc read-only,
                           every capability dropped, the env's full seccomp filter
            template mode: the template mounts its own workspace and devpts (template.main);
                           each forked child unshares the plan's namespaces and makes the
                           same calls with the same prepared arguments (template._ChildPlan)

The text is "key=value" lines; every value comes from the compiled plan
(workspace path and size, inode and pty caps, where /dev and /proc are,
namespaces, ids, hostname, rlimits, sysctl.<name> quotas). Nothing here has a
default of its own: a missing or malformed key is an error, and no env runs.

bubblewrap 0.8 cannot do these itself: `--tmpfs` takes a size but no inode
count, `--dev` mounts a devpts instance with no `max=`, and it cannot write
the per-user-namespace limits. So the sandbox keeps CAP_SYS_ADMIN,
CAP_SYS_RESOURCE and CAP_SETPCAP in its own user namespace (nowhere else)
and a filter that still allows mount() for these few calls, made by this
module's code alone; then it drops every capability, sets no_new_privs and
loads the full filter before env.py is even read.

Kernel facts this depends on:
- A tmpfs without `nr_inodes=` allows half the machine's pages as inodes; each
  costs ~1 KiB of kernel memory not counted in `size=` (300,000 empty files
  in a 64M workspace cost 276 MiB).
- A devpts mounted `newinstance` has its own pty numbers and `max=` caps
  them; outside the host's own instance all instances share kernel.pty.max
  less kernel.pty.reserve. Without it, every sandbox of an account would
  draw on that one pool (and template children would share one instance).
- /proc/sys/user/* are per user namespace and hierarchical (ucounts): a count
  in an env's namespace is also counted in every parent, and creation fails
  when any level is over its max. Writing them needs CAP_SYS_RESOURCE in that
  namespace; a new namespace starts at INT_MAX (no limit of its own).
- sysctl writes are checked against the writer's uid, not its capabilities:
  /proc ends read-only.

Standard library only: every env pays for what it imports (ctypes: ~0.35 MiB
of an exec-mode env; the template imports it anyway).
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys

from boltzlabs import abi

TYPE_CHECKING = False  # typing is not imported at run time: every env would pay for it
if TYPE_CHECKING:
    from typing import Any

VARIABLE = abi.CONFINE_VARIABLE
# Exec mode's interpreter runs this, then env.py. Not `-m`: that imports
# runpy (with typing, re, contextlib: ~5 ms and their pages in every env).
BOOTSTRAP = "import boltzlabs.runtime.confine as m; m.main()"
SYSCTL_DIR = "/proc/sys/user"

# The template's parsed VARIABLE (template.main), for its children's Plan.
prepared: dict[str, Any] | None = None


# The text's bounds: it comes from the worker, and is still parsed as input.
_MAX_TEXT, _MAX_ITEMS = 16384, 128
# Every spawn's plan has these; the template's also has TEMPLATE_KEYS (template.py checks them).
_SPAWN_KEYS = {"unshare", "uid", "gid", "hostname", "workspace", "size", "inodes", "ptys", "dev", "proc", "rlimits"}
TEMPLATE_KEYS = set("template_rlimits hidden_proc template_uid template_gid warmup memory trusted namespaces".split())
_KEYS = _SPAWN_KEYS | TEMPLATE_KEYS
_NAMESPACES = {"net", "ipc", "uts", "cgroup"}  # what a child unshares besides its user and pid namespaces


def encode(items: dict[str, Any]) -> str:
    """VARIABLE's text: one "key=value" line per item (a key of _KEYS, or
    "sysctl.<name of SYSCTL_DIR>"). Raises ValueError for a key or value the
    parser would refuse."""
    text = "\n".join(f"{key}={value}" for key, value in items.items())
    parse(text)
    return text


def parse(text: str) -> dict[str, Any]:
    """{key: value text} from VARIABLE's text, checked: bounded, known keys,
    no duplicates, and every key the set-up needs present."""
    if not isinstance(text, str) or len(text) > _MAX_TEXT or "\0" in text:
        raise ValueError(f"${VARIABLE} is missing, too long or not text")
    lines = text.split("\n")
    if len(lines) > _MAX_ITEMS:
        raise ValueError(f"${VARIABLE} has more than {_MAX_ITEMS} items")
    values = {}
    for line in lines:
        key, sep, value = line.partition("=")
        known = key in _KEYS or (key.startswith("sysctl.") and key[7:].replace("_", "").isalpha() and key[7:].islower())
        if not sep or not known or key in values:
            raise ValueError(f"${VARIABLE}: unknown, repeated or malformed item {line[:80]!r}")
        values[key] = value
    missing = _SPAWN_KEYS - set(values)
    if missing:
        raise ValueError(f"${VARIABLE} lacks {sorted(missing)}")
    return values


def id_maps(inside: tuple[Any, ...], outside: tuple[Any, ...]) -> list[tuple[str, bytes]]:
    """The (file, text) writes that map uid/gid `inside` to `outside` in a new user namespace."""
    return [
        ("/proc/self/setgroups", b"deny"),
        ("/proc/self/uid_map", f"{inside[0]} {outside[0]} 1".encode()),
        ("/proc/self/gid_map", f"{inside[1]} {outside[1]} 1".encode()),
    ]


def enter_user_namespace(inside: tuple[Any, ...], outside: tuple[Any, ...], also: int = 0) -> None:
    """unshare(CLONE_NEWUSER | also), mapping uid/gid `inside` to `outside` (ours)."""
    abi.check(abi.libc.unshare(abi.CLONE_NEWUSER | also), "unshare a user namespace")
    for path, data in id_maps(inside, outside):
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


class Capabilities:
    """Dropping every capability, with the arguments made ahead of time."""

    def __init__(self) -> None:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            self.last = int(f.read())
        self.header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
        self.data = (_CapData * 2)()

    def drop(self) -> None:
        """No capabilities now or after any execve, and no way to gain privileges."""
        abi.check(abi.libc.prctl(abi.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
        for cap in range(self.last + 1):
            if abi.libc.prctl(abi.PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() != errno.EINVAL:
                abi.check(-1, f"drop capability {cap} from the bounding set")
        abi.libc.prctl(abi.PR_CAP_AMBIENT, abi.PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
        abi.check(abi.libc.capset(ctypes.byref(self.header), self.data), "capset")


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class FilterLoader:
    """A seccomp BPF program (struct sock_filter[]) and the prctl calls that load it, prepared."""

    def __init__(self, program: bytes) -> None:
        self.prctl = abi.libc.prctl  # restype c_int, ctypes' default
        self.buffer = ctypes.create_string_buffer(program, len(program))
        self.fprog = _SockFprog(len(program) // abi.BPF_INSTRUCTION, ctypes.addressof(self.buffer))
        self.calls = [
            (ctypes.c_int(option), *(ctypes.c_ulong(a) for a in args))
            for option, args in (
                (abi.PR_SET_NO_NEW_PRIVS, (1, 0, 0, 0)),
                (abi.PR_SET_SECCOMP, (abi.SECCOMP_MODE_FILTER, ctypes.addressof(self.fprog), 0, 0)),
            )
        ]
        # One harmless call through the same path (PR_GET_NO_NEW_PRIVS), so
        # lazy symbol binding and ctypes' call machinery are settled before
        # the forks, not in every child.
        self.prctl(ctypes.c_int(abi.PR_GET_NO_NEW_PRIVS), *(ctypes.c_ulong(0) for _ in range(4)))

    def load(self) -> None:
        for args in self.calls:
            if self.prctl(*args) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"loading the seccomp filter (prctl {args[0].value}): {os.strerror(err)}")


def read_filter(fd: int) -> FilterLoader:
    """The program on `fd` (closed here: no env code ever holds it), ready to load."""
    chunks = []
    try:
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    finally:
        os.close(fd)
    program = b"".join(chunks)
    if not program or len(program) % abi.BPF_INSTRUCTION:
        raise RuntimeError(f"the seccomp program on fd {fd} is {len(program)} bytes: not a BPF program")
    return FilterLoader(program)


def path_of(values: dict[str, Any], key: str) -> str:
    """The parsed plan's `key`, checked to be a normalized absolute path (not /)."""
    path: str = values[key]
    if not path.startswith("/") or path == "/" or "," in path or os.path.normpath(path) != path:
        raise ValueError(f"${VARIABLE}: {key} must be a normalized absolute path, not {path!r}")
    return path


def number_of(values: dict[str, Any], key: str, low: int = 0) -> int:
    """The parsed plan's `key`, checked to be a whole number of at least `low`."""
    value = values[key]
    if not value.isdigit() or len(value) > 20 or int(value) < low:
        raise ValueError(f"${VARIABLE}: {key} must be a whole number of at least {low}, not {value!r}")
    return int(value)


def mount_calls(mounts: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """(source, target, fstype, flags, data, what) rows as mount(2)'s ctypes arguments and the step's words."""
    return [
        ((a and a.encode(), b.encode(), c and c.encode(), ctypes.c_ulong(f), d and d.encode()), what)
        for a, b, c, f, d, what in mounts
    ]


class Plan:
    """The set-up's system calls, their arguments built once from VARIABLE's parsed values.

    `mounts`: (mount(2)'s five arguments, what it is for an error message), in
    order: the workspace tmpfs at <dev>/shm (its directories are made
    next, `shm_dirs`), the workspace and <dev>/shm bound from it, the devpts
    (with `ptys` 0: an empty read-only directory of it over <dev>/pts instead).
    The workspace and /dev/shm are two directories of one capped tmpfs, the
    shm one bound over the tmpfs's own root, which no path reaches after: one
    superblock per env, not two (each costs every memory cgroup a slot in a
    per-cgroup table, docs/hard-reset.md). `sysctls`: (path, value) writes.
    Also kept for template._ChildPlan: `unshare` (namespace names), `ids`,
    `hostname`, `proc`, `rlimits` (text for rlimits.parse).
    """

    def __init__(self, values: dict[str, Any]) -> None:
        unshare = values["unshare"].split(",") if values["unshare"] else []
        if not set(unshare) <= _NAMESPACES or len(set(unshare)) != len(unshare):
            raise ValueError(f"${VARIABLE}: unshare names {unshare!r}; only {sorted(_NAMESPACES)} are known")
        self.unshare = frozenset(unshare)
        self.ids = (number_of(values, "uid"), number_of(values, "gid"))
        self.hostname = values["hostname"]
        if "uts" not in self.unshare and self.hostname:
            raise ValueError(f"${VARIABLE}: a hostname needs a uts namespace")
        workspace, dev, self.proc = (path_of(values, key) for key in ("workspace", "dev", "proc"))
        self.workspace = workspace.encode()
        size, inodes = (number_of(values, key, 1) for key in ("size", "inodes"))
        ptys = number_of(values, "ptys")
        self.rlimits = values["rlimits"]
        flags = abi.MS_NOSUID | abi.MS_NODEV
        shm = f"{dev}/shm"
        self.shm_dirs = [(f"{shm}/w".encode(), 0o755), (f"{shm}/s".encode(), 0o1777)]
        cover, pts = [], []
        if ptys:
            # (not nodev: its ptmx and ptys are the devices it is for)
            pts = [
                (
                    "devpts",
                    f"{dev}/pts",
                    "devpts",
                    abi.MS_NOSUID | abi.MS_NOEXEC,
                    f"newinstance,ptmxmode=0666,mode=620,max={ptys}",
                    f"mount {dev}/pts",
                )
            ]
        else:
            # No ptys: an empty read-only directory of the workspace tmpfs over
            # <dev>/pts, hiding the devpts below (bwrap's, or the template's,
            # which every child would share), and no superblock of its own.
            # /dev/ptmx (-> pts/ptmx) then names nothing: ENOENT. Bound while
            # the tmpfs's root is still reachable (before <dev>/shm covers it).
            self.shm_dirs.append((f"{shm}/p".encode(), 0o555))
            cover = [
                (f"{shm}/p", f"{dev}/pts", None, abi.MS_BIND, None, f"cover {dev}/pts"),
                (
                    None,
                    f"{dev}/pts",
                    None,
                    abi.MS_BIND | abi.MS_REMOUNT | abi.MS_RDONLY | flags | abi.MS_NOEXEC,
                    None,
                    f"make {dev}/pts read-only",
                ),
            ]
        mounts = [
            ("tmpfs", shm, "tmpfs", flags, f"size={size},nr_inodes={inodes},mode=0700", "mount the workspace tmpfs"),
            (f"{shm}/w", workspace, None, abi.MS_BIND, None, "bind the workspace"),
            *cover,
            (f"{shm}/s", shm, None, abi.MS_BIND, None, f"bind {shm}"),
            *pts,
        ]
        self.mounts = mount_calls(mounts)
        self.sysctls = [
            (f"{SYSCTL_DIR}/{key[7:]}".encode(), str(number_of(values, key)).encode())
            for key in values
            if key.startswith("sysctl.")
        ]
        self.proc_read_only = (
            (
                None,
                self.proc.encode(),
                None,
                ctypes.c_ulong(abi.MS_BIND | abi.MS_REMOUNT | abi.MS_RDONLY | flags | abi.MS_NOEXEC),
                None,
            ),
            f"make {self.proc} read-only",
        )
        self.capabilities = Capabilities()

    def mount_workspace_and_devpts(self) -> None:
        """The capped workspace (and /dev/shm) and a devpts of our own; cwd in the workspace."""
        mounts = self.mounts
        abi.check(abi.libc.mount(*mounts[0][0]), mounts[0][1])
        for path, mode in self.shm_dirs:
            os.mkdir(path)
            os.chmod(path, mode)  # past the umask
        for arguments, what in mounts[1:]:
            abi.check(abi.libc.mount(*arguments), what)
        os.chdir(self.workspace)

    def become_ids(self) -> None:
        """Exec mode, [identity] uid/gid not 0: become them in a user namespace
        of our own (and a mount namespace it owns, for /proc's read-only remount).

        bubblewrap starts every sandbox as uid 0 of its user namespace: the
        set-up's mounts need it (a process that bubblewrap's --uid makes some
        other uid keeps CAP_SYS_ADMIN, yet the kernel refuses it a tmpfs). So
        once the workspace is mounted, the env's ids are mapped onto that 0,
        the way each template child maps them onto the template's. Mapping a
        parent's uid 0 needs CAP_SETFCAP there (the plan adds it to the set-up's
        capabilities, dropped with the others before env.py). The quotas are
        then written in this namespace, the one the env's own count against."""
        enter_user_namespace(self.ids, (0, 0), also=abi.CLONE_NEWNS)

    def write_sysctls(self) -> None:
        """The per-user-namespace limits of the namespace we are in."""
        for path, value in self.sysctls:
            fd = os.open(path, os.O_WRONLY)
            try:
                os.write(fd, value)
            finally:
                os.close(fd)

    def finish(self) -> None:
        """Exec mode: everything after bubblewrap, before env.py (module docstring).
        Not through boltzlabs.host.seccomp: its host half's imports (dataclasses,
        functools) would cost every exec-mode env ~2 MiB."""
        env_filter = read_filter(int(os.environ.pop(abi.CHILD_FILTER_VARIABLE)))
        self.mount_workspace_and_devpts()
        if self.ids != (0, 0):
            self.become_ids()
        self.write_sysctls()
        abi.check(abi.libc.mount(*self.proc_read_only[0]), self.proc_read_only[1])
        self.capabilities.drop()
        env_filter.load()


def main(argv: Any = None) -> None:
    """Exec mode's entry point: rlimits, the sandbox's last steps, then env.py.
    A failure of the set-up (no env code has run) prints its traceback and exits
    abi.SET_UP_EXIT: the worker tells the sandbox's fault from the env's by that code."""
    from boltzlabs.runtime import rlimits as limits

    try:
        plan = Plan(parse(os.environ.pop(VARIABLE, "")))
        limits.apply(plan.rlimits)
        plan.finish()
    except BaseException:
        set_up_failed()
    limits.run((sys.argv[1:] if argv is None else argv)[0])


def set_up_failed() -> None:
    """In a sandbox whose own set-up raised (the exception being handled): its traceback on stderr
    (the env's log), then exit abi.SET_UP_EXIT. Never returns."""
    try:
        import traceback  # only on failure

        sys.stderr.write(traceback.format_exc())
        sys.stderr.flush()
    finally:
        os._exit(abi.SET_UP_EXIT)


if __name__ == "__main__":
    main()
