"""A remote boltzlabs worker that lies: a listener on 127.0.0.1 that speaks the protocol as far as a test
wants, then sends what the test gives it (tests/test_progress.py, tests/test_remote.py)."""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time

from boltzlabs import wire
from boltzlabs.link import Peer
from conftest import scaled

HANG = scaled(60)  # seconds: only to catch a hang


class LyingWorker:
    """Accepts one client. With `greeting` None it does the real handshake (CHALLENGE, then NEED and
    ACCEPTED whatever the client proves), takes OPEN and sends `frames`, then `raw` bytes; with a
    `greeting` it sends those frames in place of the handshake. Then it takes the client's frames until
    its CLOSE or its end of the connection, at most HANG, answering the first CALL with `on_call`, a
    frame every `pace` seconds, and every other with nothing."""

    def __init__(
        self, frames: list, raw: bytes = b"", greeting: list | None = None, on_call: list = (), pace: float = 0.0
    ):
        self.token = secrets.token_urlsafe(8)
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"tcp://127.0.0.1:{self.server.getsockname()[1]}"
        self.frames, self.raw, self.greeting = frames, raw, greeting
        self.on_call, self.pace = list(on_call), pace
        self.opened = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.server.accept()
        with conn:
            peer = Peer(conn, 1 << 24, time.monotonic() + HANG)
            try:
                if self.greeting is not None:
                    for frame in self.greeting:
                        peer.send(frame)
                else:
                    peer.send([wire.CHALLENGE, wire.PROTOCOL_VERSION, os.urandom(32)])
                    peer.receive()  # AUTH
                    peer.receive()  # SOURCE
                    peer.send([wire.NEED, False])
                    peer.send([wire.ACCEPTED, {"pid": 1}])
                    self.opened = peer.receive()[0] == wire.OPEN
                    for frame in self.frames:
                        peer.send(frame)
                    conn.sendall(self.raw)
                while (message := peer.receive())[0] != wire.CLOSE:
                    if message[0] == wire.CALL:
                        for frame in self.on_call:
                            time.sleep(self.pace)
                            peer.send(frame)
                        self.on_call = []
            except (OSError, ConnectionError):
                pass  # the client hung up, or HANG ran out

    def close(self) -> None:
        self.thread.join(HANG)
        self.server.close()
