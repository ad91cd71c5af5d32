"""A lane's life: spawned, started (its handshake), killed, reaped; and the freezer.

    _start(lanes) --_spawn--> spawner.spawn (spawn.py) --> lane STARTING --HELLO (reactor.py)--> IDLE
    _kill(lane, cause) --> spawner.kill + the cgroup's kill --> _release: DEAD, its fds closed
    spawner --on_exit(lane, status)--> _release with why it died (exit code, signal, OOM, pids limit)

Start-up overlaps spawns with handshakes: each lane is spawned and the loop
polled at once, so 1000 sandboxes start in the time of a few. A death while
an async action is in flight finishes it with a failure (stepping.py).

serialize_measurement with a freezer: every env is frozen outside its turn
and its own requests; an env's reply ends its work, so it is frozen before
the reply can pass the gate on (_on_message_freezing).

A mixin of server.Worker; it uses the reactor's _poll and fds.
"""

from __future__ import annotations

import contextlib
import os
import resource
import select
import signal
import time

from boltzlabs import abi, wire
from boltzlabs.abi import PR_SET_NAME
from boltzlabs.errors import TemplateUnavailable, describe_status, exit_signal
from boltzlabs.worker.lanes import IDLE, IN_FLIGHT, STARTING, Lane
from boltzlabs.worker.reactor import Reactor
from boltzlabs.worker.spawn import TEMPLATE_LANE, TemplateSpawner, reap_orphans
from boltzlabs.worker.stepping import outcome

ABANDONED = "start-up abandoned after another env failed"


