"""A trainer for tests/test_systemd.py, run as a process of its own wherever the
test put it (a scope systemd did not delegate, beside a process of another
tree or alone; a user's login session). It prints one JSON line on stdout:

    python tests/systemd_trainer.py check    one pool with every limit: where its worker's cgroup is,
                                             accounting, the gate, the pids limits, an env's OOM kill;
                                             closes it, then waits for its scope to go
    python tests/systemd_trainer.py hold     opens the same pool, says where it is, sleeps until killed
    python tests/systemd_trainer.py doctor   `boltzlabs doctor`'s cgroup findings, from here

It reports what it saw and asserts nothing: the test does, so that a failure
names the fact. A trainer killed by systemd (its scope stopped) prints nothing
and exits 143, which the test reports as such.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from boltzlabs import RLPool  # noqa: E402
from boltzlabs.host.cgroups import PoolView  # noqa: E402

# What each step does: "hold" keeps 32 MiB more, "oom" tries to keep 256 (past memory_limit),
# "fork" forks until refused and exits 11 (as a shell does), a number is a normal step.
ENV = """
import os, time
from boltzlabs.env import serve

held = []


def keep(mib):
    block = bytearray(mib << 20)
    block[::4096] = b"x" * len(block[::4096])
    held.append(block)


def step(action):
    if action in ("hold", "oom"):
        keep(32 if action == "hold" else 256)
        return len(held), 0.0, False, {}
    if action == "fork":
        while True:
            try:
                if os.fork() == 0:
                    time.sleep(600)
                    os._exit(0)
            except OSError:
                os._exit(11)
    return action, float(action), False, {}


serve(reset=lambda seed: 0, step=step)
"""
SCALE = float(os.environ.get("BOLTZLABS_TIME_SCALE") or 1)
MiB = 1 << 20
PIDS, POOL_PIDS = 16, 64


def cgroup_of(pid: int | str = "self") -> str:
    """The process's cgroup v2 path ('' once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cgroup").read_text().strip().split(":", 2)[2]
    except (OSError, IndexError):
        return ""


def unit_of(cgroup: str) -> str:
    """The innermost systemd unit (a .scope or .service) on a cgroup path."""
    units = [part for part in cgroup.split("/") if part.endswith((".scope", ".service"))]
    return units[-1] if units else ""


def manager(cgroup: str) -> list[str]:
    """systemctl, for the manager that owns the unit at `cgroup` (a user's below user@UID.service)."""
    return ["systemctl", "--user"] if "/user@" in cgroup else ["systemctl"]


def show(cgroup: str) -> dict[str, str]:
    """The unit's Delegate, OOMPolicy, CollectMode, ActiveState and LoadState, as systemd says."""
    unit = unit_of(cgroup)
    out = subprocess.run(
        [*manager(cgroup), "show", unit, "-p", "Id,Delegate,OOMPolicy,CollectMode,ActiveState,LoadState"],
        capture_output=True,
        text=True,
        timeout=30 * SCALE,
    ).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def open_pool() -> RLPool:
    env = Path(tempfile.mkdtemp(prefix="boltzlabs-trainer-"))
    atexit.register(shutil.rmtree, env, True)
    (env / "env.py").write_text(ENV)
    env.chmod(0o755)  # a root worker's sandboxes run as the policy's account (nobody)
    (env / "env.py").chmod(0o644)
    return RLPool(
        env,
        2,
        memory_limit="96M",
        limits={"pids": PIDS, "pool_pids": POOL_PIDS},
        serialize_measurement=True,
        cpu_share=True,
        step_timeout=10 * SCALE,
        start_timeout=120 * SCALE,
    )


def guardian_of(worker: int) -> int | None:
    """The worker's cgroup guardian: its child named boltzlabs-guard."""
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if stat.split(")")[-1].split()[1] == str(worker) and "(boltzlabs-guard)" in stat:
            return int(entry.name)
    return None


