"""The worker process's entry point: one process that owns every sandbox of a pool.

    RLPool (client) ==one frame per call==> Worker --one frame per env--> sandboxes
                                             |  epoll over every env's channel,
                                             |  log pipe and pidfd
    RLPool (client) <==one frame per call== Worker <--one frame per env-- sandboxes

`python -m boltzlabs.worker --fd N` talks to its client over the socket on fd
N. The client sends OPEN (config.py), then CALLs (step, reset, render, attr,
memory, log: requests.py; send, recv, lane_states: stepping.py; shutdown) one at a
time; the worker answers each with one REPLY or ERROR frame. `send` returns
before the envs answer: their replies are taken by the event loop (the
reactor, reactor.py, calling lifecycle.py's readers), which also runs between
calls, and held until a `recv`. Each lane follows one state machine
(lanes.py); lifecycle.py spawns, reads and kills. The Worker composes these
parts (docs/architecture.md#inside-the-worker): it keeps the pool's frozen
PoolConfig and hands each part the others it uses.

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
from collections.abc import Callable
from typing import Any

import msgpack

from boltzlabs import wire
from boltzlabs.abi import PR_SET_CHILD_SUBREAPER, PR_SET_PDEATHSIG, SET_UP_EXIT
from boltzlabs.errors import INTERNAL, PROTOCOL, USAGE, CgroupUnavailable, ClientGone, StartFailure, TemplateUnavailable
from boltzlabs.worker import affinity, native
from boltzlabs.host.builder import SandboxSpec
from boltzlabs.host.cgroups import CLOSE_STALL, CgroupPool
from boltzlabs.host.identity import HostAccount, host_account
from boltzlabs.host.policy import compile_sandbox_code, find_bwrap, load_policy
from boltzlabs.worker.config import PIPES, PoolConfig, parse_open, raise_fd_limit
from boltzlabs.worker.lanes import IDLE
from boltzlabs.worker.lifecycle import ABANDONED, Lifecycle, guard_cgroups, guard_closed, prctl, warmup_note
from boltzlabs.worker.reactor import Budget, Reactor, describe
from boltzlabs.worker.requests import Requests, tail
from boltzlabs.worker.spawn import TemplateSpawner, reap_orphans
from boltzlabs.worker.slots import Slots
from boltzlabs.worker.stepping import Stepping


# What a pool started by an ordinary user lacks without a cgroup of its own, and how to get one
# (docs/nonroot.md): a user systemd scope with delegation, or, where there is no user session
# bus (su, sudo -u, a container, ssh without a login session), one from the system manager.
DELEGATE_FIX = (
    "to have them, run the trainer as root or in a cgroup delegated to you: "
    "systemd-run --user --scope -p Delegate=yes python train.py, or where there is no user session "
    "bus (su, a container): sudo systemd-run --scope -p Delegate=yes --uid=$(id -u) --gid=$(id -g) "
    '-E PATH="$PATH" python train.py; `boltzlabs doctor` checks the host'
)


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


class Worker:
    """Owns the sandboxes of one pool and serves one client: the parts below, composed.

    The reactor (epoll, the fd table, the client's connection) exists from
    the start; open() makes the rest once the pool's config is known: the
    byte budget, the lifecycle (the lanes, the spawner, the freezer),
    stepping (send/recv, the gate) and requests (step, reset, render, attr,
    the reads), each handed the parts it uses."""

    def __init__(self, conn: socket.socket, remote: dict | None = None):
        # A remote pool (remote/listener.py): the listener chose the env
        # directory (a client never names a path on this host) and caps what it may ask for.
        self.remote: dict | None = remote
        self.reactor: Reactor = Reactor(conn, remote)  # epoll, the fd table, the client's frames
        self.config: PoolConfig | None = None  # the pool OPEN asked for (config.py), once parsed
        self.budget: Budget | None = None  # limits.max_pool_bytes: what the pool holds of replies
        self.lifecycle: Lifecycle | None = None  # the lanes, the spawner, the freezer (open())
        self.stepping: Stepping | None = None  # send/recv and the serialize_measurement gate (open())
        self.requests: Requests | None = None  # step, reset, render, attr and the reads (open())
        self.cgroups: CgroupPool | None = None  # the pool's cgroups, None without them
        self.account: HostAccount | None = None  # the host account every sandbox runs as
        self.shutdown_reason: str | None = None  # the owner's reason, once it shut the pool down
        self.warning: str = ""  # spawn="template" fell back to exec, and why
        self.memory_source: str = ""  # where memory() figures come from (cgroup accounting or PSS)
        self.memory_note: str = ""  # why there is no cgroup accounting, and the fix
        self.limits_note: str = ""  # limits the host cannot enforce (pids without cgroups)
        self.gate_note: str = ""  # serialize_measurement without a freezer
        self.room_note: str = ""  # cgroups in a unit systemd may stop on an env's OOM kill (memory_limit)
        self.packer: msgpack.Packer = msgpack.Packer(use_bin_type=True)  # every lane's action frame
        # The step's hot path in C (native.py), or None for pure Python; the
        # client warns with the note when the extension is missing.
        fastpath, note = native.load()
        self.fastpath: Any = fastpath  # the _fastpath module, or None
        self.fastpath_note: str = note  # why there is none ('' when there is)
        if self.fastpath is not None:
            # Big observations: the same megabytes allocated and freed every step
            # stay in the heap instead of being faulted in again (keep_heap's doc).
            self.fastpath.keep_heap()
        self.channel: str = PIPES  # each env's channel: PIPES or SOCKETPAIR, decided by open()
        self.env_fns_dir: str | None = None  # an env_fns pool's private directory (its thunks' file), removed at close
        self.slots: Slots | None = None  # the envs' observation slots (slots.py), a local pool's

    def open(self, request) -> dict:
        """Start the pool OPEN asks for; the READY info, or an exception saying why not."""
        policy = load_policy()
        config = self.config = parse_open(request, self.remote, policy)
        # Before any process of the pool exists (guardian, template, sandboxes): each inherits it.
        pinned = affinity.pin(config.affinity)
        find_bwrap()  # before the account's checks: a host without bwrap is told that first
        compile_sandbox_code()  # what every sandbox imports, as .pyc: the sandbox cannot write them
        self.account = host_account(policy.identity())
        # The policy compiled once (boltzlabs.host.plan); both spawners use this spec's plan.
        spec = SandboxSpec(
            policy,
            config.source_dir,
            config.workspace_size,
            config.params,
            self.account,
            config.limits,
            env_fns=self._write_env_fns(config.env_fns),
            import_roots=config.import_roots,
            expose=config.expose,
            env_vars=config.env_vars,
            group=config.group and (*config.group, config.env_limits.max_frame),
            max_str_len=config.max_str_len,
            eager_reset=config.eager_reset,
        )
        n = config.n
        limits = config.limits
        # What the pool's pids cap must hold before any env forks: a task per env in template
        # mode (bwrap's, the sandbox's init and the env in exec mode), and the template and probe.
        at_rest = n * (1 if config.spawn == "template" else 3) + 2
        if limits.get("pool_pids") and at_rest > limits["pool_pids"]:
            raise ValueError(
                f"a pool of {n} envs in {config.spawn} mode holds at least {at_rest} tasks before any env forks, more "
                f"than its pids cap of {limits['pool_pids']} tasks for all its envs together "
                f"(limits.pool_pids): raise it (limits={{'pool_pids': {2 * at_rest}}}) or split the pool over "
                "more worker processes (RLPool(..., workers=k)), each with a cap of its own"
            )
        # Two pipes per env, or a socketpair when the fd limit cannot hold them (config.py).
        self.channel = raise_fd_limit(n)
        self.slots = Slots.wanted(request, self.remote, n, self.channel, config.env_limits.max_frame)
        guardian = None
        try:
            self.cgroups = CgroupPool(
                config.memory_limit,
                limits.get("pids"),
                freezer=config.gated,
                pool_pids=limits.get("pool_pids"),
                cpu=config.cpu_budget is not None,
                cpu_share=config.cpu_share,
            )
            if (limits.get("pids") or limits.get("pool_pids")) and not self.cgroups.limits_pids:
                self.limits_note = (
                    f"no writable pids cgroup here: the per-env pids limit "
                    f"({limits.get('pids')} tasks) and the pool's "
                    f"({limits.get('pool_pids')} tasks) are not enforced; {DELEGATE_FIX}"
                )
            self.memory_source = self.cgroups.memory_source
            if config.memory_limit and self.cgroups.backend.risk:
                self.room_note = self.cgroups.backend.risk
        except CgroupUnavailable as exc:
            self.cgroups = None
            self.memory_source = "psutil PSS of each sandbox's processes (no writable memory cgroup)"
            self.memory_note = f"no cgroup memory accounting: {exc}; envs_per_gb() uses PSS instead; {DELEGATE_FIX}"
            if limits.get("pids") or limits.get("pool_pids"):
                self.limits_note = (
                    f"no cgroups here: the per-env pids limit ({limits.get('pids')} tasks) "
                    f"and the pool's ({limits.get('pool_pids')} tasks) are not enforced; "
                    f"{DELEGATE_FIX}"
                )
            if config.memory_limit:
                raise ValueError(
                    f"memory_limit needs a writable memory cgroup, and this host has none ({exc}); {DELEGATE_FIX}"
                )
            if config.cpu_budget is not None:
                raise ValueError(
                    f"cpu_budget needs the pool's cgroups to count each env's CPU (all its processes), and this "
                    f"host gives the worker no writable cgroup ({exc}); {DELEGATE_FIX}"
                )
            if config.cpu_share:
                raise ValueError(
                    f"cpu_share needs a cgroup of the cpu controller per env, and this host gives the worker no "
                    f"writable cgroup ({exc}); {DELEGATE_FIX}"
                )
        if config.cpu_budget is not None and self.cgroups is not None and not self.cgroups.counts_cpu:
            # (worker.close() removes the cgroups made so far, as for any refusal of OPEN.)
            raise ValueError(
                f"cpu_budget needs the pool's cgroups to count each env's CPU (all its processes), and here they "
                f"cannot: {self.cgroups.cpu_note} (cgroup v1 needs a writable cpuacct hierarchy beside the memory "
                f"one); {DELEGATE_FIX}"
            )
        if config.cpu_share and self.cgroups is not None and not self.cgroups.shares_cpu:
            raise ValueError(
                f"cpu_share needs a cgroup of the cpu controller per env, and here there is none: "
                f"{self.cgroups.share_note} (cgroup v1 needs a writable cpu hierarchy beside the memory one); "
                f"{DELEGATE_FIX}"
            )
        if self.cgroups is not None:
            # However this worker dies, its cgroups go with it (and the room made for them).
            guardian = guard_cgroups(self.cgroups.paths, self.cgroups.release)
        if config.gated and not (self.cgroups is not None and self.cgroups.freezes):
            why = self.cgroups.freezer_note if self.cgroups is not None else "no writable cgroups here"
            self.gate_note = (
                f"serialize_measurement cannot freeze envs outside their turn ({why}): "
                "step calls still run one at a time, but threads or child processes an env "
                "leaves running after its reply keep running during other envs' turns"
            )
        budget = self.budget = Budget(config.max_pool_bytes)
        lifecycle = self.lifecycle = Lifecycle(
            self.reactor, budget, config, spec, self.channel, self.cgroups, self.slots
        )
        self.stepping = Stepping(self.reactor, lifecycle, budget, config, self.packer)
        self.requests = Requests(self.reactor, lifecycle, self.stepping, budget, config, self.fastpath, self.packer)
        if config.spawn == "template":
            try:
                lifecycle.use_template()
            except TemplateUnavailable as exc:
                self.warning = (
                    f"spawn='template' is not possible for this env, so every env runs its own "
                    f"interpreter (spawn='exec'), which costs more memory and start-up time: {exc}"
                )
        spawner = lifecycle.spawner
        warmup = spawner.warmup if isinstance(spawner, TemplateSpawner) else None
        lifecycle.start(lifecycle.lanes, progress=True)
        failed = [e for e in lifecycle.lanes if e.state is not IDLE]
        if failed:
            first = min(failed, key=lambda e: e.cause == ABANDONED)
            raise StartFailure(
                first.index,
                f"env {first.index} failed to start: {first.cause}",
                tail(first.log),
                len(failed),
                set_up=first.exit_code == SET_UP_EXIT,
                limit=first.limit_hit,
            )
        return {
            "n": n,
            "memory_source": self.memory_source,
            "memory_note": self.memory_note,
            "cgroup": self.cgroups.paths if self.cgroups else None,  # for tests and diagnostics only
            "guardian": guardian,
            "hello": lifecycle.hello,
            "step_timeout": config.step_timeout,
            "cpu_budget": config.cpu_budget,
            "cpu_share": self.cgroups is not None and self.cgroups.shares_cpu,
            "start_timeout": config.start_timeout,  # the client's deadline for a reset's respawns
            "max_str_len": config.max_str_len,  # the trainer refuses an action holding a longer str
            "spawn": spawner.kind,
            # (A pool with a cpu_budget steps through the pure path: requests.step.)
            "fast_path": self.fastpath is not None and config.cpu_budget is None,
            "fast_path_note": self.fastpath_note,
            # What the trainer's import roots left out of the sandboxes (host/roots.py), said once.
            "import_note": spec.plan.import_note,
            "channel": self.channel,
            # The observation slots' layout (wire.SlotLayout.describe), None without them: the client
            # then asks for the memfds ("slots").
            "slots": self.slots.layout.describe() if self.slots is not None and self.slots.layout is not None else None,
            "warning": "\n".join(
                note
                for note in (self.warning, self.limits_note, self.gate_note, self.room_note, warmup_note(warmup))
                if note
            ),
            "warmup": warmup,
            "affinity": pinned,  # the CPUs this worker and its envs run on; None: not pinned
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
        deadline = self.lifecycle.close() if self.lifecycle is not None else time.monotonic() + 5.0
        if self.cgroups is not None:
            beat = self.reactor.beat

            def reap() -> None:  # between tries: zombies reaped, and a shutdown() call heartbeats
                reap_orphans()
                beat()

            if not self.cgroups.close(deadline, reap):
                print(
                    f"boltzlabs worker: some of the pool's cgroups under {self.cgroups.path} still held tasks "
                    f"after {CLOSE_STALL:g} s with none leaving; its guardian removes them once this worker has exited",
                    file=sys.stderr,
                    flush=True,
                )
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
        inbox = self.reactor.client_inbox
        while not inbox:
            if self.lifecycle is None or self.stepping is None:  # before OPEN: only the client is watched
                self.reactor.poll(None)
                continue
            # Between calls the loop still runs: async results are taken as they
            # come, the gate moves on, and deadlines are kept.
            wake = self.stepping.next_deadline()
            self.lifecycle.poll(None if wake == float("inf") else max(0.0, wake - time.monotonic()))
            self.stepping.expire()
        return inbox.pop(0)

    def _send(self, message) -> None:
        self.reactor.send(message)

    def memory(self) -> dict:
        """Each env's memory charge and the pool's shared pages, and where the figures come from."""
        assert self.requests is not None
        return {**self.requests.memory(), "source": self.memory_source, "note": self.memory_note}

    def serve(self) -> None:
        """OPEN, then one call at a time until the client goes (ClientGone)."""
        message = self._next_request()
        if message[0] != wire.OPEN or len(message) != 2:
            self._send([wire.ERROR, 0, PROTOCOL, f"expected OPEN first, got {describe(message)}", {}])
            return
        reactor = self.reactor
        reactor.begin_call(0, time.perf_counter())  # a slow start heartbeats too (seq 0: OPEN's)
        try:
            ready = self.open(message[1])
        except Exception as exc:
            reactor.end_call()
            self._send(wire.error_frame(0, exc))
            return
        reactor.end_call()
        self._send([wire.READY, ready])
        requests, stepping = self.requests, self.stepping
        assert requests is not None and stepping is not None
        calls: dict[str, Callable[..., Any]] = {
            "step": requests.step,
            "reset": requests.reset,
            "render": requests.render,
            "attr": requests.attr,
            "memory": self.memory,
            "log": requests.log,
            "states": requests.states,
            "pids": requests.pids,
            "send": stepping.send,
            "recv": stepping.recv,
            "lane_states": stepping.lane_states,
            "direct_rest": requests.direct_rest,
            "shutdown": self.shutdown,
        }
        while True:
            message = self._next_request()
            if message[0] != wire.CALL or len(message) != 4:
                self._send([wire.ERROR, 0, PROTOCOL, f"unexpected message {describe(message)}", {}])
                continue
            _, seq, name, args = message
            started = time.perf_counter()
            if requests.lent:  # any call takes lent lanes back: the client closed its copies before sending it
                requests.unlend()
            if name == "slots" and isinstance(args, list):  # the memfds go with the REPLY's bytes (SCM_RIGHTS)
                self._send_slots(seq, args)
                continue
            if name == "lend" and args == []:  # the lanes' channels go with the REPLY's bytes (SCM_RIGHTS)
                self._lend(seq)
                continue
            if name not in calls or not isinstance(args, list):
                self._send([wire.ERROR, seq, PROTOCOL, f"no call {describe(name)} with those arguments", {}])
                continue
            reactor.begin_call(seq, started)  # from here the loop's ticks send heartbeats (reactor.beat)
            try:
                result = calls[name](*args)
            except (ValueError, TypeError, KeyError, IndexError) as exc:
                reactor.end_call()
                self._send(wire.error_frame(seq, exc))
                continue
            reactor.end_call()
            worker_ms = (time.perf_counter() - started) * 1000.0
            self._send([wire.REPLY, seq, worker_ms, result])

    def _lend(self, seq) -> None:
        """The client's "lend" call, local pools only (docs/native-step.md#the-direct-step): REPLY
        [what it needs], each lane's channel (its read and write end) attached in lane order."""
        assert self.requests is not None
        if self.remote is not None or self.reactor.conn.family != socket.AF_UNIX:
            self._send([wire.REPLY, seq, 0.0, {"refused": "a remote pool's lanes cannot be lent", "lasting": True}])
            return
        info, fds = self.requests.lend()
        self._send_with_fds(wire.encode([wire.REPLY, seq, 0.0, info]), fds)

    def _send_with_fds(self, frame: bytes, fds: list[int]) -> None:
        """One frame to the client with `fds` attached to its first bytes (SCM_RIGHTS), if any."""
        attached = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
        conn = self.reactor.conn
        sent = conn.sendmsg([frame], attached if fds else [])
        if sent < len(frame):
            conn.sendall(frame[sent:])

    def _send_slots(self, seq, args) -> None:
        """The client's "slots"(start, count) call, local pools only: REPLY [lanes], the list of lanes
        whose sealed memfd comes attached to this frame, in that order (at most 250 a call)."""
        if (
            self.slots is None
            or not self.slots.active
            or len(args) != 2
            or not all(type(a) is int and a >= 0 for a in args)
        ):
            self._send([wire.ERROR, seq, USAGE, "this pool has no observation slots to send", {}])
            return
        start, count = args
        fds = self.slots.batch(start, count)
        lanes = [start + k for k, fd in enumerate(fds) if fd >= 0]
        self._send_with_fds(wire.encode([wire.REPLY, seq, 0.0, lanes]), [fd for fd in fds if fd >= 0])


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
    parser.add_argument(
        "--allow-trust-env", action="store_true", help="remote: the listener lets a client ask for trust_env=True"
    )
    args = parser.parse_args(argv)
    # The client passed this fd inheritable; left so, every sandbox spawned
    # below would hold a socket to the client and could forge its replies.
    os.set_inheritable(args.fd, False)
    conn = socket.socket(fileno=args.fd)
    remote = None
    if args.remote:
        from boltzlabs.worker.ceilings import default_ceilings

        remote = {
            "source_dir": args.source_dir,
            "max_envs": args.max_envs,
            "max_frame": args.max_frame,
            "ceilings": json.loads(args.ceilings) if args.ceilings else default_ceilings(),
            "allow_trust_env": args.allow_trust_env,
        }
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
            worker._send([wire.ERROR, -1, INTERNAL, "the worker failed:\n" + traceback.format_exc(), {}])
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
