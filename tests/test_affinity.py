"""Where a pool's processes run (RLPool(cpus=), boltzlabs/worker/affinity.py):
real workers, templates and sandboxes, read from the kernel (sched_getaffinity
of each process, and each env's own view from inside its sandbox)."""

import os

import psutil
import pytest

from boltzlabs import RLPool
from boltzlabs.worker import affinity
from conftest import COUNTER, PROBE

CPUS = sorted(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(CPUS) < 2, reason="slices need at least two CPUs this process may use")


def _tree(pid: int) -> dict:
    """pid -> CPUs, for a worker and every process below it (templates, bwrap, sandboxes, envs)."""
    worker = psutil.Process(pid)
    out = {}
    for proc in [worker, *worker.children(recursive=True)]:
        try:
            out[proc.pid] = sorted(os.sched_getaffinity(proc.pid))
        except ProcessLookupError:
            pass
    return out


def _workers(pool) -> list:
    pool = getattr(pool, "inner", pool)  # a grouped pool's: its pool of sandboxes
    shards = getattr(pool, "_shards", None) or [pool]
    return [shard._proc.pid for shard in shards]


def _env_views(pool) -> list:
    """Each lane's CPUs as its env sees them, from inside its sandbox."""
    obs, *_ = pool.step([{"op": "cpus"}] * pool.n)
    return [o["out"] for o in obs]


def _descendants() -> set:
    return {p.pid for p in psutil.Process().children(recursive=True)}


# -- the slices and the request, as data ---------------------------------------------------


@pytest.mark.parametrize(
    "cpus, of, want",
    [
        ([0, 1], 2, [[0], [1]]),
        ([0, 1], 1, [[0, 1]]),
        (list(range(8)), 4, [[0, 1], [2, 3], [4, 5], [6, 7]]),
        ([4, 5, 9, 11], 2, [[4, 5], [9, 11]]),
        # Uneven (the lanes split evenly, the CPUs would not): every shard on all of them.
        (list(range(8)), 3, [list(range(8))] * 3),
        ([0, 1], 3, [[0, 1]] * 3),
    ],
)
def test_each_shard_gets_its_slice(cpus, of, want):
    assert [affinity.slice_of(cpus, s, of) for s in range(of)] == want


