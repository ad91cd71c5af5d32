"""The worker process's entry point: one process that owns every sandbox of a pool.

    RLPool (client) ==one frame per call==> Worker --one frame per env--> sandboxes
                                             |  epoll over every env's channel,
                                             |  log pipe and pidfd
    RLPool (client) <==one frame per call== Worker <--one frame per env-- sandboxes

`python -m boltzlabs.worker --fd N` talks to its client over the socket on fd
N. The client sends OPEN (config.py), then CALLs (step, reset, render, attr,
memory, log: requests.py; send, recv, lane_states: stepping.py; shutdown) one at a
time; the worker answers each with one REPLY or ERROR frame. `send` returns
before the envs answer: their replies are taken by the event loop
(reactor.py), which also runs between calls, and held until a `recv`. Each
lane follows one state machine (lanes.py); lifecycle.py spawns and kills.

Arrays in observations and actions are passed through, never decoded: an
array is a msgpack ExtType whose header the worker checks (wire "check"
limits) and re-packs as is. The rest of a reply is decoded under the policy's
limits and re-encoded into the client's REPLY; the depth cap keeps that
re-encoding (three levels deeper) inside msgpack's own limit. On the native
step path (requests._step_native) a reply whose bytes C vouches for (what
that decoding would accept) is spliced into the REPLY undecoded (wire.Raw).

The client's socket stays in the epoll set during every wait, so a client
that dies tears the pool down even in the middle of a step; bubblewrap's
--die-with-parent does the same if the worker itself dies.
"""

from __future__ import annotations

import argparse
import array
import json
import os
import signal
import socket
import sys
import time
import traceback

import msgpack

from boltzlabs import wire
from boltzlabs.worker import native
from boltzlabs.sandbox.builder import SandboxSpec
from boltzlabs.sandbox.cgroups import CgroupPool, CgroupUnavailable
from boltzlabs.sandbox.identity import host_account
from boltzlabs.sandbox.policy import compile_sandbox_code, find_bwrap, load_policy
from boltzlabs.worker.config import PIPES, parse_open, raise_fd_limit
from boltzlabs.worker.confinement import Confinement
from boltzlabs.worker.lanes import IDLE, Lane
from boltzlabs.worker.lifecycle import (ABANDONED, PR_SET_CHILD_SUBREAPER, PR_SET_PDEATHSIG, Lifecycle, StartFailure,
                                        guard_cgroups, guard_closed, prctl, warmup_note)
from boltzlabs.worker.reactor import ClientGone, Reactor, describe
from boltzlabs.worker.requests import Requests, tail
from boltzlabs.worker.spawn import ExecSpawner, TemplateSpawner, TemplateUnavailable, reap_orphans
from boltzlabs.worker.slots import Slots
from boltzlabs.worker.stepping import Stepping


# What a pool started by an ordinary user lacks without a cgroup of its own, and how to get one
# (docs/nonroot.md): a user systemd scope with delegation, or, where there is no user session
# bus (su, sudo -u, a container, ssh without a login session), one from the system manager.
DELEGATE_FIX = ("to have them, run the trainer as root or in a cgroup delegated to you: "
                "systemd-run --user --scope -p Delegate=yes python train.py, or where there is no user session "
                "bus (su, a container): sudo systemd-run --scope -p Delegate=yes --uid=$(id -u) --gid=$(id -g) "
                "-E PATH=\"$PATH\" python train.py; `boltzlabs doctor` checks the host")


def _sweep_env_fns() -> None:
    """Remove the env_fns directories of workers that died before they could
    (their pid, in the name, is gone)."""
    import glob
    import shutil
    import tempfile

    for stale in glob.glob(os.path.join(tempfile.gettempdir(), "boltzlabs-fns-*-*")):
        pid = os.path.basename(stale).split("-")[2]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(stale, ignore_errors=True)


