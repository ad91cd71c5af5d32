"""Several envs per sandbox (issue 43): the fault matrix of RLPool(source, n, envs_per_sandbox=k).

Every test runs real pools of real sandboxes, most in both spawn modes. A pool
of n envs in groups of k has ceil(n / k) sandboxes; env i lives in sandbox
i // k, as its member i % k. What each test pins down:

  1. every env kind works grouped, each member with its own env (module state,
     env_fns object), obs through the group's slot or by the wire;
  2. an env's own exception fails that env only; anything that ends or stalls
     the group's process fails every env of it, naming the sandbox and its envs,
     and the group is respawned at their reset; soft and hard resets; stragglers;
     the measurement gate; memory per group;
  3. send/recv per env over groups;
  4. render/call/get_attr/set_attr per member;
  5. grouped and sharded at once;
  6. a hostile group reply fails its own group only, and the group comes back.

Timeouts only catch hangs; no assertion is on a duration.
"""

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import msgpack
import numpy as np
import psutil
import pytest

from boltzlabs import EnvError, EnvStartError, PoolClosedError, RLPool
from boltzlabs.pool.groups import GroupedPool
from conftest import PROBE, has_ended, intervals, open_fds, overlaps, scaled, wait_until
from framers import PATHS, use_path

FLOOR = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_group_floor.py"  # the floor benchmark

pytestmark = [
    pytest.mark.timeout(180),
    # Failed envs are what these tests make: the pool's once-per-kind warnings about them are expected.
    pytest.mark.filterwarnings("ignore:.*failures are lanes:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:.*closed; its envs failed:RuntimeWarning"),
]

MiB = 1 << 20

# An env.py with module-level state, its own env index read at import (each member runs env.py
# as a module of its own, with $BOLTZLABS_ENV_INDEX its env's), a render, a method and two
# attributes. reset(options=) faults: {"raise": True}, {"exit": code}, {"sleep": seconds}.
MEMBER_ENV = """
    import os
    import time

    from boltzlabs.env import serve

    LANE = int(os.environ["BOLTZLABS_ENV_INDEX"])
    state = {"t": 0, "episodes": 0, "label": f"env-{LANE}", "render_fails": False}


    def reset(seed, options=None):
        options = options or {}
        if "exit" in options:
            os._exit(options["exit"])
        if options.get("raise"):
            raise RuntimeError(f"reset of env {LANE} failed on purpose")
        time.sleep(options.get("sleep", 0))
        state["t"] = 0
        state["episodes"] += 1
        return {"lane": LANE, "t": 0, "episodes": state["episodes"], "seed": seed}, {"lane": LANE}


    def step(action):
        state["t"] += 1
        if action == "render_fails":
            state["render_fails"] = True
        return {"lane": LANE, "t": state["t"], "episodes": state["episodes"]}, float(LANE), False, False, {"lane": LANE}


    def render():
        if state["render_fails"]:
            raise RuntimeError(f"render of env {LANE} failed on purpose")
        return f"frame of env {LANE} at t={state['t']}"


    def set_label(value):
        state["label"] = value


    serve(
        reset=reset,
        step=step,
        render=render,
        methods={"add": lambda x, y=0: LANE + x + y},
        attributes={"label": (lambda: state["label"], set_label), "lane": lambda: LANE},
    )
"""

SERVE_ENV = """
    import gymnasium as gym

    from boltzlabs.env import serve_env

    serve_env(gym.make("CartPole-v1"))
"""


def named(group, first, last, k=2):
    """What every error of a failed group says of it."""
    return f"sandbox {group} (envs {first}-{last}, envs_per_sandbox={k})"


def grouped(pids, k):
    """The pids, one per env, as they must look for groups of k: equal within a group, distinct across."""
    groups = [pids[i : i + k] for i in range(0, len(pids), k)]
    return all(len(set(g)) == 1 for g in groups) and len({g[0] for g in groups}) == len(groups)


def assert_ok(obs, rewards, dones, infos, lanes, rewards_expected=None):
    for i in lanes:
        assert not dones[i] and "error" not in infos[i], (i, infos[i])
        assert obs[i] is not None
        if rewards_expected is not None:
            assert rewards[i] == rewards_expected[i], (i, rewards)


def assert_group_failed(obs, rewards, dones, infos, lanes, *words):
    for i in lanes:
        assert dones[i] and rewards[i] == 0.0 and obs[i] is None, (i, obs[i], infos[i])
        for word in words:
            assert word in infos[i]["error"], (i, word, infos[i])


def kill_group(pool, env):
    """SIGKILL env's sandbox (its group's bwrap: the group's process follows it), and wait until the
    pool has seen it die: a request sent before then may still be answered."""
    os.kill(pool.pids()[env], signal.SIGKILL)
    assert wait_until(lambda: pool.states()[env] == "dead"), pool.states()


@pytest.fixture
def member_env(env_dir):
    return env_dir(MEMBER_ENV)


# -- 1. every env kind works grouped ------------------------------------------------------------


def test_env_py_module_state_is_each_members_own(probe_pool):
    pool = probe_pool(5, envs_per_sandbox=2)
    assert isinstance(pool, GroupedPool) and pool.sandboxes == 3 and pool.envs_per_sandbox == 2
    assert list(pool.members(2)) == [4]  # n not a multiple of k: the last group holds the rest
    pids = pool.pids()
    assert grouped(pids, 2), pids
    obs = pool.reset(seed=0)
    assert [o["seed"] for o in obs] == [0, 1, 2, 3, 4] and [o["episodes"] for o in obs] == [1] * 5
    pool.reset(where=[0, 3], seed=10)
    obs, rewards, dones, infos = pool.step([1, 2, 3, 4, 5])
    # the probe's module-level `state`: each member counts its own episodes, keeps its own rng
    assert [o["episodes"] for o in obs] == [2, 1, 1, 2, 1]
    seeds = [10, 1, 2, 13, 4]
    assert [o["noise"] for o in obs] == [random.Random(s).random() for s in seeds]
    assert rewards.tolist() == [1, 2, 3, 4, 5] and not dones.any()
    assert pool.shared_memory is False  # dict obs with no space: by the wire
    assert pool.pids() == pids


def test_each_member_sees_its_own_env_index_at_import(pool_factory, member_env):
    pool = pool_factory(member_env, 5, envs_per_sandbox=3)
    assert pool.sandboxes == 2 and grouped(pool.pids(), 3)
    obs = pool.reset(seed=0)
    assert [o["lane"] for o in obs] == [0, 1, 2, 3, 4]
    assert pool.reset_infos == [{"lane": i} for i in range(5)]
    obs, rewards, dones, infos = pool.step([0] * 5)
    assert [o["lane"] for o in obs] == [0, 1, 2, 3, 4] and rewards.tolist() == [0, 1, 2, 3, 4]


def cartpole_fns(n):
    return [lambda: gym.make("CartPole-v1") for _ in range(n)]


@pytest.mark.parametrize("kind", ["gym_id", "serve_env", "env_fns"])
def test_cartpole_grouped_equals_sync_vector_env(pool_factory, env_dir, kind):
    """Through the group's slot (a Box space), obs equal SyncVectorEnv's with the same seed; an
    earlier step's obs stay as they were."""
    n = 5
    source = {"gym_id": "CartPole-v1", "serve_env": env_dir(SERVE_ENV), "env_fns": cartpole_fns(n)}[kind]
    pool = pool_factory(source, n, envs_per_sandbox=2)
    assert pool.sandboxes == 3 and grouped(pool.pids(), 2)
    assert pool.shared_memory is True
    assert pool.env_contract.observation_space["shape"] == [4]  # the member's space, not the group's
    sync = gym.vector.SyncVectorEnv(cartpole_fns(n))
    try:
        want, _ = sync.reset(seed=3)
        got = pool.reset(seed=3)
        assert np.array_equal(np.stack(got), want) and got[0].dtype == np.float32
        kept = []
        for t in range(12):
            actions = np.array([(t + i) % 2 for i in range(n)])
            want_obs, want_rewards, want_term, want_trunc, _ = sync.step(actions)
            obs, rewards, terminated, truncated, infos = pool.step_full(actions)
            assert np.array_equal(np.stack(obs), want_obs), t
            assert rewards.tolist() == want_rewards.tolist()
            assert terminated.tolist() == want_term.tolist() and truncated.tolist() == want_trunc.tolist()
            assert not terminated.any() and not truncated.any()
            kept.append((obs, np.stack(obs).copy()))
        for obs, copy in kept:  # the slot is written again each step: what a call returned is not
            assert np.array_equal(np.stack(obs), copy)
    finally:
        sync.close()


class Indexed(gym.Wrapper):
    """What env_fns[i] builds: CartPole with its thunk's index, where it was built, and its own id."""

    def __init__(self, index):
        super().__init__(gym.make("CartPole-v1"))
        self.index = index
        self.built_in = os.environ.get("BOLTZLABS_ENV_INDEX")
        self.object_id = id(self)


def indexed_fns(n):
    return [lambda i=i: Indexed(i) for i in range(n)]


def test_env_fns_build_k_distinct_objects_each_in_its_own_lane(pool_factory):
    pool = pool_factory(indexed_fns(5), 5, envs_per_sandbox=2)
    pool.reset(seed=0)
    assert pool.get_attr("index") == [0, 1, 2, 3, 4]
    assert pool.get_attr("built_in") == ["0", "1", "2", "3", "4"]
    ids, pids = pool.get_attr("object_id"), pool.pids()
    assert grouped(pids, 2)
    assert ids[0] != ids[1] and ids[2] != ids[3]  # one process, two objects
    pool.set_attr("index", [51], env_ids=[1])
    assert pool.get_attr("index") == [0, 51, 2, 3, 4]


START_FAILS = """
    import os

    from boltzlabs.env import serve

    if os.environ["BOLTZLABS_ENV_INDEX"] == "3" and not os.environ.get("BOLTZLABS_PROBE"):
        raise RuntimeError("env 3 cannot start")
    serve(reset=lambda seed: 0, step=lambda action: (0, 0.0, False, {}))
"""


def test_a_member_that_fails_at_start_up_names_its_sandbox_and_itself(env_dir, spawn):
    with pytest.raises(EnvStartError) as e:
        RLPool(env_dir(START_FAILS), 5, envs_per_sandbox=2, spawn=spawn, step_timeout=scaled(5))
    text = str(e.value)
    assert text.startswith(named(1, 2, 3) + " failed to start"), text
    assert "boltzlabs: env 3 (member 1 of this sandbox, envs 2-3) failed in /env/env.py" in e.value.log
    assert "RuntimeError: env 3 cannot start" in e.value.log and e.value.env_index is None


