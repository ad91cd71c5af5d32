"""Memory accounting and limits: one cgroup per env below one pool cgroup.

    <the worker's own memory cgroup>/
        boltzlabs-<worker pid>-<tag>/      the pool (removed at close)
            env-0/  env-1/  ...            one per env, a sandbox's whole tree

`CgroupPool` is the one interface; `_V1` and `_V2` are its two backends.
We only ever create cgroups below the cgroup the worker itself runs in, and
remove what we created. Under cgroup v1 the pids controller is a hierarchy
of its own: the same tree is made there too (below the worker's own pids
cgroup), and a process is moved into both.

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
"""

from __future__ import annotations

import errno
import os
import secrets
import signal
import time
from contextlib import contextmanager
from pathlib import Path


class CgroupUnavailable(Exception):
    """No writable memory cgroup here; the message says why."""


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


def _find_pids_home() -> Path | None:
    """The worker's own cgroup in a cgroup v1 pids hierarchy, if writable."""
    own = _own_cgroups()
    if "pids" not in own:
        return None
    for point, fstype, options in _mounts():
        if fstype == "cgroup" and "pids" in options:
            home = Path(point) / own["pids"].lstrip("/")
            if os.access(home, os.W_OK):
                return home
    return None


def sweep_stale(home: Path) -> None:
    """Remove pool cgroups left by workers that were killed before cleaning up."""
    for pool in home.glob("boltzlabs-*"):
        try:
            os.kill(int(pool.name.split("-")[1]), 0)
            continue  # its worker is alive
        except (ValueError, IndexError, PermissionError):
            continue
        except ProcessLookupError:
            remove_pool_dir(pool, timeout=1.0)


def remove_pool_dir(path, timeout: float = 5.0) -> bool:
    """Kill whatever is left in a pool cgroup and remove it with its children.
    `path` may be a list of them (one per hierarchy)."""
    if isinstance(path, list):
        return all([remove_pool_dir(p, timeout) for p in path])
    pool = Path(path)
    deadline = time.monotonic() + timeout
    groups = [g for g in pool.iterdir() if g.is_dir()] if pool.is_dir() else []
    for group in groups:
        _Backend.kill(None, group)
    ok = all([_rmdir(group, deadline) for group in groups])
    return _rmdir(pool, deadline) and ok


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
            if reap is not None:
                reap()
            time.sleep(0.005)


class CgroupPool:
    """A pool cgroup with one child cgroup per env (and per pool part).

    `moving(0, i, None)` is the context in which env i's sandbox must be started.
    `memory_limit` applies to envs, `pids_max` to envs and pool parts (the
    template runs env.py's import code). Everything is removed by `close()`.
    """

    def __init__(self, memory_limit: int | None = None, pids_max: int | None = None):
        self.backend = _find_backend()
        # cgroup v1: the pids controller is a hierarchy of its own.
        self.pids_home = _find_pids_home() if self.backend.version == "v1" else None
        for home in (self.backend.home, self.pids_home):
            if home is not None:
                sweep_stale(home)
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
        self._homes = [self.backend.home / "cgroup.procs"]
        if self.pids_home is not None:
            self._homes.append(self.pids_home / "cgroup.procs")
        self._groups: dict = {}  # key -> [memory group, pids group (v1) if any]

    @property
    def version(self) -> str:
        return self.backend.version

    @property
    def paths(self) -> list[str]:
        """The pool's cgroup directories, one per hierarchy."""
        return [str(p) for p in (self.path, self.pids_path) if p is not None]

    @property
    def limits_pids(self) -> bool:
        """Whether pids_max is enforced here (a pids controller we can write)."""
        if self.pids_path is not None:
            return True
        control = self.path / "cgroup.subtree_control"  # v2: enabled for the envs by prepare_pool
        return self.version == "v2" and "pids" in control.read_text().split()

    def group(self, key) -> Path:
        """The (memory) cgroup of env `key` (an int) or of a pool part (a name),
        made on first use. Only envs get `memory_limit`."""
        return self._made(key)[0]

    def _made(self, key) -> list[Path]:
        groups = self._groups.get(key)
        if groups is None:
            name = f"env-{key}" if isinstance(key, int) else key
            groups = [self.path / name] + ([self.pids_path / name] if self.pids_path is not None else [])
            for group in groups:
                group.mkdir(exist_ok=True)
            if self.memory_limit and isinstance(key, int):
                self.backend.set_limit(groups[0], self.memory_limit)
            if self.pids_max and self.limits_pids:
                self.backend.set_pids(groups[-1], self.pids_max)
            self._groups[key] = groups
        return groups

    @contextmanager
    def moving(self, pid: int, key, home):
        """Run the body with process `pid` (0: this one) in `key`'s cgroup, then
        put it back in `home`'s (None: the worker's own cgroup)."""
        for group in self._made(key):
            (group / "cgroup.procs").write_text(str(pid))
        try:
            yield
        finally:
            homes = self._homes if home is None else [g / "cgroup.procs" for g in self._made(home)]
            for procs in homes:
                procs.write_text(str(pid))

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

    def close(self, deadline: float, reap=None) -> bool:
        """Kill what is left, remove every cgroup made; False if one would not go.
        `reap()`, if given, reaps the caller's exited children between tries."""
        ok = True
        for groups in self._groups.values():
            self.backend.kill(groups[0])
        for groups in self._groups.values():
            for group in groups:
                ok &= _rmdir(group, deadline, reap)
        self._groups.clear()
        for path in (self.path, self.pids_path):
            if path is not None:
                ok &= _rmdir(path, deadline, reap)
        return ok
