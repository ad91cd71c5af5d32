"""Memory accounting and limits: one cgroup per env below one pool cgroup.

    <the worker's own memory cgroup>/
        boltzlabs-<worker pid>-<tag>/      the pool (removed at close)
            env-0/  env-1/  ...            one per env, a sandbox's whole tree

`CgroupPool` is the one interface; `_V1` and `_V2` are its two backends.
We only ever create cgroups below the cgroup the worker itself runs in, and
remove what we created. Under cgroup v1 the pids controller is a hierarchy
of its own: the same tree is made there too (below the worker's own pids
cgroup), and a process is moved into both. The freezer (serialize_measurement
only: `CgroupPool(freezer=True)`) is a third v1 hierarchy made the same way;
under v2 it is `cgroup.freeze` in the env's own cgroup.

Kernel facts this depends on:
- A process is charged for the pages it touches first, and a forked child
  starts in its parent's cgroup. So the worker moves itself into an env's
  cgroup just around the spawn (`moving()`), and the whole sandbox tree is
  born there. Pages shared with the host (the interpreter's files in page
  cache) stay charged to whoever read them first.
- cgroup v1 (this project's CI machine): the memory controller is its own
  hierarchy; `memory.usage_in_bytes` includes kernel memory (namespaces, page
  tables) and page cache. We report the working set, usage minus inactive
  file pages, as `docker stats` does.
- Killing for sure: SIGKILL to every pid in cgroup.procs, again and again
  until the group is empty (rmdir fails with EBUSY while a task is left), so
  a process forked between a read of cgroup.procs and the kills is caught
  by the next round; the pids limit bounds how many there can be. cgroup
  v2 has cgroup.kill, which the kernel applies to forks in progress too.
- pids.max counts tasks (threads too) and makes fork/clone fail with
  EAGAIN; moving a process in is never refused. The "max" line of
  pids.events counts those refusals, which is how a lane learns that its
  env hit the limit.
- cgroup v2: the "no internal processes" rule forbids enabling the memory
  controller for children of a cgroup that holds processes, so v2 works only
  where the worker's cgroup is delegated with +memory in subtree_control (as
  systemd's Delegate=yes gives). That path is deliberately thin and could not
  run on the machine this was built on (v2 there has no memory controller).
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

from boltzlabs.errors import CgroupUnavailable  # noqa: F401 - cgroups.CgroupUnavailable, its old home




def _own_cgroups():
    """{controller or '' (v2): path} for this process, from /proc/self/cgroup."""
    out = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            out[name] = path
    return out


def _mounts():
    """[(mount point, fstype, super options)] from /proc/self/mountinfo."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, right = line.split(" - ", 1)
        fstype, _source, options = right.split(" ", 2)
        out.append((left.split(" ")[4], fstype, options.split(",")))
    return out


