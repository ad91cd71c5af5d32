"""cgroup v2: the worker makes its own room in the cgroup it starts in (boltzlabs/host/cgroups.py).

Each test makes a cgroup S of its own below the cgroup2 root, as systemd makes a
service's, puts a shell there that stays (a service's main process) with a child
of its own, and starts a pool from a Python process below that shell. They run
where cgroup v2 is the pools' backend and this process is root (CI's v2 guest,
ci/v2guest.sh); on a cgroup v1 host they skip, and the rest of the suite covers v1.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from boltzlabs.host import cgroups
from conftest import TESTS, scaled

HOSTILE = TESTS / "envs" / "hostile"
MiB = 1 << 20

pytestmark = pytest.mark.skipif(
    cgroups.version() != "v2" or os.geteuid() != 0,
    reason="needs cgroup v2 pools and root (CI's v2 guest: ci/v2guest.sh)",
)

POOL = """
import json, os, sys, warnings
sys.path.insert(0, {root!r})
from pathlib import Path
from boltzlabs import RLPool
from boltzlabs.host.cgroups import PoolView
S = Path({cgroup!r})
out = {{"cgroup_before": open("/proc/self/cgroup").read().strip()}}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        # No warm-up probe: what it imports is not these tests' business, and in an
        # emulated guest it can overrun its 5 s ([template] warmup_timeout) and warn.
        pool = RLPool({hostile!r}, 2, spawn={spawn!r}, limits={{"pids": 32}}, memory_limit="64M", warmup=False)
        out["memory_limit"] = "ok"
    except ValueError as exc:
        out["memory_limit"] = str(exc)
        pool = RLPool({hostile!r}, 2, spawn={spawn!r}, limits={{"pids": 32}}, warmup=False)
out["warnings"] = [str(w.message) for w in caught]
out["source"] = pool.memory().source
out["paths"] = pool._cgroup
out["cgroup_during"] = open("/proc/self/cgroup").read().strip()
out["leaf"] = sorted(int(p) for p in (S / "boltzlabs-procs" / "cgroup.procs").read_text().split()) \
    if (S / "boltzlabs-procs").exists() else None
out["subtree_during"] = (S / "cgroup.subtree_control").read_text().split()
pool.reset(seed=0)
if pool._cgroup:  # a memory hog and a fork bomb, where the kernel bounds them
    obs, _, _, infos = pool.step([{{"op": "alloc", "mb": 256}}, {{"op": "fork_until_refused"}}])
    view = PoolView(pool._cgroup)
    out.update(oom=infos[0].get("error"), forked=obs[1]["out"], per_env=pool.memory().per_env,
               pids_limit=view.pids_limit(1), memory_max=view.memory_limit(1))
else:
    pool.step([1, 2])
