"""BoltzLabsVecEnv as a drop-in for AsyncVectorEnv on real training scripts (issue 27).

Each test runs real sandboxes (both spawn modes where an env runs) and, where
there is a reference, SyncVectorEnv over the same callables beside it:
  1. env_fns: each lane built by its own thunk, in its own finished sandbox;
  2. serve(reset=env.reset) by keyword, serve_env(env) with spaces, metadata, render;
  3. ids a plugin registered (ALE/Pong-v5) with and without gym://;
  4. Text, Sequence, OneOf carried; a package's own space (MissionSpace) rebuilt here;
  5. $PYTHONPATH and editable installs importable inside;
  6. the environment: env_vars, [pass_environment], the refused names;
  7. the Gymnasium differences: options={} on a masked reset, RecordEpisodeStatistics
     over DISABLED with masked resets, np_random_seed of self-seeding thunks;
  8. failures that used to say nothing: warned once per kind and summed up at close,
     an env.py that never serves, step() before reset().
"""

from __future__ import annotations

import glob
from contextlib import closing
import os
import subprocess
import sys
import textwrap
import threading
import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import error as gym_error
from gymnasium import spaces
from gymnasium.utils.env_checker import data_equivalence
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from gymnasium.wrappers import RecordEpisodeStatistics, TransformObservation

from boltzlabs import RLPool
from boltzlabs.errors import EnvStartError
from boltzlabs.gym import BoltzLabsVecEnv
from boltzlabs.pool import imports
from boltzlabs.errors import UnsupportedSpace
from boltzlabs.runtime.serve import reset_caller

N = 3
STEP_TIMEOUT = 30.0  # a bound against a hang under load, not a timing assertion


def ours(env_fns, spawn, **kwargs):
    kwargs.setdefault("step_timeout", STEP_TIMEOUT)
    return BoltzLabsVecEnv(env_fns, spawn=spawn, warmup=False, **kwargs)


def assert_steps_equal(a, b, steps, actions=None, seed=7):
    """The same seeds and actions give the same arrays (infos without the runtime's keys)."""
    obs_a, info_a = a.reset(seed=seed)
    obs_b, info_b = b.reset(seed=seed)
    assert data_equivalence(obs_a, obs_b)
    b.action_space.seed(seed)
    for t in range(steps):
        action = b.action_space.sample() if actions is None else actions(t)
        ra, rb = a.step(action), b.step(action)
        for k, (x, y) in enumerate(zip(ra[:4], rb[:4])):
            assert data_equivalence(x, y), f"step {t}, field {k}: {x!r:.300} != {y!r:.300}"
        if "episode" in rb[4]:  # RecordEpisodeStatistics inside: returns and lengths (not wall times)
            for key in ("r", "l", "_r"):
                np.testing.assert_array_equal(ra[4]["episode"][key], rb[4]["episode"][key], err_msg=f"step {t}")
        for key in ("lane", "_lane"):
            if key in rb[4]:
                np.testing.assert_array_equal(ra[4][key], rb[4][key], err_msg=f"step {t}: infos[{key!r}]")


# -- 1. env_fns ---------------------------------------------------------------------------------


class LaneTag(gym.Wrapper):
    """An index-dependent wrapper: the lane's own number in every info, and rewards scaled by it."""

    def __init__(self, env, lane):
        super().__init__(env)
        self.lane = lane

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        return obs, {**info, "lane": self.lane}

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        return obs, reward * (self.lane + 1), terminated, truncated, {**info, "lane": self.lane}


def make_env(env_id, lane):
    def thunk():
        env = gym.make(env_id)
        env = RecordEpisodeStatistics(env)
        env = TransformObservation(env, lambda o: o * (lane + 1), env.observation_space)
        return LaneTag(env, lane)

    return thunk


def test_env_fns_build_each_lane_with_its_own_thunk_as_sync_vector_env(spawn):
    fns = [make_env("CartPole-v1", i) for i in range(N)]
    with ours(fns, spawn) as envs, closing(SyncVectorEnv(fns)) as sync:
        assert envs.pool.spawn == spawn
        assert envs.single_observation_space == sync.single_observation_space
        _, infos = envs.reset(seed=3)
        assert infos["lane"].tolist() == [0, 1, 2]
        assert_steps_equal(envs, sync, 60)