@pytest.mark.parametrize("workers", [1, 2])
def test_close_leaves_no_process_or_fd_of_a_grouped_pool(spawn, workers):
    import psutil

    def descendants():
        return {p.pid for p in psutil.Process().children(recursive=True)}

    fds, children = open_fds(), descendants()
    pool = RLPool(PROBE, 5, envs_per_sandbox=2, workers=workers, spawn=spawn, step_timeout=scaled(1.5))
    pool.reset(seed=0)
    pool.step([1, 1, 1, 1, {"op": "sleep", "s": 60}])  # a busy group at close too: bounded by the deadline
    assert set(pool.pids()) <= descendants() - children
    pool.close()
    assert pool.closed and descendants() == children and open_fds() == fds
    with pytest.raises(PoolClosedError):
        pool.step([1] * 5)


# -- 2. failure semantics -----------------------------------------------------------------------


def test_an_exception_in_one_members_step_fails_that_env_only(probe_pool):
    pool = probe_pool(4, envs_per_sandbox=2)
    pool.reset(seed=0)
    pids = pool.pids()
    obs, rewards, dones, infos = pool.step([1, {"op": "raise"}, 3, 4])
    assert dones[1] and obs[1] is None and rewards[1] == 0.0
    assert "ValueError: step failed on purpose" in infos[1]["error"] and "Traceback" in infos[1]["error"]
    assert "sandbox" not in infos[1]["error"]  # the env's own failure, not its group's
    assert_ok(obs, rewards, dones, infos, [0, 2, 3], [1, 0, 3, 4])
    assert [o["t"] for o in (obs[0], obs[2], obs[3])] == [1, 1, 1]
    assert pool.states() == ["idle"] * 4 and pool.pids() == pids
    obs, rewards, dones, infos = pool.step([1, 2, 3, 4])  # the member still serves, even unreset
    assert_ok(obs, rewards, dones, infos, range(4), [1, 2, 3, 4])
    assert [o["t"] for o in obs] == [2, 2, 2, 2]


def test_an_exception_in_one_members_reset_fails_that_env_only(pool_factory, member_env):
    pool = pool_factory(member_env, 4, envs_per_sandbox=2)
    pool.reset(seed=0)
    pool.step([0] * 4)
    pids, before = pool.pids(), pool.observations
    obs = pool.reset(where=[1], seed=5, options={"raise": True})
    assert obs[1] is None and "RuntimeError: reset of env 1 failed on purpose" in pool.reset_infos[1]["error"]
    assert obs[0] == before[0] and obs[2:] == before[2:]  # the others were not reset
    assert pool.pids() == pids and pool.states() == ["idle"] * 4
    obs, rewards, dones, infos = pool.step([0] * 4)
    assert_ok(obs, rewards, dones, infos, range(4), [0, 1, 2, 3])
    assert [o["t"] for o in obs] == [2, 2, 2, 2]


