"""The Gymnasium adapter behaves like Gymnasium's own vector envs (issue 17, points 1-6).

Each test runs BoltzLabsVecEnv (every env in a real sandbox, in both spawn
modes) beside gymnasium.vector.SyncVectorEnv on the same env, seeds and
actions, and asserts the same values, types and dtypes, or the same
exception types:
  1. infos in Gymnasium's vector format: DictInfoToList and
     RecordEpisodeStatistics work on top;
  2. Dict spaces keep their key order (FlattenObservation lines up);
  3. an env whose reset takes only the seed can be partially reset;
  4. tuples, numpy scalars and metadata survive the wire, final_obs is writable;
  5. np_random_seed, call, get_attr, set_attr (gym sources and serve() envs);
  6. seeds are checked as Gymnasium checks them, before anything runs.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import error as gym_error
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from gymnasium.wrappers.vector import DictInfoToList, FlattenObservation, RecordEpisodeStatistics

from boltzlabs.errors import EnvError
from boltzlabs.gym import BoltzLabsVecEnv

from conftest import TESTS, env_class

TYPED_ENV = TESTS / "envs" / "typed_env"
N = 2


TypedEnv = env_class(TYPED_ENV, "TypedEnv")
GRAPH_ENV = TESTS / "envs" / "graph_env"
GraphEnv = env_class(GRAPH_ENV, "GraphEnv")


def assert_same(got, want, where="value"):
    """Equal trees: same types (tuple is not list, float32 is not float64), keys in
    the same order, dtypes, shapes and values."""
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, dict):
        assert list(got) == list(want), f"{where}: keys {list(got)} != {list(want)}"
        for key in want:
            assert_same(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and got.shape == want.shape, (
            f"{where}: {got.dtype}{got.shape} != {want.dtype}{want.shape}"
        )
        if want.dtype == object:
            for i, (g, w) in enumerate(zip(got, want)):
                assert_same(g, w, f"{where}[{i}]")
        else:
            np.testing.assert_array_equal(got, want, err_msg=where)
    elif isinstance(want, np.generic):
        assert got.dtype == want.dtype and (got == want or (np.isnan(got) and np.isnan(want))), f"{where}"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


RUNTIME_KEYS = {"episode_ids", "_episode_ids", "episode_record", "_episode_record"}


def env_part(result: tuple) -> tuple:
    """A reset's or step's result without the runtime's own info keys."""
    *values, infos = result
    return (*values, {k: v for k, v in infos.items() if k not in RUNTIME_KEYS})


def check_vector_format(infos: dict, n: int, where="infos") -> None:
    """Gymnasium's vector info format: every key an array of n (or a dict of
    them, recursively) with a bool mask `_key` of n."""
    for key, value in infos.items():
        if key.startswith("_"):
            assert key[1:] in infos, f"{where}: a mask {key!r} with no {key[1:]!r}"
            continue
        mask = infos.get(f"_{key}")
        assert isinstance(mask, np.ndarray) and mask.dtype == np.bool_ and mask.shape == (n,), (
            f"{where}[{key!r}] has no bool mask of {n}: {mask!r}"
        )
        if isinstance(value, dict):
            check_vector_format(value, n, f"{where}[{key!r}]")
        else:
            assert isinstance(value, np.ndarray) and len(value) == n, f"{where}[{key!r}] = {value!r}"


def typed_pair(pool_factory, mode=AutoresetMode.NEXT_STEP, horizon=5):
    ours = BoltzLabsVecEnv(pool_factory(TYPED_ENV, N, horizon=horizon), autoreset_mode=mode)
    reference = SyncVectorEnv([lambda: TypedEnv(horizon=horizon)] * N, autoreset_mode=mode)
    return ours, reference


