"""The Gymnasium adapter and gym sources, against in-process Gymnasium.

Parity: the same seeds, actions and partial resets through BoltzLabsVecEnv
(each env in a sandbox) and gymnasium.vector.SyncVectorEnv (in process) give
equal arrays -- observations, rewards, terminations, truncations and the
envs' infos -- for CartPole, Pendulum and a Dict-observation env, in every
autoreset mode. Then: Gymnasium's wrappers on top, bad ids and params refused
before any sandbox starts, terminations and truncations apart, episode ids
and records, the env contract, render, and failures on a lane.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import uuid
import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import data_equivalence
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from gymnasium.wrappers.vector import NormalizeObservation, RecordEpisodeStatistics

from boltzlabs import RLPool, wire
from boltzlabs.pool import sources
from boltzlabs.errors import EnvError
from boltzlabs.gym import BoltzLabsVecEnv

from conftest import TESTS, env_class

DICT_ENV = TESTS / "envs" / "dict_env"
N = 3
RUNTIME_KEYS = {"episode_ids", "_episode_ids", "episode_record", "_episode_record"}


DictEnv = env_class(DICT_ENV, "DictEnv")

# name: (source, params, in-process factory)
CASES = {
    "CartPole": ("gym://CartPole-v1", {}, lambda: gym.make("CartPole-v1")),
    "Pendulum": ("gym://Pendulum-v1", {"max_episode_steps": 9}, lambda: gym.make("Pendulum-v1", max_episode_steps=9)),
    "Dict": (str(DICT_ENV), {"horizon": 7}, lambda: DictEnv(horizon=7)),
}
MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED]


@pytest.fixture(scope="module")
def pools():
    """One pool per source for the whole module; adapters over it are cheap."""
    made = {}

    def get(name):
        if name not in made:
            source, params, _ = CASES[name]
            made[name] = RLPool(source, N, step_timeout=30.0, **params)
        return made[name]

    yield get
    for pool in made.values():
        pool.close()


def assert_same(got, want, where="value"):
    """Equal trees of arrays: same keys, dtypes, shapes and values (nan == nan)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{where}: keys {sorted(got)} != {sorted(want)}"
        for key in want:
            assert_same(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray), f"{where}: {type(got)}"
        assert got.dtype == want.dtype and got.shape == want.shape, (
            f"{where}: {got.dtype}{got.shape} != {want.dtype}{want.shape}"
        )
        if want.dtype == object:
            for i, (g, w) in enumerate(zip(got, want)):
                assert_same(g, w, f"{where}[{i}]")
        else:
            np.testing.assert_array_equal(got, want, err_msg=where)
    else:
        assert type(got) is type(want) and got == want, f"{where}: {got!r} != {want!r}"


def env_keys(infos: dict) -> dict:
    return {k: v for k, v in infos.items() if k not in RUNTIME_KEYS}


def drive(venv, mode, actions, seed=42):
    """A fixed script: seeded reset, steps, a seeded partial reset with options
    at step 5, and in DISABLED mode the resets a user must do."""
    trace = []
    obs, infos = venv.reset(seed=seed)
    trace.append(("reset", obs, env_keys(infos)))
    for t, action in enumerate(actions):
        obs, rewards, terminations, truncations, infos = venv.step(action)
        trace.append(("step", obs, rewards, terminations, truncations, env_keys(infos)))
        mask = np.zeros(N, dtype=np.bool_)
        if t == 5:
            mask[[0, 2]] = True
        if mode == AutoresetMode.DISABLED:
            mask |= terminations | truncations
        if mask.any():
            seeds = [1000 + t, None, 7] if t == 5 else None
            obs, infos = venv.reset(seed=seeds, options={"reset_mask": mask, "tag": t})
            trace.append(("partial reset", obs, env_keys(infos)))
    return trace


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("name", list(CASES))
def test_trajectory_parity_with_sync_vector_env(pools, name, mode):
    _, _, factory = CASES[name]
    reference = SyncVectorEnv([factory] * N, autoreset_mode=mode)
    ours = BoltzLabsVecEnv(pools(name), autoreset_mode=mode)
    assert ours.single_observation_space == reference.single_observation_space
    assert ours.single_action_space == reference.single_action_space
    assert ours.observation_space == reference.observation_space
    assert ours.action_space == reference.action_space
    assert ours.metadata == reference.metadata  # autoreset_mode included
    reference.action_space.seed(0)
    actions = [reference.action_space.sample() for _ in range(80)]
    want = drive(reference, mode, actions)
    got = drive(ours, mode, actions)
    assert [entry[0] for entry in got] == [entry[0] for entry in want]
    dones = 0
    for k, (g, w) in enumerate(zip(got, want)):
        for j, (a, b) in enumerate(zip(g[1:], w[1:])):
            assert_same(a, b, f"{g[0]} #{k} item {j}")
        if g[0] == "step":
            dones += int((g[3] | g[4]).sum())
            assert g[2].dtype == np.float64
    assert dones >= 2, "the script must cross episode boundaries"
    reference.close()


