"""Memory accounting and limits: one cgroup per env below one pool cgroup.

    <the worker's own memory cgroup>/
        boltzlabs-<worker pid>-<tag>/      the pool (removed at close)
            env-0/  env-1/  ...            one per env, a sandbox's whole tree

`CgroupPool` is the one interface; `_V1` and `_V2` are its two backends.
We only ever create cgroups below the cgroup the worker itself runs in, and
remove what we created.

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


def sweep_stale(backend: _Backend) -> None:
    """Remove pool cgroups left by workers that were killed before cleaning up."""
    for pool in backend.home.glob("boltzlabs-*"):
        try:
            os.kill(int(pool.name.split("-")[1]), 0)
            continue  # its worker is alive
        except (ValueError, IndexError, PermissionError):
            continue
        except ProcessLookupError:
            remove_pool_dir(pool, timeout=1.0)


def remove_pool_dir(path, timeout: float = 5.0) -> bool:
    """Kill whatever is left in a pool cgroup and remove it with its children."""
    pool = Path(path)
    deadline = time.monotonic() + timeout
    groups = [g for g in pool.iterdir() if g.is_dir()] if pool.is_dir() else []
    for group in groups:
        _Backend.kill(None, group)
    ok = all([_rmdir(group, deadline) for group in groups])
    return _rmdir(pool, deadline) and ok


def _rmdir(path: Path, deadline: float = 0.0) -> bool:
    while True:
        try:
            path.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() >= deadline:
                return False
            time.sleep(0.005)


class CgroupPool:
    """A pool cgroup with one child cgroup per env.

    `moving(0, i, None)` is the context in which env i's sandbox must be started.
    Everything is removed by `close()`.
    """

    def __init__(self, memory_limit: int | None = None):
        self.backend = _find_backend()
        sweep_stale(self.backend)
        self.memory_limit = memory_limit
        self.path = self.backend.home / f"boltzlabs-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            self.backend.prepare_pool(self.path)
        except OSError as exc:
            _rmdir(self.path)
            raise CgroupUnavailable(f"cannot create the pool cgroup {self.path}: {exc}") from None
        self._home_procs = self.backend.home / "cgroup.procs"
        self._groups: dict[int, Path] = {}

    @property
    def version(self) -> str:
        return self.backend.version

    def group(self, key) -> Path:
        """The cgroup of env `key` (an int) or of a pool part (a name), made on first use.

        Only envs get `memory_limit`.
        """
        group = self._groups.get(key)
        if group is None:
            group = self.path / (f"env-{key}" if isinstance(key, int) else key)
            group.mkdir(exist_ok=True)
            if self.memory_limit and isinstance(key, int):
                self.backend.set_limit(group, self.memory_limit)
            self._groups[key] = group
        return group

    @contextmanager
    def moving(self, pid: int, key, home):
        """Run the body with process `pid` (0: this one) in `key`'s cgroup, then
        put it back in `home`'s (None: the worker's own cgroup)."""
        (self.group(key) / "cgroup.procs").write_text(str(pid))
        try:
            yield
        finally:
            procs = self._home_procs if home is None else self.group(home) / "cgroup.procs"
            procs.write_text(str(pid))

    def usage(self, key) -> int:
        return self.backend.usage(self.group(key))

    def total(self) -> int:
        """Every env and pool part (the template's shared pages are the pool's)."""
        return sum(self.usage(key) for key in self._groups)

    def oom_kills(self, index: int) -> int:
        try:
            return self.backend.oom_kills(self.group(index))
        except OSError:
            return 0

    def kill(self, index: int) -> None:
        if index in self._groups:
            self.backend.kill(self._groups[index])

    def reset(self, index: int, deadline: float) -> None:
        """Empty env `index`'s cgroup and make it new (fresh counters) for a respawn."""
        group = self._groups.pop(index, None)
        if group is not None:
            self.backend.kill(group)
            _rmdir(group, deadline)

    def close(self, deadline: float) -> bool:
        """Kill what is left, remove every cgroup made; False if one would not go."""
        ok = True
        for group in self._groups.values():
            self.backend.kill(group)
        for group in self._groups.values():
            ok &= _rmdir(group, deadline)
        self._groups.clear()
        return _rmdir(self.path, deadline) and ok
