"""Synchronous requests: step, reset, render, attr, and what the client reads (memory, log, states, pids).

    client --CALL step(actions)--> step: one STEP frame per idle lane (Op: the lanes it waits for)
        reactor.py: each lane's one reply --> op.results        (until all came or step_timeout)
    client <--REPLY [obs, rewards, terminated, truncated, infos, stragglers]-- step: gathered in lane order
    (native: _fastpath.step() does all of the above in one C call for the replies it vouches
     for, and composes the REPLY's result from their bytes undecoded; docs/native-step.md)

A call sends one frame per lane, waits in the reactor until every lane
answered or the deadline passed, and answers with n results in lane order:
a lane that failed (raised, died, missed the deadline) is done with reward 0
and info["error"]; one that missed its deadline stays a straggler (its late
reply is dropped; reactor.py). `step` is the hot path.

A mixin of server.Worker; it uses the reactor (_poll, _write), the lifecycle
(_kill, _start, _thaw) and stepping's refusals (send/recv and step do not mix).
"""

from __future__ import annotations

import array
import time

from boltzlabs import wire
from boltzlabs.worker import native
from boltzlabs.worker.lanes import BUSY, FINISHED, IDLE, Lane
from boltzlabs.worker.spawn import TEMPLATE_LANE


class Op:
    """A request in progress: which lanes it waits for and what came back."""

    __slots__ = ("seq", "waiting", "results")

    def __init__(self, seq: int):
        self.seq = seq
        self.waiting: set[int] = set()
        self.results: dict[int, list] = {}