def test_wrappers_on_top_match_sync_vector_env(pools):
    pool = pools("CartPole")
    ours = NormalizeObservation(RecordEpisodeStatistics(BoltzLabsVecEnv(pool)))
    reference = NormalizeObservation(RecordEpisodeStatistics(SyncVectorEnv([CASES["CartPole"][2]] * N)))
    reference.action_space.seed(1)
    seen = 0
    for envs in (ours, reference):
        envs.reset(seed=3)
    for _ in range(60):
        action = reference.action_space.sample()
        got, want = ours.step(action), reference.step(action)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6)  # normalized observations
        for a, b in zip(got[1:4], want[1:4]):
            assert_same(a, b)
        if "episode" in want[4]:
            seen += 1
            for key in ("r", "l"):
                assert_same(got[4]["episode"][key], want[4]["episode"][key])
            # RecordEpisodeStatistics and our own episode_record agree
            mask = got[4]["_episode_record"]
            np.testing.assert_array_equal(got[4]["_episode"], mask)
            np.testing.assert_array_equal(got[4]["episode_record"]["length"][mask], got[4]["episode"]["l"][mask])
            np.testing.assert_array_equal(got[4]["episode_record"]["return"][mask], got[4]["episode"]["r"][mask])
    assert seen >= 2
    assert list(ours.env.return_queue) == list(reference.env.return_queue)


def test_make_and_the_contract(monkeypatch):
    envs = BoltzLabsVecEnv.make("CartPole-v1", num_envs=2, sutton_barto_reward=True)
    try:
        assert isinstance(envs, gym.vector.VectorEnv) and envs.num_envs == 2
        assert uuid.UUID(envs.env_id).version == 7
        contract = envs.env_contract
        assert contract.id == "CartPole-v1" and contract.render_mode is None
        assert contract.protocol_version == wire.PROTOCOL_VERSION
        assert contract.observation_space["type"] == "Box" and contract.action_space == envs.action_space_spec
        assert contract.metadata["render_fps"] == 50
        assert envs.metadata["autoreset_mode"] is AutoresetMode.NEXT_STEP
        obs, infos = envs.reset(seed=0)
        assert obs in envs.observation_space
        _, rewards, *_ = envs.step(np.array([1, 1]))
        assert rewards.tolist() == [0.0, 0.0]  # the param reached gymnasium.make
        assert envs.render() == (None, None)  # render_mode None, like SyncVectorEnv
    finally:
        envs.close()
    assert envs.closed and envs.pool.closed
    envs.close()  # idempotent


@pytest.fixture
def no_sandbox(monkeypatch):
    """Fail the test if a worker (and so any sandbox) is started."""

    def refuse(self, *args):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(RLPool, "_start_worker", refuse)


@pytest.mark.parametrize(
    "source, params, error, match",
    [
        ("CartPol-v1", {}, ValueError, "not a registered Gymnasium id.*did you mean 'CartPole-v1'"),
        ("gym://Nope-v0", {}, ValueError, "not a registered Gymnasium id"),
        ("gym://CartPole-v9", {}, ValueError, "not a registered Gymnasium id"),
        ("gym://nomodule_xyz:Thing-v0", {}, ValueError, "cannot import 'nomodule_xyz'"),
        ("CartPole-v1", {"gravity": 3}, ValueError, "'CartPole-v1' takes no argument 'gravity'"),
        ("CartPole-v1", {"render_mod": "rgb_array"}, ValueError, "did you mean 'render_mode'"),
        ("CartPole-v1", {"render_mode": "ansi"}, ValueError, "has no render_mode 'ansi'"),
        ("Pendulum-v1", {"g": object()}, TypeError, "must be JSON values"),
    ],
)
def test_bad_ids_and_params_are_refused_before_any_sandbox_starts(no_sandbox, source, params, error, match):
    with pytest.raises(error, match=match):
        RLPool(source, 2, **params)
    with pytest.raises(error, match=match):
        BoltzLabsVecEnv.make(source, num_envs=2, **params)


