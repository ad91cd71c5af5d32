"""The trainer's link to a remote worker: connect, authenticate, ship the env dir.

    trainer                                   training node
    RLPool(worker="tcp://node:7733") ==TCP==> Listener (boltzlabs/remote/listener.py)
      1.                      <-- [CHALLENGE, protocol, nonce]
      2. [AUTH, HMAC-SHA256(token, nonce)] -->  compared in constant time
      3. [SOURCE, {kind, sha256, size}]    -->
                              <-- [NEED, bool]      (the env dir is cached by content)
         [BLOB, tar bytes]                 -->  (only when needed; capped, verified)
      4.                      <-- [ACCEPTED, {...}]
      5. the connection is handed to its own worker process: OPEN, CALL, REPLY
         exactly as a local pool, on the same framed msgpack (wire.py).

Runs in the trainer (RLPool). The framing helpers both ends use (parse_url,
_tune, _proof, _Peer, the port and handshake caps) live here, below the
listener, which imports them. The token never crosses the network: the
client proves it knows it with an HMAC of a fresh nonce.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import os
import socket
import ssl
import tarfile
import time
from pathlib import Path
from urllib.parse import urlsplit

from boltzlabs import wire
from boltzlabs.errors import WorkerError

__all__ = ["RemoteLink", "connect", "pack_env_dir", "parse_url", "DEFAULT_PORT"]

DEFAULT_PORT = 7733
_PRE_AUTH_FRAME = 4096  # nothing before authentication needs more
_HANDSHAKE_TIMEOUT = 10.0
_SKIP = {"__pycache__", ".git", ".hg", ".svn", ".venv", ".mypy_cache", ".pytest_cache"}


# -- both ends -------------------------------------------------------------------------

def parse_url(url: str) -> tuple[str, str, int]:
    """("tcp" or "tls", host, port) from "tcp://host:port" / "tls://host:port"."""
    parts = urlsplit(url)
    if parts.scheme not in ("tcp", "tls") or not parts.hostname:
        raise ValueError(f"worker address {url!r} must look like tcp://host:port or tls://host:port")
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError:
        raise ValueError(f"worker address {url!r} has a bad port") from None
    return parts.scheme, parts.hostname, port


def _tune(sock: socket.socket) -> None:
    """No Nagle (a step is one small frame each way); notice a vanished peer
    within about half a minute, even mid-send."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3), ("TCP_USER_TIMEOUT", 30000)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _proof(token: str, nonce: bytes) -> bytes:
    return hmac.new(token.encode(), nonce, hashlib.sha256).digest()