# --- 1. the info format -----------------------------------------------------------------------


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP], ids=lambda m: m.name)
def test_dict_info_to_list_and_record_episode_statistics_work_on_top(pool_factory, mode):
    ours = BoltzLabsVecEnv(pool_factory("gym://CartPole-v1", N), autoreset_mode=mode)
    reference = SyncVectorEnv([lambda: gym.make("CartPole-v1")] * N, autoreset_mode=mode)
    wrapped = [DictInfoToList(RecordEpisodeStatistics(env)) for env in (ours, reference)]
    runtime = {"episode_ids", "episode_record"}
    got, want = (env.reset(seed=7)[1] for env in wrapped)
    assert [{k: v for k, v in i.items() if k not in runtime} for i in got] == want
    ended = 0
    for t in range(60):
        action = np.array([t % 2, (t // 3) % 2])
        _, _, terminated, truncated, info_ours = wrapped[0].step(action)
        _, _, _, _, info_ref = wrapped[1].step(action)
        assert len(info_ours) == N
        for lane, (g, w) in enumerate(zip(info_ours, info_ref)):
            if "episode" in w:  # RecordEpisodeStatistics: the same returns and lengths
                assert g["episode"]["r"] == w["episode"]["r"] and g["episode"]["l"] == w["episode"]["l"]
                assert g["episode_record"]["return"] == w["episode"]["r"]  # and our record agrees
            assert set(g) - runtime == set(w), (lane, g, w)
        done = int((terminated | truncated).sum())
        assert ours.completed_episodes == done  # the batch's count: an attribute, not an info key
        ended += done
    assert ended >= 2


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP], ids=lambda m: m.name)
def test_every_info_key_is_in_the_vector_format(pool_factory, mode):
    ours, _ = typed_pair(pool_factory, mode, horizon=3)
    _, infos = ours.reset(seed=1)
    check_vector_format(infos, N)
    for _t in range(8):
        *_, truncated, infos = ours.step(np.array([1, 2]))
        check_vector_format(infos, N)
        if truncated.any():
            assert "episode_record" in infos and all(
                f"_{k}" in infos["episode_record"] for k in ("id", "seed", "length", "return")
            )
    assert "completed_episodes" not in infos


# --- 2. key order -----------------------------------------------------------------------------


def test_dict_spaces_keep_their_key_order_end_to_end(pool_factory):
    ours, reference = typed_pair(pool_factory)
    space = ours.single_observation_space
    assert list(space.keys()) == ["z", "a", "tup"] == list(reference.single_observation_space.keys())
    assert list(space["tup"][1].keys()) == ["y", "b"]
    assert list(ours.observation_space.keys()) == list(reference.observation_space.keys())
    obs, _ = ours.reset(seed=3)
    assert list(obs) == ["z", "a", "tup"] and list(obs["tup"][1]) == ["y", "b"]
    flat_ours, flat_ref = FlattenObservation(ours), FlattenObservation(reference)
    np.testing.assert_array_equal(flat_ours.reset(seed=3)[0], flat_ref.reset(seed=3)[0])
    for t in range(7):
        np.testing.assert_array_equal(flat_ours.step(np.array([1, t % 3]))[0], flat_ref.step(np.array([1, t % 3]))[0])


# --- 3. options only when there are any ------------------------------------------------------------

SEED_ONLY = """
    import numpy as np
    from boltzlabs.env import serve
    from gymnasium import spaces
    state = {"t": 0}
    def reset(seed):  # no options: the signature serve() documents
        state["t"] = 0
        return np.zeros(1, np.float32), {"seed": seed}
    def step(action):
        state["t"] += 1
        return np.full(1, state["t"], np.float32), 1.0, state["t"] >= 2, False, {}
    serve(reset=reset, step=step, observation_space=spaces.Box(0, 9, (1,)), action_space=spaces.Discrete(2))
"""


def test_an_env_whose_reset_takes_only_the_seed_resets_partially(pool_factory, env_dir):
    envs = BoltzLabsVecEnv(pool_factory(env_dir(SEED_ONLY), N), autoreset_mode=AutoresetMode.DISABLED)
    envs.reset(seed=5)
    _, _, terminated, _, _ = envs.step(np.array([0, 0]))
    obs, _, terminated, _, _ = envs.step(np.array([0, 0]))
    assert terminated.all()
    obs, infos = envs.reset(seed=[None, 9], options={"reset_mask": np.array([False, True])})
    assert infos["seed"][1] == 9 and infos["_seed"].tolist() == [False, True]
    np.testing.assert_array_equal(obs, [[2], [0]])
    obs, infos = envs.reset(options={})  # an empty dict is no options either
    np.testing.assert_array_equal(obs, [[0], [0]])
    envs.autoreset_mode = AutoresetMode.NEXT_STEP
    for _ in range(3):
        obs, *_ = envs.step(np.array([1, 1]))
    np.testing.assert_array_equal(obs, [[0], [0]])  # the autoresets went through


# --- 4. types on the wire ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP], ids=lambda m: m.name)
def test_tuples_numpy_scalars_and_metadata_survive_the_wire(pool_factory, mode):
    ours, reference = typed_pair(pool_factory, mode, horizon=3)
    assert_same(ours.metadata, reference.metadata)
    assert ours.metadata["sizes"] == (3, 4) and ours.pool.env_contract.metadata["nested"]["pair"] == (1, (2, 3))
    assert_same(env_part(ours.reset(seed=11)), reference.reset(seed=11))
    finals = 0
    for t in range(8):
        action = np.array([t % 3, 1])
        got, want = env_part(ours.step(action)), reference.step(action)
        assert_same(got, want, f"step {t}")  # infos: f32 stays float32, i32 int32, pair a tuple, ...
        if "i32" in want[4]:  # a step's info, not an autoreset's
            assert got[4]["f32"].dtype == np.float32 and got[4]["i32"].dtype == np.int32
            assert type(got[4]["pair"][0]) is tuple
        if "final_obs" in want[4]:
            for i in np.flatnonzero(want[4]["_final_obs"]):
                final = got[4]["final_obs"][i]
                assert final["z"].flags.writeable and final["a"].flags.writeable  # as the env's own arrays
                final["z"][0] = 1.0
                finals += 1
    assert finals >= 2 or mode == AutoresetMode.NEXT_STEP


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP], ids=lambda m: m.name)
def test_graph_spaces_travel_and_their_values_are_graph_instances_both_ways(pool_factory, mode):
    """A Graph observation (in a Dict) and a Graph action, from an env directory, as SyncVectorEnv
    has them: the spaces from the handshake, a batch a tuple of GraphInstance (Gymnasium's
    concatenate), final_obs too; the env is given GraphInstance actions (its step asserts it)."""
    ours = BoltzLabsVecEnv(pool_factory(GRAPH_ENV, N), autoreset_mode=mode)
    reference = SyncVectorEnv([GraphEnv] * N, autoreset_mode=mode)
    spec = ours.pool.env_contract.observation_space["spaces"][0][1]
    assert spec["type"] == "Graph" and spec["node_space"]["type"] == "Box" and spec["edge_space"]["type"] == "Discrete"
    for name in ("single_observation_space", "single_action_space", "observation_space", "action_space"):
        assert getattr(ours, name) == getattr(reference, name), name
    got, want = env_part(ours.reset(seed=5)), reference.reset(seed=5)
    assert_same(got, want)
    assert type(got[0]["graph"][0]) is gym.spaces.GraphInstance and got[0] in ours.observation_space
    reference.action_space.seed(1)
    finals = 0
    for t in range(7):
        action = reference.action_space.sample()  # a tuple of GraphInstance, one per env
        got, want = env_part(ours.step(action)), reference.step(action)
        assert_same(got, want, f"step {t}")  # rewards: the sums of the actions' nodes, seen by the envs
        assert got[0] in ours.observation_space
        if "final_obs" in want[4]:
            for i in np.flatnonzero(want[4]["_final_obs"]):
                assert got[4]["final_obs"][i] in ours.single_observation_space
                finals += 1
    assert finals >= 2 or mode == AutoresetMode.NEXT_STEP
    # A value that is no graph is passed on as sent, for the space to refuse (SyncVectorEnv's too).
    obs, _ = ours.reset(options={"malformed": True})
    assert obs["graph"][0] == ("not", "a", "graph", "at all") and obs not in ours.observation_space


