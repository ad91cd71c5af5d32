"""The fault matrix: each fault an env can commit, alone and all in one step.

Every step returns n results in lane order; a failed lane is done with
reward 0 and `info["error"]` naming the cause; the other lanes are untouched
and the pool goes on.
"""

import time

import numpy as np
import pytest

FAULTS = {
    "sleep": ({"op": "sleep", "s": 30}, "missed the step deadline"),
    "raise": ({"op": "raise"}, "ValueError: step failed on purpose"),
    "exit": ({"op": "exit", "code": 3}, "exited with code 3"),
    # serve() was called: never "returned without calling serve()" (NO_SERVE_EXIT)
    "sys_exit": ({"op": "sys_exit", "code": 0}, "exited with code 0"),
    "segfault": ({"op": "segv"}, "SIGSEGV"),
    "loop": ({"op": "loop"}, "missed the step deadline"),
    "garbage": ({"op": "garbage", "fd": 3}, "invalid frame"),
    "bad_return": ({"op": "bad_return"}, "TypeError: step() returned str"),
}


def assert_healthy_lane(obs, rewards, dones, infos, i, reward=1.0):
    assert rewards[i] == reward
    assert "error" not in infos[i], infos[i]
    assert obs[i]["t"] >= 1


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_each_fault_alone(probe_pool, fault):
    action, expected = FAULTS[fault]
    pool = probe_pool(3, step_timeout=1.0)
    pool.reset(seed=0)
    started = time.monotonic()
    obs, rewards, dones, infos = pool.step([1, action, 1])
    assert time.monotonic() - started < 10
    assert len(obs) == len(infos) == 3
    assert rewards.dtype == np.float32 and dones.dtype == np.bool_
    assert dones[1] and rewards[1] == 0.0 and obs[1] is None
    assert expected in infos[1]["error"], infos[1]
    assert infos[1].get("straggler", False) == (fault in ("sleep", "loop"))
    assert pool.timing.stragglers == ([1] if fault in ("sleep", "loop") else [])
    for i in (0, 2):
        assert_healthy_lane(obs, rewards, dones, infos, i)
        assert not dones[i]
    # The failed lane comes back at its next reset; the others never noticed.
    pool.reset(where=[1], seed=5)
    assert "error" not in pool.reset_infos[1]
    obs, rewards, dones, infos = pool.step([1, 1, 1])
    for i in range(3):
        assert_healthy_lane(obs, rewards, dones, infos, i)


def test_all_faults_in_one_step(probe_pool):
    names = sorted(FAULTS)
    n = len(names) + 2
    pool = probe_pool(n, step_timeout=1.5)
    pool.reset(seed=0)
    actions = [1] + [FAULTS[name][0] for name in names] + [1]
    obs, rewards, dones, infos = pool.step(actions)
    assert len(obs) == n
    for lane, name in enumerate(names, start=1):
        assert dones[lane] and rewards[lane] == 0.0, name
        assert FAULTS[name][1] in infos[lane]["error"], (name, infos[lane])
    assert_healthy_lane(obs, rewards, dones, infos, 0)
    assert_healthy_lane(obs, rewards, dones, infos, n - 1)
    pool.reset(where=dones, seed=1)
    obs, rewards, dones, infos = pool.step([2] * n)
    assert (rewards == 2.0).all() and not dones.any(), infos


def test_exception_keeps_env_alive_with_traceback(probe_pool):
    pool = probe_pool(1)
    pool.reset(seed=0)
    pid = pool.pids()[0]
    _, _, dones, infos = pool.step([{"op": "raise"}])
    assert dones[0]
    assert "Traceback" in infos[0]["error"] and "step failed on purpose" in infos[0]["error"]
    assert pool.states() == ["idle"] and pool.pids()[0] == pid  # same process, still serving
    obs, rewards, _, _ = pool.step([1])  # even without a reset
    assert rewards[0] == 1.0


def test_exception_in_reset_is_reported_on_its_lane(probe_pool):
    pool = probe_pool(2)
    pool.reset(seed=0, options={"raise": True}, where=[1])
    assert "reset failed on purpose" in pool.reset_infos[1]["error"]
    assert pool.states() == ["idle", "idle"]


def test_straggler_late_reply_is_discarded_then_killed_at_reset(probe_pool):
    pool = probe_pool(2, step_timeout=0.5)
    pool.reset(seed=0)
    _, _, dones, infos = pool.step([1, {"op": "sleep", "s": 1.0}])
    assert infos[1]["straggler"] and pool.timing.stragglers == [1]
    # Still busy: the next step does not queue behind it; it is a straggler again at once.
    obs, rewards, dones, infos = pool.step([1, 1])
    assert infos[1]["straggler"] and dones[1] and "still busy" in infos[1]["error"]
    time.sleep(1.0)
    # Its late reply arrived meanwhile and was dropped: the lane is usable, the old
    # result never shows up in a later step.
    obs, rewards, dones, infos = pool.step([1, 1])
    assert rewards[1] == 1.0 and "slept" not in str(obs[1])
    # A straggler that has still not answered at its reset is killed and respawned.
    pool.step([1, {"op": "sleep", "s": 30}])
    old_pid = pool.pids()[1]
    pool.reset(where=[1], seed=0)
    assert pool.pids()[1] != old_pid and "error" not in pool.reset_infos[1]
    obs, rewards, dones, infos = pool.step([1, 1])
    assert rewards.tolist() == [1.0, 1.0]


def test_dead_env_is_reported_until_reset(probe_pool):
    pool = probe_pool(2)
    pool.reset(seed=0)
    pool.step([1, {"op": "exit", "code": 7}])
    assert pool.states()[1] == "dead"
    _, rewards, dones, infos = pool.step([1, 1])
    assert dones[1] and "exited with code 7" in infos[1]["error"] and "reset it" in infos[1]["error"]
    pool.reset(where=np.array([False, True]), seed=0)
    assert pool.states() == ["idle", "idle"]


def test_stray_output_goes_to_the_log_not_the_channel(probe_pool):
    pool = probe_pool(1)
    pool.reset(seed=0)
    obs, rewards, dones, infos = pool.step([{"op": "print"}])
    assert obs[0]["out"] == {"printed": True} and "error" not in infos[0]
    log = pool.log(0)
    for text in (
        "probe env importing",
        "raw write at import",
        "reset called",
        "hello from step",
        "more stray output",
        "raw fd 1 write",
        "raw fd 2 write",
    ):
        assert text in log


def test_output_flood_is_bounded(probe_pool):
    pool = probe_pool(2, step_timeout=20)
    pool.reset(seed=0)
    obs, rewards, dones, infos = pool.step([{"op": "flood", "mb": 64}, 1])
    assert obs[0]["out"] == {"flooded": 64}
    assert rewards[1] == 1.0
    own = pool.log(0).split("--- env 0 ---\n")[-1]  # template mode prefixes the template's output
    assert len(own) <= 65536 and own.endswith("x")


def test_garbage_on_any_fd_never_disturbs_others(probe_pool):
    pool = probe_pool(4)
    pool.reset(seed=0)
    actions = [{"op": "garbage", "fd": 1}, {"op": "garbage", "fd": 2}, {"op": "garbage", "fd": 3}, 1]
    obs, rewards, dones, infos = pool.step(actions)
    assert obs[0]["out"] == {"garbage": True} and obs[1]["out"] == {"garbage": True}
    assert "invalid frame" in infos[2]["error"]
    assert rewards[3] == 1.0 and "error" not in infos[3]
