"""Benchmarks that must keep running: benchmarks/bench_wake.py and its C program.

bench_wake's program forks children outside any sandbox, so besides a smoke run
these tests check that no child outlives it: at the end of every mode, when a
child dies mid-run, and when the program is interrupted or killed. In the shm
modes the children write shared memory the parent reads: a child that writes
its slot wrongly, dies or stops answering ends the run with that child named."""

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import host_lock

ROOT = Path(__file__).resolve().parent.parent
BENCH_WAKE = ROOT / "benchmarks" / "bench_wake.py"

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")


def _bench_wake():
    spec = importlib.util.spec_from_file_location("bench_wake", BENCH_WAKE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def binary(tmp_path_factory):
    """wake_bench built under a name of this test run's own, so its processes can be
    found by name (/proc/PID/comm) without mistaking anyone else's."""
    name = f"wb{os.getpid()}"[:15]
    return _bench_wake().build(os.environ.get("CC", "cc"), tmp_path_factory.mktemp("wake"), name)


def _processes():
    """(pid, name, state, parent pid) of every process /proc shows."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except (OSError, ValueError):
            continue
        after = stat[stat.rindex(")") + 2 :].split()
        yield int(entry.name), stat[stat.index("(") + 1 : stat.rindex(")")], after[0], int(after[1])


def _alive(name: str) -> list:
    """Pids of live (not zombie) processes named `name`."""
    return [pid for pid, comm, state, _ in _processes() if comm == name and state != "Z"]


def _none_left(name: str, within: float = 5.0) -> list:
    """The processes named `name` still alive after up to `within` seconds."""
    deadline = time.monotonic() + within
    while (left := _alive(name)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _children(parent: int, count: int, within: float = 10.0) -> list:
    """The pids of `parent`'s children, once there are `count` of them."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        kids = [pid for pid, _, _, ppid in _processes() if ppid == parent]
        if len(kids) >= count:
            return kids
        time.sleep(0.05)
    raise AssertionError(f"wake_bench (pid {parent}) had not forked {count} children after {within} s")


def _bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run bench_wake.py. Its runs are named wake_bench: one test session at a time
    (CI runs two), so counting them by name sees only its own."""
    with host_lock("bench_wake"):
        return subprocess.run([sys.executable, str(BENCH_WAKE), *args], capture_output=True, text=True, timeout=timeout)


def test_bench_wake_runs_quickly_and_writes_every_figure(tmp_path):
    """The documented quick look (here with the children SCHED_OTHER only: SCHED_BATCH
    runs in test_every_mode_ends_with_its_children_gone, and the suite's time is counted)
    finishes well under a minute and records every mode and figure."""
    out = tmp_path / "wake.json"
    started = time.monotonic()
    done = _bench("--n", "8", "--repeat", "1", "--sched", "other", "--json", str(out))
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < 60  # a bound to catch a hang or a runaway calibration, not a timing
    record = json.loads(out.read_text())
    modes = {r["mode"] for r in record["results"]}
    everywhere = {"pipe", "futex", "bcast", "pipe+bcast", "shm", "shm+wake"}
    assert modes == everywhere | {"uring"} or (modes == everywhere and "uring left out" in record["notes"][0])
    assert record["nap_divisor"] == 8
    for result in record["results"]:
        assert result["n"] == 8 and result["sched"] == "other"
        assert result["parent_us"]["median"] > 0 and result["child_rounds_per_s"]["median"] > 0
        assert 0 < result["parent_wake_us"]["median"]
        assert all(run["replies"] == 8 * run["rounds"] for run in result["runs"])
    assert "| pipe | other |" in done.stdout and "load average before" in done.stdout


def test_a_run_that_hangs_past_its_timeout_is_killed_with_its_children(tmp_path):
    with host_lock("bench_wake"):
        started = time.monotonic()
        done = subprocess.run(
            [
                sys.executable,
                str(BENCH_WAKE),
                "--n",
                "16",
                "--modes",
                "pipe",
                "--sched",
                "other",
                "--repeat",
                "1",
                "--rounds",
                "100000000",
                "--timeout",
                "1",
                "--json",
                str(tmp_path / "w.json"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 1
        assert "pipe/other n=16 rounds=100000000 did not finish in 1 s and was killed" in done.stderr
        assert time.monotonic() - started < 30
        assert _none_left("wake_bench") == []
    assert not (tmp_path / "w.json").exists()


@pytest.mark.parametrize(
    "args, says",
    [
        (["--n", "0"], "must be >= 1"),
        (["--repeat", "0"], "must be >= 1"),
        (["--rounds", "-5"], "must be >= 1"),
        (["--seconds", "0"], "--seconds > 0"),
        (["--modes", "nosuch"], "invalid choice"),
        (["--nap-divisor", "0"], "between 1 and 1000"),
        (["--nap-divisor", "nan"], "between 1 and 1000"),
        (["--sched", "fifo"], "invalid choice"),
        (["--n", "x"], "invalid int value"),
    ],
)
def test_bench_wake_refuses_bad_options(args, says):
    done = _bench(*args, timeout=30)
    assert done.returncode == 2 and says in done.stderr


def test_bench_wake_without_a_compiler_says_so(tmp_path):
    done = _bench("--cc", "no-such-cc", "--json", str(tmp_path / "w.json"), timeout=30)
    assert done.returncode == 1
    assert "no C compiler ('no-such-cc' is not on PATH)" in done.stderr and "apt-get install gcc" in done.stderr


ALL_MODES = ["pipe", "futex", "bcast", "pipe+bcast", "uring", "shm", "shm+wake"]
SHM_MODES = ["shm", "shm+wake"]


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("sched", ["other", "batch"])
def test_every_mode_ends_with_its_children_gone(binary, mode, sched):
    done = subprocess.run([str(binary), mode, sched, "32", "200"], capture_output=True, text=True, timeout=60)
    if done.returncode == 3:
        pytest.skip(f"{mode} cannot run here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)
    assert figures["mode"] == mode and figures["n"] == 32 and figures["rounds"] == 200
    assert figures["replies"] == 32 * 200  # every child answered every timed round, once
    assert figures["child_user_us"] + figures["child_sys_us"] > 0  # every child's window was recorded
    assert 0 < figures["parent_wake_us"] and figures["waits_per_round"] >= 0
    assert _none_left(binary.name) == []


def test_the_nap_divisor_is_built_in(tmp_path):
    """--nap-divisor reaches the program: built with a divisor of 2, the shm mode
    naps longer (a quarter of the fan-in so far instead of an eighth), and runs."""
    built = _bench_wake().build(os.environ.get("CC", "cc"), tmp_path, f"wd{os.getpid()}"[:15], nap_divisor=2)
    done = subprocess.run([str(built), "shm", "other", "16", "100"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["replies"] == 1600
    assert _none_left(built.name) == []


@pytest.mark.parametrize("mode", ["pipe", "bcast", "pipe+bcast", "shm", "shm+wake"])
@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_interrupted_or_killed_mid_run_leaves_no_child(binary, mode, how):
    """SIGINT / SIGTERM: the program kills and reaps its children; SIGKILL: they die by
    their parent-death signal."""
    proc = subprocess.Popen(
        [str(binary), mode, "other", "16", "100000000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    _children(proc.pid, 16)
    time.sleep(0.2)  # into the rounds
    proc.send_signal(how)
    proc.communicate(timeout=10)
    assert proc.returncode == (-signal.SIGKILL if how == signal.SIGKILL else 128 + how)
    assert _none_left(binary.name) == []


def _signal_a_child_mid_run(binary, mode: str, how: int, within: float, env=None) -> tuple:
    """Run `mode` with 16 children for good, send `how` to one child 0.2 s in, and wait
    up to `within` seconds for the program to end (killed, children and all, if it
    does not). Returns (the child's pid, the exit status, stderr)."""
    proc = subprocess.Popen(
        [str(binary), mode, "other", "16", "100000000"],
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        victim = sorted(_children(proc.pid, 16))[5]
        time.sleep(0.2)
        os.kill(victim, how)
        _, err = proc.communicate(timeout=within)
    finally:
        if proc.poll() is None:  # it did not end by itself: leave nothing behind
            proc.kill()
            proc.communicate()
    return victim, proc.returncode, err


@pytest.mark.parametrize("mode", ["pipe", "futex", "bcast", "pipe+bcast"])
def test_a_child_that_dies_mid_run_is_reported_and_the_rest_are_killed(binary, mode):
    _, status, err = _signal_a_child_mid_run(binary, mode, signal.SIGKILL, within=20)
    assert status == 1  # not killed by SIGPIPE writing to the dead child's request pipe
    # Whichever the parent meets first: the reply pipe's end of file, or EPIPE on the request pipe.
    assert ("closed its reply pipe" in err or "closed its request pipe" in err) and f"wake_bench {mode} n=16" in err
    assert _none_left(binary.name) == []


@pytest.mark.parametrize("mode", SHM_MODES)
def test_a_child_that_dies_mid_run_in_shared_memory_is_named(binary, mode):
    """No pipe tells the parent: its slot just stops moving. Once a round is slow the
    parent looks for exited children, and names the one it finds."""
    victim, status, err = _signal_a_child_mid_run(binary, mode, signal.SIGKILL, within=20)
    assert status == 1
    says = rf"wake_bench {re.escape(mode)} n=16: child \d+ \(pid {victim}\) ended with signal 9 in round"
    assert re.search(says, err)
    assert _none_left(binary.name) == []


@pytest.mark.parametrize("mode", SHM_MODES)
def test_a_child_that_stops_answering_in_shared_memory_ends_the_run_at_the_deadline(binary, mode):
    """A stopped child is alive and silent: the round's deadline (10 s; 1 s here, by
    WAKE_BENCH_ROUND_DEADLINE) ends the run, whether the parent naps (shm) or sleeps
    on the doorbell (shm+wake)."""
    _, status, err = _signal_a_child_mid_run(
        binary, mode, signal.SIGSTOP, within=40, env={"WAKE_BENCH_ROUND_DEADLINE": "1"}
    )
    assert status == 1
    assert re.search(r"1 of 16 children had not answered after 1 s \(child \d+ first\)", err)
    assert _none_left(binary.name) == []


@pytest.mark.parametrize("mode", SHM_MODES)
@pytest.mark.parametrize(
    "fault, says",
    [
        ("seq", "child 5's reply slot holds sequence"),
        ("payload", "child 5's reply in round"),
    ],
)
def test_a_child_that_writes_its_reply_slot_wrongly_is_named(binary, mode, fault, says):
    """The reply slots are the children's to write: the parent checks the sequence
    word and its own copy of the payload, and ends the run naming the child."""
    done = subprocess.run(
        [str(binary), mode, "other", "16", "100000"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "WAKE_BENCH_FAULT": f"5:{fault}"},
    )
    assert done.returncode == 1 and done.stdout == ""
    assert f"wake_bench {mode} n=16: " in done.stderr and says in done.stderr
    assert _none_left(binary.name) == []


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["pipe", "other", "8"],
        ["nosuch", "other", "8", "10"],
        ["pipe", "fifo", "8", "10"],
        ["pipe", "other", "0", "10"],
        ["pipe", "other", "8", "-1"],
        ["pipe", "other", "8x", "10"],
        ["pipe", "other", "1000000", "10"],
        ["pipe", "other", "8", "99999999999999999999"],
        ["shm+", "other", "8", "10"],
    ],
)
def test_bad_arguments_are_refused_before_any_fork(binary, argv):
    done = subprocess.run([str(binary), *argv], capture_output=True, text=True, timeout=10)
    assert done.returncode == 2
    assert "usage" in done.stderr or "bad arguments" in done.stderr
    assert done.stdout == ""


@pytest.mark.parametrize("fault", ["8:seq", "-1:seq", "5:other", "5", "x:seq", "5:seq:more", "5:payloadx"])
def test_a_bad_fault_variable_is_refused_before_any_fork(binary, fault):
    done = subprocess.run(
        [str(binary), "shm", "other", "8", "10"],
        capture_output=True,
        text=True,
        timeout=10,
        env={**os.environ, "WAKE_BENCH_FAULT": fault},
    )
    assert done.returncode == 2 and "bad WAKE_BENCH_FAULT" in done.stderr and done.stdout == ""


@pytest.mark.parametrize("value", ["0", "0.05", "4000", "nan", "1x", "-1"])
def test_a_bad_round_deadline_is_refused_before_any_fork(binary, value):
    done = subprocess.run(
        [str(binary), "pipe", "other", "8", "10"],
        capture_output=True,
        text=True,
        timeout=10,
        env={**os.environ, "WAKE_BENCH_ROUND_DEADLINE": value},
    )
    assert done.returncode == 2 and "bad WAKE_BENCH_ROUND_DEADLINE" in done.stderr and done.stdout == ""
