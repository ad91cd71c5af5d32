"""A lane of the pool (one env's sandbox) and the one state machine it follows.

    requests.py / stepping.py / reactor.py / lifecycle.py --lane.on(event)--> Lane.to(state)
                                                                              | checks TRANSITIONS
    lane_states() <-- State.shown      states() <-- State.process

Every change of a lane's state goes through `Lane.to`, which refuses a move
the table below does not declare (LaneStateError: a bug in the worker, never
the env's doing; it ends the worker with its traceback). The worker speaks in
EVENTS (a reply came, a deadline passed, the env died, recv took a result);
each maps the current state to the next one, so the same event means the same
thing wherever the worker handles it.

One enum holds both what the sandbox is doing (starting, idle, busy, dead)
and where an asynchronous action is (in flight, finished and held for recv):
a lane whose result is held may still owe a reply (a straggler's late one, or
a render's) or be dead, hence three FINISHED states that the client sees as
one "finished". Pure data: imports nothing of the worker's, runs nowhere but
in the worker process.
"""

from __future__ import annotations

import enum
from typing import Any

from boltzlabs import wire
from boltzlabs.errors import LaneStateError


class State(enum.Enum):
    """A lane's one state. `shown` is its name in the client's lane_states(),
    `process` in its states() (what the env process is doing)."""

    #               shown         process     a reply is due
    STARTING = ("starting", "starting", False)  # spawned, its handshake (HELLO) not read yet
    IDLE = ("idle", "idle", False)
    BUSY = ("busy", "busy", True)  # a step/reset/render sent within this call; never seen between calls
    STRAGGLER = ("straggler", "busy", True)  # missed its deadline, its result given; its one late reply is due
    IN_FLIGHT = ("in_flight", "busy", True)  # an async action sent (queued at the gate or running)
    FINISHED = ("finished", "idle", False)  # its async result is held for recv; the env is idle
    FINISHED_BUSY = ("finished", "busy", True)  # held for recv, and the env still owes a reply
    FINISHED_DEAD = ("finished", "dead", False)  # held for recv (a failure), and the env is dead
    DEAD = ("dead", "dead", False)

    # Set once the table below is built: the states it may move to, and where each event takes it.
    next: tuple[State, ...]
    after: dict[str, State]

    def __init__(self, shown: str, process: str, due: bool):
        self.shown = shown
        self.process = process
        self.due = due
        self.dead = process == "dead"
        self.result_held = shown == "finished"  # an async result waits for recv
        # Filled in below from TRANSITIONS and EVENTS, once every member exists.
        self.next: tuple[State, ...] = ()  # the states a lane may move to from this one
        self.after: dict[str, State] = {}  # event -> the state it leads to from this one

    # Members are singletons compared by identity: hash them so too (Enum's own
    # __hash__ is Python code, and these are looked up on every reply).
    __hash__ = object.__hash__


STARTING, IDLE, BUSY, STRAGGLER = State.STARTING, State.IDLE, State.BUSY, State.STRAGGLER
IN_FLIGHT, FINISHED, FINISHED_BUSY, FINISHED_DEAD, DEAD = (
    State.IN_FLIGHT,
    State.FINISHED,
    State.FINISHED_BUSY,
    State.FINISHED_DEAD,
    State.DEAD,
)

# The declared machine: from each state, the states a lane may move to.
TRANSITIONS: dict[State, tuple[State, ...]] = {
    DEAD: (STARTING, FINISHED_DEAD),  # spawned; or sent to, failing at once
    STARTING: (IDLE, DEAD),  # its handshake; or killed / died / timed out
    IDLE: (BUSY, IN_FLIGHT, DEAD),  # a request; an async action; died
    BUSY: (IDLE, STRAGGLER, DEAD),  # its reply; its deadline; died
    STRAGGLER: (IDLE, FINISHED_BUSY, DEAD),  # its late reply (dropped); sent to, failing at once; killed
    IN_FLIGHT: (FINISHED, FINISHED_BUSY, FINISHED_DEAD),  # its reply; its deadline; died
    FINISHED: (IDLE, FINISHED_BUSY, FINISHED_DEAD),  # received; rendered; died
    FINISHED_BUSY: (FINISHED, STRAGGLER, FINISHED_DEAD),  # its reply; received; killed
    FINISHED_DEAD: (DEAD,),  # received
}