FAULTS = {
    "exit": ("exited with code 3", False),
    "kill": ("SIGKILL", False),
    "deadline": ("missed the step deadline", True),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_group_process_that_dies_or_stalls_fails_each_of_its_envs(probe_pool, fault):
    cause, straggler = FAULTS[fault]
    pool = probe_pool(5, envs_per_sandbox=2, step_timeout=scaled(1.5))
    pool.reset(seed=0)
    pids = pool.pids()
    actions = [1, 2, 3, 4, 5]
    if fault == "kill":
        kill_group(pool, 2)
    elif fault == "exit":
        actions[2] = {"op": "exit", "code": 3}
    else:
        actions[3] = {"op": "sleep", "s": 60}
    obs, rewards, dones, infos = pool.step(actions)
    assert_group_failed(obs, rewards, dones, infos, [2, 3], cause, named(1, 2, 3))
    assert [bool(infos[i].get("straggler")) for i in (2, 3)] == [straggler] * 2
    assert pool.timing.stragglers == ([2, 3] if straggler else [])
    assert_ok(obs, rewards, dones, infos, [0, 1, 4], [1, 2, 0, 0, 5])
    assert pool.states()[2] == pool.states()[3] == ("straggler" if straggler else "dead")
    obs = pool.reset(where=[2, 3], seed=7)
    assert [pool.reset_infos[i] for i in (2, 3)] == [{"reset_info": True}] * 2
    assert [o["seed"] for o in obs[2:4]] == [9, 10]
    now = pool.pids()
    assert now[2] == now[3] != pids[2] and now[:2] == pids[:2] and now[4] == pids[4]
    obs, rewards, dones, infos = pool.step([1, 2, 3, 4, 5])
    assert_ok(obs, rewards, dones, infos, range(5), [1, 2, 3, 4, 5])


RESET_FAULTS = {  # options, the reset's error, the group's state, the next step's error
    "exit": ({"exit": 4}, "exited with code 4", "dead", "exited with code 4"),
    "deadline": ({"sleep": 60}, "missed the reset deadline", "straggler", "still busy"),
}


@pytest.mark.parametrize("fault", sorted(RESET_FAULTS))
def test_a_member_that_ends_or_stalls_its_group_in_reset_fails_the_group(pool_factory, member_env, fault):
    options, cause, state, then = RESET_FAULTS[fault]
    pool = pool_factory(member_env, 4, envs_per_sandbox=2, step_timeout=scaled(1.5))
    pool.reset(seed=0)
    pids = pool.pids()
    pool.reset(where=[2], options=options)
    assert cause in pool.reset_infos[2]["error"] and named(1, 2, 3) in pool.reset_infos[2]["error"]
    assert pool.timing.stragglers == ([2] if state == "straggler" else [])
    assert pool.states() == ["idle", "idle", state, state]
    obs, rewards, dones, infos = pool.step([0] * 4)
    assert_group_failed(obs, rewards, dones, infos, [2, 3], then, named(1, 2, 3))
    assert_ok(obs, rewards, dones, infos, [0, 1], [0, 1])
    pool.reset(where=[3], seed=1)  # one env's reset respawns the group: its other env is reset too
    assert "error" not in pool.reset_infos[3] and named(1, 2, 3) in pool.reset_infos[2]["group_reset"]
    assert pool.pids()[2] == pool.pids()[3] != pids[2] and pool.pids()[:2] == pids[:2]
    obs, rewards, dones, infos = pool.step([0] * 4)
    assert_ok(obs, rewards, dones, infos, range(4), [0, 1, 2, 3])
    assert [o["t"] for o in obs] == [2, 2, 1, 1] and [o["episodes"] for o in obs] == [1, 1, 1, 1]


def memory_limited(factory, *args, **kwargs):
    """A pool with a memory_limit, or a clean skip on a host with no usable memory cgroup."""
    try:
        return factory(*args, **kwargs)
    except ValueError as exc:
        if "memory cgroup" in str(exc):
            pytest.skip(f"no usable memory cgroup here: {exc}")
        raise


def test_memory_limit_is_per_group_and_an_oom_fails_the_group(probe_pool):
    """memory_limit bounds each group's sandbox as a whole (not k times it): two members of one
    group that each stay under it, together over it, OOM their group; a member alone does not."""
    pool = memory_limited(probe_pool, 4, envs_per_sandbox=2, memory_limit="192M")
    pool.reset(seed=0)
    obs, rewards, dones, infos = pool.step([{"op": "alloc", "mb": 110}, 1, {"op": "alloc", "mb": 110}, 1])
    assert obs[0]["out"] == obs[2]["out"] == {"held_mb": 110}
    assert_ok(obs, rewards, dones, infos, range(4))
    obs, rewards, dones, infos = pool.step([1, {"op": "alloc", "mb": 110}, 1, 1])
    assert_group_failed(obs, rewards, dones, infos, [0, 1], "OOM", "memory_limit=201326592", named(0, 0, 1))
    assert_ok(obs, rewards, dones, infos, [2, 3], [0, 0, 1, 1])
    pool.reset(where=[0, 1], seed=0)
    obs, rewards, dones, infos = pool.step([{"op": "alloc", "mb": 16}, 1, 1, 1])
    assert obs[0]["out"] == {"held_mb": 16}
    assert_ok(obs, rewards, dones, infos, range(4))


def test_reset_where_soft_resets_only_the_masked_envs(probe_pool):
    pool = probe_pool(4, envs_per_sandbox=2)
    pool.reset(seed=0)
    for _ in range(3):
        obs, *_ = pool.step([1] * 4)
    pids, infos_before = pool.pids(), pool.reset_infos
    obs = pool.reset(where=np.array([False, True, False, False]), seed=9)
    assert obs[1] == {"t": 0, "episodes": 2, "seed": 10}
    assert [o["t"] for o in obs] == [3, 0, 3, 3] and obs[0] == pool.observations[0]
    assert pool.reset_infos[0] == infos_before[0] and "group_reset" not in str(pool.reset_infos)
    assert pool.pids() == pids
    obs, *_ = pool.step([1] * 4)
    assert [o["t"] for o in obs] == [4, 1, 4, 4] and [o["episodes"] for o in obs] == [1, 2, 1, 1]


def test_a_hard_reset_respawns_the_whole_group_and_says_so(probe_pool):
    pool = probe_pool(4, envs_per_sandbox=2)
    pool.reset(seed=0)
    pool.step([1] * 4)
    pool.step([1] * 4)
    pids, episodes = pool.pids(), pool.episode_ids
    obs = pool.reset(where=[1], seed=9, hard=True)
    now = pool.pids()
    assert now[0] == now[1] != pids[0] and now[2:] == pids[2:]
    assert obs[1] == {"t": 0, "episodes": 1, "seed": 10}  # a fresh process: its counter starts again
    assert obs[0] == {"t": 0, "episodes": 1, "seed": None}  # reset too, unseeded
    assert pool.reset_infos[1] == {"reset_info": True}
    said = pool.reset_infos[0]["group_reset"]
    assert named(0, 0, 1) in said and "env(s) 1" in said
    assert pool.observations[0] == obs[0] and [o["t"] for o in obs[2:]] == [2, 2]
    assert pool.episode_ids[0] != episodes[0] and pool.episode_ids[2:] == episodes[2:]
    obs, rewards, dones, infos = pool.step([1] * 4)
    assert [o["t"] for o in obs] == [1, 1, 3, 3] and not dones.any()


def test_serialize_measurement_runs_one_env_at_a_time_across_groups(probe_pool):
    pool = probe_pool(5, envs_per_sandbox=2, serialize_measurement=True)
    pool.reset(seed=0)
    obs, rewards, dones, infos = pool.step([{"op": "interval", "s": 0.05}] * 5)
    spans = intervals(obs)
    assert len(spans) == 5 and not overlaps(spans), spans
    pool.reset(where=[1], seed=3)
    assert pool.step([1] * 5)[1].tolist() == [1.0] * 5


def test_without_the_gate_groups_overlap_and_members_take_turns(probe_pool):
    pool = probe_pool(4, envs_per_sandbox=2)
    pool.reset(seed=0)
    obs, *_ = pool.step([{"op": "interval", "s": scaled(0.3)}] * 4)
    assert not overlaps(intervals(obs[0:2])) and not overlaps(intervals(obs[2:4]))  # one process each
    assert overlaps(intervals(obs))  # the two groups ran at once


def test_envs_per_gb_divides_a_groups_memory_by_its_envs(probe_pool):
    pool = memory_limited(probe_pool, 5, envs_per_sandbox=2, memory_limit="512M")
    pool.reset(seed=0)
    before = pool.memory()
    assert len(before.per_env) == 5 and all(b > 0 for b in before.per_env)
    pool.step([{"op": "alloc", "mb": 64}, 1, 1, 1, 1])
    after = pool.memory()
    assert len(after.per_env) == 5
    assert after.per_env[0] == after.per_env[1] and after.per_env[2] == after.per_env[3]
    grew = [a - b for a, b in zip(after.per_env, before.per_env)]
    assert 28 * MiB < grew[0] == grew[1] < 40 * MiB, grew  # the group's 64 MiB, over its two envs
    assert all(abs(g) < 4 * MiB for g in grew[2:]), grew
    assert pool.envs_per_gb() == pytest.approx((1 << 30) / (after.total / 5), rel=0.05)


def episode(pool, **reset_args):
    """A reset and 5 steps of every env: [[obs, reward] of each env] per call."""
    frames = [[[o, 0.0] for o in pool.reset(**reset_args)]]
    for _ in range(5):
        obs, rewards, _, _ = pool.step([1] * len(pool))
        frames.append([[o, r] for o, r in zip(obs, rewards.tolist())])
    return frames


def wire_bytes(frames, lanes):
    """The bytes of `lanes`' part of an episode, as they crossed the wire."""
    return msgpack.packb([[frame[i] for i in lanes] for frame in frames])


def test_hard_resets_are_byte_identical_per_group(probe_pool):
    pool = probe_pool(4, envs_per_sandbox=2)
    first = episode(pool, seed=3)
    assert wire_bytes(episode(pool, seed=3), range(4)) != wire_bytes(first, range(4))  # soft: counters carry over
    assert wire_bytes(episode(pool, seed=3, hard=True), range(4)) == wire_bytes(first, range(4))
    # One group's hard reset: that group's episode is byte for byte its first one.
    alone = episode(pool, seed=3, where=[2, 3], hard=True)
    assert wire_bytes(alone, [2, 3]) == wire_bytes(first, [2, 3])
    assert wire_bytes(alone, [0, 1]) != wire_bytes(first, [0, 1])


# -- 3. send / recv ----------------------------------------------------------------------------


def test_send_to_all_then_recv_in_batches(probe_pool):
    pool = probe_pool(5, envs_per_sandbox=2)
    pool.reset(seed=0)
    pool.send([1, 2, 3, 4, 5])
    assert set(pool.states()) <= {"in_flight", "finished"}
    ids, obs, rewards, dones, infos = pool.recv(3)
    assert len(ids) == 3 and ids.dtype == np.int64 and len(obs) == len(infos) == 3
    got = dict(zip(ids.tolist(), rewards.tolist()))
    assert pool.states().count("idle") == 3 and all(pool.states()[i] == "idle" for i in got)
    ids, obs, rewards, dones, infos = pool.recv()  # the rest
    got.update(zip(ids.tolist(), rewards.tolist()))
    assert got == {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0, 4: 5.0} and len(ids) == 2
    assert pool.states() == ["idle"] * 5
    assert [o["t"] for o in pool.observations] == [1] * 5


def test_send_to_some_envs_and_refuse_an_env_whose_group_is_in_flight(probe_pool):
    pool = probe_pool(5, envs_per_sandbox=2)
    pool.reset(seed=0)
    pool.send([7, 9], env_ids=[1, 4])
    states = pool.states()
    assert states[0] == states[2] == states[3] == "idle" and {states[1], states[4]} <= {"in_flight", "finished"}
    with pytest.raises(ValueError, match=r"sandbox 0 \(envs 0-1, envs_per_sandbox=2\), whose step is in flight"):
        pool.send([1], env_ids=[0])
    with pytest.raises(ValueError, match=r"sandbox 0 \(envs 0-1"):
        pool.reset(where=[0])
    pool.send([3], env_ids=[2])  # another group: free
    ids, obs, rewards, dones, infos = pool.recv()
    assert dict(zip(ids.tolist(), rewards.tolist())) == {1: 7.0, 2: 3.0, 4: 9.0}  # actions aligned with env_ids
    assert pool.states() == ["idle"] * 5
    with pytest.raises(ValueError, match="batch_size"):
        pool.recv(1)  # nothing is in flight


def test_recv_batch_size_returns_that_many(probe_pool):
    pool = probe_pool(6, envs_per_sandbox=3)
    pool.reset(seed=0)
    pool.send([1] * 6)
    seen = []
    for size in (1, 2, 3):
        ids, *_ = pool.recv(size)
        assert len(ids) == size
        seen += ids.tolist()
    assert sorted(seen) == list(range(6))
    pool.send([1] * 6)
    with pytest.raises(ValueError, match="only 6 env"):
        pool.recv(7)
    ids, *_ = pool.recv(6)
    assert sorted(ids.tolist()) == list(range(6))


def test_recv_of_a_straggling_group_names_every_env_received(probe_pool):
    pool = probe_pool(6, envs_per_sandbox=2, step_timeout=scaled(1.5))
    pool.reset(seed=0)
    pool.send([{"op": "sleep", "s": 60}, 1, 1, 1, 1, 1])
    ids, obs, rewards, dones, infos = pool.recv(5)  # groups 1 and 2, then group 0 at its deadline
    assert sorted(ids[:4].tolist()) == [2, 3, 4, 5] and ids[4] == 0
    assert infos[4]["straggler"] and named(0, 0, 1) in infos[4]["error"] and dones[4]
    assert pool.timing.stragglers == [0]  # the stragglers among the envs received
    ids, obs, rewards, dones, infos = pool.recv(1)  # what the last recv held back
    assert ids.tolist() == [1] and infos[0]["straggler"] and named(0, 0, 1) in infos[0]["error"]
    assert pool.timing.stragglers == [1]
    assert pool.states()[:2] == ["straggler", "straggler"]
    pool.send([1, 1], env_ids=[2, 3])
    pool.recv()
    assert pool.timing.stragglers == []
    pool.reset(where=[0, 1])
    assert pool.states() == ["idle"] * 6


def test_send_recv_and_partial_resets_through_a_groups_slot(pool_factory):
    """A Box env: each result of a group's slot is its env's own, also when it is held past a later
    step of its group, and a partial or hard reset gives just the envs asked their new obs."""
    pool = pool_factory("CartPole-v1", 4, envs_per_sandbox=2)
    assert pool.shared_memory is True
    envs = [gym.make("CartPole-v1") for _ in range(4)]
    want = [env.reset(seed=i)[0] for i, env in enumerate(envs)]
    assert all(np.array_equal(o, w) for o, w in zip(pool.reset(seed=0), want))
    pool.send([1, 0, 1, 0])
    want = [env.step(a)[0] for env, a in zip(envs, [1, 0, 1, 0])]
    got = {}
    for _ in range(4):
        ids, obs, *_ = pool.recv(1)
        got[int(ids[0])] = obs[0]
    assert sorted(got) == [0, 1, 2, 3] and all(np.array_equal(got[i], want[i]) for i in range(4))
    pool.send([0, 1], env_ids=[0, 1])
    ids, obs, *_ = pool.recv(1)  # env 0; env 1's result is held
    pool.send([1], env_ids=[0])  # its sandbox steps member 0 again, rewriting the slot
    want0, want1 = envs[0].step(0)[0], envs[1].step(1)[0]
    rest = dict(zip(*pool.recv()[:2]))
    assert np.array_equal(obs[0], want0) and np.array_equal(rest[1], want1)
    assert np.array_equal(rest[0], envs[0].step(1)[0])
    before = pool.observations
    obs = pool.reset(where=[3], seed=9)
    assert np.array_equal(obs[3], envs[3].reset(seed=12)[0])
    assert all(np.array_equal(obs[i], before[i]) for i in range(3))
    obs = pool.reset(where=[1], seed=20, hard=True)
    assert np.array_equal(obs[1], envs[1].reset(seed=21)[0]) and "group_reset" in pool.reset_infos[0]
    assert not np.array_equal(obs[0], before[0]) and np.array_equal(obs[2], before[2])
    for env in envs:
        env.close()


def test_step_and_reset_wait_for_a_result_not_yet_received(probe_pool):
    """A group's reply can hold a result recv() has not taken: step() and a reset of that env are
    refused, as on a pool of one env per sandbox, never run under it (which would leave a stale
    result for a later recv)."""
    pool = probe_pool(4, envs_per_sandbox=2)
    pool.reset(seed=0)
    pool.send([1, 2], env_ids=[0, 1])
    ids, *_ = pool.recv(1)
    held = 1 - ids[0]
    assert pool.states()[held] == "finished"
    with pytest.raises(ValueError, match=r"step\(\) cannot run while 0 env\(s\) are in flight and 1 finished"):
        pool.step([5] * 4)
    with pytest.raises(ValueError, match=f"env {held}"):
        pool.reset(where=[held])
    ids, obs, rewards, dones, infos = pool.recv()
    assert ids.tolist() == [held] and obs[0]["t"] == 1 and rewards[0] == [1.0, 2.0][held]
    obs, rewards, dones, infos = pool.step([5] * 4)
    assert [o["t"] for o in obs] == [2, 2, 1, 1]


# -- 4. render, call, get_attr, set_attr per member -----------------------------------------------


def test_render_call_get_attr_set_attr_reach_each_member(pool_factory, member_env):
    pool = pool_factory(member_env, 5, envs_per_sandbox=2)
    pool.reset(seed=0)
    pool.step([0] * 5)
    assert pool.render_all() == [f"frame of env {i} at t=1" for i in range(5)]
    assert pool.render(3) == "frame of env 3 at t=1"
    assert pool.call("add", 10, y=1) == [11, 12, 13, 14, 15]
    assert pool.call("add", 5, env_ids=[4, 1]) == [9, 6]
    assert pool.get_attr("lane") == [0, 1, 2, 3, 4]
    assert pool.get_attr("label", env_ids=[3]) == ["env-3"]
    pool.set_attr("label", ["a", "b"], env_ids=[1, 4])
    assert pool.get_attr("label") == ["env-0", "a", "env-2", "env-3", "b"]
    pool.set_attr("label", "z", env_ids=[2])
    assert pool.get_attr("label") == ["env-0", "a", "z", "env-3", "b"]
    with pytest.raises(AttributeError, match="no method or attribute 'nope'"):
        pool.get_attr("nope")


def test_a_members_render_failure_names_that_env(pool_factory, member_env):
    pool = pool_factory(member_env, 4, envs_per_sandbox=2)
    pool.reset(seed=0)
    pool.step([0, "render_fails", 0, 0])
    with pytest.raises(
        EnvError, match=r"(?s)env 1 could not render: Traceback.*RuntimeError: render of env 1 failed"
    ) as e:
        pool.render(1)  # its traceback, as from an env of its own sandbox
    assert e.value.env_index == 1 and "sandbox" not in str(e.value)
    with pytest.raises(EnvError, match="env 1 could not render"):
        pool.render_all()
    assert pool.render(0) == "frame of env 0 at t=1"


def test_render_and_attrs_of_a_dead_group_name_the_env_and_its_sandbox(pool_factory, member_env):
    pool = pool_factory(member_env, 4, envs_per_sandbox=2)
    pool.reset(seed=0)
    kill_group(pool, 2)
    pool.step([0] * 4)
    with pytest.raises(EnvError, match=r"env 3 could not render: .*SIGKILL") as e:
        pool.render(3)
    assert e.value.env_index == 3 and named(1, 2, 3) in str(e.value)
    with pytest.raises(EnvError, match=r"env 3 could not call 'add': .*SIGKILL") as e:
        pool.call("add", 1, env_ids=[3])
    assert e.value.env_index == 3 and named(1, 2, 3) in str(e.value)
    assert pool.get_attr("lane", env_ids=[0, 1]) == [0, 1]


# -- 5. grouped and sharded ---------------------------------------------------------------------


def test_sharded_and_grouped_env_fns(pool_factory):
    pool = pool_factory(indexed_fns(7), 7, workers=2, envs_per_sandbox=2)
    assert pool.sandboxes == 4 and pool.inner.workers == 2
    pool.reset(seed=0)
    assert pool.get_attr("index") == list(range(7))  # each env its own thunk, over both shards
    pids = pool.pids()
    assert grouped(pids, 2)
    kill_group(pool, 6)
    obs, rewards, dones, infos = pool.step([1] * 7)
    assert_group_failed(obs, rewards, dones, infos, [6], "SIGKILL", named(3, 6, 6))
    assert_ok(obs, rewards, dones, infos, range(6), [1.0] * 6)
    pool.reset(where=[6], seed=0)
    assert pool.get_attr("index", env_ids=[6]) == [6] and pool.pids()[6] != pids[6]
    assert not pool.step([1] * 7)[2].any()


def test_more_workers_than_sandboxes_is_refused_in_sandboxes():
    with pytest.raises(
        ValueError, match=r"workers must be in \[1, 2\]: each worker process holds at least one sandbox, "
    ):
        RLPool(PROBE, 4, envs_per_sandbox=2, workers=3)


def test_sharded_and_grouped_gym_id_equals_sync_vector_env(pool_factory):
    n = 7
    pool = pool_factory("CartPole-v1", n, workers=2, envs_per_sandbox=3)
    assert pool.sandboxes == 3 and pool.inner.workers == 2 and grouped(pool.pids(), 3)
    sync = gym.vector.SyncVectorEnv(cartpole_fns(n))
    try:
        want, _ = sync.reset(seed=11)
        assert np.array_equal(np.stack(pool.reset(seed=11)), want)
        for t in range(8):
            actions = np.array([(t + i) % 2 for i in range(n)])
            want_obs, want_rewards, *_ = sync.step(actions)
            obs, rewards, dones, infos = pool.step(actions)
            assert np.array_equal(np.stack(obs), want_obs) and rewards.tolist() == want_rewards.tolist()
    finally:
        sync.close()
    pids = pool.pids()
    pool.reset(where=[4], hard=True, seed=0)  # group 1 (envs 3-5), in the second shard
    now = pool.pids()
    assert now[3] == now[5] != pids[3] and now[:3] == pids[:3] and now[6] == pids[6]
    assert [("group_reset" in pool.reset_infos[i]) for i in (3, 4, 5)] == [True, False, True]


# Infos of numpy scalars (MuJoCo's, Box2D's), which a group sends as one array per key when every
# member's info has the same keys and types (runtime/group.py's info_columns), and infos it sends
# as they are: another type in one member (action 7), another key order (8), a Python float (9).
INFO_ENV = """
    import os

    import numpy as np

    from boltzlabs.env import serve

    LANE = int(os.environ["BOLTZLABS_ENV_INDEX"])


    def reset(seed, options=None):
        return 0, {"seed": np.int64(seed or 0), "lane": np.uint8(LANE)}


    def step(action):
        info = {"x": np.float32(LANE + action / 4), "n": np.int64(-LANE), "ok": np.bool_(action % 2 == 0),
                "z": np.complex64(LANE + 1j), "h": np.float16(action)}
        if action == 7 and LANE == 1:
            info["x"] = np.float64(info["x"])
        if action == 8 and LANE == 1:
            info = dict(reversed(info.items()))
        if action == 9:
            info["x"] = float(info["x"])
        return LANE, 0.0, False, False, info


    serve(reset=reset, step=step)
"""


def test_infos_of_numpy_scalars_come_as_each_env_sent_them(env_dir, pool_factory):
    from boltzlabs.runtime.group import info_columns

    source = env_dir(INFO_ENV)
    one, grouped = pool_factory(source, 5), pool_factory(source, 5, envs_per_sandbox=3)
    one.reset(seed=0)
    grouped.reset(seed=0)
    seen = []
    for action in (0, 1, 7, 8, 9):
        want, got = one.step([action] * 5)[3], grouped.step([action] * 5)[3]
        for a, b in zip(want, got):
            assert list(a) == list(b), (action, a, b)  # the keys in the env's order
            assert [(type(v), v) for v in a.values()] == [(type(v), v) for v in b.values()], (action, a, b)
        seen.append(info_columns(want[:3]) is not None)
    assert seen == [True, True, False, False, False]
    grouped.reset(seed=3)
    assert [(i["seed"], type(i["seed"]), i["lane"], type(i["lane"])) for i in grouped.reset_infos] == [
        (3 + i, np.int64, i, np.uint8) for i in range(5)
    ]
    columns = info_columns([{"a": np.float32(1), "b": np.bool_(True)}, {"a": np.float32(2), "b": np.bool_(False)}])
    assert list(columns) == ["a", "b"] and columns["a"].dtype == np.float32 and columns["b"].tolist() == [True, False]
    for infos in (
        [None, {"a": np.float32(1)}],
        [{"a": np.str_("s")}] * 2,
        [{}, {}],
        [{1: np.float32(1)}] * 2,
        [{"a": np.datetime64(0, "s")}] * 2,
        [{"x" * 300: np.float32(1)}] * 2,
    ):
        assert info_columns(infos) is None, infos


# -- 6. hostile group replies -------------------------------------------------------------------

# An env whose step or reset (action or options {"forge": op}) writes its own frame on fd 3, the
# channel's write end, answering for its whole group, and has the runtime's own reply dropped.
HOSTILE_GROUP = """
    import os
    import threading
    import time

    import msgpack

    from boltzlabs import wire
    from boltzlabs.env import serve
    from boltzlabs.runtime import group

    KEY = group.GROUP_KEY
    state = {"t": 0}

    if not getattr(group.Group, "forging", False):  # env.py runs once per member: wrap once
        _turn = group.Group.turn

        def turn(self, channel, seq, entries, code, *rest):
            group.turn_of = (seq, len(self.members), code)  # entries may come packed (bytes)
            out = _turn(self, channel, seq, entries, code, *rest)
            if getattr(group, "forged", False):
                group.forged = False
                return b""  # the frame of this turn went already
            return out

        group.Group.turn = turn
        group.Group.forging = True


    def put(body):
        view = memoryview(len(body).to_bytes(4, "little") + body)
        while view:
            view = view[os.write(3, view):]
        group.forged = True


    def forge(op, depth=600, many=1_000_000):
        if getattr(group, "forged", False):  # another member of this turn forged its frame already
            return
        seq, count, code = group.turn_of
        kind = 0 if code == wire.STEPPED else 1
        kinds, rewards, term, trunc = [kind] * count, [1.0] * count, [False] * count, [False] * count
        infos, errors, obs = [{}] * count, [None] * count, [{"t": -1}] * count
        if op == "count":  # a result for one member more than the group has
            kinds, rewards, term, trunc, infos, errors, obs = (
                [*x, x[0]] for x in (kinds, rewards, term, trunc, infos, errors, obs)
            )
        elif op == "reward_str":
            rewards[0] = "1.0"
        elif op == "info_list":
            infos[0] = [1, 2]
        elif op == "kind7":
            kinds[0] = 7
        elif op == "rows":
            obs = obs[:-1]
        elif op == "error":
            errors[0] = ["step", 5, None]
        elif op == "not_asked":  # an asked member answered as not asked
            kinds[0] = -1
        elif op.startswith("columns_"):  # info columns (runtime/group.py's info_columns), malformed
            import numpy as np

            infos = {
                "columns_len": {"x": np.zeros(count + 1)},  # a value for a member the group has not
                "columns_2d": {"x": np.zeros((count, 1))},
                "columns_key": {7: np.zeros(count)},
                "columns_list": {"x": [0.0] * count},  # not an array
                "columns_empty": {},
            }[op]
        # "all": every member answered as stepped (a lie when only some were asked)
        if op == "fake_failure":  # a failure as the worker reports one, with no group results
            failure = {"error": "missed the step deadline of 5 s", "straggler": True}
            put(wire.encode([code, seq, None, 0.0, False, True, failure] if code == wire.STEPPED else [code, seq, None, failure])[4:])
            return
        if op in ("deep", "many", "array_key"):  # raw msgpack: a member's info nested too deep, too many
            # objects, or keyed by an array
            if op == "deep":
                info = b"\\x81\\xa1x" + b"\\x91" * depth + b"\\xc0"
            elif op == "many":
                info = b"\\x81\\xa1x" + b"\\xdd" + many.to_bytes(4, "big") + b"\\x90" * many
            else:
                import numpy as np

                info = b"\\x81" + wire.pack(np.zeros(2)) + b"\\x01"
            results = (b"\\x96" + b"".join(msgpack.packb(x) for x in (kinds, rewards, term, trunc))
                       + b"\\x92" + info + b"\\x80" + msgpack.packb(errors))
            head = [code, seq, obs] + ([0.0, False, False] if code == wire.STEPPED else [])
            body = bytes([0x90 + len(head) + 1]) + b"".join(msgpack.packb(x) for x in head)
            put(body + b"\\x81" + msgpack.packb(KEY) + results)
            return
        results = [kinds, rewards, term, trunc, infos, errors]
        if code == wire.STEPPED:
            frame = wire.encode([code, seq, obs, 0.0, False, False, {KEY: results}])
        else:
            frame = wire.encode([code, seq, obs, {KEY: results}])
        put(frame[4:])


    def reset(seed, options=None):
        state["t"] = 0
        if options and "forge" in options:
            forge(options["forge"])
        return {"t": 0}, {}


    def unasked():  # a frame nobody asked for, a moment after this turn's reply went
        time.sleep(0.05)
        body = wire.encode([wire.STEPPED, 10**9, {"t": -1}, 0.0, False, False, {}])
        os.write(3, body)


    def step(action):
        state["t"] += 1
        if isinstance(action, dict):
            if action["op"] == "unencodable":
                return object(), 0.0, False, False, {}
            if action["op"] == "unasked":
                threading.Thread(target=unasked).start()
                return {"t": state["t"]}, 0.0, False, False, {}
            forge(**action)
            return {"t": state["t"]}, 0.0, False, False, {}
        return {"t": state["t"]}, float(action), False, False, {}


    serve(reset=reset, step=step)
"""

ATTACKS = {
    "count": "do not hold exactly 2 items each",
    "reward_str": "member 0's reward or done flags are not a number and bools",
    "info_list": "member 0's info is a list, not a dict",
    "kind7": "member 0's kind is 7",
    "rows": "its observations hold 1 rows for 2 envs",
    "error": "member 0's error is not [phase, message, traceback]",
    "not_asked": "member 0 was asked and not answered",
    "deep": "nested deeper than 512 levels",
    "many": "more than 524288 objects",
    "array_key": "a dict key that is a list, a dict or an array",
    "fake_failure": "missed the step deadline of 5 s",
    **{
        f"columns_{what}": "its info columns are not one array of 2 numbers under each str key"
        for what in ("len", "2d", "key", "list", "empty")
    },
}


@pytest.fixture
def hostile(env_dir, pool_factory):
    source = env_dir(HOSTILE_GROUP)
    return lambda n=6, **kwargs: pool_factory(source, n, envs_per_sandbox=2, **kwargs)


def assert_group_comes_back(pool, lanes, pids):
    """The failed group is respawned at its envs' reset (one of them suffices) and works."""
    pool.reset(where=[lanes[0]], seed=0)
    assert "error" not in pool.reset_infos[lanes[0]], pool.reset_infos[lanes[0]]
    assert "group_reset" in pool.reset_infos[lanes[1]]
    now = pool.pids()
    assert now[lanes[0]] == now[lanes[1]] != pids[lanes[0]]
    assert [now[i] for i in range(len(pool)) if i not in lanes] == [pids[i] for i in range(len(pool)) if i not in lanes]
    obs, rewards, dones, infos = pool.step(list(range(1, len(pool) + 1)))
    assert_ok(obs, rewards, dones, infos, range(len(pool)), list(range(1, len(pool) + 1)))


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_a_hostile_group_reply_fails_its_own_group_only(hostile, attack):
    pool = hostile()
    pool.reset(seed=0)
    pids = pool.pids()
    obs, rewards, dones, infos = pool.step([1, 2, {"op": attack}, 4, 5, 6])
    assert_group_failed(obs, rewards, dones, infos, [2, 3], ATTACKS[attack], named(1, 2, 3))
    assert_ok(obs, rewards, dones, infos, [0, 1, 4, 5], [1, 2, 0, 0, 5, 6])
    assert [o["t"] for o in obs if o is not None] == [1, 1, 1, 1]
    assert_group_comes_back(pool, [2, 3], pids)


@pytest.mark.parametrize("attack", ["count", "kind7", "not_asked", "info_list"])
def test_a_hostile_group_reply_to_a_reset_fails_its_own_group_only(hostile, attack):
    pool = hostile()
    pool.reset(seed=0)
    pids = pool.pids()
    obs = pool.reset(where=[4, 5], options={"forge": attack})
    for i in (4, 5):
        assert obs[i] is None and ATTACKS[attack] in pool.reset_infos[i]["error"], pool.reset_infos[i]
        assert named(2, 4, 5) in pool.reset_infos[i]["error"]
    assert obs[:4] == [{"t": 0}] * 4
    assert_group_comes_back(pool, [4, 5], pids)


def test_a_group_answering_for_an_env_not_sent_fails_the_envs_sent(hostile):
    pool = hostile(4)
    pool.reset(seed=0)
    pids = pool.pids()
    pool.send([{"op": "all"}], env_ids=[2])  # the reply says env 3 stepped too
    ids, obs, rewards, dones, infos = pool.recv()
    assert ids.tolist() == [2] and obs == [None] and dones.tolist() == [True]
    assert "member 1 was not asked and answered as stepped" in infos[0]["error"] and named(1, 2, 3) in infos[0]["error"]
    assert pool.states() == ["idle"] * 4 and pool.observations[3] == {"t": 0}
    assert_group_comes_back(pool, [2, 3], pids)


def test_hostile_replies_to_send_fail_the_envs_sent(hostile):
    pool = hostile()
    pool.reset(seed=0)
    pids = pool.pids()
    pool.send([{"op": "count"}, 2, 3], env_ids=[2, 0, 4])
    ids, obs, rewards, dones, infos = pool.recv()
    results = {i: (o, r, d, info) for i, o, r, d, info in zip(ids.tolist(), obs, rewards, dones, infos)}
    assert sorted(results) == [0, 2, 4]  # never env 3, which was not sent, whatever its group said
    assert results[2][0] is None and results[2][2] and named(1, 2, 3) in results[2][3]["error"]
    assert results[0][1:3] == (2.0, False) and results[4][1:3] == (3.0, False)
    assert pool.states() == ["idle"] * 6
    assert_group_comes_back(pool, [2, 3], pids)


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    return use_path(request, monkeypatch)


def test_every_hostile_reply_on_each_step_path(env_dir, path):
    """The worker's native and pure step paths both carry a group's reply as they would any env's."""
    with RLPool(env_dir(HOSTILE_GROUP), 4, envs_per_sandbox=2, step_timeout=scaled(5)) as pool:
        assert pool.fast_path == (path == "native")
        pool.reset(seed=0)
        for attack, words in ATTACKS.items():
            pids = pool.pids()
            obs, rewards, dones, infos = pool.step([{"op": attack}, 2, 3, 4])
            assert_group_failed(obs, rewards, dones, infos, [0, 1], words, named(0, 0, 1))
            assert_ok(obs, rewards, dones, infos, [2, 3], [0, 0, 3, 4])
            assert_group_comes_back(pool, [0, 1], pids)


def test_a_members_info_nested_within_the_limits_is_carried(hostile):
    pool = hostile(4)
    pool.reset(seed=0)
    obs, rewards, dones, infos = pool.step([1, 2, {"op": "deep", "depth": 400}, 4])
    assert rewards.tolist() == [1, 2, 1, 1] and not dones.any()  # its own (forged) results, believed
    depth, value = 0, infos[2]["x"]
    while isinstance(value, list):
        depth, value = depth + 1, value[0] if value else None
    assert depth == 400


def test_a_members_obs_that_cannot_cross_the_wire_fails_that_env_only(hostile):
    pool = hostile(4)
    pool.reset(seed=0)
    pids = pool.pids()
    obs, rewards, dones, infos = pool.step([1, 2, {"op": "unencodable"}, 4])
    assert dones[2] and obs[2] is None and "cannot cross the wire" in infos[2]["error"]
    assert "sandbox" not in infos[2]["error"]
    assert_ok(obs, rewards, dones, infos, [0, 1, 3], [1, 2, 0, 4])
    assert obs[3] == {"t": 1} and pool.pids() == pids
    obs, rewards, dones, infos = pool.step([1, 2, 3, 4])
    assert_ok(obs, rewards, dones, infos, range(4), [1, 2, 3, 4])


# An env whose infos are numpy numbers (as MuJoCo's are), and by its action other shapes of info:
# another dtype in one env (7), another key order (8), a Python float (9), a numpy bool (10).
COLUMNS_ENV = """
    import os

    import gymnasium as gym
    import numpy as np

    from boltzlabs.env import serve

    LANE = int(os.environ["BOLTZLABS_ENV_INDEX"])


    def reset(seed, options=None):
        return np.zeros(2, np.float32), {}


    def step(action):
        info = {"x": np.float32(LANE + action / 4), "n": np.int64(-LANE), "z": np.complex64(LANE + 1j)}
        if action == 7 and LANE == 4:
            info["x"] = np.float64(info["x"])
        if action == 8 and LANE == 4:
            info = dict(reversed(info.items()))
        if action == 9:
            info["x"] = float(info["x"])
        if action == 10:
            info["ok"] = np.bool_(LANE % 2)
        return np.full(2, LANE, np.float32), 0.0, False, False, info


    serve(reset=reset, step=step, observation_space=gym.spaces.Box(-1e3, 1e3, (2,), np.float32),
          action_space=gym.spaces.Discrete(11))
"""


def test_the_adapter_batches_a_grouped_pools_info_columns_as_it_batches_each_envs_info(env_dir, pool_factory):
    """BoltzLabsVecEnv's infos from a grouped pool (batched from its sandboxes' info columns when
    they allow it) equal those over a sandbox per env: keys, order, dtypes, values and masks."""
    from boltzlabs.gym import BoltzLabsVecEnv

    source = env_dir(COLUMNS_ENV)
    grouped = pool_factory(source, 7, envs_per_sandbox=3)
    vecs = [BoltzLabsVecEnv(grouped), BoltzLabsVecEnv(pool_factory(source, 7))]
    for vec in vecs:
        vec.reset(seed=0)
    took = []
    for action in (1, 7, 2, 8, 3, 9, 10, 4):
        got, want = (vec.step(np.full(7, action))[4] for vec in vecs)
        took.append(grouped._columns is not None and grouped.batched_infos(grouped._columns[0]) is not None)
        assert list(got) == list(want), action
        for key in want:
            assert type(got[key]) is type(want[key]) and got[key].dtype == want[key].dtype, (action, key)
            if key not in ("episode_ids", "_episode_ids"):  # each pool's own ids
                assert got[key].tolist() == want[key].tolist(), (action, key)
    assert took == [True, False, True, False, True, False, False, True]  # the shortcut, where it applies


ROWS_ENV = """
    import os

    import gymnasium as gym
    import numpy as np

    from boltzlabs.env import serve

    LANE = int(os.environ["BOLTZLABS_ENV_INDEX"])


    def reset(seed, options=None):
        return np.full(3, -LANE, np.float32), {"lane": LANE}


    def step(action):
        obs = (np.asarray(action, np.float32) * 2 + LANE).astype(np.float32)
        return obs, float(LANE), bool(action[0] > 9), False, {"x": np.float64(LANE), "y": np.float32(action[1])}


    serve(reset=reset, step=step, observation_space=gym.spaces.Box(-1e6, 1e6, (3,), np.float32),
          action_space=gym.spaces.Box(-1e6, 1e6, (3,), np.float32))
"""


OFF_SPEC_ENV = """
    import os

    import gymnasium as gym
    import numpy as np

    from boltzlabs.env import serve

    LANE = int(os.environ["BOLTZLABS_ENV_INDEX"])


    class Sub(np.ndarray):
        pass


    def obs_for(how):
        plain = np.full(3, LANE, np.float32)
        return {
            0: plain,
            1: plain.astype(np.float64),  # another dtype
            2: np.zeros(4, np.float32),  # another shape
            3: plain.tolist(),  # not an array
            4: plain.view(Sub),  # a subclass (which no wire carries)
            5: np.float32(LANE),  # a numpy scalar
        }[how]


    def reset(seed, options=None):
        return obs_for(0), {}


    def step(action):
        return obs_for(int(action)), 1.0, False, False, {}


    serve(reset=reset, step=step, observation_space=gym.spaces.Box(-1e6, 1e6, (3,), np.float32))
"""


@pytest.mark.parametrize("how", [1, 2, 3, 4, 5])
def test_an_obs_off_the_space_sends_its_groups_obs_by_the_wire_each_as_the_env_returned_it(env_dir, pool_factory, how):
    """The group's slot holds only arrays of the member's exact shape and dtype: one member's obs
    of another dtype, shape or type sends every obs of its group by the wire, where each env's
    comes as its sandbox alone gives it (and the next plain step is in the slot again)."""
    source = env_dir(OFF_SPEC_ENV)
    grouped, alone = pool_factory(source, 5, envs_per_sandbox=3), pool_factory(source, 5)
    for pool in (grouped, alone):
        pool.reset(seed=0)
    actions = [0, how, 0, 0, 0]
    got, want = (pool.step_full(actions) for pool in (grouped, alone))
    failed = [1] if how == 4 else []  # a subclass cannot cross the wire: that env fails, in either pool
    assert np.flatnonzero(got.truncated).tolist() == np.flatnonzero(want.truncated).tolist() == failed
    for i in failed:
        assert "cannot cross the wire" in got.infos[i]["error"] and "cannot" in want.infos[i]["error"]
    for mine, theirs in zip(got.obs, want.obs):
        assert type(mine) is type(theirs) and np.asarray(mine).tolist() == np.asarray(theirs).tolist()
        if isinstance(mine, np.ndarray):
            assert mine.dtype == theirs.dtype and mine.shape == theirs.shape
    assert grouped.batched_obs(got.obs) is None  # group 0 by the wire: no one batch this step
    plain = grouped.step_full([0] * 5)
    assert grouped.batched_obs(plain.obs) is not None  # back in the slots
    assert [o.tolist() for o in plain.obs] == [[float(i)] * 3 for i in range(5)]


@pytest.mark.parametrize("copy", [True, False])
def test_the_adapter_steps_a_grouped_pool_with_one_array_each_way(env_dir, pool_factory, copy):
    """A Box's batch of actions goes to a grouped pool as the one array it is, and the obs come back
    as the one array of the groups' slots (Pool.batched_obs), its infos as their columns
    (step_full(lazy_infos=True)): what the adapter returns equals what it returns over a sandbox per
    env, a group smaller than the others included, and is the caller's own (copy=True) or the
    adapter's one buffer (copy=False), never the pool's."""
    from boltzlabs.gym import BoltzLabsVecEnv

    source = env_dir(ROWS_ENV)
    grouped = pool_factory(source, 7, envs_per_sandbox=3)
    vecs = [BoltzLabsVecEnv(grouped, copy=copy), BoltzLabsVecEnv(pool_factory(source, 7), copy=copy)]
    for vec in vecs:
        vec.reset(seed=0)
    rng = np.random.default_rng(1)
    batched = []
    for step in range(6):
        actions = rng.uniform(-5, 5, (7, 3)).astype(np.float32)
        if step == 2:
            actions[4, 0] = 20.0  # env 4 terminates: the next step resets it
        if step == 4:
            actions = np.asfortranarray(actions.astype(np.float64))  # another dtype, not C-contiguous
        (obs, rewards, terminated, truncated, infos), want = (vec.step(actions) for vec in vecs)
        batched.append(grouped._obs_batch is not None)  # the step gave batched_obs its array
        plain = vecs[1].pool
        assert plain.batched_obs(plain._obs) is not None, step  # k = 1: its slot batch, autoresets included
        assert np.array_equal(obs, want[0]) and obs.dtype == want[0].dtype and obs.shape == (7, 3), step
        assert rewards.tolist() == want[1].tolist() and terminated.tolist() == want[2].tolist(), step
        assert list(infos) == list(want[4]), step
        for key in want[4]:
            if key not in ("episode_ids", "_episode_ids", "episode_record"):
                assert infos[key].dtype == want[4][key].dtype and infos[key].tolist() == want[4][key].tolist()
        if step != 3:  # env 4 reset on step 3: its obs is the reset's
            assert np.array_equal(obs, (actions.astype(np.float32) * 2 + np.arange(7)[:, None]).astype(np.float32))
        assert obs.flags.writeable
        before = np.stack(grouped.observations).copy()
        obs[...] = 123.0  # the caller's to change: the pool's obs are not
        assert np.array_equal(np.stack(grouped.observations), before)
        if not copy:
            assert obs is vecs[0]._observations
    assert batched == [True] * 6  # the step that reset env 4 too: its reset obs is its row of the batch
    # Its pool stepped directly: each env's info is its dict, made from the columns.
    result = grouped.step_full(np.zeros((7, 3), np.float32))
    assert result.infos == [{"x": float(i), "y": 0.0} for i in range(7)]
    lazy = grouped.step_full(np.zeros((7, 3), np.float32), lazy_infos=True)
    assert lazy.infos == [None] * 7  # left in the columns: the adapter batches them
    assert grouped.batched_infos(lazy.infos)["x"].tolist() == list(range(7))
    assert lazy.infos == [None] * 7


# -- 7. the direct step (docs/native-step.md#the-direct-step) ---------------------------------------

needs_native = pytest.mark.skipif(os.environ.get("BOLTZLABS_PURE", "") not in ("", "0"), reason="the pure path")


def lent(pool) -> bool:
    """Whether the grouped pool's sandboxes are lent to this process now."""
    return pool.inner._lent is not None


@needs_native
def test_a_direct_step_reads_each_groups_reply_whole_in_c_as_python_reads_it(env_dir, pool_factory):
    """The hot path of a grouped step (GroupedPool._read_whole: Batch.groups reads every group's
    plain reply into the arrays, the slots give the obs) gives exactly what decoding each reply
    and checking it group by group gives: every step of it, autoresets and info columns included."""
    source = env_dir(ROWS_ENV)
    fast, slow = pool_factory(source, 7, envs_per_sandbox=3), pool_factory(source, 7, envs_per_sandbox=3)
    read = []
    whole = fast._read_whole

    def counted(*args):
        step = whole(*args)
        read.append(step is not None)
        return step

    fast._read_whole = counted
    slow._read_whole = lambda *args: None  # every reply decoded, as without C
    for pool in (fast, slow):
        pool.reset(seed=0)
    rng = np.random.default_rng(2)
    resets = None
    left = []  # the steps whose infos were left in the columns
    for step in range(8):
        actions = rng.uniform(-5, 5, (7, 3)).astype(np.float32)
        if step in (2, 5):
            actions[[1, 6], 0] = 20.0  # envs 1 and 6 terminate: the next step resets them
        lazy = step % 2 == 1
        got, want = (pool.step_full(actions, resets, lazy_infos=lazy) for pool in (fast, slow))
        assert [o.tolist() for o in got.obs] == [o.tolist() for o in want.obs], step
        assert all(type(o) is np.ndarray and not o.flags.writeable for o in got.obs)
        for mine, theirs in zip(got[1:4], want[1:4]):
            assert mine.dtype == theirs.dtype and mine.tolist() == theirs.tolist(), step
        assert got.infos == want.infos, step
        if got.infos == [None] * 7:  # lazy: left in the groups' columns, batched when asked
            left.append(step)
            for key, value in slow.batched_infos(want.infos).items():
                assert fast.batched_infos(got.infos)[key].tolist() == value.tolist()
        elif step not in (3, 6):  # each env's dict made of the columns (a step with resets sends dicts)
            assert got.infos[0] == {"x": 0.0, "y": float(actions[0, 1])}
        assert np.array_equal(fast.batched_obs(got.obs), slow.batched_obs(want.obs))
        assert fast.finished_episodes == [] or [e["length"] for e in fast.finished_episodes] == [
            e["length"] for e in slow.finished_episodes
        ]
        resets = np.flatnonzero(got.terminated).tolist() or None
    assert read == [True] * 8 and left == [1, 5, 7]


# A group with a slot (a Box space) whose turn may forge its plain-looking reply: what the trainer
# reads in C (Batch.groups) must fail the group as decoding it does.
FORGE_SLOT_ENV = """
    import os

    import gymnasium as gym
    import msgpack
    import numpy as np

    from boltzlabs import wire
    from boltzlabs.env import serve
    from boltzlabs.runtime import group

    if not getattr(group.Group, "forging", False):  # env.py runs once per member: wrap once
        _turn, _put = group.Group.turn, group.Group.put

        def turn(self, channel, seq, entries, code, *rest):
            out = _turn(self, channel, seq, entries, code, *rest)
            op, group.op = getattr(group, "op", None), None
            if op is None:
                return out
            forge(op, seq, len(self.members))  # after put(): the slot is this turn's, or left stale
            return b""

        def put(self, *args):
            if getattr(group, "op", None) == "stale":  # this turn's obs never reach the slot
                return None
            return _put(self, *args)

        group.Group.turn, group.Group.put = turn, put
        group.Group.forging = True


    def forge(op, seq, count):
        kinds, rewards, flags = [0] * count, [1.0] * count, [False] * count
        if op == "kinds":
            kinds[-1] = 1  # an env stepped answers as reset
        elif op == "int_flags":
            flags = [0] * count
        marker = msgpack.ExtType(wire.SLOT_EXT, (seq - (op == "other_seq")).to_bytes(8, "little"))
        results = [kinds, rewards, flags, list(flags), [{}] * count, [None] * count]
        # "stale": a plain reply, but the slot still holds the last turn's obs (put() did not run)
        body = wire.encode([wire.STEPPED, seq, marker, 0.0, False, False, {group.GROUP_KEY: results}])
        view = memoryview(body)
        while view:
            view = view[os.write(3, view):]


    def reset(seed, options=None):
        return np.zeros(3, np.float32), {}


    def step(action):
        if action[0] > 0:
            group.op = ["stale", "kinds", "int_flags", "other_seq"][int(action[0]) - 1]
        return np.full(3, action[1], np.float32), 1.0, False, False, {}


    serve(reset=reset, step=step, observation_space=gym.spaces.Box(-1e6, 1e6, (3,), np.float32),
          action_space=gym.spaces.Box(-1e6, 1e6, (2,), np.float32))
"""


@needs_native
@pytest.mark.parametrize(
    "attack, said",
    [
        (1, "its observation in shared memory does not match its reply"),
        (2, "member 1 was sent kind 0 and answered kind 1"),
        (3, "member 0's reward or done flags are not a number and bools"),
        (4, "for request 2 while the reply to request 3 was due (a protocol violation)"),
    ],
    ids=["stale_slot", "kinds", "int_flags", "other_seq"],
)
def test_a_forged_plain_reply_with_a_slot_fails_its_own_group_only(env_dir, pool_factory, attack, said):
    """A group with a slot that forges the plain reply the trainer reads in C (a stale slot, a
    kind not sent, ints for bools, a marker of another step) fails its own envs, each saying
    why and naming its sandbox, as the decoded path says it; the other group steps whole."""
    pool = pool_factory(env_dir(FORGE_SLOT_ENV), 4, envs_per_sandbox=2, warmup=False)  # no forging probe
    pool.reset(seed=0)
    pool.step_full(np.zeros((4, 2), np.float32))  # every slot holds a first obs
    actions = np.array([[0, 5], [0, 6], [attack, 7], [0, 8]], np.float32)
    result = pool.step_full(actions)
    assert np.flatnonzero(result.truncated).tolist() == [2, 3], result.infos
    for i in (2, 3):
        assert result.obs[i] is None and result.rewards[i] == 0.0
        assert said in result.infos[i]["error"] and named(1, 2, 3) in result.infos[i]["error"], result.infos[i]
    assert [result.obs[i].tolist() for i in (0, 1)] == [[5.0] * 3, [6.0] * 3]
    pool.reset(where=[2], seed=0)  # the group comes back, whole
    again = pool.step_full(np.array([[0, 1], [0, 2], [0, 3], [0, 4]], np.float32))
    assert not again.truncated.any() and [o.tolist()[0] for o in again.obs] == [1.0, 2.0, 3.0, 4.0]


@needs_native
def test_a_local_grouped_pool_steps_its_sandboxes_itself_with_the_workers_results(pool_factory):
    """The direct step gives what the worker's step gives: the same obs (through the slots), rewards,
    flags and infos, autoresets included, for the same seeds and actions."""
    direct = pool_factory("gym://CartPole-v1", 7, envs_per_sandbox=3)
    relayed = pool_factory("gym://CartPole-v1", 7, envs_per_sandbox=3)
    relayed.inner.direct = False
    assert direct.inner.direct and direct.shared_memory
    direct.reset(seed=5)
    relayed.reset(seed=5)
    rng = np.random.default_rng(0)
    dones = np.zeros(7, bool)
    ended = 0
    for _ in range(60):
        actions = rng.integers(0, 2, 7).tolist()
        resets = np.flatnonzero(dones).tolist()  # next-step autoreset, as the adapter sends it
        a, b = direct.step_full(actions, resets), relayed.step_full(actions, resets)
        assert np.array_equal(np.stack(a.obs), np.stack(b.obs))
        assert a.rewards.tolist() == b.rewards.tolist() and a.terminated.tolist() == b.terminated.tolist()
        assert a.truncated.tolist() == b.truncated.tolist() and a.infos == b.infos
        dones = a.terminated | a.truncated
        ended += int(dones.sum())
        assert lent(direct) and not lent(relayed)
        assert direct.timing.worker_ms == direct.timing.roundtrip_ms  # no worker in between
    assert ended >= 7  # CartPole's random episodes end within 60 steps: autoresets went both ways


@needs_native
def test_any_call_between_direct_steps_takes_the_sandboxes_back(probe_pool):
    pool = probe_pool(5, envs_per_sandbox=2)
    pool.reset(seed=0)
    for call in (pool.pids, pool.states, pool.memory, lambda: pool.reset(where=[1], seed=3), pool.pids):
        obs, rewards, dones, infos = pool.step([1, 2, 3, 4, 5])
        assert_ok(obs, rewards, dones, infos, range(5), [1, 2, 3, 4, 5])
        assert lent(pool)
        call()
        assert not lent(pool)
    assert pool.states() == ["idle"] * 5


@needs_native
def test_a_group_killed_while_lent_fails_its_envs_with_the_cause(probe_pool):
    """Killed between two direct steps, with nothing asked of the worker since: the next step's
    write or read finds it gone, the worker says why, and only its envs fail."""
    pool = probe_pool(5, envs_per_sandbox=2)
    pool.reset(seed=0)
    pids = pool.pids()
    pool.step([1, 2, 3, 4, 5])
    assert lent(pool)
    sandbox = psutil.Process(pids[2])
    tree = [sandbox, *sandbox.children(recursive=True)]
    os.kill(pids[2], signal.SIGKILL)
    assert wait_until(lambda: all(has_ended(process) for process in tree))  # its process follows its bwrap
    obs, rewards, dones, infos = pool.step([1, 2, 3, 4, 5])
    assert_group_failed(obs, rewards, dones, infos, [2, 3], "killed by SIGKILL", named(1, 2, 3))
    assert_ok(obs, rewards, dones, infos, [0, 1, 4], [1, 2, 0, 0, 5])
    pool.reset(where=[2, 3], seed=0)
    obs, rewards, dones, infos = pool.step([1, 2, 3, 4, 5])
    assert_ok(obs, rewards, dones, infos, range(5), [1, 2, 3, 4, 5])
    assert lent(pool)


@pytest.mark.parametrize("direct", [True, False])
def test_a_frame_nobody_asked_for_fails_its_group_only(hostile, direct):
    """A group that writes between two steps (lent to the trainer or read by the worker) is killed
    for it at the latest by the next step, which fails its envs and no other; it comes back at reset."""
    pool = hostile()
    pool.inner.direct = direct and pool.fast_path
    pool.reset(seed=0)
    pids = pool.pids()
    obs, rewards, dones, infos = pool.step([1, 2, {"op": "unasked"}, 4, 5, 6])
    assert_ok(obs, rewards, dones, infos, range(6), [1, 2, 0, 4, 5, 6])
    wait_until(lambda: False, timeout=0.3)  # the unasked frame is written meanwhile
    obs, rewards, dones, infos = pool.step([1, 2, 3, 4, 5, 6])
    assert_group_failed(obs, rewards, dones, infos, [2, 3], "(a protocol violation) and was killed", named(1, 2, 3))
    assert_ok(obs, rewards, dones, infos, [0, 1, 4, 5], [1, 2, 0, 0, 5, 6])
    assert_group_comes_back(pool, [2, 3], pids)


@needs_native
def test_a_straggler_of_a_direct_step_is_killed_after_its_grace(probe_pool):
    pool = probe_pool(4, envs_per_sandbox=2, step_timeout=scaled(1.0))
    pool.reset(seed=0)
    pool.step([1, 2, 3, 4])
    assert lent(pool)
    obs, rewards, dones, infos = pool.step([1, 2, {"op": "sleep", "s": 60}, 4])
    assert_group_failed(obs, rewards, dones, infos, [2, 3], "missed the step deadline", named(1, 2, 3))
    assert infos[2]["straggler"] and pool.timing.stragglers == [2, 3]
    assert_ok(obs, rewards, dones, infos, [0, 1], [1, 2])
    assert pool.states()[2] == "straggler"
    assert wait_until(lambda: pool.states()[2] == "dead", timeout=30)  # straggler_grace, then killed


def test_a_gated_pool_is_never_lent(probe_pool):
    pool = probe_pool(4, envs_per_sandbox=2, serialize_measurement=True)
    pool.reset(seed=0)
    for _ in range(3):
        obs, rewards, dones, infos = pool.step([1, 2, 3, 4])
        assert_ok(obs, rewards, dones, infos, range(4), [1, 2, 3, 4])
    assert not lent(pool) and not pool.inner.direct  # refused once, for good


@needs_native
def test_an_interrupted_direct_step_closes_the_pool_and_leaves_nothing(probe_pool):
    pool = probe_pool(4, envs_per_sandbox=2, step_timeout=scaled(30))
    pool.reset(seed=0)
    pool.step([1, 2, 3, 4])
    pids = pool.pids()
    pool.step([1, 2, 3, 4])
    assert lent(pool)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(KeyboardInterrupt):
            pool.step([1, 2, {"op": "sleep", "s": 60}, 4])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert not lent(pool)
    with pytest.raises(PoolClosedError):
        pool.step([1, 2, 3, 4])
    pool.close()
    assert wait_until(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in set(pids)))