class Worker(Reactor, Lifecycle, Requests, Stepping):
    """Owns the sandboxes of one pool and serves one client."""

    def __init__(self, conn: socket.socket, remote: dict | None = None):
        # A remote pool (remote/listener.py): the listener chose the env
        # directory (a client never names a path on this host) and caps what it may ask for.
        self.remote = remote
        self._init_reactor(conn, remote)
        self._init_lifecycle()
        self._init_requests()
        self._init_stepping()
        self.shutdown_reason = None
        self.warning = ""
        self.memory_note = ""
        self.limits_note = ""
        self.gate_note = ""
        self._packer = msgpack.Packer(use_bin_type=True)
        # The step's hot path in C (native.py), or None for pure Python; the
        # client warns with the note when the extension is missing.
        self.fastpath, self.fastpath_note = native.load()
        if self.fastpath is not None:
            # Big observations: the same megabytes allocated and freed every step
            # stay in the heap instead of being faulted in again (keep_heap's doc).
            self.fastpath.keep_heap()
        self.channel = PIPES  # each env's channel: PIPES or SOCKETPAIR, decided by open()
        self.env_fns_dir = None  # an env_fns pool's private directory (its thunks' file), removed at close
        self.slots: Slots | None = None  # the envs' observation slots (slots.py), a local pool's

    def open(self, request) -> dict:
        """Start the pool OPEN asks for; the READY info, or an exception saying why not."""
        self.policy = load_policy()
        config = self.config = parse_open(request, self.remote, self.policy)
        # What the loop reads on every call, and spawn.py reads, as attributes.
        self.env_limits, self.hello_limits = config.env_limits, config.hello_limits
        self.max_pool_bytes, self.log_tail = config.max_pool_bytes, config.log_tail
        self.start_timeout, self.step_timeout, self.gated = config.start_timeout, config.step_timeout, config.gated
        self.limits, self.memory_limit = config.limits, config.memory_limit
        self.straggler_grace = config.straggler_grace
        self.warmup = config.warmup
        find_bwrap()  # before the account's checks: a host without bwrap is told that first
        compile_sandbox_code()  # what every sandbox imports, as .pyc: the sandbox cannot write them
        self.account = host_account(self.policy.sandbox.get("identity", {}))
        # The policy compiled once (boltzlabs.sandbox.plan); both spawners use this spec's plan.
        self.spec = SandboxSpec(self.policy, config.source_dir, config.workspace_size, config.params,
                                self.account, self.limits, env_fns=self._write_env_fns(config.env_fns),
                                import_roots=config.import_roots, env_vars=config.env_vars)
        self.warmup_timeout = self.spec.plan.warmup_timeout if self.warmup else 0.0
        n = config.n
        # Two pipes per env, or a socketpair when the fd limit cannot hold them (config.py).
        self.channel = raise_fd_limit(n)
        self.slots = Slots.wanted(request, self.remote, n, self.channel, config.env_limits.max_frame)
        guardian = None
        try:
            self.cgroups = CgroupPool(self.memory_limit, self.limits.get("pids"), freezer=self.gated,
                                      pool_pids=self.limits.get("pool_pids"))
            if (self.limits.get("pids") or self.limits.get("pool_pids")) and not self.cgroups.limits_pids:
                self.limits_note = (f"no writable pids cgroup here: the per-env pids limit "
                                    f"({self.limits.get('pids')} tasks) and the pool's "
                                    f"({self.limits.get('pool_pids')} tasks) are not enforced; {DELEGATE_FIX}")
            self.memory_source = self.cgroups.memory_source
        except CgroupUnavailable as exc:
            self.cgroups = None
            self.memory_source = "psutil PSS of each sandbox's processes (no writable memory cgroup)"
            self.memory_note = f"no cgroup memory accounting: {exc}; envs_per_gb() uses PSS instead; {DELEGATE_FIX}"
            if self.limits.get("pids") or self.limits.get("pool_pids"):
                self.limits_note = (f"no cgroups here: the per-env pids limit ({self.limits.get('pids')} tasks) "
                                    f"and the pool's ({self.limits.get('pool_pids')} tasks) are not enforced; "
                                    f"{DELEGATE_FIX}")
            if self.memory_limit:
                raise ValueError(f"memory_limit needs a writable memory cgroup, and this host has none ({exc}); "
                                 f"{DELEGATE_FIX}")
        if self.cgroups is not None:
            # However this worker dies, its cgroups go with it (and the room made for them).
            guardian = guard_cgroups(self.cgroups.paths, self.cgroups.release)
        if self.gated:
            self.freezing = self.cgroups is not None and self.cgroups.freezes
            if self.freezing:
                self._on_message = self._on_message_freezing
            else:
                why = self.cgroups.freezer_note if self.cgroups is not None else "no writable cgroups here"
                self.gate_note = (f"serialize_measurement cannot freeze envs outside their turn ({why}): "
                                  "step calls still run one at a time, but threads or child processes an env "
                                  "leaves running after its reply keep running during other envs' turns")
        self.envs = [Lane(i, self.env_limits) for i in range(n)]
        # What the kernel must say of every lane's process (and the probe's) before its first request.
        self.confinement = Confinement(self.spec.plan.namespaces, len(self.spec.programs()),
                                       self.account.uid, self.account.gid)
        self.spawner = ExecSpawner(self)
        if config.spawn == "template":
            try:
                self.spawner = TemplateSpawner(self)
            except TemplateUnavailable as exc:
                self.warning = (f"spawn='template' is not possible for this env, so every env runs its own "
                                f"interpreter (spawn='exec'), which costs more memory and start-up time: {exc}")
        warmup = self.spawner.warmup if self.spawner.kind == "template" else None
        self._start(self.envs, progress=True)
        failed = [e for e in self.envs if e.state is not IDLE]
        if failed:
            first = min(failed, key=lambda e: e.cause == ABANDONED)
            raise StartFailure(first.index, f"env {first.index} failed to start: {first.cause}",
                               tail(first.log), len(failed))
        return {
            "n": n,
            "memory_source": self.memory_source,
            "memory_note": self.memory_note,
            "cgroup": self.cgroups.paths if self.cgroups else None,  # for tests and diagnostics only
            "guardian": guardian,
            "hello": self.hello,
            "step_timeout": self.step_timeout,
            "spawn": self.spawner.kind,
            "fast_path": self.fastpath is not None,
            "fast_path_note": self.fastpath_note,
            "channel": self.channel,
            # The observation slots' layout (wire.SlotLayout.describe), None without them: the client
            # then asks for the memfds ("slots").
            "slots": self.slots.layout.describe() if self.slots is not None and self.slots.active else None,
            "warning": "\n".join(note for note in (self.warning, self.limits_note, self.gate_note,
                                                   warmup_note(warmup)) if note),
            "warmup": warmup,
        }

    def _write_env_fns(self, blobs) -> str | None:
        """An env_fns pool's thunks in a file of their own (runtime/env_fns.py),
        in a directory only this worker's account can enter (the sandboxes' account
        reaches it through the identity's staging); its path, or None."""
        if blobs is None:
            return None
        import tempfile

        from boltzlabs.runtime import env_fns

        _sweep_env_fns()
        self.env_fns_dir = tempfile.mkdtemp(prefix=f"boltzlabs-fns-{os.getpid()}-")
        path = os.path.join(self.env_fns_dir, "env_fns")
        env_fns.write(path, list(blobs))
        return path

    # -- teardown -------------------------------------------------------------------

    def shutdown(self, reason) -> bool:
        """The owner's request to stop the pool now: every sandbox ends, the
        client is told, and the worker exits once the client closes."""
        self.shutdown_reason = str(reason)[:1000]
        print(f"boltzlabs worker: pool shut down by its owner: {self.shutdown_reason}", file=sys.stderr, flush=True)
        self.close()
        return True

    def close(self) -> None:
        """Kill every sandbox, stop the spawner, remove the cgroups and the account."""
        for env in self.envs:
            self._kill(env, "pool closed")
        deadline = time.monotonic() + 5.0
        if self.spawner is not None:
            self.spawner.close(deadline)
        if self.cgroups is not None:
            self.cgroups.close(deadline, reap_orphans)
            self.cgroups = None
            guard_closed()
        if self.account is not None:
            self.account.close()
        if self.env_fns_dir is not None:
            import shutil

            shutil.rmtree(self.env_fns_dir, ignore_errors=True)
            self.env_fns_dir = None
        if self.slots is not None:
            self.slots.close()

    # -- the client connection ------------------------------------------------------

    def _next_request(self) -> list:
        while not self.client_inbox:
            # Between calls the loop still runs: async results are taken as they
            # come, the gate moves on, and deadlines are kept.
            wake = self._next_deadline()
            self._poll(None if wake == float("inf") else max(0.0, wake - time.monotonic()))
            self._expire()
        return self.client_inbox.pop(0)

    def serve(self) -> None:
        """OPEN, then one call at a time until the client goes (ClientGone)."""
        message = self._next_request()
        if message[0] != wire.OPEN or len(message) != 2:
            self._send([wire.ERROR, 0, "ProtocolError", f"expected OPEN first, got {describe(message)}", {}])
            return
        try:
            ready = self.open(message[1])
        except StartFailure as exc:
            self._send([wire.ERROR, 0, "start", str(exc), {"env": exc.index, "log": exc.log, "failed": exc.count}])
            return
        except (ValueError, OSError, Exception) as exc:  # noqa: B014
            self._send([wire.ERROR, 0, type(exc).__name__, str(exc), {}])
            return
        self._send([wire.READY, ready])
        calls = {"step": self.step, "reset": self.reset, "render": self.render, "attr": self.attr,
                 "memory": self.memory, "log": self.log,
                 "states": self.states, "pids": self.pids, "send": self.send, "recv": self.recv,
                 "lane_states": self.lane_states, "shutdown": self.shutdown}
        while True:
            message = self._next_request()
            if message[0] != wire.CALL or len(message) != 4:
                self._send([wire.ERROR, 0, "ProtocolError", f"unexpected message {describe(message)}", {}])
                continue
            _, seq, name, args = message
            started = time.perf_counter()
            if name == "slots" and isinstance(args, list):  # the memfds go with the REPLY's bytes (SCM_RIGHTS)
                self._send_slots(seq, args)
                continue
            if name not in calls or not isinstance(args, list):
                self._send([wire.ERROR, seq, "ProtocolError", f"no call {describe(name)} with those arguments", {}])
                continue
            try:
                result = calls[name](*args)
            except (ValueError, TypeError, KeyError, IndexError) as exc:
                self._send([wire.ERROR, seq, type(exc).__name__, str(exc), {}])
                continue
            worker_ms = (time.perf_counter() - started) * 1000.0
            self._send([wire.REPLY, seq, worker_ms, result])

    def _send_slots(self, seq, args) -> None:
        """The client's "slots"(start, count) call, local pools only: REPLY [lanes], the list of lanes
        whose sealed memfd comes attached to this frame, in that order (at most 250 a call)."""
        if self.slots is None or not self.slots.active or len(args) != 2 \
                or not all(type(a) is int and a >= 0 for a in args):
            self._send([wire.ERROR, seq, "ValueError", "this pool has no observation slots to send", {}])
            return
        start, count = args
        fds = self.slots.batch(start, count)
        lanes = [start + k for k, fd in enumerate(fds) if fd >= 0]
        frame = wire.encode([wire.REPLY, seq, 0.0, lanes])
        attached = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd for fd in fds if fd >= 0]).tobytes())]
        sent = self.conn.sendmsg([frame], attached if lanes else [])
        if sent < len(frame):
            self.conn.sendall(frame[sent:])


