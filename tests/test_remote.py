"""Remote pools over real loopback TCP: a real `boltzlabs worker` listener, real
clients, real sandboxes on the worker's side. Nothing is mocked."""

import hashlib
import io
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import tarfile
import textwrap
import threading
import time
from pathlib import Path

import gymnasium
import numpy as np
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from boltzlabs import RLPool, wire
from boltzlabs.errors import PoolClosedError, WorkerError
from boltzlabs.link import Peer, proof
from boltzlabs.pool.remote_link import pack_env_dir
from boltzlabs.host.cgroups import PoolView
from boltzlabs.host.limits import host_tasks

from conftest import COUNTER, PROBE, open_fds, scaled
from lying_worker import LyingWorker

TOKEN = "test-token-5f2c"
WORKER_COMMAND = [sys.executable, "-m", "boltzlabs", "worker"]
ROOT = Path(__file__).resolve().parent.parent


class Worker:
    """A `boltzlabs worker --listen 127.0.0.1:0` process and what it logged."""

    def __init__(self, tmp_path: Path, *extra: str):
        self.log_path = tmp_path / f"worker-{time.monotonic_ns()}.log"
        self.cache = tmp_path / "cache"
        self.log = open(self.log_path, "w+")
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen(
            [*WORKER_COMMAND, "--listen", "127.0.0.1:0", "--token", TOKEN, "--cache-dir", str(self.cache), *extra],
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
            start_new_session=True,
        )
        line = self.proc.stdout.readline()
        match = re.match(r"listening on (tcp|tls)://127\.0\.0\.1:(\d+)", line)
        assert match, f"worker did not start: {line!r} {self.text()}"
        self.scheme, self.port = match.group(1), int(match.group(2))
        self.url = f"{self.scheme}://127.0.0.1:{self.port}"

    def text(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def pool(self, source=COUNTER, n=2, **kwargs) -> RLPool:
        kwargs.setdefault("token", TOKEN)
        kwargs.setdefault("step_timeout", 5.0)
        return RLPool(source, n, worker=self.url, **kwargs)

    def descendants(self) -> list:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def wait_for(self, predicate, what: str, timeout: float = 20.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.1)
        raise AssertionError(f"{what} (worker log:\n{self.text()})")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc.stdout.close()
        self.log.close()


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    w = Worker(tmp_path_factory.mktemp("remote"), "--handshake-timeout", str(scaled(2)))
    yield w
    w.stop()
    assert w.proc.returncode == 0, w.text()


def handshake(port: int, token: str = TOKEN) -> Peer:
    """A raw client through authentication, for tests that misbehave after it."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    peer = Peer(sock, 1 << 20, time.monotonic() + 10)
    challenge = peer.receive()
    assert challenge[0] == wire.CHALLENGE
    peer.send([wire.AUTH, proof(token, challenge[2])])
    return peer


def closed_by_worker(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """Everything the worker sends until it closes the connection."""
    sock.settimeout(timeout)
    data = b""
    while True:
        try:
            chunk = sock.recv(1 << 16)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


# -- the core API through a remote worker ---------------------------------------------


def test_core_calls_keep_their_meaning(worker):
    with worker.pool(PROBE, 3) as pool:
        assert pool.worker == worker.url
        obs = pool.reset(seed=7)
        assert [o["seed"] for o in obs] == [7, 8, 9]
        obs, rewards, dones, infos = pool.step([1.0, 2.0, 3.0])
        assert rewards.tolist() == [1.0, 2.0, 3.0] and not dones.any()
        assert 0 < pool.timing.worker_ms <= pool.timing.roundtrip_ms
        # A fault stays on its lane; the others go on.
        obs, rewards, dones, infos = pool.step([{"op": "raise"}, 1.0, {"op": "exit"}])
        assert "step failed on purpose" in infos[0]["error"] and dones[0]
        assert rewards[1] == 1.0 and not dones[1]
        assert dones[2] and "exit" in infos[2]["error"]
        obs = pool.reset(where=[0, 2])
        assert obs[0]["t"] == 0 and obs[2]["t"] == 0
        # Asynchronous stepping.
        pool.send([1.0, 1.0, 1.0])
        env_ids, obs, rewards, dones, infos = pool.recv(batch_size=3)
        assert sorted(env_ids.tolist()) == [0, 1, 2]
        assert pool.memory().per_env and pool.envs_per_gb() > 0
        assert "reset called" in pool.log(1)


def test_hard_reset_is_byte_identical_remotely(worker):
    with worker.pool(COUNTER, 2) as pool:

        def episode():
            out = [pool.reset(seed=3, hard=True)]
            for _ in range(5):
                out.append(pool.step([1, 1])[0])
            return wire.encode(out)

        assert episode() == episode()


def test_a_remote_pool_groups_envs_in_its_sandboxes(worker):
    pytest.importorskip("gymnasium")
    # No slot crosses TCP: a group's observations come by the wire, one per env.
    with worker.pool("gym://CartPole-v1", 5, envs_per_sandbox=2) as pool:
        assert pool.sandboxes == 3 and not pool.shared_memory
        obs = pool.reset(seed=0)
        local = [gymnasium.make("CartPole-v1").reset(seed=i)[0] for i in range(5)]
        assert all(np.array_equal(o, want) for o, want in zip(obs, local))
        _, rewards, _, _ = pool.step(np.array([0, 1, 0, 1, 0]))
        assert rewards.tolist() == [1.0] * 5
        pids = pool.pids()
        assert pids[0] == pids[1] != pids[2] == pids[3] != pids[4]


def test_a_remote_pool_scrubs_its_sandboxes(worker):
    """reset(scrub=True) crosses the remote link: the node's sandbox holds its server alone after."""
    litter = Path(__file__).resolve().parent.parent / "benchmarks" / "envs" / "litter"
    with worker.pool(litter, 2, warmup=False) as pool:
        pool.reset()
        pool.step([3, 3])
        pool.reset(where=[0], scrub=True)
        assert pool.reset_infos[0]["scrubbed"]["entries"] >= 4
        census = pool.call("census")
        assert census[0] == {"procs": [1], "entries": 0}
        assert len(census[1]["procs"]) > 1 and census[1]["entries"] >= 4


def test_a_remote_pool_gives_each_sandbox_a_cpu_share(worker):
    """RLPool(cpu_share=True) crosses the remote link: the node's sandboxes are each a cpu group."""
    litter = Path(__file__).resolve().parent.parent / "benchmarks" / "envs" / "litter"
    with worker.pool(litter, 2, warmup=False, cpu_share=True) as pool:
        assert pool.cpu_share is True
        pool.reset()
        pool.step([3, 3])
        view = PoolView(pool._cgroup)
        for lane in range(2):
            assert set(map(int, (view.group(lane, "cpu") / "cgroup.procs").read_text().split())) == view.procs(lane)


def test_gym_source_runs_the_workers_own_gym_env(worker):
    pytest.importorskip("gymnasium")
    with worker.pool("gym://CartPole-v1", 2) as pool:
        obs = pool.reset(seed=0)
        assert np.asarray(obs[0]).shape == (4,)
        _, rewards, _, _ = pool.step(np.array([0, 1]))
        assert rewards.tolist() == [1.0, 1.0]


def test_env_code_is_shipped_once_and_cached_by_content(worker, env_dir):
    source = env_dir("""
        from boltzlabs.env import serve
        VERSION = 1
        serve(reset=lambda seed, options=None: (VERSION, {}), step=lambda a: (VERSION, 0.0, False, False, {}))
    """)
    (source / "data.txt").write_text("shipped with the env")
    key = hashlib.sha256(pack_env_dir(source)).hexdigest()
    with worker.pool(source, 1) as pool:
        assert pool.reset() == [1]
    assert (worker.cache / key / "data.txt").read_text() == "shipped with the env"
    assert f"env code {key[:12]} received" in worker.text()
    with worker.pool(source, 1) as pool:
        assert pool.reset() == [1]
    assert f"env code {key[:12]} from the cache" in worker.text()
    # New content, new name: the change reaches the worker.
    (source / "env.py").write_text((source / "env.py").read_text().replace("VERSION = 1", "VERSION = 2"))
    with worker.pool(source, 1) as pool:
        assert pool.reset() == [2]


def test_packing_is_deterministic_and_leaves_caches_out(env_dir):
    source = env_dir("from boltzlabs.env import serve\n")
    (source / "__pycache__").mkdir()
    (source / "__pycache__" / "env.cpython-311.pyc").write_bytes(b"junk")
    first = pack_env_dir(source)
    os.utime(source / "env.py", (1, 1))
    assert pack_env_dir(source) == first
    with tarfile.open(fileobj=io.BytesIO(first)) as tar:
        assert tar.getnames() == ["env.py"]


def test_a_client_cannot_choose_a_path_on_the_worker(worker):
    """The OPEN config's source_dir is the client's; the worker uses the shipped copy."""
    with worker.pool(PROBE, 1) as pool:
        pool.reset()
        obs, _, _, _ = pool.step([{"op": "listdir", "path": "/env"}])
        assert "env.py" in str(obs[0])
    assert str(PROBE) not in worker.text()


def test_shutdown_stops_the_pool_and_names_the_reason(worker):
    pool = worker.pool(COUNTER, 2)
    pool.reset()
    pids = pool.pids()
    assert pool.shutdown("the run was preempted") is True
    assert pool.closed
    with pytest.raises(PoolClosedError, match="the run was preempted"):
        pool.step([1, 1])
    assert pool.shutdown() is False  # already closed
    worker.wait_for(lambda: not any(psutil.pid_exists(p) for p in pids), "sandboxes outlived shutdown()")
    assert "pool shut down by its owner: the run was preempted" in worker.text()


def test_n_over_the_workers_cap_is_refused(tmp_path):
    w = Worker(tmp_path, "--max-envs", "3")
    try:
        with pytest.raises(ValueError, match="1 to 3 envs"):
            w.pool(COUNTER, 4)
        # The cap counts envs, not sandboxes: 2 sandboxes of 2 envs are 4 envs.
        with pytest.raises(ValueError, match=r"1 to 3 envs .*asked for 4 envs in 2 sandboxes"):
            w.pool(COUNTER, 4, envs_per_sandbox=2)
        with w.pool(COUNTER, 3) as pool:
            assert len(pool.reset()) == 3
    finally:
        w.stop()


def test_env_dir_over_the_code_cap_is_refused(tmp_path, env_dir):
    source = env_dir("from boltzlabs.env import serve\n")
    (source / "weights.bin").write_bytes(os.urandom(300_000))
    w = Worker(tmp_path, "--max-code-size", "100K")
    try:
        with pytest.raises(WorkerError, match="over this worker's cap"):
            w.pool(source, 1)
    finally:
        w.stop()


# -- a remote client's limits stay under the worker's ceilings (point 9) ---------------------


@pytest.mark.parametrize(
    "kwargs, asked, ceiling, flag",
    [
        ({"workspace_size": "100G"}, "workspace_size=107374182400 bytes (100G)", "256M", "--max-workspace"),
        ({"memory_limit": "100G"}, "memory_limit=107374182400 bytes (100G)", "1G", "--max-memory"),
        ({"limits": {"memory": 0}}, "limits['memory']=0 (no limit)", "1G", "--max-memory"),
        ({"limits": {"pids": 100000}}, "limits['pids']=100000", "256", "--max-pids"),
        ({"limits": {"open_files": 1 << 20}}, "limits['open_files']=1048576", "1024", "--max-open-files"),
        ({"limits": {"file_size": "100G"}}, "limits['file_size']=107374182400 bytes (100G)", "1G", "--max-file-size"),
        ({"limits": {"file_size": 0}}, "limits['file_size']=0 (no limit)", "1G", "--max-file-size"),
        ({"limits": {"core_size": "1G"}}, "limits['core_size']=1073741824 bytes (1G)", "0", "--max-core-size"),
        ({"limits": {"straggler_grace": 86400.0}}, "limits['straggler_grace']=86400", "60 s", "--max-straggler-grace"),
        ({"step_timeout": 86400.0}, "step_timeout=86400", "300 s", "--max-step-timeout"),
        ({"start_timeout": 86400.0}, "start_timeout=86400", "300 s", "--max-start-timeout"),
        # The whole pool's tasks: the default ceiling is a quarter of the host's task limit.
        (
            {"limits": {"pool_pids": "90%"}},
            f"limits['pool_pids']={int(host_tasks() * 0.9)}",
            str(host_tasks() // 4),
            "--max-pool-pids",
        ),
    ],
    ids=[
        "workspace",
        "memory",
        "no-memory-limit",
        "pids",
        "open-files",
        "file-size",
        "no-file-size-limit",
        "core-size",
        "straggler-grace",
        "step-timeout",
        "start-timeout",
        "pool-pids",
    ],
)
def test_a_remote_client_cannot_pass_the_workers_ceilings(worker, kwargs, asked, ceiling, flag):
    spawned = []  # every process below the listener while the refused pool was being opened
    watching = threading.Event()

    def watch():
        while not watching.is_set():
            spawned.extend(_names(worker.descendants()))
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with pytest.raises(ValueError) as refused:
            worker.pool(COUNTER, 2, **kwargs)
    finally:
        watching.set()
        watcher.join()
    assert "bwrap" not in spawned and "setpriv" not in spawned, spawned  # refused before any sandbox started
    text = str(refused.value)
    assert asked in text and f"ceiling of {ceiling}" in text and flag in text, text
    assert "env 0" not in text


def _names(procs) -> list:
    names = []
    for proc in procs:
        try:
            names.append(proc.name())
        except psutil.NoSuchProcess:
            pass
    return names


def test_a_remote_pool_gets_the_ceilings_when_it_asks_for_nothing(worker, spawn):
    with worker.pool(PROBE, 1, spawn=spawn) as pool:
        assert pool.spawn == spawn
        pool.reset()
        view = PoolView(pool._cgroup)
        assert view.memory_limit(0) == 1 << 30  # not unlimited
        assert view.pids_limit(0) == 256 and view.pids_limit() == host_tasks() // 4  # the whole pool's too
        assert pool.step_timeout == 5.0  # what it asked, within the ceiling


def test_raised_ceilings_let_a_pool_ask_for_more(tmp_path, spawn):
    w = Worker(
        tmp_path,
        "--max-memory",
        "2G",
        "--max-pids",
        "1000",
        "--max-workspace",
        "none",
        "--max-step-timeout",
        "600",
        "--max-pool-pids",
        "2000",
    )
    try:
        with w.pool(
            PROBE,
            1,
            memory_limit="1536M",
            limits={"pids": 512, "pool_pids": 1500},
            workspace_size="1G",
            step_timeout=500.0,
            spawn=spawn,
        ) as pool:
            assert pool.spawn == spawn
            pool.reset()
            view = PoolView(pool._cgroup)
            assert view.memory_limit(0) == 1536 << 20
            assert view.pids_limit(0) == 512 and view.pids_limit() == 1500
            assert pool.step_timeout == 500.0
        with w.pool(PROBE, 1) as pool:  # asks nothing: the raised ceiling
            assert PoolView(pool._cgroup).pids_limit() == 2000
        with pytest.raises(
            ValueError,
            match=r"limits\['pool_pids'\]=2001 is over this worker's ceiling of 2000 "
            r"\(--max-pool-pids\)",
        ):
            w.pool(PROBE, 1, limits={"pool_pids": 2001})
        with pytest.raises(
            ValueError,
            match=r"memory_limit=3221225472 bytes \(3G\) is over this worker's "
            r"ceiling of 2G \(--max-memory\)",
        ):
            w.pool(PROBE, 1, memory_limit="3G")
    finally:
        w.stop()


# -- nobody else gets in ---------------------------------------------------------------


def test_wrong_or_missing_token_is_refused(worker, monkeypatch):
    with pytest.raises(WorkerError, match="wrong or missing token"):
        worker.pool(COUNTER, 1, token="not-the-token")
    monkeypatch.delenv("BOLTZLABS_TOKEN", raising=False)
    with pytest.raises(ValueError, match="needs its token"):
        RLPool(COUNTER, 1, worker=worker.url)
    # Refused clients started nothing.
    assert "pool started" not in worker.text().split("refused")[-1]


def test_the_token_is_read_from_the_environment(worker, monkeypatch):
    monkeypatch.setenv("BOLTZLABS_TOKEN", TOKEN)
    with RLPool(COUNTER, 1, worker=worker.url) as pool:
        assert pool.reset() == [{"t": 0}]


def test_worker_listens_on_loopback_by_default():
    from boltzlabs.cli import build_parser

    args = build_parser().parse_args(["worker"])
    assert args.listen.startswith("127.0.0.1:")


@pytest.mark.parametrize(
    "value, said",
    [
        ("100%", "share below 100%"),
        ("0", "at least 8"),
        (str(10**9), "not below this host's task limit"),
        ("lots", "--max-pool-pids must be a whole number of tasks or a share"),
    ],
)
def test_a_pool_pids_ceiling_at_or_above_the_hosts_limit_is_refused(value, said):
    out = subprocess.run(
        [*WORKER_COMMAND, "--listen", "127.0.0.1:0", "--token", TOKEN, "--max-pool-pids", value],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert out.returncode == 2 and said in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_two_clients_share_a_worker_in_isolation(worker):
    a = worker.pool(PROBE, 2)
    b = worker.pool(PROBE, 2)
    try:
        a.reset(seed=0)
        b.reset(seed=100)
        for _k in range(5):
            _, ra, _, _ = a.step([1.0, 2.0])
            _, rb, _, _ = b.step([10.0, 20.0])
            assert ra.tolist() == [1.0, 2.0] and rb.tolist() == [10.0, 20.0]
        # Each pool's envs see only their own processes; the pools' sandboxes differ.
        assert not set(a.pids()) & set(b.pids())
        a.close()
        _, rb, _, _ = b.step([3.0, 4.0])
        assert rb.tolist() == [3.0, 4.0]
    finally:
        a.close()
        b.close()


CLIENT = textwrap.dedent("""
    import sys
    from boltzlabs import RLPool
    pool = RLPool(sys.argv[1], 3, worker=sys.argv[2], token=sys.argv[3], step_timeout=60)
    pool.reset()
    print(" ".join(map(str, pool.pids())), flush=True)
    pool.step([{"op": "sleep", "s": 30}] * 3)
""")


def test_a_client_killed_mid_step_leaves_no_sandbox(worker):
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, str(PROBE), worker.url, TOKEN],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    pids = [int(p) for p in client.stdout.readline().split()]
    assert len(pids) == 3 and all(psutil.pid_exists(p) for p in pids)
    time.sleep(0.5)  # the step is in flight
    client.kill()
    client.wait()
    client.stdout.close()
    worker.wait_for(lambda: not any(psutil.pid_exists(p) for p in pids), "sandboxes outlived their client")
    worker.wait_for(lambda: not worker.descendants(), "a worker process outlived its client")
    with worker.pool(COUNTER, 1) as pool:  # and the worker still serves
        assert pool.reset() == [{"t": 0}]


def test_killing_the_listener_ends_every_pool(tmp_path):
    w = Worker(tmp_path)
    try:
        pool = w.pool(COUNTER, 2)
        pool.reset()
        pids = pool.pids()
        workers = w.descendants()
        os.kill(w.proc.pid, signal.SIGKILL)
        w.proc.wait()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(p.is_running() for p in workers):
            time.sleep(0.1)
        assert not any(psutil.pid_exists(p) for p in pids)
        with pytest.raises(WorkerError, match="closed the connection"):
            pool.step([1, 1])
        pool.close()
    finally:
        w.stop()


# -- a worker that is not one: its handshake is input ------------------------------------------


@pytest.mark.parametrize(
    "greeting, said",
    [
        ([[wire.ERROR]], "refused the connection: (no reason given"),
        ([[wire.ERROR, 0, "refused", 7]], "refused the connection: (no reason given"),
        ([[wire.ERROR, 0, "refused", "x" * 100_000]], "refused the connection: xxx"),
        ([[wire.CHALLENGE, wire.PROTOCOL_VERSION, 12345]], "did not answer as a boltzlabs worker"),
        ([[wire.CHALLENGE, wire.PROTOCOL_VERSION, "a nonce"]], "did not answer as a boltzlabs worker"),
        ([[wire.CHALLENGE, wire.PROTOCOL_VERSION, b""]], "did not answer as a boltzlabs worker"),
        ([[wire.CHALLENGE, wire.PROTOCOL_VERSION, b"n" * 1_000_000]], "did not answer as a boltzlabs worker"),
        ([[wire.CHALLENGE, wire.PROTOCOL_VERSION]], "did not answer as a boltzlabs worker"),
        ([[wire.CHALLENGE, wire.PROTOCOL_VERSION + 1, b"n" * 32]], "did not answer as a boltzlabs worker"),
        ([[wire.CHALLENGE, wire.PROTOCOL_VERSION, b"n" * 32], [wire.ERROR, 0]], "refused: (no reason given"),
        ([[wire.CHALLENGE, wire.PROTOCOL_VERSION, b"n" * 32], [wire.NEED, "yes"]], "sent an unexpected message"),
        ([[wire.CHALLENGE, wire.PROTOCOL_VERSION, b"n" * 32], [wire.ACCEPTED, [1]]], "sent an unexpected message"),
    ],
    ids=[
        "error-short",
        "error-reason-not-text",
        "error-reason-huge",
        "nonce-int",
        "nonce-text",
        "nonce-empty",
        "nonce-1MB",
        "challenge-short",
        "other-protocol",
        "refused-short",
        "need-not-a-bool",
        "accepted-not-a-map",
    ],
)
def test_a_listener_that_breaks_the_handshake_is_a_worker_error(greeting, said):
    """What a listener sends before the pool exists is input too: each break is a WorkerError saying
    what came, never an IndexError or TypeError from inside the client, and the socket is closed."""
    liar = LyingWorker([], greeting=greeting)
    before = open_fds()
    try:
        with pytest.raises(WorkerError) as err:
            RLPool(COUNTER, 2, worker=liar.url, token=liar.token)
    finally:
        liar.close()
    assert said in str(err.value), str(err.value)
    assert len(str(err.value)) < 2500
    assert open_fds() <= before


# -- hostile clients -------------------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(min_size=1, max_size=3000))
def test_garbage_before_authentication_is_dropped(worker, data):
    with socket.create_connection(("127.0.0.1", worker.port), timeout=10) as sock:
        sock.recv(4096)  # the challenge
        try:
            sock.sendall(data)
        except (ConnectionResetError, BrokenPipeError):
            return
        closed_by_worker(sock)


def test_hostile_clients_do_not_hurt_a_good_one(worker):
    good = worker.pool(PROBE, 2)
    good.reset()
    hostile = []
    try:
        # Slowloris: connect, say nothing; another sends half a frame.
        for _ in range(5):
            hostile.append(socket.create_connection(("127.0.0.1", worker.port), timeout=10))
        hostile[1].sendall(b"\x40\x00\x00\x00\x93")
        # A 2 GiB length prefix before authentication.
        huge = socket.create_connection(("127.0.0.1", worker.port), timeout=10)
        huge.recv(4096)
        huge.sendall(b"\xff\xff\xff\x7f")
        assert closed_by_worker(huge) == b""
        huge.close()
        # Meanwhile the good client steps on, and a new one gets in.
        for _ in range(10):
            _, rewards, _, _ = good.step([1.0, 2.0])
            assert rewards.tolist() == [1.0, 2.0]
        with worker.pool(COUNTER, 1) as other:
            assert other.reset() == [{"t": 0}]
        # The idle ones are dropped after the handshake timeout (2 s here).
        for sock in hostile:
            closed_by_worker(sock, timeout=15)
    finally:
        for sock in hostile:
            sock.close()
        good.close()
    assert "no complete handshake within 2 s" in worker.text()


def _idle(port: int, source: str = "127.0.0.1") -> socket.socket:
    """A connection that never answers its challenge, from `source` (any 127/8 address is loopback)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def _still_open(sock: socket.socket, wait: float = 0.5) -> bool:
    """Whether the worker has kept `sock` (it sent its challenge, and nothing ends it)."""
    sock.settimeout(wait)
    try:
        while True:
            if not sock.recv(4096):
                return False
    except TimeoutError:
        return True
    except ConnectionResetError:
        return False


def test_idle_connections_cannot_lock_out_a_client(tmp_path):
    w = Worker(tmp_path, "--handshake-timeout", "60")  # nothing is timed out during the test
    idle = []
    try:
        # Per address: the newest --max-handshakes-per-address (8) of 127.0.0.2 stay, the older go,
        # and 127.0.0.3's are not touched for it.
        others = [_idle(w.port, "127.0.0.3") for _ in range(4)]
        flood = [_idle(w.port, "127.0.0.2") for _ in range(20)]
        idle += others + flood
        assert all(_still_open(s, 0.2) for s in others)
        assert not any(_still_open(s, 0.2) for s in flood[:12]) and all(_still_open(s, 0.2) for s in flood[12:])
        # In total: many addresses, many connections each, more than --max-handshakes (64) in all.
        for k in range(4, 20):
            idle += [_idle(w.port, f"127.0.0.{k}") for _ in range(8)]
        idle += [_idle(w.port) for _ in range(40)]
        time.sleep(0.5)
        # Legitimate clients still get in, promptly: the oldest idle connections make room.
        started = time.monotonic()
        for _ in range(3):
            with w.pool(COUNTER, 1) as pool:
                assert pool.reset() == [{"t": 0}]
        assert time.monotonic() - started < 20
        assert not _still_open(others[0])  # the oldest of all went first
        assert sum(_still_open(s, 0.05) for s in idle) <= 64
        assert "dropped to make room for a newer one" in w.text()
    finally:
        for sock in idle:
            sock.close()
        w.stop()


@pytest.mark.parametrize(
    "frames",
    [
        [[wire.SOURCE, "not a dict"]],
        [[wire.SOURCE, {"kind": "dir", "sha256": "zz", "size": 10}]],
        [[wire.SOURCE, {"kind": "dir", "sha256": "0" * 64, "size": 10}], [wire.BLOB, b"0123456789"]],
        [[wire.CALL, 1, "step", []]],
        [[wire.SOURCE, {"kind": "gym"}], [wire.OPEN, {"n": 1}]],  # requests before ACCEPTED
    ],
    ids=["source-not-dict", "bad-sha", "blob-mismatch", "call-before-source", "pipelined-open"],
)
def test_malformed_handshakes_after_authentication_are_refused(worker, frames):
    peer = handshake(worker.port)
    for frame in frames:
        try:
            peer.send(frame)
        except OSError:
            break
    data = closed_by_worker(peer.sock)
    peer.sock.close()
    messages = wire.FrameReader(wire.Limits(1 << 20)).feed(data)
    assert any(m[0] == wire.ERROR for m in messages), messages
    # A pipelined OPEN may race past the listener's check to the worker,
    # which refuses the incomplete config: either way no pool opens.
    assert all(m[0] not in (wire.ACCEPTED, wire.READY) for m in messages) or frames[-1][0] == wire.OPEN
    assert all(m[0] != wire.READY for m in messages)


@pytest.mark.parametrize("flag", ["cpu_share", "serialize_measurement", "warmup", "trust_env"])
@pytest.mark.parametrize("value", ["yes", 1, 0, [True]])
def test_a_remote_open_whose_yes_or_no_option_is_not_a_bool_is_refused_naming_it(worker, flag, value):
    """A client that is not ours may send anything: a yes-or-no option of OPEN that is not true or
    false is refused, named, before any sandbox starts (never read as one or the other)."""
    peer = handshake(worker.port)
    peer.send([wire.SOURCE, {"kind": "gym"}])
    assert peer.receive()[0] == wire.ACCEPTED
    peer.send([wire.OPEN, {"n": 1, "params": {"id": "CartPole-v1"}, flag: value}])
    messages = wire.FrameReader(wire.Limits(1 << 20)).feed(closed_by_worker(peer.sock))
    peer.sock.close()
    errors = [m for m in messages if m[0] == wire.ERROR]
    assert errors and f"OPEN's {flag} must be true or false, not {value!r}" in str(errors[0]), messages
    assert all(m[0] != wire.READY for m in messages), messages


def _ship(port: int, blob: bytes) -> list:
    """Ship `blob` as env code; the worker's messages until it refuses or accepts."""
    peer = handshake(port)
    peer.send([wire.SOURCE, {"kind": "dir", "sha256": hashlib.sha256(blob).hexdigest(), "size": len(blob)}])
    assert peer.receive() == [wire.NEED, True]
    peer.send([wire.BLOB, blob])
    try:
        message = peer.receive()
    except ConnectionError:
        message = None
    peer.sock.close()
    return message


def _tar(members, **open_kwargs) -> bytes:
    """A tar of (TarInfo, data or None), built by hand: what a hostile client can send."""
    buffer = io.BytesIO()
    with tarfile.open(
        fileobj=buffer, mode="w", format=open_kwargs.pop("format", tarfile.PAX_FORMAT), **open_kwargs
    ) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buffer.getvalue()


def _member(name: str, kind=tarfile.REGTYPE, data: bytes | None = b"evil", **attrs):
    info = tarfile.TarInfo(name)
    info.type = kind
    for key, value in attrs.items():
        setattr(info, key, value)
    return info, (data if kind in (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE) else None)


ENV_PY = _member("env.py", data=b"pass")


def _archive(member: str) -> bytes:
    members = [ENV_PY]
    if member == "link-out":
        members.append(_member(member, tarfile.SYMTYPE, linkname="/etc/shadow"))
    elif member == "link-in":
        members.append(_member(member, tarfile.SYMTYPE, linkname="env.py"))
    elif member == "hardlink-out":
        members.append(_member(member, tarfile.LNKTYPE, linkname="/etc/shadow"))
    elif member == "hardlink-in":
        members.append(_member(member, tarfile.LNKTYPE, linkname="env.py"))
    elif member == "fifo":
        members.append(_member(member, tarfile.FIFOTYPE))
    elif member == "chardev":
        members.append(_member(member, tarfile.CHRTYPE, devmajor=1, devminor=3))
    elif member == "blockdev":
        members.append(_member(member, tarfile.BLKTYPE, devmajor=7, devminor=0))
    elif member == "contiguous":
        members.append(_member(member, tarfile.CONTTYPE))
    elif member == "duplicate":
        members.append(_member("env.py", data=b"print('second')"))
    elif member == "orphan":
        members.append(_member("undeclared/file.py"))
    elif member == "too-deep":
        path = ""
        for k in range(40):
            path = f"{path}d{k}/" if path else f"d{k}/"
            members.append(_member(path.rstrip("/"), tarfile.DIRTYPE))
        members.append(_member(path + "f"))
    elif member == "long-name":
        members.append(_member("n" * 256))
    elif member == "pax-sparse-name":  # GNU sparse keys rename the member behind the header's back
        members.append(_member("innocent", pax_headers={"GNU.sparse.name": "renamed.py"}))
    elif member == "pax-charset":
        members.append(_member("binary", pax_headers={"hdrcharset": "BINARY"}))
    elif member == "no-env-py":
        members = [_member("other.py")]
    else:
        members.append(_member(member))
    return _tar(members)


def snapshot(root: Path) -> dict:
    """Every entry below root (links not followed): type, mode, owner, size, times, content."""
    out = {".": (root.lstat().st_mode, root.lstat().st_mtime_ns)}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            st = path.lstat()
            content = hashlib.sha256(path.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else None
            # The staging directory itself changes (entries come and go inside); what is in it must not remain.
            mtime = None if path == root / ".staging" else st.st_mtime_ns
            out[str(path.relative_to(root))] = (st.st_mode, st.st_uid, st.st_size, mtime, content)
    return out


def _cache_something(worker) -> None:
    """A cached env dir, so that "the cache is unchanged" compares something."""
    blob = _tar([_member("env.py", data=b"# kept\n")])
    if not (worker.cache / hashlib.sha256(blob).hexdigest()).is_dir():
        assert _ship(worker.port, blob)[0] == wire.ACCEPTED


HOSTILE_MEMBERS = [
    "../escape.py",
    "/etc/boltzlabs-evil",
    "./dot",
    "a//b",
    "link-out",
    "link-in",
    "hardlink-out",
    "hardlink-in",
    "fifo",
    "chardev",
    "blockdev",
    "contiguous",
    "duplicate",
    "orphan",
    "too-deep",
    "long-name",
    "pax-sparse-name",
    "pax-charset",
    "no-env-py",
]


@pytest.mark.parametrize("member", HOSTILE_MEMBERS)
def test_a_hostile_env_archive_is_refused(worker, member):
    # An absolute member used to land inside the cache (tarfile's filter strips
    # the slash); it is now refused like every other name that is not plainly relative.
    _cache_something(worker)
    before = snapshot(worker.cache)
    message = _ship(worker.port, _archive(member))
    assert message[0] == wire.ERROR and "unpacked safely" in message[3], message
    assert not (worker.cache.parent / "escape.py").exists()
    assert not Path("/etc/boltzlabs-evil").exists()
    assert snapshot(worker.cache) == before  # nothing half-unpacked is left, nothing else moved


def test_a_global_pax_header_is_refused(worker):
    _cache_something(worker)
    before = snapshot(worker.cache)
    message = _ship(worker.port, _tar([ENV_PY], pax_headers={"path": "elsewhere"}))
    assert message[0] == wire.ERROR and "unpacked safely" in message[3], message
    assert snapshot(worker.cache) == before


def _path_max_chain(victim: Path, steps: int = 17, width: int = 250) -> bytes:
    """The review's archive: a chain of symlinks whose expansion passes PATH_MAX,
    so os.path.realpath (tarfile's "data" filter, Python 3.11.7) gives up and
    reads the rest lexically while the kernel follows it out of the destination;
    a hard link then reaches `victim` and a regular member writes through it."""
    letters = [chr(ord("a") + k) for k in range(steps)]
    comp = "d" * width
    members = [ENV_PY]
    for k in range(steps):
        prefix = "/".join(letters[:k])
        members.append(_member(f"{prefix}/{comp}" if prefix else comp, tarfile.DIRTYPE))
        members.append(_member(f"{prefix}/{letters[k]}" if prefix else letters[k], tarfile.SYMTYPE, linkname=comp))
    chain = "/".join(letters)
    members.append(_member(f"{chain}/l", tarfile.SYMTYPE, linkname="../" * steps))
    members.append(
        _member(
            "escape", tarfile.SYMTYPE, linkname=f"{chain}/l/" + "../" * (steps + 1) + str(victim.parent).lstrip("/")
        )
    )
    members.append(_member("hl", tarfile.LNKTYPE, linkname=f"escape/{victim.name}"))
    members.append(_member("hl", data=b"overwritten by a shipped env archive\n"))
    return _tar(members)


def test_a_symlink_chain_past_path_max_and_a_hard_link_cannot_write_outside(worker, tmp_path):
    victim = tmp_path / "victim.txt"  # outside the cache, on the same filesystem, owned by root
    victim.write_text("the host's own file\n")
    victim.chmod(0o600)
    before = snapshot(worker.cache)
    message = _ship(worker.port, _path_max_chain(victim))
    assert victim.read_text() == "the host's own file\n" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert victim.stat().st_nlink == 1
    assert message is not None and message[0] == wire.ERROR and "unpacked safely" in message[3], message
    assert "'a' is a symbolic link; only regular files and directories" in message[3], message
    assert snapshot(worker.cache) == before
    # And the worker goes on serving (and evicting) as before.
    with worker.pool(COUNTER, 1) as pool:
        assert pool.reset() == [{"t": 0}]


def test_shipped_code_is_unpacked_unprivileged_and_cached_read_only(worker):
    blob = _tar(
        [
            _member("pkg", tarfile.DIRTYPE, mode=0o777),
            _member("pkg/tool.sh", data=b"#!/bin/sh\n", mode=0o4777),
            _member("env.py", data=b"pass", mode=0o666),
        ]
    )
    key = hashlib.sha256(blob).hexdigest()
    message = _ship(worker.port, blob)
    assert message[0] == wire.ACCEPTED, message
    match = re.search(rf"env code {key[:12]} received \(\d+ bytes, 3 entries, unpacked as uid (\d+)", worker.text())
    assert match, worker.text()
    import pwd

    assert int(match.group(1)) == pwd.getpwnam("nobody").pw_uid != 0  # sandbox/policy.toml's account
    entry = worker.cache / key
    modes = {
        str(p.relative_to(entry)): (stat.S_IMODE(p.lstat().st_mode), p.lstat().st_uid)
        for p in [entry, *entry.rglob("*")]
    }
    assert modes == {".": (0o755, 0), "pkg": (0o755, 0), "pkg/tool.sh": (0o755, 0), "env.py": (0o644, 0)}


def _plant_hostile_tree(entry: Path, outside: Path) -> None:
    """What an older worker could leave in its cache: links out, a symlink chain
    whose expansion passes PATH_MAX, a directory nesting deeper than PATH_MAX."""
    entry.mkdir()
    (entry / "env.py").write_text("pass")
    os.symlink(outside, entry / "link-out")
    comp = "d" * 250
    fd = os.open(entry, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for k in range(20):
            os.mkdir(comp, dir_fd=fd)
            os.symlink(comp, f"s{k}", dir_fd=fd)
            inner = os.open(comp, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = inner
        os.symlink("../" * 25, "up", dir_fd=fd)
        os.close(os.open("file", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
    finally:
        os.close(fd)


def test_eviction_survives_a_hostile_tree_in_the_cache_and_follows_no_link(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not the cache's")
    w = Worker(tmp_path, "--cache-size", "1K")
    try:
        planted = w.cache / ("f" * 64)
        _plant_hostile_tree(planted, outside)
        os.utime(planted, (1, 1), follow_symlinks=False)  # the least recently used
        blobs = [_tar([_member("env.py", data=f"# {k}\n".encode() + b"x" * 600)]) for k in range(3)]
        for k, blob in enumerate(blobs):
            message = _ship(w.port, blob)
            assert message[0] == wire.ACCEPTED, (message, w.text())
            w.wait_for(lambda: w.text().count("pool ended") > k, "the pool did not end")
        assert not os.path.lexists(planted)
        assert (outside / "keep.txt").read_text() == "not the cache's"
        keys = sorted(p.name for p in w.cache.iterdir() if not p.name.startswith("."))
        assert keys == [hashlib.sha256(blobs[-1]).hexdigest()]  # 1K holds one; the older ones went
    finally:
        w.stop()


def test_a_hostile_tree_left_in_the_cache_is_removed_at_start(tmp_path):
    """An older worker trusted tarfile: what it cached is checked before it is served again."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not the cache's")
    cache = tmp_path / "cache"
    cache.mkdir()
    planted, plain = cache / ("e" * 64), cache / ("a" * 64)
    _plant_hostile_tree(planted, outside)
    plain.mkdir()
    (plain / "env.py").write_text("pass")
    w = Worker(tmp_path)
    try:
        assert not os.path.lexists(planted) and (plain / "env.py").read_text() == "pass"
        assert (outside / "keep.txt").read_text() == "not the cache's"
        assert f"removing {'e' * 12}" in w.text()
    finally:
        w.stop()


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_the_archive_parser_refuses_or_returns_a_plain_tree(data):
    """Random damage to a valid archive: plan() refuses it, or every entry is plainly relative and in the blob."""
    from boltzlabs.errors import UnpackRefused
    from boltzlabs.remote.envcache import plan

    blob = bytearray(_tar([_member("pkg", tarfile.DIRTYPE), _member("pkg/a.py", data=b"x" * 700), ENV_PY]))
    for _ in range(data.draw(st.integers(1, 8))):
        blob[data.draw(st.integers(0, len(blob) - 1))] = data.draw(st.integers(0, 255))
    blob = bytes(blob[: data.draw(st.integers(0, len(blob)))])
    try:
        entries = plan(blob, 100)
    except UnpackRefused:
        return
    names = ["/".join(e.parts) for e in entries]
    assert len(set(names)) == len(names) and "env.py" in names
    for entry in entries:
        assert all(p not in ("", ".", "..") and "/" not in p and "\0" not in p for p in entry.parts)
        assert entry.mode in (0o644, 0o755) and entry.offset + entry.size <= len(blob)


# -- the cache counts files, not only bytes (point 15) --------------------------------------


def _empty_files(tag: str, count: int) -> bytes:
    return _tar(
        [_member("env.py", data=f"# {tag}\n".encode())] + [_member(f"empty-{k:05d}", data=b"") for k in range(count)]
    )


def test_the_cache_counts_files_and_evicts_archives_of_empty_files(tmp_path):
    w = Worker(tmp_path, "--cache-files", "100", "--max-code-files", "60")
    try:
        first, second = _empty_files("first", 50), _empty_files("second", 50)
        assert _ship(w.port, first)[0] == wire.ACCEPTED
        w.wait_for(lambda: "pool ended" in w.text(), "the pool did not end")
        assert (w.cache / hashlib.sha256(first).hexdigest()).is_dir()
        assert _ship(w.port, second)[0] == wire.ACCEPTED
        # 51 + 51 entries (and two directories) are over 100: the first is gone, a few bytes though it held.
        assert not (w.cache / hashlib.sha256(first).hexdigest()).exists()
        assert (w.cache / hashlib.sha256(second).hexdigest()).is_dir()
        before = snapshot(w.cache)
        message = _ship(w.port, _empty_files("third", 70))
        assert message[0] == wire.ERROR, message
        assert "more than 60 members" in message[3] and "--max-code-files" in message[3], message
        assert snapshot(w.cache) == before
    finally:
        w.stop()


def test_bad_frames_after_the_hand_off_end_only_that_pool(worker):
    good = worker.pool(COUNTER, 1)
    good.reset()
    try:
        peer = handshake(worker.port)
        peer.send([wire.SOURCE, {"kind": "gym"}])
        assert peer.receive()[0] == wire.ACCEPTED
        peer.sock.settimeout(10)
        peer.sock.sendall(b"\x05\x00\x00\x00\xc1\xc1\xc1\xc1\xc1")  # 0xc1: never valid msgpack
        data = closed_by_worker(peer.sock)
        peer.sock.close()
        message = wire.FrameReader(wire.Limits(1 << 20)).feed(data)[0]
        assert message[0] == wire.ERROR and "bad frame" in message[3]
        _, rewards, _, _ = good.step([1])
        assert rewards.tolist() == [1.0]
    finally:
        good.close()


# -- TLS -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def test_tls_pool_and_certificate_check(tmp_path, certificate):
    cert, key = certificate
    w = Worker(tmp_path, "--tls-cert", str(cert), "--tls-key", str(key))
    try:
        assert w.scheme == "tls"
        with w.pool(PROBE, 2, tls_ca=str(cert)) as pool:
            pool.reset(seed=1)
            for _ in range(20):
                _, rewards, _, _ = pool.step([1.0, 2.0])
            assert rewards.tolist() == [1.0, 2.0]
        with pytest.raises(WorkerError, match="certificate verify failed"):
            w.pool(COUNTER, 1)  # the client does not trust a certificate it was not given
        # Plain TCP to a TLS worker gets nowhere.
        with socket.create_connection(("127.0.0.1", w.port), timeout=10) as sock:
            sock.sendall(b"\x00" * 64)
            closed_by_worker(sock)
    finally:
        w.stop()
