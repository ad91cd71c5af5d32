"""Remote workers: a pool on another host, reached over TCP.

    trainer                                   training node
    RLPool(worker="tcp://node:7733") ==TCP==> Listener (boltzlabs worker --listen)
      1.                      <-- [CHALLENGE, protocol, nonce]
      2. [AUTH, HMAC-SHA256(token, nonce)] -->  compared in constant time
      3. [SOURCE, {kind, sha256, size}]    -->
                              <-- [NEED, bool]      (the env dir is cached by content)
         [BLOB, tar bytes]                 -->  (only when needed; capped, verified)
      4.                      <-- [ACCEPTED, {...}]
      5. the connection is handed to its own worker process
         (python -m boltzlabs.worker --fd N --remote ...): OPEN, CALL, REPLY
         exactly as a local pool, on the same framed msgpack (wire.py).

The listener does everything before the hand-off in a thread of its own, with
a deadline for the whole handshake, small frame caps before authentication,
and a cap on handshakes in progress: a client that sends garbage, too much,
or nothing at all (slowloris) is dropped without touching anyone else. After
the hand-off each pool is a separate process with its own sandboxes and
cgroups, so clients are isolated from each other as pools are; a client that
disconnects (or whose host vanishes: TCP keepalive and a user timeout) has
its pool torn down by its worker.

The token never crosses the network: the client proves it knows it with an
HMAC of a fresh nonce. Without TLS the session after that is not encrypted or
integrity-protected: use --tls-cert/--tls-key (the client verifies the
worker's certificate) anywhere but loopback or a trusted network.

The env directory is shipped as an uncompressed tar (so its size on the wire
bounds its size on disk: no decompression bomb), named by its SHA-256, checked
on arrival and cached on the worker by envcache.py: regular files and
directories only, unpacked by a child running as the sandbox policy's
unprivileged account, checked byte for byte, then made root's and read-only;
the cache is bounded in bytes and in files.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import io
import ipaddress
import json
import os
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from boltzlabs import wire
from boltzlabs.envcache import EnvCache, UnpackRefused
from boltzlabs.errors import WorkerError

__all__ = ["Listener", "RemoteLink", "connect", "pack_env_dir", "main"]

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

    def shutdown(self, cgroup=None) -> None:
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
    from boltzlabs.sources import GYM_ENV_DIR

    scheme, host, port = parse_url(url)
    token = token if token is not None else os.environ.get("BOLTZLABS_TOKEN")
    if not token:
        raise ValueError(f"a remote worker needs its token: RLPool(..., worker={url!r}, token=...) "
                         "or BOLTZLABS_TOKEN in the environment (the worker printed it, or was given --token)")
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise WorkerError(f"cannot reach the boltzlabs worker at {url}: {exc}; is `boltzlabs worker --listen "
                          f"{host}:{port}` running there?") from None
    try:
        _tune(sock)
        if scheme == "tls":
            context = ssl.create_default_context(cafile=tls_ca)
            try:
                sock = context.wrap_socket(sock, server_hostname=host)
            except ssl.SSLError as exc:
                raise WorkerError(f"TLS with the worker at {url} failed: {exc}; give the worker's certificate "
                                  "(or its CA) as tls_ca=") from None
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
        raise WorkerError(f"the handshake with the worker at {url} failed: {exc}") from None


# -- what a remote client may ask for ------------------------------------------------------

# The listener's ceilings on what one remote pool may ask for, per env: the
# parameter (an [env_limits] key of sandbox/policy.toml, or an RLPool
# argument), its flag, its default and its kind. A client above one is
# refused before anything starts; a client that asks nothing gets the policy's
# default tightened to the ceiling ("no limit", as memory's default 0 is,
# becomes the ceiling). A limit a client may set and that has no ceiling
# here is refused outright (fail closed when the policy grows a key).
CEILINGS = {
    "memory": ("--max-memory", "1G", "size"),
    "workspace_size": ("--max-workspace", "256M", "size"),
    "pids": ("--max-pids", 256, "count"),
    "open_files": ("--max-open-files", 1024, "count"),
    "file_size": ("--max-file-size", "1G", "size"),
    "core_size": ("--max-core-size", "0", "size"),
    "straggler_grace": ("--max-straggler-grace", 60.0, "seconds"),
    "step_timeout": ("--max-step-timeout", 300.0, "seconds"),
    "start_timeout": ("--max-start-timeout", 300.0, "seconds"),
}
_NO_LIMIT = ("memory", "file_size")  # where 0 means "no limit"


def default_ceilings() -> dict:
    """CEILINGS' defaults as numbers (bytes, counts, seconds)."""
    return {key: _ceiling_value(key, default) for key, (_, default, _) in CEILINGS.items()}


