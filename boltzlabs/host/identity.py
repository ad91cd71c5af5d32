"""Who the sandboxes are on the host: never root.

    sandbox/policy.toml [identity] --host_account()--> HostAccount
    HostAccount.prefix      `setpriv --reuid --regid --clear-groups --`, put
                            before every bwrap command line by sandbox.py
    HostAccount.source(p)   where bwrap, run as the account, finds bind source p

A worker started by root starts every bubblewrap (each exec-mode env's, the
template's) as the policy's unprivileged account (`nobody` by default), so
bwrap builds an unprivileged user namespace and every process of a sandbox
has that host uid: escaping the namespaces gives that account, not root. A
worker started by an ordinary user is unprivileged already and changes
nothing. Either way the env sees the policy's uid and gid inside (bwrap
--uid/--gid), mapped onto the host account.

Kernel facts this depends on:
- execve() copies the effective uid to the saved uid, and clears the
  permitted capabilities of a process whose uids are all non-zero (bwrap has
  no file capabilities): after setpriv's exec of bwrap, real, effective and
  saved uids are the account's and no capability is left on the host.
- bwrap resolves every bind source by path, even --ro-bind-fd (it must: a
  mount of another mount namespace cannot be bound, so it reads the fd's path
  and binds that). The account must therefore be able to walk to each source.
  The interpreter often lives where it cannot (pyenv under /root, mode 0700).
  Such sources are bound again, in a private mount namespace of the worker,
  below a directory the account can reach, and bwrap binds them from there.
  The namespace is the worker's alone (its mounts propagate nowhere) and dies
  with it; what is inside a source must still be readable by the account.
- root may move any process between cgroups (cgroup.procs), whatever its
  uid, so cgroup accounting is unchanged.
"""

from __future__ import annotations

import contextlib
import glob
import grp
import os
import pwd
import shutil
import stat
import tempfile
from dataclasses import dataclass, field
from typing import Any

from boltzlabs import abi
from boltzlabs.errors import SandboxUnavailable

_FIX = "set [identity] host_user in sandbox/policy.toml to an existing unprivileged account"


def may(st: os.stat_result, uid: int, gid: int, bits: int) -> bool:
    """Whether `uid` with group `gid` (no supplementary groups, no
    capabilities) has the permission `bits` (4 r, 2 w, 1 x) on a file."""
    shift = 6 if st.st_uid == uid else 3 if st.st_gid == gid else 0
    return (st.st_mode >> shift) & bits == bits


def reachable(path: str, uid: int, gid: int) -> bool:
    """Whether the account can walk to `path` and read it (list it, for a
    directory): search permission on every directory above it."""
    path = os.path.realpath(path)
    parent = "/"
    for part in path.split("/")[1:-1]:
        parent = os.path.join(parent, part)
        if not may(os.stat(parent), uid, gid, 1):
            return False
    st = os.stat(path)
    return may(st, uid, gid, 5 if stat.S_ISDIR(st.st_mode) else 4)


@dataclass
class HostAccount:
    """The host uid and gid every process of every sandbox runs as.

    `switch`: the worker is root and starts each bwrap as this account
    (`prefix` is the command that does it); otherwise the worker is already
    unprivileged, the account is the worker's own and `prefix` is empty.
    `inside`: the (uid, gid) the env sees in its user namespace.
    """

    name: str
    uid: int
    gid: int
    inside: tuple[int, int]
    prefix: tuple[str, ...] = ()
    _staged: dict[str, str] = field(default_factory=dict)
    _stage_dir: str | None = None

    @property
    def switch(self) -> bool:
        """Whether bwrap is started as another account than the worker's."""
        return bool(self.prefix)

    def check_readable(self, path: str, what: str, bits: int) -> None:
        """Raise SandboxUnavailable if the account lacks `bits` on `path` itself
        (its parents may be out of reach: they are staged)."""
        if self.switch and not may(os.stat(path), self.uid, self.gid, bits):
            raise SandboxUnavailable(
                f"{what} {path} is not readable by {self.name} (uid {self.uid}), the host account the "
                f"sandboxes run as; make it readable by others (chmod -R o+rX {path}), or {_FIX}"
            )

    def source(self, path: str) -> str:
        """Where bwrap, running as the account, finds bind source `path`: the
        path itself, or a copy of the mount below a directory it can reach."""
        if not self.switch or reachable(path, self.uid, self.gid):
            return path
        if path not in self._staged:
            if self._stage_dir is None:
                self._stage_dir = _private_stage_dir()
            node = os.path.join(self._stage_dir, str(len(self._staged)))
            if os.path.isdir(path):
                os.mkdir(node)
            else:
                open(node, "x").close()
            abi.check(
                abi.libc.mount(path.encode(), node.encode(), None, abi.MS_BIND | abi.MS_REC, None), f"bind {path}"
            )
            self._staged[path] = node
        return self._staged[path]

    def close(self) -> None:
        """Remove the staging directory (its mounts go with the worker's namespace)."""
        if self._stage_dir is None:
            return
        abi.libc.umount2(self._stage_dir.encode(), abi.MNT_DETACH)
        try:
            os.rmdir(self._stage_dir)
        except OSError:
            pass
        self._stage_dir = None
        self._staged.clear()