def confinement():
    """What the process that calls it is: capabilities, no_new_privs, seccomp, namespaces."""
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {
        "cap_eff": int(fields["CapEff"], 16),
        "no_new_privs": fields["NoNewPrivs"].strip(),
        "seccomp": fields["Seccomp"].strip(),
        "pid_ns": os.readlink("/proc/self/ns/pid"),
        "lane": os.environ.get("BOLTZLABS_ENV_INDEX"),
        "uid": os.getuid(),
    }


class Recorded(gym.Wrapper):
    """The env, with where its thunk ran in the reset info."""

    def __init__(self, env, where):
        super().__init__(env)
        self.where = where

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        return obs, {**info, **{f"built_{k}": v for k, v in self.where.items()}}


def recording_thunk(lane):
    def thunk():
        return Recorded(gym.make("CartPole-v1"), confinement())

    return thunk


def test_each_thunk_runs_in_its_own_finished_sandbox_never_in_the_trainer_or_a_template(spawn):
    """Code running where it should not: a thunk is the trainer's, but the env it builds is
    not trusted; it is called only in its lane's sandbox, with every capability dropped,
    no_new_privs and the env's seccomp filter on, in a pid namespace of its own."""
    host_pid_ns = os.readlink("/proc/self/ns/pid")
    with ours([recording_thunk(i) for i in range(N)], spawn) as envs:
        _, infos = envs.reset(seed=0)
        assert infos["built_cap_eff"].tolist() == [0] * N
        assert infos["built_no_new_privs"].tolist() == ["1"] * N
        assert infos["built_seccomp"].tolist() == ["2"] * N  # SECCOMP_MODE_FILTER
        assert infos["built_lane"].tolist() == [str(i) for i in range(N)]
        namespaces = infos["built_pid_ns"].tolist()
        assert host_pid_ns not in namespaces and len(set(namespaces)) == N


def test_env_fns_are_checked_before_any_sandbox_starts():
    with pytest.raises(ValueError, match="env_fns has 2 callables but n=3"):
        RLPool([make_env("CartPole-v1", 0)] * 2, 3)
    with pytest.raises(TypeError, match="non-empty list of callables"):
        RLPool([make_env("CartPole-v1", 0), "CartPole-v1"], 2)
    with pytest.raises(TypeError, match="unknown option 'step_timout': did you mean 'step_timeout'"):
        BoltzLabsVecEnv([make_env("CartPole-v1", 0)], step_timout=3)
    with pytest.raises(TypeError, match="not options of the pool: level"):
        BoltzLabsVecEnv([make_env("CartPole-v1", 0)], level=3)
    lock = threading.Lock()
    with pytest.raises(TypeError, match="cannot be pickled"):
        BoltzLabsVecEnv([lambda: (lock, gym.make("CartPole-v1"))[1]])
    with pytest.raises(TypeError, match="AsyncVectorEnv's custom worker function"):
        BoltzLabsVecEnv([make_env("CartPole-v1", 0)], worker=lambda *a: None)
    with pytest.raises(TypeError, match="a single callable is not a source"):
        RLPool(make_env("CartPole-v1", 0), 1)


def returns_no_env():
    return 42


def raises_in_thunk():
    raise RuntimeError("the thunk broke")


@pytest.mark.parametrize(
    "thunk, match",
    [(returns_no_env, "returned int, not a Gymnasium env"), (raises_in_thunk, "RuntimeError: the thunk broke")],
)
def test_a_thunk_that_fails_in_its_sandbox_fails_the_start_with_its_error(spawn, thunk, match):
    with pytest.raises(EnvStartError, match=match):
        ours([thunk, thunk], spawn)


