"""A pool over several worker processes (RLPool(source, n, workers=k)): real
workers, real sandboxes, small n, uneven splits. Nothing is mocked."""

import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import psutil
import pytest

from boltzlabs import PoolClosedError, RLPool, WorkerError
from boltzlabs.errors import EnvError, EnvStartError
from boltzlabs.pool.client import ShardedPool
from boltzlabs.pool.shards import default_workers
from conftest import COUNTER, PROBE, intervals, open_fds, overlaps, scaled, wait_until

TESTS = Path(__file__).resolve().parent
TYPED = TESTS / "envs" / "typed_env"


def _descendants():
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _cgroups(*workers: int) -> set:
    from boltzlabs.host.cgroups import pool_home

    home = pool_home()
    return {p.name for worker in workers for p in home.glob(f"boltzlabs-{worker}-*")}


def _workers(pool) -> list:
    return [shard._proc.pid for shard in pool._shards]


# -- the argument and the default --------------------------------------------------------


@pytest.mark.parametrize(
    "bad, error",
    [(0, ValueError), (4, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError), ("2", TypeError)],
)
def test_bad_workers_are_refused_before_anything_starts(bad, error):
    children = _descendants()
    with pytest.raises(error, match="workers"):
        RLPool(COUNTER, 3, workers=bad)
    assert _descendants() == children


def test_the_default_rule():
    # One worker per 8 cores, at least 256 envs a shard, as many as the fd limit needs.
    assert default_workers(1000, cores=2, fd_capacity=4900) == 1
    assert default_workers(10_000, cores=2, fd_capacity=4900) == 3
    assert default_workers(5000, cores=64, fd_capacity=1 << 20) == 8
    assert default_workers(512, cores=64, fd_capacity=1 << 20) == 2
    assert default_workers(100, cores=128, fd_capacity=1 << 20) == 1
    assert default_workers(5000, cores=64, gated=True, fd_capacity=1 << 20) == 1
    assert default_workers(7, cores=64, fd_capacity=2) == 4
    from boltzlabs.pool.shards import workers_for

    assert workers_for((COUNTER, 10_000), {"worker": "tcp://node:7733"}, None) == 1  # not this machine's cores
    assert workers_for((COUNTER, 10_000), {"worker": "tcp://node:7733"}, 3) == 3
    with RLPool(COUNTER, 2) as pool:  # this 2-core machine: one worker
        assert type(pool) is RLPool and pool.workers == 1


# -- every method over uneven shards ----------------------------------------------------------


@pytest.mark.parametrize("k", [2, 3])
def test_every_method_over_uneven_shards(k):
    n = 7
    with RLPool(PROBE, n, workers=k, step_timeout=scaled(5)) as pool:
        assert isinstance(pool, RLPool) and isinstance(pool, ShardedPool) and pool.workers == k
        assert pool.source == str(PROBE) and repr(pool) == f"RLPool({str(PROBE)!r}, {n}, workers={k}, open)"
        assert pool.shards[0][0] == 0 and pool.shards[-1][1] == n and len(pool.shards) == k
        assert len({end - start for start, end in pool.shards}) == 2  # uneven
        assert len(set(_workers(pool))) == k
        obs = pool.reset(seed=10)
        assert [o["seed"] for o in obs] == [10 + i for i in range(n)]  # lane i: seed + i, as unsharded
        assert all(info == {"reset_info": True} for info in pool.reset_infos)
        obs, rewards, dones, infos = pool.step(list(range(n)))
        assert rewards.tolist() == list(range(n)) and [o["t"] for o in obs] == [1] * n
        assert len(pool.timing.shards) == k and pool.timing.worker_ms == max(pool.timing.shards) > 0
        # A partial reset: only those lanes, the others spliced.
        obs = pool.reset(seed=[100 + i for i in range(n)], where=[1, n - 1])
        assert [o["t"] for o in obs] == [0 if i in (1, n - 1) else 1 for i in range(n)]
        assert obs[n - 1]["seed"] == 100 + n - 1
        mask = np.zeros(n, dtype=bool)
        mask[[0, n - 2]] = True
        before = pool.pids()
        obs = pool.reset(seed=0, where=mask, hard=True)  # respawned: new pids on those lanes only
        after = pool.pids()
        assert [b != a for b, a in zip(before, after)] == mask.tolist()
        assert obs[0]["episodes"] == 1 and obs[n - 2]["seed"] == n - 2
        # step_full with autoresets on lanes of two shards.
        result = pool.step_full([1] * n, resets=[0, n - 1])
        assert result.obs[0]["t"] == 0 and result.obs[n - 1]["t"] == 0 and result.obs[3]["t"] == 2
        assert pool.states() == ["idle"] * n
        assert "reset called" in pool.log(n - 1)
        assert pool.render(n - 1) is None and pool.render_all() == [None] * n
        report = pool.memory()
        assert len(report.per_env) == n and all(v > 0 for v in report.per_env) and report.shared >= 0
        assert pool.envs_per_gb() > 0
        assert len(pool.episode_ids) == n and len(set(pool.episode_ids)) == n
    assert pool.closed
    with pytest.raises(PoolClosedError):
        pool.step([1] * n)