def test_direct_rest_from_a_client_without_a_lending_is_refused(probe_pool):
    """The worker checks what a client sends of a direct step: no lending, no lane of its own."""
    pool = probe_pool(4, envs_per_sandbox=2)
    pool.reset(seed=0)
    pool.inner.direct = False
    for args in ([5, 1.0, []], [1, 1.0, [[0, 2, b"x"]]], ["x", 1.0, []], [1, 1.0, [[9, 0, None]]], [1, 1.0, "x"]):
        with pytest.raises(ValueError, match="direct_rest"):
            pool.inner._call("direct_rest", *args)
    obs, rewards, dones, infos = pool.step([1, 2, 3, 4])
    assert_ok(obs, rewards, dones, infos, range(4), [1, 2, 3, 4])


ACTION_ENV = """
    from boltzlabs.env import serve


    def reset(seed, options=None):
        return 0, {}


    def step(action):
        seen = {"type": type(action).__name__, "dtype": str(getattr(action, "dtype", "")),
                "shape": list(getattr(action, "shape", ())), "writeable": bool(getattr(getattr(action, "flags", None), "writeable", False)),
                "value": action.tolist() if hasattr(action, "tolist") else action}
        return 0, 0.0, False, False, seen


    serve(reset=reset, step=step)
"""