def test_blackjack_final_obs_is_a_tuple_as_in_sync_vector_env(pool_factory):
    mode = AutoresetMode.SAME_STEP
    ours = BoltzLabsVecEnv(pool_factory("gym://Blackjack-v1", N), autoreset_mode=mode)
    reference = SyncVectorEnv([lambda: gym.make("Blackjack-v1")] * N, autoreset_mode=mode)
    assert_same(env_part(ours.reset(seed=4)), reference.reset(seed=4))
    finals = 0
    for t in range(12):
        action = np.array([1, t % 2])  # hit, hit or stick: episodes end soon
        got, want = ours.step(action), reference.step(action)
        assert_same(got[:4], want[:4], f"step {t}")
        if "final_obs" in want[4]:
            assert_same(got[4]["final_obs"], want[4]["final_obs"])
            assert_same(got[4]["_final_obs"], want[4]["_final_obs"])
            finals += int(want[4]["_final_obs"].sum())
    assert finals >= 2


# --- 5. np_random_seed, call, get_attr, set_attr -----------------------------------------------------


def test_call_get_attr_set_attr_reach_a_gym_sources_env(pool_factory):
    ours = BoltzLabsVecEnv(pool_factory("gym://CartPole-v1", N))
    reference = SyncVectorEnv([lambda: gym.make("CartPole-v1")] * N)
    for env in (ours, reference):
        env.reset(seed=42)
    assert ours.np_random_seed == reference.np_random_seed == (42, 43)
    assert ours.pool.get_attr("np_random_seed") == [42, 43]  # the envs' own say the same
    ours.reset(options={"reset_mask": np.array([True, False])})  # unseeded: the seed stays
    assert ours.np_random_seed == (42, 43)
    assert_same(ours.get_attr("gravity"), reference.get_attr("gravity"))
    for env in (ours, reference):
        env.set_attr("gravity", [1.5, 2.5])
        env.set_attr("new_attribute", (7, 8))  # Gymnasium sets what does not exist yet, on the outer wrapper
    assert_same(ours.get_attr("gravity"), reference.get_attr("gravity"))
    assert ours.get_attr("gravity") == (1.5, 2.5)
    assert ours.call("new_attribute") == reference.call("new_attribute") == (7, 8)
    assert_same(ours.call("get_wrapper_attr", "length"), reference.call("get_wrapper_attr", "length"))
    assert ours.pool.call("get_wrapper_attr", "masscart", env_ids=[1]) == [1.0]
    ours.pool.set_attr("gravity", 9.0, env_ids=[0])
    assert ours.pool.get_attr("gravity") == [9.0, 2.5]
    with pytest.raises(AttributeError) as caught:
        ours.get_attr("no_such_thing")
    with pytest.raises(AttributeError):
        reference.get_attr("no_such_thing")
    assert "no_such_thing" in str(caught.value) and "gravity" in str(caught.value)  # names what there is
    with pytest.raises(EnvError, match="cannot cross the wire .*Generator") as caught:
        ours.pool.get_attr("np_random")
    assert caught.value.env_index == 0
    with pytest.raises(ValueError, match="Got `3` values for 2 environments"):
        ours.set_attr("gravity", [1, 2, 3])
    with pytest.raises(ValueError, match="Got `3` values for 2 environments"):
        reference.set_attr("gravity", [1, 2, 3])
    ours.step(np.array([0, 1]))  # the envs serve on


