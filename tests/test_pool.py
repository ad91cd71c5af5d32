"""RLPool's API: arguments, resets, splicing, start-up failures and clean close."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from boltzlabs import EnvStartError, PoolClosedError, RLPool
from conftest import COUNTER, PROBE, on_terminal, open_fds


def test_the_product_page_loop(spawn):
    with RLPool(COUNTER, 8, spawn=spawn) as pool:
        assert pool.spawn == spawn
        assert len(pool) == 8
        obs = pool.reset(seed=0)
        assert obs == [{"t": 0}] * 8
        total = 0
        for _t in range(150):
            obs, rewards, dones, infos = pool.step(np.ones(8))
            assert rewards.dtype == np.float32 and rewards.shape == (8,)
            assert dones.dtype == np.bool_ and dones.shape == (8,)
            total += rewards.sum()
            if dones.any():
                assert obs[0] == {"t": 100}
                obs = pool.reset(where=dones)
                assert obs == [{"t": 0}] * 8
        assert total == 150 * 8
        assert pool.timing.worker_ms > 0 and pool.timing.roundtrip_ms >= pool.timing.worker_ms
        assert pool.timing.stragglers == []
        assert pool.envs_per_gb() > 10


def test_seeds_int_and_list(probe_pool):
    pool = probe_pool(3)
    obs = pool.reset(seed=10)
    assert [o["seed"] for o in obs] == [10, 11, 12]
    obs = pool.reset(seed=[7, 8, 9])
    assert [o["seed"] for o in obs] == [7, 8, 9]
    obs = pool.reset(seed=[7, 8, 9], where=[2])
    assert [o["seed"] for o in obs] == [7, 8, 9]
    assert pool.reset_infos[2] == {"reset_info": True}
    assert pool.reset()[0]["seed"] is None


def test_partial_reset_splices_latest_observations(probe_pool):
    pool = probe_pool(4)
    pool.reset(seed=0)
    obs, *_ = pool.step([1, 1, 1, 1])
    obs, *_ = pool.step([1, 1, 1, 1])
    assert [o["t"] for o in obs] == [2, 2, 2, 2]
    spliced = pool.reset(where=np.array([False, True, False, True]), seed=100)
    assert [o["t"] for o in spliced] == [2, 0, 2, 0]
    assert spliced[0] == obs[0] and spliced[2] == obs[2]
    assert spliced[1]["seed"] == 101 and spliced[3]["seed"] == 103
    assert pool.reset(where=[0])[1:] == spliced[1:]
    assert pool.reset(where=np.zeros(4, bool)) == pool.reset(where=[])


def episode(pool, **reset_args):
    """An episode's bytes: the reset observation and 5 steps, as they crossed the wire."""
    import msgpack

    frames = [pool.reset(**reset_args)]
    for _ in range(5):
        obs, rewards, dones, _ = pool.step([1])
        frames.append([obs, rewards.tolist(), dones.tolist()])
    return msgpack.packb(frames)


def test_hard_reset_is_byte_identical_soft_reset_is_not(probe_pool):
    pool = probe_pool(1)
    first = episode(pool, seed=3)
    assert episode(pool, seed=3) != first  # soft: the env's own state (episode count) carries over
    assert episode(pool, seed=3, hard=True) == first
    assert episode(pool, seed=3, hard=True) == first
    assert episode(pool, seed=3) != first


def test_workspace_kept_by_soft_reset_wiped_by_hard_reset(probe_pool):
    pool = probe_pool(2)
    pool.reset(seed=0)
    pool.step([{"op": "ws_write", "text": "kept"}] * 2)
    pool.reset()
    obs, *_ = pool.step([{"op": "ws_read"}] * 2)
    assert obs[0]["out"] == {"ok": "kept"}
    pool.reset(hard=True, where=[1])
    obs, *_ = pool.step([{"op": "ws_read"}] * 2)
    assert obs[0]["out"] == {"ok": "kept"}
    assert "FileNotFoundError" in obs[1]["out"]["denied"]


