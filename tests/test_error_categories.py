"""Each category of the worker's ERROR frames reaches the caller as its one exception, with the worker's
account as the cause (boltzlabs/errors.py: CATEGORIES; docs/wire.md, "Errors").

A category is decided in the worker, where the fault is known: the caller's mistake is a ValueError or
TypeError, the policy's a PolicyError, the host's a SandboxUnavailable, the worker's own fault (a KeyError
or IndexError included) a WorkerError. A start failure says whether the sandbox's own set-up failed by
the env's exit code (abi.SET_UP_EXIT), never by reading its traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from boltzlabs import RLPool, abi, wire
from boltzlabs.errors import (
    CATEGORIES,
    EnvStartError,
    HOST,
    INTERNAL,
    POLICY,
    PROTOCOL,
    START,
    USAGE,
    USAGE_TYPE,
    PolicyError,
    SandboxUnavailable,
    StartFailure,
    WorkerError,
    WorkerSideError,
    category_of,
    describe_exit,
)
from boltzlabs.pool.client import _error, _error_parts, _start_error
from boltzlabs.pool.sources import Source

from conftest import COUNTER

ROOT = Path(__file__).resolve().parent.parent


def _cause(exc: BaseException, category: str) -> WorkerSideError:
    cause = exc.__cause__
    assert isinstance(cause, WorkerSideError) and cause.kind == category, (exc, cause)
    return cause


def test_the_categories_are_decided_by_the_fault_not_the_name():
    assert category_of(ValueError("bad")) == USAGE
    assert category_of(TypeError("bad")) == USAGE_TYPE
    assert category_of(KeyError("log_tail")) == INTERNAL  # a worker's bug, never the caller's ValueError
    assert category_of(IndexError("list index out of range")) == INTERNAL
    assert category_of(UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad")) == INTERNAL
    assert category_of(PolicyError("[identity] uid must be ...")) == POLICY
    assert category_of(SandboxUnavailable("no bwrap")) == HOST
    assert category_of(StartFailure(0, "env 0 failed", "", 1)) == START
    assert len(set(CATEGORIES)) == len(CATEGORIES)


def test_an_internal_fault_carries_its_traceback_and_a_start_failure_its_set_up_flag_and_limit():
    try:
        {}["log_tail"]
    except KeyError as exc:
        frame = wire.error_frame(7, exc)
    assert frame[:3] == [wire.ERROR, 7, INTERNAL] and "Traceback" in frame[4]["traceback"]
    frame = wire.error_frame(0, StartFailure(2, "env 2 failed to start", "log", 3, set_up=True, limit="pids"))
    assert frame == [
        wire.ERROR,
        0,
        START,
        "env 2 failed to start",
        {"env": 2, "log": "log", "failed": 3, "set_up": True, "limit": "pids"},
    ]


@pytest.mark.parametrize(
    "detail",
    [
        {},
        {"env": "0; rm -rf", "failed": [1], "log": 5, "limit": ["pids"], "set_up": "yes"},
        {"env": 10**30, "failed": "3", "log": "x" * (1 << 20), "limit": {"pids": 1}},
        {"env": -1, "failed": None, "log": None, "limit": None},
    ],
)
def test_a_start_failure_whose_detail_is_malformed_is_still_a_clear_start_error(detail):
    """A remote worker's START detail is input: a missing or mistyped field is no KeyError or
    TypeError in the client, and a huge log is cut."""
    resolved = Source(env_dir=Path("/nonexistent"), params={}, name="env")
    config = {"source_dir": "/nonexistent", "params": {"kwargs": {}}}
    error = _start_error("env 0 failed to start: died", detail, config, resolved, 4)
    assert isinstance(error, EnvStartError) and error.env_index is None
    assert str(error).startswith("env 0 failed to start: died.") and "Fix the error in /nonexistent/env.py" in str(
        error
    )
    assert len(error.log) <= 1 << 16


@pytest.mark.parametrize(
    "message",
    [
        [wire.ERROR, 0, "KeyError", "'x'", {}],  # a class name is no category: the worker's fault
        [wire.ERROR, 0, USAGE, b"\xff" * 10, []],  # a hostile remote worker's frame
        [wire.ERROR, 0],
    ],
)
def test_a_frame_of_no_known_category_is_the_workers_fault(message):
    category, text, detail = _error_parts(message)
    assert category == INTERNAL and isinstance(text, str) and detail == {} or category == USAGE
    assert isinstance(_error(INTERNAL, text, "the worker failed x()"), WorkerError)


@pytest.mark.sandbox
def test_each_category_reaches_the_caller_as_its_exception_with_the_cause():
    with RLPool(COUNTER, 1) as pool:
        with pytest.raises(ValueError, match=r"step\(\) needs 1 actions") as err:
            pool._call("step", [1, 2, 3])  # past the client's own check: the worker's
        _cause(err.value, USAGE)
        with pytest.raises(WorkerError, match=r"the worker failed log\(\): internal error") as err:
            pool._call("log", 10**6)  # an unchecked index in the worker: its fault, not the caller's
        assert not isinstance(err.value, ValueError) and err.value.kind == INTERNAL
        assert "IndexError" in _cause(err.value, INTERNAL).text
        with pytest.raises(WorkerError, match=r"protocol error") as err:
            pool._call("no_such_call")
        _cause(err.value, PROTOCOL)
        pool.reset()  # the pool goes on after each
    with pytest.raises(TypeError, match=r"limits must be a dict") as err:
        RLPool(COUNTER, 1, limits=5)
    _cause(err.value, USAGE_TYPE)


@pytest.mark.sandbox
def test_a_policy_error_is_the_policys(tmp_path, monkeypatch):
    text = (ROOT / "sandbox" / "policy.toml").read_text()
    head, identity = text.split("\n[identity]\n", 1)
    assert "\nuid = 0\n" in identity.split("\n[", 1)[0]
    bad = tmp_path / "policy.toml"
    bad.write_text(head + "\n[identity]\n" + identity.replace("\nuid = 0\n", "\nuid = -5\n", 1))
    monkeypatch.setenv("BOLTZLABS_POLICY", str(bad))
    with pytest.raises(PolicyError, match=r"\[identity\] uid must be") as err:
        RLPool(COUNTER, 1)
    assert isinstance(err.value, SandboxUnavailable)  # what `except SandboxUnavailable` caught before
    _cause(err.value, POLICY)


@pytest.mark.sandbox
def test_a_host_that_lacks_bubblewrap_is_the_hosts(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # the worker finds no bwrap
    with pytest.raises(SandboxUnavailable, match=r"bubblewrap \(bwrap\) is not installed") as err:
        RLPool(COUNTER, 1)
    assert not isinstance(err.value, PolicyError)
    _cause(err.value, HOST)


def test_a_set_up_that_fails_exits_with_its_own_code():
    """exec mode's set-up (runtime/confine.main) with no plan: its traceback, then abi.SET_UP_EXIT,
    which the worker reads as "the sandbox's fault" (StartFailure.set_up)."""
    env = {k: v for k, v in os.environ.items() if k != abi.CONFINE_VARIABLE}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-c", "import boltzlabs.runtime.confine as m; m.main(['env.py'])"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == abi.SET_UP_EXIT, out
    assert "Traceback" in out.stderr and abi.CONFINE_VARIABLE in out.stderr
    assert "the sandbox's own set-up failed" in describe_exit(out.returncode)


def test_one_rendering_of_how_a_process_died():
    assert describe_exit(-9) == "was killed by SIGKILL (signal 9)"
    assert describe_exit(128 + 11) == "was killed by SIGSEGV (signal 11) (exit code 139)"
    assert describe_exit(3) == "exited with code 3"
    assert "without calling serve()" in describe_exit(abi.NO_SERVE_EXIT)


def test_sandbox_tests_skip_with_the_reason_where_there_is_no_bubblewrap(tmp_path):
    """The `sandbox` marker (tests/conftest.py): on a host without bwrap a pool test is skipped, and says
    why; a test of a file that builds no sandbox (NO_SANDBOX) still runs."""
    env = dict(os.environ, PATH=str(tmp_path), PYTHONPATH=str(ROOT))
    env.pop("BOLTZLABS_REQUIRE_SANDBOX", None)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "tests/test_error_categories.py::test_a_policy_error_is_the_policys",
            "tests/test_wire.py::test_the_table_check_catches_a_repeated_code",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed, 1 skipped" in out.stdout, out.stdout
    assert "needs a sandbox: bubblewrap (bwrap) is not on PATH" in out.stdout, out.stdout
    # Where sandboxes must be built (ci/test.sh sets BOLTZLABS_REQUIRE_SANDBOX), the same test fails.
    env["BOLTZLABS_REQUIRE_SANDBOX"] = "1"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/test_error_categories.py::test_a_policy_error_is_the_policys",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )
    assert out.returncode == 1 and "BOLTZLABS_REQUIRE_SANDBOX is set" in out.stdout, out.stdout
