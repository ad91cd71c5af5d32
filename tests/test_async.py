"""Asynchronous stepping (issue 7): send/recv, lane states, deadlines, faults, the gate.

Every test runs real sandboxes; timings bound hangs only, never speed.
"""

import contextlib
import time

import numpy as np
import pytest

from boltzlabs import RLPool
from conftest import PROBE, intervals, overlaps

pytestmark = pytest.mark.timeout(120)


def sleep(s):
    return {"op": "sleep", "s": s}


def drain(pool):
    """Receive everything outstanding: {env: (obs, reward, done, info)}."""
    out = {}
    while True:
        states = pool.states()
        if not any(s in ("in_flight", "finished") for s in states):
            return out
        ids, obs, rewards, dones, infos = pool.recv(1)
        for k, i in enumerate(ids.tolist()):
            assert i not in out, f"env {i} gave two results"
            out[i] = (obs[k], float(rewards[k]), bool(dones[k]), infos[k])


def wait_for(pool, lane, state, limit=10.0):
    """Poll states() until `lane` is in `state` (a busy host may be slow; bounded)."""
    give_up = time.monotonic() + limit
    while pool.states()[lane] != state:
        assert time.monotonic() < give_up, f"env {lane} never became {state}: {pool.states()}"
        time.sleep(0.01)


# -- 1. send / recv -----------------------------------------------------------------------


def test_recv_gives_the_first_envs_to_finish(probe_pool):
    pool = probe_pool(4)
    pool.reset(seed=0)
    started = time.monotonic()
    pool.send([sleep(1.0), 1, 2, sleep(1.0)])
    assert time.monotonic() - started < 0.9  # send does not wait for the slow envs
    ids, obs, rewards, dones, infos = pool.recv(2)
    assert sorted(ids.tolist()) == [1, 2]
    assert ids.dtype == np.int64 and rewards.dtype == np.float32 and dones.dtype == np.bool_
    assert dict(zip(ids.tolist(), rewards.tolist())) == {1: 1.0, 2: 2.0}
    assert [o["t"] for o in obs] == [1, 1] and not dones.any() and infos == [{"t": 1}, {"t": 1}]
    assert pool.states() == ["in_flight", "idle", "idle", "in_flight"]
    ids, obs, rewards, dones, infos = pool.recv()  # default: everything outstanding
    assert sorted(ids.tolist()) == [0, 3]
    assert [o["out"] for o in obs] == [{"slept": 1.0}] * 2
    assert pool.states() == ["idle"] * 4


def test_send_to_some_envs_with_aligned_actions(probe_pool):
    pool = probe_pool(4)
    pool.reset(seed=0)
    pool.send(np.array([7, 5]), env_ids=[3, 1])
    assert pool.states()[0] == "idle" and pool.states()[2] == "idle"
    results = drain(pool)
    assert {i: r[1] for i, r in results.items()} == {3: 7.0, 1: 5.0}
    # rewards/terminated/_obs of the pool track the lanes received
    assert pool.rewards[3] == 7.0 and pool.rewards[1] == 5.0


def test_pool_batch_size_is_the_default(probe_pool):
    pool = probe_pool(4, batch_size=3)
    pool.reset(seed=0)
    pool.send([1, 2, 3, 4])
    ids, *_ = pool.recv()
    assert len(ids) == 3
    with pytest.raises(ValueError, match="would wait forever"):
        pool.recv()  # 3 more cannot come: only 1 is outstanding
    assert len(pool.recv(1)[0]) == 1
    with pytest.raises(ValueError, match="batch_size"):
        RLPool(PROBE, 2, batch_size=3)
    with pytest.raises(ValueError, match="batch_size"):
        RLPool(PROBE, 2, batch_size=0)


def test_recv_timeout_returns_what_finished(probe_pool):
    pool = probe_pool(2)
    pool.reset(seed=0)
    pool.send([1, sleep(1.5)])
    ids, obs, rewards, dones, infos = pool.recv(2, timeout=0.5)
    assert ids.tolist() == [0]
    assert pool.states() == ["idle", "in_flight"]
    assert pool.recv(1, timeout=0)[0].tolist() == []  # 0: only what has finished
    with pytest.raises(ValueError, match="timeout"):
        pool.recv(1, timeout=-1)
    assert pool.recv(1)[0].tolist() == [1]


