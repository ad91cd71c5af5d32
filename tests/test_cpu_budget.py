"""RLPool(cpu_budget=): a lane whose step spins burns its own budget, not the node's.

Real sandboxes, real cgroup accounting (v1's cpuacct here; v2's cpu.stat in ci/v2guest.sh's
guest), in both spawn modes. Each test asserts the outcome, never a timing: a lane over its
budget comes back killed with info["cpu_budget"], every other lane answers with its own data in
the same call, and the step returns long before step_timeout (the hang bound). What is metered
(from a step's send until the lane's next step or reset, every process of its sandbox) is
docs/limits.md#cpu-budget.
"""

import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from boltzlabs import RLPool
from boltzlabs.host import cgroups
from boltzlabs.host.cgroups import PoolView, cpu_list_count
from conftest import gone, scaled, wait_until, with_hierarchy_read_only

# Spins in its step, in children it forks, or in a daemon it leaves behind; a number is an honest
# step that sleeps that long (no CPU) and answers with its own lane, so a test can tell whose data
# came back.
SPIN_ENV = """
import os, signal, time
from boltzlabs.env import serve

LANE = int(os.environ.get("BOLTZLABS_ENV_INDEX", "-1"))


def spin():
    while True:
        pass


def daemon():
    # Double-forked into a session of its own, deaf to the usual signals: no process tree,
    # session or process group of the env holds it.
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)
            spin()
        os._exit(0)
    os.wait()


def escape():
    # What an env might try to leave its cgroup's accounting: write itself into another
    # cgroup (no cgroup filesystem is mounted in the sandbox), widen its affinity; then a daemon.
    tried = {}
    for path in ("/sys/fs/cgroup/cgroup.procs", "/sys/fs/cgroup/cpuacct/cgroup.procs"):
        try:
            with open(path, "w") as f:
                f.write(str(os.getpid()))
            tried[path] = "written"
        except OSError as exc:
            tried[path] = type(exc).__name__
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
        tried["affinity"] = len(os.sched_getaffinity(0))
    except OSError as exc:
        tried["affinity"] = type(exc).__name__
    with open("/proc/self/cgroup") as f:
        tried["cgroup"] = f.read()
    daemon()
    return tried


def reset(seed):
    return {"lane": LANE}


def step(action):
    if action == "spin":
        spin()
    if action == "fork":  # the daemon first: nothing waits once the 4 spinners run
        daemon()
        for _ in range(4):
            if os.fork() == 0:
                spin()
    if action == "escape":
        return {"lane": LANE, "tried": escape()}, 0.0, False, {}
    if isinstance(action, dict):  # {"burn": s}: s seconds of this process's CPU, then the reply
        end = time.process_time() + action["burn"]
        while time.process_time() < end:
            pass
    elif action != "fork" and action > 0:
        time.sleep(action)
    return {"lane": LANE, "echo": action}, float(LANE), False, {"lane": LANE}


serve(reset=reset, step=step)
"""

BUDGET = 0.5  # CPU seconds: a spinner passes it in ~0.5 s of a free core; an honest step uses ~1 ms
HANG = scaled(60.0)  # step_timeout: only a hang comes near it


def assert_own(obs, rewards, infos, actions, skip=()):
    """Every lane not in `skip` answered with its own lane and action."""
    for i, action in enumerate(actions):
        if i in skip:
            continue
        assert obs[i] == {"lane": i, "echo": action}, (i, obs[i], infos[i])
        assert rewards[i] == float(i) and infos[i] == {"lane": i}, (i, infos[i])


def assert_over_budget(obs, rewards, dones, infos, i, where="in this step"):
    assert infos[i].get("cpu_budget") is True, infos[i]
    assert f"of CPU {where}, over its cpu_budget of {BUDGET:g} s" in infos[i]["error"], infos[i]
    assert obs[i] is None and rewards[i] == 0.0 and dones[i], (obs[i], rewards[i], dones[i])
    assert "straggler" not in infos[i], infos[i]


@pytest.fixture
def spin_env(env_dir):
    return env_dir(SPIN_ENV)