def test_slices_are_equal_and_cover_the_cpus_once_or_each_is_all_of_them():
    for count in range(1, 70):
        cpus = list(range(0, 2 * count, 2))
        for of in range(1, count + 3):
            slices = [affinity.slice_of(cpus, s, of) for s in range(of)]
            if count % of:
                assert slices == [cpus] * of
            else:
                assert sum(slices, []) == cpus and {len(s) for s in slices} == {count // of}


@pytest.mark.parametrize(
    "asked",
    [
        [0, 1],
        {"cpus": None, "shard": 0},
        {"cpus": None, "shard": 0, "of": 2, "more": 1},
        {"cpus": None, "shard": 2, "of": 2},
        {"cpus": None, "shard": -1, "of": 2},
        {"cpus": None, "shard": 0, "of": 0},
        {"cpus": None, "shard": True, "of": 2},
        {"cpus": None, "shard": 0.0, "of": 2},
        {"cpus": None, "shard": 0, "of": 1 << 40},
        {"cpus": [], "shard": 0, "of": 1},
        {"cpus": [-1], "shard": 0, "of": 1},
        {"cpus": [1 << 13], "shard": 0, "of": 1},
        {"cpus": [[0]], "shard": 0, "of": 1},
        {"cpus": ["0"], "shard": 0, "of": 1},
        {"cpus": "0-3", "shard": 0, "of": 1},
        {"cpus": [0] * ((1 << 13) + 1), "shard": 0, "of": 1},
        {"cpus": None, "shard": 0, "of": 1, "spread": 1},
        {"cpus": None, "shard": 0, "of": 1, "spread": "yes"},
        {"cpus": None, "shard": 0, "of": 1, "spread": None},
        {"cpus": None, "shard": 0, "spread": True},
    ],
)
def test_a_hostile_affinity_request_is_refused(asked):
    with pytest.raises(ValueError, match="affinity"):
        affinity.parse(asked)


def test_a_request_is_parsed_to_sorted_distinct_cpus():
    assert affinity.parse(None) is None
    assert affinity.parse({"cpus": [3, 1, 3], "shard": 1, "of": 2}) == affinity.Affinity((1, 3), 1, 2)
    assert affinity.parse({"cpus": None, "shard": 0, "of": 1, "spread": True}) == affinity.Affinity(None, 0, 1, True)
    assert affinity.parse({"cpus": None, "shard": 0, "of": 1, "spread": False}).spread is False


@pytest.mark.parametrize(
    "cpus, error",
    [
        (True, TypeError),
        ("0-3", TypeError),
        (3, TypeError),
        ([], ValueError),
        ([-1], ValueError),
        ([1.0], ValueError),
        ([True], ValueError),
        ([1 << 13], ValueError),
    ],
)
def test_bad_cpus_are_refused_before_anything_starts(cpus, error):
    before = _descendants()
    for workers in (1, 2):
        with pytest.raises(error, match="cpus"):
            RLPool(COUNTER, 2, workers=workers, cpus=cpus)
    assert _descendants() <= before


# -- real pools ----------------------------------------------------------------------------


@needs_two
@pytest.mark.parametrize("spawn", ["template", "exec"])
def test_each_shard_and_everything_below_it_runs_on_its_slice_respawns_included(spawn):
    slices = [affinity.slice_of(CPUS, s, 2) for s in range(2)]
    lane_slice = [slices[0]] * 2 + [slices[1]] * 3  # 5 lanes over 2 shards: [0, 2) and [2, 5)
    with RLPool(PROBE, 5, workers=2, step_timeout=10, spawn=spawn) as pool:
        assert pool.spawn == spawn
        assert pool.affinity == slices
        pool.reset(seed=0)
        for worker, cpus in zip(_workers(pool), slices):
            tree = _tree(worker)
            assert len(tree) > 3 and set(map(tuple, tree.values())) == {tuple(cpus)}, tree
        assert _env_views(pool) == lane_slice
        before = set(pool.pids())
        pool.reset(seed=1, hard=True)  # every env a new process (forked by its shard's template)
        after = set(pool.pids())
        assert not before & after
        _, _, dones, infos = pool.step([1.0, 1.0, 1.0, {"op": "exit"}, 1.0])
        assert dones[3] and "exit" in infos[3]["error"]
        pool.reset(where=[3])  # a respawn after a crash
        assert _env_views(pool) == lane_slice
        for worker, cpus in zip(_workers(pool), slices):
            assert set(map(tuple, _tree(worker).values())) == {tuple(cpus)}
    assert sorted(os.sched_getaffinity(0)) == CPUS  # the trainer's own is left as it was


@needs_two
def test_a_pool_is_pinned_only_where_asked():
    with RLPool(PROBE, 2) as pool:  # one worker: not pinned
        pool.reset(seed=0)
        assert pool.affinity == [None] and _env_views(pool) == [CPUS] * 2
    with RLPool(PROBE, 4, workers=2, cpus=False) as pool:
        pool.reset(seed=0)
        assert pool.affinity == [None, None] and _env_views(pool) == [CPUS] * 4
        for worker in _workers(pool):
            assert set(map(tuple, _tree(worker).values())) == {tuple(CPUS)}
    last = CPUS[-1:]
    with RLPool(PROBE, 2, cpus=last) as pool:  # the trainer keeps the other CPUs to itself
        pool.reset(seed=0)
        assert pool.affinity == [last] and _env_views(pool) == [last] * 2
        assert set(map(tuple, _tree(_workers(pool)[0]).values())) == {tuple(last)}
    two = CPUS[:2]
    with RLPool(PROBE, 3, workers=3, cpus=two) as pool:  # 3 shards, 2 CPUs: each shard on both
        pool.reset(seed=0)
        assert pool.affinity == [None if two == CPUS else two] * 3
        assert _env_views(pool) == [two] * 3


def _pinned(pid: int) -> set:
    """The CPUs of every thread of process pid."""
    return {tuple(sorted(os.sched_getaffinity(int(task)))) for task in os.listdir(f"/proc/{pid}/task")}


@needs_two
@pytest.mark.parametrize("spawn", ["template", "exec"])
def test_pin_sandboxes_puts_each_sandbox_on_one_cpu_in_turn_respawns_included(spawn):
    """A grouped pool of 3 sandboxes (2 + 2 + 1 envs): sandbox g on CPUS[g mod C], every thread
    of it, as the kernel and its envs say; the worker and the template are not narrowed; a
    sandbox respawned after a hard reset or a crash is pinned again."""
    want = [[CPUS[g % len(CPUS)]] for g in range(3)]
    lanes = [want[0]] * 2 + [want[1]] * 2 + [want[2]]
    with RLPool(PROBE, 5, envs_per_sandbox=2, pin_sandboxes=True, step_timeout=10, spawn=spawn) as pool:
        pool.reset(seed=0)
        worker = _workers(pool)[0]
        assert sorted(os.sched_getaffinity(worker)) == CPUS and pool.affinity == [None]

        def check():
            pids = pool.pids()  # exec: each sandbox's bwrap, whose last descendant is the env's process
            envs = [
                pid if spawn == "template" else psutil.Process(pid).children(recursive=True)[-1].pid for pid in pids
            ]
            for g, pid in enumerate(sorted(set(envs), key=envs.index)):
                assert _pinned(pid) == {tuple(want[g])}, (g, pid)
            assert _env_views(pool) == lanes

        check()
        before = set(pool.pids())
        pool.reset(seed=1, hard=True)
        assert not before & set(pool.pids())
        check()
        _, _, dones, infos = pool.step([1.0, 1.0, {"op": "exit"}, 1.0, 1.0])
        assert dones[2] and dones[3] and "exit" in infos[2]["error"]
        pool.reset(where=[2])  # its group's respawn
        check()
    assert sorted(os.sched_getaffinity(0)) == CPUS  # the trainer's own is left as it was


@needs_two
def test_pin_sandboxes_spreads_within_each_shards_slice_and_within_cpus():
    slices = [affinity.slice_of(CPUS, s, 2) for s in range(2)]
    with RLPool(PROBE, 6, workers=2, pin_sandboxes=True) as pool:  # 3 envs per shard
        pool.reset(seed=0)
        assert _env_views(pool) == [[s[i % len(s)]] for s in slices for i in range(3)]
    last = CPUS[-1:]
    with RLPool(PROBE, 4, envs_per_sandbox=2, cpus=last, pin_sandboxes=True) as pool:
        pool.reset(seed=0)
        assert pool.affinity == [last] and _env_views(pool) == [last] * 4
    with RLPool(PROBE, 2) as pool:  # not asked: the kernel places each sandbox
        pool.reset(seed=0)
        assert _env_views(pool) == [CPUS] * 2


@pytest.mark.parametrize(
    "pin, cpus, error", [("yes", None, TypeError), (1, None, TypeError), (True, False, ValueError)]
)
def test_a_bad_pin_sandboxes_is_refused_before_anything_starts(pin, cpus, error):
    before = _descendants()
    for workers in (1, 2):
        with pytest.raises(error, match="pin_sandboxes"):
            RLPool(COUNTER, 2, workers=workers, cpus=cpus, pin_sandboxes=pin)
    assert _descendants() <= before


def test_a_cpu_the_worker_may_not_use_is_refused_naming_it_and_nothing_is_left():
    before = _descendants()
    missing = max(CPUS) + 1
    with pytest.raises(ValueError, match=f"CPU {missing} is not one this worker may use"):
        RLPool(COUNTER, 2, cpus=[missing])
    assert _descendants() <= before


@needs_two
def test_an_env_that_widens_its_own_affinity_moves_nothing_else():
    slices = [affinity.slice_of(CPUS, s, 2) for s in range(2)]
    with RLPool(PROBE, 4, workers=2, step_timeout=10) as pool:
        pool.reset(seed=0)
        obs, *_ = pool.step([{"op": "widen"}, 1.0, 1.0, 1.0])
        assert obs[0]["out"] == CPUS  # placement, not a limit: it may, within its cpuset
        assert _env_views(pool) == [CPUS, slices[0], slices[1], slices[1]]
        moved = {pid for pid, cpus in _tree(_workers(pool)[0]).items() if cpus != slices[0]}
        assert moved == {pool.pids()[0]}  # the env's own process; its template and neighbours stay
        assert set(map(tuple, _tree(_workers(pool)[1]).values())) == {tuple(slices[1])}
        pool.reset(where=[0], hard=True)  # its respawn is back on its shard's slice
        assert _env_views(pool)[0] == slices[0]


@needs_two
def test_a_remote_pool_pins_each_shard_within_the_remote_workers_cpus(tmp_path):
    from test_remote import Worker

    slices = [affinity.slice_of(CPUS, s, 2) for s in range(2)]
    listener = Worker(tmp_path)
    try:
        with listener.pool(PROBE, 4, workers=2) as pool:
            assert pool.affinity == slices
            pool.reset(seed=0)
            assert _env_views(pool) == [slices[0]] * 2 + [slices[1]] * 2
        with listener.pool(PROBE, 4, envs_per_sandbox=2, pin_sandboxes=True) as pool:  # one remote worker
            pool.reset(seed=0)
            assert _env_views(pool) == [[CPUS[0]]] * 2 + [[CPUS[1]]] * 2
        # A client that lies about its shard: the worker refuses it, and says why.
        with pytest.raises(ValueError, match="affinity: shard"):
            listener.pool(COUNTER, 2, _shard=(3, 2))
        with pytest.raises(ValueError, match="is not one this worker may use"):
            listener.pool(COUNTER, 2, cpus=[max(CPUS) + 1])
        listener.wait_for(lambda: not listener.descendants(), "the refused pools' workers to leave")
    finally:
        listener.stop()