def _private_stage_dir() -> str:
    """Move the worker into a mount namespace of its own (a slave of the host's:
    nothing mounted here propagates out) and mount a small tmpfs the account
    can walk through (mode 0711: through, not list). Returns its path."""
    abi.check(abi.libc.unshare(abi.CLONE_NEWNS), "unshare a mount namespace for the worker")
    abi.check(abi.libc.mount(None, b"/", None, abi.MS_REC | abi.MS_SLAVE, None), "make / a slave mount")
    # An empty directory on the host (the tmpfs is only in our namespace);
    # close() removes it; one left by a worker killed before it could (its pid
    # is in the name, and gone) is swept here. A live worker's looks empty
    # from here too: its pid is the only guard, and rmdir removes nothing else.
    for stale in glob.glob(os.path.join(tempfile.gettempdir(), "boltzlabs-binds-*-*")):
        pid = os.path.basename(stale).split("-")[2]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            with contextlib.suppress(OSError):
                os.rmdir(stale)
    path = tempfile.mkdtemp(prefix=f"boltzlabs-binds-{os.getpid()}-")
    abi.check(
        abi.libc.mount(
            b"tmpfs", path.encode(), b"tmpfs", abi.MS_NOSUID | abi.MS_NODEV | abi.MS_NOEXEC, b"size=64k,mode=0711"
        ),
        f"mount a tmpfs on {path}",
    )
    return path


def host_account(policy_identity: dict[str, Any]) -> HostAccount:
    """Resolve the policy's [identity] for this worker; see the module docstring."""
    inside = (int(policy_identity.get("uid", 0)), int(policy_identity.get("gid", 0)))
    if os.geteuid() != 0:
        uid, gid = os.geteuid(), os.getegid()
        try:
            name = pwd.getpwuid(uid).pw_name
        except KeyError:
            name = f"uid {uid}"
        return HostAccount(name, uid, gid, inside)
    name = policy_identity.get("host_user", "nobody")
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise SandboxUnavailable(
            f"the pool runs as root, so its sandboxes run as the account {name!r} ([identity] host_user in "
            f"sandbox/policy.toml), and this host has no such user; create it (useradd --system "
            f"--no-create-home --shell /usr/sbin/nologin {name}) or {_FIX}"
        ) from None
    gid = entry.pw_gid
    if policy_identity.get("host_group"):
        try:
            gid = grp.getgrnam(policy_identity["host_group"]).gr_gid
        except KeyError:
            raise SandboxUnavailable(
                f"[identity] host_group {policy_identity['host_group']!r} in "
                f"sandbox/policy.toml does not exist on this host"
            ) from None
    if entry.pw_uid == 0 or gid == 0:
        raise SandboxUnavailable(
            f"[identity] in sandbox/policy.toml names {name!r}, which is root (uid "
            f"{entry.pw_uid}, gid {gid}): sandboxes must never run as host root; {_FIX}"
        )
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        raise SandboxUnavailable(
            f"the pool runs as root and starts its sandboxes as {name!r} with setpriv, "
            f"which is missing; install util-linux (apt-get install -y util-linux)"
        )
    prefix = (setpriv, f"--reuid={entry.pw_uid}", f"--regid={gid}", "--clear-groups", "--")
    return HostAccount(name, entry.pw_uid, gid, inside, prefix)