@pytest.mark.parametrize(
    "actions",
    [
        [np.arange(6, dtype=np.float32).reshape(2, 3) + i for i in range(5)],  # rows of one array per sandbox
        [np.array([i, -i], dtype=np.int8) for i in range(5)],
        [np.array([True, False])] * 5,
        [np.float64(i) for i in range(5)],  # numpy scalars of one type (a Discrete's): one array
        [np.int64(i) for i in range(4)] + [np.int32(4)],  # numpy scalars of two types: an entry each
        [np.bool_(i % 2) for i in range(5)],
        list(range(5)),  # Python ints: an entry each
        [np.array(i) for i in range(5)],  # 0-d arrays: an entry each
        [np.zeros(2), np.zeros(3), np.zeros(2), np.zeros(2), np.zeros(2)],  # shapes differ: an entry each
        [np.zeros(2), np.zeros(2, np.float32), np.zeros(2), np.zeros(2), np.zeros(2)],  # dtypes differ
        np.arange(30, dtype=np.float32).reshape(5, 2, 3),  # one array: its slices are packed as they are
        np.arange(60.0).reshape(5, 12)[:, ::3],  # one array, not contiguous
        np.arange(10, dtype=">i4").reshape(5, 2),  # one array, big-endian
        np.array([[True, False]] * 5),
    ],
    ids=[
        "float32_2d",
        "int8",
        "bool",
        "scalars",
        "mixed_scalars",
        "bool_scalars",
        "ints",
        "0d",
        "shapes",
        "dtypes",
        "array",
        "strided",
        "big_endian",
        "bools",
    ],
)
def test_each_member_gets_its_action_as_a_sandbox_of_its_own_would(env_dir, pool_factory, actions):
    """However a group's actions travel (one array of rows when they are arrays of one shape and
    dtype, an entry each otherwise), each env gets what it gets with envs_per_sandbox=1: the same
    type, dtype, shape, value, read-only."""
    source = env_dir(ACTION_ENV)
    grouped, alone = pool_factory(source, 5, envs_per_sandbox=3), pool_factory(source, 5)
    grouped.reset(seed=0)
    alone.reset(seed=0)
    want = alone.step(actions)[3]
    got = grouped.step(actions)[3]
    assert got == want
    assert [info["value"] for info in got] == [a.tolist() if hasattr(a, "tolist") else a for a in actions]