def _write(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _read_int(path: Path) -> int:
    return int(path.read_text().split()[0])


def _read_stat(path: Path) -> dict:
    stats = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            stats[key] = int(value)
    return stats


class _Backend:
    version = ""

    def __init__(self, home: Path):
        self.home = home  # the worker's own cgroup

    def prepare_pool(self, pool: Path) -> None:
        pool.mkdir()

    def usage(self, group: Path) -> int:
        raise NotImplementedError

    def set_limit(self, group: Path, limit: int) -> None:
        raise NotImplementedError

    def oom_kills(self, group: Path) -> int:
        raise NotImplementedError

    def set_pids(self, group: Path, limit: int) -> None:
        (group / "pids.max").write_text(str(limit))

    def pids_refused(self, group: Path) -> int:
        """How many forks pids.max has refused in `group` (pids.events "max")."""
        return _read_stat(group / "pids.events").get("max", 0)

    def kill(self, group: Path) -> None:
        try:
            pids = (group / "cgroup.procs").read_text().split()
        except FileNotFoundError:
            return
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


class _V1(_Backend):
    version = "v1"

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
        (group / "memory.limit_in_bytes").write_text(str(limit))
        memsw = group / "memory.memsw.limit_in_bytes"
        if memsw.exists():  # swap off: memory+swap capped at the same figure
            memsw.write_text(str(limit))
        try:
            (group / "memory.swappiness").write_text("0")
        except OSError:
            pass

    def oom_kills(self, group: Path) -> int:
        stat = _read_stat(group / "memory.oom_control")
        return stat.get("oom_kill", 0)


class _V2(_Backend):
    version = "v2"

    def prepare_pool(self, pool: Path) -> None:
        pool.mkdir()
        (pool / "cgroup.subtree_control").write_text("+memory")
        try:  # the pids files then sit beside the memory ones
            (pool / "cgroup.subtree_control").write_text("+pids")
        except OSError:
            pass

    def usage(self, group: Path) -> int:
        stat = _read_stat(group / "memory.stat")
        return max(0, _read_int(group / "memory.current") - stat.get("inactive_file", 0))

    def set_limit(self, group: Path, limit: int) -> None:
        (group / "memory.max").write_text(str(limit))
        (group / "memory.swap.max").write_text("0")

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


def _find_backend() -> _Backend:
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
    if "" in own:
        for point, fstype, _ in mounts:
            if fstype == "cgroup2":
                home = Path(point) / own[""].lstrip("/")
                controllers = (home / "cgroup.controllers").read_text().split() if home.exists() else []
                subtree = (home / "cgroup.subtree_control").read_text().split() if home.exists() else []
                if "memory" not in controllers:
                    reasons.append(f"cgroup v2 at {home} has no memory controller")
                elif "memory" not in subtree:
                    reasons.append(f"cgroup v2 at {home} does not delegate memory (+memory not in cgroup.subtree_control)")
                elif not os.access(home, os.W_OK):
                    reasons.append(f"cgroup v2 cgroup {home} is not writable")
                else:
                    return _V2(home)
    raise CgroupUnavailable("; ".join(reasons) or "no cgroup filesystem is mounted")


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
                continue
            except ProcessLookupError:
                stale.setdefault(pool.name, []).append(pool)
    for pools in stale.values():
        remove_pool_dir(pools, timeout=1.0)


def remove_pool_dir(path, timeout: float = 5.0) -> bool:
    """Kill whatever is left in a pool cgroup and remove it with its children.
    `path` may be a list of them (one per hierarchy): every hierarchy's tasks
    are killed and thawed before any directory is waited for, since a frozen
    task dies only once its freezer group is thawed."""
    pools = [Path(p) for p in (path if isinstance(path, list) else [path])]
    deadline = time.monotonic() + timeout
    groups = [g for pool in pools if pool.is_dir() for g in pool.iterdir() if g.is_dir()]
    for group in groups:
        _Backend.kill(None, group)
    for group in groups:
        _thaw_v1(group)
    ok = all([_rmdir(group, deadline) for group in groups])
    return all([_rmdir(pool, deadline) for pool in pools]) and ok


def _rmdir(path: Path, deadline: float = 0.0, reap=None) -> bool:
    """Remove a cgroup, killing what is in it until it is empty (or deadline).
    `reap()` reaps the caller's exited children: a zombie keeps a cgroup busy."""
    while True:
        try:
            path.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() >= deadline:
                return False
            _Backend.kill(None, path)  # forked since the last round: kill again
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


class CgroupPool:
    """A pool cgroup with one child cgroup per env (and per pool part).

    `moving(0, i, None)` is the context in which env i's sandbox must be started.
    `memory_limit` applies to envs and to the pool parts that hold what an
    env would (LIMITED_PARTS: the template's imports are one env's, and its
    warm-up probe runs an env's code), `pids_max` to envs and every pool part. `freezer=True` makes envs freezable
    (`freeze`, `thaw`, `frozen`) if the host allows it; `freezes` says
    whether it does, `freezer_note` why not. Everything is removed by `close()`.
    """

    def __init__(self, memory_limit: int | None = None, pids_max: int | None = None, freezer: bool = False):
        self.backend = _find_backend()
        v1 = self.backend.version == "v1"
        # cgroup v1: the pids controller (and the freezer) are hierarchies of their own.
        self.pids_home = _find_v1_home("pids") if v1 else None
        self.freezer_home = _find_v1_home("freezer") if v1 and freezer else None
        sweep_stale([home for home in (self.backend.home, self.pids_home, self.freezer_home) if home is not None])
        self.memory_limit = memory_limit
        self.pids_max = pids_max
        name = f"boltzlabs-{os.getpid()}-{secrets.token_hex(4)}"
        self.path = self.backend.home / name
        self.pids_path = self.pids_home / name if self.pids_home is not None else None
        try:
            self.backend.prepare_pool(self.path)
            if self.pids_path is not None:
                self.pids_path.mkdir()
        except OSError as exc:
            _rmdir(self.path)
            raise CgroupUnavailable(f"cannot create the pool cgroup {self.path}: {exc}") from None
        self.freezer_path = None
        self.freezes, self.freezer_note = False, ""
        if freezer and v1:
            self.freezer_note = "no writable cgroup v1 freezer hierarchy holds this process"
            if self.freezer_home is not None:
                try:
                    (self.freezer_home / name).mkdir()
                    self.freezer_path = self.freezer_home / name
                    self.freezes = True
                except OSError as exc:
                    self.freezer_note = f"cannot create the pool's freezer cgroup {self.freezer_home / name}: {exc}"
        elif freezer:
            # v2: every non-root cgroup has cgroup.freeze (kernel 5.2+).
            self.freezes = (self.path / "cgroup.freeze").exists()
            self.freezer_note = "" if self.freezes else f"no cgroup.freeze in {self.path} (kernel older than 5.2)"
        self._homes = [self.backend.home / "cgroup.procs"]
        for home in (self.pids_home, self.freezer_path and self.freezer_home):
            if home is not None:
                self._homes.append(home / "cgroup.procs")
        # key -> [memory group, pids group (v1) if any, freezer group (v1) if any]
        self._groups: dict = {}
        self._frozen_group: dict = {}  # key -> the group whose freezer holds it

    @property
    def version(self) -> str:
        return self.backend.version

    @property
    def paths(self) -> list[str]:
        """The pool's cgroup directories, one per hierarchy."""
        return [str(p) for p in (self.path, self.pids_path, self.freezer_path) if p is not None]

    @property
    def limits_pids(self) -> bool:
        """Whether pids_max is enforced here (a pids controller we can write)."""
        if self.pids_path is not None:
            return True
        control = self.path / "cgroup.subtree_control"  # v2: enabled for the envs by prepare_pool
        return self.version == "v2" and "pids" in control.read_text().split()

    def group(self, key) -> Path:
        """The (memory) cgroup of env `key` (an int) or of a pool part (a name),
        made on first use."""
        return self._made(key)[0]

    def remove(self, key, deadline: float, reap=None) -> bool:
        """Kill what is in `key`'s cgroups and remove them (a pool part that is
        done: the warm-up probe's); False if one would not go by `deadline`."""
        if key not in self._groups:
            return True
        self.backend.kill(self._groups[key][0])
        if self.freezes:
            self.backend.thaw(self._frozen_group[key])
        ok = all([_rmdir(group, deadline, reap) for group in self._joined(key)])
        if ok:
            del self._groups[key]
            self._frozen_group.pop(key, None)
        return ok

    def _made(self, key) -> list[Path]:
        groups = self._groups.get(key)
        if groups is None:
            name = f"env-{key}" if isinstance(key, int) else key
            groups = [self.path / name] + ([self.pids_path / name] if self.pids_path is not None else [])
            for group in groups:
                group.mkdir(exist_ok=True)
            if self.memory_limit and (isinstance(key, int) or key in LIMITED_PARTS):
                self.backend.set_limit(groups[0], self.memory_limit)
            if self.pids_max and self.limits_pids:
                self.backend.set_pids(groups[-1], self.pids_max)
            self._frozen_group[key] = groups[0]
            if self.freezer_path is not None:  # last, so groups[-1] stays the pids group for the others
                self._frozen_group[key] = self.freezer_path / name
                self._frozen_group[key].mkdir(exist_ok=True)
            self._groups[key] = groups
        return groups

    @contextmanager
    def moving(self, pid: int, key, home):
        """Run the body with process `pid` (0: this one) in `key`'s cgroup, then
        put it back in `home`'s (None: the worker's own cgroup)."""
        for group in self._joined(key):
            (group / "cgroup.procs").write_text(str(pid))
        try:
            yield
        finally:
            homes = self._homes if home is None else [g / "cgroup.procs" for g in self._joined(home)]
            for procs in homes:
                procs.write_text(str(pid))

    def _joined(self, key) -> list[Path]:
        """Every group a process of `key` is in, one per hierarchy."""
        groups = self._made(key)
        if self.freezer_path is not None:
            return groups + [self._frozen_group[key]]
        return groups

    def freeze(self, index: int) -> None:
        """Start freezing env `index` (every task of it); `frozen()` says when done."""
        self.backend.freeze(self._frozen_group[index])

    def thaw(self, index: int) -> None:
        self.backend.thaw(self._frozen_group[index])

    def frozen(self, index: int) -> bool:
        return self.backend.frozen(self._frozen_group[index])

    def usage(self, key) -> int:
        return self.backend.usage(self.group(key))

    def total(self) -> int:
        """Every env and pool part (the template's shared pages are the pool's)."""
        return sum(self.usage(key) for key in self._groups)

    def events(self, index: int) -> tuple[int, int]:
        """(OOM kills, forks refused by pids.max) so far in env `index`'s cgroup."""
        groups = self._made(index)
        counts = []
        for read, group in ((self.backend.oom_kills, groups[0]), (self.backend.pids_refused, groups[-1])):
            try:
                counts.append(read(group))
            except OSError:
                counts.append(0)
        return counts[0], counts[1]

    def tasks(self, index: int) -> int:
        """Tasks still charged to env `index`: pids.current where there is a pids
        controller (a zombie counts until it is reaped), else cgroup.procs."""
        groups = self._made(index)
        try:
            if self.limits_pids:
                return _read_int(groups[-1] / "pids.current")
            return len((groups[0] / "cgroup.procs").read_text().split())
        except OSError:
            return 0

    def kill(self, index: int) -> None:
        """SIGKILL everything in env `index`'s cgroup now (one round, no wait)."""
        if index in self._groups:
            self.backend.kill(self._groups[index][0])
            if self.freezes:
                self.thaw(index)  # a frozen task dies only once thawed

    def close(self, deadline: float, reap=None) -> bool:
        """Kill what is left, remove every cgroup made; False if one would not go.
        `reap()`, if given, reaps the caller's exited children between tries."""
        ok = True
        for key, groups in self._groups.items():
            self.backend.kill(groups[0])
            if self.freezes:
                self.thaw(key)
        for key, groups in self._groups.items():
            for group in self._joined(key):
                ok &= _rmdir(group, deadline, reap)
        self._groups.clear()
        for path in (self.path, self.pids_path, self.freezer_path):
            if path is not None:
                ok &= _rmdir(path, deadline, reap)
        return ok