def test_a_spinning_step_is_killed_at_its_budget_and_the_others_answer(pool_factory, spin_env):
    pool = pool_factory(spin_env, 3, cpu_budget=BUDGET, step_timeout=HANG)
    assert pool.cpu_budget == BUDGET and pool.fast_path is False  # the pure step path meters each reply
    pool.reset(seed=0)
    started = time.monotonic()
    obs, rewards, dones, infos = pool.step([0, "spin", 0.2])
    assert time.monotonic() - started < HANG / 2  # killed at its budget, not at the deadline
    assert_over_budget(obs, rewards, dones, infos, 1)
    assert_own(obs, rewards, infos, [0, None, 0.2], skip={1})
    assert pool.truncated[1] and not pool.truncated[0] and not pool.truncated[2]
    assert pool.states()[1] == "dead" and wait_until(lambda: not PoolView(pool._cgroup).procs(1))  # its whole cgroup
    # Dead until its reset, and said so on its lane with the cause; then it steps again.
    obs, rewards, dones, infos = pool.step([1, 2, 3])
    assert infos[1]["cpu_budget"] is True and infos[1]["error"].startswith("env is dead (used "), infos[1]
    assert_own(obs, rewards, infos, [1, None, 3], skip={1})
    pool.reset(where=[1], seed=0)
    obs, rewards, dones, infos = pool.step([1, 2, 3])
    assert_own(obs, rewards, infos, [1, 2, 3])


def test_a_step_that_burns_past_its_budget_and_replies_is_failed_not_taken(pool_factory, spin_env):
    # Whether the worker's check or the reply comes first, the reply of a step over its budget is
    # never taken: the outcome does not depend on when the worker looked.
    pool = pool_factory(spin_env, 2, cpu_budget=BUDGET, step_timeout=HANG)
    pool.reset(seed=0)
    obs, rewards, dones, infos = pool.step([0, {"burn": BUDGET * 1.5}])
    assert_over_budget(obs, rewards, dones, infos, 1)
    assert_own(obs, rewards, infos, [0, None], skip={1})
    # Under it, the reply stands.
    pool.reset(where=[1], seed=0)
    obs, rewards, dones, infos = pool.step([0, {"burn": BUDGET / 10}])
    assert obs[1] == {"lane": 1, "echo": {"burn": BUDGET / 10}} and infos[1] == {"lane": 1}


def test_children_and_a_daemon_a_step_leaves_spinning_are_charged_in_the_next_step(pool_factory, spin_env):
    # The step forks 4 spinners and a setsid daemon, then replies at once: under budget. They spin
    # on; the next step sleeps (no CPU of its own) and is charged for them: every process of the
    # sandbox counts, and the kill takes them all.
    pool = pool_factory(spin_env, 2, cpu_budget=BUDGET, step_timeout=HANG)
    pool.reset(seed=0)
    obs, rewards, dones, infos = pool.step([0, "fork"])
    assert_own(obs, rewards, infos, [0, "fork"])
    spinners = PoolView(pool._cgroup).procs(1)
    assert len(spinners) >= 6, spinners  # the env, 4 children, the daemon
    started = time.monotonic()
    obs, rewards, dones, infos = pool.step([0.2, HANG])
    assert time.monotonic() - started < HANG / 2
    assert_over_budget(obs, rewards, dones, infos, 1)
    assert_own(obs, rewards, infos, [0.2, None], skip={1})
    assert wait_until(lambda: gone(spinners)), [p for p in spinners if psutil.pid_exists(p)]


def test_what_a_step_leaves_spinning_is_killed_while_the_trainer_does_not_call(pool_factory, spin_env):
    # The window of a step lasts until the lane's next step: spinners left behind are charged to
    # it while the lane idles, and killed there with no call; the next step says why.
    pool = pool_factory(spin_env, 2, cpu_budget=BUDGET, step_timeout=HANG)
    pool.reset(seed=0)
    pool.step([0, "fork"])
    spinners = PoolView(pool._cgroup).procs(1)
    assert wait_until(lambda: pool.states()[1] == "dead", timeout=30)
    assert wait_until(lambda: gone(spinners))
    obs, rewards, dones, infos = pool.step([1, 1])
    assert infos[1]["cpu_budget"] is True, infos[1]
    assert "since its last step was sent, over its cpu_budget" in infos[1]["error"], infos[1]
    assert_own(obs, rewards, infos, [1, None], skip={1})


def test_an_env_that_tries_to_leave_its_accounting_is_still_charged(pool_factory, spin_env):
    pool = pool_factory(spin_env, 2, cpu_budget=BUDGET, step_timeout=HANG)
    pool.reset(seed=0)
    obs, _, _, infos = pool.step([0, "escape"])
    tried = obs[1]["tried"]
    # No cgroup filesystem inside; its own cgroup namespace shows it at its root.
    assert (
        tried["/sys/fs/cgroup/cgroup.procs"] != "written" and tried["/sys/fs/cgroup/cpuacct/cgroup.procs"] != "written"
    )
    assert all(line.endswith(":/") for line in tried["cgroup"].splitlines()), tried["cgroup"]
    daemon = PoolView(pool._cgroup).procs(1)
    assert wait_until(lambda: pool.states()[1] == "dead", timeout=30)
    assert wait_until(lambda: gone(daemon))
    _, _, _, infos = pool.step([0, 0])
    assert infos[1]["cpu_budget"] is True, infos[1]