def hostile_thunk():
    """An env that tries to change the pool's thunks for the next env built from them."""

    class Tamper(gym.Wrapper):
        def step(self, action):
            path = os.environ["BOLTZLABS_ENV_FNS"]
            try:
                with open(path, "r+b") as f:
                    f.write(b"x")
                outcome = "wrote"
            except OSError as exc:
                outcome = type(exc).__name__
            obs, reward, terminated, truncated, info = self.env.step(action)
            return obs, reward, terminated, truncated, {**info, "tamper": outcome}

    return Tamper(gym.make("CartPole-v1"))


def test_an_env_cannot_change_the_thunks_and_their_file_goes_at_close(spawn):
    envs = ours([hostile_thunk] * 2, spawn)
    pid = envs.pool._proc.pid
    try:
        envs.reset(seed=0)
        _, _, _, _, infos = envs.step(np.array([0, 1]))
        assert set(infos["tamper"].tolist()) <= {"OSError", "PermissionError"}
        made = set(glob.glob(f"/tmp/boltzlabs-fns-{pid}-*"))
        assert len(made) == 1
        envs.pool.reset(hard=True)  # respawned sandboxes read the same, untouched thunks
        obs, infos = envs.reset(seed=0)
        assert obs.shape == (2, 4)
    finally:
        envs.close()
    assert glob.glob(f"/tmp/boltzlabs-fns-{pid}-*") == []  # this pool's (another session may have its own)


