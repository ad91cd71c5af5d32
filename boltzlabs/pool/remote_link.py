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

Runs in the trainer (RLPool). What both ends use (parse_url, tune, proof,
Peer, the port and handshake caps) lives in boltzlabs/link.py, which the
listener imports too; neither side imports the other. The token never crosses
the network: the client proves it knows it with an HMAC of a fresh nonce.
"""

from __future__ import annotations

import hashlib
import io
import os
import socket
import ssl
import tarfile
import time
from pathlib import Path

from boltzlabs import wire
from boltzlabs.link import GYM_ENV_DIR, Peer, parse_url, proof, tune
from boltzlabs.errors import ProtocolError, WorkerError

__all__ = ["RemoteLink", "connect", "pack_env_dir"]

_SKIP = {"__pycache__", ".git", ".hg", ".svn", ".venv", ".mypy_cache", ".pytest_cache"}


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
                    raise ValueError(
                        f"the env directory {env_dir} is over the worker's cap of {max_size} bytes "
                        "once packed; keep large data out of it (load it at run time from a path the "
                        "worker mounts) or start the worker with a larger --max-code-size"
                    )
    return buffer.getvalue()


class RemoteLink:
    """The client's connection to a remote worker, handshake done.

    Same surface as the local link in client.py: `conn`, `alive()`,
    `died()`, `shutdown()`.
    """

    kind = "remote"
    stuck = False  # set when a call passed its deadline: shutdown() closes at once

    def __init__(self, url: str, conn: socket.socket, accepted: dict):
        self.url = url
        self.who = f"at {url}"  # how errors name the worker
        self.conn = conn
        self.accepted = accepted

    def alive(self) -> bool:
        return True  # a remote worker's death shows as the connection closing

    def wait_dead(self) -> None:
        pass

    def died(self) -> WorkerError:
        return WorkerError(
            f"the boltzlabs worker at {self.url} closed the connection (it stopped, or the network "
            "failed); the pool is gone: create a new RLPool"
        )

    def watch_guardian(self, pid, cgroups) -> None:
        """A remote worker's guardian and cgroups are on its own host: nothing to watch here."""

    def shutdown(self) -> None:
        """Ask the worker to end the pool, wait a little for it, close (at once when it is
        stuck: the worker ends the pool when its connection closes)."""
        if self.stuck:
            self.conn.close()
            return
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


# The CHALLENGE's nonce, as bytes: the listener sends 32; anything far from that is not a boltzlabs worker.
_NONCE_SIZES = (16, 1024)


def _why(message: list) -> str:
    """The reason an ERROR frame from the listener gives ([ERROR, 0, category, why, detail]), cut; its
    frame is input, so a missing or mistyped reason is shown as what came."""
    why = message[3] if len(message) > 3 else None
    return why[:2000] if isinstance(why, str) else f"(no reason given: {message!r:.200})"


def connect(url: str, token: str | None, source, tls_ca=None, timeout: float = 30.0) -> RemoteLink:
    """Connect, authenticate and ship `source` (a sources.Source) to the worker at `url`."""
    scheme, host, port = parse_url(url)
    token = token if token is not None else os.environ.get("BOLTZLABS_TOKEN")
    if not token:
        raise ValueError(
            f"a remote worker needs its token: RLPool(..., worker={url!r}, token=...) "
            "or BOLTZLABS_TOKEN in the environment (the worker printed it, or was given --token)"
        )
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise WorkerError(
            f"cannot reach the boltzlabs worker at {url}: {exc}; is `boltzlabs worker --listen "
            f"{host}:{port}` running there?"
        ) from exc
    try:
        tune(sock)
        if scheme == "tls":
            context = ssl.create_default_context(cafile=tls_ca)
            try:
                sock = context.wrap_socket(sock, server_hostname=host)
            except ssl.SSLError as exc:
                raise WorkerError(
                    f"TLS with the worker at {url} failed: {exc}; give the worker's certificate (or its CA) as tls_ca="
                ) from exc
        peer = Peer(sock, 1 << 20, time.monotonic() + timeout)
        message = peer.receive()
        if message[0] == wire.ERROR:
            raise WorkerError(f"the worker at {url} refused the connection: {_why(message)}")
        if (
            message[0] != wire.CHALLENGE
            or len(message) != 3
            or message[1] != wire.PROTOCOL_VERSION
            or type(message[2]) is not bytes
            or not _NONCE_SIZES[0] <= len(message[2]) <= _NONCE_SIZES[1]
        ):
            raise WorkerError(
                f"{url} did not answer as a boltzlabs worker of protocol {wire.PROTOCOL_VERSION} "
                f"(got {str(message)[:60]}); upgrade the older side"
            )
        peer.send([wire.AUTH, proof(token, message[2])])
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
                raise WorkerError(f"the worker at {url} refused: {_why(message)}")
            else:
                raise WorkerError(f"the worker at {url} sent an unexpected message {str(message)[:60]}")
    except (OSError, ProtocolError, ValueError, WorkerError) as exc:
        sock.close()
        if isinstance(exc, (WorkerError, ValueError)):
            raise
        raise WorkerError(f"the handshake with the worker at {url} failed: {exc}") from exc
