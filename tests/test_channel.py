"""The worker<->env channel: two pipes by default, a socketpair as the fallback (issue 16).

Real pools over real sandboxes, in both spawn modes and on both of the
worker's step paths (native and pure). The env below answers a number with
a normal step and a {"op": ...} with one behaviour: it reports what it holds
(its fds, pipe sizes, signal dispositions), returns big observations, or
misuses its channel the way a hostile or broken env could (closing one end,
writing where it reads, writing after its reply, never reading, putting its
channel over stdout). Each misuse may cost its own lane, never another's,
and never the worker: the other lane answers normally in the same call.
"""

import errno
import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from boltzlabs import RLPool
from boltzlabs.runtime.serve import _channel_fds
from boltzlabs.worker.config import FD_SLACK, FDS_PER_ENV, envs_within, fds_needed
from conftest import COUNTER
from framers import PATHS, use_path

F_SETPIPE_SZ, F_GETPIPE_SZ = 1031, 1032
SIGPIPE_BIT = 1 << 12  # signal 13 in /proc/<pid>/status SigIgn
STEP_TIMEOUT = 2.0

CHANNEL_ENV = """
import fcntl
import os
import struct
import time

from boltzlabs import wire
from boltzlabs.env import serve
from boltzlabs.runtime import serve as runtime

F_SETPIPE_SZ, F_GETPIPE_SZ = 1031, 1032
AFTER = []  # what the env does once its reply is written

original = runtime._reply

def reply(channel, seq, phase, build, call, *args):
    original(channel, seq, phase, build, call, *args)
    while AFTER:
        AFTER.pop(0)(seq)

runtime._reply = reply

def hang(seq=None):
    while True:
        time.sleep(60)

def pipe_size(fd):
    try:
        return fcntl.fcntl(fd, F_GETPIPE_SZ)
    except OSError as exc:
        return -exc.errno

def _open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False

def sigign():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))

def step(action):
    lane = int(os.environ["BOLTZLABS_ENV_INDEX"])
    if not isinstance(action, dict):
        return {"lane": lane, "action": action}, 1.0, False, {}
    op = action["op"]
    if op == "fds":
        fds = [fd for fd in sorted(int(fd) for fd in os.listdir("/proc/self/fd")) if _open(fd)]  # less listdir's own
        kinds = {fd: os.readlink(f"/proc/self/fd/{fd}").split(":")[0] for fd in fds}
        out = {"fds": fds, "kinds": kinds, "sizes": {fd: pipe_size(fd) for fd in fds}, "sigign": sigign()}
        return out, 0.0, False, {}
    if op == "big":
        return b"x" * action["size"], 0.0, False, {}
    if op == "chatter":  # far more output than the one-page log pipe holds
        for i in range(action["lines"]):
            print(f"chatter {i:06d} " + "." * 100)
        print("chatter done", flush=True)
        return {"lane": lane, "action": op}, 1.0, False, {}
    if op == "shrink":  # an env may shrink its own pipes: it costs only its own lane's speed
        for fd in (3, 4):
            fcntl.fcntl(fd, F_SETPIPE_SZ, 4096)
        return [pipe_size(3), pipe_size(4)], 0.0, False, {}
    if op == "close_read_then_hang":
        AFTER.extend([lambda seq: os.close(4), hang])
    elif op == "close_write_then_hang":
        AFTER.extend([lambda seq: os.close(3), hang])
    elif op == "write_to_read_end":
        os.write(4, b"\\x01\\x00\\x00\\x00\\x90")
    elif op == "frames_after_reply":
        AFTER.append(lambda seq: os.write(3, wire.encode([wire.STEPPED, seq, 0, 0.0, False, False, {}]) * 3))
    elif op == "stop_reading":
        AFTER.append(hang)
    elif op == "dup_over_stdout":
        os.dup2(action["fd"], 1)
        os.write(1, b"printed after dup2 " * 1000)
    return {"lane": lane, "action": op}, 1.0, False, {}

serve(reset=lambda seed: {"lane": int(os.environ["BOLTZLABS_ENV_INDEX"])}, step=step)
"""


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """Both of the worker's step paths: native (_fastpath) and pure Python."""
    return use_path(request, monkeypatch)


@pytest.fixture
def channel_pool(env_dir, pool_factory, path):
    source = env_dir(CHANNEL_ENV)

    def make(n=2, **kwargs):
        kwargs.setdefault("step_timeout", STEP_TIMEOUT)
        pool = pool_factory(source, n, **kwargs)
        assert pool.fast_path == (path == "native")
        pool.reset(seed=0)
        return pool

    return make


def normal(obs, infos, lane, action=7):
    assert "error" not in infos[lane], infos[lane]
    assert obs[lane] == {"lane": lane, "action": action}


