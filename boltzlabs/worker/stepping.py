"""Asynchronous stepping: send, recv, and the serialize_measurement gate.

    client --CALL send(actions, env_ids)--> send: one STEP frame per lane, returns at once (lanes IN_FLIGHT)
    env replies, deadlines, deaths (reactor.py, lifecycle.py) --> _finish: the result held (lane FINISHED*)
    client --CALL recv(batch_size)--> recv: the first batch_size lanes to finish, in that order

send() writes one frame per lane and returns; the lane is IN_FLIGHT with a
deadline counted from its send. Replies are taken by the reactor whenever the
event loop runs: inside any call, and between calls too (the worker idles in
epoll, see server.Worker._next_request), so a result waits in the worker, not
in a socket. A lane whose deadline passes, or that dies, is finished with a
failure result, exactly as step() reports it. recv() hands out finished
lanes in the order they finished.

serialize_measurement: the STEP frames of a send carry gated=True and the
lanes queue; the gate goes (GO) to one IN_FLIGHT lane at a time, the next as
soon as the holder answers or dies, and the holder's deadline counts from
its GO (as in step()). A holder that overruns is killed, so the gate holds.

One Stepping per pool, made by server.Worker.open; it uses the reactor
(write) and the lifecycle (poll, kill, respawn, the freezer), which hands it
every async lane's reply or death (Lifecycle.deliver_to: take).
"""

from __future__ import annotations

import array
import collections
import time

import msgpack

from boltzlabs import wire
from boltzlabs.worker.config import PoolConfig
from boltzlabs.worker.lanes import IDLE, IN_FLIGHT, Lane, failure
from boltzlabs.worker.lifecycle import Lifecycle
from boltzlabs.worker.reactor import Budget, Reactor


