"""Each lane's confinement, checked from outside: what the kernel says of the env's process.

    spawner (exec: bwrap's command; template: the child's pid 1) --HELLO (reactor.py)-->
        Confinement.check(lane, pid, pidfd): /proc/<pid>/status and /proc/<pid>/ns/*, read
        by the worker --> '' (the lane goes on) or what is wrong (the lane is killed, named)

Defence in depth. Every sandbox confines itself (bubblewrap, then
boltzlabs/runtime/confine.py, or the template's child set-up in
boltzlabs/runtime/template.py) before any env code runs; a process that
took part in that set-up and was subverted (a trusted template whose
import-time code patched the runtime, a bug) could hand the env a sandbox
with less in it. So before a lane's first request the worker, on the host,
reads what the kernel reports for the env's process and refuses the lane
unless it shows:

- seccomp in filter mode with at least the filters the plan loads (bwrap's,
  then the env's full filter: more are fine, an env may add its own);
- no_new_privs;
- no capability in any set (inheritable, permitted, effective, bounding,
  ambient), as seen in the process's own user namespace;
- the host account's uid and gid, every one of them (real, effective,
  saved, filesystem);
- a namespace of its own of every kind the plan unshares (user, pid and mount
  always): none shared with the worker, the template, or any other live lane.

Kernel facts this depends on: /proc/<pid>/status's Cap* lines are the sets
in the process's own user namespace; its Seccomp_filters line (Linux 5.9+)
counts the filters attached; /proc/<pid>/ns/<kind> names a namespace by its
inode, unique while the namespace lives. A pid can be reused once its
process is reaped, so every read is made through a pid whose pidfd we
hold, and the pidfd is polled after the reads: if the process has exited
by then, what was read may be another's and nothing is concluded (its
death is reported on its lane anyway).
"""

from __future__ import annotations

import os
import select

from boltzlabs.runtime.rlimits import read_file

__all__ = ["Confinement", "NAMESPACE_KINDS"]

NAMESPACE_KINDS = ("user", "mnt", "pid", "net", "ipc", "uts", "cgroup")
_CAPABILITY_SETS = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")


class Confinement:
    """The check every lane passes before its first request.

    `namespaces`: the kinds the plan gives every sandbox (plan.namespaces:
    [namespaces] unshare of sandbox/policy.toml; a mount namespace always);
    `filters`: how many seccomp filters the plan loads into each sandbox;
    `uid`, `gid`: the host account the sandboxes run as (None: not checked).
    """

    def __init__(self, namespaces, filters: int, uid: int | None = None, gid: int | None = None):
        self.kinds = tuple(kind for kind in NAMESPACE_KINDS if kind == "mnt" or kind in set(namespaces))
        self.filters = int(filters)
        self.uid, self.gid = uid, gid
        self.others: dict[str, str] = {}  # namespace id -> whose (the worker's, the template's)
        self.lanes: dict[str, int] = {}  # namespace id -> the live lane that has it
        self.held: dict[int, list[str]] = {}  # lane -> its namespace ids
        self.outside(os.getpid(), "the worker")

    def outside(self, pid: int, who: str) -> None:
        """Namespaces of a process no lane may share (the worker's, the
        template's), in place of what `who` had before."""
        self.gone(who)
        for kind in self.kinds:
            try:
                self.others[os.readlink(f"/proc/{pid}/ns/{kind}")] = who
            except OSError:
                pass

    def gone(self, who: str) -> None:
        """`who` has exited: its namespaces are freed, and their numbers may be
        reused by a lane's (a template that died, before the next one)."""
        for ident in [ident for ident, owner in self.others.items() if owner == who]:
            del self.others[ident]

    def check(self, lane: int, pid: int, pidfd: int) -> str:
        """What is wrong with lane's process `pid` (held by `pidfd`), or '' if
        nothing is (or if it has exited during the reads: its death is
        reported on its lane). On '' the lane's namespaces are remembered
        until `forget(lane)`. Fails closed: a process it cannot find is refused."""
        if pid <= 0 or pidfd < 0:
            return "its process could not be found (it may have exited at once)"
        try:
            text = read_file(f"/proc/{pid}/status").decode(errors="replace")
            status = dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)
            namespaces = {kind: os.readlink(f"/proc/{pid}/ns/{kind}") for kind in self.kinds}
        except OSError:
            return ""  # it has exited: the death is reported on its lane
        if _gone(pidfd):
            return ""  # exited during the reads: they may describe another process
        problems = []
        if status.get("Seccomp", "").strip() != "2":
            problems.append(f"seccomp mode {status.get('Seccomp', '?').strip()} (the policy's filters run in mode 2)")
        filters = status.get("Seccomp_filters", "").strip()
        if filters.isdigit() and int(filters) < self.filters:
            problems.append(f"{filters} seccomp filter(s) attached where the policy loads {self.filters}")
        if status.get("NoNewPrivs", "").strip() != "1":
            problems.append("no_new_privs is not set")
        held = [name for name in _CAPABILITY_SETS if status.get(name, "0").strip().strip("0")]
        if held:
            problems.append("capabilities in " + ", ".join(f"{name} ({status[name].strip()})" for name in held))
        for field, want in (("Uid", self.uid), ("Gid", self.gid)):
            ids = status.get(field, "").split()
            if want is not None and ids != [str(want)] * 4:
                problems.append(f"{field} {' '.join(ids)} (the sandboxes' account is {want})")
        for kind, ident in namespaces.items():
            if ident in self.others:
                problems.append(f"shares its {kind} namespace with {self.others[ident]}")
            elif self.lanes.get(ident, lane) != lane:
                problems.append(f"shares its {kind} namespace with lane {self.lanes[ident]}")
        if problems:
            return "; ".join(problems)
        self.forget(lane)
        self.held[lane] = list(namespaces.values())
        for ident in self.held[lane]:
            self.lanes[ident] = lane
        return ""

    def forget(self, lane: int) -> None:
        """Lane's process is gone: its namespaces may be reused."""
        for ident in self.held.pop(lane, ()):
            if self.lanes.get(ident) == lane:
                del self.lanes[ident]


def _gone(pidfd: int) -> bool:
    """Whether the process a pidfd holds has exited (a pidfd polls readable then)."""
    if pidfd < 0:
        return True
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))