class Lifecycle:
    """Spawning, killing and reaping lanes, and the freezer (a mixin of server.Worker)."""

    def _init_lifecycle(self) -> None:
        self.envs: list[Lane] = []
        self.spawner = None
        self.cgroups = None
        self.account = None
        self.hello = None  # lane 0's handshake info, for the client's READY
        # serialize_measurement with a freezer: every env is frozen outside its
        # turn and its own requests (see _freeze); `freeze_pending`: lanes asked to
        # freeze whose freeze is not confirmed yet.
        self.freezing = False
        self.freeze_pending: set[int] = set()
        # The template's cgroup is frozen during every gated turn too (its
        # imports' threads, a trusted env.py's at-fork hooks): frozen at
        # each turn's start with the envs, thawed when the turn ends.
        self.template_frozen = False
        self.confinement = None  # confinement.Confinement, made by open()

    # -- start-up -------------------------------------------------------------------

    def _spawn(self, env: Lane) -> None:
        """Start env's sandbox. Its fds are registered; it is STARTING."""
        if self.spawner.kind == "template" and not self.spawner.alive():
            self.spawner = TemplateSpawner(self)  # the last one died; a new one for respawns
        env.generation += 1
        if self.cgroups is not None:
            self._settle(env)
            env.events_base = self.cgroups.events(env.index)
        if self.freezing:
            self._thaw(env)  # the template forks while in the env's cgroups: never into a frozen one
        self.spawner.spawn(env)  # sets env.chan, env.wchan, env.logfd (and env.pid when known)
        # Never blocked by an env: a full channel buffers in env.out (reactor._write).
        os.set_blocking(env.chan, False)
        os.set_blocking(env.wchan, False)
        os.set_blocking(env.logfd, False)
        env.on("spawn")
        env.seq = -1
        env.out = b""
        env.reader = wire.FrameReader(self.hello_limits)
        self._unhold(env)
        env.started = time.monotonic()
        for fd, kind in ((env.chan, "chan"), (env.logfd, "log")):
            self.epoll.register(fd, select.EPOLLIN)
            self.handlers[fd] = (kind, env)
        if self.spawner.kind == "template":
            self.spawner.deliver_exits()  # exits read while waiting for the fork

    def _settle(self, env: Lane) -> None:
        """Before env's sandbox is (re)spawned into its cgroup: wait until the
        tasks of its last one are gone, killing any still there. They count
        against pids.max until reaped (exec mode's bwrap is reaped by this
        loop), and a fork bomb's leftovers would refuse the new sandbox's forks."""
        deadline = time.monotonic() + 5.0
        while self.cgroups.tasks(env.index) and time.monotonic() < deadline:
            self.cgroups.kill(env.index)
            self._poll(0.005)
            reap_orphans()

    def _start(self, envs: list[Lane], progress: bool = False) -> None:
        """Spawn envs, overlapping spawns with handshakes, until all are IDLE or DEAD."""
        deadline_of = lambda env: env.started + self.start_timeout  # noqa: E731
        last_report = 0.0
        for env in envs:
            if not env.state.dead:
                self._kill(env, "restarted")
            try:
                self._spawn(env)
            except (OSError, TemplateUnavailable) as exc:
                cause = f"could not spawn its sandbox: {exc}"
                if env.state.dead:
                    env.cause = cause
                else:  # spawned, then failed: its fds go too
                    self._kill(env, cause)
            self._poll(0)
            if progress and time.monotonic() - last_report > 0.1:
                last_report = time.monotonic()
                self._progress(envs)
        while True:
            starting = [e for e in envs if e.state is STARTING]
            if not starting:
                break
            now = time.monotonic()
            for env in starting:
                if now >= deadline_of(env):
                    self._kill(env, f"did not complete its handshake within {self.start_timeout:g} s")
            earliest = min((deadline_of(e) for e in starting if e.state is STARTING), default=now)
            self._poll(max(0.0, min(earliest - now, 0.1)))
            if progress and time.monotonic() - last_report > 0.1:
                last_report = time.monotonic()
                self._progress(envs)
            if progress and any(e.state.dead for e in envs):
                # Fail fast: at pool start-up one broken env fails the pool.
                for env in envs:
                    if env.state is STARTING:
                        self._kill(env, ABANDONED)
        if progress:
            self._progress(envs)

    def _progress(self, envs: list[Lane]) -> None:
        ready = sum(e.state is IDLE for e in envs)
        self._send([wire.PROGRESS, ready, len(envs)])

    def _confinement_problem(self, env: Lane) -> str:
        """What the kernel says is wrong with env's confinement (confinement.py), or ''."""
        if self.confinement is None:
            return ""
        pid, pidfd, owned = self.spawner.process(env)
        try:
            return self.confinement.check(env.index, pid, pidfd)
        finally:
            if owned:
                os.close(pidfd)

    # -- death ----------------------------------------------------------------------

    def on_exit(self, env: Lane, status, cause: str = "") -> None:
        """env's process is gone (the spawner reaped it): record why."""
        if env.state.dead:
            return
        self._drain_log(env)
        env.exit_code = os.waitstatus_to_exitcode(status) if isinstance(status, int) else None
        if not cause:
            cause = describe_status(status) + self._limits_hit(env, status)
        self._release(env, f"died: {cause}")

    def _limits_hit(self, env: Lane, status) -> str:
        """What limit an env that died had hit, by name ('' if none is known)."""
        notes = []
        if self.cgroups is not None:
            oom, refused = (now - base for now, base in zip(self.cgroups.events(env.index), env.events_base))
            if oom > 0:
                notes.append(f"OOM: killed by the kernel's OOM killer over its memory limit "
                             f"(memory_limit={self.memory_limit} bytes)")
            if refused > 0:
                # The kernel counts a refusal in the forking env's cgroup whichever
                # limit refused it, its own or the pool's (limits.pool_pids).
                own, cap = f"its limit of {self.limits['pids']} tasks", self.limits.get("pool_pids")
                pools = f"the pool's limit of {cap} tasks for all its envs together (limits.pool_pids)"
                if self.cgroups.pool_full():
                    where = pools
                elif cap and cap < len(self.envs) * self.limits["pids"]:
                    where = f"{own} or {pools}"
                else:
                    where = own
                notes.append(f"pids limit: {refused} fork(s) refused at {where}")
        signum = exit_signal(os.waitstatus_to_exitcode(status)) if isinstance(status, int) else None
        if signum == signal.SIGXFSZ:
            notes.append(f"file size limit: it wrote past limits.file_size={self.limits.get('file_size')} bytes")
        elif signum == signal.SIGXCPU:
            notes.append("CPU time limit (RLIMIT_CPU)")
        return "".join(f"; {note}" for note in notes)

    def _release(self, env: Lane, cause: str) -> None:
        """Mark env dead with `cause`; close its fds; the op stops waiting for it,
        an async action in flight is finished with the failure."""
        self._close_channel(env)
        self._close_log(env)
        env.pid = -1
        if self.confinement is not None:
            self.confinement.forget(env.index)
        was = env.on("die")
        env.cause = cause
        self.held -= env.held
        env.held = 0
        if was is IN_FLIGHT:
            self._finish(env, outcome(None, cause))
        op = self.op
        if op is not None and env.index in op.waiting:
            op.waiting.discard(env.index)
            op.results[env.index] = None  # failure: see env.cause

    def _kill(self, env: Lane, cause: str) -> None:
        """Kill env's sandbox now, its whole tree; the spawner reaps it."""
        if env.state.dead:
            return
        self.spawner.kill(env)
        if self.cgroups is not None:
            self.cgroups.kill(env.index)  # and thaws it: killed tasks die on the way out
        self.freeze_pending.discard(env.index)
        self._drain_log(env)
        self._release(env, cause)

    # -- the freezer (serialize_measurement) ------------------------------------------

    def _on_message_freezing(self, env: Lane, message: list) -> None:
        """_on_message of a pool that freezes its envs (serialize_measurement):
        an env's handshake or reply ends its work, so it is frozen first, before
        the reply can pass the gate on. If the message is refused, the kill thaws."""
        if env.state is STARTING or (env.state.due and len(message) >= 2 and message[1] == env.seq):
            self._freeze(env)
        Reactor._on_message(self, env, message)

    def _freeze(self, env: Lane) -> None:
        try:
            self.cgroups.freeze(env.index)
        except OSError:
            return  # its cgroup is gone: so is the env
        self.freeze_pending.add(env.index)

    def _thaw(self, env: Lane) -> None:
        self.freeze_pending.discard(env.index)
        try:
            self.cgroups.thaw(env.index)
        except OSError:
            pass

    def _freeze_template(self) -> bool:
        """Start freezing the template's cgroup (a gated turn begins); whether it is frozen or freezing."""
        if self.spawner is None or self.spawner.kind != "template" or not self.spawner.alive():
            return False
        if not self.template_frozen:
            try:
                self.cgroups.freeze(TEMPLATE_LANE)
            except OSError:
                return False
            self.template_frozen = True
        return True

    def _thaw_template(self) -> None:
        """A gated turn is over (or the template is needed: a fork, a death to reap)."""
        if self.template_frozen:
            self.template_frozen = False
            try:
                self.cgroups.thaw(TEMPLATE_LANE)
            except OSError:
                pass

    @contextlib.contextmanager
    def template_thawed(self):
        """Context in which the template runs (it forks): thawed if a turn froze it.
        The next turn freezes it again."""
        self._thaw_template()
        yield

    def _all_frozen(self) -> None:
        """Before a turn at the gate: wait until every env asked to freeze, and
        the template, are frozen. Freezing takes each task out of whatever it
        runs; an env that cannot be frozen in time is killed, and a template
        that cannot is given up (its envs with it), so the gate's promise holds."""
        template = self._freeze_template()
        now = time.monotonic()
        deadline = now + min(self.step_timeout, 2.0)
        spin_until = now + 0.002  # a freeze mostly lands within ~0.1 ms: re-read before sleeping
        pause = 0.0001
        while template:
            try:
                if self.cgroups.frozen(TEMPLATE_LANE) or not self.spawner.alive():
                    break
            except OSError:
                break
            if time.monotonic() >= deadline:
                self.spawner.failure = "it could not be frozen outside its children's turns (serialize_measurement)"
                self.spawner._lost()
                break
            time.sleep(pause)
            pause = min(pause * 2, 0.005)
        pause = 0.0001
        while self.freeze_pending:
            for index in list(self.freeze_pending):
                env = self.envs[index]
                try:
                    done = env.state.dead or self.cgroups.frozen(index)
                except OSError:
                    done = True
                if done:
                    self.freeze_pending.discard(index)
            if not self.freeze_pending:
                return
            if time.monotonic() >= deadline:
                for index in list(self.freeze_pending):
                    self.freeze_pending.discard(index)
                    self._kill(self.envs[index], "could not be frozen outside its turn (serialize_measurement) "
                                                 "and was killed")
                return
            if time.monotonic() >= spin_until:
                time.sleep(pause)
                pause = min(pause * 2, 0.005)


def warmup_note(report: dict | None) -> str:
    """The warning for a warm-up that failed (template.warm_up), or ''."""
    if report is None:
        return ""
    notes = []
    if report["error"]:
        notes.append(f"the warm template's probe failed, so each env imports on its own what its reset and step "
                     f"import (more memory per env); the pool runs. {report['error']}. Fix the env's reset/step, "
                     "or name the library modules they import in RLPool(preload=[...]) (or a boltzlabs.toml beside env.py), or RLPool(warmup=False) to skip it")
    failed = sorted(set(report["failed"]) & set(report["preload"]))
    if failed:
        notes.append("preload named modules the template could not import: "
                     + "; ".join(f"{name}: {report['failed'][name]}" for name in failed[:8]))
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
    tests/test_protocol.py).
    """
    from boltzlabs.sandbox.cgroups import remove_pool_dir

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
            closed = False
            while os.read(r, 1):
                closed = True  # guard_closed(): the worker closed the pool itself
            remove_pool_dir(paths)
            if release is not None and not closed:
                release()  # after a clean close the worker did it; a new pool may have made its own since
        finally:
            os._exit(0)
    os.close(r)
    _GUARD.append(w)  # held (close-on-exec, so no sandbox gets it) until this process ends
    return pid


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
