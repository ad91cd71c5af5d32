"""The envs people train on, through BoltzLabsVecEnv beside SyncVectorEnv, step for step (issue 27).

Each family from its PyPI wheel (the test extras: ale-py, minigrid, box2d, mujoco), built by
env_fns with the wrappers a training script puts around it, in both spawn modes: the same seed
and actions give the same observations, rewards, terminations, truncations and the envs' own
infos, autoresets included, and render() gives the same frames (Pong, LunarLander, HalfCheetah).
"""

from __future__ import annotations

import os
from contextlib import closing

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import data_equivalence
from gymnasium.vector import SyncVectorEnv

from boltzlabs.gym import BoltzLabsVecEnv

N = 2
RUNTIME_KEYS = ("episode_ids", "_episode_ids", "episode_record", "_episode_record")


def pong():
    import ale_py
    from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation

    gym.register_envs(ale_py)
    env = gym.make("ALE/Pong-v5", frameskip=1, render_mode="rgb_array")
    return FrameStackObservation(AtariPreprocessing(env, noop_max=30, frame_skip=4, screen_size=84), 4)


def minigrid():
    import minigrid  # noqa: F401 (registers its ids)

    return gym.make("MiniGrid-Empty-5x5-v0", max_steps=12)


def lunar_lander():
    return gym.wrappers.RecordEpisodeStatistics(gym.make("LunarLander-v3", render_mode="rgb_array"))


def half_cheetah():
    return gym.wrappers.ClipAction(gym.make("HalfCheetah-v5", render_mode="rgb_array", max_episode_steps=20))


FAMILIES = {  # name: (the PyPI package's module, the thunk, steps, whether to compare frames)
    "ale-py Pong 84x84x4": ("ale_py", pong, 40, True),
    "minigrid Empty": ("minigrid", minigrid, 30, False),
    "box2d LunarLander": ("Box2D", lunar_lander, 120, True),
    "mujoco HalfCheetah": ("mujoco", half_cheetah, 45, True),
}


@pytest.fixture(autouse=True)
def headless(monkeypatch):
    # MuJoCo renders through EGL here (software; no display): in this process, and in the
    # sandboxes, which take MUJOCO_GL from it (sandbox/policy.toml [pass_environment]).
    monkeypatch.setenv("MUJOCO_GL", os.environ.get("MUJOCO_GL", "egl"))


def env_part(infos: dict) -> dict:
    return {k: v for k, v in infos.items() if k not in RUNTIME_KEYS}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_real_env_runs_step_for_step_as_in_sync_vector_env(family, spawn):
    module, thunk, steps, frames = FAMILIES[family]
    pytest.importorskip(module)
    ours = BoltzLabsVecEnv([thunk] * N, spawn=spawn, step_timeout=60.0, warmup=False)
    with ours, closing(SyncVectorEnv([thunk] * N)) as sync:
        assert ours.single_observation_space == sync.single_observation_space
        assert ours.single_action_space == sync.single_action_space
        assert ours.render_mode == sync.render_mode
        obs, infos = ours.reset(seed=11)
        want, want_infos = sync.reset(seed=11)
        assert data_equivalence(obs, want) and data_equivalence(env_part(infos), want_infos)
        sync.action_space.seed(5)
        ends = 0
        for t in range(steps):
            action = sync.action_space.sample()
            got, expected = ours.step(action), sync.step(action)
            for k, name in enumerate(("obs", "rewards", "terminations", "truncations")):
                assert data_equivalence(got[k], expected[k]), f"{family}, step {t}: {name} differ"
            got_infos, want_infos = env_part(got[4]), expected[4]
            if "episode" in want_infos:  # RecordEpisodeStatistics: not its wall times
                for infos_ in (got_infos, want_infos):
                    infos_["episode"] = {k: v for k, v in infos_["episode"].items() if k not in ("t", "_t")}
            assert data_equivalence(got_infos, want_infos), f"{family}, step {t}: infos differ"
            ends += int((expected[2] | expected[3]).sum())
        if family != "ale-py Pong 84x84x4":  # a Pong episode outlasts any short test
            assert ends > 0, f"{family}: no episode ended, so no autoreset was compared"
        if frames:
            got_frames, want_frames = ours.render(), sync.render()
            assert len(got_frames) == N and all(f.ndim == 3 and f.dtype == np.uint8 for f in got_frames)
            for got_frame, want_frame in zip(got_frames, want_frames):
                np.testing.assert_array_equal(got_frame, want_frame)