class _Peer:
    """Frames from a socket with one deadline for the whole exchange."""

    def __init__(self, sock, max_frame: int, deadline: float):
        self.sock = sock
        self.reader = wire.FrameReader(wire.Limits(max_frame))
        self.inbox: list = []
        self.deadline = deadline

    def limit(self, max_frame: int) -> None:
        self.reader.limits = wire.Limits(max_frame)

    def send(self, message) -> None:
        self._arm()
        self.sock.sendall(wire.encode(message))

    def receive(self) -> list:
        while not self.inbox:
            self._arm()
            data = self.sock.recv(1 << 16)
            if not data:
                raise ConnectionError("the peer closed the connection")
            self.inbox.extend(self.reader.feed(data))
        return self.inbox.pop(0)

    def _arm(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the handshake took too long")  # a slow upload, or a slowloris
        self.sock.settimeout(left)


# -- the client side -------------------------------------------------------------------

def pack_env_dir(env_dir: Path, max_size: int | None = None) -> bytes:
    """The env directory as a deterministic, uncompressed tar (same tree, same bytes).

    Caches, VCS and virtualenv directories are left out; ownership and times
    are zeroed so the SHA-256 names the content only.
    """
    env_dir = Path(env_dir)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for root, dirs, files in os.walk(env_dir):
            dirs[:] = sorted(d for d in dirs if d not in _SKIP)
            for name in sorted(dirs) + sorted(f for f in files if not f.endswith(".pyc")):
                path = Path(root, name)
                info = tar.gettarinfo(str(path), arcname=str(path.relative_to(env_dir)))
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                info.mtime = 0
                if info.isreg():
                    info.mode = 0o755 if info.mode & 0o111 else 0o644
                    with open(path, "rb") as f:
                        tar.addfile(info, f)
                else:
                    info.mode = 0o755 if info.isdir() else info.mode
                    tar.addfile(info)
                if max_size is not None and buffer.tell() > max_size:
                    raise ValueError(f"the env directory {env_dir} is over the worker's cap of {max_size} bytes "
                                     "once packed; keep large data out of it (load it at run time from a path the "
                                     "worker mounts) or start the worker with a larger --max-code-size")
    return buffer.getvalue()


class RemoteLink:
    """The client's connection to a remote worker, handshake done.

    Same surface as the local link in client.py: `conn`, `alive()`,
    `died()`, `shutdown()`.
    """

    kind = "remote"

    def __init__(self, url: str, conn: socket.socket, accepted: dict):
        self.url = url
        self.conn = conn
        self.accepted = accepted

    def alive(self) -> bool:
        return True  # a remote worker's death shows as the connection closing

    def wait_dead(self) -> None:
        pass

    def died(self) -> WorkerError:
        return WorkerError(f"the boltzlabs worker at {self.url} closed the connection (it stopped, or the network "
                           "failed); the pool is gone: create a new RLPool")

    def watch_guardian(self, pid) -> None:
        """A remote worker's guardian is on its own host: nothing to watch here."""

    def shutdown(self) -> None:
        """Ask the worker to end the pool, wait a little for it, close."""
        try:
            self.conn.settimeout(5.0)
            self.conn.sendall(wire.encode([wire.CLOSE]))
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline and self.conn.recv(1 << 16):
                pass  # drained until the worker closes its end: the pool is down
        except OSError:
            pass
        finally:
            self.conn.close()


def connect(url: str, token: str | None, source, tls_ca=None, timeout: float = 30.0) -> RemoteLink:
    """Connect, authenticate and ship `source` (a sources.Source) to the worker at `url`."""
    from boltzlabs.pool.sources import GYM_ENV_DIR

    scheme, host, port = parse_url(url)
    token = token if token is not None else os.environ.get("BOLTZLABS_TOKEN")
    if not token:
        raise ValueError(f"a remote worker needs its token: RLPool(..., worker={url!r}, token=...) "
                         "or BOLTZLABS_TOKEN in the environment (the worker printed it, or was given --token)")
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise WorkerError(f"cannot reach the boltzlabs worker at {url}: {exc}; is `boltzlabs worker --listen "
                          f"{host}:{port}` running there?") from exc
    try:
        _tune(sock)
        if scheme == "tls":
            context = ssl.create_default_context(cafile=tls_ca)
            try:
                sock = context.wrap_socket(sock, server_hostname=host)
            except ssl.SSLError as exc:
                raise WorkerError(f"TLS with the worker at {url} failed: {exc}; give the worker's certificate "
                                  "(or its CA) as tls_ca=") from exc
        peer = _Peer(sock, 1 << 20, time.monotonic() + timeout)
        message = peer.receive()
        if message[0] == wire.ERROR:
            raise WorkerError(f"the worker at {url} refused the connection: {message[3]}")
        if message[0] != wire.CHALLENGE or len(message) != 3 or message[1] != wire.PROTOCOL_VERSION:
            raise WorkerError(f"{url} did not answer as a boltzlabs worker of protocol {wire.PROTOCOL_VERSION} "
                              f"(got {str(message)[:60]}); upgrade the older side")
        peer.send([wire.AUTH, _proof(token, message[2])])
        if source.env_dir == GYM_ENV_DIR:
            peer.send([wire.SOURCE, {"kind": "gym"}])
            blob = None
        else:
            blob = pack_env_dir(source.env_dir)
            peer.send([wire.SOURCE, {"kind": "dir", "sha256": hashlib.sha256(blob).hexdigest(), "size": len(blob)}])
        while True:
            message = peer.receive()
            if message[0] == wire.NEED and len(message) == 2 and message[1] is True and blob is not None:
                peer.deadline = time.monotonic() + timeout + len(blob) / 1e6  # a MB/s floor for the upload
                peer.send([wire.BLOB, blob])
                blob = None
            elif message[0] == wire.NEED and len(message) == 2 and message[1] is False:
                blob = None  # the worker has this code cached
            elif message[0] == wire.ACCEPTED and len(message) == 2 and isinstance(message[1], dict):
                sock.settimeout(None)
                return RemoteLink(url, sock, message[1])
            elif message[0] == wire.ERROR:
                raise WorkerError(f"the worker at {url} refused: {message[3]}")
            else:
                raise WorkerError(f"the worker at {url} sent an unexpected message {str(message)[:60]}")
    except (OSError, wire.ProtocolError, ValueError, WorkerError) as exc:
        sock.close()
        if isinstance(exc, (WorkerError, ValueError)):
            raise
        raise WorkerError(f"the handshake with the worker at {url} failed: {exc}") from exc