def test_good_params_pass_the_check(no_sandbox):
    # Constructor params, gymnasium.make's own, and module-prefixed ids.
    for source, params in [
        ("CartPole-v1", {"render_mode": "rgb_array", "sutton_barto_reward": True}),
        ("gym://Pendulum-v1", {"g": 9.0, "max_episode_steps": 5}),
        ("gymnasium.envs.classic_control:MountainCar-v0", {"goal_velocity": 0.1}),
    ]:
        with pytest.raises(AssertionError, match="a worker was started"):
            RLPool(source, 1, **params)


READS_PARAMS = """
    from boltzlabs.env import params, serve
    serve(reset=lambda seed, options=None: params(), step=lambda a: (0, 0.0, False, {}))
"""
IGNORES_PARAMS = """
    from boltzlabs.env import serve
    serve(reset=lambda seed, options=None: "no params read", step=lambda a: (0, 0.0, False, {}))
"""


def test_params_reach_an_env_directory_as_keywords_or_in_params(env_dir):
    source = env_dir(READS_PARAMS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no word about any of them: they are read
        pool = RLPool(source, 1, params={"step_timout": 5, "worker_id": 2}, size=(3, 4), name="x")
    with pool:  # a param named like a misspelt option goes in params={...}; JSON: tuples arrive as lists
        assert pool.reset() == [{"step_timout": 5, "worker_id": 2, "size": [3, 4], "name": "x"}]


def _thunk():
    return gym.make("CartPole-v1")


class _LimitedEnv(gym.Env):
    """A Gymnasium env whose constructor names params that look like RLPool's options."""

    def __init__(self, limit=1, worker_id=0):
        self.limit, self.worker_id = limit, worker_id


# No module of its own (a partial of a class of this file): nothing for the sandbox to import first.
gym.register("BoltzLabsTest/Limited-v0", entry_point=functools.partial(_LimitedEnv))


@pytest.mark.parametrize(
    "make, name, option",
    [
        (lambda dir, **kw: RLPool(dir, 2, **kw), "step_timout", "step_timeout"),
        (lambda dir, **kw: RLPool(dir, 2, workers=2, **kw), "memory_limt", "memory_limit"),  # sharded
        (lambda dir, **kw: RLPool("CartPole-v1", 2, **kw), "memory_limt", "memory_limit"),
        pytest.param(
            lambda dir, **kw: RLPool("gym://HalfCheetah-v5", 2, **kw),  # a constructor that takes **kwargs
            "steps_timeout",
            "step_timeout",
            marks=pytest.mark.skipif(importlib.util.find_spec("mujoco") is None, reason="mujoco is not installed"),
        ),
        (lambda dir, **kw: RLPool([_thunk] * 2, 2, **kw), "step_timout", "step_timeout"),
        (lambda dir, **kw: BoltzLabsVecEnv([_thunk] * 2, **kw), "start_timout", "start_timeout"),
        (lambda dir, **kw: BoltzLabsVecEnv.make("CartPole-v1", 2, **kw), "autoreset_mod", "autoreset_mode"),
        (lambda dir, **kw: BoltzLabsVecEnv.make(dir, 2, **kw), "observaton_space", "observation_space"),
        (lambda dir, **kw: RLPool(dir, 2, **kw), "worker_id", "worker"),  # an env param of that name: params=
    ],
    ids=[
        "env dir",
        "sharded",
        "gym id",
        "gym id with **kwargs",
        "env_fns",
        "adapter env_fns",
        "adapter option",
        "adapter env dir",
        "a param named like an option",
    ],
)
def test_a_misspelt_option_is_refused_naming_it_before_any_sandbox_starts(no_sandbox, env_dir, make, name, option):
    source = env_dir(READS_PARAMS)
    with pytest.raises(TypeError, match=rf"unknown option '{name}': did you mean '{option}'\? \((.*params=|env_fns)"):
        make(source, **{name: 5})


def test_a_gym_constructor_names_its_own_params_whatever_option_they_resemble(no_sandbox):
    with pytest.raises(AssertionError, match="a worker was started"):  # the check passed
        RLPool("gym://BoltzLabsTest/Limited-v0", 1, limit=3, worker_id=2)
    with pytest.raises(ValueError, match="takes no argument 'limt'; did you mean 'limit'"):
        RLPool("gym://BoltzLabsTest/Limited-v0", 1, limt=3)  # nearer the env's own than the option 'limits'
    with pytest.raises(TypeError, match="unknown option 'limitss': did you mean 'limits'"):
        RLPool("gym://BoltzLabsTest/Limited-v0", 1, limitss=3)


@pytest.mark.parametrize(
    "source, error, match",
    [
        ("CartPole-v1", ValueError, "'CartPole-v1' takes no argument 'colour'"),
        ([_thunk], TypeError, "env_fns carry their own arguments; these are not options of the pool: colour"),
    ],
    ids=["gym id", "env_fns"],
)
def test_an_unknown_keyword_is_refused_by_a_source_that_takes_no_such_param(no_sandbox, source, error, match):
    with pytest.raises(error, match=match):
        RLPool(source, 1, colour="red")
    with pytest.raises(error, match=match):
        RLPool(source, 1, params={"colour": "red"})


def test_params_given_twice_or_not_as_a_dict_are_refused(no_sandbox, env_dir):
    source = env_dir(READS_PARAMS)
    with pytest.raises(TypeError, match="env param 'level' is given twice"):
        RLPool(source, 1, level=1, params={"level": 2})
    with pytest.raises(TypeError, match="params must be a dict"):
        RLPool(source, 1, params=[("level", 1)])


def test_params_an_env_directory_never_reads_are_warned_about_once(env_dir):
    source = env_dir(IGNORES_PARAMS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for workers in (1, 1, 2):  # the same params again, and a sharded pool: no second warning
            with RLPool(source, 2, workers=workers, level=3, warmup=False) as pool:
                assert pool.reset() == ["no params read"] * 2  # they went nowhere; the env runs
        with RLPool(source, 2, params={"levl": 3}, memory_cap="1G", warmup=False) as pool:
            pool.reset()
    unread = [w for w in caught if "never reads them" in str(w.message)]
    assert [str(w.message).split(" go to ")[0] for w in unread] == [
        "env params 'level'",
        "env params 'levl', 'memory_cap'",
    ]
    assert all(w.category is UserWarning and w.filename == __file__ for w in unread)  # at the caller's line
    assert f"go to {source}, whose code never reads them" in str(unread[0].message)
    assert "Did you mean the option 'memory_limit' for 'memory_cap'?" in str(unread[1].message)


def test_every_adapter_keyword_is_an_option_a_misspelling_is_checked_against():
    """The layers above RLPool pass the keywords they do not take on to it: a misspelling of one of
    theirs arrives as a bare keyword, to be compared with their names too (keywords.ADAPTER_OPTIONS)."""
    import inspect

    from boltzlabs.cluster import ClusterPool
    from boltzlabs.pool import keywords

    layers = [BoltzLabsVecEnv.__init__, BoltzLabsVecEnv.make, ClusterPool.__init__]
    if importlib.util.find_spec("stable_baselines3") is not None:
        from boltzlabs.sb3 import BoltzLabsSB3VecEnv

        layers.append(BoltzLabsSB3VecEnv.__init__)
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    theirs = {name for f in layers for name, p in inspect.signature(f).parameters.items() if p.kind in named}
    assert theirs - {"self", "cls", "env_fns", "source", "n"} <= set(keywords.options(RLPool.__init__))


def test_reading_params_anywhere_in_an_env_directory_counts(tmp_path):
    from boltzlabs.pool.keywords import reads_params

    (tmp_path / "env.py").write_text("import helper\nhelper.main()\n")
    assert not reads_params(tmp_path)
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "helper.py").write_text("import boltzlabs.env as be\nlevel = be.params ( )['level']\n")
    assert reads_params(tmp_path)
    (tmp_path / "lib" / "helper.py").write_text("import os, json\njson.loads(os.environ['BOLTZLABS_PARAMS'])\n")
    assert reads_params(tmp_path)
    (tmp_path / "lib" / "helper.py").write_text("from boltzlabs.env import params as p\n")
    assert reads_params(tmp_path)
    (tmp_path / "lib" / "helper.py").write_text("def get_params(): pass\n")
    assert not reads_params(tmp_path)


def test_a_path_that_exists_wins_over_a_gym_id(tmp_path, monkeypatch):
    (tmp_path / "CartPole-v1").mkdir()
    (tmp_path / "CartPole-v1" / "env.py").write_text("")
    monkeypatch.chdir(tmp_path)
    assert sources.resolve("CartPole-v1", {}).gym_id is None
    assert sources.resolve("gym://CartPole-v1", {}).gym_id == "CartPole-v1"  # the prefix is always gym
    assert sources.resolve("Pendulum-v1", {}).gym_id == "Pendulum-v1"
    with pytest.raises(ValueError, match="is not a directory"):
        sources.resolve("./Pendulum-v1", {})  # spelled as a path: a path


def test_terminations_and_truncations_are_kept_apart(pools):
    # Pendulum only truncates (time limit); the Dict env terminates (distance) and truncates (horizon).
    pool = pools("Pendulum")
    pool.reset(seed=0)
    for _t in range(9):
        _, _, dones, _ = pool.step(np.zeros((N, 1), np.float32))
    assert dones.all() and pool.truncated.all() and not pool.terminated.any()
    envs = BoltzLabsVecEnv(pools("Dict"))
    envs.reset(seed=0)
    kinds = set()
    for _ in range(60):
        # lane 0 walks away (terminates), the others stand still (truncated at the horizon)
        _, _, terminations, truncations, infos = envs.step(np.array([[2, 1], [1, 1], [1, 1]]))
        np.testing.assert_array_equal(terminations, envs.pool.terminated)
        np.testing.assert_array_equal(truncations, envs.pool.truncated)
        kinds |= {"terminated"} if terminations.any() else set()
        kinds |= {"truncated"} if truncations.any() else set()
    assert kinds == {"terminated", "truncated"}


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP], ids=lambda m: m.name)
def test_episode_ids_and_records(pools, mode):
    envs = BoltzLabsVecEnv(pools("Dict"), autoreset_mode=mode)
    _, infos = envs.reset(seed=[5, 6, 7])
    ids = list(infos["episode_ids"])
    assert all(uuid.UUID(i).version == 7 for i in ids) and len(set(ids)) == N
    assert infos["_episode_ids"].all() and envs.completed_episodes == 0
    returns, lengths, seeds = np.zeros(N), np.zeros(N, int), [5, 6, 7]
    pending_reset = np.zeros(N, bool)
    all_ids = set(ids)
    records = 0
    for _ in range(40):
        _, rewards, terminations, truncations, infos = envs.step(np.array([[2, 1]] * N))
        done = terminations | truncations
        counted = ~pending_reset  # NEXT_STEP: a reset step counts toward no episode
        returns[counted] += rewards[counted]
        lengths[counted] += 1
        assert envs.completed_episodes == int(done.sum())
        if done.any():
            record, mask = infos["episode_record"], infos["_episode_record"]
            np.testing.assert_array_equal(mask, done)
            for i in np.flatnonzero(done):
                assert record["id"][i] == ids[i]
                assert record["seed"][i] == seeds[i]
                assert record["length"][i] == lengths[i]
                assert record["return"][i] == pytest.approx(returns[i], rel=1e-12)
                records += 1
            returns[done], lengths[done] = 0.0, 0
            for i in np.flatnonzero(done):
                seeds[i] = None  # autoresets are unseeded
        else:
            assert "episode_record" not in infos
        new_ids = list(infos["episode_ids"])
        if mode == AutoresetMode.SAME_STEP:
            changed = done  # the obs returned already belong to the new episode
        else:
            changed = pending_reset
            pending_reset = done
        for i in range(N):
            assert (new_ids[i] != ids[i]) == bool(changed[i])
        all_ids |= set(new_ids)
        ids = new_ids
    assert records >= 3 and len(all_ids) == N + records - int(pending_reset.sum()) * (mode == AutoresetMode.NEXT_STEP)