def test_episodes_are_counted_per_received_lane(probe_pool):
    pool = probe_pool(2)
    pool.reset(seed=0)
    for _ in range(100):  # the probe ends its episode at t = 100
        pool.send([1], env_ids=[0])
        pool.recv(1)
    assert pool.finished_episodes and pool.finished_episodes[0]["env"] == 0
    assert pool.finished_episodes[0]["length"] == 100 and pool.finished_episodes[0]["return"] == 100.0
    assert pool._episode_lengths[1] == 0


# -- 2. the state machine -------------------------------------------------------------------


def test_every_state_and_transition(probe_pool):
    pool = probe_pool(5, step_timeout=2.0)
    pool.reset(seed=0)
    assert pool.states() == ["idle"] * 5
    pool.send([sleep(10.0), {"op": "exit"}], env_ids=[3, 4])  # a straggler-to-be, a dead-to-be
    drain(pool)
    assert pool.states() == ["idle", "idle", "idle", "straggler", "dead"]
    pool.send([1, sleep(1.5)], env_ids=[0, 1])
    wait_for(pool, 0, "finished")
    assert pool.states() == ["finished", "in_flight", "idle", "straggler", "dead"]

    # refused, and nothing was sent: the states are unchanged
    with pytest.raises(ValueError, match="env 0: it has finished .* recv it first"):
        pool.send([1], env_ids=[0])
    with pytest.raises(ValueError, match="env 1: it is in flight .* recv it first"):
        pool.send([1, 1], env_ids=[2, 1])
    with pytest.raises(ValueError, match="would wait forever"):
        pool.recv(3)
    with pytest.raises(ValueError, match=r"step\(\) cannot run .* recv them first"):
        pool.step([1] * 5)
    with pytest.raises(ValueError, match="cannot reset env 1: it is in flight .* recv it first"):
        pool.reset(where=[1])
    with pytest.raises(ValueError, match="cannot reset env 0: it has finished .* recv it first"):
        pool.reset(where=[0])
    with pytest.raises(ValueError, match="cannot reset"):
        pool.reset()
    assert pool.states() == ["finished", "in_flight", "idle", "straggler", "dead"]

    # allowed: reset of idle, straggler and dead envs between sends, others in flight
    obs = pool.reset(where=[2, 3, 4], seed=7)
    assert [obs[i]["seed"] for i in (2, 3, 4)] == [9, 10, 11]
    states = pool.states()
    assert states[0] == "finished" and states[1] in ("in_flight", "finished") and states[2:] == ["idle"] * 3

    # finished -> idle by recv; in flight -> finished -> idle
    assert pool.recv(1)[0].tolist() == [0]
    assert pool.recv(1)[0].tolist() == [1]
    assert pool.states() == ["idle"] * 5
    with pytest.raises(ValueError, match="would wait forever"):
        pool.recv(1)
    assert pool.step([1] * 5)[1].tolist() == [1.0] * 5  # step() works once nothing is outstanding


def test_send_to_dead_or_straggler_fails_at_once_as_step_does(probe_pool):
    pool = probe_pool(3, step_timeout=0.5)
    pool.reset(seed=0)
    pool.send([sleep(3.0), {"op": "exit"}], env_ids=[0, 1])
    drain(pool)
    pool.send([1, 1, 1])
    assert pool.states()[:2] == ["finished", "finished"]
    results = drain(pool)
    assert results[0][2] and results[0][3]["straggler"] and "reset it" in results[0][3]["error"]
    assert results[1][2] and "env is dead" in results[1][3]["error"] and results[1][1] == 0.0
    assert results[2][1] == 1.0


def test_bad_sends_are_refused_before_anything_is_sent(probe_pool):
    pool = probe_pool(3)
    pool.reset(seed=0)
    with pytest.raises(ValueError, match="twice"):
        pool.send([1, 1], env_ids=[0, 0])
    with pytest.raises(ValueError, match="outside"):
        pool.send([1], env_ids=[3])
    with pytest.raises(ValueError, match="needs 2 actions"):
        pool.send([1, 1, 1], env_ids=[0, 1])
    with pytest.raises(TypeError, match="env 1"):
        pool.send([1, object()], env_ids=[0, 1])
    with pytest.raises(ValueError, match="batch_size"):
        pool.recv(0)
    assert pool.states() == ["idle"] * 3