def recovers(pool, lane):
    """The lane comes back at its reset and both lanes step normally."""
    pool.reset(where=[lane])
    obs, _, _, infos = pool.step([5, 5])
    normal(obs, infos, 0, 5)
    normal(obs, infos, 1, 5)


def worker_ignores_sigpipe(pool) -> bool:
    status = Path(f"/proc/{pool._proc.pid}/status").read_text()
    ignored = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")), 16)
    return bool(ignored & SIGPIPE_BIT)


# --- what an env holds -----------------------------------------------------------------------


def test_an_env_holds_two_pipes_and_a_one_page_log_pipe(channel_pool):
    pool = channel_pool()
    assert pool.channel == "pipes"
    obs, _, _, infos = pool.step([{"op": "fds"}] * 2)
    for out in obs:
        # 7: the env's observation slot (docs/wire.md). This env's space has no
        # fixed shape, so a lane spawned before lane 0's HELLO holds an empty
        # memfd, one spawned after it (a slow fork) none.
        assert out["fds"] in ([0, 1, 2, 3, 4, 7], [0, 1, 2, 3, 4]), out
        kinds = {int(k): v for k, v in out["kinds"].items()}
        assert kinds.get(7, "/memfd") == "/memfd", kinds
        sizes = {int(k): v for k, v in out["sizes"].items()}
        assert kinds[3] == kinds[4] == "pipe" and kinds[1] == "pipe", kinds
        assert sizes[3] >= 4096 and sizes[4] >= 4096  # 64 KiB unless the host's pipe quota is spent
        assert sizes[1] == 4096  # the log pipe: one page (spawn.LOG_PIPE_SIZE)
        assert out["sigign"] & SIGPIPE_BIT  # as Python sets it; a write to a closed pipe raises EPIPE
    assert worker_ignores_sigpipe(pool)


def test_the_socketpair_channel_can_be_forced(channel_pool, monkeypatch):
    monkeypatch.setenv("BOLTZLABS_CHANNEL", "socketpair")
    pool = channel_pool()
    assert pool.channel == "socketpair"
    obs, _, _, infos = pool.step([{"op": "fds"}, 7])
    assert obs[0]["fds"] == [0, 1, 2, 3, 7] and {int(k): v for k, v in obs[0]["kinds"].items()}[3] == "socket", obs[0]
    normal(obs, infos, 1)
    obs, _, _, infos = pool.step([{"op": "big", "size": 1 << 20}, 7])
    assert obs[0] == b"x" * (1 << 20)


def test_a_wrong_channel_choice_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("BOLTZLABS_CHANNEL", "carrier-pigeon")
    with pytest.raises(ValueError, match="BOLTZLABS_CHANNEL='carrier-pigeon'.*'pipes'.*'socketpair'"):
        RLPool(COUNTER, 2)


@pytest.mark.parametrize(
    "value", ["", "3,", ",3", "3,4,5", "4,4", "2", "1024", "x", "\u0663", " 3", "3" * 40, "-3", "3.0", "4,3,"]
)
def test_the_env_refuses_a_malformed_channel_variable(value):
    with pytest.raises(RuntimeError, match="BOLTZLABS_FD"):
        _channel_fds(value)


def test_the_env_reads_the_channel_variable_the_worker_sets():
    assert _channel_fds("3") == (3,)
    assert _channel_fds("4,3") == (4, 3)


# --- big observations, through full and shrunk pipes ----------------------------------------


@pytest.mark.parametrize("size", [84 * 84 * 3, 1 << 20])
def test_big_observations_cross_the_pipes(channel_pool, size):
    pool = channel_pool()
    for _ in range(2):
        obs, _, _, infos = pool.step([{"op": "big", "size": size}, 7])
        assert obs[0] == b"x" * size, infos[0]
        normal(obs, infos, 1)


def test_an_env_that_shrinks_its_pipes_to_one_page_still_gets_big_frames_through(channel_pool):
    """As a pool past the host's pipe quota gets (docs/wire.md#the-channel):
    a 1 MiB reply in 4 KiB pieces, a 300 KiB action likewise."""
    pool = channel_pool()
    obs, _, _, infos = pool.step([{"op": "shrink"}, 7])
    assert obs[0] == [4096, 4096], infos[0]
    obs, _, _, infos = pool.step([{"op": "big", "size": 1 << 20}, 7])
    assert obs[0] == b"x" * (1 << 20), infos[0]
    action = "a" * (300 << 10)
    obs, _, _, infos = pool.step([action, 7])
    assert obs[0] == {"lane": 0, "action": action}, infos[0]
    normal(obs, infos, 1)


