"""Remote pools over real loopback TCP: a real `boltzlabs worker` listener, real
clients, real sandboxes on the worker's side. Nothing is mocked."""

import hashlib
import io
import os
import re
import signal
import socket
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from boltzlabs import RLPool, wire
from boltzlabs.errors import PoolClosedError, WorkerError
from boltzlabs.remote import _Peer, _proof, pack_env_dir

from conftest import COUNTER, PROBE

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
            [*WORKER_COMMAND, "--listen", "127.0.0.1:0", "--token", TOKEN,
             "--cache-dir", str(self.cache), *extra],
            stdout=subprocess.PIPE, stderr=self.log, text=True, env=env, start_new_session=True)
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
    w = Worker(tmp_path_factory.mktemp("remote"), "--handshake-timeout", "2")
    yield w
    w.stop()
    assert w.proc.returncode == 0, w.text()


def handshake(port: int, token: str = TOKEN) -> _Peer:
    """A raw client through authentication, for tests that misbehave after it."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    peer = _Peer(sock, 1 << 20, time.monotonic() + 10)
    challenge = peer.receive()
    assert challenge[0] == wire.CHALLENGE
    peer.send([wire.AUTH, _proof(token, challenge[2])])
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


def test_two_clients_share_a_worker_in_isolation(worker):
    a = worker.pool(PROBE, 2)
    b = worker.pool(PROBE, 2)
    try:
        a.reset(seed=0)
        b.reset(seed=100)
        for k in range(5):
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
    client = subprocess.Popen([sys.executable, "-c", CLIENT, str(PROBE), worker.url, TOKEN],
                              stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
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


@pytest.mark.parametrize("frames", [
    [[wire.SOURCE, "not a dict"]],
    [[wire.SOURCE, {"kind": "dir", "sha256": "zz", "size": 10}]],
    [[wire.SOURCE, {"kind": "dir", "sha256": "0" * 64, "size": 10}], [wire.BLOB, b"0123456789"]],
    [[wire.CALL, 1, "step", []]],
    [[wire.SOURCE, {"kind": "gym"}], [wire.OPEN, {"n": 1}]],  # requests before ACCEPTED
], ids=["source-not-dict", "bad-sha", "blob-mismatch", "call-before-source", "pipelined-open"])
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


def _archive(member: str) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        env = tarfile.TarInfo("env.py")
        env.size = 4
        tar.addfile(env, io.BytesIO(b"pass"))
        info = tarfile.TarInfo(member)
        if member == "link-out":
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/shadow"
        elif member == "hardlink-out":
            info.type, info.linkname = tarfile.LNKTYPE, "/etc/shadow"
        elif member == "fifo":
            info.type = tarfile.FIFOTYPE
        else:
            info.size = 4
        tar.addfile(info, io.BytesIO(b"evil") if info.isreg() else None)
    return buffer.getvalue()


@pytest.mark.parametrize("member", ["../escape.py", "link-out", "hardlink-out", "fifo"])
def test_a_hostile_env_archive_is_refused(worker, member):
    message = _ship(worker.port, _archive(member))
    assert message[0] == wire.ERROR and "unpacked safely" in message[3]
    assert not (worker.cache.parent / "escape.py").exists()
    assert not list(worker.cache.glob(".incoming-*"))  # nothing half-unpacked is left


def test_an_absolute_member_lands_inside_the_cache(worker):
    blob = _archive("/etc/boltzlabs-evil")
    message = _ship(worker.port, blob)
    assert message[0] == wire.ACCEPTED
    assert not Path("/etc/boltzlabs-evil").exists()
    assert (worker.cache / hashlib.sha256(blob).hexdigest() / "etc" / "boltzlabs-evil").read_bytes() == b"evil"


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
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
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
