"""A lane's life: spawned, started (its handshake), read, killed, reaped; and the freezer.

    start(lanes) --_spawn--> spawner.spawn (spawn.py) --> lane STARTING --HELLO (_on_message)--> IDLE
    the reactor --channel readable--> _read_channel --FrameReader(limits)--> _on_message --lane.on("reply")-->
        the sync request's Op (requests.py, begin/end) or the async results (stepping.py, deliver_to)
    kill(lane, cause) --> spawner.kill + the cgroup's kill --> _release: DEAD, its fds closed
    spawner --on_exit(lane, status)--> _release with why it died (exit code, signal, OOM, pids limit)

One Lifecycle per pool, made by server.Worker.open once the pool's config,
plan and cgroups are known; it owns the lanes, the spawner and the freezer,
and is handed to requests.py and stepping.py. It uses the reactor (fds,
epoll) and the byte budget it is given.

Start-up overlaps spawns with handshakes: each lane is spawned and the loop
polled at once, so 1000 sandboxes start in the time of a few. A death while
an async action is in flight finishes it with a failure (stepping.py).

Everything an env writes is untrusted: frames are capped and decoded with
limits (size, lengths, objects per frame, nesting depth: wire.Limits, from
[limits] in sandbox/policy.toml; the handshake has caps of its own), replies
are checked for shape (reactor.check_reply), logs keep a bounded tail, the
bytes the pool holds for replies not yet returned are bounded
(reactor.Budget), and an env that breaks any rule is killed and reported on
its lane. Nothing here walks an env's value recursively: decoding is
msgpack's C code under those limits, descriptions in errors go through
reprlib (reactor.describe: bounded depth and width).

Which frames are due. Each request to an env (STEP, RESET, RENDER, ATTR) carries a
fresh sequence number, and exactly one reply carrying that number is due
until it comes (State.due, lanes.py). A straggler (past its deadline) still
owes it, so its one late reply is legitimate: it frees the lane and is
dropped, as the README says. Every other frame is a protocol violation that
kills the lane at once, before anything else it sent is decoded: a frame when
no reply is due (a second reply, anything after a dropped late one, anything
from an idle env), a frame with any other sequence number (older or newer),
and a reply of the wrong kind or shape. So an env cannot make the worker
decode frames it then ignores. Stragglers past their grace are killed from
poll() (`overdue`), whatever call is running.

serialize_measurement with a freezer: every env is frozen outside its turn
and its own requests; an env's reply ends its work, so it is frozen before
the reply can pass the gate on (_on_message_freezing).
"""

from __future__ import annotations

import collections
import contextlib
import os
import resource
import select
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack

from boltzlabs import abi, wire
from boltzlabs.abi import PR_SET_NAME
from boltzlabs.errors import ProtocolError, TemplateUnavailable, describe_status, exit_signal, stopped
from boltzlabs.host.builder import SandboxSpec
from boltzlabs.host.cgroups import CgroupPool, cpus_allowed
from boltzlabs.worker import affinity
from boltzlabs.worker.config import PoolConfig
from boltzlabs.worker.confinement import Confinement
from boltzlabs.worker.cpu_budget import CpuMeter
from boltzlabs.worker.lanes import BUSY, IDLE, IN_FLIGHT, STARTING, Lane
from boltzlabs.worker.reactor import OBJECT_COST, Budget, Reactor, check_reply, describe, read_fd
from boltzlabs.worker.slots import Slots
from boltzlabs.worker.spawn import TEMPLATE_LANE, ExecSpawner, SpawnContext, Spawner, TemplateSpawner, reap_orphans

ABANDONED = "start-up abandoned after another env failed"


class Op:
    """A request in progress: which lanes it waits for and what came back."""

    __slots__ = ("seq", "waiting", "results")

    def __init__(self, seq: int):
        self.seq = seq
        self.waiting: set[int] = set()
        self.results: dict[int, list[Any] | None] = {}  # None: the lane failed (its cause says why)


