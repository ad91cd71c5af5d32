"""A trainer on a systemd cgroup-v2 node, started with no command: in a scope
systemd did not delegate (a login shell's session-N.scope is one), beside a
process of another tree or alone, and as an ordinary user in a login session.
The worker asks systemd for a delegated scope of its own (boltzlabs-<worker
pid>.scope, OOMPolicy=continue) and makes its room there: accounting,
memory_limit's OOM kill on the lane (the trainer lives), both pids caps, the
freezer gate; the scope is gone after close and after SIGKILL of the trainer.

Real systemd only: these run in ci/v2guest.sh's guest booted with systemd as
PID 1 (`V2GUEST_INIT=systemd bash ci/v2guest.sh bash ci/v2tests.sh systemd`,
which also starts the system bus and logind and makes the session's user, named
by BOLTZLABS_TEST_SESSION_USER) and skip elsewhere. Each trainer is
tests/systemd_trainer.py, a process of its own placed by systemd-run.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import scaled, wait_until

ROOT = Path(__file__).resolve().parent.parent
TRAINER = Path(__file__).resolve().parent / "systemd_trainer.py"
PYTHON = sys.executable
SESSION_USER = os.environ.get("BOLTZLABS_TEST_SESSION_USER", "")


def _systemd_cgroup2() -> str:
    """Why these tests cannot run here, '' when they can."""
    if not Path("/run/systemd/system").is_dir():
        return "systemd is not the init here (no /run/systemd/system)"
    if not Path("/sys/fs/cgroup/cgroup.controllers").exists():
        return "not a cgroup v2 host"
    if os.geteuid() != 0:
        return "the tests place trainers with systemd-run as root"
    return ""


pytestmark = pytest.mark.skipif(bool(_systemd_cgroup2()), reason=_systemd_cgroup2() or "runs")


def _tag() -> str:
    return f"trainer-{secrets.token_hex(3)}"


def _placed(placement: str, mode: str, unit: str, *env: str) -> list[str]:
    """The command line that runs the trainer in `mode` where `placement` says, as unit `unit`,
    with `env` (NAME=value) added to its environment."""
    scale = f"BOLTZLABS_TIME_SCALE={os.environ.get('BOLTZLABS_TIME_SCALE', '1')}"
    trainer = ["env", scale, *env, PYTHON, str(TRAINER), mode]
    if placement == "beside_another_tree":
        # A process the trainer's tree does not hold, as tmux or nohup leave in a session: the
        # subshell's sleep is orphaned to PID 1 before the trainer starts.
        return ["systemd-run", "--scope", f"--unit={unit}", "--quiet", "--",
                "bash", "-c", '(sleep 100000 </dev/null >/dev/null 2>&1 &); exec "$@"', "trainer", *trainer]  # fmt: skip
    if placement == "alone":
        return ["systemd-run", "--scope", f"--unit={unit}", "--quiet", "--", *trainer]
    if placement in ("user_session", "user_delegated_scope"):
        # pam_systemd through PAMName=login: a session-N.scope of logind's and the user's manager;
        # then, for the second, a scope of that manager's with Delegate=yes, as the docs' fix made.
        inner = ["systemd-run", "--user", "--scope", "-p", "Delegate=yes", "--quiet", "--"]
        return ["systemd-run", "-p", "PAMName=login", "-p", f"User={SESSION_USER}", f"--unit={unit}",
                "--quiet", "--pipe", "--wait", "--",
                *(inner if placement == "user_delegated_scope" else []), *trainer]  # fmt: skip
    raise ValueError(placement)


def _stop(unit: str) -> None:
    subprocess.run(["systemctl", "stop", unit], capture_output=True, timeout=scaled(60))
    subprocess.run(["systemctl", "reset-failed", unit], capture_output=True, timeout=scaled(60))


def _session_ready(placement: str) -> None:
    """For a placement in a user's session: skip without the session's user, else wait for the
    user's manager (ci/v2tests.sh makes it linger): a session opened while it starts or stops
    finds its bus refusing, and the trainer never runs."""
    if not placement.startswith("user_"):
        return
    if not SESSION_USER:
        pytest.skip("no BOLTZLABS_TEST_SESSION_USER: ci/v2tests.sh's systemd run makes one in the guest")

    manager = f"user@{pwd.getpwnam(SESSION_USER).pw_uid}.service"

    def active() -> bool:
        state = subprocess.run(["systemctl", "is-active", manager], capture_output=True, text=True)
        return state.stdout.strip() == "active"

    assert wait_until(active, timeout=120), f"{manager} is not active: is {SESSION_USER} lingering?"


def _run(placement: str, mode: str) -> dict:
    _session_ready(placement)
    unit = _tag() + (".service" if placement.startswith("user_") else ".scope")
    try:
        out = subprocess.run(
            _placed(placement, mode, unit), capture_output=True, text=True, cwd=ROOT, timeout=scaled(90)
        )
    finally:
        _stop(unit)
    assert out.returncode == 0, f"the trainer exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def _in_its_own_scope(report: dict) -> None:
    """The worker is in a delegated transient scope of its own, named for it; the trainer stayed."""
    worker, unit = report["worker_pid"], report["unit"]
    assert unit.get("Id") == f"boltzlabs-{worker}.scope", report
    assert f"/boltzlabs-{worker}.scope/" in report["worker_cgroup"] + "/", report
    assert unit.get("Delegate") == "yes" and unit.get("OOMPolicy") == "continue", unit
    assert unit.get("CollectMode") == "inactive-or-failed", unit
    assert report["trainer_cgroup"] == report["trainer_cgroup_before"] == report["trainer_cgroup_after"], report
    assert "boltzlabs" not in report["trainer_cgroup"], report


@pytest.mark.parametrize("placement", ["beside_another_tree", "alone", "user_session"])
def test_a_trainer_in_a_scope_systemd_did_not_delegate_gets_every_limit(placement):
    report = _run(placement, "check")
    _in_its_own_scope(report)
    assert not [w for w in report["warnings"] if "cgroup" in w or "freeze" in w], report["warnings"]
    # Accounting: the kernel's, each env charged for its own allocation.
    assert report["memory_source"].startswith("cgroup v2 "), report["memory_source"]
    grew = report["grew_mib"]
    assert 28 < grew[0] < 40 and abs(grew[1]) < 4, grew
    # The gate: both envs frozen between calls.
    assert report["frozen_between_calls"] == [True, True], report
    # cpu_share: the cpu controller was the worker's to pass on, and each env's group holds it.
    assert report["cpu_share"] is True and report["cpu_groups_hold_the_envs"] == [True, True], report
    # pids: the env's cap refused its forks and says so; the pool's cap is written.
    assert "pids limit" in report["pids_error"] and "16 tasks" in report["pids_error"], report["pids_error"]
    assert report["pids_limit"] == [16, 16] and report["pool_pids_limit"] == 64, report
    # OOM: named on its lane; the other lane, the trainer and the scope go on.
    assert "OOM" in report["oom_error"], report["oom_error"]
    assert report["oom_other_lane"] == "" and report["after_oom"] == [1.0, 1.0], report
    assert report["unit_after_oom"].get("ActiveState") == "active", report["unit_after_oom"]
    # Close: the worker, its scope and the scope's cgroup are gone.
    assert report["gone_after_close_s"] is not None, "the worker's scope outlived the pool by 30 s"


def test_a_user_whose_scope_systemd_delegated_keeps_the_room_there():
    """A delegated unit is the worker's to use (a user's manager marks it with no xattr: the
    worker asks it for the unit's Delegate property): no second scope, the room made in the
    trainer's own, every limit there, and an env's OOM kill leaves it running (a delegated unit's
    OOMPolicy defaults to continue)."""
    report = _run("user_delegated_scope", "check")
    unit = report["unit"]
    assert "/user@" in report["trainer_cgroup_before"] and unit.get("Delegate") == "yes", report
    assert unit.get("Id", "").startswith("run-") and unit["Id"] in report["trainer_cgroup_before"], unit
    assert report["worker_cgroup"] == report["trainer_cgroup_before"] + "/boltzlabs-procs", report
    assert report["memory_source"].startswith("cgroup v2 ") and 28 < report["grew_mib"][0] < 40, report
    assert report["frozen_between_calls"] == [True, True] and report["pool_pids_limit"] == 64, report
    assert "OOM" in report["oom_error"] and report["after_oom"] == [1.0, 1.0], report
    assert report["unit_after_oom"].get("ActiveState") == "active", report["unit_after_oom"]
    assert report["gone_after_close_s"] is not None, "the pool's cgroups outlived it by 30 s"


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize(
    "placement, killed",
    [
        ("beside_another_tree", ["trainer"]),
        ("user_session", ["trainer"]),
        # No guardian left to clean up: systemd alone removes the emptied scope and what is below it.
        ("alone", ["trainer", "worker", "guardian"]),
    ],
    ids=["beside_another_tree", "user_session", "alone-with-worker-and-guardian"],
)
def test_nothing_is_left_after_the_trainer_is_killed(placement, killed):
    _session_ready(placement)
    unit = _tag() + (".service" if placement == "user_session" else ".scope")
    proc = subprocess.Popen(
        _placed(placement, "hold", unit), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        line = proc.stdout.readline()
        assert line, f"the trainer said nothing: {proc.stderr.read()[-4000:]}"
        report = json.loads(line)
        report["trainer_cgroup_before"] = report["trainer_cgroup_after"] = report["trainer_cgroup"]
        _in_its_own_scope(report)
        scope = Path("/sys/fs/cgroup" + report["worker_cgroup"].split(report["unit"]["Id"])[0] + report["unit"]["Id"])
        assert scope.is_dir()
        assert report["guardian_pid"], report
        for who in killed:
            os.kill(report[f"{who}_pid"], signal.SIGKILL)
        pids = [report["worker_pid"], report["guardian_pid"], *report["env_pids"]]
        assert wait_until(lambda: not any(map(_alive, pids)), 30), [p for p in pids if _alive(p)]
        assert wait_until(lambda: not scope.exists(), 30), f"{scope} outlived the trainer"
        if "/user@" not in str(scope):  # (a user's manager may itself be gone with the session)
            state = lambda: subprocess.run(  # noqa: E731
                ["systemctl", "show", "-p", "LoadState", "--value", report["unit"]["Id"]],
                capture_output=True,
                text=True,
                timeout=scaled(30),
            ).stdout.strip()
            assert wait_until(lambda: state() == "not-found", 30), state()
    finally:
        proc.kill()
        proc.communicate()
        _stop(unit)


def test_doctor_says_where_the_room_was_made():
    report = _run("beside_another_tree", "doctor")
    found = {f["name"]: f for f in report["findings"]}
    for name in ("memory cgroup", "pids cgroup", "freezer cgroup"):
        assert found[name]["status"] == "ok", found[name]
    assert "delegated scope boltzlabs-" in found["memory cgroup"]["detail"], found["memory cgroup"]


@pytest.mark.parametrize("placement", ["beside_another_tree", "alone"])
def test_doctor_says_what_it_tried_where_systemd_gives_no_scope(placement):
    # A system bus that is not there: no scope from systemd. Beside another tree the worker cannot
    # make a room of its own either; alone it can, in a unit systemd may stop on an env's OOM kill.
    unit = _tag() + ".scope"
    argv = _placed(placement, "doctor", unit, "DBUS_SYSTEM_BUS_ADDRESS=unix:path=/nonexistent/bus")
    try:
        out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=scaled(90))
    finally:
        _stop(unit)
    assert out.returncode == 0, out.stderr[-4000:]
    found = {f["name"]: f for f in json.loads(out.stdout.strip().splitlines()[-1])["findings"]}
    memory = found["memory cgroup"]
    assert memory["status"] == "warn" and "/nonexistent/bus" in memory["detail"], memory
    if placement == "beside_another_tree":
        assert "tried a delegated scope from systemd" in memory["detail"], memory
        assert "then its own room" in memory["detail"], memory
        assert "not of the worker's own process tree" in memory["detail"], memory
        assert found["pids cgroup"]["status"] == "warn", found["pids cgroup"]
    else:
        assert "OOMPolicy=stop" in memory["detail"] and "the trainer with it" in memory["detail"], memory
        assert found["pids cgroup"]["status"] == "ok" and found["freezer cgroup"]["status"] == "ok", found