def test_async_send_recv_reports_the_budget_on_its_lane(pool_factory, spin_env):
    pool = pool_factory(spin_env, 3, cpu_budget=BUDGET, step_timeout=HANG)
    pool.reset(seed=0)
    started = time.monotonic()
    pool.send([0.1, "spin", 0.2])
    got = pool.recv()
    assert time.monotonic() - started < HANG / 2
    env_ids, obs, rewards, dones, infos = got
    by_lane = {int(i): k for k, i in enumerate(env_ids)}
    k = by_lane[1]
    assert infos[k]["cpu_budget"] is True and "in this step, over its cpu_budget" in infos[k]["error"], infos[k]
    assert obs[k] is None and rewards[k] == 0.0 and dones[k]
    for lane, action in ((0, 0.1), (2, 0.2)):
        k = by_lane[lane]
        assert obs[k] == {"lane": lane, "echo": action} and infos[k] == {"lane": lane}
    # Sent to again while dead: refused on its lane, with the cause.
    pool.send([1], env_ids=[1])
    _, _, _, _, infos = pool.recv()
    assert infos[0]["cpu_budget"] is True and infos[0]["error"].startswith("env is dead")


def test_serialize_measurement_with_a_budget(pool_factory, spin_env):
    pool = pool_factory(spin_env, 3, cpu_budget=BUDGET, step_timeout=HANG, serialize_measurement=True)
    pool.reset(seed=0)
    started = time.monotonic()
    obs, rewards, dones, infos = pool.step([0, "spin", 0.1])
    assert time.monotonic() - started < HANG / 2  # the gate moved on once the holder was killed
    assert_over_budget(obs, rewards, dones, infos, 1)
    assert_own(obs, rewards, infos, [0, None, 0.1], skip={1})
    pool.send([0, "spin", 0.1])
    env_ids, obs, _, _, infos = pool.recv()
    k = list(env_ids).index(1)
    assert infos[k]["cpu_budget"] is True and obs[k] is None


def test_a_grouped_pool_fails_the_spinning_members_whole_group(spawn, spin_env):
    # envs_per_sandbox=2: the budget bounds each sandbox as a whole (both its envs' steps).
    with RLPool(spin_env, 4, envs_per_sandbox=2, cpu_budget=BUDGET, step_timeout=HANG, spawn=spawn) as pool:
        assert pool.cpu_budget == BUDGET
        pool.reset(seed=0)
        obs, rewards, dones, infos = pool.step([0, "spin", 0.1, 0.2])
        for i in (0, 1):
            assert infos[i]["cpu_budget"] is True and infos[i]["group"] == 0, infos[i]
            assert "over its cpu_budget" in infos[i]["error"] and "every env of it fails" in infos[i]["error"]
            assert obs[i] is None and rewards[i] == 0.0 and dones[i]
        # The other sandbox's envs: their own data.
        assert obs[2] == {"lane": 2, "echo": 0.1} and obs[3] == {"lane": 3, "echo": 0.2}, obs
        pool.reset(seed=0)
        obs, _, _, infos = pool.step([0, 0, 0, 0])
        assert not any("error" in (info or {}) for info in infos), infos


def test_a_sharded_pool_keeps_the_budget_on_each_shards_lanes(spin_env):
    with RLPool(spin_env, 4, workers=2, cpu_budget=BUDGET, step_timeout=HANG) as pool:
        assert pool.workers == 2 and pool.cpu_budget == BUDGET
        pool.reset(seed=0)
        obs, rewards, dones, infos = pool.step([0, 0.1, 0, "spin"])
        assert_over_budget(obs, rewards, dones, infos, 3)
        # (An env's BOLTZLABS_ENV_INDEX is its index in its shard.)
        assert obs[:3] == [{"lane": 0, "echo": 0}, {"lane": 1, "echo": 0.1}, {"lane": 0, "echo": 0}], obs


