"""Both ends of the link to a worker: the remote handshake's pieces and a worker process's environment.

    trainer (pool/remote_link.py)              training node (remote/listener.py)
      connect() ==TCP, tune()==> Listener
      1.                      <-- [CHALLENGE, protocol, nonce]
      2. [AUTH, proof(token, nonce)] -->  compared in constant time
      3. [SOURCE, ...], [BLOB, ...]  -->  (the env dir, when the node lacks it)
      4.                      <-- [ACCEPTED, {...}]
    each side frames the exchange with a Peer: one deadline for all of it, and
    PRE_AUTH_FRAME bytes at most before the token is proven.

Neutral ground: the trainer's side (pool/) and the node's (remote/) both import
this, and neither imports the other (tests/test_layout.py). Standard library
and wire only.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from boltzlabs import wire

__all__ = [
    "DEFAULT_PORT",
    "PRE_AUTH_FRAME",
    "HANDSHAKE_TIMEOUT",
    "GYM_ENV_DIR",
    "parse_url",
    "tune",
    "proof",
    "Peer",
    "worker_environment",
]

DEFAULT_PORT = 7733
PRE_AUTH_FRAME = 4096  # nothing before authentication needs more
HANDSHAKE_TIMEOUT = 10.0
# The env directory of every Gymnasium source: SOURCE {"kind": "gym"} names it on both ends, and no bytes travel.
GYM_ENV_DIR = Path(__file__).resolve().parent / "runtime" / "gym_env"


def parse_url(url: str) -> tuple[str, str, int]:
    """("tcp" or "tls", host, port) from "tcp://host:port" / "tls://host:port"."""
    parts = urlsplit(url)
    if parts.scheme not in ("tcp", "tls") or not parts.hostname:
        raise ValueError(f"worker address {url!r} must look like tcp://host:port or tls://host:port")
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError as exc:
        raise ValueError(f"worker address {url!r} has a bad port") from exc
    return parts.scheme, parts.hostname, port


def tune(sock: socket.socket) -> None:
    """No Nagle (a step is one small frame each way); notice a vanished peer
    within about half a minute, even mid-send."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3), ("TCP_USER_TIMEOUT", 30000)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def proof(token: str, nonce: bytes) -> bytes:
    """What AUTH carries: HMAC-SHA256(token, nonce); the token itself never crosses the network."""
    return hmac.new(token.encode(), nonce, hashlib.sha256).digest()


class Peer:
    """Frames from a socket with one deadline for the whole exchange."""

    def __init__(self, sock: socket.socket, max_frame: int, deadline: float):
        self.sock = sock
        self.reader = wire.FrameReader(wire.Limits(max_frame))
        self.inbox: list[Any] = []
        self.deadline = deadline

    def limit(self, max_frame: int) -> None:
        self.reader.limits = wire.Limits(max_frame)

    def send(self, message: Any) -> None:
        self._arm()
        self.sock.sendall(wire.encode(message))

    def receive(self) -> Any:
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


def worker_environment() -> dict[str, str]:
    """The environment a worker process starts with (a local pool's, or one a listener hands a
    connection to): this one, with this very boltzlabs first on PYTHONPATH, installed or not."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env