@pytest.mark.parametrize("resets", [[1], [0, 2, 4], [0, 1, 2, 3, 4]], ids=["one", "some", "all"])
def test_a_step_with_resets_sends_its_rows_whole_and_each_env_gets_what_alone_it_would(
    env_dir, pool_factory, monkeypatch, resets
):
    """step_full(rows, resets=...) (next-step autoreset, the adapter's) sends each group its rows and
    the members it resets, not an entry per member; every env gets what it gets with
    envs_per_sandbox=1: a reset's obs, info, reward 0 and no ending, or its step's."""
    from boltzlabs.pool import groups

    source = env_dir(ACTION_ENV)
    grouped, alone = pool_factory(source, 5, envs_per_sandbox=3), pool_factory(source, 5)
    grouped.reset(seed=0)
    alone.reset(seed=0)
    actions = np.arange(10, dtype=np.float32).reshape(5, 2)
    want = alone.step_full(actions, resets=resets)

    def entries(*args):
        raise AssertionError("a step of rows with resets went an entry per member")

    monkeypatch.setattr(groups, "_packed", entries)
    got = grouped.step_full(actions, resets=resets)
    assert got.infos == want.infos
    assert [info == {} for info in got.infos] == [i in resets for i in range(5)]
    assert got.obs == want.obs
    for name in ("rewards", "terminated", "truncated"):
        assert getattr(got, name).tolist() == getattr(want, name).tolist()


