"""The "starting envs" bar (boltzlabs/pool/progress.py): one bar of the whole pool's size however
many workers start it, and a worker's start-up messages checked as the input they are.

Real pools, a real remote-worker handshake; the hostile worker is a socket speaking the protocol."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from boltzlabs import RLPool, wire
from boltzlabs.errors import WorkerError
from boltzlabs.pool.progress import StartProgress, check
from conftest import COUNTER, on_terminal, scaled
from lying_worker import LyingWorker

HANG = scaled(60)  # seconds: only to catch a hang


# -- check(): a worker's PROGRESS frame ----------------------------------------------------------


def test_a_well_formed_progress_frame_gives_its_ready_count():
    assert check([wire.PROGRESS, 0, 4], 4) == 0
    assert check([wire.PROGRESS, 4, 4], 4) == 4


@pytest.mark.parametrize(
    "frame",
    [
        [wire.PROGRESS],
        [wire.PROGRESS, 1],
        [wire.PROGRESS, 1, 4, 0],
        [wire.PROGRESS, "3", 4],
        [wire.PROGRESS, 1.0, 4],
        [wire.PROGRESS, True, 4],
        [wire.PROGRESS, None, 4],
        [wire.PROGRESS, -1, 4],
        [wire.PROGRESS, 5, 4],  # more ready than the worker was asked for
        [wire.PROGRESS, 1, 10**9],  # a total that is not this worker's n
        [wire.PROGRESS, 1, 3],
        [wire.PROGRESS, 2**70, 4],
        [wire.PROGRESS, [1] * 100_000, 4],
    ],
    ids=lambda frame: repr(frame)[:30],
)
def test_a_malformed_progress_frame_is_a_worker_error_naming_it(frame):
    with pytest.raises(WorkerError, match=r"malformed start-up progress message .*0 <= ready <= 4") as err:
        check(frame, 4)
    assert len(str(err.value)) < 500  # what arrived is cut, however large


# -- StartProgress: one bar over several workers ---------------------------------------------------


def test_the_bar_sums_every_workers_latest_count_across_threads():
    progress = StartProgress(3000)
    counters = [progress.counter() for _ in range(3)]

    def report(counter):
        for ready in range(1001):
            counter(ready)

    threads = [threading.Thread(target=report, args=(c,)) for c in counters]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(HANG)
        assert progress.ready == 3000
        counters[1](400)  # a worker's count is its latest, not added to the last
        assert progress.ready == 2400
    finally:
        progress.close()


def test_a_sharded_pool_draws_one_bar_of_its_whole_size(capfd):
    with RLPool(COUNTER, 64, workers=2, spawn="exec", progress=True) as pool:
        assert pool.workers == 2
    err = capfd.readouterr().err
    assert "starting envs" in err and "/64" in err, err[-500:]
    assert "/32" not in err, err[-500:]  # not a bar per shard


def test_a_sharded_pool_shows_its_bar_on_a_terminal_by_default():
    code = (
        f"import sys; sys.path.insert(0, {str(COUNTER.parents[1])!r})\n"
        "from boltzlabs import RLPool\n"
        f"with RLPool({str(COUNTER)!r}, 64, workers=2, spawn='exec') as pool:\n"
        "    assert pool.workers == 2\n"
        "print('done', file=sys.stderr)\n"
    )
    text = on_terminal([sys.executable, "-c", code], until="done", timeout=HANG)
    assert "starting envs" in text and "/64" in text and "/32" not in text, repr(text[:300])


def test_no_bar_when_asked_for_none(capfd):
    with RLPool(COUNTER, 64, workers=2, spawn="exec", progress=False):
        pass
    assert "starting envs" not in capfd.readouterr().err


# -- a remote worker's start-up messages are input ----------------------------------------------------


NESTED = b"\x91" * 5000 + b"\xc0"  # a msgpack list 5000 deep


@pytest.mark.parametrize(
    "frames, raw, said",
    [
        ([[wire.PROGRESS, "1", 4]], b"", "malformed start-up progress message"),
        ([[wire.PROGRESS, 1, 4], [wire.PROGRESS, 9, 4]], b"", "malformed start-up progress message"),
        ([[wire.PROGRESS, 1, 10**12]], b"", "malformed start-up progress message"),
        ([[wire.PROGRESS]], b"", "malformed start-up progress message"),
        ([7], b"", "sent a frame this client cannot read"),
        ([[]], b"", "sent a frame this client cannot read"),
        ([{"ready": 1}], b"", "sent a frame this client cannot read"),
        ([[wire.REPLY, 1, 0.0, None]], b"", "while starting the pool"),
        ([[wire.READY, "ready"]], b"", "while starting the pool"),
        ([], len(NESTED).to_bytes(4, "little") + NESTED, "sent a frame this client cannot read"),
    ],
    ids=[
        "ready-a-string",
        "ready-past-n",
        "total-not-n",
        "short",
        "not-a-list",
        "empty",
        "a-map",
        "a-reply",
        "ready-not-a-map",
        "nested-5000-deep",
    ],
)
def test_a_worker_that_breaks_the_start_up_protocol_is_named_and_the_client_goes_on(frames, raw, said):
    worker = LyingWorker(frames, raw)
    started = time.monotonic()
    try:
        with pytest.raises(WorkerError) as err:
            RLPool(COUNTER, 4, worker=worker.url, token=worker.token, progress=True)
    finally:
        worker.close()
    assert worker.opened
    # Typed, and saying what is wrong: no IndexError, TypeError or KeyError from inside the client.
    assert isinstance(err.value, WorkerError), repr(err.value)
    assert said in str(err.value) and "same boltzlabs version" in str(err.value), str(err.value)
    assert time.monotonic() - started < HANG
