"""Remote workers: a pool on another host, reached over TCP.

    trainer: RLPool(worker="tcp://node:7733") --boltzlabs/pool/remote_link.py--TCP-->
    Listener (boltzlabs worker --listen, this module): challenge, HMAC proof, the
    env dir shipped or found in the cache, then the connection handed to its own
    worker process (python -m boltzlabs.worker --fd N --remote ...), which speaks
    to it exactly as to a local pool. The handshake, step by step: remote_link.py.

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
import ipaddress
import json
import os
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

from boltzlabs import wire
from boltzlabs.errors import HandshakeRefused as _Refused
from boltzlabs.errors import REFUSED, ProtocolError, UnpackRefused
from boltzlabs.link import (
    DEFAULT_PORT,
    GYM_ENV_DIR,
    HANDSHAKE_TIMEOUT,
    PRE_AUTH_FRAME,
    Peer,
    proof,
    tune,
    worker_environment,
)
from boltzlabs.worker.ceilings import CEILINGS, NO_LIMIT, apply_ceilings, ceiling_value, default_ceilings
from boltzlabs.remote.envcache import EnvCache

__all__ = ["Listener", "main", "CEILINGS", "apply_ceilings", "default_ceilings", "add_worker_arguments", "run_worker"]


# -- the worker side -------------------------------------------------------------------


class _Slot:
    """A connection in its handshake: where from, and a dup of its socket so
    that another thread can end it (shutdown reaches the socket whatever
    object, plain or TLS, holds it now)."""

    def __init__(self, source: str, wake: socket.socket):
        self.source, self.uploading, self.dropped = source, False, False
        self.wake: socket.socket | None = wake  # None once closed

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

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        *,
        token: str,
        cache_dir: Path,
        max_clients: int = 16,
        max_envs: int = 4096,
        max_code_size: int = 64 << 20,
        cache_size: int = 1 << 30,
        cache_files: int = 100_000,
        max_code_files: int = 10_000,
        tls: ssl.SSLContext | None = None,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        max_handshakes: int = 64,
        max_handshakes_per_address: int = 8,
        ceilings: dict | None = None,
        allow_trust_env: bool = False,
        log=sys.stderr,
    ):
        if not token:
            raise ValueError("a worker needs a token")
        self.token = token
        self.cache_dir = Path(cache_dir)
        self.max_clients, self.max_envs = max_clients, max_envs
        self.max_code_size, self.cache_size = max_code_size, cache_size
        self.tls = tls
        self.handshake_timeout = handshake_timeout
        self.ceilings = {**default_ceilings(), **(ceilings or {})}
        # The listener decides trust, never its client: a client's trust_env=True
        # (env.py imported in the template) is refused unless the operator allowed it.
        self.allow_trust_env = bool(allow_trust_env)
        self.log = log
        self.cache = EnvCache(
            self.cache_dir,
            max_bytes=cache_size,
            max_files=cache_files,
            max_code_files=min(max_code_files, cache_files),
            account=_unpack_account(),
            log=self._say,
        )
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
            except TimeoutError:
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

    def _drop(self, slot: _Slot) -> None:
        """End an unauthenticated connection (with self._lock held): shutdown()
        wakes its thread's recv, which then closes the socket and the slot."""
        self._pre_auth.remove(slot)
        slot.dropped = True
        wake = slot.wake
        if wake is None:  # its thread closed it already
            return
        try:
            wake.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _authenticated(self, slot: _Slot) -> None:
        """The connection proved the token: no longer one a flood may push out."""
        with self._lock:
            if slot in self._pre_auth:
                self._pre_auth.remove(slot)
            slot.close()
            if self._uploads >= 2 * self.max_clients:
                raise _Refused(
                    f"{self._uploads} authenticated clients are still shipping their code; try again in a moment"
                )
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

    def _client(self, conn: socket.socket, addr, slot: _Slot) -> None:
        where = f"{addr[0]}:{addr[1]}"
        try:
            tune(conn)
            peer = Peer(conn, PRE_AUTH_FRAME, time.monotonic() + self.handshake_timeout)
            if self.tls is not None:
                conn.settimeout(self.handshake_timeout)
                conn = peer.sock = self.tls.wrap_socket(conn, server_side=True)
            source_dir, key = self._handshake(peer, where, slot)
        except _Refused as exc:
            self._say(f"refused {where}: {exc}")
            try:
                peer.send([wire.ERROR, 0, REFUSED, str(exc), {}])
            except (OSError, TimeoutError):
                pass
            conn.close()
            return
        except (OSError, TimeoutError, ProtocolError, ssl.SSLError, ConnectionError) as exc:
            why = f"no complete handshake within {self.handshake_timeout:g} s" if isinstance(exc, TimeoutError) else exc
            if slot.dropped:
                why = (
                    f"the oldest unauthenticated connection {'from ' + slot.source if slot.source else ''}, "
                    "dropped to make room for a newer one (--max-handshakes, --max-handshakes-per-address)"
                )
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

    def _handshake(self, peer: Peer, where: str, slot: _Slot) -> tuple[str, str | None]:
        nonce = secrets.token_bytes(32)
        peer.send([wire.CHALLENGE, wire.PROTOCOL_VERSION, nonce])
        message = peer.receive()
        if (
            message[0] != wire.AUTH
            or len(message) != 2
            or not isinstance(message[1], bytes)
            or not hmac.compare_digest(message[1], proof(self.token, nonce))
        ):
            raise _Refused(
                "wrong or missing token; give the worker's token as RLPool(..., token=...) or BOLTZLABS_TOKEN"
            )
        self._authenticated(slot)
        peer.limit(self.max_code_size + PRE_AUTH_FRAME)
        message = peer.receive()
        if message[0] != wire.SOURCE or len(message) != 2 or not isinstance(message[1], dict):
            raise _Refused("expected the pool's source after authentication")
        with self._lock:
            if len(self._pools) >= self.max_clients:
                raise _Refused(
                    f"this worker already serves {len(self._pools)} pools (its --max-clients); "
                    "try again later or start another worker"
                )
        offer = message[1]
        if offer.get("kind") == "gym":
            return str(GYM_ENV_DIR), None
        key, size = offer.get("sha256"), offer.get("size")
        if not (
            isinstance(key, str)
            and len(key) == 64
            and all(c in "0123456789abcdef" for c in key)
            and isinstance(size, int)
            and 0 < size
        ):
            raise _Refused("the source offer is malformed")
        if size > self.max_code_size:
            raise _Refused(
                f"the env directory is {size} bytes packed, over this worker's cap of "
                f"{self.max_code_size} (--max-code-size)"
            )
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

    def _run_pool(self, conn, peer: Peer, source_dir: str, key, where: str) -> None:
        """Hand the connection to a worker process of its own; wait for it."""
        if peer.reader.pending or peer.inbox:
            why = "requests sent before the handshake ended (wait for ACCEPTED)"
            self._say(f"refused {where}: {why}")
            try:
                peer.send([wire.ERROR, 0, REFUSED, why, {}])
            except (OSError, TimeoutError):
                pass
            conn.close()
            return
        ours: socket.socket | None  # our end of the relay: None without TLS
        if isinstance(conn, ssl.SSLSocket):  # TLS state lives in this process: relay plain bytes to the worker
            ours, theirs = socket.socketpair()
        else:
            ours, theirs = None, conn
        argv = [
            sys.executable,
            "-m",
            "boltzlabs.worker",
            "--fd",
            str(theirs.fileno()),
            "--remote",
            "--source-dir",
            source_dir,
            "--max-envs",
            str(self.max_envs),
            "--max-frame",
            str(max(self.max_code_size, 64 << 20)),
            "--parent",
            str(os.getpid()),
            "--ceilings",
            json.dumps(self.ceilings),
        ] + (["--allow-trust-env"] if self.allow_trust_env else [])
        try:
            proc = subprocess.Popen(
                argv,
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=worker_environment(),
            )
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
            if ours is not None:
                theirs.close()
                _relay(conn, ours, proc)
            else:
                conn.close()  # the worker holds the connection now
                proc.wait()
        finally:
            if ours is not None:
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
    from boltzlabs.host.identity import host_account
    from boltzlabs.host.policy import load_policy

    account = host_account(load_policy().identity())
    return account.name, account.uid, account.gid