def _ceiling_value(key: str, value):
    from boltzlabs.sandbox import parse_size

    if value is None or str(value).lower() == "none":
        return None  # no ceiling: what the client asks goes (a private listener, e.g. RLPool(cluster=...)'s)
    kind = CEILINGS[key][2]
    if kind == "size":
        return 0 if value in (0, "0") else parse_size(value)
    if kind == "count":
        value = int(value)
        if value < 1:
            raise ValueError(f"{CEILINGS[key][0]} must be at least 1")
        return value
    value = float(value)
    if not 0 < value < float("inf"):
        raise ValueError(f"{CEILINGS[key][0]} must be a positive number of seconds")
    return value


def _shown(key: str, value) -> str:
    kind = CEILINGS[key][2]
    if kind == "size":
        if value == 0:
            return "0 (no limit)" if key in _NO_LIMIT else "0"
        for unit, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
            if value % (1 << shift) == 0:
                return f"{value} bytes ({value >> shift}{unit})"
        return f"{value} bytes"
    return f"{value:g}" if kind == "seconds" else str(value)


def _ceiling_shown(key: str, ceiling) -> str:
    kind = CEILINGS[key][2]
    if kind == "size":
        for unit, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
            if ceiling and ceiling % (1 << shift) == 0:
                return f"{ceiling >> shift}{unit}"
        return str(ceiling)
    return f"{ceiling:g} s" if kind == "seconds" else str(ceiling)


def _over(name: str, key: str, asked, ceiling) -> ValueError:
    flag = CEILINGS[key][0]
    return ValueError(f"{name}={_shown(key, asked)} is over this worker's ceiling of {_ceiling_shown(key, ceiling)} "
                      f"({flag}); ask for less, or start the worker (boltzlabs worker) with a larger {flag}")


def apply_ceilings(config: dict, ceilings: dict, policy) -> dict:
    """A remote client's OPEN config within the listener's `ceilings`
    (CEILINGS' keys, as numbers), for Worker.open. Raises ValueError naming
    the parameter, what was asked, the ceiling and its flag; returns the
    config with every limit explicit (policy defaults tightened to the
    ceilings)."""
    from boltzlabs import limits as _limits

    out = dict(config)
    asked = config.get("limits")
    if asked is not None and not isinstance(asked, dict):
        raise TypeError(f"limits must be a dict like {{'pids': 64}}, not {type(asked).__name__}")
    asked = dict(asked or {})
    names = {key: f"limits[{key!r}]" for key in asked}
    if config.get("memory_limit") is not None:
        if asked.get("memory", config["memory_limit"]) != config["memory_limit"]:
            raise ValueError("give memory_limit= or limits={'memory': ...}, not both")
        asked["memory"] = config["memory_limit"]
        names["memory"] = "memory_limit"
    resolved = _limits.resolve(policy.sandbox.get("env_limits", {}), asked)  # types and minimums
    for key, value in resolved.items():
        if key not in ceilings:
            if key in asked:
                raise ValueError(f"this worker does not let a remote client set {names[key]}; leave it out")
            continue
        ceiling = ceilings[key]
        if ceiling is None:
            continue
        over = (value == 0 and key in _NO_LIMIT and ceiling != 0) or value > ceiling
        if over and key in asked:
            raise _over(names[key], key, value, ceiling)
        if over:
            resolved[key] = ceiling
    out["limits"], out["memory_limit"] = resolved, None

    inf = float("inf")
    workspace, ceiling = config.get("workspace_size"), ceilings.get("workspace_size") or inf
    if workspace is None:
        from boltzlabs.sandbox import parse_size

        workspace = min(parse_size(policy.sandbox["workspace"]["default_size"]), ceiling)
    elif isinstance(workspace, bool) or not isinstance(workspace, int) or workspace <= 0:
        raise ValueError(f"workspace_size must be a positive number of bytes, not {workspace!r}")
    elif workspace > ceiling:
        raise _over("workspace_size", "workspace_size", workspace, ceiling)
    out["workspace_size"] = workspace

    for key in ("step_timeout", "start_timeout"):
        value, ceiling = config.get(key), ceilings.get(key) or inf
        if value is None:
            out[key] = min(float(policy.limits[key]), ceiling)
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < inf:
            raise ValueError(f"{key} must be a positive number of seconds, not {value!r}")
        if value > ceiling:
            raise _over(key, key, value, ceiling)
        out[key] = float(value)
    return out