SHADOW = """
    from boltzlabs.env import serve
    from gymnasium import spaces
    serve(reset=lambda seed, options=None: (0, {"episode_ids": "mine"}),
          step=lambda a: (0, 1.0, True, False, {"episode_record": "mine too"}),
          observation_space=spaces.Discrete(3), action_space=spaces.Discrete(2))
"""


def test_an_env_key_shadows_the_runtime_key_logged_once(env_dir, caplog):
    envs = BoltzLabsVecEnv(RLPool(env_dir(SHADOW), 2))
    try:
        with caplog.at_level(logging.WARNING, logger="boltzlabs"):
            _, infos = envs.reset()
            assert list(infos["episode_ids"]) == ["mine", "mine"]
            for t in range(4):
                _, _, _, _, infos = envs.step(np.array([0, 1]))
                if t % 2 == 0:  # both episodes ended: the env's episode_record wins over ours
                    assert list(infos["episode_record"]) == ["mine too"] * 2 and envs.completed_episodes == 2
                    assert len(infos["episode_ids"]) == 2 and infos["episode_ids"][0] != "mine"
                else:  # the next-step autoreset: its info's episode_ids wins
                    assert list(infos["episode_ids"]) == ["mine", "mine"] and "episode_record" not in infos
        shadows = [r.getMessage() for r in caplog.records if "shadows" in r.getMessage()]
        assert len(shadows) == 2, shadows  # once per key, not once per step
    finally:
        envs.close()


