"""Memory accounting and limits: one cgroup per env below one pool cgroup.

    cgroup v1 (one tree per controller: memory, pids, freezer; cpuacct for a pool with a cpu_budget,
    cpu for a pool with cpu_share):
        <the worker's own cgroup in each>/
            boltzlabs-<worker pid>-<tag>/      the pool (pids.max: the pool's cap)
                env-0/  env-1/  ...  template/ probe/     one per env, a sandbox's whole tree
        memory, when the pool sets no per-env memory limit:
            boltzlabs-<worker pid>-<tag>/
                envs/  template/  probe/       every env in one memory cgroup
    cgroup v2 (one tree), the worker started in cgroup S (under systemd, in a unit
    systemd did not delegate: S is the scope boltzlabs-<worker pid>.scope that
    systemd makes for the worker alone, host/systemd.py):
        S/                                     +memory +pids in cgroup.subtree_control
            boltzlabs-procs/                   "the leaf": what was in S, the worker among it
            boltzlabs-<worker pid>-<tag>/      the pool (pids.max: the pool's cap), +memory +pids
                env-0/  env-1/  ...  template/ probe/

`CgroupPool` is the one interface the worker uses; `_V1` and `_V2` are its
two backends, and `PoolView` reads a pool's cgroups through the same
backends from their paths alone (tests, diagnostics). We only ever create
cgroups below the cgroup the worker started in (or the scope systemd made for
it), and remove what we created; systemd removes the scope once it is empty.

Kernel facts this depends on:
- A process is charged for the pages it touches first, and a forked child
  starts in its parent's cgroup. So the worker moves itself into an env's
  cgroup just around the spawn (`moving()`), and the whole sandbox tree is
  born there. Pages shared with the host (the interpreter's files in page
  cache) stay charged to whoever read them first.
- cgroup v1: each controller is a hierarchy of its own; the pool's tree is
  made in each (memory; pids; the freezer for serialize_measurement) and a
  process is moved into all of them. `memory.usage_in_bytes` includes kernel
  memory (namespaces, page tables) and page cache. We report the working
  set, usage minus inactive file pages, as `docker stats` does.
- cgroup v2's "no internal processes" rule: a cgroup other than the root may
  enable a domain controller (memory) in its cgroup.subtree_control only
  while it holds no process (EBUSY), and no process may then be moved into
  it. The worker always starts in a cgroup that holds processes (itself;
  under systemd its service's or scope's others), so, as container runtimes
  do with a delegated cgroup, it moves the process tree it belongs to into a
  leaf below, enables memory and pids above it, and makes the pool beside
  it (`_V2._make_room`). The root cgroup is exempt (a pool goes straight in
  it); inside a container's cgroup namespace the namespace's root is not,
  and gets a leaf like any other. A worker started in such a leaf (a second
  pool of the same trainer) shares the room, and the last pool to close
  undoes it: controllers off, every process back, the leaf removed.
- Killing for sure: SIGKILL to every pid in cgroup.procs, again and again
  until the group is empty (rmdir fails with EBUSY while a task is left), so
  a process forked between a read of cgroup.procs and the kills is caught
  by the next round; the pids limit bounds how many there can be. cgroup
  v2 has cgroup.kill, which the kernel applies to forks in progress too.
- pids.max counts tasks (threads too) in a cgroup and all below it and makes
  fork/clone fail with EAGAIN; moving a process in is never refused. The
  pool's cgroup has a cap of its own (limits.pool_pids), so n envs at their
  per-env cap cannot take every pid of the host together. The "max" line of
  pids.events counts refused forks, which is how a lane learns its env hit a
  limit.
- Every memory cgroup keeps, per memory-cgroup-aware shrinker (one per
  mounted superblock: each env's workspace tmpfs, devpts and proc), a slot
  in its shrinker_info (~16 bytes: 520-byte units of 64 in kmalloc-1k),
  allocated in every memory cgroup for every shrinker and charged to none.
  One memory cgroup per env makes that n x 3n: ~90 KiB per env at 1,000
  envs, ~0.9 MiB at 10,000. So on v1, where memory is a hierarchy of its
  own, an env gets a memory cgroup of its own only when the pool sets a
  per-env memory limit; otherwise every env shares the pool's "envs" memory
  cgroup (accounting stays exact for the pool; `env_usages` splits it
  evenly), while the pids and freezer groups, which keep no such slots,
  stay per env: kills, task counts, fork caps and the measurement gate are
  still one env's. v2 has one tree, so its envs keep a cgroup each.
- CPU accounting (RLPool(cpu_budget=)) counts every task of a cgroup and all
  below it, children and setsid daemons included (a task cannot leave its
  cgroup without the cgroup filesystem, which no sandbox mounts): v1's
  cpuacct.usage (ns), a hierarchy of its own, joined only by the envs of a
  pool that asks for it (a spawn then joins one more cgroup); v2's cpu.stat
  usage_usec, in every cgroup whether or not the cpu controller is enabled.
  How fast a cgroup can spend it is bounded by its cpuset (`cpus_allowed`),
  not by affinity, which any task may widen within its cpuset.
- CPU shares (RLPool(cpu_share=True)): the scheduler weighs each group of the
  cpu controller as one, whatever it holds, against its siblings (v1
  cpu.shares, v2 cpu.weight, each left at its default: every env the same).
  So an env's processes together get one env's share, however many it forks
  or sessions it starts. Without it the kernel's autogroup (on in Debian's
  and Ubuntu's kernels) weighs each session as one: every env's sandbox is a
  session, and a `setsid()` inside it makes one more, at full weight. A task
  in a cpu cgroup other than the root is out of autogroup, so within an
  env the nice values hold (a server at 0 beats its own children at 19).
  The pool's group itself weighs as one against the worker's and trainer's
  processes, so a pool's envs cannot starve the process that steps them.
  v1: a hierarchy of its own (or co-mounted with cpuacct, then one group
  serves both), joined only by the envs of a pool that asks for it; v2: the
  controller enabled in the room and the pool's subtree_control for such a
  pool only.
- Freezing is asynchronous: v1's freezer.state reads FREEZING until every
  task has stopped (reading it re-checks), v2's cgroup.events says
  "frozen 1". A SIGKILL to a task frozen by the v1 freezer waits for the
  thaw, so every kill here thaws after signalling: the tasks die on their
  way out of the freezer, before any of their code runs again.
"""

from __future__ import annotations

import errno
import os
import secrets
import signal
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from boltzlabs.errors import CgroupUnavailable
from boltzlabs.host import systemd
from boltzlabs.runtime.rlimits import read_file, stat_fields

LEAF = "boltzlabs-procs"  # v2: where the worker and its process tree go to make room
# v2 controllers a pool needs: memory (accounting, memory_limit), pids (the
# fork-bomb caps). The freezer is cgroup.freeze, in every non-root cgroup.
NEEDED = ("memory", "pids")
# v2 controllers enabled only for a pool that asks: cpu (RLPool(cpu_share=True)).
ON_REQUEST = ("cpu",)
# Every controller a pool may have a group of (PoolView finds each by its hierarchy).
CONTROLLERS = ("memory", "pids", "freezer", "cpuacct", "cpu")
# Where to read how to run the worker in a cgroup it may use (systemd, containers).
HOST_DOC = "docs/host.md#cgroup-v2-and-systemd"