def test_honest_lanes_are_never_killed_over_many_steps(pool_factory, spin_env):
    # A budget far above what a step costs: no lane fails, over many sync and async steps.
    pool = pool_factory(spin_env, 4, cpu_budget=2.0, step_timeout=HANG)
    pool.reset(seed=0)
    for t in range(150):
        actions = [0, 0, 0, {"burn": 0.002}] if t % 10 else [0.01, 0, 0, 0]
        obs, rewards, dones, infos = pool.step(actions)
        assert_own(obs, rewards, infos, actions)
    for _ in range(50):
        pool.send([0, 0, 0, 0])
        env_ids, obs, _, _, infos = pool.recv()
        assert sorted(o["lane"] for o in obs) == [0, 1, 2, 3] and all(
            i == {"lane": o["lane"]} for o, i in zip(obs, infos)
        )
    assert pool.states() == ["idle"] * 4


@pytest.mark.parametrize("budget", [0, -1.0, True, "1", float("nan"), float("inf"), [1]])
def test_bad_cpu_budgets_are_refused_before_any_sandbox_starts(budget, spin_env):
    before = set(psutil.Process().children(recursive=True))
    with pytest.raises(ValueError, match="cpu_budget must be a positive, finite number of CPU seconds"):
        RLPool(spin_env, 2, cpu_budget=budget)
    assert set(psutil.Process().children(recursive=True)) <= before  # no worker was started


@pytest.mark.parametrize("kind", [{"workers": 2}, {"envs_per_sandbox": 2}])
def test_bad_cpu_budgets_are_refused_by_sharded_and_grouped_pools_too(kind, spin_env):
    before = set(psutil.Process().children(recursive=True))
    with pytest.raises(ValueError, match="cpu_budget must be a positive, finite number of CPU seconds"):
        RLPool(spin_env, 4, cpu_budget=0, **kind)
    assert set(psutil.Process().children(recursive=True)) <= before


def test_cpu_budget_is_an_option_not_an_env_param(spin_env):
    # A misspelling is refused naming the option, never passed to the env as a param.
    with pytest.raises(TypeError, match="did you mean 'cpu_budget'"):
        RLPool(spin_env, 2, cpu_budgt=1.0)


GYM_SPIN = """
import gymnasium
from boltzlabs.env import serve

def reset(seed):
    return 0

def step(action):
    while action == 1:
        pass
    return 0, 1.0, False, False, {}

serve(reset=reset, step=step, observation_space=gymnasium.spaces.Discrete(2),
      action_space=gymnasium.spaces.Discrete(2))
"""


def test_the_gymnasium_adapter_takes_it_as_a_pool_option(env_dir):
    pytest.importorskip("gymnasium")
    from boltzlabs.gym import BoltzLabsVecEnv

    envs = BoltzLabsVecEnv.make(str(env_dir(GYM_SPIN)), num_envs=2, cpu_budget=BUDGET, step_timeout=HANG)
    try:
        assert envs.pool.cpu_budget == BUDGET
        envs.reset(seed=0)
        _, rewards, terminations, truncations, infos = envs.step(np.array([0, 1]))
        assert rewards.tolist() == [1.0, 0.0] and truncations.tolist() == [False, True], infos
        assert infos["cpu_budget"][1] and infos["_cpu_budget"].tolist() == [False, True], infos
    finally:
        envs.close()


REFUSED = """
import sys
sys.path.insert(0, {root!r})
from boltzlabs import RLPool
try:
    RLPool({source!r}, 1, cpu_budget=1.0, spawn="exec")
except ValueError as exc:
    print(exc)
else:
    print("started")
"""


@pytest.mark.parametrize("hierarchy", ["memory", "cpuacct"])
def test_without_a_cgroup_that_counts_cpu_a_budget_is_refused(hierarchy, spin_env):
    # A private mount namespace where the hierarchy is read-only: the kernel, not a mock, refuses
    # the worker's writes. With no writable memory cgroup there are no cgroups at all (the PSS
    # fallback); with no writable cpuacct hierarchy (v1), nothing counts each env's CPU.
    mount = cgroups.hierarchy(hierarchy)
    if mount is None or (hierarchy == "cpuacct" and cgroups.version() != "v1"):
        pytest.skip(f"no cgroup v1 {hierarchy} hierarchy here (cgroup v2 counts CPU in every cgroup)")
    code = REFUSED.format(root=str(Path(__file__).parent.parent), source=str(spin_env))
    said = with_hierarchy_read_only(mount, code)
    assert said.startswith("cpu_budget needs the pool's cgroups to count each env's CPU"), said
    assert "Delegate=yes" in said
    if hierarchy == "cpuacct":
        assert "cpuacct" in said, said


def test_cpu_lists_are_counted_as_the_kernel_writes_them():
    assert cpu_list_count("0-3,8,10-11\n") == 7 and cpu_list_count("0") == 1
    assert 1 <= cgroups.cpus_allowed() <= (psutil.cpu_count() or 1)