# -- 3. deadlines per env, faults in flight --------------------------------------------------


def test_deadline_counts_from_each_envs_own_send(probe_pool):
    pool = probe_pool(2, step_timeout=2.0)
    pool.reset(seed=0)
    pool.send([sleep(1.2)], env_ids=[0])
    time.sleep(1.0)
    pool.send([sleep(1.2)], env_ids=[1])  # ends ~2.2 s after the first send, 1.2 s after its own
    results = drain(pool)
    assert all("straggler" not in r[3] for r in results.values()), results
    assert [results[i][0]["out"] for i in (0, 1)] == [{"slept": 1.2}] * 2


def test_deadline_is_kept_between_calls(probe_pool):
    pool = probe_pool(2, step_timeout=0.5)
    pool.reset(seed=0)
    pool.send([sleep(5.0), 1])
    time.sleep(1.0)  # no call runs: the worker keeps the deadline itself
    assert pool.states()[0] == "finished"
    wait_for(pool, 1, "finished")
    ids, obs, rewards, dones, infos = pool.recv(2)
    got = dict(zip(ids.tolist(), infos))
    assert got[0]["straggler"] and "missed the step deadline of 0.5 s" in got[0]["error"]
    assert pool.timing.stragglers == [0]
    assert dones[ids.tolist().index(0)] and rewards[ids.tolist().index(0)] == 0.0
    assert pool.states() == ["straggler", "idle"]
    pool.reset(where=[0])  # kills and respawns the straggler
    pool.send([1, 1])
    assert sorted(drain(pool)) == [0, 1]


@pytest.mark.parametrize(
    "fault, state, expect",
    [
        ({"op": "raise"}, "idle", "ValueError: step failed on purpose"),
        ({"op": "exit"}, "dead", "died: exited with code 3"),
        ({"op": "segv"}, "dead", "SIGSEGV"),
        (sleep(5.0), "straggler", "missed the step deadline"),
    ],
)
def test_faults_in_flight_come_back_in_recv(probe_pool, fault, state, expect):
    pool = probe_pool(3, step_timeout=1.0)
    pool.reset(seed=0)
    pool.send([1, fault, sleep(0.2)])
    results = drain(pool)
    assert sorted(results) == [0, 1, 2]
    obs, reward, done, info = results[1]
    assert obs is None and reward == 0.0 and done and expect in info["error"], info
    assert results[0][1] == 1.0 and results[2][0]["out"] == {"slept": 0.2}
    assert pool.states() == ["idle", state, "idle"]
    if fault["op"] == "raise":
        assert "Traceback" in info["error"]
    pool.reset(where=[1], seed=0)
    pool.send([1, 2, 3])
    assert {i: r[1] for i, r in drain(pool).items()} == {0: 1.0, 1: 2.0, 2: 3.0}


def test_autoreset_lanes_in_a_send(probe_pool):
    pool = probe_pool(2)
    pool.reset(seed=0)
    pool.send([1, 1], None, resets=[1])
    results = drain(pool)
    assert results[0][0]["t"] == 1 and results[1][0]["t"] == 0 and results[1][1] == 0.0 and not results[1][2]


# -- 4. the serialize_measurement gate --------------------------------------------------------


def test_serialize_gate_holds_under_async(spawn):
    n = 4
    with RLPool(PROBE, n, serialize_measurement=True, step_timeout=5, spawn=spawn) as pool:
        pool.reset(seed=0)
        spans = []
        pool.send([{"op": "interval", "s": 0.05}] * n)
        ids, obs, *_ = pool.recv(2)
        spans += intervals(obs)
        pool.send([{"op": "interval", "s": 0.05}] * 2, env_ids=ids)  # queue behind those still flying
        time.sleep(0.2)  # the gate moves on between calls too
        spans += intervals(drain_obs(pool))
        spans.sort()
        assert len(spans) == n + 2 and not overlaps(spans), spans