def test_render_one_env_or_all(pools):
    pool = RLPool(str(DICT_ENV), 2, render_mode="rgb_array", horizon=50)
    envs = BoltzLabsVecEnv(pool)
    try:
        assert envs.render_mode == "rgb_array" and pool.env_contract.render_mode == "rgb_array"
        envs.reset(seed=0)
        envs.step(np.array([[1, 1], [1, 1]]))
        frame = pool.render(env_index=1)
        assert frame.shape == (8, 8, 3) and frame.dtype == np.uint8 and (frame == 1).all()
        frames = envs.render()
        assert isinstance(frames, tuple) and len(frames) == 2 and all((f == 1).all() for f in frames)
        with pytest.raises(ValueError, match=r"env index must be in \[0, 2\)"):
            pool.render(env_index=2)
    finally:
        envs.close()
    # No render_mode: no frame, as the env says.
    assert pools("Dict").render(0) is None


def test_render_of_a_gym_source():
    with RLPool("gym://CartPole-v1", 1, render_mode="rgb_array") as pool:
        pool.reset(seed=0)
        try:
            import pygame  # noqa: F401
        except ImportError:
            with pytest.raises(EnvError, match="pygame is not installed"):
                pool.render()
        else:
            assert pool.render().shape == (400, 600, 3)
        pool.step([0])  # the env is still fine