def test_the_sb3_adapter_takes_env_fns_as_subproc_vec_env_does():
    pytest.importorskip("stable_baselines3")
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.monitor import Monitor
    from stable_baselines3.common.vec_env import DummyVecEnv

    from boltzlabs.sb3 import BoltzLabsSB3VecEnv

    venv = make_vec_env(
        "CartPole-v1",
        n_envs=2,
        seed=5,
        vec_env_cls=BoltzLabsSB3VecEnv,
        vec_env_kwargs={"step_timeout": STEP_TIMEOUT, "warmup": False},
    )
    reference = make_vec_env("CartPole-v1", n_envs=2, seed=5, vec_env_cls=DummyVecEnv)
    try:
        assert venv.env_is_wrapped(Monitor) == [True, True]  # make_vec_env's thunks wrap in Monitor inside
        np.testing.assert_array_equal(venv.reset(), reference.reset())
        for t in range(80):
            action = np.array([t % 2, (t // 3) % 2])
            got, want = venv.step(action), reference.step(action)
            for x, y in zip(got[:3], want[:3]):
                np.testing.assert_array_equal(x, y)
            for a, b in zip(got[3], want[3]):
                assert ("episode" in a) == ("episode" in b)
                if "episode" in b:
                    assert (a["episode"]["r"], a["episode"]["l"]) == (b["episode"]["r"], b["episode"]["l"])
    finally:
        venv.close()
        reference.close()


# -- 2. serve(reset=env.reset) and serve_env(env) --------------------------------------------------

GYM_METHODS = """
    import gymnasium as gym
    from gymnasium.wrappers import FrameStackObservation
    from boltzlabs.env import serve
    env = FrameStackObservation(gym.make("CartPole-v1"), 2)
    serve(reset=env.reset, step=env.step, observation_space=env.observation_space, action_space=env.action_space)
"""

SERVE_ENV = """
    import gymnasium as gym
    from gymnasium.wrappers import FrameStackObservation
    from boltzlabs.env import serve_env
    serve_env(FrameStackObservation(gym.make("CartPole-v1", render_mode="rgb_array"), 2))
"""


def reference_frame_stack():
    from gymnasium.wrappers import FrameStackObservation

    return FrameStackObservation(gym.make("CartPole-v1", render_mode="rgb_array"), 2)


@pytest.mark.parametrize("source", [GYM_METHODS, SERVE_ENV], ids=["serve(env.reset)", "serve_env(env)"])
def test_a_gymnasium_envs_own_methods_serve(pool_factory, env_dir, source):
    envs = BoltzLabsVecEnv(pool_factory(env_dir(source), 2))
    with closing(SyncVectorEnv([reference_frame_stack] * 2)) as sync:
        assert_steps_equal(envs, sync, 30)
        obs, _ = envs.reset(seed=[4, None], options={"reset_mask": np.array([True, False])})
        want, _ = reference_frame_stack().reset(seed=4)
        np.testing.assert_array_equal(obs[0], want)
        if source is SERVE_ENV:
            assert envs.render_mode == "rgb_array" and envs.metadata["render_fps"] == sync.metadata["render_fps"]
            frames = envs.render()
            assert len(frames) == 2 and frames[0].shape == sync.render()[0].shape
    envs.close()


def test_reset_is_called_the_way_it_takes_its_arguments():
    calls = []

    def positional(s):
        calls.append(("positional", s))

    def documented(seed):
        calls.append(("documented", seed))

    def with_options(seed, options=None):
        calls.append(("with_options", seed, options))

    def keyword_only(*, seed=None, options=None):
        calls.append(("keyword_only", seed, options))

    def forwarding(**kwargs):
        calls.append(("forwarding", kwargs))

    class Env:
        def reset(self, *, seed=None, options=None):
            calls.append(("method", seed, options))

    for reset in (positional, documented, with_options, keyword_only, forwarding, Env().reset):
        caller = reset_caller(reset)
        caller(3, None)
        caller(4, {})
    assert calls == [
        ("positional", 3),
        ("positional", 4),
        ("documented", 3),
        ("documented", 4),
        ("with_options", 3, None),
        ("with_options", 4, {}),
        ("keyword_only", 3, None),
        ("keyword_only", 4, {}),
        ("forwarding", {"seed": 3, "options": None}),
        ("forwarding", {"seed": 4, "options": {}}),
        ("method", 3, None),
        ("method", 4, {}),
    ]
    with pytest.raises(TypeError, match="options"):
        reset_caller(documented)(5, {"level": 2})  # options it cannot take: its lane's failure, with why


# -- 3. ids a plugin registers ------------------------------------------------------------------


@pytest.mark.parametrize("source", ["gym://ALE/Pong-v5", "ALE/Pong-v5"])
def test_an_id_a_plugin_registered_here_runs_in_the_sandbox(spawn, source):
    ale_py = pytest.importorskip("ale_py")
    gym.register_envs(ale_py)
    pool = RLPool(
        source, 1, spawn=spawn, step_timeout=STEP_TIMEOUT, warmup=False, frameskip=1, repeat_action_probability=0.0
    )
    try:
        obs = pool.reset(seed=1)[0]
        want, _ = gym.make("ALE/Pong-v5", frameskip=1, repeat_action_probability=0.0).reset(seed=1)
        np.testing.assert_array_equal(obs, want)
    finally:
        pool.close()


def test_an_id_no_module_here_registered_names_the_module_to_give():
    code = textwrap.dedent("""
        from boltzlabs import RLPool
        for source in ("gym://ALE/Pong-v5", "ALE/Pong-v5"):
            try:
                RLPool(source, 1)
            except ValueError as exc:
                print(exc)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    lines = out.strip().splitlines()
    assert len(lines) == 2, out
    for line in lines:
        assert "Namespace ALE not found" in line and "'gym://ale_py:ALE/Pong-v5'" in line and "import ale_py" in line


def test_an_id_registered_from_a_directory_the_sandbox_cannot_see_is_refused_early(tmp_path, monkeypatch):
    (tmp_path / "local_envs.py").write_text(
        textwrap.dedent("""
        import gymnasium
        gymnasium.register("LocalCartPole-v0", entry_point="local_envs:make")
        def make(**kwargs):
            return gymnasium.make("CartPole-v1")
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import local_envs  # noqa: F401

    with pytest.raises(ValueError, match="registered by 'local_envs'.*where a sandbox cannot see it.*pip install -e"):
        RLPool("LocalCartPole-v0", 1)


# -- 4. spaces ----------------------------------------------------------------------------------

TEXT_SEQUENCE_ONEOF = """
    import numpy as np
    from gymnasium import spaces
    from boltzlabs.env import serve
    space = spaces.Dict({
        "text": spaces.Text(6, min_length=2, charset="abcxyz"),
        "seq": spaces.Sequence(spaces.Discrete(4)),
        "stacked": spaces.Sequence(spaces.Box(0, 1, (2,)), stack=True),
        "choice": spaces.OneOf([spaces.Discrete(3), spaces.Box(-1, 1, (2,))]),
    })
    space.seed(0)
    def reset(seed):
        space.seed(seed)
        return space.sample(), {}
    def step(action):
        return space.sample(), 0.0, False, False, {}
    serve(reset=reset, step=step, observation_space=space, action_space=spaces.Discrete(2))
"""


def test_text_sequence_and_oneof_spaces_are_carried(pool_factory, env_dir):
    envs = BoltzLabsVecEnv(pool_factory(env_dir(TEXT_SEQUENCE_ONEOF), 2))
    space = envs.single_observation_space
    assert space["text"] == spaces.Text(6, min_length=2, charset="abcxyz")
    assert space["seq"] == spaces.Sequence(spaces.Discrete(4))
    assert space["stacked"] == spaces.Sequence(spaces.Box(0, 1, (2,)), stack=True)
    assert space["choice"] == spaces.OneOf([spaces.Discrete(3), spaces.Box(-1, 1, (2,))])
    obs, _ = envs.reset(seed=1)
    assert obs in envs.observation_space
    obs, *_ = envs.step(np.array([0, 0]))
    assert obs in envs.observation_space
    envs.close()


CUSTOM_SPACE = """
    from gymnasium import spaces
    from boltzlabs.env import serve
    class Mission(spaces.Space):
        def contains(self, x):
            return isinstance(x, str)
    space = spaces.Dict({"image": spaces.Box(0, 255, (2, 2), "uint8"), "mission": Mission()})
    serve(reset=lambda seed: {"image": space["image"].sample(), "mission": "go"},
          step=lambda a: ({"image": space["image"].sample(), "mission": "go"}, 0.0, False, {}),
          observation_space=space, action_space=spaces.Discrete(2))
"""


def test_a_space_of_the_envs_own_says_where_it_is_and_which_override_to_pass(pool_factory, env_dir):
    pool = pool_factory(env_dir(CUSTOM_SPACE), 1)
    with pytest.raises(
        UnsupportedSpace,
        match=r"space\['mission'\].*a __main__\.Mission.*"
        r"BoltzLabsVecEnv\(\.\.\., observation_space=\.\.\.\)",
    ):
        BoltzLabsVecEnv(pool)


def minigrid_thunk():
    import minigrid  # noqa: F401 (registers the ids)

    return gym.make("MiniGrid-Empty-5x5-v0")


def test_minigrids_mission_space_is_rebuilt_here_from_the_same_thunk_or_id(spawn):
    pytest.importorskip("minigrid")
    with ours([minigrid_thunk] * 2, spawn) as envs, closing(SyncVectorEnv([minigrid_thunk] * 2)) as sync:
        assert envs.single_observation_space == sync.single_observation_space
        assert type(envs.single_observation_space["mission"]).__name__ == "MissionSpace"
        assert_steps_equal(envs, sync, 20, actions=lambda t: np.array([2, t % 3]))
    import minigrid  # noqa: F401

    envs = BoltzLabsVecEnv.make("MiniGrid-Empty-5x5-v0", 2, spawn=spawn, step_timeout=STEP_TIMEOUT, warmup=False)
    assert type(envs.single_observation_space["mission"]).__name__ == "MissionSpace"
    envs.close()


# -- 5. what the trainer imports from elsewhere ----------------------------------------------------

IMPORTS_ENV = """
    from boltzlabs.env import serve
    import {module}
    serve(reset=lambda seed: {module}.VALUE, step=lambda action: ({module}.VALUE, 0.0, False, {{}}))
"""


def test_a_package_on_pythonpath_is_importable_inside(pool_factory, env_dir, tmp_path, monkeypatch):
    lib = tmp_path / "lib"
    (lib / "pp_package").mkdir(parents=True)
    (lib / "pp_package" / "__init__.py").write_text("VALUE = 'from PYTHONPATH'\n")
    os.chmod(tmp_path, 0o755)
    monkeypatch.setenv("PYTHONPATH", str(lib))
    pool = pool_factory(env_dir(IMPORTS_ENV.format(module="pp_package")), 2)
    assert pool.reset(seed=0) == ["from PYTHONPATH"] * 2


def test_editable_installs_are_importable_inside(pool_factory, env_dir, tmp_path, monkeypatch):
    """Both kinds pip makes: a .pth that names a directory (legacy and static editables,
    hatchling, flit) and setuptools' finder, which maps a package name to its directory."""
    site_dir, pth_src, mapped = tmp_path / "site", tmp_path / "proj_a" / "src", tmp_path / "proj_b" / "finder_pkg"
    for d in (site_dir, pth_src / "pth_pkg", mapped):
        d.mkdir(parents=True)
    os.chmod(tmp_path, 0o755)
    (pth_src / "pth_pkg" / "__init__.py").write_text("VALUE = 'from a .pth'\n")
    (mapped / "__init__.py").write_text("VALUE = 'from a finder'\n")
    (site_dir / "__editable__.proj_a-0.1.pth").write_text(f"# comment\n{pth_src}\nimport sys\n")
    finder = type(sys)("__editable___proj_b_0_1_finder")
    finder.MAPPING = {"finder_pkg": str(mapped), "finder_pkg.sub": str(mapped / "sub")}
    monkeypatch.setitem(sys.modules, finder.__name__, finder)
    real = imports._site_dirs
    monkeypatch.setattr(imports, "_site_dirs", lambda: [*real(), str(site_dir)])
    assert [str(pth_src), "pth", ""] in imports.roots() and [str(mapped), "package", "finder_pkg"] in imports.roots()
    for module, value in (("pth_pkg", "from a .pth"), ("finder_pkg", "from a finder")):
        pool = pool_factory(env_dir(IMPORTS_ENV.format(module=module)), 1)
        assert pool.reset(seed=0) == [value]


def test_env_fns_using_a_module_of_the_scripts_own_directory_travel_by_value(spawn, tmp_path, monkeypatch):
    (tmp_path / "script_helpers.py").write_text(
        textwrap.dedent("""
        import gymnasium
        class Scaled(gymnasium.RewardWrapper):
            def reward(self, reward):
                return 10 * reward
        def make():
            return Scaled(gymnasium.make("CartPole-v1"))
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import script_helpers

    assert not imports.visible(script_helpers.__file__)
    with ours([script_helpers.make] * 2, spawn) as envs:
        envs.reset(seed=0)
        _, rewards, *_ = envs.step(np.array([0, 1]))
        assert rewards.tolist() == [10.0, 10.0]


# -- 6. the environment -------------------------------------------------------------------------

ENVIRON = """
    import os
    from boltzlabs.env import serve
    serve(reset=lambda seed: dict(os.environ), step=lambda action: ({}, 0.0, False, {}))
"""


def test_variables_pass_by_policy_or_by_the_pool_and_dangerous_ones_never(pool_factory, env_dir, monkeypatch):
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")  # [pass_environment]: numerics
    monkeypatch.setenv("MUJOCO_GL", "egl")
    monkeypatch.setenv("BOLTZLABS_TEST_SECRET", "not for the env")
    source = env_dir(ENVIRON)
    env = pool_factory(source, 1, env_vars={"MY_SETTING": "on", "MUJOCO_GL": "osmesa"}).reset(seed=0)[0]
    assert env["OPENBLAS_CORETYPE"] == "Haswell" and env["MY_SETTING"] == "on"
    assert env["MUJOCO_GL"] == "osmesa"  # the pool's own wins over the trainer's
    assert "BOLTZLABS_TEST_SECRET" not in env and env["PYTHONHASHSEED"] == "0"
    for name, why in [
        ("PYTHONPATH", "sandbox policy"),
        ("PYTHONWARNINGS", "never passed"),
        ("LD_PRELOAD", "never passed"),
        ("GCONV_PATH", "never passed"),
        ("HOME", "sandbox policy"),
        ("BOLTZLABS_FD", "never passed"),
        ("not a name", "not a variable name"),
    ]:
        with pytest.raises(ValueError, match=f"env_vars: '{name}' .*{why}"):
            pool_factory(source, 1, env_vars={name: "/tmp/x"})
    with pytest.raises(TypeError, match="env_vars must be a dict"):
        pool_factory(source, 1, env_vars={"A": 1})


def mujoco_thunk():
    return gym.make("HalfCheetah-v5", render_mode="rgb_array")


def test_mujoco_renders_with_the_gl_backend_passed_in(spawn):
    pytest.importorskip("mujoco")
    with ours([mujoco_thunk], spawn, env_vars={"MUJOCO_GL": "egl"}) as envs:
        envs.reset(seed=0)
        (frame,) = envs.render()
        assert frame.shape == (480, 480, 3) and frame.std() > 0


# -- 7. the Gymnasium differences --------------------------------------------------------------


class OptionsSeen(gym.Wrapper):
    def reset(self, *, seed=None, options=None):
        obs, info = self.env.reset(seed=seed, options=options)
        return obs, {**info, "options": repr(options)}


def options_thunk():
    return OptionsSeen(gym.make("CartPole-v1"))


def test_a_masked_reset_gives_each_env_the_options_sync_gives(spawn):
    with ours([options_thunk] * 2, spawn) as envs, closing(SyncVectorEnv([options_thunk] * 2)) as sync:
        for venv in (envs, sync):
            _, infos = venv.reset(seed=0)
            assert infos["options"].tolist() == ["None", "None"]
            options = {"reset_mask": np.array([False, True])}
            _, infos = venv.reset(options=options)
            assert infos["options"][1] == "{}" and options == {}


def test_record_episode_statistics_over_disabled_autoreset_matches_sync(spawn):
    """3 envs, masked resets of the finished lanes, 40 steps: the same episode returns."""
    from gymnasium.wrappers.vector import RecordEpisodeStatistics as VectorStats

    fns = [lambda: gym.make("CartPole-v1")] * 3
    a = VectorStats(ours(fns, spawn, autoreset_mode=AutoresetMode.DISABLED))
    b = VectorStats(SyncVectorEnv(fns, autoreset_mode=AutoresetMode.DISABLED))
    try:
        a.reset(seed=1)
        b.reset(seed=1)
        for t in range(40):
            action = np.array([1, 0, t % 2])
            ra, rb = a.step(action), b.step(action)
            np.testing.assert_array_equal(ra[0], rb[0], err_msg=f"step {t}")
            if "episode" in rb[4]:
                np.testing.assert_array_equal(ra[4]["episode"]["r"], rb[4]["episode"]["r"], err_msg=f"step {t}")
                np.testing.assert_array_equal(ra[4]["_episode"], rb[4]["_episode"])
            done = rb[2] | rb[3]
            if done.any():
                a.reset(options={"reset_mask": done.copy()})
                b.reset(options={"reset_mask": done.copy()})
    finally:
        a.close()
        b.close()


def self_seeding(seed):
    def thunk():
        env = gym.make("CartPole-v1")
        env.reset(seed=seed)
        return env

    return thunk


def test_np_random_seed_of_thunks_that_seed_themselves(spawn):
    fns = [self_seeding(i) for i in range(N)]
    with ours(fns, spawn) as envs, closing(SyncVectorEnv(fns)) as sync:
        assert envs.np_random_seed == sync.np_random_seed == (0, 1, 2)
        envs.reset(seed=10)
        sync.reset(seed=10)
        assert envs.np_random_seed == sync.np_random_seed == (10, 11, 12)


# -- 8. failures that said nothing ------------------------------------------------------------------

ALWAYS_FAILS = """
    from boltzlabs.env import serve
    def reset(seed):
        raise ValueError("no level file")
    def step(action):
        return 0, 1.0, False  # a 3-tuple
    serve(reset=reset, step=step)
"""


def test_a_pool_whose_every_env_fails_says_so_once_per_kind_and_at_close(pool_factory, env_dir):
    pool = pool_factory(env_dir(ALWAYS_FAILS), 3)
    with pytest.warns(RuntimeWarning, match=r"env 0's reset raised \(ValueError: no level file\)"):
        assert pool.reset(seed=0) == [None] * 3
    with pytest.warns(RuntimeWarning, match=r"env 0's step raised \(TypeError: step\(\) returned tuple of length 3"):
        pool.step([0, 0, 0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per kind: the same failures again warn no more
        pool.reset(seed=0)
        pool.step([0, 0, 0])
    with pytest.warns(
        RuntimeWarning,
        match=r"closed; its envs failed: reset raised: 6 time\(s\), first env 0 "
        r"\(ValueError: no level file\); step raised: 6 time\(s\)",
    ):
        pool.close()


def test_an_env_py_that_never_serves_says_so(pool_factory, env_dir):
    with pytest.raises(EnvStartError, match=r"returned without calling serve\(\)") as caught:
        pool_factory(env_dir("x = 1\nprint('imported')\n"), 2)
    assert "exited with code 0" not in str(caught.value)
    assert "imported" in caught.value.log and "without calling serve()" in caught.value.log
    with pytest.raises(EnvStartError, match=r"exited with status 0 without calling serve\(\)"):
        pool_factory(env_dir("import sys\nsys.exit(0)\n"), 1)


def test_step_before_reset_is_refused_as_gymnasium_refuses_it(pool_factory, env_dir):
    pool = pool_factory(env_dir(ENVIRON), 2)
    with pytest.raises(ValueError, match=r"step\(\) before reset\(\): env\(s\) 0, 1"):
        pool.step([0, 0])
    with pytest.raises(ValueError, match=r"send\(\) before reset\(\): env\(s\) 1"):
        pool.reset(where=[0])
        pool.send([0, 0])
    pool.reset(where=[1])
    pool.step([0, 0])
    envs = BoltzLabsVecEnv(pool_factory("CartPole-v1", 2))
    with pytest.raises(gym_error.ResetNeeded, match=r"Cannot call step\(\) before calling reset\(\)"):
        envs.step(np.array([0, 1]))
    with closing(SyncVectorEnv([lambda: gym.make("CartPole-v1")])) as sync, pytest.raises(gym_error.ResetNeeded):
        sync.step(np.array([0]))
    envs.reset(seed=0)
    envs.step(np.array([0, 1]))


# -- a remote worker --------------------------------------------------------------------------------


class PathsSeen(gym.Wrapper):
    def reset(self, **kwargs):
        import sys as sys_

        obs, info = self.env.reset(**kwargs)
        return obs, {**info, "imports": os.path.exists("/opt/import"), "path": ":".join(sys_.path)}


def paths_thunk():
    return PathsSeen(gym.make("CartPole-v1"))


def test_env_fns_run_on_a_remote_worker_which_binds_none_of_the_clients_paths(tmp_path, monkeypatch):
    """A remote client's import roots name paths of its own machine: a worker binds none of them
    (a hostile client would name the worker's /etc)."""
    from test_remote import TOKEN, Worker

    monkeypatch.setenv("PYTHONPATH", "/etc")
    assert ["/etc", "path", ""] in imports.roots()
    worker = Worker(tmp_path)
    try:
        envs = BoltzLabsVecEnv([paths_thunk, paths_thunk], worker=worker.url, token=TOKEN, step_timeout=STEP_TIMEOUT)
        with envs:
            _, infos = envs.reset(seed=0)
            assert infos["imports"].tolist() == [False, False]
            assert all("/etc" not in p.split(":") for p in infos["path"].tolist())
            _, rewards, *_ = envs.step(np.array([0, 1]))
            assert rewards.tolist() == [1.0, 1.0]
    finally:
        worker.stop()


def test_env_fns_whose_envs_have_different_spaces_are_refused_as_async_vector_env_refuses_them(spawn):
    fns = [lambda: gym.make("CartPole-v1"), lambda: gym.make("MountainCar-v0")]
    with pytest.raises(RuntimeError, match="env 1's observation space .* is not env 0's"):
        ours(fns, spawn)
    fns = [lambda: gym.make("CartPole-v1"), lambda: gym.make("Acrobot-v1")]
    with pytest.raises(RuntimeError):
        ours(fns, spawn)