def _entropy_seeds(seeds) -> bool:
    # numpy's SeedSequence draws 128 bits: more than msgpack's 64 (both draw at once below 2**64: 2**-128).
    return (
        len(set(seeds)) == N
        and all(type(s) is int and 0 <= s < 2**128 for s in seeds)
        and any(s >= 2**64 for s in seeds)
    )


def test_np_random_seed_of_an_unseeded_env_is_drawn_when_first_asked_for(pool_factory):
    """Gymnasium's Env.np_random_seed makes the env's generator from a seed drawn from entropy
    when there is none; SyncVectorEnv reads it so, and so does ours, each 128-bit seed whole."""
    ours = BoltzLabsVecEnv(pool_factory("gym://CartPole-v1", N))
    reference = SyncVectorEnv([lambda: gym.make("CartPole-v1")] * N)
    for envs in (ours, reference):
        drawn = envs.np_random_seed
        assert _entropy_seeds(drawn), drawn
        assert envs.np_random_seed == drawn  # drawn once, then kept
        obs, _ = envs.reset()  # unseeded: the generator made at the read is the one the reset uses
        for i in range(N):
            np.testing.assert_array_equal(obs[i], gym.make("CartPole-v1").reset(seed=drawn[i])[0])
        assert envs.np_random_seed == drawn
        envs.reset(seed=42)
        assert envs.np_random_seed == (42, 43)


def test_np_random_seed_after_an_unseeded_first_reset_is_the_seed_the_env_drew(pool_factory):
    ours = BoltzLabsVecEnv(pool_factory("gym://CartPole-v1", N))
    reference = SyncVectorEnv([lambda: gym.make("CartPole-v1")] * N)
    for envs in (reference, ours):
        obs, _ = envs.reset()  # CartPole's reset draws from self.np_random: a seed from entropy
        drawn = envs.np_random_seed
        assert _entropy_seeds(drawn), drawn
        for i in range(N):
            np.testing.assert_array_equal(obs[i], gym.make("CartPole-v1").reset(seed=drawn[i])[0])
    ours.pool.reset(hard=True)  # fresh envs, with no generator: a new draw
    assert _entropy_seeds(ours.np_random_seed) and set(ours.np_random_seed).isdisjoint(drawn)