# The worker's events and what each does from each state where it can happen.
# An event from any other state is a bug: LaneStateError.
EVENTS: dict[str, dict[State, State]] = {
    "spawn": {DEAD: STARTING},
    "hello": {STARTING: IDLE},
    "request": {
        IDLE: BUSY,
        FINISHED: FINISHED_BUSY,
    },  # step, reset; render and attr (also of a lane whose result is held)
    "send": {IDLE: IN_FLIGHT},
    "refuse": {DEAD: FINISHED_DEAD, STRAGGLER: FINISHED_BUSY},  # send to a lane that cannot take it
    "reply": {BUSY: IDLE, STRAGGLER: IDLE, IN_FLIGHT: FINISHED, FINISHED_BUSY: FINISHED},
    "deadline": {BUSY: STRAGGLER, IN_FLIGHT: FINISHED_BUSY},
    "die": {
        STARTING: DEAD,
        IDLE: DEAD,
        BUSY: DEAD,
        STRAGGLER: DEAD,
        IN_FLIGHT: FINISHED_DEAD,
        FINISHED: FINISHED_DEAD,
        FINISHED_BUSY: FINISHED_DEAD,
    },
    "recv": {FINISHED: IDLE, FINISHED_BUSY: STRAGGLER, FINISHED_DEAD: DEAD},
}

for _state in State:
    _state.next = TRANSITIONS[_state]
    _state.after = {event: moves[_state] for event, moves in EVENTS.items() if _state in moves}
del _state

# lane_states()'s vocabulary, as the client documents it (starting never outlives a call).
SHOWN = tuple(dict.fromkeys(state.shown for state in State))

# Lane.limit_hit of a lane killed over RLPool(cpu_budget=) (worker/cpu_budget.py).
CPU_BUDGET = "cpu_budget"


def failure(lane: Lane, error: str) -> dict[str, Any]:
    """The info of a lane's failed result: {"error": error}, and "cpu_budget": True when its
    sandbox was killed over its cpu_budget."""
    info: dict[str, Any] = {"error": error}
    if lane.state.dead and lane.limit_hit == CPU_BUDGET:
        info[CPU_BUDGET] = True
    return info


class Lane:
    """One env's sandbox as the worker sees it: process, channel, log and state."""

    __slots__ = (
        "index",
        "state",
        "pid",
        "chan",
        "wchan",
        "logfd",
        "reader",
        "log",
        "seq",
        "out",
        "cause",
        "held",
        "started",
        "events_base",
        "generation",
        "expect",
        "result",
        "deadline",
        "done_at",
        "exit_code",
        "limit_hit",
        "scrubbing",
    )

    def __init__(self, index: int, limits: wire.Limits):
        self.index = index
        self.state = DEAD
        # Its channel: `chan` is the fd the worker reads (in epoll for EPOLLIN),
        # `wchan` the fd it writes: the same socket, or two pipes (spawn.py).
        self.pid = self.chan = self.wchan = self.logfd = -1
        self.reader = wire.FrameReader(limits)
        self.log = bytearray()
        self.seq = -1
        self.out = b""
        self.cause = "not started"
        self.held = 0  # what the pool holds of its replies: bytes read, 64 per decoded object
        self.started = 0.0
        self.events_base = (0, 0)  # the cgroup's (OOM kills, refused forks) at spawn
        self.generation = 0
        self.expect: int | None = None  # the reply code due for the request in flight
        self.result: tuple[Any, ...] | None = None  # held for recv: (obs, reward, terminated, truncated, info)
        self.deadline = 0.0  # IN_FLIGHT: when it becomes a straggler (inf while queued at the gate)
        self.done_at = 0.0  # held for recv: when the result was ready (for queued_ms)
        self.exit_code: int | None = None  # its last process's, once dead (os.waitstatus_to_exitcode)
        self.limit_hit = ""  # the limit its last process died at, by its name in `limits` ('' if none)
        self.scrubbing = False  # the request in flight is a scrub (its reply is counted: Lifecycle.scrub_left)

    def to(self, state: State) -> None:
        """Move to `state`, if the table declares the move; else LaneStateError."""
        if state not in self.state.next:
            raise LaneStateError(
                f"lane {self.index}: no transition from {self.state.name} to {state.name} "
                "(a bug in the worker; the pool ends)"
            )
        self.state = state

    def on(self, event: str) -> State:
        """Apply one of EVENTS; returns the state it left."""
        before = self.state
        after = before.after.get(event)
        if after is None:
            raise LaneStateError(
                f"lane {self.index}: event {event!r} cannot happen in state {before.name} "
                "(a bug in the worker; the pool ends)"
            )
        self.to(after)
        return before
