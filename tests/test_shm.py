"""Observations through shared memory: each env's slot (wire.py, worker/slots.py, pool/slots.py).

Every test runs in both spawn modes, and on both step paths in CI (the native
walker vouches for a marker; the pure path checks it in Python). The threat
model's rows for the slots point here: one memfd per env, sealed against
resizing before any request; an env that resizes or seals it first is killed
(its pool does not start); a reply whose slot header disagrees with its
marker fails that lane only; a marker anywhere but a step's or a reset's obs,
naming another request, or from an env with no slot kills the env; remote
pools and BOLTZLABS_NO_SHM=1 keep the wire.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from boltzlabs import wire
from boltzlabs.errors import EnvStartError
from boltzlabs.pool import slots

SLOT_ENV = Path(__file__).resolve().parent / "envs" / "slot_env"


def counting(pool) -> list:
    """Count the obs that came through slots (wire.Slot markers the client filled)."""
    seen = [0]
    fill = pool._slots.fill

    def counted(lanes, obs, *rest):
        seen[0] += sum(type(o) is wire.Slot for o in obs)
        return fill(lanes, obs, *rest)

    pool._slots.fill = counted
    return seen


def same_obs(a, b) -> bool:
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_obs(a[k], b[k]) for k in a)
    if isinstance(a, tuple):
        return type(b) is tuple and len(a) == len(b) and all(same_obs(x, y) for x, y in zip(a, b))
    return (
        type(a) is np.ndarray
        and type(b) is np.ndarray
        and a.dtype == b.dtype
        and a.shape == b.shape
        and np.array_equal(a, b)
        and not a.flags.writeable
        and not b.flags.writeable
    )


def run(pool, steps=6):
    out = [pool.reset(seed=3)]
    for t in range(steps):
        out.append(pool.step([1] * pool.n)[0])
        if t == 2:
            out.append(pool.reset(where=[0]))  # a partial reset's obs come through the slot too
    out.append(pool.step_full([1] * pool.n, resets=[1]).obs)  # an autoreset lane's, and the others'
    pool.send([1] * pool.n)
    received = pool.recv_full()  # asynchronous steps', in the order the envs finished: put in lane order
    out.append([received.obs[k] for k in np.argsort(received.env_ids)])
    return out


@pytest.mark.parametrize("space", ["box", "dict", "tuple"])
def test_observations_through_slots_equal_the_wires(pool_factory, space, monkeypatch):
    pool = pool_factory(SLOT_ENV, 3, space=space)
    assert pool.shared_memory
    seen = counting(pool)
    through_slots = run(pool)
    # Every obs came through a slot, but the two lanes the partial reset splices in from before.
    assert seen[0] == sum(len(batch) for batch in through_slots) - 2
    monkeypatch.setenv("BOLTZLABS_NO_SHM", "1")
    wired = pool_factory(SLOT_ENV, 3, space=space)
    assert not wired.shared_memory and wired._slots is None
    by_wire = run(wired)
    assert len(through_slots) == len(by_wire)
    for a, b in zip(through_slots, by_wire):
        assert all(same_obs(x, y) for x, y in zip(a, b)), (a, b)


def test_an_obs_that_does_not_fit_goes_by_the_wire(pool_factory):
    pool = pool_factory(SLOT_ENV, 2)
    pool.reset(seed=0)
    obs, rewards, dones, infos = pool.step([{"op": "wire"}, 1])
    assert obs[0].shape == (5,) and obs[1].shape == (3, 4)
    assert not dones.any() and "error" not in infos[0]


def test_the_trainer_copies_the_slot_once_after_the_reply(pool_factory):
    pool = pool_factory(SLOT_ENV, 2)
    pool.reset(seed=1)
    first = pool.step([1, 1])[0]
    kept = [o.copy() for o in first]
    pool.step([1, 1])  # the envs write their slots again: what the first step returned stays as it was
    assert all(np.array_equal(a, b) for a, b in zip(first, kept))
    assert first[0].base is first[1].base  # one batch for the call


def test_a_slot_inconsistent_with_its_header_fails_its_lane_only(pool_factory):
    pool = pool_factory(SLOT_ENV, 3)
    pool.reset(seed=0)
    result = pool.step_full([1, 1, 1])
    assert pool.batched_obs(result.obs) is not None  # every obs its slot's row: the batch is offered
    obs, rewards, dones, infos = pool.step([1, {"op": "header", "seq": 12345}, 1])
    assert obs[1] is None and dones[1] and rewards[1] == 0.0
    assert "does not match its reply" in infos[1]["error"] and "seq 12345" in infos[1]["error"]
    assert obs[0] is not None and obs[2] is not None and not dones[[0, 2]].any()
    assert pool.batched_obs(pool._obs) is None  # a lane failed: no batch holds every lane's obs
    assert pool.states() == ["idle"] * 3
    pool.reset(where=[1])
    assert pool.step([1, 1, 1])[0][1] is not None


@pytest.mark.parametrize("op,why", [("nested", "where no observation goes"), ("wrong_seq", "for request")])
def test_a_marker_anywhere_but_the_obs_or_for_another_request_kills_the_env(pool_factory, op, why):
    pool = pool_factory(SLOT_ENV, 2)
    pool.reset(seed=0)
    obs, rewards, dones, infos = pool.step([{"op": op}, 1])
    assert obs[0] is None and dones[0] and why in infos[0]["error"], infos[0]
    assert pool.states()[0] == "dead" and pool.states()[1] == "idle"
    assert obs[1] is not None and not dones[1]
    pool.reset(where=[0])
    assert pool.step([1, 1])[0][0] is not None


def test_a_marker_from_an_env_without_a_slot_kills_it(pool_factory, monkeypatch):
    monkeypatch.setenv("BOLTZLABS_NO_SHM", "1")
    pool = pool_factory(SLOT_ENV, 2)
    pool.reset(seed=0)
    obs, rewards, dones, infos = pool.step([{"op": "marker_anyway"}, 1])
    assert obs[0] is None and dones[0] and "extension type 4" in infos[0]["error"], infos[0]
    assert pool.states() == ["dead", "idle"]


def test_an_env_that_seals_its_slot_before_the_worker_is_killed(pool_factory, spawn):
    # env.py runs in the env's own process before its HELLO in both modes (a template's child
    # runs it once it is a sandbox, its slot on fd 7): sealing the slot there fails the env.
    with pytest.raises(EnvStartError, match="tampered with its observation slot"):
        pool_factory(SLOT_ENV, 2, tamper="seal")


def test_an_env_that_resizes_its_slot_before_the_worker_gets_the_worker_s_size(pool_factory):
    pool = pool_factory(SLOT_ENV, 2, tamper="grow")
    assert pool.shared_memory and all(o.shape == (3, 4) for o in pool.reset(seed=0))


def test_a_sealed_slot_cannot_be_resized_by_its_env(pool_factory):
    pool = pool_factory(SLOT_ENV, 2, tamper="keep")
    pool.reset(seed=0)
    infos = pool.step([{"op": "resize"}, {"op": "resize"}])[3]
    assert [info["resize"] for info in infos] == [["EPERM", "EPERM", "EPERM"]] * 2
    obs = pool.step([1, 1])[0]  # the trainer's mappings are whole: no fault, the obs as before
    assert all(o.shape == (3, 4) for o in obs)


def test_an_env_without_a_fixed_shape_space_keeps_the_wire(pool_factory):
    pool = pool_factory(Path(__file__).parent.parent / "examples" / "counter", 2)
    assert not pool.shared_memory
    assert pool.reset(seed=0) == [{"t": 0}] * 2


def test_a_remote_pool_keeps_the_wire(tmp_path):
    from test_remote import Worker

    worker = Worker(tmp_path)
    try:
        with worker.pool(SLOT_ENV, 2) as pool:
            assert not pool.shared_memory
            pool.reset(seed=0)
            assert pool.step([1, 1])[0][0].shape == (3, 4)
    finally:
        worker.stop()


def test_no_shm_turns_it_off(monkeypatch):
    monkeypatch.setenv("BOLTZLABS_NO_SHM", "1")
    assert not slots.wanted()
    monkeypatch.setenv("BOLTZLABS_NO_SHM", "0")
    assert slots.wanted()
