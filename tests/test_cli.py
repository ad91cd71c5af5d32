"""The `boltzlabs` command through subprocess: output words and exit codes.

Every run is a real command over real sandboxes; the broken envs live in
tests/envs/ (nondeterministic, import_error, reset_crash).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from boltzlabs.host import cgroups
from conftest import COUNTER, PROBE, TESTS, on_terminal, scaled

ENVS = TESTS / "envs"
HANG = scaled(120)  # seconds: only to catch a hang (10x in the emulated v2 guest)


def boltzlabs(*args, env=None, command=None):
    """Run the command; returns (exit code, stdout, stderr)."""
    argv = (command or [sys.executable, "-m", "boltzlabs"]) + [str(a) for a in args]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=HANG, env=env, stdin=subprocess.DEVNULL)
    return out.returncode, out.stdout, out.stderr


def assert_no_traceback_of_ours(stderr: str) -> None:
    assert "Traceback" not in stderr, stderr


# -- help and usage ----------------------------------------------------------------------------


@pytest.mark.parametrize("command", [[], ["check"], ["bench"], ["doctor"]])
def test_help_of_each_command_names_its_exit_codes(command):
    code, out, err = boltzlabs(*command, "--help")
    assert code == 0, err
    assert out.startswith("usage: boltzlabs" + "".join(" " + c for c in command))
    assert "exit codes:" in out and "2  usage error" in out


def test_no_command_is_a_usage_error():
    code, _, err = boltzlabs()
    assert code == 2 and "usage: boltzlabs" in err


@pytest.mark.parametrize(
    "args, words",
    [
        (["check", "/no/such/env"], "is not a directory"),
        (["check", COUNTER, "--actions", "[1, 2"], "--actions is not JSON"),
        (["check", COUNTER, "--actions", "{}"], "non-empty JSON list"),
        (["check", COUNTER, "--param", "novalue"], "NAME=VALUE"),
        (["check", "gym://NoSuchEnv-v0"], "not a registered Gymnasium id"),
        (["bench", COUNTER, "-n", "0"], "whole number >= 1"),
        (["bench", COUNTER], "-n"),
        (["bench", COUNTER, "-n", "2", "--envs-per-sandbox", "0"], "whole numbers >= 1 separated by commas"),
        (["bench", COUNTER, "-n", "2", "--envs-per-sandbox", "1,x"], "whole numbers >= 1 separated by commas"),
        (["bench", COUNTER, "-n", "2", "--envs-per-sandbox", "2", "--plot", "x.png"], "leave it out with"),
        (["bench", COUNTER, "-n", "2", "--envs-per-sandbox", "2", "--rounds", "0"], "whole number >= 1"),
    ],
)
def test_usage_errors_exit_2_with_the_cause(args, words):
    code, out, err = boltzlabs(*args)
    assert code == 2, (out, err)
    assert words in err
    assert_no_traceback_of_ours(err)


# -- check -------------------------------------------------------------------------------------


def test_check_passes_on_the_example_env(spawn):
    code, out, err = boltzlabs("check", COUNTER, "--spawn", spawn)
    assert code == 0, out + err
    assert "FAIL" not in out
    for stage in ("start", "reset", "steps", "exception", "replay"):
        assert f"PASS  {stage}" in out, out
    assert "byte-identical episode" in out
    assert "reported on its lane" in out and "TypeError" in out  # float({...}) raised in the counter's step
    assert "WARN  handshake" in out  # the counter declares no spaces
    assert f"(spawn={spawn})" in out


def test_installed_script_runs_check():
    script = Path(sys.executable).parent / "boltzlabs"
    assert script.exists(), "the console script is missing: pip install -e . (ci/setup.sh does)"
    code, out, err = boltzlabs("check", COUNTER, "--actions", "[1, 2]", "--steps", "4", command=[str(script)])
    assert code == 0, out + err
    assert "4 step(s) answered, actions given" in out


def test_check_samples_a_gym_env_s_action_space():
    code, out, err = boltzlabs("check", "gym://CartPole-v1", "--steps", "5", "--param", "max_episode_steps=50")
    assert code == 0, out + err
    assert "action_space Discrete(2)" in out
    assert "actions sampled from the action space (seed 0)" in out
    assert "AssertionError" in out  # CartPole rejects the invalid action: the exception path ran
    assert "PASS  replay" in out


def test_check_finds_a_nondeterministic_env(spawn):
    code, out, err = boltzlabs("check", ENVS / "nondeterministic", "--spawn", spawn)
    assert code == 1, out + err
    assert "FAIL  replay" in out and "different episode" in out and "the reset obs differs" in out
    # It ignores its actions, so the invalid one does not make it raise: said, not failed.
    assert "WARN  exception" in out and "not exercised" in out


def test_check_shows_the_start_up_output_of_an_env_that_fails_at_import(spawn):
    code, out, err = boltzlabs("check", ENVS / "import_error", "--spawn", spawn)
    assert code == 1, out + err
    assert "FAIL  start" in out
    assert "about to import a module that does not exist" in out  # what the env printed
    assert "ModuleNotFoundError: No module named 'boltzlabs_no_such_module'" in out
    assert_no_traceback_of_ours(err)


def test_check_reports_a_crashing_reset(spawn):
    code, out, err = boltzlabs("check", ENVS / "reset_crash", "--spawn", spawn)
    assert code == 1, out + err
    assert "FAIL  reset" in out and "reset is broken on purpose" in out
    assert_no_traceback_of_ours(err)


def test_check_reports_a_step_that_raises_on_the_given_actions():
    code, out, err = boltzlabs("check", PROBE, "--actions", '[1, {"op": "raise"}]')
    assert code == 1, out + err
    assert "FAIL  steps" in out and "step 2" in out and "step failed on purpose" in out


# -- bench -------------------------------------------------------------------------------------


def test_bench_prints_a_table():
    code, out, err = boltzlabs("bench", COUNTER, "-n", "2", "4", "--steps", "20")
    assert code == 0, out + err
    lines = out.splitlines()
    assert lines[0].split("|")[1:4] == [" n ", " start (s) ", " env-steps/s "]
    assert [line.split("|")[1].strip() for line in lines[2:4]] == ["2", "4"]
    assert "worker ms" in lines[0] and "roundtrip ms" in lines[0] and "envs/GiB" in lines[0]
    assert f"cgroup {cgroups.version()}" in out  # where the memory figures come from: the kernel's


def test_bench_json_and_plot(tmp_path):
    plot = tmp_path / "bench.png"
    code, out, err = boltzlabs("bench", COUNTER, "-n", "2", "3", "--steps", "20", "--json", "--plot", plot)
    assert code == 0, out + err
    report = json.loads(out)  # JSON only on stdout
    assert [r["n"] for r in report["results"]] == [2, 3]
    for result in report["results"]:
        assert result["steps"] == 20 and result["failed_steps"] == 0
        assert result["env_steps_per_s"] > 0 and result["start_s"] > 0
        assert 0 < result["worker_ms"] <= result["roundtrip_ms"]
        assert result["mib_per_env"] > 0 and result["envs_per_gb"] > 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_says_how_to_get_matplotlib_when_it_is_missing(tmp_path):
    # A matplotlib package that cannot be imported, first on the path.
    (tmp_path / "matplotlib").mkdir()
    (tmp_path / "matplotlib" / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    code, out, err = boltzlabs("bench", COUNTER, "-n", "2", "--steps", "5", "--plot", tmp_path / "x.png", env=env)
    assert code == 2 and out == ""
    assert "pip install matplotlib (or pip install -e '.[plot]' in a checkout of boltzlabs)" in err


def test_bench_of_an_env_that_cannot_start_exits_1():
    code, out, err = boltzlabs("bench", ENVS / "import_error", "-n", "2", "--steps", "5")
    assert code == 1
    assert "ModuleNotFoundError" in err and "a pool of 2 envs failed" in err


def test_bench_per_envs_per_sandbox_prints_a_row_per_k_beside_async_vector_env():
    """Rows and columns, never speeds: a pool per k, then AsyncVectorEnv over the same Gymnasium id."""
    code, out, err = boltzlabs(
        "bench", "gym://CartPole-v1", "-n", "4", "--envs-per-sandbox", "1,2", "--steps", "6", "--rounds", "2"
    )
    assert code == 0, out + err
    lines = out.splitlines()
    header = [cell.strip() for cell in lines[0].split("|")[1:-1]]
    assert header == ["n", "k", "sandboxes", "env-steps/s", "CPU us/env-step", "envs/GiB", "/ AsyncVectorEnv"]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines[2:5]]
    assert [row[:3] for row in rows] == [["4", "1", "4"], ["4", "2", "2"], ["4", "async", "-"]]
    assert rows[2][5:] == ["-", "1.00x"]  # AsyncVectorEnv: no kernel accounting of its own; the reference
    for row in rows:
        assert float(row[3].replace(",", "")) > 0 and float(row[4]) > 0
    for row in rows[:2]:
        assert float(row[5].replace(",", "")) > 0 and row[6].endswith("x")
    assert lines[5] == "" and "medians of 2 round(s) taken in turns" in lines[6]
    assert f"cgroup {cgroups.version()}" in out


def test_bench_per_envs_per_sandbox_json_of_an_env_directory():
    """An env directory has no AsyncVectorEnv twin; a k past n is measured as n, once."""
    code, out, err = boltzlabs(
        "bench", COUNTER, "-n", "4", "--envs-per-sandbox", "1,2,4,8", "--steps", "6", "--rounds", "3", "--json"
    )
    assert code == 0, out + err
    report = json.loads(out)
    assert report["envs_per_sandbox"] == [1, 2, 4, 8] and report["rounds"] == 3
    results = report["results"]
    assert [(r["n"], r["k"], r["sandboxes"]) for r in results] == [(4, 1, 4), (4, 2, 2), (4, 4, 1)]
    for r in results:
        assert r["steps"] == 6 and r["rounds"] == 3 and len(r["rates"]) == 3 and r["failed_steps"] == 0
        assert r["env_steps_per_s"] > 0 and r["cpu_us_per_env_step"] > r["client_cpu_us_per_env_step"] > 0
        assert r["envs_per_gb"] > 0 and r["vs_async"] is None


def bench_rows(source, *options, rows: int = 4):
    """`boltzlabs bench source -n 4 ...options`'s output and its first rows' n, k and sandboxes."""
    code, out, err = boltzlabs("bench", source, "-n", "4", *options)
    assert code == 0, out + err
    table = [[cell.strip() for cell in line.split("|")[1:-1]] for line in out.splitlines()[2 : 2 + rows]]
    return out, [row[:3] for row in table]


def bench_results(source, n, *options):
    """`boltzlabs bench source -n n ...options --json`'s results."""
    code, out, err = boltzlabs("bench", source, "-n", str(n), *options, "--json")
    assert code == 0, out + err
    return json.loads(out)["results"]