class Lifecycle:
    """The pool's lanes: spawning, reading, killing and reaping them, and the freezer."""

    def __init__(
        self,
        reactor: Reactor,
        budget: Budget,
        config: PoolConfig,
        spec: SandboxSpec,
        channel: str,
        cgroups: CgroupPool | None,
        slots: Slots | None,
    ):
        self.reactor: Reactor = reactor  # the epoll set every lane's fds are in
        self.budget: Budget = budget  # what the pool holds of replies not yet returned
        self.config: PoolConfig = config  # the pool's frozen configuration (config.py)
        self.cgroups: CgroupPool | None = cgroups  # each lane's cgroup (and the template's), None without
        self.slots: Slots | None = slots  # the observation slots, sealed at each lane's HELLO; None without
        self.lanes: list[Lane] = [Lane(i, config.env_limits) for i in range(config.n)]
        # RLPool(pin_sandboxes=True): the CPUs this worker runs on (its slice, pinned by server.py
        # before this), lane i's sandbox on the (i mod len)-th at its handshake (affinity.py).
        spread = config.affinity is not None and config.affinity.spread
        self.sandbox_cpus: list[int] | None = sorted(os.sched_getaffinity(0)) if spread else None
        # What the kernel must say of every lane's process (and the probe's) before its first request.
        account = spec.account
        assert account is not None, "the worker's sandboxes always run as its host account (server.py)"
        self.confinement: Confinement = Confinement(
            spec.plan.namespaces, len(spec.programs()), account.uid, account.gid
        )
        # What the spawners may use of the pool (spawn.SpawnContext), the same for every spawner made.
        self.spawn_context: SpawnContext = SpawnContext(
            spec=spec,
            config=config,
            channel=channel,
            cgroups=cgroups,
            confinement=self.confinement,
            slots=slots,
            watch=reactor.watch,
            unwatch=reactor.unwatch,
            on_exit=self.on_exit,
            thawed=self.template_thawed,
            beat=reactor.beat,
        )
        self.spawner: Spawner = ExecSpawner(self.spawn_context)  # TemplateSpawner from use_template()
        self.hello: dict | None = None  # lane 0's handshake info, for the client's READY
        self.op: Op | None = None  # the sync request whose replies are gathered (requests.py: begin/end)
        # Where an async lane's reply (or None, with the cause, when it dies) goes: stepping.Stepping.take.
        self.deliver: Callable[[Lane, list | None, str], None] = _no_async
        self.seq: int = 0  # the last request's sequence number (next_seq)
        # (kill time, lane, seq) of stragglers: a lane still owing the reply to
        # request seq at its kill time (deadline + straggler_grace) is killed.
        # Each is "now + grace" when set, so the deque is sorted.
        self.overdue: collections.deque[tuple[float, int, int]] = collections.deque()
        # serialize_measurement with a freezer: every env is frozen outside its
        # turn and its own requests (see _freeze); `freeze_pending`: lanes asked to
        # freeze whose freeze is not confirmed yet.
        self.freezing: bool = config.gated and cgroups is not None and cgroups.freezes
        self.freeze_pending: set[int] = set()
        # The template's cgroup is frozen during every gated turn too (its
        # imports' threads, a trusted env.py's at-fork hooks): frozen at
        # each turn's start with the envs, thawed when the turn ends.
        self.template_frozen: bool = False
        # How a frame from a lane is handled: with the freezer, the lane is frozen first.
        self.on_message: Callable[[Lane, list], None] = self._on_message_freezing if self.freezing else self._on_message
        # RLPool(cpu_budget=): each lane's CPU in its step's window (cpu_budget.py), None without a
        # budget (server.py refuses a budget where the cgroups count no CPU). A reply is metered first.
        self.meter: CpuMeter | None = None
        self.on_message_unmetered: Callable[[Lane, list], None] = self.on_message  # where a metered reply goes on
        if config.cpu_budget is not None and cgroups is not None and cgroups.counts_cpu:
            self.meter = CpuMeter(config.cpu_budget, cgroups, cpus_allowed(), self.lanes, self.kill)
            self.on_message = self._on_message_metered

    def use_template(self) -> None:
        """Spawn by forks of a warm template (spawn="template"); TemplateUnavailable if it cannot start."""
        self.spawner = TemplateSpawner(self.spawn_context)

    def deliver_to(self, deliver: Callable[[Lane, list | None, str], None]) -> None:
        """Where async lanes' replies and deaths go (stepping.Stepping.take)."""
        self.deliver = deliver

    def begin(self, op: Op) -> None:
        """A sync request starts: its lanes' replies go to op.results."""
        self.op = op

    def end(self) -> None:
        """The sync request is over: a late reply is a straggler's, dropped."""
        self.op = None

    def next_seq(self) -> int:
        """A fresh sequence number for a request (one per call, shared by its lanes)."""
        self.seq += 1
        return self.seq

    def reserve_seqs(self, count: int) -> range:
        """`count` fresh sequence numbers at once, for a client that steps lent lanes (requests.lend)."""
        first = self.seq + 1
        self.seq += count
        return range(first, first + count)

    def check_lanes(self, indices) -> list:
        """`indices` checked (every lane for None), or ValueError."""
        n = len(self.lanes)
        if indices is None:
            return list(range(n))
        if not isinstance(indices, list) or any(not isinstance(i, int) or not 0 <= i < n for i in indices):
            raise ValueError(f"lanes must be indices in [0, {n})")
        return indices

    # -- the loop ---------------------------------------------------------------------

    def poll(self, timeout: float | None) -> None:
        """One round of the reactor: read every ready fd, handle what arrived; then
        kill the stragglers past their grace, and with a cpu_budget the lanes past it
        (waking up in time for both)."""
        overdue = self.overdue
        if overdue:
            due = max(0.0, overdue[0][0] - time.monotonic())
            timeout = due if timeout is None or timeout < 0 else min(timeout, due)
        meter = self.meter
        if meter is not None and meter.checks:
            due = max(0.0, meter.next_check() - time.monotonic())
            timeout = due if timeout is None or timeout < 0 else min(timeout, due)
        self.reactor.poll(timeout)
        if overdue:
            self._kill_overdue()
        if meter is not None and meter.checks:
            meter.check()

    def straggling(self, lane: Lane) -> None:
        """env missed its deadline and is still running: it has straggler_grace
        seconds more to answer, then it is killed (its CPU time is bounded)."""
        if lane.state is BUSY:  # a sync request's (an async one's is expired by stepping.py)
            lane.on("deadline")
        self.overdue.append((time.monotonic() + self.config.straggler_grace, lane.index, lane.seq))

    def _kill_overdue(self) -> None:
        now = time.monotonic()
        overdue = self.overdue
        while overdue and overdue[0][0] <= now:
            _, index, seq = overdue.popleft()
            lane = self.lanes[index]
            if lane.state.due and lane.seq == seq:
                self.kill(
                    lane,
                    f"killed: still running {self.config.straggler_grace:g} s after missing its "
                    f"deadline of {self.config.step_timeout:g} s (limits.straggler_grace)",
                )

    # -- start-up -------------------------------------------------------------------

    def _spawn(self, lane: Lane) -> None:
        """Start env's sandbox. Its fds are registered; it is STARTING."""
        spawner = self.spawner
        if isinstance(spawner, TemplateSpawner) and not spawner.alive():
            self.use_template()  # the last one died; a new one for respawns
        lane.generation += 1
        if self.cgroups is not None:
            self._settle(lane)
            lane.events_base = self.cgroups.events(lane.index)
        if self.slots is not None:
            # After the last sandbox's tasks are gone (with cgroups; else after its pid 1
            # was killed): the new one never reads what the old one wrote.
            self.slots.clear(lane.index)
        if self.freezing:
            self.thaw(lane)  # the template forks while in the env's cgroups: never into a frozen one
        self.spawner.spawn(lane)  # sets lane.chan, lane.wchan, lane.logfd (and lane.pid when known)
        # Never blocked by an env: a full channel buffers in lane.out (Reactor.write).
        os.set_blocking(lane.chan, False)
        os.set_blocking(lane.wchan, False)
        os.set_blocking(lane.logfd, False)
        lane.on("spawn")
        lane.seq = -1
        lane.scrubbing = False
        lane.out = b""
        lane.reader = wire.FrameReader(self.config.hello_limits)
        self.budget.unhold(lane)
        lane.started = time.monotonic()
        self.reactor.watch_channel(lane, self._read_channel)
        self.reactor.watch(lane.logfd, self._read_log, lane)
        spawner = self.spawner
        if isinstance(spawner, TemplateSpawner):
            spawner.deliver_exits()  # exits read while waiting for the fork

    def _settle(self, lane: Lane) -> None:
        """Before env's sandbox is (re)spawned into its cgroup: wait until the
        tasks of its last one are gone, killing any still there. They count
        against pids.max until reaped (exec mode's bwrap is reaped by this
        loop), and a fork bomb's leftovers would refuse the new sandbox's forks."""
        cgroups = self.cgroups
        assert cgroups is not None
        deadline = time.monotonic() + 5.0
        while cgroups.tasks(lane.index) and time.monotonic() < deadline:
            cgroups.kill(lane.index)
            self.poll(0.005)
            reap_orphans()

    def start(self, lanes: list[Lane], progress: bool = False) -> None:
        """Spawn envs, overlapping spawns with handshakes, until all are IDLE or DEAD."""
        start_timeout = self.config.start_timeout
        deadline_of = lambda lane: lane.started + start_timeout  # noqa: E731
        last_report = 0.0
        for lane in lanes:
            if not lane.state.dead:
                self.kill(lane, "restarted")
            try:
                self._spawn(lane)
            except (OSError, TemplateUnavailable) as exc:
                cause = f"could not spawn its sandbox: {exc}"
                if lane.state.dead:
                    lane.cause = cause
                else:  # spawned, then failed: its fds go too
                    self.kill(lane, cause)
            self.poll(0)
            if progress and time.monotonic() - last_report > 0.1:
                last_report = time.monotonic()
                self._progress(lanes)
        while True:
            starting = [e for e in lanes if e.state is STARTING]
            if not starting:
                break
            now = time.monotonic()
            for lane in starting:
                if now >= deadline_of(lane):
                    self.kill(lane, f"did not complete its handshake within {start_timeout:g} s")
            earliest = min((deadline_of(e) for e in starting if e.state is STARTING), default=now)
            self.poll(max(0.0, min(earliest - now, 0.1)))
            if progress and time.monotonic() - last_report > 0.1:
                last_report = time.monotonic()
                self._progress(lanes)
            if progress and any(e.state.dead for e in lanes):
                # Fail fast: at pool start-up one broken env fails the pool.
                for lane in lanes:
                    if lane.state is STARTING:
                        self.kill(lane, ABANDONED)
        if progress:
            self._progress(lanes)

    def _progress(self, lanes: list[Lane]) -> None:
        ready = sum(e.state is IDLE for e in lanes)
        self.reactor.send([wire.PROGRESS, ready, len(lanes)])

    def respawn(self, lanes: list[Lane], hard: bool) -> None:
        """Respawn those of envs that need it before a reset: all when hard,
        else the dead and those still busy with an unanswered step."""
        respawn = [e for e in lanes if hard or e.state.dead or e.state.due]
        cause = "killed for a hard reset" if hard else "killed at reset: it had not answered its last step"
        beat = self.reactor.beat  # 10,000 kills take seconds outside the loop: the client hears of them
        with self.spawner.batching_kills():
            for lane in respawn:
                if not lane.state.dead:
                    self.kill(lane, cause)
                lane.log += b"\n--- boltzlabs: sandbox respawned ---\n"
                beat()
        if respawn:
            self.start(respawn)

    def _vet(self, lane: Lane) -> str:
        """At env's handshake, with one look at its process: why it is killed, or ''. What the
        kernel says is wrong with its confinement (confinement.py); with RLPool(pin_sandboxes=True),
        it is then pinned to its CPU (affinity.place), or killed when it cannot be."""
        pid, pidfd, owned = self.spawner.process(lane)
        try:
            problem = self.confinement.check(lane.index, pid, pidfd)
            if problem:
                return (
                    f"failed the confinement check (what the kernel says of its process, read "
                    f"by the worker) and was killed: {problem}"
                )
            cpus = self.sandbox_cpus
            if cpus and pid > 0:
                cpu = cpus[lane.index % len(cpus)]
                try:
                    affinity.place(pid, cpu)
                except OSError as exc:
                    return (
                        f"could not be pinned to CPU {cpu} (RLPool(pin_sandboxes=True)) and was killed: "
                        f"sched_setaffinity: {exc.strerror or exc}; make the pool without pin_sandboxes"
                    )
            return ""
        finally:
            if owned:
                os.close(pidfd)

    # -- reading an env ---------------------------------------------------------------

    def watch(self, lane: Lane) -> None:
        """Read lane's channel as it becomes readable (requests.unlend: a lent channel back)."""
        self.reactor.watch_channel(lane, self._read_channel)

    def _read_channel(self, lane: Lane) -> None:
        data = read_fd(lane.chan)
        if data is None:
            return
        if not data:
            self.reactor.close_channel(lane)
            # It has ended (or is ending): a template frozen for a turn must
            # run to reap it and say how it died.
            self.thaw_template()
            return
        self.take(lane, data)

    def take(self, lane: Lane, data: bytes) -> None:
        """Bytes read from env's channel (by the event loop, or by the native
        step path, requests._step_native): charged, framed, decoded under the
        limits, and handled."""
        budget = self.budget
        if not budget.charge(lane, len(data)):
            self.kill(lane, budget.over(lane))
            return
        try:
            messages = lane.reader.feed(data)
            limits = lane.reader.limits
            if limits.made:
                # What the decoded frames cost beyond their bytes, ~64 bytes
                # per object (a list, a dict entry, a str), is charged too.
                cost = limits.made * OBJECT_COST
                limits.made = 0
                if not budget.charge(lane, cost):
                    self.kill(lane, budget.over(lane))
                    return
        except ProtocolError as exc:
            lane.reader.limits.made = 0
            if lane.state is STARTING:
                hello = self.config.hello_limits
                self.kill(
                    lane,
                    f"sent an invalid frame as its handshake (HELLO) and was killed: {exc} (its caps are "
                    f"limits.max_hello={hello.max_frame} bytes and "
                    f"limits.max_hello_objects={hello.max_objects})",
                )
            else:
                self.kill(lane, f"sent an invalid frame ({exc}) and was killed")
            return
        on_message = self.on_message
        for message in messages:
            on_message(lane, message)
            if lane.state.dead:
                return

    def _on_message_metered(self, lane: Lane, message: list) -> None:
        """on_message of a pool with a cpu_budget: the reply a lane owes is metered before it is
        taken, and a lane over its budget is killed, the reply dropped (cpu_budget.py)."""
        meter = self.meter
        assert meter is not None
        if lane.state.due and len(message) >= 2 and message[1] == lane.seq and meter.at_reply(lane):
            return
        self.on_message_unmetered(lane, message)

    def _on_message(self, lane: Lane, message: list) -> None:
        code = message[0]
        if lane.state is STARTING:
            if code == wire.HELLO and len(message) == 3 and message[1] == wire.PROTOCOL_VERSION:
                problem = self._vet(lane)
                if problem:
                    self.kill(lane, problem)
                    return
                lane.on("hello")
                lane.reader.limits = self.config.env_limits
                if lane.index == 0 and self.hello is None:  # only lane 0's is ever read: keep no other
                    self.hello = message[2] if isinstance(message[2], dict) else {}
                self.budget.unhold(lane)
                if self.slots is not None:  # sized and sealed from lane 0's space (worker/slots.py)
                    self.slots.on_hello(self.hello, self.config.env_limits, self.lanes, self.kill, lane)
                return
            self.kill(lane, f"sent {describe(message)} instead of its handshake (protocol {wire.PROTOCOL_VERSION})")
            return
        # Exactly one reply is due per request, carrying its sequence number
        # (module docstring): anything else is killed at the first frame.
        if not lane.state.due:
            self.kill(lane, f"sent {describe(message)} when no reply was due (a protocol violation) and was killed")
            return
        if len(message) < 2 or message[1] != lane.seq:
            self.kill(
                lane,
                f"sent {describe(message)} with the wrong sequence number while the reply to request "
                f"{lane.seq} was due (a protocol violation) and was killed",
            )
            return
        result = check_reply(message)
        if result is None or result[0] not in (lane.expect, wire.FAILED):
            self.kill(lane, f"sent a malformed reply {describe(message)}")
            return
        if lane.scrubbing:
            lane.scrubbing = False
            left = self.scrub_left(lane) if result[0] == wire.RESET_DONE else 0
            if left:
                self.kill(
                    lane,
                    f"its scrub reported done, yet {left} process(es) besides its server were still "
                    "running (counted in its cgroup); killed: reset it to respawn",
                )
                return
        obs: Any = result[2] if result[0] != wire.FAILED else None  # a decoded value (msgpack: untyped)
        if type(obs) is msgpack.ExtType and obs.code == wire.SLOT_EXT:
            # (wire.decode lets a marker through only as the obs of a step or reset, and only with slots on.)
            if self.slots is None or not self.slots.sealed[lane.index]:
                self.kill(
                    lane,
                    "sent its obs as a slot marker but has no observation slot (a protocol violation) and was killed",
                )
                return
            if obs.data != lane.seq.to_bytes(8, "little"):
                self.kill(
                    lane,
                    f"sent an observation in its slot for request {int.from_bytes(obs.data, 'little')} "
                    f"while the reply to request {lane.seq} was due (a protocol violation) and was killed",
                )
                return
        if lane.on("reply") is IN_FLIGHT:  # an async action's result, held for recv
            self.deliver(lane, result, lane.cause)
            return
        op = self.op
        if op is not None and message[1] == op.seq and lane.index in op.waiting:
            op.waiting.discard(lane.index)
            op.results[lane.index] = result
            return
        self.budget.unhold(lane)  # a straggler's one late reply: dropped

    def _read_log(self, lane: Lane) -> None:
        data = read_fd(lane.logfd)
        if data is None:
            return
        if not data:
            self.reactor.close_log(lane)
            return
        log = lane.log
        log += data
        tail = self.config.log_tail
        if len(log) > tail:
            del log[: len(log) - tail]

    def drain_log(self, lane: Lane) -> None:
        """Read what env's log pipe holds now (a bounded amount)."""
        for _ in range(64):  # at most 4 MiB: the tail is what matters
            if lane.logfd < 0:
                return
            before = len(lane.log), lane.logfd
            self._read_log(lane)
            if (len(lane.log), lane.logfd) == before:
                return

    # -- death ----------------------------------------------------------------------

    def on_exit(self, lane: Lane, status, cause: str = "") -> None:
        """env's process is gone (the spawner reaped it): record why."""
        if lane.state.dead:
            return
        self.drain_log(lane)
        lane.exit_code = os.waitstatus_to_exitcode(status) if isinstance(status, int) else None
        lane.limit_hit = ""
        if not cause:
            cause = describe_status(status) + self._limits_hit(lane, status)
        self._release(lane, f"died: {cause}")

    def _limits_hit(self, lane: Lane, status) -> str:
        """What limit an env that died had hit, by name ('' if none is known);
        lane.limit_hit says which, as `limits` names it (the first, if several)."""
        notes, hit = [], []
        limits = self.config.limits
        if self.cgroups is not None:
            oom, refused = (now - base for now, base in zip(self.cgroups.events(lane.index), lane.events_base))
            if oom > 0:
                hit.append("memory")
                notes.append(
                    f"OOM: killed by the kernel's OOM killer over its memory limit "
                    f"(memory_limit={self.config.memory_limit} bytes)"
                )
            if refused > 0:
                # The kernel counts a refusal in the forking env's cgroup whichever
                # limit refused it, its own or the pool's (limits.pool_pids).
                own, cap = f"its limit of {limits['pids']} tasks", limits.get("pool_pids")
                pools = f"the pool's limit of {cap} tasks for all its envs together (limits.pool_pids)"
                if self.cgroups.pool_full():
                    where, which = pools, "pool_pids"
                elif cap and cap < len(self.lanes) * limits["pids"]:
                    where, which = f"{own} or {pools}", "pids or pool_pids"
                else:
                    where, which = own, "pids"
                hit.append(which)
                notes.append(f"pids limit: {refused} fork(s) refused at {where}")
        signum = exit_signal(os.waitstatus_to_exitcode(status)) if isinstance(status, int) else None
        if signum == signal.SIGXFSZ:
            hit.append("file_size")
            notes.append(f"file size limit: it wrote past limits.file_size={limits.get('file_size')} bytes")
        elif signum == signal.SIGXCPU:
            notes.append("CPU time limit (RLIMIT_CPU)")
        lane.limit_hit = hit[0] if hit else ""
        return "".join(f"; {note}" for note in notes)

    def _release(self, lane: Lane, cause: str) -> None:
        """Mark env dead with `cause`; close its fds; the op stops waiting for it,
        an async action in flight is finished with the failure."""
        self.reactor.close_channel(lane)
        self.reactor.close_log(lane)
        lane.pid = -1
        self.confinement.forget(lane.index)
        was = lane.on("die")
        lane.cause = cause
        self.budget.release(lane)
        if was is IN_FLIGHT:
            self.deliver(lane, None, cause)
        op = self.op
        if op is not None and lane.index in op.waiting:
            op.waiting.discard(lane.index)
            op.results[lane.index] = None  # failure: see lane.cause

    def scrub_field(self, scrub: bool) -> dict | None:
        """A RESET frame's scrub field for reset(scrub=) and send(scrub=), or None: the sandbox also
        removes its SysV IPC objects where its IPC namespace is its own."""
        return {"ipc": "ipc" in self.confinement.kinds} if scrub else None

    def reset_frame(self, lane: Lane, seq: int, seed: Any, options: Any, scrubbing: dict | None) -> list:
        """Lane's RESET message; with `scrubbing` (scrub_field(); None for a lane just respawned,
        which has nothing to scrub) a scrub, whose reply is counted from outside (scrub_left)."""
        if scrubbing is None:
            return [wire.RESET, seq, seed, options]
        lane.scrubbing = True
        return [wire.RESET, seq, seed, options, scrubbing]

    def scrub_left(self, lane: Lane) -> int:
        """How many processes a lane whose scrub says it is done still holds besides its server
        (and, in exec mode, bubblewrap's two), counted in its cgroup from outside: more than none,
        and its server is no longer the env's (an action ran in it). Without cgroups, 0: the count
        is the sandbox's own word."""
        if self.cgroups is None:
            return 0
        return max(0, len(self.cgroups.procs(lane.index)) - self.spawner.processes_at_rest)

    def kill(self, lane: Lane, cause: str, limit: str = "") -> None:
        """Kill env's sandbox now, its whole tree; the spawner reaps it. `limit`: the limit it
        is killed at, by its name (lane.limit_hit: lanes.CPU_BUDGET), '' for none."""
        if lane.state.dead:
            return
        lane.limit_hit = limit
        self.spawner.kill(lane)
        if self.cgroups is not None:
            self.cgroups.kill(lane.index)  # and thaws it: killed tasks die on the way out
        self.freeze_pending.discard(lane.index)
        self.drain_log(lane)
        self._release(lane, cause)

    def close(self) -> float:
        """Kill every lane and stop the spawner (by a deadline of 5 s); that deadline, for the cgroups."""
        for lane in self.lanes:
            self.kill(lane, "pool closed")
            self.reactor.beat()
        deadline = time.monotonic() + 5.0
        self.spawner.close(deadline)
        return deadline

    # -- the freezer (serialize_measurement) ------------------------------------------

    def _on_message_freezing(self, lane: Lane, message: list) -> None:
        """on_message of a pool that freezes its envs (serialize_measurement):
        an env's handshake or reply ends its work, so it is frozen first, before
        the reply can pass the gate on. If the message is refused, the kill thaws."""
        if lane.state is STARTING or (lane.state.due and len(message) >= 2 and message[1] == lane.seq):
            self._freeze(lane)
        self._on_message(lane, message)

    def _freeze(self, lane: Lane) -> None:
        assert self.cgroups is not None  # freezing needs them
        try:
            self.cgroups.freeze(lane.index)
        except OSError:
            return  # its cgroup is gone: so is the env
        self.freeze_pending.add(lane.index)

    def thaw(self, lane: Lane) -> None:
        """env runs (its turn, its own request); only with the freezer."""
        assert self.cgroups is not None
        self.freeze_pending.discard(lane.index)
        try:
            self.cgroups.thaw(lane.index)
        except OSError:
            pass

    def _freeze_template(self) -> bool:
        """Start freezing the template's cgroup (a gated turn begins); whether it is frozen or freezing."""
        spawner = self.spawner
        if not isinstance(spawner, TemplateSpawner) or not spawner.alive() or self.cgroups is None:
            return False
        if not self.template_frozen:
            try:
                self.cgroups.freeze(TEMPLATE_LANE)
            except OSError:
                return False
            self.template_frozen = True
        return True

    def thaw_template(self) -> None:
        """A gated turn is over (or the template is needed: a fork, a death to reap)."""
        if self.template_frozen:
            self.template_frozen = False
            assert self.cgroups is not None
            try:
                self.cgroups.thaw(TEMPLATE_LANE)
            except OSError:
                pass

    @contextlib.contextmanager
    def template_thawed(self) -> Iterator[None]:
        """Context in which the template runs (it forks): thawed if a turn froze it.
        The next turn freezes it again."""
        self.thaw_template()
        yield

    def all_frozen(self) -> None:
        """Before a turn at the gate: wait until every env asked to freeze, and
        the template, are frozen. Freezing takes each task out of whatever it
        runs; an env that cannot be frozen in time is killed, and a template
        that cannot is given up (its envs with it), so the gate's promise holds."""
        template = self._freeze_template()
        cgroups = self.cgroups
        assert cgroups is not None
        spawner = self.spawner
        now = time.monotonic()
        deadline = now + min(self.config.step_timeout, 2.0)
        spin_until = now + 0.002  # a freeze mostly lands within ~0.1 ms: re-read before sleeping
        pause = 0.0001
        while template and isinstance(spawner, TemplateSpawner):
            try:
                if cgroups.frozen(TEMPLATE_LANE) or not spawner.alive():
                    break
            except OSError:
                break
            if time.monotonic() >= deadline:
                spawner.give_up("it could not be frozen outside its children's turns (serialize_measurement)")
                break
            time.sleep(pause)
            pause = min(pause * 2, 0.005)
        pause = 0.0001
        while self.freeze_pending:
            for index in list(self.freeze_pending):
                lane = self.lanes[index]
                try:
                    done = lane.state.dead or cgroups.frozen(index)
                except OSError:
                    done = True
                if done:
                    self.freeze_pending.discard(index)
            if not self.freeze_pending:
                return
            if time.monotonic() >= deadline:
                for index in list(self.freeze_pending):
                    self.freeze_pending.discard(index)
                    self.kill(
                        self.lanes[index], "could not be frozen outside its turn (serialize_measurement) and was killed"
                    )
                return
            if time.monotonic() >= spin_until:
                time.sleep(pause)
                pause = min(pause * 2, 0.005)