def test_call_get_attr_set_attr_render_across_shards():
    n = 5
    with RLPool(TYPED, n, workers=2) as pool:
        pool.reset(seed=0)
        assert pool.get_attr("label") == ["typed"] * n
        pool.set_attr("gain", [float(i) for i in range(n)])
        assert pool.get_attr("gain") == [float(i) for i in range(n)]
        assert pool.get_attr("gain", env_ids=[4, 0]) == [4.0, 0.0]
        assert pool.call("scaled", 3, by=2, env_ids=[3, 1]) == [(6, np.float32(3.0)), (6, np.float32(1.0))]
        assert pool.get_attr("np_random_seed") == list(range(n))
        with pytest.raises(EnvError, match=r"env 3 could not call 'explode'") as caught:
            pool.call("explode", env_ids=[4, 3])
        assert caught.value.env_index == 3


# -- byte for byte --------------------------------------------------------------------------


def _canon(value):
    """Everything a result says, arrays by dtype, shape and bytes: equal only if byte for byte."""
    if isinstance(value, np.ndarray):
        return ("nd", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, np.generic):
        return ("np", value.dtype.str, value.tobytes())
    if isinstance(value, dict):
        return ("dict", tuple((k, _canon(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_canon(v) for v in value))
    return (type(value).__name__, value)


def _episodes(source, n: int, workers: int, steps: int) -> list:
    rng = np.random.default_rng(7)
    record = []
    with RLPool(source, n, workers=workers) as pool:
        record.append(_canon(pool.reset(seed=3)))
        record.append(_canon(pool.reset_infos))
        for t in range(steps):
            obs, rewards, dones, infos = pool.step(rng.integers(0, 3, n))
            record.append(
                (
                    _canon(obs),
                    rewards.tobytes(),
                    dones.tobytes(),
                    pool.terminated.tobytes(),
                    pool.truncated.tobytes(),
                    _canon(infos),
                )
            )
            if t % 37 == 36:  # a hard reset of some lanes, seeded
                record.append(_canon(pool.reset(seed=[50 + i for i in range(n)], where=[0, n // 2, n - 1], hard=True)))
            elif dones.any():
                record.append(_canon(pool.reset(where=dones)))
            record.append(
                [(e["env"], e["seed"], e["length"], e["return"], e["terminated"]) for e in pool.finished_episodes]
            )
    return record


@pytest.mark.parametrize("source, steps", [(COUNTER, 230), (TYPED, 80)])
def test_sharded_episodes_equal_unsharded_byte_for_byte(source, steps):
    n = 7
    one = _episodes(source, n, 1, steps)
    three = _episodes(source, n, 3, steps)
    assert len(one) == len(three)
    for t, (a, b) in enumerate(zip(one, three)):
        assert a == b, f"record {t} differs"
    assert sum(len(r) for r in one if isinstance(r, list)) >= n  # many episodes ended and were reset


# -- faults on their lanes ------------------------------------------------------------------


def test_a_crash_and_a_hang_in_the_last_shard_come_back_on_their_global_lanes():
    n = 6
    with RLPool(PROBE, n, workers=3, step_timeout=scaled(1.0)) as pool:
        pool.reset(seed=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            obs, rewards, dones, infos = pool.step([1, 2, 3, {"op": "raise"}, {"op": "exit"}, {"op": "loop"}])
        assert rewards.tolist()[:3] == [1.0, 2.0, 3.0] and [o["t"] for o in obs[:3]] == [1, 1, 1]
        assert dones.tolist() == [False, False, False, True, True, True]
        assert "step failed on purpose" in infos[3]["error"] and obs[3] is None
        assert obs[4] is None and "error" in infos[4]
        assert infos[5]["straggler"] and obs[5] is None
        assert pool.timing.stragglers == [5]
        texts = " ".join(str(w.message) for w in caught)
        assert "env 3's step raised" in texts, texts
        assert pool.states()[4] == "dead"
        obs = pool.reset(where=dones)
        assert pool.step([1] * n)[1].tolist() == [1.0] * n


def test_a_shard_whose_worker_is_killed_ends_the_pool_naming_the_shard_and_its_lanes():
    fds, children = open_fds(), _descendants()
    pool = RLPool(PROBE, 6, workers=3)
    pool.reset(seed=0)
    workers, pids = _workers(pool), pool.pids()
    os.kill(workers[1], signal.SIGKILL)
    with pytest.raises(WorkerError, match=r"shard 1 of 3 of this pool \(envs 2-3\) lost its worker.*SIGKILL") as err:
        pool.step([1] * 6)
    assert err.value.signal is signal.SIGKILL
    assert pool.closed
    with pytest.raises(PoolClosedError):
        pool.step([1] * 6)
    assert wait_until(lambda: not any(psutil.pid_exists(p) for p in pids))
    assert wait_until(lambda: not _cgroups(*workers))
    pool.close()
    assert _descendants() == children
    assert open_fds() == fds


def test_a_start_failure_names_an_env_of_the_pool(env_dir):
    broken = env_dir("raise RuntimeError('broken on purpose')\n")
    children = _descendants()
    with pytest.raises(EnvStartError, match="broken on purpose") as caught:
        RLPool(broken, 5, workers=2, start_timeout=scaled(10))
    assert 0 <= caught.value.env_index < 5 and f"env {caught.value.env_index}" in str(caught.value)
    assert wait_until(lambda: _descendants() == children)


# -- send / recv ----------------------------------------------------------------------------


def test_send_recv_takes_the_first_to_finish_across_shards():
    n = 6
    with RLPool(PROBE, n, workers=3, step_timeout=scaled(10)) as pool:
        pool.reset(seed=0)
        slow = {"op": "sleep", "s": scaled(1.5)}
        pool.send([slow, slow, slow, 1, slow, 5])  # lanes 3 and 5 (shards 1 and 2) finish at once
        env_ids, obs, rewards, dones, infos = pool.recv(batch_size=2)
        assert sorted(env_ids.tolist()) == [3, 5] and sorted(rewards.tolist()) == [1.0, 5.0]
        with pytest.raises(ValueError, match="env 4"):
            pool.send([1], env_ids=[4])  # in flight
        with pytest.raises(ValueError, match="in flight"):
            pool.step([1] * n)
        with pytest.raises(ValueError, match="env 0"):
            pool.reset(where=[0])
        pool.send([7], env_ids=[3])  # a received lane may go again
        env_ids, *_ = pool.recv(batch_size=1, timeout=scaled(0.5))
        assert env_ids.tolist() == [3]
        assert pool.states() == ["in_flight", "in_flight", "in_flight", "idle", "in_flight", "idle"]
        env_ids, obs, rewards, dones, infos = pool.recv()
        assert sorted(env_ids.tolist()) == [0, 1, 2, 4] and all(o["out"]["slept"] for o in obs)
        assert pool.states() == ["idle"] * n
        with pytest.raises(ValueError, match="would wait forever"):
            pool.recv(batch_size=1)
        pool.send([1, 1], env_ids=[5, 0], resets=[5])  # an autoreset across shards
        env_ids, obs, *_ = pool.recv()
        assert dict(zip(env_ids.tolist(), [o["t"] for o in obs])) == {5: 0, 0: 2}
        assert pool.step([1] * n)[1].tolist() == [1.0] * n


def test_recv_holds_what_a_shard_gave_beyond_the_batch():
    n = 4
    with RLPool(PROBE, n, workers=2, step_timeout=scaled(10)) as pool:
        pool.reset(seed=0)
        pool.send([1, 2, 3, 4])
        got = []
        for _ in range(n):
            env_ids, _, rewards, _, _ = pool.recv(batch_size=1)
            got += list(zip(env_ids.tolist(), rewards.tolist()))
            assert len(env_ids) == 1
        assert sorted(got) == [(0, 1.0), (1, 2.0), (2, 3.0), (3, 4.0)]


# -- the gate spans the pool ------------------------------------------------------------------


def test_serialize_measurement_never_measures_two_envs_at_once_over_shards():
    n = 4
    with RLPool(PROBE, n, workers=2, serialize_measurement=True, step_timeout=scaled(5)) as pool:
        assert pool.workers == 2
        pool.reset(seed=0)
        obs, *_ = pool.step([{"op": "interval", "s": 0.05}] * n)
        spans = intervals(obs)
        assert len(spans) == n and not overlaps(spans), spans
        assert pool.timing.worker_ms >= n * 50 and len(pool.timing.shards) == 2
        pool.send([{"op": "interval", "s": 0.05}] * n)
        assert pool.states().count("in_flight") + pool.states().count("finished") == n
        env_ids, obs, *_ = pool.recv(batch_size=1)
        env_ids2, obs2, *_ = pool.recv()
        assert sorted(env_ids.tolist() + env_ids2.tolist()) == list(range(n))
        spans = intervals(obs + obs2)
        assert len(spans) == n and not overlaps(spans), spans
    # Without the gate the same steps overlap: the check above can fail.
    with RLPool(PROBE, n, workers=2, step_timeout=scaled(5)) as pool:
        pool.reset(seed=0)
        obs, *_ = pool.step([{"op": "interval", "s": scaled(0.2)}] * n)
        assert overlaps(intervals(obs))


# -- nothing left behind --------------------------------------------------------------------


def test_close_leaves_nothing_behind():
    fds, children = open_fds(), _descendants()
    pool = RLPool(PROBE, 5, workers=3, step_timeout=scaled(0.5))
    pool.reset(seed=0)
    pool.step([1, {"op": "sleep", "s": 60}, 1, 1, {"op": "sleep", "s": 60}])  # busy envs at close too
    workers = _workers(pool)
    assert len(_cgroups(*workers)) == 3  # a pool cgroup per worker
    pool.close()
    pool.close()
    assert _descendants() == children
    assert open_fds() == fds
    assert not _cgroups(*workers)
    pool2 = RLPool(PROBE, 3, workers=2)
    workers = _workers(pool2)
    del pool2  # garbage collection closes every shard
    assert wait_until(lambda: _descendants() == children)
    assert open_fds() == fds
    assert wait_until(lambda: not _cgroups(*workers))


CLIENT = """
import sys
sys.path.insert(0, {root!r})
from boltzlabs import RLPool
pool = RLPool({probe!r}, 5, workers=2)
pool.reset(seed=0)
print((pool.pids(), [s._proc.pid for s in pool._shards]), flush=True)
import os; os.kill(os.getpid(), 9)
"""


def test_a_trainer_killed_leaves_no_worker_sandbox_or_cgroup():
    code = CLIENT.format(root=str(TESTS.parent), probe=str(PROBE))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(60))
    pids, workers = eval(out.stdout.strip().splitlines()[0])
    assert len(pids) == 5 and len(workers) == 2
    assert wait_until(lambda: not any(psutil.pid_exists(p) for p in pids + workers))
    assert wait_until(lambda: not _cgroups(*workers))


# -- the adapters over a sharded pool ---------------------------------------------------------


def test_gymnasium_and_sb3_adapters_over_a_sharded_pool():
    from boltzlabs.gym import BoltzLabsVecEnv

    import gymnasium as gym

    envs = BoltzLabsVecEnv([lambda: gym.make("CartPole-v1")] * 5, workers=2)  # env_fns, split by shard
    try:
        assert envs.pool.workers == 2 and envs.pool.source.startswith("env_fns[5: ")
        obs, infos = envs.reset(seed=0)
        assert obs.shape == (5, 4)
        for _ in range(30):
            obs, rewards, terminations, truncations, infos = envs.step(envs.action_space.sample())
        assert obs.shape == (5, 4) and rewards.shape == (5,)
    finally:
        envs.close()
    pytest.importorskip("stable_baselines3")
    from boltzlabs.sb3 import BoltzLabsSB3VecEnv

    venv = BoltzLabsSB3VecEnv(RLPool("CartPole-v1", 4, workers=2))
    try:
        obs = venv.reset()
        assert obs.shape == (4, 4)
        for _ in range(30):
            obs, rewards, dones, infos = venv.step(np.array([venv.action_space.sample() for _ in range(4)]))
        assert obs.shape == (4, 4) and len(infos) == 4
    finally:
        venv.close()


def test_a_remote_pool_over_several_workers(tmp_path):
    from test_remote import Worker

    listener = Worker(tmp_path)
    try:
        with listener.pool(COUNTER, 5, workers=2) as pool:
            assert pool.workers == 2
            assert pool.reset(seed=0) == [{"t": 0}] * 5
            obs, rewards, *_ = pool.step([1, 2, 3, 4, 5])
            assert rewards.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0] and obs == [{"t": 1}] * 5
            pool.send([1] * 5)
            assert sorted(pool.recv()[0].tolist()) == list(range(5))
    finally:
        listener.stop()
