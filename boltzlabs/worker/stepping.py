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

A mixin of server.Worker; it uses the reactor's _poll/_write and the
lifecycle's _kill and _respawn (requests.py).
"""

from __future__ import annotations

import array
import collections
import time

from boltzlabs import wire
from boltzlabs.worker.lanes import IDLE, IN_FLIGHT, Lane


class Stepping:
    """send/recv and the gate (a mixin of server.Worker)."""

    def _init_stepping(self) -> None:
        # Lanes IN_FLIGHT, lanes finished in the order they finished (recv
        # hands out the first ones), and the gate's queue.
        self.flying: set[int] = set()
        self.finished: collections.deque[int] = collections.deque()
        self.gate_queue: collections.deque[int] = collections.deque()
        self.gate_holder = -1
        # (deadline, lane, seq) in the order set. Every deadline is "now +
        # step_timeout" when set (at send, or at GO for a gated lane), so the
        # deque is sorted and the earliest is at its head: O(1) per poll, not
        # O(lanes in flight). Entries of lanes that finished are dropped lazily.
        self.deadlines: collections.deque[tuple] = collections.deque()

    def send(self, actions: list, indices: list, resets=None) -> list:
        """Hand actions to the lanes in `indices` (resets: lanes reset instead);
        returns at once. Everything is checked before the first byte is written."""
        if not isinstance(indices, list) or len(set(indices)) != len(indices):
            raise ValueError("send() env_ids must be distinct env indices")
        indices = self._check_lanes(indices)
        if not isinstance(actions, list) or len(actions) != len(indices):
            raise ValueError(f"send() needs one action per env id ({len(indices)}); "
                             f"got {len(actions) if isinstance(actions, list) else type(actions).__name__}")
        resets = set(self._check_lanes(resets or []))
        if not resets <= set(indices):
            raise ValueError("send() can only autoreset lanes it sends to")
        self._pump()
        for index in indices:
            self._refuse_outstanding(index, "send to")
        if resets:
            self._respawn([self.envs[i] for i in sorted(resets)], hard=False)
        seq = self._next_seq()
        now = time.monotonic()
        pack = self._packer.pack
        header = wire.HEADER.pack
        gated = self.gated
        deadline = now + self.step_timeout
        # Hot path: one frame per lane, written straight to its channel.
        for index, action in zip(indices, actions):
            env = self.envs[index]
            if env.state is not IDLE:  # dead, or a straggler still busy: a failure result at once, as in step()
                info = _unavailable(env)
                env.on("refuse")
                self._finish(env, (None, 0.0, False, True, info))
                continue
            env.to(IN_FLIGHT)
            self.flying.add(index)
            if index in resets:
                body = pack([wire.RESET, seq, None, None])
                env.expect = wire.RESET_DONE
                if self.freezing:
                    self._thaw(env)  # resets are not gated
                env.deadline = deadline
                self.deadlines.append((deadline, index, seq))
            else:
                body = pack([wire.STEP, seq, action, gated])
                env.expect = wire.STEPPED
                if gated:
                    env.deadline = float("inf")  # until its turn at the gate
                    self.gate_queue.append(index)
                else:
                    env.deadline = deadline
                    self.deadlines.append((deadline, index, seq))
            env.seq = seq
            self._write(env, header(len(body)) + body)
        self._advance_gate()
        return [len(self.flying), len(self.finished)]

    def recv(self, batch_size, timeout) -> list:
        """The first `batch_size` lanes to finish (fewer if `timeout` passes):
        [indices, obs, rewards f64 bytes, terminated, truncated, infos, stragglers,
        wait_ms, queued_ms]."""
        self._pump()
        can_come = len(self.flying) + len(self.finished)
        if batch_size is None:
            batch_size = can_come
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 0:
            raise ValueError(f"recv() batch_size must be a whole number, not {batch_size!r}")
        if batch_size > can_come:
            raise ValueError(f"recv(batch_size={batch_size}) would wait forever: only {can_come} result(s) can come "
                             f"({len(self.flying)} env(s) in flight, {len(self.finished)} finished and not received)")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0):
            raise ValueError(f"recv() timeout must be a number of seconds >= 0 or None, not {timeout!r}")
        started = time.monotonic()
        give_up = float("inf") if timeout is None else started + timeout
        while len(self.finished) < batch_size:
            now = time.monotonic()
            if now >= give_up:
                break
            wake = min(give_up, self._next_deadline())
            self._poll(max(0.0, min(wake - now, 1.0)))
            self._expire()
        wait_ms = (time.monotonic() - started) * 1000.0
        k = min(batch_size, len(self.finished))
        rewards = array.array("d", bytes(8 * k))
        terminated = bytearray(k)
        truncated = bytearray(k)
        indices, obs, infos, stragglers = [0] * k, [None] * k, [None] * k, []
        now = time.monotonic()
        queued = 0.0
        released = 0
        # Hot path: the results were shaped when they arrived; here they are only copied out.
        for j in range(k):
            index = self.finished.popleft()
            env = self.envs[index]
            if not env.state.due:  # its reply came (a straggler's is still to come, or not)
                released += env.held
                env.held = 0
            indices[j] = index
            obs[j], rewards[j], terminated[j], truncated[j], infos[j] = env.result
            if infos[j].get("straggler") is True and "error" in infos[j] and obs[j] is None:
                stragglers.append(index)
            queued += now - env.done_at
            env.on("recv")
            env.result = None
        self.held -= released
        queued_ms = queued * 1000.0 / k if k else 0.0
        return [indices, obs, rewards.tobytes(), bytes(terminated), bytes(truncated), infos, stragglers,
                wait_ms, queued_ms]

    def lane_states(self) -> list:
        """Each lane's one state, by its client name (lanes.State.shown): idle,
        in_flight, finished (a result waiting for recv), straggler (busy past
        its deadline, result already given), dead."""
        self._pump()
        return [env.state.shown for env in self.envs]

    def _refuse_outstanding(self, index: int, what: str) -> None:
        env = self.envs[index]
        if env.state is IN_FLIGHT:
            raise ValueError(f"cannot {what} env {index}: it is in flight (an action was sent and its result has "
                             "not been received); recv it first")
        if env.state.result_held:
            raise ValueError(f"cannot {what} env {index}: it has finished and its result has not been received; "
                             "recv it first")

    def _refuse_async(self, what: str) -> None:
        if self.flying or self.finished:
            raise ValueError(f"{what} while {len(self.flying)} env(s) are in flight and {len(self.finished)} "
                             "finished but not received: recv them first (send/recv and step() do not mix)")

    def _finish(self, env: Lane, result: tuple) -> None:
        """env's async action has its one result (its state says so already): hold it for recv."""
        env.result = result
        env.done_at = time.monotonic()
        self.flying.discard(env.index)
        self.finished.append(env.index)
        if env.index == self.gate_holder:
            self.gate_holder = -1
            self._thaw_template()  # the turn is over
            self._advance_gate()

    def _next_deadline(self) -> float:
        """The earliest deadline of an IN_FLIGHT lane (inf when none)."""
        deadlines = self.deadlines
        while deadlines:
            deadline, index, seq = deadlines[0]
            env = self.envs[index]
            if env.state is IN_FLIGHT and env.seq == seq and env.deadline == deadline:
                return deadline
            deadlines.popleft()  # finished since
        return float("inf")

    def _expire(self) -> None:
        """Lanes IN_FLIGHT past their deadline become straggler results."""
        now = time.monotonic()
        while self._next_deadline() <= now:
            index = self.deadlines.popleft()[1]
            env = self.envs[index]
            if index == self.gate_holder:
                # The gate promises one env's code at a time: kill the holder before the next one goes.
                self._kill(env, f"missed the step deadline of {self.step_timeout:g} s while holding the "
                                "serialize_measurement gate, and was killed")
                env.result = (None, 0.0, False, True, {"straggler": True, "error": env.cause})
                continue
            env.on("deadline")
            self._finish(env, (None, 0.0, False, True,
                               {"straggler": True, "error": f"missed the step deadline of {self.step_timeout:g} s"}))
            self._straggling(env)

    def _advance_gate(self) -> None:
        """Give the gate to the next queued lane when nobody holds it."""
        while self.gate_holder < 0 and self.gate_queue:
            index = self.gate_queue.popleft()
            env = self.envs[index]
            if env.state is not IN_FLIGHT:
                continue  # died while queued: already finished
            if self.freezing:
                self._all_frozen()
                if env.state is not IN_FLIGHT:
                    continue
                self._thaw(env)
            self.gate_holder = index
            env.deadline = time.monotonic() + self.step_timeout
            self.deadlines.append((env.deadline, index, env.seq))
            self._write(env, wire.encode([wire.GO, env.seq]))

    def _pump(self) -> None:
        """Take whatever arrived and apply deadlines, without waiting."""
        self._poll(0)
        self._expire()


def outcome(result, cause: str) -> tuple:
    """An async lane's result as (obs, reward, terminated, truncated, info);
    failures as step() reports them: truncated, reward 0, info["error"]."""
    if result is None:
        return (None, 0.0, False, True, {"error": cause})
    code = result[0]
    if code == wire.STEPPED:
        return (result[2], float(result[3]), result[4], result[5], result[6])
    if code == wire.RESET_DONE:  # an autoreset lane: reward 0, not done
        return (result[2], 0.0, False, False, result[3])
    return (None, 0.0, False, True, {"error": result[4] or result[3]})  # FAILED, with the traceback


def _unavailable(env: Lane) -> dict:
    if env.state.dead:
        return {"error": f"env is dead ({env.cause}); reset it to respawn"}
    return {"straggler": True, "error": "still busy with an earlier step it has not answered; "
                                        "reset it (it will be killed and respawned)"}