def test_bench_pin_sandboxes_measures_each_k_placed_and_pinned_and_says_it():
    out, rows = bench_rows(COUNTER, "--envs-per-sandbox", "1,2", "--steps", "6", "--rounds", "2", "--pin-sandboxes")
    assert rows == [
        ["4", "1", "4"],
        ["4", "1 pinned", "4"],
        ["4", "2", "2"],
        ["4", "2 pinned", "2"],
    ]
    assert "k pinned: the same pool made with pin_sandboxes=True" in out
    results = bench_results(COUNTER, 4, "--envs-per-sandbox", "2", "--steps", "6", "--rounds", "1", "--pin-sandboxes")
    assert [(r["k"], r["pinned"]) for r in results] == [(2, False), (2, True)]
    assert bench_results(COUNTER, 2, "--steps", "6", "--pin-sandboxes")[0]["failed_steps"] == 0


def test_bench_eager_reset_measures_each_k_once_more_with_eager_resets_and_says_it():
    out, rows = bench_rows(
        "gym://CartPole-v1",
        "--envs-per-sandbox",
        "2",
        "--steps",
        "60",
        "--rounds",
        "2",
        "--pin-sandboxes",
        "--eager-reset",
    )
    assert rows == [
        ["4", "2", "2"],
        ["4", "2 pinned", "2"],
        ["4", "2 pinned eager", "2"],
        ["4", "async", "-"],
    ]
    assert "k eager: the same pool made with eager_reset=True" in out
    results = bench_results(COUNTER, 4, "--envs-per-sandbox", "2", "--steps", "6", "--rounds", "1", "--eager-reset")
    assert [(r["k"], r["pinned"], r["eager"]) for r in results] == [(2, False, False), (2, False, True)]
    assert bench_results(COUNTER, 2, "--steps", "6", "--eager-reset")[0]["failed_steps"] == 0