# -- the worker side -------------------------------------------------------------------

class _Refused(Exception):
    """The handshake ends here; the message goes to the client."""


class _Slot:
    """A connection in its handshake: where from, and a dup of its socket so
    that another thread can end it (shutdown reaches the socket whatever
    object, plain or TLS, holds it now)."""

    def __init__(self, source: str, wake: socket.socket):
        self.source, self.wake, self.uploading, self.dropped = source, wake, False, False

    def close(self) -> None:
        if self.wake is not None:
            self.wake.close()
            self.wake = None


def _source(ip: str) -> str:
    """The unit a per-address cap counts: the IPv4 address, or the IPv6 /64
    (one host commonly holds a whole /64)."""
    try:
        address = ipaddress.ip_address(ip.split("%")[0])
    except ValueError:
        return ip
    if address.version == 6:
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address)


class Listener:
    """`boltzlabs worker --listen`: authenticates clients, caches their env
    code, and gives each pool a worker process of its own."""

    def __init__(self, host: str = "127.0.0.1", port: int = DEFAULT_PORT, *, token: str,
                 cache_dir: Path, max_clients: int = 16, max_envs: int = 4096, max_code_size: int = 64 << 20,
                 cache_size: int = 1 << 30, cache_files: int = 100_000, max_code_files: int = 10_000,
                 tls: ssl.SSLContext | None = None, handshake_timeout: float = _HANDSHAKE_TIMEOUT,
                 max_handshakes: int = 64, max_handshakes_per_address: int = 8, ceilings: dict | None = None,
                 log=sys.stderr):
        if not token:
            raise ValueError("a worker needs a token")
        self.token = token
        self.cache_dir = Path(cache_dir)
        self.max_clients, self.max_envs = max_clients, max_envs
        self.max_code_size, self.cache_size = max_code_size, cache_size
        self.tls = tls
        self.handshake_timeout = handshake_timeout
        self.ceilings = {**default_ceilings(), **(ceilings or {})}
        self.log = log
        self.cache = EnvCache(self.cache_dir, max_bytes=cache_size, max_files=cache_files,
                              max_code_files=min(max_code_files, cache_files), account=_unpack_account(),
                              log=self._say)
        self.sock = socket.create_server((host, port), backlog=128)
        self.address = self.sock.getsockname()[:2]
        self._lock = threading.Lock()
        self.max_handshakes = max(1, max_handshakes)
        self.max_handshakes_per_address = max(1, min(max_handshakes_per_address, self.max_handshakes))
        self._pre_auth: list[_Slot] = []  # connections not yet authenticated, oldest first
        self._uploads = 0  # authenticated handshakes still in progress
        self._pools: dict[int, subprocess.Popen] = {}  # pid -> worker process
        self._in_use: dict[str, int] = {}  # cache key -> pools using it
        self._stopping = threading.Event()

    @property
    def url(self) -> str:
        return f"{'tls' if self.tls else 'tcp'}://{self.address[0]}:{self.address[1]}"

    def _say(self, text: str) -> None:
        print(f"[boltzlabs worker] {text}", file=self.log, flush=True)

    def serve_forever(self) -> None:
        """Accept clients until stop() (or SIGTERM/SIGINT through main())."""
        self.sock.settimeout(0.5)
        while not self._stopping.is_set():
            try:
                conn, addr = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                if self._stopping.is_set():
                    break
                raise
            try:
                slot = _Slot(_source(addr[0]), conn.dup())
            except OSError:  # out of fds: drop this one, not the ones already in
                conn.close()
                continue
            with self._lock:
                # Full: the oldest unauthenticated connection (of this source if
                # it has its share, else of all) makes room. Refusing the new one
                # would let anyone who holds the slots lock every client out.
                mine = [s for s in self._pre_auth if s.source == slot.source]
                if len(mine) >= self.max_handshakes_per_address:
                    self._drop(mine[0])
                elif len(self._pre_auth) >= self.max_handshakes:
                    self._drop(self._pre_auth[0])
                self._pre_auth.append(slot)
            try:
                threading.Thread(target=self._client, args=(conn, addr, slot), daemon=True).start()
            except RuntimeError as exc:  # no thread to be had: this client goes, the listener stays
                self._say(f"dropped {addr[0]}:{addr[1]}: {exc}")
                with self._lock:
                    if slot in self._pre_auth:
                        self._pre_auth.remove(slot)
                    slot.close()
                conn.close()

    def _drop(self, slot: "_Slot") -> None:
        """End an unauthenticated connection (with self._lock held): shutdown()
        wakes its thread's recv, which then closes the socket and the slot."""
        self._pre_auth.remove(slot)
        slot.dropped = True
        try:
            slot.wake.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _authenticated(self, slot: "_Slot") -> None:
        """The connection proved the token: no longer one a flood may push out."""
        with self._lock:
            if slot in self._pre_auth:
                self._pre_auth.remove(slot)
            slot.close()
            if self._uploads >= 2 * self.max_clients:
                raise _Refused(f"{self._uploads} authenticated clients are still shipping their code; try again "
                               "in a moment")
            self._uploads += 1
            slot.uploading = True

    def stop(self) -> None:
        """Stop accepting and end every pool (each worker tears its sandboxes down)."""
        self._stopping.set()
        self.sock.close()
        with self._lock:
            procs = list(self._pools.values())
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    # -- one client ----------------------------------------------------------------

    def _client(self, conn: socket.socket, addr, slot: "_Slot") -> None:
        where = f"{addr[0]}:{addr[1]}"
        try:
            _tune(conn)
            peer = _Peer(conn, _PRE_AUTH_FRAME, time.monotonic() + self.handshake_timeout)
            if self.tls is not None:
                conn.settimeout(self.handshake_timeout)
                conn = peer.sock = self.tls.wrap_socket(conn, server_side=True)
            source_dir, key = self._handshake(peer, where, slot)
        except _Refused as exc:
            self._say(f"refused {where}: {exc}")
            try:
                peer.send([wire.ERROR, 0, "refused", str(exc), {}])
            except (OSError, TimeoutError):
                pass
            conn.close()
            return
        except (OSError, TimeoutError, wire.ProtocolError, ssl.SSLError, ConnectionError) as exc:
            why = f"no complete handshake within {self.handshake_timeout:g} s" if isinstance(exc, TimeoutError) else exc
            if slot.dropped:
                why = (f"the oldest unauthenticated connection {'from ' + slot.source if slot.source else ''}, "
                       "dropped to make room for a newer one (--max-handshakes, --max-handshakes-per-address)")
            self._say(f"dropped {where}: {why}")
            conn.close()
            return
        finally:
            with self._lock:
                if slot in self._pre_auth:
                    self._pre_auth.remove(slot)
                slot.close()
                if slot.uploading:
                    self._uploads -= 1
        try:
            self._run_pool(conn, peer, source_dir, key, where)
        finally:
            if key:
                with self._lock:
                    self._in_use[key] -= 1

    def _handshake(self, peer: _Peer, where: str, slot: "_Slot") -> tuple[str, str | None]:
        from boltzlabs.sources import GYM_ENV_DIR

        nonce = secrets.token_bytes(32)
        peer.send([wire.CHALLENGE, wire.PROTOCOL_VERSION, nonce])
        message = peer.receive()
        if (message[0] != wire.AUTH or len(message) != 2 or not isinstance(message[1], bytes)
                or not hmac.compare_digest(message[1], _proof(self.token, nonce))):
            raise _Refused("wrong or missing token; give the worker's token as RLPool(..., token=...) "
                           "or BOLTZLABS_TOKEN")
        self._authenticated(slot)
        peer.limit(self.max_code_size + _PRE_AUTH_FRAME)
        message = peer.receive()
        if message[0] != wire.SOURCE or len(message) != 2 or not isinstance(message[1], dict):
            raise _Refused("expected the pool's source after authentication")
        with self._lock:
            if len(self._pools) >= self.max_clients:
                raise _Refused(f"this worker already serves {len(self._pools)} pools (its --max-clients); "
                               "try again later or start another worker")
        offer = message[1]
        if offer.get("kind") == "gym":
            return str(GYM_ENV_DIR), None
        key, size = offer.get("sha256"), offer.get("size")
        if not (isinstance(key, str) and len(key) == 64 and all(c in "0123456789abcdef" for c in key)
                and isinstance(size, int) and 0 < size):
            raise _Refused("the source offer is malformed")
        if size > self.max_code_size:
            raise _Refused(f"the env directory is {size} bytes packed, over this worker's cap of "
                           f"{self.max_code_size} (--max-code-size)")
        with self._lock:
            self._in_use[key] = self._in_use.get(key, 0) + 1
        try:
            path = self.cache_dir / key
            if self.cache.has(key):  # (and now the most recently used)
                peer.send([wire.NEED, False])
                self._say(f"{where}: env code {key[:12]} from the cache")
            else:
                peer.send([wire.NEED, True])
                peer.deadline = time.monotonic() + self.handshake_timeout + size / 1e6
                message = peer.receive()
                if message[0] != wire.BLOB or len(message) != 2 or not isinstance(message[1], bytes):
                    raise _Refused("expected the env directory's bytes")
                blob = message[1]
                if len(blob) != size or hashlib.sha256(blob).hexdigest() != key:
                    raise _Refused("the env directory's bytes do not match their SHA-256")
                try:
                    note = self.cache.add(key, blob)
                except UnpackRefused as exc:
                    raise _Refused(f"the env directory could not be unpacked safely: {exc}") from None
                self._say(f"{where}: env code {key[:12]} received ({size} bytes, {note})")
                self.cache.evict(self._lock, self._in_use)
        except BaseException:
            with self._lock:
                self._in_use[key] -= 1
            raise
        return str(path), key

    def _run_pool(self, conn, peer: _Peer, source_dir: str, key, where: str) -> None:
        """Hand the connection to a worker process of its own; wait for it."""
        if peer.reader.pending or peer.inbox:
            why = "requests sent before the handshake ended (wait for ACCEPTED)"
            self._say(f"refused {where}: {why}")
            try:
                peer.send([wire.ERROR, 0, "refused", why, {}])
            except (OSError, TimeoutError):
                pass
            conn.close()
            return
        tls = isinstance(conn, ssl.SSLSocket)
        if tls:  # TLS state lives in this process: relay plain bytes to the worker
            ours, theirs = socket.socketpair()
        else:
            ours, theirs = None, conn
        argv = [sys.executable, "-m", "boltzlabs.worker", "--fd", str(theirs.fileno()), "--remote",
                "--source-dir", source_dir, "--max-envs", str(self.max_envs), "--max-frame",
                str(max(self.max_code_size, 64 << 20)), "--parent", str(os.getpid()),
                "--ceilings", json.dumps(self.ceilings)]
        try:
            proc = subprocess.Popen(argv, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                    start_new_session=True, env=_worker_environment())
        except OSError as exc:
            self._say(f"could not start a worker for {where}: {exc}")
            conn.close()
            return
        with self._lock:
            self._pools[proc.pid] = proc
        peer.sock.settimeout(None)
        try:
            peer.send([wire.ACCEPTED, {"pid": proc.pid}])
        except (OSError, TimeoutError):
            pass
        self._say(f"{where}: pool started (worker pid {proc.pid})")
        try:
            if tls:
                theirs.close()
                _relay(conn, ours, proc)
            else:
                conn.close()  # the worker holds the connection now
                proc.wait()
        finally:
            if tls:
                ours.close()
                conn.close()
            proc.wait()
            with self._lock:
                self._pools.pop(proc.pid, None)
            self._say(f"{where}: pool ended (worker exit code {proc.returncode})")