def drain_obs(pool):
    return [r[0] for r in drain(pool).values()]


def test_gate_holder_that_overruns_under_async_is_killed(spawn):
    with RLPool(PROBE, 3, serialize_measurement=True, step_timeout=0.5, spawn=spawn) as pool:
        pool.reset(seed=0)
        pool.send([{"op": "interval", "s": 0.05}, {"op": "loop"}, {"op": "interval", "s": 0.05}])
        results = drain(pool)
        info = results[1][3]
        assert info["straggler"] and "holding the serialize_measurement gate" in info["error"]
        assert pool.states() == ["idle", "dead", "idle"]
        assert not overlaps(intervals([results[0][0], results[2][0]]))


# -- 5. timing ---------------------------------------------------------------------------------


def test_wait_and_queued_timing(probe_pool):
    pool = probe_pool(2)
    pool.reset(seed=0)
    pool.send([sleep(0.3)], env_ids=[0])
    pool.recv(1)
    waited = pool.timing.wait_ms
    assert waited > 0 and pool.timing.roundtrip_ms >= waited
    pool.send([1], env_ids=[1])
    time.sleep(0.3)  # the result waits in the worker, not the trainer
    pool.recv(1)
    assert pool.timing.queued_ms > pool.timing.wait_ms
    assert "queued" in str(pool.timing)
    pool.step([1, 1])
    assert pool.timing.wait_ms == 0.0 and pool.timing.queued_ms == 0.0


# -- nothing is lost: random interleavings -------------------------------------------------------