pool.close()
out["subtree_after"] = (S / "cgroup.subtree_control").read_text().split()
out["leaf_after"] = (S / "boltzlabs-procs").exists()
out["cgroup_after"] = open("/proc/self/cgroup").read().strip()
print(json.dumps(out), flush=True)
"""


@pytest.fixture
def service():
    """A cgroup S below the cgroup2 root with memory and pids passed down to it,
    as systemd's Delegate=yes gives a unit; removed (with what is left in it) after."""
    root = cgroups.hierarchy("memory")
    group = root / f"boltzlabs-test-{os.getpid()}-{time.monotonic_ns()}"
    group.mkdir()
    yield group
    for child in sorted(group.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if child.is_dir():
            cgroups._rmdir(child, time.monotonic() + 5)
    cgroups._rmdir(group, time.monotonic() + 5)


def run_in(group: Path, code: str, *, wrap: str = "", extra: str = "") -> dict:
    """Run `code` with Python from a shell that moves itself into `group` and
    stays there with a `sleep` child (a service's main process and a helper),
    optionally inside `wrap` (e.g. unshare). Returns what the code printed (JSON)."""
    inner = f'sleep 600 & {extra} {sys.executable} -c "$0"; rc=$?; kill $! 2>/dev/null; exit $rc'
    script = f"echo $$ > {group}/cgroup.procs || exit 1; " + (f"{wrap} sh -c '{inner}' \"$0\"" if wrap else inner)
    out = subprocess.run(["sh", "-c", script, code], capture_output=True, text=True, timeout=scaled(120))
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def pool_code(group: Path, spawn: str) -> str:
    return POOL.format(root=str(TESTS.parent), cgroup=str(group), hostile=str(HOSTILE), spawn=spawn)


def test_a_worker_in_a_cgroup_that_holds_processes_makes_room_and_undoes_it(service, spawn):
    """The shell and its sleep stay in S with the trainer: the worker moves all
    of them (its own process tree) into a leaf, enables memory and pids in S
    and makes the pool beside the leaf; at close everything goes back."""
    seen = run_in(service, pool_code(service, spawn))
    assert seen["cgroup_before"].endswith(service.name)
    assert seen["source"].startswith("cgroup v2"), seen  # the kernel's accounting, not PSS
    assert not seen["warnings"], seen["warnings"]
    assert [Path(p).parent for p in seen["paths"]] == [service]  # beside the leaf, inside S
    assert seen["cgroup_during"].endswith(f"{service.name}/boltzlabs-procs")
    assert len(seen["leaf"]) >= 3, seen  # the shell, its sleep, the trainer (and the worker's guardian)
    assert {"memory", "pids"} <= set(seen["subtree_during"])
    assert seen["memory_limit"] == "ok" and seen["memory_max"] == 64 * MiB
    assert "OOM" in seen["oom"] and "memory_limit" in seen["oom"], seen["oom"]  # named on its lane
    assert seen["pids_limit"] == 32 and 0 < seen["forked"]["forked"] < 32, seen["forked"]
    assert "Resource temporarily unavailable" in seen["forked"]["refused"]
    # Per env, by the kernel: env 1's 20-odd sleeping children are charged to env 1.
    assert seen["per_env"][1] > seen["per_env"][0] + 8 * MiB, seen["per_env"]
    # Undone: the controllers off, the leaf gone, every process back in S.
    assert seen["subtree_after"] == [] and seen["leaf_after"] is False
    assert seen["cgroup_after"] == seen["cgroup_before"]
    assert [p.name for p in service.iterdir() if p.is_dir()] == []


def test_a_process_of_someone_else_in_the_cgroup_is_named_and_left_alone(service):
    """A process put in S by someone else is not the worker's to move: the pool
    falls back to PSS, says which process and what to run instead, and S is
    left exactly as it was."""
    stranger = subprocess.Popen(["sleep", "600"])
    try:
        (service / "cgroup.procs").write_text(str(stranger.pid))
        seen = run_in(service, pool_code(service, "template"))
    finally:
        stranger.kill()
        stranger.wait()
    assert "PSS" in seen["source"], seen
    [warned] = [w for w in seen["warnings"] if "no cgroup memory accounting" in w]
    assert f"{stranger.pid} (sleep)" in warned and "not of the worker's own process tree" in warned, warned
    assert "systemd-run --scope -p Delegate=yes" in warned and "--user" in warned and "--uid=" in warned
    assert "memory_limit needs a writable memory cgroup" in seen["memory_limit"]
    assert seen["leaf"] is None and seen["subtree_during"] == []  # nothing was moved or enabled
    assert seen["cgroup_during"] == seen["cgroup_before"]


def test_a_cgroup_that_is_not_given_memory_says_so_and_what_to_run(service):
    """S's parent passes no memory down (a unit without Delegate=): the reason
    and the fix, from CgroupPool itself."""
    inner = service / "unit"
    inner.mkdir()  # service passes nothing to its children: no controller in inner
    code = (
        "import sys; sys.path.insert(0, %r)\n"
        "from boltzlabs.errors import CgroupUnavailable\nfrom boltzlabs.host.cgroups import CgroupPool\n"
        "try:\n    CgroupPool()\nexcept CgroupUnavailable as exc:\n    print(__import__('json').dumps(str(exc)))\n"
        % str(TESTS.parent)
    )
    said = run_in(inner, code)
    assert "has no memory controller" in said and str(inner) in said, said
    assert "Delegate=yes" in said and "boltzlabs doctor" in said


def test_memory_without_pids_runs_and_doctor_warns_that_fork_bombs_are_not_bounded(service):
    """A delegation with memory but not pids: the pool runs with the kernel's
    accounting, and doctor says the pids limits will not be enforced (it once
    said PASS there)."""
    (service / "cgroup.subtree_control").write_text("+memory")
    inner = service / "unit"
    inner.mkdir()  # given memory, not pids
    code = (
        "import sys, json; sys.path.insert(0, %r)\n"
        "from boltzlabs.cli import doctor\n"
        "print(json.dumps({f.name: [f.status, f.detail] for f in doctor._cgroups()}))\n" % str(TESTS.parent)
    )
    found = run_in(inner, code)
    assert found["memory cgroup"][0] == "ok" and "cgroup v2" in found["memory cgroup"][1], found
    assert found["pids cgroup"][0] == "warn" and "fork bomb is not bounded" in found["pids cgroup"][1], found
    assert found["freezer cgroup"][0] == "ok", found


def test_a_pool_inside_a_containers_cgroup_namespace(service):
    """Inside a cgroup namespace the namespace's root (the container's cgroup)
    is not the kernel's root: the worker makes its room there, with the shell
    and its sleep, and writes nothing above it."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    code = pool_code(Path("/sys/fs/cgroup"), "template")
    seen = run_in(
        service,
        code,
        wrap="unshare -C -m",
        extra="mount --make-rprivate / && umount /sys/fs/cgroup && mount -t cgroup2 none /sys/fs/cgroup &&",
    )
    assert seen["cgroup_before"] == "0::/", seen  # the namespace's root
    assert seen["source"].startswith("cgroup v2"), seen
    assert not seen["warnings"], seen["warnings"]
    assert seen["cgroup_during"] == "0::/boltzlabs-procs"
    assert [p.startswith("/sys/fs/cgroup/boltzlabs-") for p in seen["paths"]] == [True]
    assert seen["memory_limit"] == "ok" and seen["leaf_after"] is False
    # Seen from outside: all of it was inside S, and is gone.
    assert [p.name for p in service.iterdir() if p.is_dir()] == []


TWO_POOLS = """
import json, sys
sys.path.insert(0, {root!r})
from pathlib import Path
from boltzlabs import RLPool
S = Path({cgroup!r})
a = RLPool({hostile!r}, 1)
b = RLPool({hostile!r}, 1)  # its worker starts in a's leaf and shares the room
out = {{"parents": sorted({{str(Path(p).parent) for p in a._cgroup + b._cgroup}})}}
a.close()
out["leaf_with_b"] = (S / "boltzlabs-procs").exists()
b.reset(seed=0)
out["b_steps"] = b.step([3])[0][0]
b.close()
out["leaf_after"] = (S / "boltzlabs-procs").exists()
out["subtree_after"] = (S / "cgroup.subtree_control").read_text().split()
print(json.dumps(out), flush=True)
"""


def test_two_pools_share_the_room_and_the_last_one_undoes_it(service):
    seen = run_in(service, TWO_POOLS.format(root=str(TESTS.parent), cgroup=str(service), hostile=str(HOSTILE)))
    assert seen["parents"] == [str(service)], seen
    assert seen["leaf_with_b"] is True and seen["b_steps"] == {"lane": 0, "echo": 3}
    assert seen["leaf_after"] is False and seen["subtree_after"] == [], seen


def test_a_systemd_unit_is_delegated_when_systemd_marked_it(service):
    """doctor's "systemd delegation" finding: systemd marks a delegated unit's
    cgroup with trusted.delegate (and user.delegate); below an unmarked one a
    pool's cgroups are systemd's to move or remove, so a worker there asks for
    a scope of its own. The innermost unit decides, not a unit above it."""
    marker = Path("/run/systemd/system")
    made = not marker.exists()
    if made:  # the guest has no systemd: say it has, for this check only
        marker.mkdir(parents=True)
    try:
        unit, below = service / "a.service", service / "a.service" / "job"
        below.mkdir(parents=True)
        assert cgroups.systemd_delegated(below) is False
        os.setxattr(unit, "trusted.delegate", b"1")
        assert cgroups.systemd_delegated(below) is True and cgroups.systemd_delegated(unit) is True
        assert cgroups.systemd_delegated(service) is None  # in no unit of systemd's: nothing to say
    finally:
        if made:
            marker.rmdir()
    if made:
        assert cgroups.systemd_delegated(service) is None  # no systemd: nothing to say


KILLED_WORKER = """
import json, os, signal, sys, time
sys.path.insert(0, {root!r})
from pathlib import Path
import psutil
from boltzlabs import RLPool
S = Path({cgroup!r})
pool = RLPool({hostile!r}, 2)
pool.reset(seed=0)
out = {{"leaf": (S / "boltzlabs-procs").exists(), "paths": pool._cgroup}}
guardian = [p for p in psutil.Process(pool._proc.pid).children() if p.name() == "boltzlabs-guard"]
os.kill(pool._proc.pid, signal.SIGKILL)
psutil.wait_procs(guardian, timeout=60)
out.update(leaf_after=(S / "boltzlabs-procs").exists(), pools_after=[str(p) for p in S.glob("boltzlabs-*")],
           subtree_after=(S / "cgroup.subtree_control").read_text().split(),
           cgroup_after=open("/proc/self/cgroup").read().strip())
print(json.dumps(out), flush=True)
"""


def test_after_the_worker_is_killed_its_guardian_undoes_the_room(service):
    seen = run_in(service, KILLED_WORKER.format(root=str(TESTS.parent), cgroup=str(service), hostile=str(HOSTILE)))
    assert seen["leaf"] is True and [Path(p).parent for p in seen["paths"]] == [service], seen
    assert seen["pools_after"] == [] and seen["leaf_after"] is False and seen["subtree_after"] == [], seen
    assert seen["cgroup_after"].endswith(service.name)  # the trainer is back where it started