class Requests:
    """step, reset, render and the reads (a mixin of server.Worker)."""

    def _init_requests(self) -> None:
        self.op: Op | None = None
        self._seq = 0

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _wait(self, op: Op, deadline: float) -> None:
        while op.waiting:
            now = time.monotonic()
            if now >= deadline:
                return
            self._poll(deadline - now)

    def _wait_one(self, op: Op, index: int, deadline: float) -> None:
        while index in op.waiting:
            now = time.monotonic()
            if now >= deadline:
                return
            self._poll(deadline - now)

    def step(self, actions: list, resets=None):
        """Step every env; the lanes in `resets` are reset (seed and options
        None) instead, their actions ignored: Gymnasium's next-step autoreset
        in the same round trip. Returns the result list, or (native path) its
        msgpack bytes as a wire.Raw.

        THE HOT PATH. The batch is fanned out (one frame per idle lane), its
        replies waited for and gathered into arrays allocated once. An ungated
        pool with the extension does all of that in C (_step_native)."""
        n = len(self.envs)
        if not isinstance(actions, list) or len(actions) != n:
            raise ValueError(f"step() needs {n} actions, one per env; got {len(actions) if isinstance(actions, list) else type(actions).__name__}")
        resets = set(self._check_lanes(resets or []))
        self._refuse_async("step() cannot run")
        if resets:
            self._respawn([self.envs[i] for i in sorted(resets)], hard=False)
        seq = self._next_seq()
        op = Op(seq)
        self.op = op
        if self.fastpath is not None and not self.gated:
            result = self._step_native(actions, resets, op)
            if result is not None:
                return result
        pack = self._packer.pack
        header = wire.HEADER.pack
        gated = self.gated
        freezing = self.freezing
        immediate: dict[int, str] = {}
        # Hot path (pure), fan-out: one frame per idle env, written straight to its channel.
        for env, action in zip(self.envs, actions):
            if env.state is IDLE:
                if resets and env.index in resets:
                    body = pack([wire.RESET, seq, None, None])
                    env.expect = wire.RESET_DONE
                    if freezing:
                        self._thaw(env)  # resets are not gated
                else:
                    body = pack([wire.STEP, seq, action, gated])
                    env.expect = wire.STEPPED
                env.seq = seq
                env.to(BUSY)
                op.waiting.add(env.index)
                self._write(env, header(len(body)) + body)
            else:
                immediate[env.index] = _not_sent(env)
        stragglers = []
        if gated:
            for index in sorted(op.waiting - resets):
                env = self.envs[index]
                if index not in op.waiting:
                    continue
                if freezing:
                    self._all_frozen()
                    if index not in op.waiting:
                        continue
                    self._thaw(env)  # its STEP is waiting in its channel: decoded in its own turn
                self._write(env, wire.encode([wire.GO, seq]))
                self._wait_one(op, index, time.monotonic() + self.step_timeout)
                self._thaw_template()  # the turn is over
                if index in op.waiting:
                    # The gate promises one env's code at a time, so a holder
                    # that overruns is killed before the next one goes.
                    self._kill(env, f"missed the step deadline of {self.step_timeout:g} s while holding the "
                                    "serialize_measurement gate, and was killed")
                    stragglers.append(index)
        if op.waiting:  # ungated steps, and resets (which the gate does not serialize)
            self._wait(op, time.monotonic() + self.step_timeout)
            stragglers.extend(op.waiting)
            for index in op.waiting:
                self._straggling(self.envs[index])
        self.op = None
        # Hot path (pure), gather: the REPLY in lane order, its arrays allocated once.
        rewards = array.array("d", bytes(8 * n))
        terminated = bytearray(n)
        truncated = bytearray(n)
        obs = [None] * n
        infos = [None] * n
        results = op.results
        released = 0
        for env in self.envs:
            i = env.index
            result = results.get(i, False)
            if result:
                released += env.held  # its reply leaves with this call's REPLY
                env.held = 0
            obs[i], rewards[i], terminated[i], truncated[i], infos[i] = self._lane_result(
                env, result, i in stragglers, immediate.get(i))
        self.held -= released
        return [obs, rewards.tobytes(), bytes(terminated), bytes(truncated), infos, stragglers]

    def _lane_result(self, env: Lane, result, straggler: bool, immediate: str | None) -> tuple:
        """(obs, reward, terminated, truncated, info) of one lane's step: its
        reply (decoded), or a failure (reward 0, truncated, info["error"])."""
        if result:
            kind = result[0]
            if kind == wire.STEPPED:
                return result[2], result[3], result[4], result[5], result[6]
            if kind == wire.RESET_DONE:  # an autoreset lane: reward 0, not done
                return result[2], 0.0, False, False, result[3]
            info = {"error": result[4] or result[3]}  # the env's exception, with traceback
        elif straggler and not env.state.dead:
            info = {"straggler": True, "error": f"missed the step deadline of {self.step_timeout:g} s"}
        elif straggler:
            info = {"straggler": True, "error": env.cause}
        elif immediate == "straggler":
            info = {"straggler": True, "error": "still busy with an earlier step it has not answered; "
                                                "reset it (it will be killed and respawned)"}
        elif immediate == "dead":
            info = {"error": f"env is dead ({env.cause}); reset it to respawn"}
        else:
            info = {"error": env.cause}
        return None, 0.0, False, True, info

    def _step_native(self, actions: list, resets: set, op: Op):
        """THE HOT PATH, native (native/fastpath.c): one C call frames every
        idle lane's request, writes it, waits on epoll until each answered or
        the deadline, and vouches for each reply it can (exactly what
        wire.decode and check_reply accept, walked in C), which then stays
        undecoded: its obs and info bytes go into the REPLY as the env sent
        them, and the lane never leaves IDLE (nothing can see it inside the
        call). Only the lanes C did not complete are handled here, exactly as
        the pure path does: BUSY, what C read fed to _take, _wait until the
        deadline, their outcome packed as an override. None (nothing done)
        when C will not take this batch: the pure path runs it."""
        envs = self.envs
        chans, wchans = [], []
        for env in envs:
            if env.state is IDLE:
                if env.out or env.chan < 0 or env.wchan < 0 or env.reader.pending:
                    # A request still draining, a channel gone, or part of a frame
                    # held (C reads only what comes now): the pure path runs this batch.
                    return None
                chans.append(env.chan)
                wchans.append(env.wchan)
            else:
                chans.append(-1)
                wchans.append(-1)
        try:
            packed = self._packer.pack(actions)
        except (TypeError, ValueError, OverflowError):
            return None  # the pure path packs each lane's action and says which failed
        flags = bytearray(len(envs))
        for index in resets:
            flags[index] = 1
        seq = op.seq
        fastpath = self.fastpath
        deadline = time.monotonic() + self.step_timeout
        batch = fastpath.step(self.epoll.fileno(), chans, wchans, packed, seq, bytes(flags), deadline,
                              native.caps(self.env_limits), self.max_pool_bytes - self.held)
        if batch is None:
            return None  # C would not split the actions; nothing was written
        self.held += batch.held  # the replies C holds count against the pool's budget until the REPLY
        rest = batch.rest
        for index, kind, value in rest:
            env = envs[index]
            env.seq = seq
            env.expect = wire.RESET_DONE if index in resets else wire.STEPPED
            env.to(BUSY)
            op.waiting.add(index)
            if kind == fastpath.UNUSUAL:  # not a reply C vouches for: Python decodes it and names what is wrong
                self._take(env, value)
            elif kind == fastpath.EOF:
                self._close_channel(env)
            elif kind == fastpath.SHORT_WRITE_KIND:  # the rest is flushed by the event loop, as _write does
                env.out = value
                self._watch_out(env, True)
        stragglers = []
        if op.waiting:
            self._wait(op, deadline)
            stragglers.extend(op.waiting)
            for index in op.waiting:
                self._straggling(envs[index])
        self.op = None
        overrides = {}
        if batch.done < len(envs):
            pack = wire.pack
            results = op.results
            released = 0
            lanes = [index for index, fd in enumerate(chans) if fd < 0] + [index for index, _, _ in rest]
            for index in lanes:
                env = envs[index]
                result = results.get(index, False)
                if result:
                    released += env.held
                    env.held = 0
                immediate = None if chans[index] >= 0 else _not_sent(env)
                obs, reward, terminated, truncated, info = self._lane_result(env, result, index in stragglers,
                                                                             immediate)
                overrides[index] = (pack(obs), reward, terminated, truncated, pack(info))
            self.held -= released
        self.held -= batch.held
        return wire.Raw(batch.compose(overrides, wire.pack(stragglers)))

    def _check_lanes(self, indices) -> list:
        n = len(self.envs)
        if indices is None:
            return list(range(n))
        if not isinstance(indices, list) or any(not isinstance(i, int) or not 0 <= i < n for i in indices):
            raise ValueError(f"lanes must be indices in [0, {n})")
        return indices

    def _respawn(self, envs: list[Lane], hard: bool) -> None:
        """Respawn those of envs that need it before a reset: all when hard,
        else the dead and those still busy with an unanswered step."""
        respawn = [e for e in envs if hard or e.state.dead or e.state.due]
        cause = "killed for a hard reset" if hard else "killed at reset: it had not answered its last step"
        with self.spawner.batching_kills():
            for env in respawn:
                if not env.state.dead:
                    self._kill(env, cause)
                env.log += b"\n--- boltzlabs: sandbox respawned ---\n"
        if respawn:
            self._start(respawn)

    def reset(self, indices, seeds, hard: bool, options=None) -> list:
        """Reset the lanes in `indices` (respawned first when hard, dead or
        busy): [indices, obs, infos]."""
        indices = self._check_lanes(indices)
        if seeds is not None and (not isinstance(seeds, list) or len(seeds) != len(indices)):
            raise ValueError("reset() needs one seed per selected env")
        self._pump()
        for index in indices:
            self._refuse_outstanding(index, "reset")
        envs = [self.envs[i] for i in indices]
        self._respawn(envs, hard)
        seq = self._next_seq()
        op = Op(seq)
        self.op = op
        for env, seed in zip(envs, seeds or [None] * len(envs)):
            if env.state is not IDLE:
                continue
            env.seq = seq
            env.to(BUSY)
            env.expect = wire.RESET_DONE
            op.waiting.add(env.index)
            if self.freezing:
                self._thaw(env)
            self._write(env, wire.encode([wire.RESET, seq, seed, options]))
        self._wait(op, time.monotonic() + self.step_timeout)
        self.op = None
        for index in op.waiting:
            self._straggling(self.envs[index])
        obs, infos = [], []
        for env in envs:
            if not env.state.due:
                self._unhold(env)
            result = op.results.get(env.index)
            if result and result[0] == wire.RESET_DONE:
                obs.append(result[2])
                infos.append(result[3])
                continue
            obs.append(None)
            if result:
                infos.append({"error": result[4] or result[3]})
            elif env.index in op.waiting:
                infos.append({"straggler": True, "error": f"missed the reset deadline of {self.step_timeout:g} s"})
            else:
                infos.append({"error": f"could not be reset: {env.cause}", "log": tail(env.log)})
        return [indices, obs, infos]

    def render(self, indices) -> list:
        """One frame per lane in `indices` (None for a lane that has none)."""
        indices = self._check_lanes(indices)
        frames, errors = self._ask(indices, wire.RENDERED, lambda seq, k: wire.encode([wire.RENDER, seq]), "render")
        return [frames, {index: why for index, (_, why) in errors.items()}]

    def attr(self, indices, op, name, args, kwargs, values=None) -> list:
        """call / get_attr / set_attr on the lanes in `indices`: one ATTR
        request each, as render(). `values` (set): one per lane, for args."""
        indices = self._check_lanes(indices)
        if op not in ("call", "get", "set") or not isinstance(name, str) or not isinstance(args, list) \
                or not isinstance(kwargs, dict) or (values is not None and (not isinstance(values, list)
                                                                           or len(values) != len(indices))):
            raise ValueError("attr() takes an op (call, get, set), a name, args, kwargs and one value per lane")
        same = {}

        def frame(seq, k):
            if values is not None:
                return wire.encode([wire.ATTR, seq, op, name, [values[k]], kwargs])
            if not same:  # the same request for every lane: encoded once
                same[0] = wire.encode([wire.ATTR, seq, op, name, args, kwargs])
            return same[0]

        results, errors = self._ask(indices, wire.ATTR_DONE, frame, {"get": "get_attr", "set": "set_attr"}.get(op, op))
        return [results, {index: list(error) for index, error in errors.items()}]

    def _ask(self, indices, expect, frame, what: str):
        """One request to each idle lane in `indices` (`frame(seq, k)` is the
        k-th lane's, encoded), answered within the step deadline (render,
        attr). Returns each lane's value (None if it has none) and, for each
        lane that could not answer, (the env's exception message or "", why:
        its traceback, the missed deadline, or the lane's state)."""
        seq = self._next_seq()
        op = Op(seq)
        self.op = op
        for k, index in enumerate(indices):
            env = self.envs[index]
            if env.state is IDLE or env.state is FINISHED:  # an env with a result held for recv may answer too
                env.seq = seq
                env.on("request")
                env.expect = expect
                op.waiting.add(index)
                if self.freezing:
                    self._thaw(env)
                self._write(env, frame(seq, k))
        self._wait(op, time.monotonic() + self.step_timeout)
        self.op = None
        for index in op.waiting:
            self._straggling(self.envs[index])
        values, errors = [], {}
        for index in indices:
            env = self.envs[index]
            if not env.state.due:
                self._unhold(env)
            result = op.results.get(index)
            if result and result[0] == expect:
                values.append(result[2])
                continue
            values.append(None)
            if result:  # FAILED: the env's exception, with its traceback
                errors[index] = (result[3], result[4] or result[3])
            elif index in op.waiting:
                errors[index] = ("", f"missed the {what} deadline of {self.step_timeout:g} s")
            else:
                errors[index] = ("", f"env is {env.state.process} ({env.cause})")
        return values, errors

    def memory(self) -> dict:
        """Each env's memory charge and the pool's shared pages, and where the figures come from."""
        shared = 0
        if self.cgroups is not None:
            per_env = self.cgroups.env_usages([not e.state.dead for e in self.envs])
            if self.spawner.kind == "template":
                shared = self.cgroups.usage(TEMPLATE_LANE)
        else:
            per_env = [_pss_tree(e.pid) if e.pid > 0 else 0 for e in self.envs]
            if self.spawner.kind == "template" and self.spawner.alive():
                shared = _pss_tree(self.spawner.bwrap_pid)
        return {"per_env": per_env, "shared": shared, "source": self.memory_source, "note": self.memory_note}

    def log(self, index: int) -> str:
        """The tail of env `index`'s output (env.py's import included), after the
        template's in template mode, when it printed anything: the warm-up
        probe's (env.py run once), or env.py's import in a trusted template."""
        env = self.envs[index]
        self._drain_log(env)
        text = bytes(env.log).decode("utf-8", "replace")
        if self.spawner.kind == "template" and self.spawner.log:
            shared = bytes(self.spawner.log).decode("utf-8", "replace")
            text = (f"--- the template's output (the warm-up probe; env.py's import if trusted) ---\n{shared}"
                    f"--- env {index} ---\n{text}")
        return text

    def states(self) -> list:
        """Each lane's process state (lanes.State.process): starting, idle, busy or dead."""
        return [e.state.process for e in self.envs]

    def pids(self) -> list:
        """Each lane's host pid (-1 when dead)."""
        return [e.pid for e in self.envs]


def tail(log: bytearray, size: int = 4000) -> str:
    """The last `size` bytes of a log, as text."""
    return bytes(log[-size:]).decode("utf-8", "replace")


def _pss_tree(pid: int) -> int:
    import psutil

    try:
        root = psutil.Process(pid)
        total = 0
        for proc in [root] + root.children(recursive=True):
            try:
                total += proc.memory_full_info().pss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return total
    except psutil.NoSuchProcess:
        return 0


def _not_sent(env: Lane) -> str:
    """Why a step sent nothing to a lane that was not idle, for _lane_result:
    "straggler" (still busy with a request it has not answered) or "dead"."""
    return "straggler" if env.state.due else "dead"