def interleavings(pool, calls: dict):
    """The model of test_nothing_lost_across_random_interleavings, on `pool`
    (shared by every example) and counting what it does in `calls`."""
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

    n = pool.n
    counter = [0]

    class Interleavings(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.outstanding = {}  # env -> the reward its result must carry, or "fault"
            self.dead = {i for i, s in enumerate(pool.states()) if s == "dead"}
            self.sent = self.received = 0
            self.whole = True  # the last rule ran to its end: the model is the pool's

        def idle(self):
            return [i for i in range(n) if i not in self.outstanding]

        @rule(data=st.data())
        def act(self, data):
            # One rule, weighted: hypothesis would otherwise favour whichever rule comes first.
            op = data.draw(st.sampled_from(["send"] * 4 + ["recv"] * 4 + ["reset", "refused"]))
            if op == "recv" and not self.outstanding:
                op = "send"
            if op == "refused" and not self.outstanding:
                op = "reset"
            self.whole = False
            getattr(self, op)(data)
            self.whole = True

        def send(self, data):
            idle = self.idle()
            if not idle:
                return
            # Every draw before the model changes: hypothesis may stop an example at
            # any draw, and a model updated lane by lane then awaited lanes never sent.
            lanes = data.draw(st.lists(st.sampled_from(idle), min_size=1, unique=True))
            kinds = [data.draw(st.sampled_from(["fast"] * 12 + ["slow", "raise", "exit"])) for _ in lanes]
            actions = []
            for i, kind in zip(lanes, kinds):
                counter[0] += 1
                if i in self.dead:
                    actions.append(counter[0])
                    self.outstanding[i] = "dead"
                elif kind in ("fast", "slow"):
                    actions.append(counter[0] if kind == "fast" else sleep(0.002 + (counter[0] % 3) / 1000))
                    self.outstanding[i] = float(counter[0]) if kind == "fast" else 0.0
                else:
                    actions.append({"op": kind})
                    self.outstanding[i] = kind
            pool.send(actions, env_ids=lanes)
            self.sent += len(lanes)
            calls["send"] += 1

        def recv(self, data):
            k = data.draw(st.integers(1, len(self.outstanding)))
            ids, obs, rewards, dones, infos = pool.recv(k)
            assert len(ids) == k
            for j, i in enumerate(ids.tolist()):
                want = self.outstanding.pop(i)  # KeyError: a result nobody sent for, or a second one
                if want == "raise":
                    assert "step failed on purpose" in infos[j]["error"]
                elif want == "exit":
                    assert "died" in infos[j]["error"]
                    self.dead.add(i)
                elif want == "dead":
                    assert "env is dead" in infos[j]["error"]
                else:
                    assert rewards[j] == want and "error" not in infos[j], (i, want, infos[j])
            self.received += k
            calls["recv"] += 1
            calls["results"] += k

        def reset(self, data):
            idle = self.idle()
            if not idle:
                return
            lanes = data.draw(st.lists(st.sampled_from(idle), min_size=1, unique=True))
            pool.reset(where=lanes)
            self.dead.difference_update(lanes)
            calls["reset"] += 1

        def refused(self, data):
            i = data.draw(st.sampled_from(sorted(self.outstanding)))
            op = data.draw(st.sampled_from(["send", "reset", "step", "recv"]))
            calls["refused"] += 1
            with pytest.raises(ValueError):
                if op == "send":
                    pool.send([1], env_ids=[i])
                elif op == "reset":
                    pool.reset(where=[i])
                elif op == "step":
                    pool.step([1] * n)
                else:
                    pool.recv(len(self.outstanding) + 1)

        @invariant()
        def states_match(self):
            for i, state in enumerate(pool.states()):
                if i in self.outstanding:
                    assert state in ("in_flight", "finished"), (i, state)
                else:
                    assert state == ("dead" if i in self.dead else "idle"), (i, state)

        def teardown(self):
            # The next example shares the pool and its model starts with nothing
            # outstanding: drain what the pool holds, not what this model thinks,
            # which is wrong after a rule that did not end (stopped, or failing:
            # then that failure is reported, not a "finished" lane in the next).
            results = drain(pool)
            stragglers = [i for i, state in enumerate(pool.states()) if state == "straggler"]
            if stragglers:  # a missed deadline, which the example has failed on
                pool.reset(where=stragglers)
            if self.whole:
                assert sorted(results) == sorted(self.outstanding), (sorted(results), self.outstanding)
                assert self.sent == self.received + len(results)

    return Interleavings


def test_nothing_lost_across_random_interleavings(spawn):
    """Thousands of random send/recv/reset calls (with faults) on a small pool:
    every action sent gives exactly one result, with its own reward, and the
    lane states always match a model of them."""
    pytest.importorskip("hypothesis")
    from hypothesis import HealthCheck, settings

    pool = RLPool(PROBE, 4, step_timeout=10.0, spawn=spawn)
    pool.reset(seed=0)
    calls = {"send": 0, "recv": 0, "reset": 0, "refused": 0, "results": 0}
    try:
        from hypothesis.stateful import run_state_machine_as_test

        run_state_machine_as_test(
            interleavings(pool, calls),
            settings=settings(
                max_examples=50, stateful_step_count=80, deadline=None, suppress_health_check=list(HealthCheck)
            ),
        )
        print(calls)
        assert sum(calls.values()) - calls["results"] >= 1000, calls  # thousands of calls, with lane_states
    finally:
        pool.close()


class Scripted:
    """hypothesis's st.data() for one example driven by hand: each draw takes
    the next value of the script, and a draw past its end stops the example
    as hypothesis does when an example's choices run out (StopTest, raised
    from that draw, wherever it is in a rule)."""

    def __init__(self, *values):
        self.values = list(values)

    def draw(self, strategy):
        from hypothesis.errors import StopTest

        if not self.values:
            raise StopTest(0)
        return self.values.pop(0)


@pytest.mark.parametrize("end", ["stopped", "failed"])
def test_an_example_cut_short_leaves_the_next_a_clean_pool(probe_pool, end):
    """Every example of the interleavings shares one pool. Hypothesis may stop
    an example at any draw: stopped between two lanes of a send, the model
    awaited a lane never sent, its teardown's recv asked for more than could
    come (a ValueError hypothesis ignores in an example it stopped), the lanes
    really in flight stayed unreceived, and the next example found one
    "finished" where its model had "idle" (about one run in 25 of the old
    test, at any load). An example that fails must leave the same clean
    pool, its teardown adding no error of its own."""
    pytest.importorskip("hypothesis")
    from hypothesis.errors import StopTest

    pool = probe_pool(4)
    pool.reset(seed=0)
    Interleavings = interleavings(pool, dict.fromkeys(["send", "recv", "reset", "refused", "results"], 0))
    first = Interleavings()
    if end == "stopped":
        first.act(Scripted("send", [2], "fast"))
        wait_for(pool, 2, "finished")
        with pytest.raises(StopTest):
            first.act(Scripted("send", [0, 1], "fast"))  # stopped at the draw of lane 1's action
        with contextlib.suppress(ValueError):  # what hypothesis does with it, the example being stopped
            first.teardown()
    else:
        first.act(Scripted("send", [0, 1, 2], "fast", "fast", "fast"))
        first.outstanding = dict.fromkeys(first.outstanding, -1.0)  # a model wrong about every reward
        with pytest.raises(AssertionError):
            first.act(Scripted("recv", 2))  # fails at its first result
        first.teardown()
    Interleavings().states_match()  # the next example's first check


# -- 6. Gymnasium: step_async / step_wait ---------------------------------------------------------


@pytest.mark.parametrize("mode", ["NEXT_STEP", "SAME_STEP", "DISABLED"])
def test_gym_step_async_wait_equals_step(mode):
    pytest.importorskip("gymnasium")
    from gymnasium.vector import AutoresetMode

    from boltzlabs.gym import BoltzLabsVecEnv

    mode = AutoresetMode[mode]
    a = BoltzLabsVecEnv.make("CartPole-v1", num_envs=3, autoreset_mode=mode)
    b = BoltzLabsVecEnv.make("CartPole-v1", num_envs=3, autoreset_mode=mode)
    try:
        for envs in (a, b):
            envs.reset(seed=1)
        rng = np.random.default_rng(0)
        completed = 0
        for _t in range(80):
            actions = rng.integers(0, 2, 3)
            if mode == AutoresetMode.DISABLED and a._autoreset.any():
                mask = a._autoreset.copy()
                for envs in (a, b):
                    envs.reset(options={"reset_mask": mask})
            want = a.step(actions)
            b.step_async(actions)
            got = b.step_wait()
            for x, y in zip(want[:4], got[:4]):
                np.testing.assert_array_equal(x, y)
            assert a.completed_episodes == b.completed_episodes
            completed += a.completed_episodes
        assert completed > 0
        with pytest.raises(ValueError, match="without a step_async"):
            b.step_wait()
        b.step_async(rng.integers(0, 2, 3))
        with pytest.raises(ValueError, match="waiting for its step_wait"):
            b.step_async(rng.integers(0, 2, 3))
        b.step_wait()
    finally:
        a.close()
        b.close()


SLOW_GYM = """
import time
import gymnasium
from boltzlabs.env import serve

def reset(seed):
    return 0

def step(action):
    time.sleep(1.5 if action == 1 else 0.0)
    return 0, float(action), False, False, {}

serve(reset=reset, step=step, observation_space=gymnasium.spaces.Discrete(2),
      action_space=gymnasium.spaces.Discrete(2))
"""


def test_gym_step_wait_timeout_keeps_what_came(env_dir):
    pytest.importorskip("gymnasium")
    from boltzlabs.gym import BoltzLabsVecEnv

    envs = BoltzLabsVecEnv.make(str(env_dir(SLOW_GYM)), num_envs=2, step_timeout=10)
    try:
        envs.reset(seed=0)
        envs.step_async(np.array([0, 1]))
        with pytest.raises(TimeoutError, match="1 env"):
            envs.step_wait(timeout=0.2)
        obs, rewards, terminations, truncations, infos = envs.step_wait()
        assert rewards.tolist() == [0.0, 1.0] and not truncations.any()
    finally:
        envs.close()


def test_close_with_envs_in_flight_leaves_nothing(spawn):
    from conftest import open_fds

    before = open_fds()
    pool = RLPool(PROBE, 3, step_timeout=5, spawn=spawn)
    pool.reset(seed=0)
    pool.send([sleep(10.0), 1, sleep(10.0)])
    proc = pool._proc
    started = time.monotonic()
    pool.close()
    assert time.monotonic() - started < 20  # close does not wait for the envs' steps
    assert proc.poll() is not None
    assert open_fds() == before
    with pytest.raises(Exception, match="closed"):
        pool.recv(1)
