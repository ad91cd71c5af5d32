"""Synchronous requests: step, reset, render, attr, and what the client reads (memory, log, states, pids).

    client --CALL step(actions)--> step: one STEP frame per idle lane (Op: the lanes it waits for)
        reactor.py: each lane's one reply --> op.results        (until all came or step_timeout)
    client <--REPLY [obs, rewards, terminated, truncated, infos, stragglers]-- step: gathered in lane order

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

import msgpack

from boltzlabs import wire
from boltzlabs.worker.lanes import BUSY, FINISHED, IDLE, Lane
from boltzlabs.worker.reactor import OBJECT_COST, check_reply
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

    def step(self, actions: list, resets=None) -> list:
        """Step every env; the lanes in `resets` are reset (seed and options
        None) instead, their actions ignored: Gymnasium's next-step autoreset
        in the same round trip.

        THE HOT PATH. The batch is fanned out (one frame per idle lane), its
        replies waited for and gathered into arrays allocated once, all here:
        a native fan-out/gather slots in at the loop marked below."""
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
        pack = self._packer.pack
        header = wire.HEADER.pack
        gated = self.gated
        freezing = self.freezing
        immediate: dict[int, str] = {}
        # The native path writes, waits and reads in one call (_step_fast);
        # the gate's turns stay in Python.
        fast = self.fastpath is not None and not gated
        lanes, frames = [], []
        # Hot path, fan-out: one frame per idle env, written straight to its channel.
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
                if fast and not env.out and env.chan >= 0:  # (a channel closed at EOF waits for its deadline)
                    lanes.append(env)
                    frames.append(header(len(body)) + body)
                else:
                    self._write(env, header(len(body)) + body)
            elif env.state.due:
                immediate[env.index] = "straggler"
            else:
                immediate[env.index] = "dead"
        deadline = time.monotonic() + self.step_timeout
        if lanes:
            self._step_fast(lanes, frames, deadline)
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
                if index in op.waiting:
                    # The gate promises one env's code at a time, so a holder
                    # that overruns is killed before the next one goes.
                    self._kill(env, f"missed the step deadline of {self.step_timeout:g} s while holding the "
                                    "serialize_measurement gate, and was killed")
                    stragglers.append(index)
        if op.waiting:  # ungated steps, and resets (which the gate does not serialize)
            self._wait(op, deadline if fast else time.monotonic() + self.step_timeout)
            stragglers.extend(op.waiting)
            for index in op.waiting:
                self._straggling(self.envs[index])
        self.op = None
        # Hot path, gather: the REPLY in lane order, its arrays allocated once.
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
                kind = result[0]
                if kind == wire.STEPPED:
                    obs[i] = result[2]
                    rewards[i] = result[3]
                    terminated[i] = result[4]
                    truncated[i] = result[5]
                    infos[i] = result[6]
                    continue
                if kind == wire.RESET_DONE:  # an autoreset lane: reward 0, not done
                    obs[i] = result[2]
                    infos[i] = result[3]
                    continue
                infos[i] = {"error": result[4] or result[3]}  # the env's exception, with traceback
            elif i in stragglers and not env.state.dead:
                infos[i] = {"straggler": True, "error": f"missed the step deadline of {self.step_timeout:g} s"}
            elif i in stragglers:
                infos[i] = {"straggler": True, "error": env.cause}
            elif immediate.get(i) == "straggler":
                infos[i] = {"straggler": True, "error": "still busy with an earlier step it has not answered; "
                                                        "reset it (it will be killed and respawned)"}
            elif immediate.get(i) == "dead":
                infos[i] = {"error": f"env is dead ({env.cause}); reset it to respawn"}
            else:
                infos[i] = {"error": env.cause}
            truncated[i] = 1
        self.held -= released
        return [obs, rewards.tobytes(), bytes(terminated), bytes(truncated), infos, stragglers]

    def _step_fast(self, lanes: list, frames: list, deadline: float) -> None:
        """Hot path, native (native/fastpath.c): write every lane's frame, wait
        on epoll until each has answered or `deadline`, read each reply once,
        all in one C call. Every byte read goes through _take, as the event
        loop's reads do. Whatever it leaves (lanes not read yet: it returns
        early when a log, pidfd, straggler or the client is ready, or at the
        byte budget; short writes) is left to the pure path's _wait."""
        fastpath = self.fastpath
        why, results = fastpath.exchange(self.epoll.fileno(), [env.chan for env in lanes],
                                         [env.wchan for env in lanes], frames, deadline,
                                         self.env_limits.max_frame, self.max_pool_bytes - self.held)
        limits = self.env_limits
        small = limits.max_depth if limits.guarded is not None else -1  # env limits are always guarded
        kwargs = limits.kwargs
        unpackb = msgpack.unpackb
        op = self.op
        for env, frame, result in zip(lanes, frames, results):
            if result is None:
                continue
            if type(result) is bytes:  # one whole reply
                # The common case inline: a small frame (it can neither nest
                # deeper nor hold more objects than limits.max_depth, so it is
                # decoded with no hook, as wire.decode does) that is the reply
                # due, well formed, within the budget. Anything else, and any
                # decoding error, goes through _take, which says what is wrong.
                size = len(result)
                cost = size + (size - 4) * OBJECT_COST
                if (size - 4 <= small and not env.reader.pending and env.reader.limits is limits
                        and self.held + cost <= self.max_pool_bytes):
                    try:
                        message = unpackb(memoryview(result)[4:], **kwargs)
                    except Exception:  # noqa: BLE001 (msgpack raises several types; _take names it)
                        message = None
                    if (type(message) is list and len(message) > 1 and type(message[0]) is int
                            and message[0] == env.expect and message[1] == env.seq and env.state is BUSY
                            and check_reply(message)):
                        env.held += cost
                        self.held += cost
                        env.on("reply")
                        op.waiting.discard(env.index)
                        op.results[env.index] = message
                        continue
                self._take(env, result)
                continue
            kind, value = result
            if kind == fastpath.UNUSUAL:  # not exactly one frame: FrameReader sorts it out
                self._take(env, value)
            elif kind == fastpath.EOF:
                self._close_channel(env)
            else:  # SHORT_WRITE_KIND: the rest is flushed by the event loop, as _write does
                env.out = frame[value:]
                self._watch_out(env, True)

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
            per_env = [self.cgroups.usage(e.index) if not e.state.dead else 0 for e in self.envs]
            if self.spawner.kind == "template":
                shared = self.cgroups.usage(TEMPLATE_LANE)
        else:
            per_env = [_pss_tree(e.pid) if e.pid > 0 else 0 for e in self.envs]
            if self.spawner.kind == "template" and self.spawner.alive():
                shared = _pss_tree(self.spawner.bwrap_pid)
        return {"per_env": per_env, "shared": shared, "source": self.memory_source, "note": self.memory_note}

    def log(self, index: int) -> str:
        """The tail of env `index`'s output (in template mode after what env.py printed at import)."""
        env = self.envs[index]
        self._drain_log(env)
        text = bytes(env.log).decode("utf-8", "replace")
        if self.spawner.kind == "template":
            # What env.py printed at import, it printed once, in the template.
            shared = bytes(self.spawner.log).decode("utf-8", "replace")
            text = f"--- the template's output (env.py at import) ---\n{shared}--- env {index} ---\n{text}"
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
