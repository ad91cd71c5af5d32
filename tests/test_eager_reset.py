"""RLPool(eager_reset=True): an env whose step ended its episode resets as soon as the step's
reply is sent, while the trainer works, and the next autoreset takes that reset's result.
Real pools of real sandboxes, an env per sandbox (k = 1) and groups (k = 3), both spawn modes.
What each test pins down:
  1. the results are those of a pool without it, step for step (Gymnasium's CartPole);
  2. the reset runs before the next request, once: an env's own count of its resets says so;
  3. anything else asked of that env first (a seeded reset, a step, set_attr) gets what a pool
     without it gives, after one more reset;
  4. an eager reset that raises fails that env's autoreset, with its cause; one that hangs or
     kills its sandbox fails the next request, as a reset there would; the pool goes on;
  5. the option is checked: a bool, never with serialize_measurement, in OPEN as from the client;
     a pool over several workers gives it to each.
Timeouts only catch hangs; no assertion is on a duration.
"""

import numpy as np
import pytest

from boltzlabs import RLPool
from boltzlabs.gym import BoltzLabsVecEnv
from boltzlabs.host.policy import load_policy
from boltzlabs.worker import config
from conftest import scaled

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.filterwarnings("ignore:.*failures are lanes:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:.*closed; its envs failed:RuntimeWarning"),
]

# Counts its resets in module state (each member its own module); the episode ends at the step
# whose action is "end". reset(options=) faults, and faults armed for the next reset by a step's
# action ("raise next", "sleep next", "exit next"): an eager reset runs them with no request.
COUNTING_ENV = """
    import os
    import time
    from boltzlabs.env import serve
    LANE = int(os.environ["BOLTZLABS_ENV_INDEX"])
    state = {"resets": 0, "t": 0, "next": None, "seeds": []}
    def reset(seed, options=None):
        fault, state["next"] = state["next"], None
        if fault == "raise next":
            raise RuntimeError(f"reset of env {LANE} failed on purpose")
        if fault == "sleep next":
            time.sleep(3600)
        if fault == "exit next":
            os._exit(3)
        state["resets"] += 1
        state["t"] = 0
        state["seeds"].append(seed)
        return {"lane": LANE, "resets": state["resets"], "seed": seed}, {"lane": LANE}
    def step(action):
        state["t"] += 1
        if action in ("raise next", "sleep next", "exit next"):
            state["next"] = action
        ended = action != "go"
        return {"lane": LANE, "resets": state["resets"], "t": state["t"]}, 1.0, ended, False, {}
    serve(
        reset=reset,
        step=step,
        attributes={
            "resets": lambda: state["resets"],
            "seeds": lambda: list(state["seeds"]),
            "label": (lambda: state.get("label"), lambda value: state.update(label=value)),
        },
    )
"""


@pytest.fixture(params=[1, 3], ids=["k1", "k3"])
def k(request):
    return request.param


def counting_pool(pool_factory, env_dir, k, n=4, **kwargs):
    return pool_factory(str(env_dir(COUNTING_ENV)), n, envs_per_sandbox=k, eager_reset=True, **kwargs)


def test_results_are_those_of_a_pool_without_it_step_for_step(pool_factory, k):
    n = 6
    runs = []
    for eager in (False, True):
        vec = BoltzLabsVecEnv(pool_factory("gym://CartPole-v1", n, envs_per_sandbox=k, eager_reset=eager))
        obs, infos = vec.reset(seed=7)
        rng = np.random.default_rng(0)
        run = [(obs.copy(), None, None, None)]
        for _ in range(250):
            obs, rewards, terminated, truncated, _ = vec.step(rng.integers(0, 2, n))
            run.append((obs.copy(), rewards.copy(), terminated.copy(), truncated.copy()))
        runs.append(run)
    lazy, eager = runs
    assert sum(int(step[2].sum()) for step in lazy[1:]) >= 10  # many episodes ended, so many eager resets
    for before, after in zip(lazy, eager):
        for a, b in zip(before, after):
            assert (a is None and b is None) or np.array_equal(a, b)


def test_an_ended_env_is_reset_before_the_next_request_and_that_autoreset_takes_it(pool_factory, env_dir, k):
    pool = counting_pool(pool_factory, env_dir, k)
    pool.reset()
    assert pool.get_attr("resets") == [1, 1, 1, 1]
    pool.step(["go", "end", "go", "end"])
    # No request since: envs 1 and 3 reset on their own, the others did not.
    assert pool.get_attr("resets") == [1, 2, 1, 2]
    result = pool.step_full(["go", None, "go", None], resets=[1, 3])
    assert [o["resets"] for o in result.obs] == [1, 2, 1, 2]  # the autoreset's obs: that reset's, not another
    assert [o.get("seed", "none") for o in result.obs] == ["none", None, "none", None]
    assert result.infos[1] == {"lane": 1} and result.infos[3] == {"lane": 3}
    assert pool.get_attr("resets") == [1, 2, 1, 2]
    # reset(where=mask), unseeded, takes it too.
    pool.step(["end", "go", "go", "go"])
    obs = pool.reset(where=[True, False, False, False])
    assert obs[0]["resets"] == 2 and pool.get_attr("resets") == [2, 2, 1, 2]