HOSTILE_SEED = """
    from boltzlabs.env import serve
    from gymnasium import spaces
    state = {"seed": 7}
    def sent(value):
        state["seed"] = value
    serve(reset=lambda seed: 0, step=lambda action: (0, 0.0, False, {}),
          observation_space=spaces.Discrete(2), action_space=spaces.Discrete(2),
          methods={"boltzlabs_np_random_seed": lambda: state["seed"]},  # the adapter's question (gym_serve.py)
          attributes={"sent": (lambda: state["seed"], sent)})
"""


def test_a_seed_an_env_sends_is_checked_and_a_bad_one_fails_its_lane(pool_factory, env_dir):
    """np_random_seed crosses the wire as an int (msgpack's 64 bits) or as decimal digits; the
    adapter reads it as untrusted input: anything else is an EnvError naming the lane."""
    ours = BoltzLabsVecEnv(pool_factory(env_dir(HOSTILE_SEED), N))
    for good, read in [("9" * 78, int("9" * 78)), (2**64 - 1, 2**64 - 1), (-1, -1), ("007", 7)]:
        ours.set_attr("sent", [7, good])
        assert ours.np_random_seed == (7, read)
    too_long = ["9" * 79, "1" * 1_000_000]
    not_digits = ["", "12a", "-5", " 5", "5\n", "\u0665", "1_000"]
    not_seeds = [-2, 1.5, True, None, [1], b"5", {"seed": 5}, (5,)]
    for value in too_long + not_digits + not_seeds:
        ours.set_attr("sent", [7, value])
        with pytest.raises(EnvError, match=r"env 1 sent .* as its np_random_seed, which is not a seed") as caught:
            _ = ours.np_random_seed
        assert caught.value.env_index == 1, value
    ours.set_attr("sent", [7, 8])
    assert ours.np_random_seed == (7, 8)  # the envs serve on
    ours.reset()
    ours.step(np.array([0, 1]))


def test_call_get_attr_set_attr_reach_only_what_a_served_env_offers(pool_factory):
    ours, reference = typed_pair(pool_factory)
    for env in (ours, reference):
        env.reset(seed=1)
    assert_same(ours.call("scaled", 4, by=3), reference.call("scaled", 4, by=3))  # a tuple with a float32 in it
    assert ours.call("scaled", (1, 2)) == (((1, 2, 1, 2), np.float32(1.0)),) * N
    assert_same(ours.get_attr("gain"), reference.get_attr("gain"))
    ours.set_attr("gain", [2.0, 3.0])
    assert ours.get_attr("gain") == (2.0, 3.0) and ours.pool.get_attr("label") == ["typed", "typed"]
    assert ours.pool.get_attr("np_random_seed", env_ids=[1]) == [2]
    _, rewards, *_ = ours.step(np.array([0, 0]))
    assert rewards.tolist() == [2.0, 3.0]  # the setter reached the env
    offered = ours.pool.env_contract.attributes
    assert offered == {
        "methods": ["explode", "scaled"],
        "attributes": {"gain": True, "label": False, "np_random_seed": False},
        "target": None,
    }
    # Refused in this process, before anything is sent, naming what the env offers.
    with pytest.raises(AttributeError, match=r"no method or attribute 'reset'.*\['explode', 'scaled'\].*'gain'"):
        ours.call("reset")
    with pytest.raises(AttributeError, match="'label' is read-only"):
        ours.pool.set_attr("label", "x")
    with pytest.raises(AttributeError, match="'scaled' is a method of the env, not an attribute"):
        ours.pool.get_attr("scaled")
    with pytest.raises(EnvError, match="(?s)env 0 could not call 'explode' .1 other.*ZeroDivisionError"):
        ours.call("explode")
    with pytest.raises(TypeError, match="cannot cross the wire"):
        ours.call("scaled", object())
    ours.step(np.array([0, 0]))


FAULTY_METHODS = """
    import os, time
    from boltzlabs.env import serve
    def reset(seed):
        return 0
    def step(action):
        return 0, 0.0, False, {}
    def deep():
        value = ()
        for _ in range(40):
            value = (value,)
        return value
    serve(reset=reset, step=step, methods={
        "hang": lambda lane: time.sleep(60) if lane == int(os.environ["BOLTZLABS_ENV_INDEX"]) else "ok",
        "die": lambda lane: os._exit(4) if lane == int(os.environ["BOLTZLABS_ENV_INDEX"]) else "ok",
        "deep": deep, "ping": lambda: "pong"})
"""