def _relay(tls: ssl.SSLSocket, plain: socket.socket, proc) -> None:
    """Pump bytes between the client's TLS socket and the worker's socket until either closes."""
    import selectors

    selector = selectors.DefaultSelector()
    selector.register(tls, selectors.EVENT_READ)
    selector.register(plain, selectors.EVENT_READ)
    tls.settimeout(30.0)
    try:
        while True:
            for key, _ in selector.select(timeout=1.0):
                try:
                    if key.fileobj is tls:
                        data = tls.recv(1 << 16)
                        while data and tls.pending():  # decrypted bytes epoll cannot see
                            data += tls.recv(tls.pending())
                        if not data:
                            return
                        plain.sendall(data)
                    else:
                        data = plain.recv(1 << 16)
                        if not data:
                            return
                        tls.sendall(data)
                except ssl.SSLWantReadError:
                    continue
                except (OSError, ssl.SSLError):
                    return
            if proc.poll() is not None:
                return
    finally:
        selector.close()


def _unpack_account() -> tuple[str, int, int] | None:
    """Who unpacks shipped code: the sandbox policy's host account when the
    listener is root (the account the code will run as anyway; never root),
    else None (the listener's own, unprivileged, account)."""
    if os.geteuid() != 0:
        return None
    from boltzlabs.identity import host_account
    from boltzlabs.sandbox import load_policy

    account = host_account(load_policy().sandbox.get("identity", {}))
    return account.name, account.uid, account.gid


