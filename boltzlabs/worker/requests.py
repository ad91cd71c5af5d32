"""Synchronous requests: step, reset, render, attr, and what the client reads (memory, log, states, pids).

    client --CALL step(actions)--> step: one STEP frame per idle lane (Op: the lanes it waits for)
        lifecycle.py: each lane's one reply --> op.results        (until all came or step_timeout)
    client <--REPLY [obs, rewards, terminated, truncated, infos, stragglers]-- step: gathered in lane order
    (native: _fastpath.step() does all of the above in one C call for the replies it vouches
     for, and composes the REPLY's result from their bytes undecoded; docs/native-step.md)

A call sends one frame per lane, waits in the reactor until every lane
answered or the deadline passed, and answers with n results in lane order:
a lane that failed (raised, died, missed the deadline) is done with reward 0
and info["error"]; one that missed its deadline stays a straggler (its late
reply is dropped; lifecycle.py). `step` is the hot path; `_gather` shapes
the lanes' results for both of its paths.

One Requests per pool, made by server.Worker.open; it uses the reactor
(write), the lifecycle (poll, kill, respawn, the freezer) and stepping's
refusals (send/recv and step do not mix).
"""

from __future__ import annotations

import array
import time
from typing import Any
from collections.abc import Callable

import msgpack

from boltzlabs import wire
from boltzlabs.worker import native
from boltzlabs.worker.config import PoolConfig
from boltzlabs.worker.lanes import BUSY, FINISHED, IDLE, Lane, failure
from boltzlabs.worker.lifecycle import Lifecycle, Op
from boltzlabs.worker.reactor import Budget, Reactor
from boltzlabs.worker.spawn import TEMPLATE_LANE, TemplateSpawner
from boltzlabs.worker.stepping import Stepping


