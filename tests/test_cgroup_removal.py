"""Removing a pool's cgroups waits while their tasks keep leaving (boltzlabs/host/cgroups.py).

Thousands of killed sandboxes tearing down their namespaces on a loaded machine take
longer to die than any fixed deadline; a removal that gave up at one left the envs'
shared memory cgroup behind after a 10,000-env pool's close. Here the kernel's freezer
makes killed tasks die one at a time, on the test's signal: each stays frozen (a
frozen task acts on SIGKILL only once thawed) until its own freezer cgroup is thawed.
"""

import os
import signal
import subprocess
import threading
import time

import pytest

from boltzlabs.host import cgroups

pytestmark = pytest.mark.skipif(
    cgroups.version() != "v1" or os.geteuid() != 0,
    reason="the envs' shared memory cgroup is cgroup v1's (on v2 each env's cgroup holds only its own tasks); needs root",
)

TASKS = 6
APART = 0.4  # seconds between two tasks' deaths


@pytest.fixture
def dying_one_by_one():
    """A pool whose envs 0..TASKS-1 each hold one killed, frozen task in the envs' shared
    memory cgroup; yields (pool, shared group, start, reap): start() thaws them APART s apart,
    reap() reaps the children that died (a zombie keeps the group busy)."""
    pool = cgroups.CgroupPool(freezer=True)
    children = [subprocess.Popen(["sleep", "600"]) for _ in range(TASKS)]
    try:
        for key, child in enumerate(children):
            for procs in pool.procs_files(key):
                procs.write_text(str(child.pid))
            pool.freeze(key)
        deadline = time.monotonic() + 10
        while not all(pool.frozen(key) for key in range(TASKS)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(pool.frozen(key) for key in range(TASKS))
        for child in children:
            os.kill(child.pid, signal.SIGKILL)
        time.sleep(0.2)
        assert all(child.poll() is None for child in children), "a frozen task died before its thaw"
        shared = pool.group(0)
        assert shared.name == cgroups.SHARED and shared == pool.group(TASKS - 1)

        def thaw_in_turn():
            for key in range(TASKS):
                time.sleep(APART)
                pool.thaw(key)

        thawing = threading.Thread(target=thaw_in_turn, daemon=True)

        def reap():
            for child in children:
                child.poll()

        yield pool, shared, thawing.start, reap
        thawing.join(timeout=30)
    finally:
        for key in range(TASKS):
            pool.thaw(key)
        for child in children:
            child.kill()
            child.wait()
        assert pool.close(time.monotonic() + 10, None), "the test's own pool would not go"


def test_a_removal_waits_while_tasks_keep_leaving(dying_one_by_one):
    pool, shared, start, reap = dying_one_by_one
    start()
    began = time.monotonic()
    # Far less than the TASKS * APART seconds the tasks take to leave, but more than APART.
    assert cgroups._rmdir(shared, began + 2 * APART, reap, stall=2 * APART)
    assert not shared.exists()
    assert time.monotonic() - began >= (TASKS - 1) * APART


def test_a_removal_without_progress_gives_up_at_its_deadline(dying_one_by_one):
    pool, shared, start, reap = dying_one_by_one
    began = time.monotonic()
    assert not cgroups._rmdir(shared, began + 2 * APART, reap, stall=2 * APART)  # nothing thawed: none leaves
    assert shared.exists()
    start()


def test_a_fixed_deadline_is_what_left_the_group_behind(dying_one_by_one):
    """The control: without the stall rule the same removal fails."""
    pool, shared, start, reap = dying_one_by_one
    start()
    assert not cgroups._rmdir(shared, time.monotonic() + 2 * APART, reap)
    assert shared.exists()