FORGE_RESET_ENV = """
    from boltzlabs.env import serve
    from boltzlabs.runtime import group

    if not getattr(group.Group, "forging", False):  # env.py runs once per member: wrap once
        _encode = group.Group.encode

        def encode(self, frame, obs, infos, errors, kinds):
            op, group.op = getattr(group, "op", None), None
            results = frame[-1][group.GROUP_KEY]
            if op == "reward":  # every member, the one reset too, says reward 5 and terminated
                results[1], results[2] = [5.0] * len(kinds), [True] * len(kinds)
            elif op == "kinds":  # the member reset answers as stepped
                results[0] = [0] * len(kinds)
            return _encode(self, frame, obs, infos, errors, kinds)

        group.Group.encode = encode
        group.Group.forging = True


    def reset(seed, options=None):
        return 0, {"reset": 1}


    def step(action):
        group.op = {1: "reward", 2: "kinds"}.get(int(action[0]), getattr(group, "op", None))
        return 1, 0.0, False, False, {}


    serve(reset=reset, step=step)
"""


def test_a_group_gives_an_env_it_resets_no_reward_no_ending_and_no_other_kind(env_dir, pool_factory):
    """A reset's reward and endings are the pool's (0, not done), whatever the group says of them;
    a group that answers a reset as a step fails, its own envs only."""
    pool = pool_factory(env_dir(FORGE_RESET_ENV), 4, envs_per_sandbox=2)
    pool.reset(seed=0)
    actions = np.zeros((4, 1), np.float32)
    actions[0] = 1
    result = pool.step_full(actions, resets=[1])
    assert result.rewards.tolist() == [5.0, 0.0, 0.0, 0.0]
    assert result.terminated.tolist() == [True, False, False, False]
    assert result.infos == [{}, {"reset": 1}, {}, {}]
    actions[0] = 2
    result = pool.step_full(actions, resets=[1])
    for i in (0, 1):
        assert "member 1 was sent kind 1 and answered kind 0" in result.infos[i]["error"], result.infos[i]
        assert result.truncated[i] and result.obs[i] is None
    assert result.infos[2:] == [{}, {}] and result.obs[2:] == [1, 1]