def _own_cgroups(pid: int | str = "self") -> dict[str, str]:
    """{controller or '' (v2): path} of a process, from /proc/<pid>/cgroup."""
    out: dict[str, str] = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            out[name] = path
    return out


def _mounts() -> list[tuple[str, str, list[str]]]:
    """[(mount point, fstype, super options)] from /proc/self/mountinfo."""
    out: list[tuple[str, str, list[str]]] = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, right = line.split(" - ", 1)
        fstype, _source, options = right.split(" ", 2)
        out.append((left.split(" ")[4], fstype, options.split(",")))
    return out


def _write(path: Any, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _read(path: Any) -> str:
    return read_file(path).decode()


def _mkdir(path: Any) -> None:
    try:
        os.mkdir(path)
    except FileExistsError:
        pass


def _read_int(path: Path) -> int:
    return int(_read(path).split()[0])


def _read_limit(path: Path) -> int | None:
    """A limit file's value; None for "max" (no limit)."""
    text = _read(path).split()[0]
    return None if text == "max" else int(text)


def _read_stat(path: Path) -> dict[str, int]:
    stats: dict[str, int] = {}
    for line in _read(path).splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            stats[key] = int(value)
    return stats


def _words(path: Path) -> list[str]:
    try:
        return _read(path).split()
    except OSError:
        return []


def _procs(group: Path) -> list[int]:
    try:
        return [int(p) for p in _read(os.path.join(group, "cgroup.procs")).split()]
    except FileNotFoundError:
        return []


class _Backend:
    """What the pool does with a cgroup, per cgroup version. Every reader takes
    a group's path and nothing else, so PoolView can use it on paths alone.
    `home`: where pools are made; `procs_home`: the worker's own cgroup."""

    version = ""

    # The freezer, where the version has one (v1's freezer controller, v2's cgroup.freeze).
    def freeze(self, group: Path) -> None:
        raise NotImplementedError

    def thaw(self, group: Path) -> None:
        raise NotImplementedError

    def frozen(self, group: Path) -> bool:
        raise NotImplementedError

    def __init__(self, home: Path | None) -> None:
        self.home = home
        self.procs_home = home
        self.note = ""  # what the backend did to make room, for doctor
        # Where the room is in a unit systemd owns and may stop on an env's OOM kill, why (v2).
        self.risk = ""

    def prepare_pool(self, pool: Path, cpu: bool = False) -> None:
        """Make the pool's group; `cpu`: with the cpu controller for its envs (v2: v1 has a tree of it)."""
        pool.mkdir()

    def release(self) -> bool:
        """Undo what was done to make room for pools (v2); True when nothing is left of it."""
        return True

    def cpu_note(self, pool: Path) -> str:
        """Why `pool`'s envs have no cpu controller's group (v2; v1 says it by _v1_pool_group)."""
        raise NotImplementedError

    def usage(self, group: Path) -> int:
        raise NotImplementedError

    def set_limit(self, group: Path, limit: int) -> None:
        raise NotImplementedError

    def memory_limit(self, group: Path) -> int | None:
        """The group's memory limit in bytes, None for none."""
        raise NotImplementedError

    def swap_limit(self, group: Path) -> int | None:
        """Bytes of swap the group may use beyond its memory limit; None: no limit."""
        raise NotImplementedError

    def swap_used(self, group: Path) -> int:
        raise NotImplementedError

    def oom_kills(self, group: Path) -> int:
        raise NotImplementedError

    def set_pids(self, group: Path, limit: int) -> None:
        _write(os.path.join(group, "pids.max"), b"%d" % limit)

    def pids_limit(self, group: Path) -> int | None:
        return _read_limit(group / "pids.max")

    def pids_current(self, group: Path) -> int:
        return _read_int(group / "pids.current")

    def pids_refused(self, group: Path) -> int:
        """How many forks pids.max has refused in `group` (pids.events "max")."""
        return _read_stat(group / "pids.events").get("max", 0)

    def procs(self, group: Path) -> list[int]:
        return _procs(group)

    def kill(self, group: Path) -> None:
        _kill_procs(group)

    # The file that counts a group's CPU time, and how many seconds its first bytes say.
    cpu_file = ""

    def cpu_seconds(self, data: bytes) -> float:
        raise NotImplementedError


def _kill_procs(group: Path, pids: list[int] | None = None) -> None:
    """SIGKILL each process listed in `group` (one round; any version, no backend needed),
    or each of `pids`, the list the caller just read from it."""
    for pid in _procs(group) if pids is None else pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class _V1(_Backend):
    version = "v1"
    cpu_file = "cpuacct.usage"  # in the cpuacct hierarchy: nanoseconds, every task of the group and below

    def cpu_seconds(self, data: bytes) -> float:
        return int(data) / 1e9

    # The v1 freezer is its own hierarchy: these take a group in it.
    def freeze(self, group: Path) -> None:
        _write(group / "freezer.state", b"FROZEN")

    def thaw(self, group: Path) -> None:
        _write(group / "freezer.state", b"THAWED")

    def frozen(self, group: Path) -> bool:
        return (group / "freezer.state").read_bytes().strip() == b"FROZEN"

    def usage(self, group: Path) -> int:
        stat = _read_stat(group / "memory.stat")
        return max(0, _read_int(group / "memory.usage_in_bytes") - stat.get("total_inactive_file", 0))

    def set_limit(self, group: Path, limit: int) -> None:
        _write(os.path.join(group, "memory.limit_in_bytes"), b"%d" % limit)
        memsw = os.path.join(group, "memory.memsw.limit_in_bytes")
        if os.path.exists(memsw):  # swap off: memory+swap capped at the same figure
            _write(memsw, b"%d" % limit)
        try:
            _write(os.path.join(group, "memory.swappiness"), b"0")
        except OSError:
            pass

    # v1 says "no limit" with the largest page-aligned counter value.
    _UNLIMITED = 1 << 62

    def memory_limit(self, group: Path) -> int | None:
        value = _read_int(group / "memory.limit_in_bytes")
        return None if value >= self._UNLIMITED else value

    def swap_limit(self, group: Path) -> int | None:
        memsw = group / "memory.memsw.limit_in_bytes"
        if memsw.exists():
            both, memory = _read_int(memsw), _read_int(group / "memory.limit_in_bytes")
            return None if both >= self._UNLIMITED else both - memory
        # No swap accounting in this kernel: swappiness 0 keeps the group's pages in RAM.
        return 0 if _read_int(group / "memory.swappiness") == 0 else None

    def swap_used(self, group: Path) -> int:
        return _read_stat(group / "memory.stat").get("total_swap", 0)

    def oom_kills(self, group: Path) -> int:
        return _read_stat(group / "memory.oom_control").get("oom_kill", 0)


class _V2(_Backend):
    version = "v2"
    cpu_file = "cpu.stat"  # "usage_usec N" first, in every cgroup (the cpu controller need not be on)

    def cpu_seconds(self, data: bytes) -> float:
        for line in data.splitlines():
            key, _, value = line.partition(b" ")
            if key == b"usage_usec":
                return int(value) / 1e6
        raise ValueError("cpu.stat has no usage_usec line")

    def __init__(self, start: Path | None, make_room: bool = True) -> None:
        super().__init__(start)
        self.start = start  # the cgroup this process started in
        self.leaf: Path | None = None  # the leaf of the room it uses (and undoes if last)
        self.enabled: list[str] = []  # controllers it enabled in home's subtree_control
        self.moved: list[int] = []  # processes it moved into the leaf
        if start is not None and make_room:
            self._make_room()

    # -- making room (the no-internal-processes rule) ----------------------------------

    def _make_room(self) -> None:
        start = self.start
        assert start is not None  # only called with a start
        controllers = _words(start / "cgroup.controllers")
        if "memory" not in controllers:
            raise CgroupUnavailable(
                f"cgroup v2: the worker's cgroup {start} has no memory controller (cgroup.controllers: "
                f"{' '.join(controllers) or 'none'}): the cgroup above it does not pass memory down. "
                + delegation_fix()
            )
        if not (start / "cgroup.type").exists():
            # The root cgroup (it alone has no cgroup.type) may hold processes and
            # enable controllers at once: pools go straight in it.
            self._enable(start, controllers)
            self.note = f"pools in the root cgroup {start}"
            return
        subtree = _words(start / "cgroup.subtree_control")
        parent = start.parent
        if start.name == LEAF and "memory" in _words(parent / "cgroup.subtree_control"):
            if not _writable(parent):
                raise CgroupUnavailable(
                    f"cgroup v2: this worker started in the leaf {start}, but the cgroup "
                    f"above it, {parent}, is not writable by uid {os.geteuid()}. " + delegation_fix()
                )
            # A room made by another worker of ours: share it; the last pool out undoes it.
            self.home, self.leaf = parent, start
            self.enabled = [c for c in NEEDED if c in _words(parent / "cgroup.subtree_control")]
            self.note = f"pools in {parent}, beside the leaf {start} another worker made"
            return
        if "memory" in subtree:
            raise CgroupUnavailable(
                f"cgroup v2: {start} already passes memory to its children, so no process "
                "may be in it, yet this worker is (a threaded cgroup?). " + delegation_fix()
            )
        if not _writable(start):
            raise CgroupUnavailable(
                f"cgroup v2: the worker's cgroup {start} is not delegated to uid "
                f"{os.geteuid()} (its cgroup.procs, cgroup.subtree_control or the "
                "directory is not writable). " + delegation_fix()
            )
        self._refuse_foreign(start)  # before anything changes
        leaf = start / LEAF
        try:
            leaf.mkdir()
        except FileExistsError:  # an empty one left by a worker that was killed
            pass
        except OSError as exc:
            raise CgroupUnavailable(f"cgroup v2: cannot create the leaf {leaf}: {exc}. " + delegation_fix()) from exc
        self.leaf, self.procs_home = leaf, leaf
        try:
            for _ in range(50):  # until the tree's forks since the last read are moved too
                self._move_ours(start, leaf)
                if self._enable(start, [c for c in NEEDED if c in controllers]):
                    break
            else:
                raise CgroupUnavailable(
                    f"cgroup v2: {start} would not pass memory to its children: new "
                    "processes kept appearing in it (EBUSY). " + delegation_fix()
                )
        except BaseException:
            self.release()
            raise
        self.note = (
            f"pools in {start}; the {len(self.moved)} process(es) of the worker's tree that were in it, "
            f"the worker among them, moved to the leaf {leaf} (the no-internal-processes rule)"
        )

    def _move_ours(self, start: Path, leaf: Path) -> None:
        """Move every process of start that belongs to this worker's tree into
        the leaf; CgroupUnavailable naming the others, which are not ours to move."""
        for pid in self._refuse_foreign(start):
            try:
                _write(leaf / "cgroup.procs", str(pid).encode())
                self.moved.append(pid)
            except ProcessLookupError:
                pass  # gone meanwhile

    def _refuse_foreign(self, start: Path) -> list[int]:
        """The processes of start of this worker's tree; CgroupUnavailable naming the others."""
        ours, foreign = _classify(_procs(start))
        if foreign:
            shown = ", ".join(f"{pid} ({_comm(pid)})" for pid in foreign[:5])
            more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
            raise CgroupUnavailable(
                f"cgroup v2: the worker's cgroup {start} holds processes that are not of the worker's own "
                f"process tree ({shown}{more}); the kernel lets {start} pass memory to the pool's cgroups only "
                "once no process is left in it, and these are not ours to move. " + delegation_fix()
            )
        return ours

    def _enable(self, group: Path, controllers: Any) -> bool:
        """Enable `controllers` in group's subtree_control (those not yet on); False on EBUSY."""
        have = _words(group / "cgroup.subtree_control")
        for name in controllers:
            if name in have or name not in NEEDED + ON_REQUEST:
                continue
            try:
                _write(group / "cgroup.subtree_control", f"+{name}".encode())
            except OSError as exc:
                if exc.errno == errno.EBUSY:
                    return False  # a process is (again) in the group
                if name == "memory":
                    raise CgroupUnavailable(
                        f"cgroup v2: cannot enable memory in {group}/cgroup.subtree_control: {exc}. " + delegation_fix()
                    ) from exc
                continue  # pids: the pool runs, without its fork caps (limits_pids says so); cpu: cpu_note
            if self.leaf is not None:  # ours to undo (never the root's)
                self.enabled.append(name)
        return True

    def release(self) -> bool:
        """Undo the room once no pool is left beside the leaf (whichever worker
        made it): memory and pids off, every process of the leaf back in the
        cgroup above, the leaf removed. True when nothing of it is left."""
        start, leaf = self.home, self.leaf
        if leaf is None or start is None:  # a leaf is made only below a home (_make_room)
            return True
        try:
            others = [c for c in start.iterdir() if c.is_dir() and c != leaf]
        except FileNotFoundError:
            return True
        if others:
            return False  # a pool (or a cgroup of someone else's) still needs the room
        disabled = []
        for name in reversed(self.enabled):
            try:
                _write(start / "cgroup.subtree_control", f"-{name}".encode())
                disabled.append(name)
            except OSError:
                # A pool made meanwhile holds the controller: leave the room as it was.
                for again in disabled:
                    try:
                        _write(start / "cgroup.subtree_control", f"+{again}".encode())
                    except OSError:
                        pass
                return False
        self.enabled = []
        for _ in range(50):  # a process of the leaf may fork while we move them
            pids = _procs(leaf)
            if not pids:
                break
            for pid in pids:
                try:
                    _write(start / "cgroup.procs", str(pid).encode())
                except OSError:
                    pass
        try:
            leaf.rmdir()
        except FileNotFoundError:
            pass
        except OSError:
            return False
        self.leaf = None
        self.procs_home = start
        return True

    # -- what a pool does ---------------------------------------------------------------

    def prepare_pool(self, pool: Path, cpu: bool = False) -> None:
        if cpu and self.home is not None:
            # In the room too: the leaf (the worker's tree) and each pool then weigh one each.
            self._enable(self.home, ["cpu"])
        pool.mkdir()
        (pool / "cgroup.subtree_control").write_text("+memory")
        for extra in ("pids", "cpu") if cpu else ("pids",):
            try:  # the pids (cpu) files then sit beside the memory ones
                (pool / "cgroup.subtree_control").write_text(f"+{extra}")
            except OSError:
                pass  # limits_pids, shares_cpu say so

    def cpu_note(self, pool: Path) -> str:
        """Why `pool` does not pass the cpu controller to its envs."""
        have = " ".join(_words(pool / "cgroup.controllers")) or "none"
        return (
            f"cgroup v2: the cpu controller could not be enabled in {pool}/cgroup.subtree_control (the controllers "
            f"it has: {have}); the cgroup above the worker must pass cpu down. " + delegation_fix()
        )

    def usage(self, group: Path) -> int:
        stat = _read_stat(group / "memory.stat")
        return max(0, _read_int(group / "memory.current") - stat.get("inactive_file", 0))

    def set_limit(self, group: Path, limit: int) -> None:
        _write(os.path.join(group, "memory.max"), b"%d" % limit)
        _write(os.path.join(group, "memory.swap.max"), b"0")

    def memory_limit(self, group: Path) -> int | None:
        return _read_limit(group / "memory.max")

    def swap_limit(self, group: Path) -> int | None:
        return _read_limit(group / "memory.swap.max")

    def swap_used(self, group: Path) -> int:
        return _read_int(group / "memory.swap.current")

    def oom_kills(self, group: Path) -> int:
        return _read_stat(group / "memory.events").get("oom_kill", 0)

    def kill(self, group: Path) -> None:
        try:
            (group / "cgroup.kill").write_text("1")
        except OSError:
            super().kill(group)

    def freeze(self, group: Path) -> None:
        _write(group / "cgroup.freeze", b"1")

    def thaw(self, group: Path) -> None:
        _write(group / "cgroup.freeze", b"0")

    def frozen(self, group: Path) -> bool:
        return _read_stat(group / "cgroup.events").get("frozen") == 1


def _writable(group: Path) -> bool:
    """Whether this process may make cgroups in `group` and move processes and
    controllers there (a delegated cgroup: its directory and both files are ours)."""
    return all(os.access(path, os.W_OK) for path in (group, group / "cgroup.procs", group / "cgroup.subtree_control"))


def delegation_fix() -> str:
    """What to run instead, where a cgroup v2 host gives the worker no room."""
    return (
        "Run the worker in a cgroup delegated to it, with memory and pids: as root "
        "`systemd-run --scope -p Delegate=yes -- python train.py`, as a user "
        "`systemd-run --user --scope -p Delegate=yes -- python train.py`, or without a user session bus "
        "`sudo systemd-run --uid=$(id -u) --gid=$(id -g) -p Delegate=yes --same-dir --pty --wait --collect "
        "-- python train.py`; `boltzlabs doctor` run the same way says whether it worked "
        f"({HOST_DOC})"
    )


def systemd_delegated(group: Path) -> bool | None:
    """Whether systemd delegated the unit `group` is in (host/systemd.py says how that is told),
    None where systemd does not run this host or `group` is in no unit of its. Below a unit that
    was not delegated, systemd owns the tree: it may move or remove what others make there."""
    root = hierarchy("memory")
    unit = systemd.unit_of(group, root) if systemd.running() and root is not None else None
    return None if unit is None else systemd.delegated(unit)


def _ppid(pid: int) -> int:
    fields = stat_fields(pid)
    return 0 if fields is None else int(fields[1])


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "gone"


def _classify(pids: list[int]) -> tuple[list[int], list[int]]:
    """(ours, foreign) of the processes of the worker's cgroup. Ours: the
    process tree the worker belongs to there, the descendants of its oldest
    ancestor in the same cgroup (under systemd: the unit's main process, the
    trainer that started the pool, the worker, their other children). Any
    other process was put there by someone else."""
    here = set(pids)
    top, parent = os.getpid(), _ppid(os.getpid())
    while parent in here:
        top, parent = parent, _ppid(parent)
    verdict = {top: True}
    ours: list[int] = []
    foreign: list[int] = []
    for pid in pids:
        chain: list[int] = []
        current = pid
        while current not in verdict and current > 1 and len(chain) < 4096:
            chain.append(current)
            current = _ppid(current)
        mine = verdict.get(current, False)
        for p in chain:
            verdict[p] = mine
        (ours if mine else foreign).append(pid)
    return ours, foreign


def _v2_start(own: dict[str, str], mounts: list[tuple[str, str, list[str]]]) -> Path | None:
    """This process's cgroup in the cgroup2 tree, if one is mounted."""
    if "" not in own:
        return None
    for point, fstype, _ in mounts:
        if fstype == "cgroup2":
            return Path(point) / own[""].lstrip("/")
    return None


def _find_backend(make_room: bool = True) -> _Backend:
    own = _own_cgroups()
    mounts = _mounts()
    reasons = []
    if "memory" in own:
        for point, fstype, options in mounts:
            if fstype == "cgroup" and "memory" in options:
                home = Path(point) / own["memory"].lstrip("/")
                if os.access(home, os.W_OK):
                    return _V1(home)
                reasons.append(f"cgroup v1 memory cgroup {home} is not writable")
    start = _v2_start(own, mounts)
    if start is not None:
        if not start.is_dir():
            reasons.append(
                f"cgroup v2: this process's cgroup {own['']} is not below the cgroup2 mount "
                f"({start} does not exist: a cgroup namespace whose root is not mounted here?)"
            )
        elif make_room:
            return _v2_room(start, Path(next(p for p, f, _ in mounts if f == "cgroup2")))
        else:
            return _V2(start, make_room=False)
    raise CgroupUnavailable("; ".join(reasons) or "no cgroup filesystem is mounted")


def _v2_room(start: Path, root: Path) -> _V2:
    """The v2 backend with its room made. Where systemd is the init and the unit the worker
    started in was not delegated, the room is made in a delegated scope systemd makes for the
    worker alone (host/systemd.py says why: systemd owns that unit, and stops it on an env's OOM
    kill); where systemd gives none, in `start` as elsewhere, and a refusal names both tries."""
    unit = systemd.unit_of(start, root) if systemd.running() else None
    if unit is None or systemd.delegated(unit):
        return _V2(start)
    # Root's scope goes in the slice of the trainer's unit, under the same slice limits
    # (user-0.slice, system.slice); a user's manager has only its own slices (app.slice).
    beside = unit.parent.name if os.geteuid() == 0 and unit.parent.name.endswith(".slice") else None
    try:
        scope = systemd.own_scope(root, beside)
    except CgroupUnavailable as exc:
        tried = f"a delegated scope from systemd, as {unit.name} was not delegated: {exc}"
        try:
            backend = _V2(start)
        except CgroupUnavailable as again:
            raise CgroupUnavailable(f"cgroup v2 under systemd: tried {tried}; then its own room: {again}") from again
        backend.risk = (
            f"{unit.name} is systemd's and not delegated, and systemd gave no scope of the pool's own ({exc}): "
            f"with its default OOMPolicy=stop, an env OOM-killed at memory_limit makes systemd stop "
            f"{unit.name}, the trainer with it. " + delegation_fix()
        )
        backend.note += f"; tried {tried}"
        return backend
    try:
        backend = _V2(scope)
    except CgroupUnavailable as exc:  # (the worker has left `start`: no room there to fall back on)
        raise CgroupUnavailable(
            f"cgroup v2 under systemd: in the delegated scope {scope} that "
            f"{systemd.manager()} made for this worker: {exc}"
        ) from exc
    backend.note = (
        f"in the delegated scope {scope.name} that {systemd.manager()} made for this worker "
        f"({unit.name} was not delegated): " + backend.note
    )
    return backend


def pool_home() -> Path | None:
    """Where a pool started from this process makes its cgroups (v1: the memory
    hierarchy's), without changing anything; None where there is no memory cgroup."""
    try:
        backend = _find_backend(make_room=False)
    except CgroupUnavailable:
        return None
    start = backend.home
    assert start is not None, "a backend _find_backend found has its home (only PoolView's has none)"
    if backend.version == "v2" and start.name == LEAF:
        return start.parent
    return start


def version() -> str:
    """The cgroup version pools get here ("v1" or "v2"), "" where there is no memory cgroup."""
    try:
        return _find_backend(make_room=False).version
    except CgroupUnavailable:
        return ""


def hierarchy(controller: str = "memory") -> Path | None:
    """The mount point of the cgroup hierarchy that holds `controller` for this
    process (v1: that controller's own; v2: the one cgroup2 mount)."""
    own = _own_cgroups()
    for point, fstype, options in _mounts():
        if fstype == "cgroup" and controller in options and controller in own:
            return Path(point)
    if "" in own:
        for point, fstype, _ in _mounts():
            if fstype == "cgroup2" and not any(f == "cgroup" and controller in o for _, f, o in _mounts()):
                return Path(point)
    return None


def cpu_list_count(text: str) -> int:
    """How many CPUs a kernel CPU list names ("0-3,8,10-11": 7); ValueError for what is not one."""
    count = 0
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        count += (int(high) if high else int(low)) - int(low) + 1
    return count


def cpus_allowed() -> int:
    """How many CPUs the tasks of this process's cgroup (and of every cgroup below it: a pool's
    envs) can run on at once: the CPUs of its cpuset (v1: its cpuset hierarchy's group; v2: the
    nearest cpuset.cpus.effective up its tree), else every online CPU. Not its affinity: a task
    may widen its own within its cpuset (sched_setaffinity is not filtered), never leave it."""
    own, mounts = _own_cgroups(), _mounts()
    files: list[Path] = []
    if "cpuset" in own:
        for point, fstype, options in mounts:
            if fstype == "cgroup" and "cpuset" in options:
                group = Path(point) / own["cpuset"].lstrip("/")
                files += [group / "cpuset.effective_cpus", group / "cpuset.cpus"]
    else:
        start = _v2_start(own, mounts)
        root = next((Path(p) for p, f, _ in mounts if f == "cgroup2"), None)
        while start is not None and root is not None and start != root and root in start.parents:
            files.append(start / "cpuset.cpus.effective")
            start = start.parent
    files.append(Path("/sys/devices/system/cpu/online"))
    for path in files:
        try:
            count = cpu_list_count(_read(path))
        except (OSError, ValueError):
            continue
        if count > 0:
            return count
    return os.cpu_count() or 1


def _group_name(key: Any) -> str:
    """The cgroup of env `key` (an int) or of a pool part (its name), below the pool's."""
    return f"env-{key}" if isinstance(key, int) else key


def _v1_pool_group(home: Path | None, name: str, controller: str) -> tuple[Path | None, str]:
    """The pool's own group `name` in the v1 hierarchy of `controller` whose home is `home`
    (made now), and "", or None and why there is none."""
    if home is None:
        return None, f"no writable cgroup v1 {controller} hierarchy holds this process"
    try:
        (home / name).mkdir()
    except OSError as exc:
        return None, f"cannot create the pool's {controller} cgroup {home / name}: {exc}"
    return home / name, ""


def _find_v1_home(controller: str) -> Path | None:
    """The worker's own cgroup in a cgroup v1 hierarchy of `controller`, if writable."""
    own = _own_cgroups()
    if controller not in own:
        return None
    for point, fstype, options in _mounts():
        if fstype == "cgroup" and controller in options:
            home = Path(point) / own[controller].lstrip("/")
            if os.access(home, os.W_OK):
                return home
    return None


def sweep_stale(homes: list[Path]) -> None:
    """Remove pool cgroups left by workers that were killed before cleaning up,
    in every hierarchy of `homes` at once (their frozen tasks die only once thawed)."""
    stale: dict[str, list[Path]] = {}
    for home in homes:
        for pool in home.glob("boltzlabs-*"):
            try:
                os.kill(int(pool.name.split("-")[1]), 0)
                continue  # its worker is alive
            except (ValueError, IndexError, PermissionError):
                continue  # not a pool (the v2 leaf), or not ours to judge
            except ProcessLookupError:
                stale.setdefault(pool.name, []).append(pool)
    for pools in stale.values():
        remove_pool_dir(pools, timeout=1.0)


def remove_pool_dir(path: Any, timeout: float = 5.0) -> bool:
    """Kill whatever is left in a pool cgroup and remove it with its children,
    giving up only once `timeout` seconds pass with nothing gone.
    `path` may be a list of them (one per hierarchy): every hierarchy's tasks
    are killed and thawed before any directory is waited for, since a frozen
    task dies only once its freezer group is thawed."""
    pools = [Path(p) for p in (path if isinstance(path, list) else [path])]
    deadline = time.monotonic() + timeout
    groups = [g for pool in pools if pool.is_dir() for g in pool.iterdir() if g.is_dir()]
    for group in groups:
        _kill_procs(group)
    for group in groups:
        _thaw_v1(group)
    return _rmdir_all(groups + pools, deadline, None, timeout)


def _rmdir_all(groups: list[Path], deadline: float, reap: Any, stall: float) -> bool:
    """_rmdir each of `groups` in turn, the deadline moving on with every one
    removed: it gives up on the rest only once `stall` seconds pass with none
    gone. False if one would not go."""
    ok = True
    for group in groups:
        if _rmdir(group, deadline, reap, stall):
            deadline = max(deadline, time.monotonic() + stall)
        else:
            ok = False
    return ok


def _rmdir(path: Path, deadline: float = 0.0, reap: Any = None, stall: float = 0.0) -> bool:
    """Remove a cgroup, killing what is in it until it is empty (or deadline).
    `reap()` reaps the caller's exited children: a zombie keeps a cgroup busy.

    With `stall`, the deadline moves on while tasks keep leaving: it gives up
    only once `stall` seconds pass with none gone. Thousands of killed
    sandboxes tearing down their namespaces on a loaded machine take longer
    than any fixed deadline (3,333 envs' shared memory cgroup took over 5 s
    here), and a cgroup given up on is left behind."""
    left = None  # tasks in it at the last try
    while True:
        try:
            path.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                return False
            now = time.monotonic()
            procs = _procs(path)
            if stall and left is not None and len(procs) < left:
                deadline = max(deadline, now + stall)
            left = len(procs)
            if now >= deadline:
                return False
            _kill_procs(path, procs)  # forked since the last round: kill again
            _thaw_v1(path)
            if reap is not None:
                reap()
            time.sleep(0.005)


def _thaw_v1(group: Path) -> None:
    """Thaw a v1 freezer group (a no-op in other hierarchies): killed tasks
    there die only once thawed."""
    try:
        _write(group / "freezer.state", b"THAWED")
    except OSError:
        pass


# Pool parts that get the env's memory limit (see CgroupPool).
LIMITED_PARTS = ("template", "probe")
# The memory cgroup every env of a pool without per-env memory limits shares (v1).
SHARED = "envs"
# A closing pool waits for its cgroups while their tasks keep leaving, and
# gives up on one only after this many seconds with none gone (_rmdir).
CLOSE_STALL = 5.0


class CgroupPool:
    """A pool cgroup with one child cgroup per env (and per pool part).

    `moving(0, i, None)` is the context in which env i's sandbox must be started.
    `memory_limit` applies to envs and to the pool parts that hold what an
    env would (LIMITED_PARTS: the template's imports are one env's, and its
    warm-up probe runs an env's code), `pids_max` to envs and every pool part,
    `pool_pids` to the pool's cgroup as a whole (every env and part together).
    `freezer=True` makes envs freezable
    (`freeze`, `thaw`, `frozen`) if the host allows it; `freezes` says
    whether it does, `freezer_note` why not. `per_env_memory` (None: only
    with a `memory_limit`) gives each env a memory cgroup of its own on v1;
    without it the envs share SHARED (the module's docstring says why) and
    `env_usages` splits it. `cpu=True` counts each env's CPU time (`cpu_seconds`,
    for RLPool(cpu_budget=)): on v1 in a cpuacct tree made for this pool only,
    so other pools' spawns join no more cgroups than before; `counts_cpu` says
    whether it does, `cpu_note` why not. Everything is removed by
    `close()`, and on cgroup v2 the room made for it too (`_V2`).
    """

    def __init__(
        self,
        memory_limit: int | None = None,
        pids_max: int | None = None,
        freezer: bool = False,
        pool_pids: int | None = None,
        per_env_memory: bool | None = None,
        cpu: bool = False,
        cpu_share: bool = False,
    ) -> None:
        self.memory_limit = memory_limit
        self.pids_max = pids_max
        self.pool_pids = pool_pids
        name = f"boltzlabs-{os.getpid()}-{secrets.token_hex(4)}"
        for attempt in range(2):
            self.backend = _find_backend()
            v1 = self.backend.version == "v1"
            # cgroup v1: the pids controller (and the freezer) are hierarchies of their own.
            self.pids_home = _find_v1_home("pids") if v1 else None
            self.freezer_home = _find_v1_home("freezer") if v1 and freezer else None
            self.cpuacct_home = _find_v1_home("cpuacct") if v1 and cpu else None
            self.cpu_home = _find_v1_home("cpu") if v1 and cpu_share else None
            homes = (self.backend.home, self.pids_home, self.freezer_home, self.cpuacct_home, self.cpu_home)
            sweep_stale(list(dict.fromkeys(home for home in homes if home is not None)))
            home = self.backend.home
            assert home is not None, "a backend _find_backend found has its home (only PoolView's has none)"
            self.path = home / name
            self.pids_path = self.pids_home / name if self.pids_home is not None else None
            try:
                self.backend.prepare_pool(self.path, cpu=cpu_share)
                if self.pids_path is not None:
                    self.pids_path.mkdir()
                if pool_pids and self.limits_pids:
                    # Before any process is in it: the cap holds from the template's first fork.
                    self.backend.set_pids(self.pids_path or self.path, pool_pids)
                break
            except OSError as exc:
                for path in (self.path, self.pids_path):
                    if path is not None:
                        _rmdir(path)
                self.backend.release()
                # v2: the room this worker joined was undone meanwhile by the last
                # pool of another worker closing; once more makes a room of its own.
                if attempt == 0 and not v1:
                    continue
                raise CgroupUnavailable(f"cannot create the pool cgroup {self.path}: {exc}") from exc
        self.freezer_path = None
        self.freezes, self.freezer_note = False, ""
        if freezer and v1:
            self.freezer_path, self.freezer_note = _v1_pool_group(self.freezer_home, name, "freezer")
            self.freezes = self.freezer_path is not None
        elif freezer:
            # v2: every non-root cgroup has cgroup.freeze (kernel 5.2+).
            self.freezes = (self.path / "cgroup.freeze").exists()
            self.freezer_note = "" if self.freezes else f"no cgroup.freeze in {self.path} (kernel older than 5.2)"
        # CPU accounting (cpu=True): v1's cpuacct tree, made for this pool; v2's cpu.stat in each group.
        self.cpuacct_path: Path | None = None
        self.counts_cpu, self.cpu_note = False, ""
        if cpu and v1:
            self.cpuacct_path, self.cpu_note = _v1_pool_group(self.cpuacct_home, name, "cpuacct")
            self.counts_cpu = self.cpuacct_path is not None
        elif cpu:
            self.counts_cpu = (self.path / "cpu.stat").exists()
            self.cpu_note = "" if self.counts_cpu else f"no cpu.stat in {self.path} (kernel older than 4.15)"
        # CPU shares (cpu_share=True): each env's group of the cpu controller weighs as one.
        self.cpu_path: Path | None = None
        self.shares_cpu, self.share_note = False, ""
        if cpu_share and v1 and self.cpu_home is not None and self.cpu_home == self.cpuacct_home:
            self.cpu_path, self.share_note = self.cpuacct_path, self.cpu_note  # cpu,cpuacct: one group for both
            self.shares_cpu = self.cpu_path is not None
        elif cpu_share and v1:
            self.cpu_path, self.share_note = _v1_pool_group(self.cpu_home, name, "cpu")
            self.shares_cpu = self.cpu_path is not None
        elif cpu_share:
            self.shares_cpu = "cpu" in _words(self.path / "cgroup.subtree_control")
            self.share_note = "" if self.shares_cpu else self.backend.cpu_note(self.path)
        # Where the worker goes back to after a spawn: its own cgroup in each hierarchy.
        procs_home = self.backend.procs_home
        assert procs_home is not None, "the worker's own cgroup: its home or the leaf it made"
        self._homes = [os.path.join(procs_home, "cgroup.procs")]
        for home in (
            self.pids_home,
            self.freezer_path and self.freezer_home,
            self.cpuacct_path and self.cpuacct_home,
            self.cpu_home if self._own_cpu_group else None,
        ):
            if home is not None:
                self._homes.append(os.path.join(home, "cgroup.procs"))
        # Whether each env has a memory cgroup of its own (the module's docstring
        # says what a memory cgroup costs the kernel): always on v2 (one tree),
        # and where there is no pids hierarchy (its group is what a kill
        # empties); on v1 otherwise only for a per-env memory limit, unless
        # `per_env_memory` says otherwise.
        own_memory = bool(memory_limit) if per_env_memory is None else per_env_memory
        self.per_env_memory = own_memory or not v1 or self.pids_path is None
        # key -> [memory group, pids group (v1) if any]; the last one is the
        # key's own (the one whose tasks are its alone, which a kill empties)
        self._groups: dict[Any, Any] = {}
        self._frozen_group: dict[Any, Any] = {}  # key -> the group whose freezer holds it
        self._procs: dict[Any, list[str]] = {}  # key -> the cgroup.procs file of each group it joins
        self._cpu_files: dict[Any, str] = {}  # key -> the file that counts its CPU time (counts_cpu only)

    @property
    def version(self) -> str:
        return self.backend.version

    @property
    def paths(self) -> list[str]:
        """The pool's cgroup directories, one per hierarchy."""
        return [str(p) for p in self._pools()]

    def _pools(self) -> list[Path]:
        """The pool's own group in each hierarchy (the cpu one is the cpuacct one where co-mounted)."""
        pools = (self.path, self.pids_path, self.freezer_path, self.cpuacct_path, self.cpu_path)
        return list(dict.fromkeys(p for p in pools if p is not None))

    @property
    def _own_cpu_group(self) -> bool:
        """Whether the envs join a v1 cpu group of their own (not the cpuacct one they join anyway)."""
        return self.cpu_path is not None and self.cpu_path != self.cpuacct_path

    @property
    def _cpu_pools(self) -> list[Path]:
        """The pool's groups in the v1 cpuacct and cpu hierarchies, each env's group below each:
        cpuacct for a cpu_budget, cpu for cpu_share (unless co-mounted with cpuacct: the same)."""
        return [pool for pool in (self.cpuacct_path, self.cpu_path if self._own_cpu_group else None) if pool]

    @property
    def limits_pids(self) -> bool:
        """Whether pids limits are enforced here (a pids controller we can write)."""
        if self.pids_path is not None:
            return True
        control = self.path / "cgroup.subtree_control"  # v2: enabled for the envs by prepare_pool
        return self.version == "v2" and "pids" in _words(control)

    def group(self, key: Any) -> Path:
        """The (memory) cgroup of env `key` (an int) or of a pool part (a name),
        made on first use."""
        return self._made(key)[0]

    def remove(self, key: Any, deadline: float, reap: Any = None) -> bool:
        """Kill what is in `key`'s cgroups and remove them (a pool part that is
        done: the warm-up probe's); False if one would not go by `deadline`."""
        if key not in self._groups:
            return True
        self.backend.kill(self._groups[key][-1])
        if self.freezes:
            self.backend.thaw(self._frozen_group[key])
        ok = all([_rmdir(group, deadline, reap) for group in self._joined(key) if group.name != SHARED])
        if ok:
            del self._groups[key]
            self._frozen_group.pop(key, None)
            self._procs.pop(key, None)
            self._cpu_files.pop(key, None)
        return ok

    def _made(self, key: Any) -> list[Path]:
        groups = self._groups.get(key)
        if groups is None:
            name = _group_name(key)
            memory = self.path / (name if self.per_env_memory or not isinstance(key, int) else SHARED)
            groups = [memory] + ([self.pids_path / name] if self.pids_path is not None else [])
            for group in groups:
                _mkdir(group)
            if self.memory_limit and (isinstance(key, int) or key in LIMITED_PARTS):
                self.backend.set_limit(groups[0], self.memory_limit)
            if self.pids_max and self.limits_pids:
                self.backend.set_pids(groups[-1], self.pids_max)
            self._frozen_group[key] = groups[0]
            if self.freezer_path is not None:  # last, so groups[-1] stays the pids group for the others
                self._frozen_group[key] = self.freezer_path / name
                _mkdir(self._frozen_group[key])
            for pool in self._cpu_pools:
                _mkdir(pool / name)
            if self.cpuacct_path is not None:
                self._cpu_files[key] = str(self.cpuacct_path / name / self.backend.cpu_file)
            elif self.counts_cpu:  # v2: the env's one group
                self._cpu_files[key] = str(groups[0] / self.backend.cpu_file)
            self._groups[key] = groups
            self._procs[key] = [os.path.join(group, "cgroup.procs") for group in self._joined(key)]
        return groups

    @contextmanager
    def moving(self, pid: int, key: Any, home: Any) -> Any:
        """Run the body with process `pid` (0: this one) in `key`'s cgroup, then
        put it back in `home`'s (None: the worker's own cgroup)."""
        self._made(key)
        data = b"%d" % pid
        for procs in self._procs[key]:
            _write(procs, data)
        try:
            yield
        finally:
            if home is not None:
                self._made(home)
            for procs in self._homes if home is None else self._procs[home]:
                _write(procs, data)

    def procs_files(self, key: Any) -> list[Path]:
        """The cgroup.procs file of each of `key`'s cgroups (one per hierarchy):
        a process that writes 0 to each joins them, itself alone, where
        `moving(0, ...)` would move every thread of the caller."""
        return [group / "cgroup.procs" for group in self._joined(key)]

    def _joined(self, key: Any) -> list[Path]:
        """Every group a process of `key` is in, one per hierarchy."""
        groups = self._made(key)
        if self.freezer_path is not None:
            groups = groups + [self._frozen_group[key]]
        return groups + [pool / _group_name(key) for pool in self._cpu_pools]

    def freeze(self, index: int | str) -> None:
        """Start freezing env `index` (every task of it; or a pool part, by name); `frozen()` says when done."""
        self.backend.freeze(self._frozen_group[index])

    def thaw(self, index: int | str) -> None:
        self.backend.thaw(self._frozen_group[index])

    def frozen(self, index: int | str) -> bool:
        return self.backend.frozen(self._frozen_group[index])

    def cpu_seconds(self, key: Any) -> float:
        """CPU seconds every task of `key`'s cgroup (and below) has used (counts_cpu only), user and
        system, since the cgroup was made: OSError or ValueError if it cannot be read."""
        fd = os.open(self._cpu_files[key], os.O_RDONLY | os.O_CLOEXEC)
        try:
            data = os.read(fd, 4096)
        finally:
            os.close(fd)
        return self.backend.cpu_seconds(data)

    def usage(self, key: Any) -> int:
        """The working set of `key`'s memory cgroup (with shared env memory,
        every env's together for an env index)."""
        return self.backend.usage(self.group(key))

    def env_usages(self, alive: list[bool]) -> list[int]:
        """Each env's memory charge, env i's when alive[i] is true, else 0:
        its own cgroup's working set, or with shared env memory the envs'
        cgroup's split evenly over the live envs."""
        if self.per_env_memory:
            return [self.usage(i) if up else 0 for i, up in enumerate(alive)]
        live = sum(map(bool, alive))
        share = self.backend.usage(self.path / SHARED) // live if live and (self.path / SHARED).exists() else 0
        return [share if up else 0 for up in alive]

    @property
    def memory_source(self) -> str:
        """Where env_usages() comes from, in words."""
        where = (
            "each env's own cgroup"
            if self.per_env_memory
            else "the envs' one memory cgroup, split evenly over the live envs (an env has its own "
            "memory cgroup only with a per-env memory limit)"
        )
        return f"cgroup {self.version} working set (usage - inactive file), kernel memory included, of {where}"

    def total(self) -> int:
        """Every env and pool part (the template's shared pages are the pool's)."""
        return sum(self.usage(key) for key in self._groups)

    def events(self, index: int | str) -> tuple[int, int]:
        """(OOM kills, forks refused by pids.max) so far in env `index`'s cgroup (or a pool part's, by name)."""
        groups = self._made(index)
        counts = []
        for read, group in ((self.backend.oom_kills, groups[0]), (self.backend.pids_refused, groups[-1])):
            try:
                # The envs' shared memory cgroup has no limit, and its OOM count
                # (a host-wide OOM's kills) is no one env's: a lane killed so says SIGKILL.
                counts.append(read(group) if group.name != SHARED else 0)
            except OSError:
                counts.append(0)
        return counts[0], counts[1]

    def pool_full(self, slack: int = 8) -> bool:
        """Whether the pool's tasks are within `slack` of its cap (pool_pids):
        a refused fork was then the pool's cap, not (only) the env's."""
        if not self.pool_pids or not self.limits_pids:
            return False
        try:
            return self.backend.pids_current(self.pids_path or self.path) + slack >= self.pool_pids
        except OSError:
            return False

    def tasks(self, index: int) -> int:
        """Tasks still charged to env `index`: pids.current where there is a pids
        controller (a zombie counts until it is reaped), else cgroup.procs."""
        groups = self._made(index)
        try:
            if self.limits_pids:
                return self.backend.pids_current(groups[-1])
            return len(_procs(groups[0]))
        except OSError:
            return 0

    def procs(self, index: int) -> list[int]:
        """The processes in env `index`'s own cgroup (the one a kill empties), by host pid."""
        groups = self._groups.get(index)
        return _procs(groups[-1]) if groups else []

    def kill(self, index: int | str) -> None:
        """SIGKILL everything in env `index`'s cgroup (or a pool part's, by name) now (one round, no wait)."""
        if index in self._groups:
            self.backend.kill(self._groups[index][-1])
            if self.freezes:
                self.thaw(index)  # a frozen task dies only once thawed

    def release(self) -> bool:
        """Undo what was done to make room for the pool (cgroup v2's leaf), where
        no other pool needs it; the worker's guardian calls it too."""
        return self.backend.release()

    def close(self, deadline: float, reap: Any = None) -> bool:
        """Kill what is left, remove every cgroup made; False if one would not go.
        `reap()`, if given, reaps the caller's exited children between tries."""
        for key, groups in self._groups.items():
            self.backend.kill(groups[-1])
            if self.freezes:
                self.thaw(key)
        # Each env's groups, the envs' shared memory cgroup once, then the pool's own; a pool
        # gives up only once none went for CLOSE_STALL seconds (10,000 sandboxes take far
        # longer than 5 s to die).
        made = [group for key in self._groups for group in self._joined(key)]
        made += self._pools()
        ok = _rmdir_all(list(dict.fromkeys(made)), deadline, reap, CLOSE_STALL)
        self._groups.clear()
        self.release()  # False only when another pool still uses the room: not a failure of ours
        return ok


class PoolView:
    """A pool's cgroups as the kernel shows them, found from their paths alone
    (`RLPool._cgroup`, the READY info's "cgroup" list) and read through the
    same backends the worker uses: tests and diagnostics never name a file of
    one cgroup version. `key` is an env index or a pool part's name."""

    def __init__(self, paths: Any) -> None:
        self.paths = [Path(p) for p in paths]
        # "memory" / "pids" / "freezer" / "cpuacct" -> the pool in that hierarchy (v2: the one pool)
        self.by_controller: dict[str, Path] = {}
        v2 = False
        mounts = sorted(_mounts(), key=lambda m: len(m[0]), reverse=True)
        for path in self.paths:
            point, fstype, options = next(m for m in mounts if str(path).startswith(m[0].rstrip("/") + "/"))
            if fstype == "cgroup2":
                v2 = True
                for name in CONTROLLERS:
                    self.by_controller.setdefault(name, path)
            else:
                for name in CONTROLLERS:
                    if name in options:
                        self.by_controller[name] = path
        self.backend = _V2(None, make_room=False) if v2 else _V1(None)
        self.version = self.backend.version

    def group(self, key: Any, controller: str = "memory") -> Path:
        """Env `key`'s cgroup in the hierarchy of `controller` (for the memory
        controller, the envs' shared one where env `key` has none of its own)."""
        pool = self.by_controller[controller]
        own = pool / _group_name(key)
        if isinstance(key, int) and not own.exists() and (pool / SHARED).is_dir():
            return pool / SHARED
        return own

    def shares_memory(self) -> bool:
        """Whether the pool's envs share one memory cgroup (no per-env memory limit, v1)."""
        return (self.by_controller["memory"] / SHARED).is_dir()

    def pool(self, controller: str = "pids") -> Path:
        return self.by_controller[controller]

    def procs(self, key: Any) -> set[int]:
        """The processes of env (or part) `key` alone: its pids group's, which is its own in both cases."""
        return set(self.backend.procs(self.group(key, "pids" if "pids" in self.by_controller else "memory")))

    def memory_limit(self, key: Any) -> int | None:
        return self.backend.memory_limit(self.group(key))

    def swap_limit(self, key: Any) -> int | None:
        return self.backend.swap_limit(self.group(key))

    def swap_used(self, key: Any) -> int:
        return self.backend.swap_used(self.group(key))

    def oom_kills(self, key: Any) -> int:
        return self.backend.oom_kills(self.group(key))

    def pids_limit(self, key: Any = None) -> int | None:
        """Env `key`'s pids limit; None for the pool's own (limits.pool_pids)."""
        return self.backend.pids_limit(self.pool() if key is None else self.group(key, "pids"))

    def pids_current(self, key: Any = None) -> int:
        return self.backend.pids_current(self.pool() if key is None else self.group(key, "pids"))

    def pids_refused(self, key: Any) -> int:
        return self.backend.pids_refused(self.group(key, "pids"))

    def frozen(self, key: Any) -> bool:
        return self.backend.frozen(self.group(key, "freezer"))

    def cpu_seconds(self, key: Any) -> float:
        """CPU seconds env `key`'s cgroup has counted (a pool with a cpu_budget)."""
        return self.backend.cpu_seconds(read_file(str(self.group(key, "cpuacct") / self.backend.cpu_file)))

    def cgroup_of(self, pid: int, controller: str = "memory") -> Path | None:
        """The cgroup process `pid` is in, in the hierarchy of `controller`, as
        a path comparable with group()."""
        own = _own_cgroups(pid)
        pool = self.by_controller[controller]
        path = own.get("" if self.version == "v2" else controller)
        if path is None:
            return None
        for point, fstype, options in _mounts():
            if (
                fstype == ("cgroup2" if self.version == "v2" else "cgroup")
                and str(pool).startswith(point + "/")
                and (self.version == "v2" or controller in options)
            ):
                return Path(point) / path.lstrip("/")
        return None