class Requests:
    """step, reset, render, attr and the reads."""

    def __init__(
        self,
        reactor: Reactor,
        lifecycle: Lifecycle,
        stepping: Stepping,
        budget: Budget,
        config: PoolConfig,
        fastpath: Any,
        packer: msgpack.Packer,
    ):
        self.reactor: Reactor = reactor  # where frames to the lanes are written
        self.lifecycle: Lifecycle = lifecycle  # the lanes: poll, kill, respawn, the freezer, the current Op
        self.stepping: Stepping = stepping  # its refusals: a sync request waits for no async result
        self.budget: Budget = budget  # replies leave the pool's byte count with their REPLY
        self.config: PoolConfig = config  # step_timeout, gated, env_limits
        self.fastpath: Any = fastpath  # the native step (native.load()), None for pure Python
        self.packer: msgpack.Packer = packer  # the worker's one Packer: each lane's action frame
        self.lent: bool = False  # the lanes' channels are the client's until its next call (lend)
        self.lent_seqs: range = range(0)  # the sequence numbers of the last lending (direct_rest's)

    def _wait(self, op: Op, deadline: float, index: int | None = None) -> None:
        """Poll until every lane of `op` (only lane `index`, when given) has answered or the
        deadline passes; then one look more that does not wait. The worker itself may not have
        run until past the deadline (a loaded node): replies already in their pipes are read,
        not taken for stragglers. One look only, so an env trickling bytes cannot extend the
        step (native/fastpath.c's wait_ready looks the same way)."""
        poll = self.lifecycle.poll
        waiting = op.waiting
        looked = False
        while (index in waiting) if index is not None else waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                if looked:
                    return
                looked, left = True, 0.0
            poll(left)

    def step(self, actions: list, resets=None):
        """Step every env; the lanes in `resets` are reset (seed and options
        None) instead, their actions ignored: Gymnasium's next-step autoreset
        in the same round trip. Returns the result list, or (native path) its
        msgpack bytes as a wire.Raw.

        THE HOT PATH. The batch is fanned out (one frame per idle lane), its
        replies waited for and gathered into arrays allocated once. An ungated
        pool with the extension does all of that in C (_step_native)."""
        lifecycle = self.lifecycle
        lanes = lifecycle.lanes
        n = len(lanes)
        if not isinstance(actions, list) or len(actions) != n:
            raise ValueError(
                f"step() needs {n} actions, one per env; got {len(actions) if isinstance(actions, list) else type(actions).__name__}"
            )
        resets = set(lifecycle.check_lanes(resets or []))
        self.stepping.refuse_async("step() cannot run")
        if resets:
            lifecycle.respawn([lanes[i] for i in sorted(resets)], hard=False)
        seq = lifecycle.next_seq()
        op = Op(seq)
        lifecycle.begin(op)
        gated = self.config.gated
        meter = lifecycle.meter
        # The native path waits in C until the deadline: with a cpu_budget the lanes' CPU must be
        # read at each reply and while they run (cpu_budget.py), which the pure path's loop does.
        if self.fastpath is not None and not gated and meter is None:
            result = self._step_native(actions, resets, op)
            if result is not None:
                return result
        pack = self.packer.pack
        header = wire.HEADER.pack
        write = self.reactor.write
        freezing = lifecycle.freezing
        step_timeout = self.config.step_timeout
        immediate: dict[int, str] = {}
        # Hot path (pure), fan-out: one frame per idle env, written straight to its channel (with a
        # cpu_budget, once its window is open: a lane over the budget of the last one is killed instead).
        for lane, action in zip(lanes, actions):
            if lane.state is IDLE and (meter is None or meter.open(lane, seq)):
                if resets and lane.index in resets:
                    body = pack([wire.RESET, seq, None, None])
                    lane.expect = wire.RESET_DONE
                    if freezing:
                        lifecycle.thaw(lane)  # resets are not gated
                else:
                    body = pack([wire.STEP, seq, action, gated])
                    lane.expect = wire.STEPPED
                lane.seq = seq
                lane.to(BUSY)
                op.waiting.add(lane.index)
                write(lane, header(len(body)) + body)
            else:
                immediate[lane.index] = _not_sent(lane)
        stragglers: list[int] = []
        if gated:
            for index in sorted(op.waiting - resets):
                lane = lanes[index]
                if index not in op.waiting:
                    continue
                if freezing:
                    lifecycle.all_frozen()
                    if index not in op.waiting:
                        continue
                    lifecycle.thaw(lane)  # its STEP is waiting in its channel: decoded in its own turn
                write(lane, wire.encode([wire.GO, seq]))
                self._wait(op, time.monotonic() + step_timeout, index)
                lifecycle.thaw_template()  # the turn is over
                if index in op.waiting:
                    # The gate promises one env's code at a time, so a holder
                    # that overruns is killed before the next one goes.
                    lifecycle.kill(
                        lane,
                        f"missed the step deadline of {step_timeout:g} s while holding the "
                        "serialize_measurement gate, and was killed",
                    )
                    stragglers.append(index)
        if op.waiting:  # ungated steps, and resets (which the gate does not serialize)
            self._wait(op, time.monotonic() + step_timeout)
            stragglers.extend(op.waiting)
            for index in op.waiting:
                lifecycle.straggling(lanes[index])
        lifecycle.end()
        # Hot path (pure), gather: the REPLY in lane order, its arrays allocated once.
        rewards = array.array("d", bytes(8 * n))
        terminated = bytearray(n)
        truncated = bytearray(n)
        obs: list = [None] * n
        infos: list = [None] * n

        def put(i: int, lane_obs, reward, lane_terminated, lane_truncated, info) -> None:
            obs[i], rewards[i], terminated[i], truncated[i], infos[i] = (
                lane_obs,
                reward,
                lane_terminated,
                lane_truncated,
                info,
            )

        self._gather(op, range(n), stragglers, immediate, put)
        return [obs, rewards.tobytes(), bytes(terminated), bytes(truncated), infos, stragglers]

    def _gather(
        self, op: Op, indices, stragglers: list[int], immediate: dict[int, str], put: Callable[..., None]
    ) -> None:
        """Hot path (both paths), gather: `put(i, obs, reward, terminated, truncated, info)` for
        each lane i of `indices`, its reply or its failure; what the replies held leaves the
        pool's byte count with this call's REPLY."""
        lanes = self.lifecycle.lanes
        results = op.results
        lane_result = self._lane_result
        released = 0
        for i in indices:
            lane = lanes[i]
            result = results.get(i, False)
            if result:
                released += lane.held  # its reply leaves with this call's REPLY
                lane.held = 0
            put(i, *lane_result(lane, result, i in stragglers, immediate.get(i)))
        self.budget.free(released)

    def _lane_result(self, lane: Lane, result, straggler: bool, immediate: str | None) -> tuple:
        """(obs, reward, terminated, truncated, info) of one lane's step: its
        reply (decoded), or a failure (reward 0, truncated, info["error"])."""
        if result:
            kind = result[0]
            if kind == wire.STEPPED:
                return result[2], result[3], result[4], result[5], result[6]
            if kind == wire.RESET_DONE:  # an autoreset lane: reward 0, not done
                return result[2], 0.0, False, False, result[3]
            info = {"error": result[4] or result[3]}  # the env's exception, with traceback
        elif straggler and not lane.state.dead:
            info = {"straggler": True, "error": f"missed the step deadline of {self.config.step_timeout:g} s"}
        elif straggler:
            info = {"straggler": True, **failure(lane, lane.cause)}
        elif immediate == "straggler":
            info = {
                "straggler": True,
                "error": "still busy with an earlier step it has not answered; "
                "reset it (it will be killed and respawned)",
            }
        elif immediate == "dead":
            info = failure(lane, f"env is dead ({lane.cause}); reset it to respawn")
        else:
            info = failure(lane, lane.cause)
        return None, 0.0, False, True, info

    def _step_native(self, actions: list, resets: set, op: Op):
        """THE HOT PATH, native (native/fastpath.c): one C call frames every
        idle lane's request, writes it, waits on epoll until each answered or
        the deadline, and vouches for each reply it can (exactly what
        wire.decode and check_reply accept, walked in C), which then stays
        undecoded: its obs and info bytes go into the REPLY as the env sent
        them, and the lane never leaves IDLE (nothing can see it inside the
        call). Only the lanes C did not complete are handled here, exactly as
        the pure path does: BUSY, what C read fed to Lifecycle.take, _wait until
        the deadline, their outcome packed by _gather as an override. None
        (nothing done) when C will not take this batch: the pure path runs it."""
        lifecycle = self.lifecycle
        lanes = lifecycle.lanes
        chans, wchans = [], []
        for lane in lanes:
            if lane.state is IDLE:
                if lane.out or lane.chan < 0 or lane.wchan < 0 or lane.reader.pending:
                    # A request still draining, a channel gone, or part of a frame
                    # held (C reads only what comes now): the pure path runs this batch.
                    return None
                chans.append(lane.chan)
                wchans.append(lane.wchan)
            else:
                chans.append(-1)
                wchans.append(-1)
        try:
            packed = self.packer.pack(actions)
        except (TypeError, ValueError, OverflowError):
            return None  # the pure path packs each lane's action and says which failed
        flags = bytearray(len(lanes))
        for index in resets:
            flags[index] = 1
        seq = op.seq
        fastpath = self.fastpath
        budget = self.budget
        deadline = time.monotonic() + self.config.step_timeout
        batch = fastpath.step(
            self.reactor.epoll.fileno(),
            chans,
            wchans,
            packed,
            seq,
            bytes(flags),
            deadline,
            native.caps(self.config.env_limits),
            budget.room(),
        )
        if batch is None:
            return None  # C would not split the actions; nothing was written
        budget.add(batch.held)  # the replies C holds count against the pool's budget until the REPLY
        not_sent = [index for index, fd in enumerate(chans) if fd < 0]
        overrides: dict[int, tuple] = {}

        def put(i: int, lane_obs, reward, lane_terminated, lane_truncated, info) -> None:
            overrides[i] = (wire.pack(lane_obs), reward, lane_terminated, lane_truncated, wire.pack(info))

        stragglers = self._finish(op, batch.rest, resets, deadline, not_sent, put)
        budget.free(batch.held)
        return wire.Raw(batch.compose(overrides, wire.pack(stragglers)))

    def _finish(self, op: Op, rest, resets: set, deadline: float, not_sent: list, put: Callable[..., None]) -> list:
        """The lanes a native step did not complete (`rest`, _fastpath.step's: [lane, kind, value])
        handled as the pure path would (BUSY, what C read fed to Lifecycle.take, _wait until the
        deadline, stragglers), then `put` (see _gather) for each of them and each lane of
        `not_sent`; the stragglers. op ends here (it began before the request was written)."""
        lifecycle = self.lifecycle
        lanes = lifecycle.lanes
        fastpath = self.fastpath
        immediate = {index: _not_sent(lanes[index]) for index in not_sent}
        for index, kind, value in rest:
            lane = lanes[index]
            if lane.state is not IDLE:  # lent (direct_rest), it died meanwhile: its cause says how
                immediate[index] = _not_sent(lane)
                continue
            lane.seq = op.seq
            lane.expect = wire.RESET_DONE if index in resets else wire.STEPPED
            lane.to(BUSY)
            op.waiting.add(index)
            if lane.chan < 0:
                continue
            if kind == fastpath.UNUSUAL:  # not a reply C vouches for: Python decodes it and names what is wrong
                lifecycle.take(lane, value)
            elif kind == fastpath.EOF:
                self.reactor.close_channel(lane)
            elif kind == fastpath.SHORT_WRITE_KIND:  # the rest is flushed by the event loop, as Reactor.write does
                lane.out = value
                self.reactor.watch_out(lane, True)
        stragglers: list[int] = []
        if op.waiting:
            self._wait(op, deadline)
            stragglers.extend(op.waiting)
            for index in op.waiting:
                lifecycle.straggling(lanes[index])
        lifecycle.end()
        if not_sent or rest:
            self._gather(op, not_sent + [item[0] for item in rest], stragglers, immediate, put)
        return stragglers

    # -- the direct step (docs/native-step.md#the-direct-step) -----------------------------------

    def lendable(self) -> tuple[str, bool]:
        """('', _) when this pool's lanes may be lent to its client for direct steps, else (why not,
        whether that lasts as long as the pool: else a reset may change it)."""
        lifecycle = self.lifecycle
        if self.fastpath is None:
            return "the worker runs the pure-Python step path", True
        if self.config.gated or lifecycle.meter is not None or lifecycle.freezing:
            return "the pool is gated (serialize_measurement), has a cpu_budget or freezes its envs", True
        if len(lifecycle.lanes) > LEND_MAX:
            return f"the pool has more than {LEND_MAX} sandboxes", True
        for lane in lifecycle.lanes:
            if lane.state is not IDLE or lane.chan < 0 or lane.wchan < 0 or lane.out or lane.reader.pending:
                return f"lane {lane.index} is {lane.state.shown}, not idle", False
        return "", False

    def lend(self) -> tuple[dict, list[int]]:
        """Lend every lane's channel to the client, which then steps the pool itself with the same C
        step (_fastpath.step) until its next call: (what it needs, the fds to attach: each lane's
        read and write end). The worker stops reading the channels until then (unlend) and keeps
        everything else: deaths, logs, cgroups, kills. Sequence numbers seq .. seq + seqs - 1 are
        the client's. When the pool cannot lend (lendable()): ({"refused": why, "lasting": bool}, [])."""
        why, lasting = self.lendable()
        if why:
            return {"refused": why, "lasting": lasting}, []
        lifecycle = self.lifecycle
        self.lent_seqs = lifecycle.reserve_seqs(LENT_SEQS)
        fds: list[int] = []
        for lane in lifecycle.lanes:
            self.reactor.unwatch(lane.chan)
            fds += (lane.chan, lane.wchan)
        self.lent = True
        info = {
            "seq": self.lent_seqs.start,
            "seqs": LENT_SEQS,
            "caps": list(native.caps(self.config.env_limits)),
            "room": int(self.budget.room()),
            "step_timeout": float(self.config.step_timeout),
        }
        return info, fds

    def unlend(self) -> None:
        """The lanes back from the client (at its next call): their channels are read again, and
        whatever an env wrote since its last reply is handled as any unasked frame is (killed)."""
        for lane in self.lifecycle.lanes:
            if lane.chan >= 0:
                self.lifecycle.watch(lane)
        self.lent = False

    def direct_rest(self, seq, deadline, rest) -> list:
        """The lanes a direct step of the client could not finish in C: `rest` as _fastpath.step
        gave it ([lane, kind, the bytes read / the unsent part of the frame / None]) for request
        `seq` (one of the lent ones), until `deadline` (time.monotonic() of this host). Each is
        handled exactly as _step_native handles its own rest (lifecycle.take, the deadline,
        stragglers, deaths); the result is [[lane, obs bytes, reward, terminated, truncated, info
        bytes], ...] for Batch.compose, and the stragglers."""
        lifecycle = self.lifecycle
        lanes = lifecycle.lanes
        fastpath = self.fastpath
        n = len(lanes)
        kinds = (
            set()
            if fastpath is None
            else {
                (fastpath.PENDING, type(None)),
                (fastpath.UNUSUAL, bytes),
                (fastpath.EOF, bytes),
                (fastpath.SHORT_WRITE_KIND, bytes),
            }
        )
        if (
            fastpath is None
            or type(seq) is not int
            or seq not in self.lent_seqs
            or type(deadline) is not float
            or type(rest) is not list
            or len(rest) > n
            or not all(
                type(item) is list
                and len(item) == 3
                and type(item[0]) is int
                and 0 <= item[0] < n
                and (item[1], type(item[2])) in kinds
                for item in rest
            )
            or len({item[0] for item in rest}) != len(rest)
        ):
            raise ValueError("direct_rest(seq, deadline, [[lane, kind, bytes or None], ...]) as a direct step makes it")
        op = Op(seq)
        lifecycle.begin(op)
        overrides: list = []

        def put(i: int, lane_obs, reward, lane_terminated, lane_truncated, info) -> None:
            overrides.append([i, wire.pack(lane_obs), reward, lane_terminated, lane_truncated, wire.pack(info)])

        stragglers = self._finish(op, rest, set(), deadline, [], put)
        return [overrides, stragglers]

    def reset(self, indices, seeds, hard: bool, options=None, scrub: bool = False) -> list:
        """Reset the lanes in `indices` (respawned first when hard, dead or
        busy): [indices, obs, infos]. `scrub` (and not hard): each live lane's
        sandbox kills every process but its server and empties its workspace
        before the env's reset (runtime/scrub.py); counted from outside after."""
        lifecycle = self.lifecycle
        indices = lifecycle.check_lanes(indices)
        if seeds is not None and (not isinstance(seeds, list) or len(seeds) != len(indices)):
            raise ValueError("reset() needs one seed per selected env")
        self.stepping.pump()
        for index in indices:
            self.stepping.refuse_outstanding(index, "reset")
        if not isinstance(scrub, bool):
            raise ValueError(f"reset() scrub must be a bool, not {scrub!r}")
        lanes = [lifecycle.lanes[i] for i in indices]
        fresh = {lane.index for lane in lanes if hard or lane.state is not IDLE}  # respawned: nothing to scrub
        lifecycle.respawn(lanes, hard)
        seq = lifecycle.next_seq()
        op = Op(seq)
        lifecycle.begin(op)
        scrubbing = lifecycle.scrub_field(scrub)
        for lane, seed in zip(lanes, seeds or [None] * len(lanes)):
            if lane.state is not IDLE:
                continue
            lane.seq = seq
            lane.to(BUSY)
            lane.expect = wire.RESET_DONE
            op.waiting.add(lane.index)
            if lifecycle.freezing:
                lifecycle.thaw(lane)
            frame = lifecycle.reset_frame(lane, seq, seed, options, None if lane.index in fresh else scrubbing)
            self.reactor.write(lane, wire.encode(frame))
        self._wait(op, time.monotonic() + self.config.step_timeout)
        lifecycle.end()
        for index in op.waiting:
            lifecycle.straggling(lifecycle.lanes[index])
        obs, infos = [], []
        for lane in lanes:
            if not lane.state.due:
                self.budget.unhold(lane)
            result = op.results.get(lane.index)
            if result and result[0] == wire.RESET_DONE:
                obs.append(result[2])
                infos.append(result[3])
                continue
            obs.append(None)
            if result:
                infos.append({"error": result[4] or result[3]})
            elif lane.index in op.waiting:
                infos.append(
                    {"straggler": True, "error": f"missed the reset deadline of {self.config.step_timeout:g} s"}
                )
            else:
                infos.append({"error": f"could not be reset: {lane.cause}", "log": tail(lane.log)})
        return [indices, obs, infos]

    def render(self, indices) -> list:
        """One frame per lane in `indices` (None for a lane that has none)."""
        indices = self.lifecycle.check_lanes(indices)
        frames, errors = self._ask(indices, wire.RENDERED, lambda seq, k: wire.encode([wire.RENDER, seq]), "render")
        return [frames, {index: why for index, (_, why) in errors.items()}]

    def attr(self, indices, op, name, args, kwargs, values=None) -> list:
        """call / get_attr / set_attr on the lanes in `indices`: one ATTR
        request each, as render(). `values` (set): one per lane, for args."""
        indices = self.lifecycle.check_lanes(indices)
        if (
            op not in ("call", "get", "set")
            or not isinstance(name, str)
            or not isinstance(args, list)
            or not isinstance(kwargs, dict)
            or (values is not None and (not isinstance(values, list) or len(values) != len(indices)))
        ):
            raise ValueError("attr() takes an op (call, get, set), a name, args, kwargs and one value per lane")
        same: dict[int, bytes] = {}  # [0]: the one frame, once encoded

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
        lifecycle = self.lifecycle
        seq = lifecycle.next_seq()
        op = Op(seq)
        lifecycle.begin(op)
        for k, index in enumerate(indices):
            lane = lifecycle.lanes[index]
            if lane.state is IDLE or lane.state is FINISHED:  # an env with a result held for recv may answer too
                if lifecycle.meter is not None:
                    lifecycle.meter.carry(lane, seq)  # a step's CPU window goes on through it
                lane.seq = seq
                lane.on("request")
                lane.expect = expect
                op.waiting.add(index)
                if lifecycle.freezing:
                    lifecycle.thaw(lane)
                self.reactor.write(lane, frame(seq, k))
        self._wait(op, time.monotonic() + self.config.step_timeout)
        lifecycle.end()
        for index in op.waiting:
            lifecycle.straggling(lifecycle.lanes[index])
        values: list = []
        errors: dict[int, tuple[str, str]] = {}
        for index in indices:
            lane = lifecycle.lanes[index]
            if not lane.state.due:
                self.budget.unhold(lane)
            result = op.results.get(index)
            if result and result[0] == expect:
                values.append(result[2])
                continue
            values.append(None)
            if result:  # FAILED: the env's exception, with its traceback
                errors[index] = (result[3], result[4] or result[3])
            elif index in op.waiting:
                errors[index] = ("", f"missed the {what} deadline of {self.config.step_timeout:g} s")
            else:
                errors[index] = ("", f"env is {lane.state.process} ({lane.cause})")
        return values, errors

    def memory(self) -> dict:
        """Each env's memory charge and the pool's shared pages (where the figures come from: server.py)."""
        shared = 0
        lifecycle = self.lifecycle
        cgroups, spawner = lifecycle.cgroups, lifecycle.spawner
        if cgroups is not None:
            per_env = cgroups.env_usages([not e.state.dead for e in lifecycle.lanes])
            if spawner.kind == "template":
                shared = cgroups.usage(TEMPLATE_LANE)
        else:
            per_env = []
            for lane in lifecycle.lanes:  # psutil over every sandbox's tree: seconds for thousands
                per_env.append(_pss_tree(lane.pid) if lane.pid > 0 else 0)
                self.reactor.beat()
            if isinstance(spawner, TemplateSpawner) and spawner.alive():
                shared = _pss_tree(spawner.bwrap_pid)
        return {"per_env": per_env, "shared": shared}

    def log(self, index: int) -> str:
        """The tail of env `index`'s output (env.py's import included), after the
        template's in template mode, when it printed anything: the warm-up
        probe's (env.py run once), or env.py's import in a trusted template."""
        lane = self.lifecycle.lanes[index]
        self.lifecycle.drain_log(lane)
        text = bytes(lane.log).decode("utf-8", "replace")
        spawner = self.lifecycle.spawner
        if isinstance(spawner, TemplateSpawner) and spawner.log:
            shared = bytes(spawner.log).decode("utf-8", "replace")
            text = (
                f"--- the template's output (the warm-up probe; env.py's import if trusted) ---\n{shared}"
                f"--- env {index} ---\n{text}"
            )
        return text

    def states(self) -> list:
        """Each lane's process state (lanes.State.process): starting, idle, busy or dead."""
        return [e.state.process for e in self.lifecycle.lanes]

    def pids(self) -> list:
        """Each lane's host pid (-1 when dead)."""
        return [e.pid for e in self.lifecycle.lanes]


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


# Lanes a client may hold at once (two fds each: one SCM_RIGHTS message carries at most 253).
LEND_MAX = 64
# Sequence numbers a lending leaves to the client: more than a pool steps in its life.
LENT_SEQS = 1 << 40


def _not_sent(lane: Lane) -> str:
    """Why a step sent nothing to a lane that was not idle, for _lane_result:
    "straggler" (still busy with a request it has not answered) or "dead"."""
    return "straggler" if lane.state.due else "dead"
