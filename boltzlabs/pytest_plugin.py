"""The boltzlabs pytest plugin: the `rlpool` fixture and its options, for users' CI.

    test --rlpool(source, n, **kwargs)--> RLPool (spawn= from --boltzlabs-spawn unless given)
         ... the test fails --> --boltzlabs-keep-logs: each env's log (pool.log(i)) as a report section
    teardown --> close every pool --> any process or cgroup of a pool left? --> the test errors in
                 its teardown, naming them; they are then killed and removed, so one leak does not
                 spill into the next test

Registered through the `pytest11` entry point, so it loads in every pytest run
where boltzlabs is installed: at collection it imports only pytest. RLPool
(numpy), psutil and the cgroup code are imported when a test first asks for
`rlpool`.

What a pool owns is recorded from the host, never from what an env says: the
worker process and every process below it (bwraps, the template, the envs),
with their start times so that a reused pid is not mistaken for a leftover
(in clock ticks since boot, from /proc/<pid>/stat: psutil's create_time()
adds the boot time of /proc/stat, which moves by a second when the wall clock
is stepped or slewed, and would make a live process look like another one),
taken when the pool is made and again just before it is closed (to include
envs respawned by hard resets); and the pool's cgroup directories (one per
hierarchy). Pools on a remote worker or a Ray cluster own nothing on this host:
they are closed, not checked.
"""

from __future__ import annotations

import os
import time

import pytest

# How long teardown waits for a closed pool's processes and cgroups to go:
# close() waits for the worker itself, so this only covers the kernel's reaping.
LEFTOVER_WAIT = 5.0

_POOLS = pytest.StashKey[list]()


def pytest_addoption(parser) -> None:
    """The plugin's command-line options."""
    group = parser.getgroup("boltzlabs", "boltzlabs sandboxed env pools (the rlpool fixture)")
    group.addoption(
        "--boltzlabs-spawn",
        choices=("template", "exec"),
        default="template",
        help="how pools made by the rlpool fixture start their sandboxes, unless a test passes "
        "spawn= (default: template)",
    )
    group.addoption(
        "--boltzlabs-keep-logs",
        action="store_true",
        default=False,
        help="attach the log of every env of a failing test's rlpool pools to its report",
    )


@pytest.fixture
def rlpool(request):
    """A factory of RLPools: `rlpool(source, n, **kwargs)` returns an open pool.

    Every pool it made is closed at the end of the test; the test then fails
    (an error in its teardown) if any of a pool's processes or cgroups remain.
    `spawn` defaults to --boltzlabs-spawn.
    """
    tracked: list[_Tracked] = []
    request.node.stash[_POOLS] = tracked
    spawn = request.config.getoption("boltzlabs_spawn")

    def make(source, n, **kwargs):
        from boltzlabs import RLPool

        kwargs.setdefault("spawn", spawn)
        pool = RLPool(source, n, **kwargs)
        tracked.append(_Tracked(pool))
        return pool

    yield make
    left = []
    for entry in tracked:
        left.extend(entry.close())
    if left:
        pytest.fail(
            "rlpool: after close() and a wait of {:g} s these remain:\n  {}\nThey were killed and removed "
            "now; a pool that leaves them behind leaks on every run (report it with this list).".format(
                LEFTOVER_WAIT, "\n  ".join(left)
            ),
            pytrace=False,
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """With --boltzlabs-keep-logs, a failing test's report gets each env's log."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed or not item.config.getoption("boltzlabs_keep_logs"):
        return
    for number, entry in enumerate(item.stash.get(_POOLS, [])):
        for title, text in entry.logs(number):
            report.sections.append((title, text))


KEEP_LOGS_MAX = 16


class _Tracked:
    """One pool the fixture made, with what it owns on this host."""

    def __init__(self, pool):
        self.pool = pool
        self.processes: dict[int, int] = {}  # pid -> start time (started())
        self.cgroups = [str(path) for path in (getattr(pool, "_cgroup", None) or [])]
        self._record()

    def _record(self) -> None:
        worker = getattr(self.pool, "_proc", None)
        if worker is not None:
            self.processes.update(descendants(worker.pid))

    def logs(self, number: int) -> list:
        """(title, text) of each env's log; one line for a pool that cannot give them."""
        from boltzlabs.errors import BoltzLabsError

        pool = self.pool
        name = f"boltzlabs pool {number} ({pool.source}, spawn={getattr(pool, 'spawn', '?')})"
        if pool.closed:
            return [(name, "the pool was closed before the test failed: no logs")]
        sections = []
        # A report is read by a person: the first KEEP_LOGS_MAX envs' logs, not a thousand.
        shown = min(len(pool), KEEP_LOGS_MAX)
        try:
            for i in range(shown):
                sections.append((f"{name}: env {i} log", pool.log(i) or "(empty)"))
        except BoltzLabsError as exc:
            sections.append((name, f"the logs could not be read: {type(exc).__name__}: {exc}"))
        if len(pool) > shown:
            sections.append(
                (
                    name,
                    f"logs of envs {shown}..{len(pool) - 1} left out (at most {KEEP_LOGS_MAX} "
                    "per pool); read them with pool.log(i) in the test",
                )
            )
        return sections

    def close(self) -> list:
        """Close the pool; what it left behind, in words (killed and removed by then)."""
        if not self.pool.closed:
            self._record()  # envs respawned since the pool was made
        self.pool.close()
        left = remaining(self.processes, self.cgroups, LEFTOVER_WAIT)
        if left:
            _clean_up(self.processes, self.cgroups)
            worker = getattr(self.pool, "_proc", None)
            if worker is not None:
                worker.poll()  # reap our own child
        return left


def started(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (field 22 of
    /proc/<pid>/stat: the kernel's, unmoved by any clock change); None once it is gone."""
    from boltzlabs.runtime.rlimits import stat_fields

    fields = stat_fields(pid)
    return None if fields is None else int(fields[19])


def descendants(pid: int) -> dict:
    """{pid: start time (started())} of a process and every process below it, now."""
    import psutil

    try:
        root = psutil.Process(pid)
        family = [root] + root.children(recursive=True)
    except psutil.Error:
        return {}
    found = {}
    for process in family:
        start = started(process.pid)
        if start is not None:
            found[process.pid] = start
    return found


def remaining(processes: dict, cgroups: list, wait: float) -> list:
    """Which of `processes` ({pid: start time, as started() gives}) still run and which `cgroups`
    directories still exist, waiting up to `wait` seconds for them to go."""
    deadline = time.monotonic() + wait
    while True:
        left = [f"process {pid} ({what})" for pid, start in sorted(processes.items()) if (what := _running(pid, start))]
        left += [f"cgroup {path}" for path in cgroups if os.path.isdir(path)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def _running(pid: int, start: int) -> str:
    """The process's name and state when that very process still runs (a zombie has ended); else ''."""
    import psutil

    try:
        process = psutil.Process(pid)
        if started(pid) != start:
            return ""  # the pid was reused (or it is gone)
        status = process.status()
        if status == psutil.STATUS_ZOMBIE:
            return ""
        return f"{process.name()}, {status}"
    except psutil.Error:
        return ""


def _clean_up(processes: dict, cgroups: list) -> None:
    """Kill what is left (the same processes, by pid and start time) and remove the cgroups."""
    import psutil

    from boltzlabs.host.cgroups import remove_pool_dir

    for pid, start in processes.items():
        try:
            process = psutil.Process(pid)
            if started(pid) == start:
                process.kill()
        except psutil.Error:
            continue
    if cgroups:
        remove_pool_dir(cgroups)