def test_an_env_printing_far_more_than_its_log_pipe_holds_steps_on(channel_pool):
    """The log pipe is one page: 300 KiB of prints per step cost the env
    waits for the worker to read its log, not its lane."""
    pool = channel_pool()
    for _ in range(2):
        obs, _, _, infos = pool.step([{"op": "chatter", "lines": 3000}, 7])
        normal(obs, infos, 0, "chatter")
        normal(obs, infos, 1)
    assert "chatter done" in pool.log(0)


# --- hostile channels: each costs its own lane only ------------------------------------------


def test_an_env_that_closes_its_read_end_fails_only_its_lane(channel_pool):
    """Its write end stays open, so no EOF tells the worker: the worker's
    next write fails with EPIPE (not SIGPIPE), the channel is closed, and
    the lane misses its deadline; the other lane answers at once."""
    pool = channel_pool()
    obs, _, _, infos = pool.step([{"op": "close_read_then_hang"}, 7])
    normal(obs, infos, 0, "close_read_then_hang")
    start = time.monotonic()
    obs, _, dones, infos = pool.step([7, 7])
    assert time.monotonic() - start < STEP_TIMEOUT + 10
    assert dones[0] and obs[0] is None and infos[0].get("straggler"), infos[0]
    normal(obs, infos, 1)
    assert worker_ignores_sigpipe(pool) and pool._proc.poll() is None
    recovers(pool, 0)


def test_an_env_that_closes_its_write_end_fails_only_its_lane(channel_pool):
    pool = channel_pool()
    obs, _, _, infos = pool.step([{"op": "close_write_then_hang"}, 7])
    normal(obs, infos, 0, "close_write_then_hang")
    obs, _, dones, infos = pool.step([7, 7])
    assert dones[0] and obs[0] is None and infos[0].get("straggler"), infos[0]
    normal(obs, infos, 1)
    recovers(pool, 0)


def test_an_env_writing_to_its_read_end_gets_ebadf(channel_pool):
    pool = channel_pool()
    obs, _, dones, infos = pool.step([{"op": "write_to_read_end"}, 7])
    assert obs[0] is None and f"[Errno {errno.EBADF}]" in infos[0]["error"], infos[0]
    normal(obs, infos, 1)
    obs, _, _, infos = pool.step([7, 7])  # it keeps serving: its step raised, nothing else
    normal(obs, infos, 0)
    normal(obs, infos, 1)


def test_frames_written_after_the_reply_kill_the_lane(channel_pool):
    pool = channel_pool()
    pool.step([{"op": "frames_after_reply"}, 7])
    obs, _, dones, infos = pool.step([7, 7])
    assert dones[0] and obs[0] is None, infos[0]
    assert "protocol violation" in infos[0]["error"] or "dead" in infos[0]["error"], infos[0]
    normal(obs, infos, 1)
    recovers(pool, 0)


def test_an_env_that_never_reads_cannot_block_the_worker(channel_pool):
    """A 1 MiB action to an env that stopped reading fills its pipe: the
    worker keeps the rest and goes on (its write end is non-blocking)."""
    pool = channel_pool()
    pool.step([{"op": "stop_reading"}, 7])
    big = "a" * (1 << 20)
    start = time.monotonic()
    obs, _, dones, infos = pool.step([big, 7])
    assert time.monotonic() - start < STEP_TIMEOUT + 10
    assert dones[0] and infos[0].get("straggler"), infos[0]
    normal(obs, infos, 1)
    for _ in range(3):  # the worker still serves the other lane, the stuck one reported at once
        obs, _, dones, infos = pool.step([7, 7])
        normal(obs, infos, 1)
        assert infos[0].get("straggler"), infos[0]
    recovers(pool, 0)


@pytest.mark.parametrize(
    "fd, words",
    [
        (3, "invalid frame"),  # its stdout into the pipe the worker reads: garbage, killed at once
        (4, "Bad file descriptor"),  # its stdout onto the end it reads: its own writes fail
    ],
)
def test_an_env_that_puts_its_channel_over_stdout_hurts_only_its_lane(channel_pool, fd, words):
    pool = channel_pool()
    obs, _, dones, infos = pool.step([{"op": "dup_over_stdout", "fd": fd}, 7])
    assert obs[0] is None and words in infos[0]["error"], infos[0]
    normal(obs, infos, 1)
    recovers(pool, 0)


def test_the_socketpair_channel_withstands_the_same_misuse(channel_pool, monkeypatch):
    """The fallback's lanes: an env that closes its socket (EOF while it
    lives: the native step once refused the closed fd and the worker died),
    writes after its reply, or stops reading fails only its own lane."""
    monkeypatch.setenv("BOLTZLABS_CHANNEL", "socketpair")
    pool = channel_pool()
    assert pool.channel == "socketpair"
    for op, action in [("close_write_then_hang", 7), ("frames_after_reply", 7), ("stop_reading", "a" * (1 << 20))]:
        pool.step([{"op": op}, 7])
        obs, _, dones, infos = pool.step([action, 7])
        assert dones[0] and obs[0] is None, (op, infos[0])
        normal(obs, infos, 1)
        recovers(pool, 0)