@pytest.mark.parametrize(
    "bad, error",
    [
        (lambda d: RLPool(d / "missing", 1), "is not a directory"),
        (lambda d: RLPool(d, 1), "has no env.py"),
        (lambda d: RLPool(PROBE, 0), "at least 1"),
        (lambda d: RLPool(PROBE, 2.5), "whole number"),
        (lambda d: RLPool(PROBE, 1, step_timeout=-1), "positive number"),
        (lambda d: RLPool(PROBE, 1, workspace_size="lots"), "as a size"),
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(tmp_path, bad, error):
    with pytest.raises((ValueError, TypeError), match=error):
        bad(tmp_path)


def test_bad_actions_are_refused_before_a_byte_is_sent(probe_pool):
    pool = probe_pool(2)
    pool.reset(seed=0)
    with pytest.raises(ValueError, match="needs 2 actions, one per env; got 3"):
        pool.step([1, 1, 1])
    with pytest.raises(ValueError, match="first dimension is 2"):
        pool.step(np.ones((3, 2)))
    with pytest.raises(TypeError, match="action for env 1 cannot be sent"):
        pool.step([1, object()])
    with pytest.raises(ValueError, match="mask needs 2 booleans"):
        pool.reset(where=[True, False, True])
    with pytest.raises(ValueError, match="outside"):
        pool.reset(where=[5])
    with pytest.raises(ValueError, match="one seed per env"):
        pool.reset(seed=[1])
    # Nothing was sent, so the pool is fine.
    assert pool.step(np.array([1, 2]))[1].tolist() == [1.0, 2.0]
    # An (n, k) array gives each env its row, as an array (the probe's float() of it fails).
    _, _, dones, infos = pool.step(np.array([[1, 1], [2, 2]]))
    assert "arrays can be converted to Python scalars" in infos[0]["error"]


def test_use_after_close(probe_pool):
    pool = probe_pool(1)
    pool.close()
    pool.close()  # idempotent
    assert pool.closed
    with pytest.raises(PoolClosedError, match="create a new one"):
        pool.step([1])
    with pytest.raises(PoolClosedError):
        pool.reset()


@pytest.mark.parametrize(
    "source, expected",
    [
        ("raise RuntimeError('broken at import')\n", "broken at import"),
        ("import os\nos._exit(4)\n", "exited with code 4"),
        ("x = 1  # never calls serve()\n", "returned without calling serve()"),
        ("import time\ntime.sleep(60)\n", "did not complete its handshake"),
        ("import os\nos.write(3, b'nonsense!')\nimport time\ntime.sleep(5)\n", "sent an invalid frame"),
        (
            "import os, time\nfrom boltzlabs import wire\nos.write(3, wire.encode([99]))\ntime.sleep(5)\n",
            "sent [99] instead of its handshake",
        ),
    ],
)
def test_start_up_failure_names_env_and_shows_its_output(env_dir, spawn, source, expected):
    directory = env_dir(source)
    started = time.monotonic()
    with pytest.raises(EnvStartError) as caught:
        RLPool(directory, 3, start_timeout=2, spawn=spawn)
    assert time.monotonic() - started < 20
    assert expected in str(caught.value)
    assert caught.value.env_index in (0, 1, 2)
    assert f"env {caught.value.env_index}" in str(caught.value)
    if "broken" in expected:
        assert "Traceback" in caught.value.log
        # The env's own error: the message sends the user to env.py, not to the sandbox's set-up.
        assert f"Fix the error in {directory}/env.py" in str(caught.value)
        assert "set-up failed" not in str(caught.value)


def _descendants():
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _our_cgroups(*workers: int) -> set:
    """The pool cgroups of these worker pids (named boltzlabs-<worker pid>-<tag>) where
    this process's pools make them, which other test sessions share (CI runs two at once)."""
    from boltzlabs.host.cgroups import pool_home

    home = pool_home()
    return {p.name for worker in workers for p in home.glob(f"boltzlabs-{worker}-*")}


def test_close_leaves_nothing_behind(spawn):
    fds, children = open_fds(), _descendants()
    pool = RLPool(PROBE, 4, step_timeout=0.5, spawn=spawn)
    pool.reset(seed=0)
    pool.step([1, {"op": "sleep", "s": 60}, 1, 1])  # a busy env at close too
    assert len(_descendants()) > len(children)
    worker = pool._proc.pid
    assert len(_our_cgroups(worker)) == 1  # the pool made one cgroup
    pool.close()
    assert _descendants() == children
    assert open_fds() == fds
    assert not _our_cgroups(worker)


def test_interrupted_call_and_dropped_pool_leave_nothing_behind(spawn):
    fds, children = open_fds(), _descendants()
    pool = RLPool(PROBE, 2, step_timeout=30, spawn=spawn)
    pool.reset(seed=0)
    workers = [pool._proc.pid]
    signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    try:
        with pytest.raises(KeyboardInterrupt):
            pool.step([{"op": "sleep", "s": 20}, 1])
    finally:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
    assert pool.closed
    with pytest.raises(PoolClosedError):
        pool.step([1, 1])
    pool2 = RLPool(PROBE, 2, spawn=spawn)
    workers.append(pool2._proc.pid)
    del pool2  # garbage collection closes it
    assert _descendants() == children
    assert open_fds() == fds
    assert not _our_cgroups(*workers)


CLIENT = """
import sys, time
sys.path.insert(0, {root!r})
from boltzlabs import RLPool
pool = RLPool({probe!r}, 3, spawn={spawn!r})
pool.reset(seed=0)
print((pool.pids(), pool._proc.pid), flush=True)
{ending}
"""


@pytest.mark.parametrize("ending", ["pass  # interpreter exit", "import os; os.kill(os.getpid(), 9)"])
def test_client_exit_or_death_leaves_no_sandbox(spawn, ending):
    code = CLIENT.format(root=str(Path(__file__).parent.parent), probe=str(PROBE), ending=ending, spawn=spawn)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    pids, worker = eval(out.stdout.strip().splitlines()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in pids):
        time.sleep(0.05)
    assert not any(psutil.pid_exists(p) for p in pids)
    while time.monotonic() < deadline and _our_cgroups(worker):
        time.sleep(0.05)
    assert not _our_cgroups(worker)


def test_worker_death_is_a_clear_error_and_kills_every_sandbox(spawn):
    pool = RLPool(PROBE, 2, spawn=spawn)
    pool.reset(seed=0)
    pids = pool.pids()
    os.kill(pool._proc.pid, signal.SIGKILL)
    from boltzlabs import WorkerError

    with pytest.raises(
        WorkerError, match=r"worker \(pid \d+\) was killed by SIGKILL \(signal 9\).*create a new"
    ) as err:
        pool.step([1, 1])
    assert err.value.signal is signal.SIGKILL and "exit code" not in str(err.value)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in pids):
        time.sleep(0.05)
    assert not any(psutil.pid_exists(p) for p in pids)
    pool.close()


PROGRESS = """
import sys
sys.path.insert(0, {root!r})
from boltzlabs import RLPool
with RLPool({counter!r}, 64, spawn="exec") as pool:
    pass
print("done", file=sys.stderr)
"""


def test_start_up_shows_progress_on_a_terminal():
    code = PROGRESS.format(root=str(Path(__file__).parent.parent), counter=str(COUNTER))
    text = on_terminal([sys.executable, "-c", code], until="done", timeout=60)
    assert "starting envs" in text and "/64" in text, repr(text[:300])


def test_a_host_without_bwrap_is_told_what_to_install():
    """The worker checks for bwrap (the trainer no longer reads the sandbox policy, #15) and the
    pool raises SandboxUnavailable with the install command, before anything starts."""
    code = (
        "from boltzlabs import RLPool, SandboxUnavailable\n"
        f"try:\n    RLPool({str(COUNTER)!r}, 1)\n"
        "except SandboxUnavailable as exc:\n    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PATH": "/nonexistent"},
    )
    assert out.returncode == 0, out.stderr
    assert "bubblewrap (bwrap) is not installed" in out.stdout and "apt-get install -y bubblewrap" in out.stdout


def test_a_trainer_holding_fd_numbers_past_1024_opens_and_closes_pools():
    """select() refuses fd numbers from 1024 up; a trainer with many envs,
    loaders or sockets open holds such numbers, and the pool's own fds (the
    worker's socket, the guardian's pidfd) then land there too."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1400:
        pytest.skip(f"the fd hard limit here is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1400), hard))
    filler = []
    try:
        while len(filler) < 1100:  # every number below ~1100 taken
            filler.append(os.open(os.devnull, os.O_RDONLY))
        with RLPool(COUNTER, 2) as pool:
            pool.reset(seed=0)
            pool.step([1, 1])
            pool.reset(hard=True)
        assert pool.closed
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_spawners_wait_on_fd_numbers_past_1024():
    from boltzlabs.worker.spawn import _readable

    r, w = os.pipe()
    high = os.dup2(r, 2000)
    try:
        assert _readable([high], 0) == set()
        os.write(w, b"x")
        assert _readable([high, r], 1.0) == {high, r}
    finally:
        for fd in (r, w, high):
            os.close(fd)