@pytest.mark.parametrize("k", [1, 2])
def test_a_pool_over_several_workers_passes_it_to_every_shard(env_dir, k):
    with RLPool(str(env_dir(COUNTING_ENV)), 4, workers=2, envs_per_sandbox=k, eager_reset=True) as pool:
        assert pool.workers == 2
        pool.reset()
        pool.step(["go", "end", "go", "end"])
        assert pool.get_attr("resets") == [1, 2, 1, 2]  # one env in each shard reset on its own
        result = pool.step_full(["go", None, "go", None], resets=[1, 3])
        assert [o["resets"] for o in result.obs] == [1, 2, 1, 2]


def test_a_seeded_reset_a_step_or_set_attr_first_gets_what_a_pool_without_it_gives(pool_factory, env_dir, k):
    pool = counting_pool(pool_factory, env_dir, k)
    pool.reset()
    pool.step(["end", "end", "end", "go"])
    assert pool.get_attr("resets") == [2, 2, 2, 1]
    # A seeded reset: the env resets again, with the seed.
    obs = pool.reset(seed=[10, 11, 12, 13], where=[True, False, False, False])
    assert obs[0]["seed"] == 10 and obs[0]["resets"] == 3
    # A step: the env steps on (its eager reset's result is dropped); a later reset is a new one.
    result = pool.step_full(["go", "go", "go", "go"])
    assert result.obs[1]["t"] == 1 and result.obs[1]["resets"] == 2
    pool.reset(where=[False, True, False, False])
    assert pool.get_attr("resets")[1] == 3
    # set_attr (or call) may change what the next reset makes: the autoreset then resets anew.
    pool.step(["go", "go", "end", "go"])
    assert pool.get_attr("resets")[2] == 3
    pool.set_attr("label", ["hard"] * 4)
    result = pool.step_full(["go", "go", None, "go"], resets=[2])
    assert result.obs[2]["resets"] == 4
    assert pool.get_attr("seeds")[2] == [None, None, None, None]


def test_an_eager_reset_that_raises_fails_that_envs_autoreset_with_its_cause(pool_factory, env_dir, k):
    pool = counting_pool(pool_factory, env_dir, k)
    pool.reset()
    pool.step(["go", "raise next", "go", "go"])
    result = pool.step_full(["go", None, "go", "go"], resets=[1])
    assert result.truncated.tolist() == [False, True, False, False]
    assert "reset of env 1 failed on purpose" in result.infos[1]["error"]
    assert "RuntimeError" in result.infos[1]["error"]
    for lane in (0, 2, 3):
        assert "error" not in result.infos[lane]
    # The env itself lives on: its next reset works.
    obs = pool.reset(where=[False, True, False, False])
    assert obs[1]["resets"] == 2


@pytest.mark.parametrize("fault", ["sleep next", "exit next"])
def test_an_eager_reset_that_hangs_or_kills_its_sandbox_fails_the_next_request(pool_factory, env_dir, k, fault):
    pool = counting_pool(pool_factory, env_dir, k, step_timeout=scaled(2.0))
    pool.reset()
    pool.step(["go", "go", "go", fault])
    result = pool.step_full(["go", "go", "go", None], resets=[3])
    # Env 3 alone fails (with k = 3 it is alone in its group: envs 3-5 of 4), with the cause. A
    # sandbox seen dead before the request comes is respawned for it instead, as without eager_reset.
    if fault == "exit next" and not result.truncated[3]:
        assert result.obs[3]["resets"] == 1  # a new process's first reset
    else:
        assert np.flatnonzero(result.truncated).tolist() == [3]
        error = result.infos[3]["error"]
        assert result.infos[3].get("straggler") is True if fault == "sleep next" else "exit" in error, error
    assert not result.truncated[:3].any()
    # The pool goes on: the failed env comes back at its reset, the others step.
    obs = pool.reset(where=[False, False, False, True])
    assert obs[3]["resets"] >= 1
    result = pool.step_full(["go"] * 4)
    assert not result.truncated.any()


def test_eager_reset_is_checked_and_refused_with_serialize_measurement(pool_factory, env_dir):
    source = str(env_dir(COUNTING_ENV))
    with pytest.raises(TypeError, match="eager_reset must be True or False"):
        RLPool(source, 2, eager_reset="yes")
    for k in (1, 2):
        with pytest.raises(ValueError, match="serialize_measurement"):
            RLPool(source, 2, envs_per_sandbox=k, eager_reset=True, serialize_measurement=True)


@pytest.mark.parametrize("value", ["yes", 1, [True], {"on": True}])
def test_a_hostile_eager_reset_in_open_is_refused(value):
    policy = load_policy()
    request = {"source_dir": "/nonexistent", "n": 2, "eager_reset": value}
    with pytest.raises((ValueError, TypeError), match="eager_reset"):
        config.parse_open(request, None, policy)
    request = {"source_dir": "/nonexistent", "n": 2, "eager_reset": True, "serialize_measurement": True}
    with pytest.raises(ValueError, match="serialize_measurement"):
        config.parse_open(request, None, policy)
