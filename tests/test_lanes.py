"""The lane state machine (boltzlabs/worker/lanes.py): one enum, one transition table, one door (Lane.to).

Pure: no sandbox is needed to check a table. The worker's own use of it is
tested end to end by test_pool, test_async, test_faults and test_hostile_wire.
"""

from __future__ import annotations

import itertools
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from boltzlabs import wire
from boltzlabs.errors import LaneStateError
from boltzlabs.worker.lanes import EVENTS, SHOWN, TRANSITIONS, Lane, State

LIMITS = wire.Limits(1 << 16)


def path_to(target: State) -> list[str]:
    """The shortest list of events that takes a new lane (DEAD) to `target`."""
    seen = {State.DEAD: []}
    queue = deque([State.DEAD])
    while queue:
        state = queue.popleft()
        if state is target:
            return seen[state]
        for event, moves in EVENTS.items():
            nxt = moves.get(state)
            if nxt is not None and nxt not in seen:
                seen[nxt] = seen[state] + [event]
                queue.append(nxt)
    raise AssertionError(f"{target.name} cannot be reached from DEAD by the worker's events")


def lane_in(state: State) -> Lane:
    lane = Lane(7, LIMITS)
    for event in path_to(state):
        lane.on(event)
    assert lane.state is state
    return lane


def test_a_new_lane_is_dead_and_every_state_is_reachable():
    assert Lane(0, LIMITS).state is State.DEAD
    for state in State:
        path_to(state)


@pytest.mark.parametrize(
    "source,target", [(s, t) for s, targets in TRANSITIONS.items() for t in targets], ids=lambda s: s.name
)
def test_every_declared_transition_is_taken(source, target):
    lane = lane_in(source)
    lane.to(target)
    assert lane.state is target


@pytest.mark.parametrize(
    "source,target",
    [(s, t) for s, t in itertools.product(State, State) if t not in TRANSITIONS[s]],
    ids=lambda s: s.name,
)
def test_every_undeclared_transition_raises_and_changes_nothing(source, target):
    lane = lane_in(source)
    with pytest.raises(LaneStateError, match=f"lane 7: no transition from {source.name} to {target.name}"):
        lane.to(target)
    assert lane.state is source


def test_the_illegal_transition_is_an_internal_error_not_a_bad_argument():
    """The worker's serve loop answers ValueError/TypeError/KeyError/IndexError as a caller's mistake
    and goes on; a broken state machine must instead end the worker with its traceback."""
    assert not issubclass(LaneStateError, (ValueError, TypeError, KeyError, IndexError))


def test_the_events_and_the_table_agree():
    """Every move an event makes is declared, and every declared move is made by some event."""
    made = {(s, t) for moves in EVENTS.values() for s, t in moves.items()}
    declared = {(s, t) for s, targets in TRANSITIONS.items() for t in targets}
    assert made <= declared, f"events make undeclared moves: {made - declared}"
    assert declared <= made, f"declared moves no event makes: {declared - made}"
    assert set(TRANSITIONS) == set(State)


def test_the_client_vocabulary():
    """lane_states() shows the async vocabulary (docs/async.md), states() the process one (docs/api.md);
    starting and busy never outlive a call."""
    assert set(SHOWN) == {"idle", "in_flight", "finished", "straggler", "dead", "starting", "busy"}
    assert {s.process for s in State} == {"starting", "idle", "busy", "dead"}
    assert [s.name for s in State if s.shown == "finished"] == ["FINISHED", "FINISHED_BUSY", "FINISHED_DEAD"]


def test_an_event_that_cannot_happen_raises():
    lane = lane_in(State.IDLE)
    with pytest.raises(LaneStateError, match="event 'recv' cannot happen in state IDLE"):
        lane.on("recv")
    assert lane.state is State.IDLE


def _model(process: str, flight: str, straggler: bool, event: str):
    """The worker before the split, as two axes: process (starting/idle/busy/dead) and
    flight (none/flying/finished), plus whether a busy lane is past its deadline.
    What `event` does there, or None where the worker never sends that event."""
    if event == "spawn":
        return ("starting", flight, False) if process == "dead" and flight == "none" else None
    if event == "hello":
        return ("idle", flight, False) if process == "starting" else None
    if event == "request":
        return ("busy", flight, False) if process == "idle" and flight in ("none", "finished") else None
    if event == "send":
        return ("busy", "flying", False) if process == "idle" and flight == "none" else None
    if event == "refuse":
        ok = flight == "none" and (process == "dead" or (process == "busy" and straggler))
        return (process, "finished", straggler) if ok else None
    if event == "reply":
        if process != "busy":
            return None
        return ("idle", "finished" if flight == "flying" else flight, False)
    if event == "deadline":
        if process != "busy" or straggler or flight == "finished":
            return None
        return ("busy", "finished" if flight == "flying" else flight, True)
    if event == "die":
        return ("dead", "finished" if flight == "flying" else flight, False) if process != "dead" else None
    if event == "recv":
        # A lane still busy when its result is taken owes a reply past its deadline: a straggler.
        return (process, "none", process == "busy") if flight == "finished" else None
    raise AssertionError(event)


def _axes(state: State) -> tuple[str, str]:
    return state.process, "flying" if state is State.IN_FLIGHT else "finished" if state.result_held else "none"


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(sorted(EVENTS)), max_size=60))
def test_random_events_never_reach_an_undeclared_state(events):
    """Any sequence of the worker's events: each either moves the lane along a declared
    transition or is refused with LaneStateError and changes nothing; and wherever the
    one enum moves, it moves as the old two axes (state strings, flight ints) did."""
    lane = Lane(0, LIMITS)
    process, flight, straggler = "dead", "none", False
    for event in events:
        before = lane.state
        try:
            lane.on(event)
        except LaneStateError:
            assert lane.state is before
            assert _model(process, flight, straggler, event) is None, f"{event} from {before.name} was refused"
            continue
        assert lane.state in TRANSITIONS[before], (before, event, lane.state)
        modelled = _model(process, flight, straggler, event)
        assert modelled is not None, f"{event} from {before.name}: the worker never did this"
        process, flight, straggler = modelled
        assert _axes(lane.state) == (process, flight), (before, event, lane.state)
        assert lane.state.due == (process == "busy")
        assert (lane.state is State.STRAGGLER) == (process == "busy" and flight == "none" and straggler)