def test_the_adapter_needs_declared_spaces(probe_pool):
    with pytest.raises(ValueError, match="declared no observation_space"):
        BoltzLabsVecEnv(probe_pool(1))


GRAPHS = [
    gym.spaces.Graph(node_space=gym.spaces.Box(-1, 1, (2,)), edge_space=None),
    gym.spaces.Graph(node_space=gym.spaces.Discrete(5), edge_space=gym.spaces.Box(-100, 100, (3, 4))),
    gym.spaces.Graph(
        node_space=gym.spaces.Dict([("pos", gym.spaces.Box(-10, 10, (3,))), ("label", gym.spaces.Discrete(5))]),
        edge_space=gym.spaces.Tuple((gym.spaces.Discrete(4), gym.spaces.Box(0, 1, (2,)))),
    ),
    gym.spaces.Sequence(gym.spaces.Graph(node_space=gym.spaces.Box(-1, 1, (2,)), edge_space=gym.spaces.Discrete(4))),
    gym.spaces.OneOf([gym.spaces.Discrete(2), gym.spaces.Graph(node_space=gym.spaces.MultiBinary(3), edge_space=None)]),
]


@pytest.mark.parametrize("space", GRAPHS, ids=repr)
def test_graph_specs_round_trip_and_their_values_come_back_as_graph_instances(space):
    """The spec's two halves (runtime/spec.py in the env, pool/spaces.py in the trainer) and the
    restorer both sides run on what the wire delivers (tests/test_gym_compat.py runs them in pools)."""
    from boltzlabs.pool.spaces import from_spec
    from boltzlabs.runtime.spec import graph_restorer, to_spec

    def across(value):  # as a frame delivers it: a step's action, or a reply's obs
        return wire.FrameReader(wire.Limits(1 << 20)).feed(wire.encode([wire.STEP, 0, value, False]))[0][2]

    assert from_spec(across(to_spec(space))) == space
    space.seed(3)
    for _ in range(5):
        value = space.sample()
        restored = graph_restorer(space)(across(value))  # each GraphInstance arrived a plain tuple
        assert restored in space and data_equivalence(restored, value, exact=True)  # types too