# -- doctor ------------------------------------------------------------------------------------


def test_doctor_timeout_bounds_each_trial_and_says_which_flag_gives_more():
    code, out, err = boltzlabs("doctor", "--timeout", "0.001")
    assert code == 1, out + err
    line = next(line for line in out.splitlines() if "bwrap sandbox" in line)
    assert line.startswith("FAIL") and "no answer within 0.001 s (doctor --timeout)" in line, out
    assert_no_traceback_of_ours(err)


def test_a_doctor_trial_cut_short_leaves_no_process():
    """A trial sandbox killed at doctor's --timeout in its first milliseconds: bwrap's child in the new
    pid namespace has not yet set its death signal and would wait for ever on bwrap's eventfd. The whole
    process group is killed, so nothing of any trial is left (a race: many short timeouts, most of them
    landing in bwrap's set-up)."""
    import shutil

    import psutil

    from boltzlabs.cli import doctor

    def trials() -> set:
        return {
            p.pid
            for p in psutil.process_iter(["name", "cmdline"])
            if p.info["name"] == "bwrap" and any("boltzlabs-doctor-" in a for a in p.info["cmdline"] or [])
        }

    before = trials()
    bwrap = shutil.which("bwrap")
    cut = 0
    try:
        for timeout in [0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.008, 0.01] * 25:
            findings = doctor._sandbox(bwrap, timeout)
            cut += "doctor --timeout" in findings[0].detail
        time.sleep(0.5)
        assert trials() - before == set()
        assert cut >= 100, cut  # the kill landed in most trials
    finally:
        for pid in trials() - before:
            os.kill(pid, signal.SIGKILL)


