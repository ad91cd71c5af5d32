"""Gymnasium's tests/vector/test_async_vector_env.py, run on BoltzLabsVecEnv (our asynchronous vector env).

Ported from Gymnasium 1.4.0 (MIT License; notice in tests/gymnasium_vector/__init__.py). Upstream's
`shared_memory` parameter has no counterpart (observations cross a socket) and is dropped; SlowEnv,
CustomSpaceEnv and the raise_error envs are variants of envs/generic/env.py.
"""

import re
import warnings
from multiprocessing import TimeoutError

import numpy as np
import pytest
from gymnasium.error import AlreadyPendingCallError, ClosedEnvironmentError, NoAsyncCallError
from gymnasium.spaces import Box, Discrete, MultiDiscrete, Tuple
from gymnasium.vector import AutoresetMode

from .conftest import (CLOSED_ERROR, FAILURES_ARE_LANES, HETEROGENEOUS, MP_TIMEOUT, NO_ASYNC_RESET, NO_PYGAME,
                       NO_SHARED_MEMORY, REFUSED_SPACE, generic, generic_env, make_env)


def test_create_async_vector_env(build):
    """Test creating an async vector environment with or without shared memory."""
    env_fns = [make_env("CartPole-v1", i) for i in range(8)]

    env = build("boltzlabs", env_fns)
    assert env.num_envs == 8
    env.close()


def test_metadata_async_vector_env(build):
    """Tests that the vector env's metadata doesn't mutate the sub-environment's (class-level) metadata."""
    envs_1 = build("boltzlabs", [make_env("CartPole-v1", 0)], autoreset_mode=AutoresetMode.NEXT_STEP)
    envs_2 = build("boltzlabs", [make_env("CartPole-v1", 1)], autoreset_mode=AutoresetMode.SAME_STEP)

    assert envs_1.metadata["autoreset_mode"] == AutoresetMode.NEXT_STEP
    assert envs_2.metadata["autoreset_mode"] == AutoresetMode.SAME_STEP

    env = make_env("CartPole-v1", 0).thunk()
    assert "autoreset_mode" not in env.metadata

    env.close()
    envs_1.close()
    envs_2.close()


def test_reset_async_vector_env(build):
    """Test the reset of async vector environment with or without shared memory."""
    env_fns = [make_env("CartPole-v1", i) for i in range(8)]

    env = build("boltzlabs", env_fns)
    observations, infos = env.reset()

    env.close()

    assert isinstance(env.observation_space, Box)
    assert isinstance(observations, np.ndarray)
    assert observations.dtype == env.observation_space.dtype
    assert observations.shape == (8,) + env.single_observation_space.shape
    assert observations.shape == env.observation_space.shape

    try:
        env = build("boltzlabs", env_fns)
        observations, infos = env.reset()
    finally:
        env.close()

    assert isinstance(env.observation_space, Box)
    assert isinstance(observations, np.ndarray)
    assert observations.dtype == env.observation_space.dtype
    assert observations.shape == (8,) + env.single_observation_space.shape
    assert observations.shape == env.observation_space.shape
    assert isinstance(infos, dict)
    assert all([isinstance(info, dict) for info in infos])


@NO_PYGAME
def test_render_async_vector(build):
    envs = build("boltzlabs", [make_env("CartPole-v1", i, render_mode="rgb_array") for i in range(3)])
    assert envs.render_mode == "rgb_array"

    envs.reset()
    rendered_frames = envs.render()
    assert isinstance(rendered_frames, tuple)
    assert len(rendered_frames) == envs.num_envs
    assert all(isinstance(frame, np.ndarray) for frame in rendered_frames)
    envs.close()

    envs = build("boltzlabs", [make_env("CartPole-v1", i) for i in range(3)])
    assert envs.render_mode is None
    envs.close()


@pytest.mark.parametrize("use_single_action_space", [True, False])
def test_step_async_vector_env(use_single_action_space, build):
    """Test the step async vector environment with and without shared memory."""
    env_fns = [make_env("CartPole-v1", i) for i in range(8)]

    env = build("boltzlabs", env_fns)
    env.reset()

    assert isinstance(env.single_action_space, Discrete)
    assert isinstance(env.action_space, MultiDiscrete)

    if use_single_action_space:
        actions = [env.single_action_space.sample() for _ in range(8)]
    else:
        actions = env.action_space.sample()
    observations, rewards, terminations, truncations, _ = env.step(actions)

    env.close()

    assert isinstance(env.observation_space, Box)
    assert isinstance(observations, np.ndarray)
    assert observations.dtype == env.observation_space.dtype
    assert observations.shape == (8,) + env.single_observation_space.shape
    assert observations.shape == env.observation_space.shape

    assert isinstance(rewards, np.ndarray)
    assert isinstance(rewards[0], (float, np.floating))
    assert rewards.ndim == 1
    assert rewards.size == 8

    assert isinstance(terminations, np.ndarray)
    assert terminations.dtype == np.bool_
    assert terminations.ndim == 1
    assert terminations.size == 8

    assert isinstance(truncations, np.ndarray)
    assert truncations.dtype == np.bool_
    assert truncations.ndim == 1
    assert truncations.size == 8