def test_a_malformed_graph_spec_or_value_is_refused_or_passed_on_never_a_crash():
    from boltzlabs.pool.spaces import from_spec
    from boltzlabs.runtime.spec import graph_restorer

    box = {"type": "Box", "low": 0, "high": 1, "shape": [2], "dtype": "float32"}
    for spec in [
        {"type": "Graph"},
        {"type": "Graph", "node_space": None, "edge_space": None},
        {"type": "Graph", "node_space": "Box", "edge_space": None},
        {"type": "Graph", "node_space": box, "edge_space": {"type": "Box"}},
    ]:
        with pytest.raises(ValueError, match="malformed|cannot describe"):
            from_spec(spec)
    restore = graph_restorer(GRAPHS[0])
    for value in [None, "graph", (), (1, 2), (1, 2, 3, 4), {"nodes": 1}, np.zeros(3)]:
        assert restore(value) is value
    one_of = graph_restorer(GRAPHS[4])
    for value in [(7, (np.zeros((1, 3)), None, None)), (-1, ()), ("0", ()), (0,), 5]:
        assert one_of(value) is value
    assert graph_restorer(gym.spaces.Box(0, 1)) is None  # no Graph: nothing to do


FLAKY = """
    import numpy as np
    from boltzlabs.env import serve
    from gymnasium import spaces
    state = {"t": 0}
    def reset(seed, options=None):
        state["t"] = 0
        return np.zeros(2, np.float32), {}
    def step(action):
        if action == 1:
            raise RuntimeError("boom on purpose")
        state["t"] += 1
        return np.full(2, state["t"], np.float32), 1.0, False, False, {}
    serve(reset=reset, step=step, observation_space=spaces.Box(-9, 9, (2,)), action_space=spaces.Discrete(2))
"""


def test_a_failing_lane_is_truncated_with_its_error_then_autoreset(env_dir):
    # The env raises on purpose, so the warm-up probe fails too (a RuntimeWarning) and the pool runs.
    with pytest.warns(RuntimeWarning, match="probe failed"):
        pool = RLPool(env_dir(FLAKY), 2)
    envs = BoltzLabsVecEnv(pool)
    try:
        envs.reset()
        envs.step(np.array([0, 0]))
        obs, rewards, terminations, truncations, infos = envs.step(np.array([1, 0]))
        assert truncations.tolist() == [True, False] and not terminations.any()
        assert "boom on purpose" in infos["error"][0] and infos["_error"].tolist() == [True, False]
        np.testing.assert_array_equal(obs, [[1, 1], [2, 2]])  # lane 0 keeps its last observation
        obs, rewards, *_ = envs.step(np.array([0, 0]))  # next step: lane 0 autoresets
        np.testing.assert_array_equal(obs, [[0, 0], [3, 3]])
        assert rewards.tolist() == [0.0, 1.0]
    finally:
        envs.close()


def test_disabled_mode_refuses_to_step_a_finished_lane(pools):
    envs = BoltzLabsVecEnv(pools("Pendulum"), autoreset_mode=AutoresetMode.DISABLED)
    envs.reset(seed=0)
    for _ in range(9):
        *_, truncations, _ = envs.step(np.zeros((N, 1), np.float32))
    assert truncations.all()
    with pytest.raises(ValueError, match="autoreset is DISABLED: reset them first"):
        envs.step(np.zeros((N, 1), np.float32))
    envs.reset(options={"reset_mask": np.array([True, True, True])})
    envs.step(np.zeros((N, 1), np.float32))


def test_reset_mask_is_checked_and_popped_like_sync_vector_env(pools):
    envs = BoltzLabsVecEnv(pools("CartPole"))
    envs.reset(seed=0)
    options = {"reset_mask": np.array([True, False, False])}
    envs.reset(options=options)
    assert options == {}  # SyncVectorEnv pops it: a wrapper above (RecordEpisodeStatistics) sees no mask
    for bad, error in [
        ([True, False, True], TypeError),
        (np.array([True]), ValueError),
        (np.array([1, 0, 0]), TypeError),
        (np.zeros(N, bool), ValueError),
    ]:
        with pytest.raises(error, match="reset_mask"):
            envs.reset(options={"reset_mask": bad})
    with pytest.raises(ValueError, match="length must match num_envs=3"):
        envs.reset(seed=[1, 2])
    with pytest.raises(ValueError, match="needs 3 actions"):
        envs.step(np.array([0, 1]))


