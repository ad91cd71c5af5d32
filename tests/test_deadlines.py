"""A stuck worker never hangs the trainer, and close() leaves nothing (issue 42, points 2 and 3).

Each call the client makes has a deadline derived from what it asked plus a margin
(client.DEADLINE_MARGIN); the worker's HEARTBEAT frames, sent during calls that run past a
second, extend it. Past it the call raises WorkerError naming the worker, the call and the
wait, and the pool is closed as at any other worker death: a stopped local worker is killed,
its cgroups removed. Faults: a SIGSTOPped local worker (step, hard reset, recv; one shard of a
sharded pool), a remote listener that accepts and then says nothing, a listener that sends a
malformed heartbeat; and the contrary case, a long call that heartbeats (no false alarm).
Real processes throughout; the only time bounds catch a hang.
"""

import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from boltzlabs import RLPool, wire
from boltzlabs.errors import PoolClosedError, WorkerError
from boltzlabs.pool import client

from conftest import COUNTER, PROBE, has_ended, scaled
from lying_worker import LyingWorker

# A small margin, so that a stuck call is found in seconds here; heartbeats come every second
# (four of them may be missed on a loaded machine before a live worker is taken for a stuck one).
MARGIN = scaled(4.0)
# What a test allows past a call's deadline before it calls it a hang: killing the worker,
# waiting for its guardian, a noisy shared machine.
SLACK = scaled(15)


@pytest.fixture
def margin(monkeypatch):
    monkeypatch.setattr(client, "DEADLINE_MARGIN", MARGIN)
    return MARGIN


def _stop(pool) -> int:
    pid = pool._proc.pid
    os.kill(pid, signal.SIGSTOP)
    return pid


def _assert_gone(pool, pid: int, cgroups) -> None:
    """The pool is closed, its stopped worker killed (not left behind) and its cgroups removed."""
    assert pool.closed
    with pytest.raises(PoolClosedError):
        pool.pids()
    try:
        proc = psutil.Process(pid)
        assert has_ended(proc), f"the stopped worker {pid} was left behind ({proc.status()})"
    except psutil.NoSuchProcess:
        pass
    left = [p for p in cgroups or [] if Path(p).exists()]
    assert not left, f"cgroups left behind: {left}"


def _stopped_during(pool, call, what: str, budget: float, before=None) -> None:
    """Reset `pool` (then `before(pool)`), SIGSTOP its worker and make `call(pool)`: it raises a
    WorkerError naming `what` and the worker within `budget` s and SLACK, and nothing is left."""
    cgroups = pool._cgroup
    try:
        pool.reset(seed=0)
        if before is not None:
            before(pool)
        pid = _stop(pool)
        started = time.monotonic()
        with pytest.raises(WorkerError) as err:
            call(pool)
        waited = time.monotonic() - started
    finally:
        pool.close()
    _stuck(err.value, what, f"pid {pid}")
    assert waited < budget + SLACK, waited
    _assert_gone(pool, pid, cgroups)


def _stuck(exc: WorkerError, what: str, who: str) -> None:
    text = str(exc)
    assert what in text and who in text and "waited" in text, text
    assert exc.kind == "deadline", text


@pytest.mark.timeout(120)
@pytest.mark.parametrize("spawn", ["template", "exec"])
def test_a_stopped_worker_during_step_is_a_worker_error_not_a_hang(margin, spawn):
    pool = RLPool(COUNTER, 2, step_timeout=2, spawn=spawn)
    _stopped_during(pool, lambda pool: pool.step([1, 1]), "step()", 2 + margin)


@pytest.mark.timeout(120)
def test_a_stopped_worker_that_cannot_take_a_big_batch_is_a_worker_error(margin):
    # 2 x 8 MiB of actions: more than the socket holds, so the send itself waits on the worker.
    pool = RLPool(COUNTER, 2, step_timeout=2)
    _stopped_during(pool, lambda pool: pool.step([b"x" * (8 << 20)] * 2), "step()", 2 + margin)


@pytest.mark.timeout(120)
def test_a_stopped_worker_during_a_hard_reset_is_a_worker_error(margin):
    pool = RLPool(COUNTER, 4, step_timeout=2, start_timeout=3)
    _stopped_during(pool, lambda pool: pool.reset(hard=True), "reset()", 3 + 2 + margin)


@pytest.mark.timeout(120)
def test_a_stopped_worker_during_recv_is_a_worker_error(margin):
    pool = RLPool(COUNTER, 3, step_timeout=2)
    _stopped_during(pool, lambda pool: pool.recv(3), "recv()", 2 + margin, before=lambda pool: pool.send([1, 1, 1]))


