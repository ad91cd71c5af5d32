"""Gymnasium's tests/wrappers/vector/test_human_rendering.py, each test run on SyncVectorEnv and BoltzLabsVecEnv.

Ported from Gymnasium 1.4.0 (MIT License; notice in tests/gymnasium_vector/__init__.py).
HumanRendering opens a pygame window: skipped without pygame, as upstream.
"""

import re

import pytest
from gymnasium.wrappers.vector import HumanRendering

from ..conftest import NO_PYGAME, UPSTREAM_RENDER_LIST, vectorisers


# Ant-v4's frames come from MuJoCo rendering in software here (EGL, no GPU): a minute per case on
# two cores, ~10 minutes of CI on each step path. HumanRendering tiles CartPole's frames the same way,
# and MuJoCo's render() is compared frame for frame beside SyncVectorEnv in tests/test_real_envs.py.
SOFTWARE_MUJOCO = pytest.mark.skip(reason="MuJoCo renders in software here (a minute per case); "
                                          "tests/test_real_envs.py compares its frames")


@pytest.mark.parametrize("env_id", ["CartPole-v1", pytest.param("Ant-v4", marks=SOFTWARE_MUJOCO)])
@pytest.mark.parametrize("num_envs", [1, 3, 9])
@pytest.mark.parametrize("screen_size", [None, (400, 300), (300, 600), (600, 600)])
@pytest.mark.parametrize("vectoriser", vectorisers())
@NO_PYGAME
def test_num_envs_screen_size(vectoriser, make_vec, env_id, num_envs, screen_size):
    envs = make_vec(vectoriser, env_id, num_envs=num_envs, render_mode="rgb_array")
    envs = HumanRendering(envs, screen_size=screen_size)

    assert envs.render_mode == "human"

    envs.reset()
    for _ in range(25):
        envs.step(envs.action_space.sample())
    envs.close()


@pytest.mark.parametrize("vectoriser", vectorisers(boltzlabs=UPSTREAM_RENDER_LIST, sync=UPSTREAM_RENDER_LIST))
@NO_PYGAME
def test_render_modes(vectoriser, make_vec):
    envs = HumanRendering(
        make_vec(vectoriser, "CartPole-v1", num_envs=3, render_mode="rgb_array_list")
    )
    assert envs.render_mode == "human"

    envs.reset()
    for _ in range(25):
        envs.step(envs.action_space.sample())
    envs.close()

    # HumanRenderer on human renderer should not work
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Expected env.render_mode to be one of ['rgb_array', 'rgb_array_list', 'depth_array', 'depth_array_list'] but got 'human'"
        ),
    ):
        HumanRendering(envs)