RENDER_FAULTS = """
    import os, time
    import boltzlabs.runtime.serve as runtime
    from boltzlabs import wire
    from boltzlabs.env import serve
    state = {"mode": "ok", "t": 0}
    def render():
        mode = state["mode"]
        if mode == "raise":
            raise RuntimeError("render failed on purpose")
        if mode == "exit":
            os._exit(3)
        if mode == "hang":
            time.sleep(60)
        return [state["t"]]
    def step(action):
        state["t"] += 1
        if action == "wrong_kind":  # answer a STEP with a RESET_DONE of the right seq
            runtime._step_reply = lambda seq, result: [wire.RESET_DONE, seq, None, {}]
        else:
            state["mode"] = action
        return state["t"], 1.0, False, False, {}
    def reset(seed, options=None):
        state["t"] = 0
        return 0
    serve(reset=reset, step=step, render=render)
"""


@pytest.mark.parametrize(
    "fault, error",
    [
        ("raise", "(?s)env 0 could not render: Traceback.*RuntimeError: render failed on purpose"),
        ("exit", "env 0 could not render: env is dead .*exited with code 3"),
        ("hang", "env 0 could not render: missed the render deadline of 1 s"),
    ],
)
def test_render_faults_are_typed_and_leave_other_envs_alone(env_dir, fault, error):
    with RLPool(env_dir(RENDER_FAULTS), 2, step_timeout=1.0) as pool:
        pool.reset()
        pool.step([fault, "ok"])
        with pytest.raises(EnvError, match=error) as caught:
            pool.render_all()
        assert caught.value.env_index == 0
        assert pool.render(1) == [1]
        _, _, dones, infos = pool.step(["ok", "ok"])
        assert dones[0] == (fault != "raise") and not dones[1], infos
        pool.reset(where=[0])  # a dead or stuck env is respawned
        pool.step(["ok", "ok"])
        assert pool.render(0) == [1]


def test_a_reply_of_the_wrong_kind_kills_only_that_env(env_dir):
    with RLPool(env_dir(RENDER_FAULTS), 2, step_timeout=5.0) as pool:
        pool.reset()
        pool.step(["wrong_kind", "ok"])  # from now on env 0 answers steps with RESET_DONE
        obs, _, dones, infos = pool.step(["ok", "ok"])
        assert dones.tolist() == [True, False] and "sent a malformed reply" in infos[0]["error"]
        assert obs[1] == 2 and pool.states()[0] == "dead"


def _cartpole():
    return gym.make("CartPole-v1")


def test_env_fns_pickled_from_many_threads_at_once_all_resolve():
    """The shards of a pool pickle their env_fns in threads at once, and cloudpickle's by-value
    registry is one per process: one thread's unregistering this (hidden) test module under
    another's feet raised ValueError ("not registered for pickle by value") in a sharded pool."""
    import sys
    import threading

    import cloudpickle

    assert __name__ not in cloudpickle.list_registry_pickle_by_value()
    errors: list = []
    start = threading.Barrier(8)

    def resolve_many() -> None:
        start.wait()
        try:
            for _ in range(25):
                source = sources.resolve([_cartpole] * 2, {})
                assert len(source.env_fns) == 2
        except Exception as exc:  # noqa: BLE001 - any failure is the finding
            errors.append(exc)

    threads = [threading.Thread(target=resolve_many) for _ in range(8)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads switch often, inside each other's pickling
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    assert __name__ not in cloudpickle.list_registry_pickle_by_value()  # nothing left registered


def test_env_fns_leave_a_module_the_caller_registered_by_value_registered():
    """Pickling env_fns unregisters only what it registered: a caller's own registration stands."""
    import sys

    import cloudpickle

    module = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(module)
    try:
        sources.resolve([_cartpole], {})
        assert __name__ in cloudpickle.list_registry_pickle_by_value()
    finally:
        cloudpickle.unregister_pickle_by_value(module)
