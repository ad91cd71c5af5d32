"""RLPool(cpu_share=True): each sandbox one equal share of the CPU, all its processes together.

Real sandboxes and the kernel's own scheduler (v1's cpu hierarchy here; v2's cpu controller in
ci/v2guest.sh's guest), in both spawn modes. The share is measured, never timed: two lanes
contend in the same window, and the test compares the CPU each got (the sum of its processes'
/proc/<pid>/schedstat), a ratio that holds however loaded the machine is. A lane that starts
eight setsid spinners then gets what one honest lane gets, not eight times that; without
cpu_share it gets several times more (the kernel weighs each session, or each process, as one),
which is what shows the test can fail.
"""

import time
from pathlib import Path

import pytest

from boltzlabs import RLPool
from boltzlabs.host import cgroups
from boltzlabs.host.cgroups import PoolView
from conftest import scaled, wait_until, with_hierarchy_read_only

DAEMONS = 8
# "daemons": start DAEMONS spinners, each in a session of its own (setsid), and answer at once;
# a number: spin in the step for that many seconds of wall time.
SHARE_ENV = f"""
import os, time
from boltzlabs.env import serve


def reset(seed):
    return 0, {{}}


def step(action):
    if action == "daemons":
        for _ in range({DAEMONS}):
            if os.fork() == 0:
                os.setsid()
                while True:
                    pass
        return 0, 0.0, False, False, {{}}
    until = time.monotonic() + float(action)
    while time.monotonic() < until:
        pass
    return 0, 0.0, False, False, {{}}


serve(reset=reset, step=step)
"""


@pytest.fixture
def share_env(env_dir):
    return env_dir(SHARE_ENV)


def lane_cpu(view: PoolView, lane: int) -> float:
    """CPU seconds of every process of `lane` now (the sum of their schedstat run times)."""
    total = 0
    for pid in view.procs(lane):
        try:
            total += int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # gone meanwhile
    return total / 1e9


def contend(pool) -> float:
    """Lane 0 starts its spinners; then, while lane 1 spins in a step, the CPU lane 0's
    processes got over that of lane 1's, in the same window."""
    pool.reset(seed=0)
    view = PoolView(pool._cgroup)
    pool.step(["daemons", 0.0])
    assert wait_until(lambda: len(view.procs(0)) > DAEMONS)  # every spinner is up
    before = lane_cpu(view, 0), lane_cpu(view, 1)
    pool.step([0.0, 3.0])
    after = lane_cpu(view, 0), lane_cpu(view, 1)
    hog, honest = after[0] - before[0], after[1] - before[1]
    assert honest > 0, (hog, honest)
    return hog / honest


def test_a_lane_with_many_sessions_gets_one_share(pool_factory, share_env):
    pool = pool_factory(share_env, 2, cpu_share=True, step_timeout=scaled(60.0))
    assert pool.cpu_share is True
    ratio = contend(pool)
    # One share each, within the scheduler's slack; without cpu_share it is ~DAEMONS (below).
    assert ratio < 2.5, f"the lane with {DAEMONS} setsid spinners got {ratio:.1f}x the CPU of the honest lane"


def test_without_cpu_share_the_spinners_outweigh_the_honest_lane(pool_factory, share_env):
    pool = pool_factory(share_env, 2, step_timeout=scaled(60.0))
    assert pool.cpu_share is False
    ratio = contend(pool)
    assert ratio > 4, f"without cpu_share the spinners got only {ratio:.1f}x the honest lane's CPU"


def test_each_sandbox_has_a_cpu_group_of_its_own_and_close_removes_them(pool_factory, share_env):
    pool = pool_factory(share_env, 3, cpu_share=True)
    pool.reset(seed=0)
    pool.step(["daemons", 0.0, 0.0])
    view = PoolView(pool._cgroup)
    cpu_pool = view.pool("cpu")
    assert cpu_pool.is_dir()
    for lane in range(3):
        group = view.group(lane, "cpu")
        members = set(cgroups._procs(group))
        assert members and members == view.procs(lane), (lane, members, view.procs(lane))
    assert len(view.procs(0)) > DAEMONS  # the setsid spinners stayed in their lane's group
    # A hard reset respawns the lane into a group of the same kind.
    pool.reset(where=[0], hard=True, seed=0)
    assert set(cgroups._procs(view.group(0, "cpu"))) == view.procs(0) != set()
    pool.close()
    assert not cpu_pool.exists()