class _Returns(tuple):
    """A tuple of another type: the step's return takes the checked path."""


@pytest.mark.parametrize(
    "returned, expected",
    [
        ((np.zeros(2), 1.5, False, True, {"a": 1}), (1.5, False, True, {"a": 1}, None)),
        ((np.zeros(2), np.float32(2.0), np.bool_(True), 0, {}), (2.0, True, False, {}, None)),
        ((np.zeros(2), 3, 1, {}), (3.0, True, False, {}, None)),  # the 4-tuple: done, never truncated
        ((np.zeros(2), 1.0, False, False, None), (1.0, False, False, {}, None)),  # no info: {}
        (_Returns((np.zeros(2), 4.0, False, False, {})), (4.0, False, False, {}, None)),
        ((np.zeros(2), "much", False, False, {}), "ValueError: could not convert string to float"),
        ((np.zeros(2), 1.0, False, False, [1]), "TypeError: step() returned info of type list; expected a dict"),
        ((np.zeros(2), 1.0, False), "TypeError: step() returned tuple of length 3"),
        ([np.zeros(2), 1.0, False, False, {}], "TypeError: step() returned list"),
    ],
)
def test_a_members_step_return_is_taken_or_fails_that_member_alone(returned, expected):
    """Whatever one member's step returns, the group's turn takes it as serve() does for an env
    of its own (reward a float, flags bools, info a dict) or fails that member alone."""
    from boltzlabs import wire
    from boltzlabs.runtime.group import GROUP_KEY, RESET, STEPPED, Group

    def member(result):
        return {
            "step": lambda action: result,
            "reset": lambda seed, options: (np.zeros(2), {}),
            "observation_space": None,
            "action_space": None,
        }

    plain = (np.ones(2), 0.5, False, False, {})
    group = Group([member(plain), member(returned), member(plain)], 3, 0)

    class Channel:
        space = None

    group.turn(Channel, 1, [[RESET, None, None]] * 3, wire.RESET_DONE)
    data = group.turn(Channel, 2, [[STEPPED, 0]] * 3, wire.STEPPED)
    frame = wire.decode(data[wire.HEADER.size :], wire.Limits(1 << 20))
    kinds, rewards, terminated, truncated, infos, errors = frame[6][GROUP_KEY]
    assert kinds == [STEPPED] * 3
    for j in (0, 2):  # the others stepped as ever
        assert (rewards[j], terminated[j], truncated[j], infos[j], errors[j]) == (0.5, False, False, {}, None)
    if isinstance(expected, tuple):
        got = (rewards[1], terminated[1], truncated[1], infos[1], errors[1])
        assert got == expected and [type(x) for x in got[:3]] == [float, bool, bool]
    else:
        assert errors[1][0] == "step" and errors[1][1].startswith(expected), errors[1]


@pytest.mark.parametrize("members", [[1, 0], [0, 0], [2], ["0"], [True], [-1], 1, [0, 1, 1]])
def test_a_group_refuses_a_malformed_list_of_members_to_reset(members):
    from boltzlabs.errors import ProtocolError
    from boltzlabs.runtime.group import _listed

    assert _listed([0, 1], 2) == [0, 1]
    with pytest.raises(ProtocolError, match="as the members to reset"):
        _listed(members, 2)


# -- the options ---------------------------------------------------------------------------------


def test_vectorization_mode_sync_async_and_anything_else(spawn):
    with RLPool(PROBE, 3, vectorization_mode="sync", spawn=spawn) as pool:
        assert isinstance(pool, GroupedPool) and pool.sandboxes == 1 and len(set(pool.pids())) == 1
        pool.reset(seed=0)
        assert pool.step([1, 2, 3])[1].tolist() == [1, 2, 3]
    with RLPool(PROBE, 3, vectorization_mode="async", spawn=spawn) as pool:
        assert not isinstance(pool, GroupedPool) and len(set(pool.pids())) == 3
    with RLPool(PROBE, 3, envs_per_sandbox=1, spawn=spawn) as pool:
        assert not isinstance(pool, GroupedPool) and len(set(pool.pids())) == 3
    with pytest.raises(ValueError, match="vectorization_mode must be 'sync'"):
        RLPool(PROBE, 3, vectorization_mode="threads")
    for bad in (0, 1.5, True, "2"):
        with pytest.raises(ValueError, match="envs_per_sandbox must be a whole number"):
            RLPool(PROBE, 3, envs_per_sandbox=bad)


def test_trust_env_with_groups_is_refused():
    with pytest.raises(ValueError, match="trust_env=True imports env.py in the template"):
        RLPool(PROBE, 4, envs_per_sandbox=2, trust_env=True)


@pytest.mark.parametrize(
    "args, kwargs",
    [
        ((PROBE, 3), {}),
        ((PROBE,), {"n": 3}),
        ((), {"source": PROBE, "n": 3}),
    ],
)
def test_envs_per_sandbox_groups_with_every_spelling_of_the_arguments(args, kwargs):
    with RLPool(*args, envs_per_sandbox=2, **kwargs) as pool:
        assert isinstance(pool, GroupedPool) and pool.sandboxes == 2 and grouped(pool.pids(), 2)


def test_the_group_floor_benchmark_prints_each_implementation_and_where_a_step_goes():
    """benchmarks/bench_group_floor.py, tiny (a smoke run, autoresets and a smaller last group
    included): its rows, in order, and where a step of ours goes; the lean step where the direct C
    step is built, said to be left out where it is not."""
    from boltzlabs.worker import native

    lean = ["lean k=2"] if native.load()[0] is not None else []
    out = subprocess.run(
        [
            sys.executable,
            str(FLOOR),
            "--env",
            "CartPole-v1",
            "--n",
            "5",
            "--k",
            "2",
            "--rounds",
            "1",
            "--chunk",
            "0.2",
        ],
        capture_output=True,
        text=True,
        timeout=scaled(180),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and "env-steps/s" not in line]
    assert [row.split("|")[1].strip() for row in rows] == ["sync", "floor", *lean, "boltzlabs k=2"], out.stdout
    assert "A step of ours" in out.stdout and "The floor's step" in out.stdout, out.stdout
    if lean:
        assert "The lean step" in out.stdout, out.stdout
    else:
        assert "Lean: left out (no direct step here" in out.stderr, out.stderr


def test_the_group_floor_benchmark_refuses_a_group_larger_than_the_pool():
    out = subprocess.run(
        [sys.executable, str(FLOOR), "--n", "4", "--k", "8"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "1 <= k <= n" in out.stderr, out.stderr


TYPE_OF_ACTION = """
from boltzlabs.env import serve


def step(action):
    return type(action).__module__ + "." + type(action).__name__, 0.0, False, {}


serve(reset=lambda seed: "", step=step)
"""


@pytest.mark.parametrize("k", [1, 2])
def test_a_1d_array_of_actions_gives_python_scalars_or_with_array_items_numpy_scalars(env_dir, pool_factory, k):
    """step_full(array_items=True) (the adapter's): each env its item of a 1-d batch as the numpy
    scalar Gymnasium's iterate gives; by default a Python scalar, as step() documents."""
    pool = pool_factory(env_dir(TYPE_OF_ACTION), 3, envs_per_sandbox=k)
    pool.reset(seed=0)
    assert pool.step_full(np.arange(3))[0] == ["builtins.int"] * 3
    assert pool.step_full(np.arange(3), array_items=True)[0] == ["numpy.int64"] * 3
    assert pool.step_full(np.linspace(0, 1, 3, dtype=np.float32), array_items=True)[0] == ["numpy.float32"] * 3