class Stepping:
    """send/recv and the gate."""

    def __init__(
        self, reactor: Reactor, lifecycle: Lifecycle, budget: Budget, config: PoolConfig, packer: msgpack.Packer
    ):
        self.reactor: Reactor = reactor  # where frames to the lanes are written
        self.lifecycle: Lifecycle = lifecycle  # the lanes: poll, kill, respawn, the freezer
        self.budget: Budget = budget  # a result received leaves the pool's byte count
        self.config: PoolConfig = config  # step_timeout, gated
        self.packer: msgpack.Packer = packer  # the worker's one Packer: each lane's action frame
        # Lanes IN_FLIGHT, lanes finished in the order they finished (recv
        # hands out the first ones), and the gate's queue.
        self.flying: set[int] = set()
        self.finished: collections.deque[int] = collections.deque()
        self.gate_queue: collections.deque[int] = collections.deque()
        self.gate_holder: int = -1  # the lane holding the serialize_measurement gate, -1 for none
        # (deadline, lane, seq) in the order set. Every deadline is "now +
        # step_timeout" when set (at send, or at GO for a gated lane), so the
        # deque is sorted and the earliest is at its head: O(1) per poll, not
        # O(lanes in flight). Entries of lanes that finished are dropped lazily.
        self.deadlines: collections.deque[tuple[float, int, int]] = collections.deque()
        lifecycle.deliver_to(self.take)

    def send(self, actions: list, indices: list, resets=None, how=None) -> list:
        """Hand actions to the lanes in `indices` (resets: lanes reset instead);
        returns at once. Everything is checked before the first byte is written.
        `how`, for the resets: [seeds (one per lane of `resets`, in its order) or
        None, options, scrub], as reset() takes them; None: unseeded, no options."""
        if not isinstance(indices, list) or len(set(indices)) != len(indices):
            raise ValueError("send() env_ids must be distinct env indices")
        lifecycle = self.lifecycle
        lanes = lifecycle.lanes
        indices = lifecycle.check_lanes(indices)
        if not isinstance(actions, list) or len(actions) != len(indices):
            raise ValueError(
                f"send() needs one action per env id ({len(indices)}); "
                f"got {len(actions) if isinstance(actions, list) else type(actions).__name__}"
            )
        reset_list = lifecycle.check_lanes(resets or [])
        resets = set(reset_list)
        if not resets <= set(indices):
            raise ValueError("send() can only autoreset lanes it sends to")
        seeds, options, scrub = _reset_how(how, len(reset_list))
        self.pump()
        for index in indices:
            self.refuse_outstanding(index, "send to")
        scrubbing = lifecycle.scrub_field(scrub)
        if resets:
            seed_of = dict(zip(reset_list, seeds or [None] * len(reset_list)))
            fresh = {i for i in resets if lanes[i].state is not IDLE}  # respawned now: nothing to scrub
            lifecycle.respawn([lanes[i] for i in sorted(resets)], hard=False)
        seq = lifecycle.next_seq()
        now = time.monotonic()
        pack = self.packer.pack
        header = wire.HEADER.pack
        gated = self.config.gated
        freezing = lifecycle.freezing
        write = self.reactor.write
        deadline = now + self.config.step_timeout
        meter = lifecycle.meter
        # Hot path: one frame per lane, written straight to its channel.
        for index, action in zip(indices, actions):
            lane = lanes[index]
            if meter is not None and lane.state is IDLE:
                # Its step's CPU window opens (cpu_budget.py); a lane over the budget of its
                # last one is killed instead, and refused below.
                meter.open(lane, seq)
            if lane.state is not IDLE:  # dead, or a straggler still busy: a failure result at once, as in step()
                info = _unavailable(lane)
                lane.on("refuse")
                self._finish(lane, (None, 0.0, False, True, info))
                continue
            lane.to(IN_FLIGHT)
            self.flying.add(index)
            if index in resets:
                body = pack(
                    lifecycle.reset_frame(lane, seq, seed_of[index], options, None if index in fresh else scrubbing)
                )
                lane.expect = wire.RESET_DONE
                if freezing:
                    lifecycle.thaw(lane)  # resets are not gated
                lane.deadline = deadline
                self.deadlines.append((deadline, index, seq))
            else:
                body = pack([wire.STEP, seq, action, gated])
                lane.expect = wire.STEPPED
                if gated:
                    lane.deadline = float("inf")  # until its turn at the gate
                    self.gate_queue.append(index)
                else:
                    lane.deadline = deadline
                    self.deadlines.append((deadline, index, seq))
            lane.seq = seq
            write(lane, header(len(body)) + body)
        self._advance_gate()
        return [len(self.flying), len(self.finished)]

    def recv(self, batch_size, timeout) -> list:
        """The first `batch_size` lanes to finish (fewer if `timeout` passes):
        [indices, obs, rewards f64 bytes, terminated, truncated, infos, stragglers,
        wait_ms, queued_ms]."""
        self.pump()
        can_come = len(self.flying) + len(self.finished)
        if batch_size is None:
            batch_size = can_come
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 0:
            raise ValueError(f"recv() batch_size must be a whole number, not {batch_size!r}")
        if batch_size > can_come:
            raise ValueError(
                f"recv(batch_size={batch_size}) would wait forever: only {can_come} result(s) can come "
                f"({len(self.flying)} env(s) in flight, {len(self.finished)} finished and not received)"
            )
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0):
            raise ValueError(f"recv() timeout must be a number of seconds >= 0 or None, not {timeout!r}")
        started = time.monotonic()
        give_up = float("inf") if timeout is None else started + timeout
        while len(self.finished) < batch_size:
            now = time.monotonic()
            if now >= give_up:
                break
            wake = min(give_up, self.next_deadline())
            self.lifecycle.poll(max(0.0, min(wake - now, 1.0)))
            self.expire()
        wait_ms = (time.monotonic() - started) * 1000.0
        k = min(batch_size, len(self.finished))
        rewards = array.array("d", bytes(8 * k))
        terminated = bytearray(k)
        truncated = bytearray(k)
        indices, obs, stragglers = [0] * k, [None] * k, []
        infos: list[dict] = [{}] * k
        now = time.monotonic()
        queued = 0.0
        released = 0
        # Hot path: the results were shaped when they arrived; here they are only copied out.
        lanes = self.lifecycle.lanes
        for j in range(k):
            index = self.finished.popleft()
            lane = lanes[index]
            if not lane.state.due:  # its reply came (a straggler's is still to come, or not)
                released += lane.held
                lane.held = 0
            indices[j] = index
            result = lane.result
            assert result is not None, "every finished lane holds its result (_finish)"
            obs[j], rewards[j], terminated[j], truncated[j], infos[j] = result
            if infos[j].get("straggler") is True and "error" in infos[j] and obs[j] is None:
                stragglers.append(index)
            queued += now - lane.done_at
            lane.on("recv")
            lane.result = None
        self.budget.free(released)
        queued_ms = queued * 1000.0 / k if k else 0.0
        return [
            indices,
            obs,
            rewards.tobytes(),
            bytes(terminated),
            bytes(truncated),
            infos,
            stragglers,
            wait_ms,
            queued_ms,
        ]

    def lane_states(self) -> list:
        """Each lane's one state, by its client name (lanes.State.shown): idle,
        in_flight, finished (a result waiting for recv), straggler (busy past
        its deadline, result already given), dead."""
        self.pump()
        return [lane.state.shown for lane in self.lifecycle.lanes]

    def refuse_outstanding(self, index: int, what: str) -> None:
        """ValueError if lane `index` has an async action or result outstanding (for a sync request)."""
        lane = self.lifecycle.lanes[index]
        if lane.state is IN_FLIGHT:
            raise ValueError(
                f"cannot {what} env {index}: it is in flight (an action was sent and its result has "
                "not been received); recv it first"
            )
        if lane.state.result_held:
            raise ValueError(
                f"cannot {what} env {index}: it has finished and its result has not been received; recv it first"
            )

    def refuse_async(self, what: str) -> None:
        """ValueError while any async action or result is outstanding (step() does not mix with them)."""
        if self.flying or self.finished:
            raise ValueError(
                f"{what} while {len(self.flying)} env(s) are in flight and {len(self.finished)} "
                "finished but not received: recv them first (send/recv and step() do not mix)"
            )

    def take(self, lane: Lane, reply: list | None, cause: str) -> None:
        """env's async action has its reply (None: it died of `cause`): its result, held for recv."""
        self._finish(lane, outcome(reply, cause, lane))

    def _finish(self, lane: Lane, result: tuple) -> None:
        """env's async action has its one result (its state says so already): hold it for recv."""
        lane.result = result
        lane.done_at = time.monotonic()
        self.flying.discard(lane.index)
        self.finished.append(lane.index)
        if lane.index == self.gate_holder:
            self.gate_holder = -1
            self.lifecycle.thaw_template()  # the turn is over
            self._advance_gate()

    def next_deadline(self) -> float:
        """The earliest deadline of an IN_FLIGHT lane (inf when none)."""
        deadlines = self.deadlines
        lanes = self.lifecycle.lanes
        while deadlines:
            deadline, index, seq = deadlines[0]
            lane = lanes[index]
            if lane.state is IN_FLIGHT and lane.seq == seq and lane.deadline == deadline:
                return deadline
            deadlines.popleft()  # finished since
        return float("inf")

    def expire(self) -> None:
        """Lanes IN_FLIGHT past their deadline become straggler results."""
        now = time.monotonic()
        lifecycle = self.lifecycle
        step_timeout = self.config.step_timeout
        while self.next_deadline() <= now:
            index = self.deadlines.popleft()[1]
            lane = lifecycle.lanes[index]
            if index == self.gate_holder:
                # The gate promises one env's code at a time: kill the holder before the next one goes.
                lifecycle.kill(
                    lane,
                    f"missed the step deadline of {step_timeout:g} s while holding the "
                    "serialize_measurement gate, and was killed",
                )
                lane.result = (None, 0.0, False, True, {"straggler": True, "error": lane.cause})
                continue
            lane.on("deadline")
            self._finish(
                lane,
                (
                    None,
                    0.0,
                    False,
                    True,
                    {"straggler": True, "error": f"missed the step deadline of {step_timeout:g} s"},
                ),
            )
            lifecycle.straggling(lane)

    def _advance_gate(self) -> None:
        """Give the gate to the next queued lane when nobody holds it."""
        lifecycle = self.lifecycle
        while self.gate_holder < 0 and self.gate_queue:
            index = self.gate_queue.popleft()
            lane = lifecycle.lanes[index]
            if lane.state is not IN_FLIGHT:
                continue  # died while queued: already finished
            if lifecycle.freezing:
                lifecycle.all_frozen()
                if lane.state is not IN_FLIGHT:
                    continue
                lifecycle.thaw(lane)
            self.gate_holder = index
            lane.deadline = time.monotonic() + self.config.step_timeout
            self.deadlines.append((lane.deadline, index, lane.seq))
            self.reactor.write(lane, wire.encode([wire.GO, lane.seq]))

    def pump(self) -> None:
        """Take whatever arrived and apply deadlines, without waiting."""
        self.lifecycle.poll(0)
        self.expire()