def test_a_grouped_and_a_sharded_pool_take_it(share_env):
    with RLPool(share_env, 4, envs_per_sandbox=2, cpu_share=True) as pool:
        assert pool.cpu_share is True
        pool.reset(seed=0)
        pool.step([0.0] * 4)
        view = PoolView(pool.inner._cgroup)  # a grouped pool's lanes are its sandboxes: its inner pool's
        assert set(cgroups._procs(view.group(0, "cpu"))) == view.procs(0) != set()
    with RLPool(share_env, 4, workers=2, cpu_share=True) as pool:
        assert pool.workers == 2 and pool.cpu_share is True
        pool.reset(seed=0)
        pool.step([0.0] * 4)


@pytest.mark.parametrize("value", [1, "yes", None])
def test_a_flag_that_is_not_a_bool_is_refused(value, share_env):
    with pytest.raises(TypeError, match="cpu_share must be True or False"):
        RLPool(share_env, 1, cpu_share=value)


def test_cpu_share_is_an_option_not_an_env_param(share_env):
    # A misspelling is refused naming the option, never passed to the env as a param.
    with pytest.raises(TypeError, match="did you mean 'cpu_share'"):
        RLPool(share_env, 2, cpu_shares=True)


def test_the_gymnasium_adapter_takes_it_as_a_pool_option(env_dir):
    pytest.importorskip("gymnasium")
    from boltzlabs.gym import BoltzLabsVecEnv

    source = env_dir("""
        import gymnasium
        from boltzlabs.env import serve
        serve(reset=lambda seed: 0, step=lambda a: (0, 1.0, False, False, {}),
              observation_space=gymnasium.spaces.Discrete(2), action_space=gymnasium.spaces.Discrete(2))
    """)
    envs = BoltzLabsVecEnv.make(str(source), num_envs=2, cpu_share=True)
    try:
        assert envs.pool.cpu_share is True
        envs.reset(seed=0)
        view = PoolView(envs.pool._cgroup)
        assert set(cgroups._procs(view.group(1, "cpu"))) == view.procs(1) != set()
    finally:
        envs.close()


REFUSED = """
import sys
sys.path.insert(0, {root!r})
from boltzlabs import RLPool
try:
    RLPool({source!r}, 1, cpu_share=True).close()
except ValueError as exc:
    print(exc)
else:
    print("started")
"""


def test_without_a_cpu_hierarchy_it_is_refused(share_env):
    # A private mount namespace where the v1 cpu hierarchy is read-only: the kernel, not a mock,
    # refuses the worker's mkdir, and the pool says what it needs.
    mount = cgroups.hierarchy("cpu")
    if mount is None or cgroups.version() != "v1" or mount == cgroups.hierarchy("memory"):
        pytest.skip("no cgroup v1 cpu hierarchy of its own here")
    code = REFUSED.format(root=str(Path(__file__).parent.parent), source=str(share_env))
    said = with_hierarchy_read_only(mount, code)
    assert said.startswith("cpu_share needs a cgroup of the cpu controller per env"), said
    assert "cpu" in said and "Delegate=yes" in said


def test_the_share_ends_with_the_pool(share_env):
    # Nothing of the spinners outlives close(): their groups are killed and removed.
    pool = RLPool(share_env, 2, cpu_share=True)
    pool.reset(seed=0)
    pool.step(["daemons", 0.0])
    view = PoolView(pool._cgroup)
    spinners = view.procs(0)
    assert len(spinners) > DAEMONS
    pool.close()
    deadline = time.monotonic() + scaled(30)
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in spinners):
        time.sleep(0.05)
    assert not any(Path(f"/proc/{pid}").exists() for pid in spinners)
