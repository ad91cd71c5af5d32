"""close() leaves nothing (issue 42, point 3): when it returns, the pool's processes and cgroups
are gone, or it warns naming what it could not remove.

A 10,000-env pool's close() once returned while two of its cgroups still existed: the client
waited at most 10 s for the worker's cgroup guardian, which was still removing them. Here: a
pool's whole process tree and its cgroups are looked at the moment close() returns (one worker,
several, a worker stopped before close), and a cgroup that something else holds (a cgroup made
inside one of the pool's, as another tool might) is named in close()'s warning.
"""

import os
import signal
import socket
import warnings
from pathlib import Path

import psutil
import pytest

from boltzlabs import RLPool
from boltzlabs.errors import WorkerError

from conftest import COUNTER, has_ended


def _tree(pool) -> list:
    """Every process of the pool: each worker, and all it started (guardian, template, sandboxes)."""
    workers = [pool._proc.pid] if hasattr(pool, "_proc") else [shard._proc.pid for shard in pool._shards]
    procs = []
    for pid in workers:
        worker = psutil.Process(pid)
        procs += [worker, *worker.children(recursive=True)]
    return procs


def _cgroups(pool) -> list:
    shards = getattr(pool, "_shards", None) or [pool]
    return [Path(p) for shard in shards for p in (shard._cgroup or [])]


def _left(procs, groups) -> tuple:
    return [p.pid for p in procs if not has_ended(p)], [str(g) for g in groups if g.exists()]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("spawn, workers", [("template", 1), ("exec", 1), ("template", 2)])
def test_nothing_of_the_pool_is_left_when_close_returns(spawn, workers):
    pool = RLPool(COUNTER, 32, spawn=spawn, workers=workers, step_timeout=10)
    pool.reset(seed=0)
    pool.step([1] * 32)
    procs, groups = _tree(pool), _cgroups(pool)
    assert any(p.name() == "boltzlabs-guard" for p in procs) == bool(groups)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to say: everything went
        pool.close()
    assert _left(procs, groups) == ([], [])


@pytest.mark.timeout(300)
def test_close_of_a_stopped_worker_kills_it_and_leaves_nothing():
    pool = RLPool(COUNTER, 8, step_timeout=10)
    procs, groups = _tree(pool), _cgroups(pool)
    os.kill(pool._proc.pid, signal.SIGSTOP)
    pool.close()
    assert _left(procs, groups) == ([], [])


@pytest.mark.timeout(300)
def test_a_connection_that_ends_while_the_worker_lives_is_named_and_close_kills_the_worker():
    """The trainer's end of the connection ended (here: shut down under it) while the worker,
    stopped, cannot exit: the call raises WorkerError saying so, not subprocess's TimeoutExpired,
    and close() leaves nothing."""
    pool = RLPool(COUNTER, 4, step_timeout=10)
    pool.reset(seed=0)
    procs, groups = _tree(pool), _cgroups(pool)
    os.kill(pool._proc.pid, signal.SIGSTOP)
    pool._link.exit_wait = 0.5
    pool._conn.shutdown(socket.SHUT_RDWR)
    with pytest.raises(WorkerError, match=r"ended and the worker had not exited 0\.5 s later") as raised:
        pool.step([1] * 4)
    assert f"pid {pool._proc.pid}" in str(raised.value)
    pool.close()
    assert _left(procs, groups) == ([], [])


@pytest.mark.timeout(300)
def test_close_names_a_cgroup_it_could_not_remove():
    pool = RLPool(COUNTER, 4, step_timeout=10)
    groups = _cgroups(pool)
    if not groups:
        pool.close()
        pytest.skip("no writable cgroups here: the pool has none to leave")
    # A cgroup made inside the template's (another tool's, say): the template's cannot be removed
    # while it is there, nor the pool's.
    held = groups[0] / "template" / "held-by-a-test"
    held.mkdir()
    try:
        with pytest.warns(RuntimeWarning, match="could not be removed") as said:
            pool.close()
        text = " ".join(str(w.message) for w in said)
        assert str(groups[0]) in text and f"pid {pool._proc.pid}" in text, text
        assert held.exists()
    finally:
        for path in (held, held.parent, groups[0]):
            try:
                path.rmdir()
            except FileNotFoundError:
                pass
    assert not any(g.exists() for g in groups)
