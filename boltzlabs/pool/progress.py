"""The "starting envs" bar: one over every worker process of a pool.

    worker --[PROGRESS, ready, n]--> RLPool._open --check()--> Counter(ready) --> StartProgress --> one tqdm bar
                                     (one per worker: a sharded pool's shards, a cluster's nodes)

A one-worker pool, a sharded pool (pool/shards.py) and a ClusterPool all
start their workers' pools at once, each worker reporting how many of its
own envs are ready. StartProgress sums those counts into one bar of the
whole pool's size, so 10,000 envs over three shards show one bar that
reaches 10,000, not three bars racing or none. Reports come from the
threads that open the shards, hence the lock.

A worker's PROGRESS frame is input (a remote worker is another machine's
process): check() takes exactly [PROGRESS, ready, n] with whole numbers,
n the envs that worker was asked for and 0 <= ready <= n, and raises
WorkerError naming what arrived otherwise, whether or not a bar is shown.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

from boltzlabs import wire
from boltzlabs.errors import WorkerError

__all__ = ["MIN_ENVS", "StartProgress", "check", "shown", "wanted"]

# Below this many envs a pool starts in well under a second: no bar unless asked for.
MIN_ENVS = 64


def wanted(progress, n: int) -> bool:
    """RLPool(progress=) resolved: None is on for n >= MIN_ENVS when stderr is a terminal."""
    if progress is None:
        return n >= MIN_ENVS and sys.stderr.isatty()
    return bool(progress)


@contextlib.contextmanager
def shown(progress, n: int, parent: StartProgress | None = None, what: str = "env") -> Iterator[StartProgress | None]:
    """The bar a pool's workers report to while it starts: `parent`'s when the pool is part of a
    larger one (a sharded pool's shard, a ClusterPool's node), else one of its own when `progress`
    asks for it (closed on leaving), else None. `what` the bar counts: "env", or "sandbox" for a
    grouped pool (pool/groups.py), whose workers start sandboxes of several envs."""
    if parent is not None or not wanted(progress, n):
        yield parent
        return
    bar = StartProgress(n, what)
    try:
        yield bar
    finally:
        bar.close()


def check(message: list, n: int) -> int:
    """The ready count of a worker's [PROGRESS, ready, n] frame, for a worker asked for n envs."""
    if (
        len(message) == 3
        and type(message[1]) is int
        and type(message[2]) is int
        and message[2] == n
        and 0 <= message[1] <= n
    ):
        return message[1]
    raise WorkerError(
        f"the worker sent a malformed start-up progress message {message!r:.120} (expected "
        f"[{wire.PROGRESS}, ready, {n}] with 0 <= ready <= {n}): it does not speak this client's protocol; "
        "run the same boltzlabs version on both sides"
    )


_PLURAL = {"env": "envs", "sandbox": "sandboxes"}


class StartProgress:
    """One bar of `total` envs over the workers that start them; counter() for each worker."""

    def __init__(self, total: int, what: str = "env"):
        self._total = total
        self._what = what  # what it counts: "env", or "sandbox" (a grouped pool's)
        self._ready: list[int] = []  # each worker's latest ready count
        self._bar: Any = None  # a tqdm, made at the first report: a pool that fails at once draws nothing
        self._lock = threading.Lock()

    def counter(self):
        """A callable taking one worker's ready count (all of its envs, not an increment)."""
        with self._lock:
            slot = len(self._ready)
            self._ready.append(0)

        def report(ready: int) -> None:
            with self._lock:
                self._ready[slot] = ready
                if self._bar is None:
                    from tqdm import tqdm

                    self._bar = tqdm(
                        total=self._total, desc=f"starting {_PLURAL[self._what]}", unit=self._what, leave=False
                    )
                self._bar.update(sum(self._ready) - self._bar.n)

        return report

    @property
    def ready(self) -> int:
        """Envs ready across every worker, as last reported."""
        with self._lock:
            return sum(self._ready)

    def close(self) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None