@pytest.mark.timeout(120)
def test_a_stopped_shard_ends_a_sharded_pool_with_a_worker_error(margin):
    pool = RLPool(COUNTER, 4, workers=2, step_timeout=2)
    cgroups = [p for shard in pool._shards for p in (shard._cgroup or [])]
    pids = [shard._proc.pid for shard in pool._shards]
    try:
        pool.reset(seed=0)
        os.kill(pids[1], signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(WorkerError) as err:
            pool.step([1] * 4)
        waited = time.monotonic() - started
    finally:
        pool.close()
    text = str(err.value)
    assert "shard 1 of 2" in text and f"pid {pids[1]}" in text and "step()" in text, text
    assert waited < 2 + margin + SLACK, waited
    assert pool.closed
    for pid in pids:
        assert not psutil.pid_exists(pid) or has_ended(psutil.Process(pid)), pid
    assert not [p for p in cgroups if Path(p).exists()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "how", [{}, {"serialize_measurement": True}, {"envs_per_sandbox": 2}], ids=["plain", "gated", "grouped"]
)
def test_replies_that_came_while_the_worker_itself_was_not_run_are_results_not_stragglers(how):
    # The worker is stopped (as the scheduler of a loaded node may leave it unrun) after it sent
    # the step and before the envs answer, and let go only past the step's deadline: the replies
    # waiting in their pipes are taken by the worker's last look at the deadline, not reported as
    # stragglers. Each env sleeps 1 s of the 2 s step_timeout (a group steps its two in turn).
    timeout = scaled(2.0)
    sleep = 1.0 / how.get("envs_per_sandbox", 1)
    pool = RLPool(PROBE, 2, step_timeout=timeout, **how)
    pid = getattr(pool, "inner", pool)._proc.pid
    stopped = threading.Event()

    def stop_then_go_on():
        os.kill(pid, signal.SIGSTOP)
        stopped.set()
        time.sleep(timeout + 1.5)
        os.kill(pid, signal.SIGCONT)

    timer = threading.Timer(0.3, stop_then_go_on)
    try:
        pool.reset(seed=0)
        timer.start()
        obs, _, _, infos = pool.step([{"op": "sleep", "s": sleep}] * 2)
        timer.join()
        assert stopped.is_set()
        assert pool.timing.stragglers == [], infos
        assert [o["out"] for o in obs] == [{"slept": sleep}] * 2, infos
        assert not any("error" in info for info in infos), infos
    finally:
        if timer.is_alive():  # the step failed: the worker is let go before the pool closes
            timer.join()
        pool.close()


@pytest.mark.timeout(120)
def test_an_env_trickling_its_reply_past_the_deadline_does_not_extend_the_step():
    # The look at the deadline reads once: a reply that keeps coming, a byte every 20 ms, is cut
    # off there, its lane a straggler, and the step returns with the other lane's result.
    timeout = scaled(1.0)
    pool = RLPool(PROBE, 2, step_timeout=timeout)
    try:
        pool.reset(seed=0)
        started = time.monotonic()
        _, rewards, done, infos = pool.step([{"op": "trickle", "bytes": 500, "every": 0.02}, 7])
        took = time.monotonic() - started
        assert pool.timing.stragglers == [0], infos
        assert infos[0].get("straggler") is True and done[0], infos
        assert rewards[1] == 7 and "error" not in infos[1], infos
        assert took < timeout + scaled(2.0), took
    finally:
        pool.close()


@pytest.mark.timeout(120)
def test_a_slow_call_that_heartbeats_is_not_taken_for_a_dead_worker(margin):
    # Under serialize_measurement the envs step one after another: 6 x 1.5 s of step code is a
    # step of ~9 s, longer than its derived deadline (step_timeout 2 s + the margin); the worker's
    # heartbeats keep it alive.
    pool = RLPool(PROBE, 6, step_timeout=2, serialize_measurement=True)
    try:
        pool.reset(seed=0)
        started = time.monotonic()
        obs, rewards, dones, infos = pool.step([{"op": "sleep", "s": 1.5}] * 6)
        took = time.monotonic() - started
        assert all(o["out"] == {"slept": 1.5} for o in obs), (obs, infos)
        assert took > 2 + margin, took  # else this test proves nothing: the step fit its deadline
        pool.step([0] * 6)  # still open, still answering
    finally:
        pool.close()


# -- remote: a listener that accepts and then stays silent -------------------------------------

# What a worker's READY says, as far as a client needs to open a pool.
READY = {
    "n": 2,
    "memory_source": "none",
    "memory_note": "",
    "cgroup": None,
    "hello": {},
    "step_timeout": 2.0,
    "spawn": "exec",
    "warning": "",
}


@pytest.mark.timeout(120)
def test_a_silent_remote_listener_at_start_is_a_worker_error(margin):
    liar = LyingWorker([])  # the handshake, OPEN taken, then nothing
    started = time.monotonic()
    try:
        with pytest.raises(WorkerError) as err:
            RLPool(COUNTER, 2, worker=liar.url, token=liar.token, start_timeout=2)
    finally:
        liar.close()
    waited = time.monotonic() - started
    _stuck(err.value, "start", liar.url)
    assert waited < 2 + margin + SLACK, waited


@pytest.mark.timeout(120)
def test_a_silent_remote_listener_during_step_is_a_worker_error(margin):
    liar = LyingWorker([[wire.READY, READY]])  # a pool opened, then no answer to any call
    try:
        pool = RLPool(COUNTER, 2, worker=liar.url, token=liar.token, step_timeout=2)
        pool._never_reset.clear()  # the liar answers no reset: step at once
        started = time.monotonic()
        with pytest.raises(WorkerError) as err:
            pool.step([1, 1])
        waited = time.monotonic() - started
        assert pool.closed
    finally:
        liar.close()
    _stuck(err.value, "step()", liar.url)
    assert waited < 2 + margin + SLACK, waited


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "beat, said",
    [
        ([wire.HEARTBEAT], "malformed heartbeat"),
        ([wire.HEARTBEAT, 1], "malformed heartbeat"),
        ([wire.HEARTBEAT, 1, "soon"], "malformed heartbeat"),
        ([wire.HEARTBEAT, 1, -1.0], "malformed heartbeat"),
        ([wire.HEARTBEAT, 1, float("nan")], "malformed heartbeat"),
        ([wire.HEARTBEAT, 1, 2.0, "extra"], "malformed heartbeat"),
        ([wire.HEARTBEAT, 7, 2.0], "heartbeat for call 7"),
        ([wire.HEARTBEAT, True, 2.0], "malformed heartbeat"),
        ([wire.HEARTBEAT, 1, "x" * 100_000], "malformed heartbeat"),
    ],
    ids=["bare", "no-seconds", "seconds-a-str", "negative", "nan", "extra", "other-call", "bool-seq", "big"],
)
def test_a_malformed_heartbeat_is_a_worker_error(margin, beat, said):
    liar = LyingWorker([[wire.READY, READY]], on_call=[beat])
    try:
        pool = RLPool(COUNTER, 2, worker=liar.url, token=liar.token, step_timeout=2)
        pool._never_reset.clear()
        with pytest.raises(WorkerError) as err:
            pool.step([1, 1])
        assert pool.closed
    finally:
        liar.close()
    assert said in str(err.value) and liar.url in str(err.value), str(err.value)