@NO_PYGAME
def test_call_async_vector_env(build):
    """Test call with async vector environment."""
    env_fns = [
        make_env("CartPole-v1", i, render_mode="rgb_array_list") for i in range(4)
    ]

    env = build("boltzlabs", env_fns)
    env.reset()
    images = env.call("render")
    gravity = env.call("gravity")

    env.close()

    assert isinstance(images, tuple)
    assert len(images) == 4
    for i in range(4):
        assert len(images[i]) == 1
        assert isinstance(images[i][0], np.ndarray)

    assert isinstance(gravity, tuple)
    assert len(gravity) == 4
    for i in range(4):
        assert isinstance(gravity[i], float)
        assert gravity[i] == 9.8


def test_set_attr_async_vector_env(build):
    """Test `set_attr_` for async vector environment with or without shared memory."""
    env_fns = [make_env("CartPole-v1", i) for i in range(4)]

    env = build("boltzlabs", env_fns)
    env.set_attr("gravity", [9.81, 3.72, 8.87, 1.62])
    gravity = env.get_attr("gravity")
    assert gravity == (9.81, 3.72, 8.87, 1.62)

    env.close()


def test_copy_async_vector_env(build):
    """Test observations are a copy of the true observation with and without shared memory."""
    env_fns = [make_env("CartPole-v1", i) for i in range(8)]

    # TODO, these tests do nothing, understand the purpose of the tests and fix them
    env = build("boltzlabs", env_fns, copy=True)
    observations, infos = env.reset()
    observations[0] = 0

    env.close()


def test_no_copy_async_vector_env(build):
    """Test observation are not a copy of the true observation with and without shared memory."""
    env_fns = [make_env("CartPole-v1", i) for i in range(8)]

    # TODO, these tests do nothing, understand the purpose of the tests and fix them
    env = build("boltzlabs", env_fns, copy=False)
    observations, infos = env.reset()
    observations[0] = 0

    env.close()


@NO_ASYNC_RESET
def test_reset_timeout_async_vector_env(build):
    """Test timeout error on reset with and without shared memory."""
    env_fns = [generic_env(obs="slow", act="slow_action", behaviour="slow", slow_reset=0.3)] * 4

    env = build("boltzlabs", env_fns)
    with pytest.raises(TimeoutError):
        env.reset_async()
        env.reset_wait(timeout=0.1)

    env.close(terminate=True)


@MP_TIMEOUT
def test_step_timeout_async_vector_env(build):
    """Test timeout error on step with and without shared memory."""
    env_fns = [generic_env(obs="slow", act="slow_action", behaviour="slow", slow_reset=0.0)] * 4

    env = build("boltzlabs", env_fns)
    with pytest.raises(TimeoutError):
        env.reset()
        env.step_async(np.array([0.1, 0.1, 0.3, 0.1]))
        observations, rewards, terminations, truncations, _ = env.step_wait(timeout=0.1)
    env.close(terminate=True)


@NO_ASYNC_RESET
def test_reset_out_of_order_async_vector_env(build):
    """Test reset being called out of order with and without shared memory."""
    env_fns = [make_env("CartPole-v1", i) for i in range(4)]

    env = build("boltzlabs", env_fns)
    with pytest.raises(
        NoAsyncCallError,
        match=re.escape(
            "Calling `reset_wait` without any prior call to `reset_async`."
        ),
    ):
        env.reset_wait()

    env.close(terminate=True)

    env = build("boltzlabs", env_fns)
    with pytest.raises(
        AlreadyPendingCallError,
        match=re.escape(
            "Calling `reset_async` while waiting for a pending call to `step` to complete"
        ),
    ):
        actions = env.action_space.sample()
        env.reset()
        env.step_async(actions)
        env.reset_async()

    with pytest.warns(
        UserWarning,
        match=re.escape(
            "Calling `close` while waiting for a pending call to `step` to complete."
        ),
    ):
        env.close(terminate=True)


@NO_ASYNC_RESET
def test_step_out_of_order_async_vector_env(build):
    """Test step out of order with and without shared memory."""
    env_fns = [make_env("CartPole-v1", i) for i in range(4)]

    env = build("boltzlabs", env_fns)
    with pytest.raises(
        NoAsyncCallError,
        match=re.escape("Calling `step_wait` without any prior call to `step_async`."),
    ):
        env.action_space.sample()
        env.reset()
        env.step_wait()

    env.close(terminate=True)

    env = build("boltzlabs", env_fns)
    with pytest.raises(
        AlreadyPendingCallError,
        match=re.escape(
            "Calling `step_async` while waiting for a pending call to `reset` to complete"
        ),
    ):
        actions = env.action_space.sample()
        env.reset_async()
        env.step_async(actions)

    with pytest.warns(
        UserWarning,
        match=re.escape(
            "Calling `close` while waiting for a pending call to `reset` to complete."
        ),
    ):
        env.close(terminate=True)