# -- boltzlabs worker ------------------------------------------------------------------


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `boltzlabs worker`."""
    parser.add_argument(
        "--listen",
        default=f"127.0.0.1:{DEFAULT_PORT}",
        metavar="HOST:PORT",
        help="address to listen on (default %(default)s; loopback unless told otherwise; port 0 picks a free one)",
    )
    parser.add_argument(
        "--token",
        default=None,
        help="the clients' token (default: $BOLTZLABS_TOKEN, else --token-file, else a new one is made and printed)",
    )
    parser.add_argument("--token-file", default=None, help="read the token from this file")
    parser.add_argument("--tls-cert", default=None, help="serve TLS with this certificate (PEM)")
    parser.add_argument("--tls-key", default=None, help="the certificate's private key (PEM)")
    parser.add_argument(
        "--cache-dir", default=None, help="where shipped env code is cached (default ~/.cache/boltzlabs/envs)"
    )
    parser.add_argument(
        "--cache-size",
        default="1G",
        help="cache size before the least recently used code is removed (default %(default)s)",
    )
    parser.add_argument(
        "--cache-files",
        type=int,
        default=100_000,
        help="files and directories in the cache before the least recently used code is removed "
        "(default %(default)s): archives of many empty files cost inodes, not bytes",
    )
    parser.add_argument(
        "--max-code-size", default="64M", help="largest env directory a client may ship (default %(default)s)"
    )
    parser.add_argument(
        "--max-code-files",
        type=int,
        default=10_000,
        help="most files and directories one shipped env directory may hold (default %(default)s)",
    )
    parser.add_argument("--max-clients", type=int, default=16, help="pools served at once (default %(default)s)")
    parser.add_argument(
        "--max-envs", type=int, default=4096, help="largest pool a client may open (default %(default)s)"
    )
    for key, (flag, default, kind) in CEILINGS.items():
        what = {
            "size": "bytes or e.g. 512M",
            "count": "a count",
            "seconds": "seconds",
            "tasks": "a count or a share of this host's task limit like 25%%",
        }[kind]
        whose = (
            "for the whole pool (every env, the template and its probe together)" if key == "pool_pids" else "per env"
        )
        parser.add_argument(
            flag,
            default=str(default),
            metavar=kind.upper(),
            help=f"the most a client may ask for {key} {whose}, {what}, or none "
            f"(default %(default)s)" + ("; a pool that sets none gets this" if key in NO_LIMIT else ""),
        )
    parser.add_argument(
        "--parent",
        type=int,
        default=0,
        metavar="PID",
        help="stop (and end every pool) when process PID dies, e.g. the Ray actor that started it",
    )
    parser.add_argument(
        "--max-handshakes",
        type=int,
        default=64,
        help="connections not yet authenticated, in all; when full the oldest is dropped to make "
        "room (default %(default)s)",
    )
    parser.add_argument(
        "--max-handshakes-per-address",
        type=int,
        default=8,
        help="connections not yet authenticated from one address (an IPv6 /64); when full its "
        "oldest is dropped (default %(default)s)",
    )
    parser.add_argument(
        "--allow-trust-env",
        action="store_true",
        help="let a client ask for trust_env=True: its env.py is then imported in the template "
        "that forks its envs, outside any env's sandbox (default: refused)",
    )
    parser.add_argument(
        "--handshake-timeout",
        type=float,
        default=HANDSHAKE_TIMEOUT,
        help="seconds a client has to authenticate and ship its code (default %(default)s)",
    )


def run_worker(args: argparse.Namespace) -> int:
    """Run `boltzlabs worker` until SIGTERM or Ctrl-C; 0 on a clean stop."""
    from boltzlabs.units import parse_size

    host, _, port = args.listen.rpartition(":")
    if not host or not port.isdigit():
        print(f"boltzlabs worker: --listen {args.listen!r} must be HOST:PORT", file=sys.stderr)
        return 2
    token = args.token or os.environ.get("BOLTZLABS_TOKEN")
    if not token and args.token_file:
        token = Path(args.token_file).read_text().strip()
    made = not token
    if not token:
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
        ceilings = {
            key: ceiling_value(key, getattr(args, flag[2:].replace("-", "_"))) for key, (flag, _, _) in CEILINGS.items()
        }
    except (ValueError, TypeError) as exc:
        print(f"boltzlabs worker: {exc}", file=sys.stderr)
        return 2
    try:
        listener = Listener(
            host.strip("[]"),
            int(port),
            token=token,
            cache_dir=cache,
            max_clients=args.max_clients,
            max_envs=args.max_envs,
            max_code_size=parse_size(args.max_code_size),
            cache_size=parse_size(args.cache_size),
            cache_files=args.cache_files,
            max_code_files=args.max_code_files,
            tls=tls,
            handshake_timeout=args.handshake_timeout,
            max_handshakes=args.max_handshakes,
            max_handshakes_per_address=args.max_handshakes_per_address,
            ceilings=ceilings,
            allow_trust_env=args.allow_trust_env,
        )
    except OSError as exc:
        print(f"boltzlabs worker: cannot listen on {args.listen}: {exc}", file=sys.stderr)
        return 1
    if host not in ("127.0.0.1", "localhost", "::1", "[::1]"):
        listener._say(
            f"listening on {host}, not loopback: anyone who can reach it and knows the token can run "
            f"code here{'' if tls else '; and without TLS the session is not encrypted'}"
        )
    print(f"listening on {listener.url}", flush=True)
    if made:
        print(f"token: {token}", flush=True)

    if args.parent:
        from boltzlabs.worker.server import die_with

        die_with(args.parent)  # SIGKILL: each pool's worker then dies with us, its sandboxes with it

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
    """`python -m boltzlabs.remote.listener`: the same as `boltzlabs worker`."""
    parser = argparse.ArgumentParser(prog="boltzlabs worker", description="serve RLPools to remote clients")
    add_worker_arguments(parser)
    return run_worker(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