# --- the fd limit decides the channel ----------------------------------------------------------

FALLBACK_CLIENT = r"""
import json, resource, sys
from boltzlabs import RLPool
n, limit = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
try:
    # One worker: its own fallback is what is tested (workers=None would
    # split a pool its open-file table cannot hold with pipes over more workers).
    with RLPool(sys.argv[3], n, spawn=sys.argv[4], workers=int(sys.argv[5]) or None) as pool:
        pool.reset(seed=0)
        obs = pool.step([1] * n)[0]
        print(json.dumps({"channel": pool.channel, "obs": obs, "workers": pool.workers}))
except ValueError as exc:
    print(json.dumps({"error": str(exc)}))
"""


def run_with_fd_limit(n: int, limit: int, spawn: str, workers: int = 1) -> dict:
    """A pool opened by a client whose hard open-file limit is `limit` (the
    worker inherits it; without CAP_SYS_RESOURCE it cannot raise it)."""
    # setpriv drops CAP_SYS_RESOURCE so that root cannot raise the hard limit either.
    prefix = ["setpriv", "--inh-caps=-sys_resource", "--bounding-set=-sys_resource"] if os.geteuid() == 0 else []
    done = subprocess.run(
        [*prefix, sys.executable, "-c", FALLBACK_CLIENT, str(n), str(limit), str(COUNTER), spawn, str(workers)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_pool_falls_back_to_the_socketpair_when_the_fd_limit_cannot_hold_pipes(spawn):
    n = 8
    assert fds_needed(n) == 4 * n + FD_SLACK and fds_needed(n, "socketpair") == 3 * n + FD_SLACK
    roomy = run_with_fd_limit(n, fds_needed(n), spawn)
    assert roomy["channel"] == "pipes" and roomy["obs"] == [{"t": 1}] * n, roomy
    tight = run_with_fd_limit(n, fds_needed(n) - 1, spawn)
    assert tight["channel"] == "socketpair" and tight["obs"] == [{"t": 1}] * n, tight
    short = run_with_fd_limit(n, fds_needed(n, "socketpair") - 1, spawn)
    assert "needs about" in short.get("error", "") and "ulimit -n" in short["error"], short


def test_by_default_a_pool_one_worker_cannot_hold_with_pipes_takes_more_workers(spawn):
    n = 8
    split = run_with_fd_limit(n, fds_needed(n) - 1, spawn, workers=0)  # 0: workers=None
    assert split["workers"] == 2 and split["channel"] == "pipes" and split["obs"] == [{"t": 1}] * n, split


def test_envs_within_counts_the_fallback():
    assert FDS_PER_ENV == {"pipes": 4, "socketpair": 3}
    # This machine's hard limit: 5000 envs fit one worker only on socketpairs.
    assert envs_within(20_000) == (20_000 - FD_SLACK) // 3 >= 5000
    assert envs_within(20_000, "pipes") < 5000


# --- the host's pipe quota ------------------------------------------------------------------


def worker_pipe_sizes(pid: int) -> list[int]:
    """F_GETPIPE_SZ of every pipe the worker holds, read through /proc."""
    sizes = []
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            if not os.readlink(f"/proc/{pid}/fd/{name}").startswith("pipe:"):
                continue
            fd = os.open(f"/proc/{pid}/fd/{name}", os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            sizes.append(fcntl.fcntl(fd, F_GETPIPE_SZ))
        finally:
            os.close(fd)
    return sizes


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_thousand_env_pool_costs_the_pipe_quota_33_pages_per_env():
    """Two 16-page channel pipes and a one-page log pipe per env. A worker with
    CAP_SYS_ADMIN or CAP_SYS_RESOURCE (root here) is not held to
    fs.pipe-user-pages-soft; an unprivileged one gets 2-page pipes past it
    (docs/wire.md#the-channel), which this checks only as 'at least a page'."""
    n = 1000
    with RLPool(COUNTER, n, step_timeout=60) as pool:
        assert pool.channel == "pipes"
        sizes = worker_pipe_sizes(pool._proc.pid)
        assert sizes.count(4096) >= n  # every env's log pipe (the template's is full size)
        channel = sorted(sizes)[n:]
        assert len(channel) >= 2 * n and min(channel) >= 4096
        pages = sum(sizes) // 4096
        assert pages <= 33 * n + 64, pages
        pool.reset(seed=0)
        assert pool.step([1] * n)[0] == [{"t": 1}] * n