def test_doctor_passes_here_and_names_the_cgroup_version():
    code, out, err = boltzlabs("doctor", "--timeout", scaled(60))
    assert code == 0, out + err
    assert "FAIL" not in out
    assert f"cgroup {cgroups.version()}" in out
    for name in (
        "bwrap version",
        "bwrap mode",
        "user namespaces",
        "bwrap sandbox",
        "pool (spawn=template)",
        "pool (spawn=exec)",
        "memory cgroup",
        "pids cgroup",
        "freezer cgroup",
        "fd limit",
        "python",
        "packages",
    ):
        assert f"PASS  {name}" in out, name
    # Each PASS says what the kernel did when it was tried.
    assert "refused" in out.split("PASS  pids cgroup")[1].splitlines()[0]
    assert "froze and thawed" in out.split("PASS  freezer cgroup")[1].splitlines()[0]


def test_doctor_json():
    code, out, err = boltzlabs("doctor", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["ok"] is True
    names = {f["name"] for f in report["findings"]}
    assert {"bwrap version", "cgroup version", "fd limit", "memory cgroup"} <= names
    for finding in report["findings"]:
        assert set(finding) == {"name", "status", "detail", "fix"}
        assert finding["status"] in ("ok", "warn", "fail")
    assert any(
        f"cgroup {cgroups.version()}" in f["detail"] for f in report["findings"] if f["name"] == "cgroup version"
    )


@pytest.mark.parametrize("hidden", ["memory", "pids"])
def test_doctor_warns_for_each_cgroup_controller_it_cannot_use(hidden):
    """doctor tries each controller: a read-only hierarchy (the kernel refuses
    the writes) is a WARN naming what will not be enforced, never a PASS."""
    mount = cgroups.hierarchy(hidden)
    if hidden == "pids" and mount == cgroups.hierarchy("memory"):
        pytest.skip("cgroup v2: pids is in the memory's tree (tests/test_cgroups.py delegates memory without pids)")
    script = (
        f"mount --make-rprivate / && mount -o remount,bind,ro {mount} && "
        f"exec {sys.executable} -m boltzlabs doctor --json"
    )
    out = subprocess.run(
        ["unshare", "-m", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=scaled(300),
        env=dict(os.environ, PYTHONPATH=str(TESTS.parent)),
    )
    findings = {f["name"]: f for f in json.loads(out.stdout)["findings"]}
    pids = findings["pids cgroup"]
    assert pids["status"] == "warn" and "fork bomb is not bounded" in pids["detail"], pids
    if hidden == "memory":
        for name in ("memory cgroup", "freezer cgroup"):
            assert findings[name]["status"] == "warn", findings[name]
        detail = findings["memory cgroup"]["detail"]
        assert "PSS" in detail and "memory_limit is refused" in detail, detail
    else:
        assert findings["memory cgroup"]["status"] == "ok", findings["memory cgroup"]


def test_doctor_measures_what_each_memory_cgroup_costs_the_kernel():
    """The kernel's per-cgroup shrinker table is charged to no cgroup, so
    envs_per_gb() cannot include it; doctor measures it (docs/hard-reset.md)."""
    import re

    code, out, err = boltzlabs("doctor", "--json", "-n", "500")
    assert code == 0, err
    [finding] = [f for f in json.loads(out)["findings"] if f["name"] == "memory cgroup bookkeeping"]
    per_group = int(re.search(r"costs ~(\d+) KiB", finding["detail"]).group(1))
    assert per_group >= 0  # a real reading: kernel frees elsewhere can hide a small cost
    assert finding["status"] == ("warn" if per_group > 192 else "ok"), finding
    assert "at n=500" in finding["detail"]
    if finding["status"] == "warn":
        assert "reboot" in finding["fix"]


def test_bookkeeping_is_the_median_round_per_cgroup_and_warns_past_the_threshold(monkeypatch):
    """The arithmetic of the check, with the kernel's counter replaced: three
    rounds of 64 cgroups, the median round, a negative round read as 0."""
    from boltzlabs.cli import doctor

    for readings, expected, status in (
        ([0, 64 * 50, 0, 64 * 10, 0, -64 * 900], 10, "ok"),
        ([0, 64 * 300, 0, 64 * 250, 0, 64 * 400], 300, "warn"),
    ):
        values = iter(readings)
        monkeypatch.setattr(doctor, "_unreclaimable_kib", lambda: next(values))
        [finding] = doctor._memory_cgroup_bookkeeping(1000)
        assert f"costs ~{expected} KiB" in finding.detail and finding.status == status, finding
        assert f"~{expected * 1000 / 1024:.0f} MiB at n=1000" in finding.detail


def test_doctor_fails_without_bwrap_and_says_how_to_install_it():
    code, out, err = boltzlabs("doctor", env=dict(os.environ, PATH="/nonexistent"))
    assert code == 1, out + err
    assert "FAIL  bwrap" in out and "apt-get install -y bubblewrap" in out
    assert_no_traceback_of_ours(err)


def test_doctor_fails_when_the_fd_limit_is_too_low_for_the_pool():
    # More fds than the kernel lets any process have (fs.nr_open): no limit can be raised that far.
    nr_open = int(Path("/proc/sys/fs/nr_open").read_text())
    code, out, err = boltzlabs("doctor", "-n", nr_open // 3 + 1)
    assert code == 1, out + err
    assert "FAIL  fd limit" in out and "ulimit -n" in out


def test_bench_exits_1_when_lanes_fail():
    code, out, err = boltzlabs("bench", PROBE, "-n", "2", "--steps", "3", "--actions", '[{"op": "raise"}]')
    assert code == 1, out + err
    assert "| 2 |" in out  # the figures are still printed
    assert "lane step(s) failed at n=2" in err and "step failed on purpose" in err


def test_bench_shows_a_progress_bar_on_a_terminal(tmp_path):
    argv = [sys.executable, "-m", "boltzlabs", "bench", str(COUNTER), "-n", "2", "--steps", "30"]
    with open(tmp_path / "table", "w+") as table:
        text = on_terminal(argv, until="\0", timeout=HANG, stdout=table)  # read until it ends
        table.seek(0)
        out = table.read()
    assert "n=2" in text and "30/30" in text, repr(text[:300])
    assert "| 2 |" in out and "n=2" not in out  # the bar on stderr, the table on stdout