def _no_async(lane: Lane, reply: list | None, cause: str) -> None:
    raise AssertionError(f"lane {lane.index} finished an async action with no stepping part to take it")


def warmup_note(report: dict | None) -> str:
    """The warning for a warm-up that failed (spawn.TemplateSpawner._warmup's report), or ''."""
    if report is None:
        return ""
    notes = []
    if report["error"]:
        notes.append(
            f"the warm template's probe failed, so each env imports on its own what its reset and step "
            f"import (more memory per env); the pool runs. {report['error']}. Fix the env's reset/step, "
            "or name the library modules they import in RLPool(preload=[...]) (or a boltzlabs.toml beside env.py), or RLPool(warmup=False) to skip it"
        )
    failed = sorted(set(report["failed"]) & set(report["preload"]))
    if failed:
        notes.append(
            "preload named modules the template could not import: "
            + "; ".join(f"{name}: {report['failed'][name]}" for name in failed[:8])
        )
    return "\n".join(notes)


def guard_cgroups(paths: list[str], release=None) -> int:
    """Make sure the pool's cgroups and every task in them go with this worker,
    however it dies (SIGKILL included). Returns the guardian's pid.

    A killed worker removes nothing itself, and a task frozen by the cgroup v1
    freezer (serialize_measurement) does not act on SIGKILL until it is
    thawed, so bwrap's --die-with-parent (and every other kill) would wait
    forever for it. A forked guardian in a session of its own (a kill of our
    process group misses it) waits for the end of a pipe this process holds,
    which closes only when this process is gone, then kills, thaws and
    removes what is left of the pool's cgroups: nothing, after a clean close;
    then `release()` (CgroupPool.release: cgroup v2's room, where it is free).
    The client, which only kills the worker, waits for the guardian to end.
    A fork shares the worker's pages; it writes little (measured in
    tests/test_protocol.py). It also watches the client (this worker's parent:
    the trainer, or a remote worker's listener): once the client is gone, a
    worker that is stopped (SIGSTOP, ^Z, a debugger) would never see it go and
    would hold every sandbox for ever, so the guardian kills it.
    """
    from boltzlabs.host.cgroups import remove_pool_dir

    worker, client = os.getpid(), os.getppid()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            prctl(PR_SET_NAME, GUARDIAN_NAME)  # what ps and /proc/<pid>/comm show
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(signum, signal.SIG_IGN)
            # Nothing of the worker's but the pipe: the client's socket held
            # here would hide the worker's death from the client.
            os.closerange(3, r)
            os.closerange(r + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
            closed = _await_worker(r, worker, client)
            remove_pool_dir(paths)
            if release is not None and not closed:
                release()  # after a clean close the worker did it; a new pool may have made its own since
        finally:
            os._exit(0)
    os.close(r)
    _GUARD.append(w)  # held (close-on-exec, so no sandbox gets it) until this process ends
    return pid


def _await_worker(r: int, worker: int, client: int) -> bool:
    """The guardian's wait: read the worker's pipe until it ends (the worker has exited); whether
    the worker said it closed the pool itself (guard_closed). Once the client has exited, the
    worker is checked every STOPPED_CHECK seconds and killed if it is stopped: a running worker
    sees its connection end and closes the pool itself."""
    poller = select.poll()
    poller.register(r, select.POLLIN)
    try:
        killer = os.pidfd_open(worker)
    except OSError:  # the worker is gone already: its pipe has ended
        killer = None
    try:
        poller.register(os.pidfd_open(client), select.POLLIN)  # readable once the client has exited
        client_gone = False
    except OSError:  # gone before we looked
        client_gone = True
    closed = False
    while True:
        for fd, _ in poller.poll(int(STOPPED_CHECK * 1000) if client_gone else -1):
            if fd == r:
                if not os.read(r, 1):
                    return closed
                closed = True  # guard_closed(): the worker closed the pool itself
            else:
                poller.unregister(fd)
                client_gone = True
        if client_gone and killer is not None and stopped(worker):
            try:
                signal.pidfd_send_signal(killer, signal.SIGKILL)  # the pidfd: never another process
            except ProcessLookupError:
                pass  # it exited meanwhile: its pipe ends


STOPPED_CHECK = 0.5  # seconds between the guardian's looks at a worker whose client is gone
GUARDIAN_NAME = b"boltzlabs-guard"  # 15 bytes: the kernel's comm holds at most 15


def prctl(option: int, value) -> None:
    """prctl(2) with one argument (an int, or bytes for PR_SET_NAME); the worker's one caller of it."""
    abi.libc.prctl(option, value, 0, 0, 0)


_GUARD: list[int] = []


def guard_closed() -> None:
    """Tell the guardians that this worker removed its cgroups (and released
    the room) itself: they only sweep what may be left, and undo nothing."""
    for w in _GUARD:
        try:
            os.write(w, b"c")
        except OSError:
            pass