def _terminate(signum, frame):
    raise ClientGone


def die_with(parent: int) -> None:
    """SIGKILL us if `parent` dies (then bwrap's --die-with-parent ends every sandbox)."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent and os.getppid() != parent:  # it died before the prctl
        os._exit(1)


def main(argv=None) -> int:
    """`python -m boltzlabs.worker --fd N [--remote ...]`: serve one pool, then exit."""
    parser = argparse.ArgumentParser(description="boltzlabs worker (started by RLPool)")
    parser.add_argument("--fd", type=int, required=True, help="socket to the client")
    parser.add_argument("--remote", action="store_true", help="serve a remote client (started by remote.Listener)")
    parser.add_argument("--source-dir", help="remote: the env directory, whatever the client says")
    parser.add_argument("--max-envs", type=int, default=4096, help="remote: the largest pool")
    parser.add_argument("--max-frame", type=int, default=64 << 20, help="remote: the largest frame from the client")
    parser.add_argument("--parent", type=int, default=0, help="remote: die with this process (the listener)")
    parser.add_argument("--ceilings", default=None, help="remote: JSON of the listener's ceilings (remote.CEILINGS)")
    parser.add_argument("--allow-trust-env", action="store_true",
                        help="remote: the listener lets a client ask for trust_env=True")
    args = parser.parse_args(argv)
    # The client passed this fd inheritable; left so, every sandbox spawned
    # below would hold a socket to the client and could forge its replies.
    os.set_inheritable(args.fd, False)
    conn = socket.socket(fileno=args.fd)
    remote = None
    if args.remote:
        from boltzlabs.worker.ceilings import default_ceilings

        remote = {"source_dir": args.source_dir, "max_envs": args.max_envs, "max_frame": args.max_frame,
                  "ceilings": json.loads(args.ceilings) if args.ceilings else default_ceilings(),
                  "allow_trust_env": args.allow_trust_env}
        die_with(args.parent)
    # Orphans of killed sandboxes (an exec sandbox's inner bwrap) come to us,
    # not to a host init that may reap them late: reap_orphans() takes them.
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    # SIGTERM (the listener stopping, a service manager) ends the pool cleanly.
    signal.signal(signal.SIGTERM, _terminate)
    worker = Worker(conn, remote)
    code = 0
    try:
        worker.serve()
    except ClientGone:
        code = 0
    except BaseException:
        code = 1
        try:
            worker._send([wire.ERROR, -1, "WorkerError", "the worker failed:\n" + traceback.format_exc(), {}])
        except OSError:
            pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # already ending: let close() finish
        worker.close()
        try:
            worker._send([wire.CLOSE])
        except OSError:
            pass
        conn.close()
    return code


if __name__ == "__main__":  # `python -m boltzlabs.worker.server`
    sys.exit(main())