@CLOSED_ERROR
def test_already_closed_async_vector_env(build):
    """Test the error if a function is called if environment is already closed."""
    env_fns = [make_env("CartPole-v1", i) for i in range(4)]
    with pytest.raises(ClosedEnvironmentError):
        env = build("boltzlabs", env_fns)
        env.close()
        env.reset()


@HETEROGENEOUS
def test_check_spaces_async_vector_env(build):
    """Test check spaces for async vector environment with and without shared memory."""
    # CartPole-v1 - observation_space: Box(4,), action_space: Discrete(2)
    env_fns = [make_env("CartPole-v1", i) for i in range(8)]
    # FrozenLake-v1 - Discrete(16), action_space: Discrete(4)
    env_fns[1] = make_env("FrozenLake-v1", 1)
    with pytest.raises(RuntimeError):
        env = build("boltzlabs", env_fns)
        env.close(terminate=True)


@REFUSED_SPACE
def test_custom_space_async_vector_env(build):
    """Test custom spaces with async vector environment."""
    env_fns = [generic_env(obs="custom", act="custom", behaviour="custom")] * 4

    env = build("boltzlabs", env_fns)
    reset_observations, reset_infos = env.reset()

    assert isinstance(env.single_action_space, generic.CustomSpace)
    assert isinstance(env.action_space, Tuple)

    actions = ("action-2", "action-3", "action-5", "action-7")
    step_observations, rewards, terminations, truncations, _ = env.step(actions)

    env.close()

    assert isinstance(env.single_observation_space, generic.CustomSpace)
    assert isinstance(env.observation_space, Tuple)

    assert isinstance(reset_observations, tuple)
    assert reset_observations == ("reset", "reset", "reset", "reset")

    assert isinstance(step_observations, tuple)
    assert step_observations == (
        "step(action-2)",
        "step(action-3)",
        "step(action-5)",
        "step(action-7)",
    )


@NO_SHARED_MEMORY
def test_custom_space_async_vector_env_shared_memory(build):
    """Test custom space with shared memory."""
    env_fns = [generic_env(obs="custom", act="custom", behaviour="custom")] * 4
    with pytest.raises(ValueError):
        env = build("boltzlabs", env_fns)
        env.close(terminate=True)


def test_float16_async_vector_env_shared_memory(build):
    """Test observation dtypes without an `array` typecode (e.g. float16) with shared memory."""
    envs = build("boltzlabs", [generic_env(obs="box_f16")] * 2)

    observations, _ = envs.reset(seed=0)
    assert observations.dtype == np.float16
    assert observations.shape == (2, 3)

    observations, *_ = envs.step(envs.action_space.sample())
    assert observations.dtype == np.float16
    assert observations.shape == (2, 3)

    envs.close()


@FAILURES_ARE_LANES
def test_async_vector_subenv_error(build):
    envs = build("boltzlabs", [generic_env(behaviour="raise_error")] * 2)

    with warnings.catch_warnings(record=True) as caught_warnings:
        envs.reset(seed=[0, 0])
    assert len(caught_warnings) == 0

    with warnings.catch_warnings(record=True) as caught_warnings:
        with pytest.raises(ValueError, match="Error in reset"):
            envs.reset(seed=[1, 0])

    envs.close()

    assert len(caught_warnings) == 3
    assert (
        "Received the following error from Worker-0 - Shutting it down"
        in caught_warnings[0].message.args[0]
    )
    assert (
        'in raise_error_reset\n    raise ValueError("Error in reset")\nValueError: Error in reset'
        in caught_warnings[1].message.args[0]
    )
    assert (
        caught_warnings[2].message.args[0]
        == "\x1b[31mERROR: Raising the last exception back to the main process.\x1b[0m"
    )

    envs = build("boltzlabs", [generic_env(behaviour="raise_error")] * 3)

    with warnings.catch_warnings(record=True) as caught_warnings:
        with pytest.raises(ValueError, match="Error in step"):
            envs.step([0, 1, 2])

    envs.close()

    assert len(caught_warnings) == 5
    # due to variance in the step time, the order of warnings is random
    assert re.match(
        r"\x1b\[31mERROR: Received the following error from Worker-[12] - Shutting it down\x1b\[0m",
        caught_warnings[0].message.args[0],
    )
    assert re.match(
        r"\x1b\[31mERROR: Traceback \(most recent call last\):(?s:.)*in raise_error_step(?s:.)*ValueError: Error in step with [12]\n\x1b\[0m",
        caught_warnings[1].message.args[0],
    )
    assert re.match(
        r"\x1b\[31mERROR: Received the following error from Worker-[12] - Shutting it down\x1b\[0m",
        caught_warnings[2].message.args[0],
    )
    assert re.match(
        r"\x1b\[31mERROR: Traceback \(most recent call last\):(?s:.)*in raise_error_step(?s:.)*ValueError: Error in step with [12]\n\x1b\[0m",
        caught_warnings[3].message.args[0],
    )
    assert (
        caught_warnings[4].message.args[0]
        == "\x1b[31mERROR: Raising the last exception back to the main process.\x1b[0m"
    )