@pytest.mark.parametrize(
    "fault, error",
    [
        ("hang", "env 0 could not call 'hang': missed the call deadline of 1 s"),
        ("die", "env 0 could not call 'die': env is dead .*exited with code 4"),
        ("deep", "(?s)env 0 could not call 'deep' .1 other.*tuples nested more than 32 deep"),
    ],
)
def test_a_call_that_hangs_crashes_or_returns_too_much_fails_its_lane(pool_factory, env_dir, fault, error):
    pool = pool_factory(env_dir(FAULTY_METHODS), N, step_timeout=1.0)
    pool.reset()
    with pytest.raises(EnvError, match=error) as caught:
        pool.call(fault, 0) if fault != "deep" else pool.call("deep")
    assert caught.value.env_index == 0
    assert pool.call("ping", env_ids=[1]) == ["pong"]  # the other lane is untouched
    pool.reset(where=[0])  # a stuck or dead env is respawned
    assert pool.call("ping") == ["pong", "pong"]


# --- 6. seeds --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "seed, error",
    [
        (-1, gym_error.Error),
        ([3, -5], gym_error.Error),
        ([1.5, 2], gym_error.Error),
        ([np.int64(1), 2], gym_error.Error),
        ([1, 2, 3], ValueError),
        ([1], ValueError),
        (1.5, TypeError),
        (np.int64(3), TypeError),
    ],
    ids=repr,
)
def test_seeds_are_checked_as_gymnasium_checks_them_before_anything_runs(pool_factory, seed, error):
    ours = BoltzLabsVecEnv(pool_factory("gym://CartPole-v1", N))
    reference = SyncVectorEnv([lambda: gym.make("CartPole-v1")] * N)
    ours.reset(seed=0)
    before = list(ours.pool.episode_ids)
    with pytest.raises(error):
        reference.reset(seed=seed)
    with pytest.raises(error) as caught:
        ours.reset(seed=seed)
    assert type(caught.value) is error or issubclass(type(caught.value), error)
    assert ours.pool.episode_ids == before  # no env was reset
    assert ours.np_random_seed == (0, 1)


def test_the_pool_refuses_seeds_that_are_not_whole_numbers(pool_factory, env_dir):
    pool = pool_factory(env_dir(SEED_ONLY), N)
    with pytest.raises(TypeError, match="env 1's seed is 2.5"):
        pool.reset(seed=[1, 2.5])
    with pytest.raises(TypeError, match="env 0's seed is True"):
        pool.reset(seed=[True, 2])
    assert pool.reset(seed=[1, np.int64(2)])[1] is not None
    assert pool.reset_infos[1]["seed"] == 2


HOSTILE_ATTRS = """
    from boltzlabs import wire
    from boltzlabs.env import serve
    from boltzlabs.runtime import serve as runtime
    # A handshake whose list of methods is garbage: the client must not trust it.
    runtime._Attributes.describe = lambda self: {"methods": "all of them", "attributes": [1, 2], "target": 5}
    def reset(seed):
        return 0
    def step(action):
        return 0, 0.0, False, {}
    def lie():  # from now on this env answers an ATTR with a STEPPED of the right sequence number
        runtime._attr_reply = lambda seq, value: [wire.STEPPED, seq, 0, 0.0, False, False, {}]
        return "ok"
    serve(reset=reset, step=step, methods={"lie": lie, "ping": lambda: "pong"})
"""


def test_a_hostile_handshake_or_attr_reply_fails_only_its_lane(pool_factory, env_dir):
    pool = pool_factory(env_dir(HOSTILE_ATTRS), N)
    assert pool.env_contract.attributes is None  # refused: the envs are asked instead
    pool.reset()
    with pytest.raises(AttributeError, match="no method or attribute 'nope'"):
        pool.call("nope")
    assert pool.call("lie", env_ids=[0]) == ["ok"]
    with pytest.raises(EnvError, match="env 0 could not call 'ping': env is dead .*malformed reply") as caught:
        pool.call("ping")
    assert caught.value.env_index == 0 and pool.states() == ["dead", "idle"]
    assert pool.call("ping", env_ids=[1]) == ["pong"]
    pool.reset(where=[0])
    assert pool.call("ping") == ["pong", "pong"]