def outcome(result, cause: str, lane: Lane) -> tuple:
    """An async lane's result as (obs, reward, terminated, truncated, info);
    failures as step() reports them: truncated, reward 0, info["error"]
    (and info["cpu_budget"] for `lane` killed over it: lanes.failure)."""
    if result is None:
        return (None, 0.0, False, True, failure(lane, cause))
    code = result[0]
    if code == wire.STEPPED:
        return (result[2], float(result[3]), result[4], result[5], result[6])
    if code == wire.RESET_DONE:  # an autoreset lane: reward 0, not done
        return (result[2], 0.0, False, False, result[3])
    return (None, 0.0, False, True, {"error": result[4] or result[3]})  # FAILED, with the traceback


def _reset_how(how, count: int) -> tuple:
    """send()'s `how` checked: (seeds or None, options, scrub). A remote client's word, so
    nothing is taken on trust: seeds are whole numbers or None, one per reset lane."""
    if how is None:
        return None, None, False
    if not isinstance(how, list) or len(how) != 3:
        raise ValueError("send() how must be [seeds, options, scrub]")
    seeds, options, scrub = how
    if not isinstance(scrub, bool):
        raise ValueError(f"send() scrub must be a bool, not {scrub!r}")
    if seeds is not None:
        if not isinstance(seeds, list) or len(seeds) != count:
            raise ValueError("send() needs one seed per reset env")
        if any(s is not None and (type(s) is not int and not isinstance(s, list)) for s in seeds):
            raise ValueError("send() seeds must be whole numbers or None")
    return seeds, options, scrub


def _unavailable(lane: Lane) -> dict:
    if lane.state.dead:
        return failure(lane, f"env is dead ({lane.cause}); reset it to respawn")
    return {
        "straggler": True,
        "error": "still busy with an earlier step it has not answered; reset it (it will be killed and respawned)",
    }