def _worker_environment() -> dict:
    from boltzlabs.client import _worker_environment as local

    return local()


# -- boltzlabs worker ------------------------------------------------------------------

def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `boltzlabs worker`."""
    parser.add_argument("--listen", default=f"127.0.0.1:{DEFAULT_PORT}", metavar="HOST:PORT",
                        help="address to listen on (default 127.0.0.1:%(default)s; loopback unless told otherwise; "
                             "port 0 picks a free one)")
    parser.add_argument("--token", default=None,
                        help="the clients' token (default: $BOLTZLABS_TOKEN, else --token-file, else a new one "
                             "is made and printed)")
    parser.add_argument("--token-file", default=None, help="read the token from this file")
    parser.add_argument("--tls-cert", default=None, help="serve TLS with this certificate (PEM)")
    parser.add_argument("--tls-key", default=None, help="the certificate's private key (PEM)")
    parser.add_argument("--cache-dir", default=None,
                        help="where shipped env code is cached (default ~/.cache/boltzlabs/envs)")
    parser.add_argument("--cache-size", default="1G", help="cache size before the least recently used code "
                                                            "is removed (default %(default)s)")
    parser.add_argument("--cache-files", type=int, default=100_000,
                        help="files and directories in the cache before the least recently used code is removed "
                             "(default %(default)s): archives of many empty files cost inodes, not bytes")
    parser.add_argument("--max-code-size", default="64M", help="largest env directory a client may ship "
                                                               "(default %(default)s)")
    parser.add_argument("--max-code-files", type=int, default=10_000,
                        help="most files and directories one shipped env directory may hold (default %(default)s)")
    parser.add_argument("--max-clients", type=int, default=16, help="pools served at once (default %(default)s)")
    parser.add_argument("--max-envs", type=int, default=4096, help="largest pool a client may open "
                                                                   "(default %(default)s)")
    for key, (flag, default, kind) in CEILINGS.items():
        what = {"size": "bytes or e.g. 512M", "count": "a count", "seconds": "seconds"}[kind]
        parser.add_argument(flag, default=str(default), metavar=kind.upper(),
                            help=f"the most a client may ask for {key} per env, {what}, or none "
                                 f"(default %(default)s)"
                                 + ("; a pool that sets none gets this" if key in _NO_LIMIT else ""))
    parser.add_argument("--parent", type=int, default=0, metavar="PID",
                        help="stop (and end every pool) when process PID dies, e.g. the Ray actor that started it")
    parser.add_argument("--max-handshakes", type=int, default=64,
                        help="connections not yet authenticated, in all; when full the oldest is dropped to make "
                             "room (default %(default)s)")
    parser.add_argument("--max-handshakes-per-address", type=int, default=8,
                        help="connections not yet authenticated from one address (an IPv6 /64); when full its "
                             "oldest is dropped (default %(default)s)")
    parser.add_argument("--handshake-timeout", type=float, default=_HANDSHAKE_TIMEOUT,
                        help="seconds a client has to authenticate and ship its code (default %(default)s)")


def run_worker(args: argparse.Namespace) -> int:
    """Run `boltzlabs worker` until SIGTERM or Ctrl-C; 0 on a clean stop."""
    from boltzlabs.sandbox import parse_size

    host, _, port = args.listen.rpartition(":")
    if not host or not port.isdigit():
        print(f"boltzlabs worker: --listen {args.listen!r} must be HOST:PORT", file=sys.stderr)
        return 2
    token = args.token or os.environ.get("BOLTZLABS_TOKEN")
    if not token and args.token_file:
        token = Path(args.token_file).read_text().strip()
    made = not token
    if made:
        token = secrets.token_urlsafe(24)
    tls = None
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            print("boltzlabs worker: TLS needs both --tls-cert and --tls-key", file=sys.stderr)
            return 2
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.minimum_version = ssl.TLSVersion.TLSv1_2
        tls.load_cert_chain(args.tls_cert, args.tls_key)
    cache = Path(args.cache_dir) if args.cache_dir else Path.home() / ".cache" / "boltzlabs" / "envs"
    try:
        ceilings = {key: _ceiling_value(key, getattr(args, flag[2:].replace("-", "_")))
                    for key, (flag, _, _) in CEILINGS.items()}
    except (ValueError, TypeError) as exc:
        print(f"boltzlabs worker: {exc}", file=sys.stderr)
        return 2
    try:
        listener = Listener(host.strip("[]"), int(port), token=token, cache_dir=cache,
                            max_clients=args.max_clients, max_envs=args.max_envs,
                            max_code_size=parse_size(args.max_code_size), cache_size=parse_size(args.cache_size),
                            cache_files=args.cache_files, max_code_files=args.max_code_files,
                            tls=tls, handshake_timeout=args.handshake_timeout, max_handshakes=args.max_handshakes,
                            max_handshakes_per_address=args.max_handshakes_per_address, ceilings=ceilings)
    except OSError as exc:
        print(f"boltzlabs worker: cannot listen on {args.listen}: {exc}", file=sys.stderr)
        return 1
    if host not in ("127.0.0.1", "localhost", "::1", "[::1]"):
        listener._say(f"listening on {host}, not loopback: anyone who can reach it and knows the token can run "
                      f"code here{'' if tls else '; and without TLS the session is not encrypted'}")
    print(f"listening on {listener.url}", flush=True)
    if made:
        print(f"token: {token}", flush=True)

    if args.parent:
        from boltzlabs.worker import _die_with

        _die_with(args.parent)  # SIGKILL: each pool's worker then dies with us, its sandboxes with it

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        listener.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        listener.stop()
    return 0


def main(argv=None) -> int:
    """`python -m boltzlabs.remote`: the same as `boltzlabs worker`."""
    parser = argparse.ArgumentParser(prog="boltzlabs worker", description="serve RLPools to remote clients")
    add_worker_arguments(parser)
    return run_worker(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