def where(pool: RLPool) -> dict:
    worker = pool._proc.pid
    cgroup = cgroup_of(worker)
    return {
        "trainer_pid": os.getpid(),
        "trainer_cgroup": cgroup_of(),
        "worker_pid": worker,
        "guardian_pid": guardian_of(worker),
        "worker_cgroup": cgroup,
        "unit": show(cgroup),
        "pool_cgroups": pool._cgroup,
        "env_pids": pool.pids(),
    }


def gone(report: dict, timeout: float) -> float | None:
    """Seconds until the worker and the pool's cgroups were gone, and with them the worker's own
    scope (unit and cgroup) where it had one; None if not by `timeout`."""
    cgroup, unit = report["worker_cgroup"], report["unit"].get("Id", "?")
    own = re.fullmatch(r"boltzlabs-\d+(-[0-9a-f]+)?\.scope", unit) is not None
    left = [*report["pool_cgroups"], "/sys/fs/cgroup" + cgroup.split(unit)[0] + unit if own else "/nonexistent"]
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if (
            not os.path.exists(f"/proc/{report['worker_pid']}")
            and not any(map(os.path.exists, left))
            and (not own or show(cgroup).get("LoadState") == "not-found")
        ):
            return time.monotonic() - start
        time.sleep(0.05)
    return None


def check() -> dict:
    report: dict = {"trainer_cgroup_before": cgroup_of()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pool = open_pool()
        try:
            report.update(where(pool))
            view = PoolView(pool._cgroup)
            pool.reset(seed=0)
            # Accounting: the kernel's figures, each env charged for what it allocates.
            before = pool.memory()
            pool.step(["hold", 1])
            after = pool.memory()
            report["memory_source"] = before.source
            report["grew_mib"] = [(a - b) / MiB for a, b in zip(after.per_env, before.per_env)]
            # The gate: between calls every env is frozen.
            report["frozen_between_calls"] = [view.frozen(i) for i in range(2)]
            # cpu_share: each env a group of the cpu controller, every process of it inside.
            report["cpu_share"] = pool.cpu_share
            report["cpu_groups_hold_the_envs"] = [
                sorted(map(int, (view.group(i, "cpu") / "cgroup.procs").read_text().split())) == sorted(view.procs(i))
                and (view.pool("cpu") / "cgroup.subtree_control").read_text().split().count("cpu") == 1
                for i in range(2)
            ]
            # pids: the env's cap refuses its forks and is named; the pool's cap is written.
            _, _, dones, infos = pool.step(["fork", 1])
            report["pids_error"] = infos[0].get("error", "")
            report["pids_limit"] = [view.pids_limit(i) for i in range(2)]
            report["pool_pids_limit"] = view.pids_limit()
            pool.reset(where=[0], seed=0)
            # OOM: the env past memory_limit is killed and named; the trainer and the other env go on.
            _, rewards, dones, infos = pool.step(["oom", 1])
            report["oom_error"] = infos[0].get("error", "")
            report["oom_other_lane"] = infos[1].get("error", "")
            time.sleep(2 * SCALE)  # what systemd would do about the OOM kill, it does now
            pool.reset(where=[0], seed=0)
            report["after_oom"] = pool.step([1, 1])[1].tolist()
            report["unit_after_oom"] = show(report["worker_cgroup"])
        finally:
            pool.close()
        report["warnings"] = [str(w.message) for w in caught]
    report["gone_after_close_s"] = gone(report, 30 * SCALE)
    report["trainer_cgroup_after"] = cgroup_of()
    return report


def hold() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pool = open_pool()
        pool.reset(seed=0)
        report = where(pool)
        report["warnings"] = [str(w.message) for w in caught]
    print(json.dumps(report), flush=True)
    time.sleep(100000)


def doctor() -> dict:
    from boltzlabs.cli.doctor import _cgroup_version, _cgroups

    findings = _cgroup_version() + _cgroups()
    return {"findings": [f.to_dict() for f in findings], "trainer_cgroup_after": cgroup_of()}


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "hold":
        hold()
    else:
        print(json.dumps(check() if mode == "check" else doctor()), flush=True)