@pytest.mark.timeout(120)
def test_a_heartbeat_while_starting_is_malformed_too(margin):
    liar = LyingWorker([[wire.HEARTBEAT, "x", 1.0]])
    try:
        with pytest.raises(WorkerError) as err:
            RLPool(COUNTER, 2, worker=liar.url, token=liar.token)
    finally:
        liar.close()
    assert "malformed heartbeat" in str(err.value), str(err.value)


@pytest.mark.timeout(120)
def test_heartbeats_of_a_silent_listener_keep_a_call_alive_and_then_it_ends(margin):
    # Heartbeats extend the deadline (never for ever): a listener that beats for a while past the
    # margin, then goes silent, ends the call a margin after its last beat.
    beats = [[wire.HEARTBEAT, 1, float(k)] for k in range(1, 6)]
    liar = LyingWorker([[wire.READY, READY]], on_call=beats, pace=1.0)
    try:
        pool = RLPool(COUNTER, 2, worker=liar.url, token=liar.token, step_timeout=1)
        pool._never_reset.clear()
        started = time.monotonic()
        with pytest.raises(WorkerError) as err:
            pool.step([1, 1])
        waited = time.monotonic() - started
    finally:
        liar.close()
    _stuck(err.value, "step()", liar.url)
    assert waited > 1 + margin, waited  # the beats held it past its bare deadline
    assert waited < 5 + margin + SLACK, waited
