"""How the ported Gymnasium tests build their vector envs, on both sides.

Upstream hands SyncVectorEnv/AsyncVectorEnv a list of callables. A sandbox takes a source and
JSON params instead, so the ported tests describe each sub-env as a `Source` (a registered id, or
a variant of envs/generic/env.py by name) and `build(vectoriser, sources, ...)` makes from it:

    "sync"       SyncVectorEnv([source.thunk, ...]): the reference, in this process
    "async"      AsyncVectorEnv([source.thunk, ...]) (only where upstream tests AsyncVectorEnv's API)
    "boltzlabs"  BoltzLabsVecEnv.make(source, n, **params): one sandbox per sub-env

Ours is handed out behind `WithoutRuntimeInfo`, which takes the runtime's own info keys
(episode_ids, episode_record: docs/gym.md, "Infos") out of infos, because upstream compares infos
exactly; every other key, and everything else, is the adapter's. Every env built is closed when the
test ends. The marks below are the differences docs/gym.md
lists; each names its reason once, here.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path

import gymnasium as gym
import pytest
from gymnasium.vector import AsyncVectorEnv, SyncVectorEnv, VectorWrapper

from boltzlabs.errors import EnvError, PoolClosedError
from boltzlabs.gym import BoltzLabsVecEnv

# Headless, as upstream's CI runs these: MuJoCo renders through EGL (software, no display; the
# sandboxes get it too: sandbox/policy.toml [pass_environment]) and pygame's windows go to SDL's
# dummy driver. Without them the in-process reference aborts, looking for a display.
os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
os.environ.setdefault("SDL_AUDIODRIVER", "dummy")

GENERIC_DIR = Path(__file__).resolve().parent / "envs" / "generic"
_spec = importlib.util.spec_from_file_location("gymnasium_vector_generic_env", GENERIC_DIR / "env.py")
generic = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(generic)

STEP_TIMEOUT = 30.0  # a bound against a hang under load, not a timing assertion


@dataclass(frozen=True)
class Source:
    """One sub-env: a Gymnasium id (`gym_id`) or a variant of envs/generic (`params`).

    `seed` is upstream's make_env(env_name, seed): the in-process thunk seeds its action space and
    resets with it, as upstream's does; a sandbox cannot take it (the pool seeds at reset)."""

    gym_id: str | None = None
    params: dict = field(default_factory=dict, hash=False)
    seed: int | None = field(default=None, compare=False)

    def thunk(self):
        """The in-process sub-env upstream's callable would make."""
        if self.gym_id is None:
            return generic.make(**self.params)
        env = gym.make(self.gym_id, **self.params)
        if self.seed is not None:
            env.action_space.seed(self.seed)
            env.reset(seed=self.seed)
        return env

    @property
    def source(self):
        """What RLPool runs: the registered id or the generic env dir."""
        return self.gym_id if self.gym_id is not None else str(GENERIC_DIR)

    def key(self):
        """What makes two sub-envs the same pool lane (the seed does not)."""
        return self.gym_id, tuple(sorted((k, repr(v)) for k, v in self.params.items()))


def _gym_thunk(gym_id: str, params: dict, seed: int | None):
    """Source.thunk for a registered id, written out: it pickles alone (Source would take its
    module's `generic`, loaded by path and importable nowhere, into the pickle)."""
    env = gym.make(gym_id, **params)
    if seed is not None:
        env.action_space.seed(seed)
        env.reset(seed=seed)
    return env


def make_env(env_name: str, seed: int | None = None, **kwargs) -> Source:
    """Upstream's tests/vector/testing_utils.make_env, as a Source."""
    return Source(env_name, {"disable_env_checker": True, **kwargs}, seed)


def gym_env(env_id: str, **kwargs) -> Source:
    """`lambda: gym.make(env_id, **kwargs)`, as a Source."""
    return Source(env_id, kwargs)


def generic_env(**params) -> Source:
    """`lambda: GenericTestEnv(...)`, as a Source naming its spaces and functions (envs/generic/env.py)."""
    return Source(None, params)


# The keys BoltzLabsVecEnv adds to every env's infos (docs/gym.md, "Infos"); SyncVectorEnv has none.
RUNTIME_INFO_KEYS = ("episode_ids", "episode_record")


class WithoutRuntimeInfo(VectorWrapper):
    """BoltzLabsVecEnv without the runtime's info keys, for upstream's exact comparisons of infos.

    Forwards everything else to the adapter (call/get_attr/set_attr, step_async, env_contract, ...)."""

    def reset(self, **kwargs):
        """The adapter's reset, its infos without RUNTIME_INFO_KEYS."""
        obs, infos = self.env.reset(**kwargs)
        return obs, _strip(infos)

    def step(self, actions):
        """The adapter's step, its infos without RUNTIME_INFO_KEYS."""
        *results, infos = self.env.step(actions)
        return (*results, _strip(infos))

    def step_wait(self, *args, **kwargs):
        """The adapter's step_wait, its infos without RUNTIME_INFO_KEYS."""
        *results, infos = self.env.step_wait(*args, **kwargs)
        return (*results, _strip(infos))

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.env, name)


def _strip(infos: dict) -> dict:
    for key in RUNTIME_INFO_KEYS:
        infos.pop(key, None)
        infos.pop(f"_{key}", None)
    return infos


@pytest.fixture
def build():
    """`build(vectoriser, sources, **vector_kwargs)`: the vector env over these sub-envs; with
    `thunks=True` ours is built as the others are, from the sources' thunks (env_fns)."""
    made = []

    def make(vectoriser: str, sources, *, thunks: bool = False, **vector_kwargs):
        sources = list(sources)
        if vectoriser == "sync":
            env = SyncVectorEnv([s.thunk for s in sources], **vector_kwargs)
        elif vectoriser == "async":
            env = AsyncVectorEnv([s.thunk for s in sources], **vector_kwargs)
        elif thunks:
            # Upstream's callables (env_fns), each called in its own sandbox: a seed in a thunk is seen.
            assert all(s.gym_id is not None for s in sources), "thunks=True builds registered ids"
            fns = [functools.partial(_gym_thunk, s.gym_id, s.params, s.seed) for s in sources]
            env = WithoutRuntimeInfo(BoltzLabsVecEnv(fns, step_timeout=STEP_TIMEOUT, warmup=False, **vector_kwargs))
        else:
            assert vectoriser == "boltzlabs", vectoriser
            if len({s.key() for s in sources}) != 1:
                pytest.fail("a pool runs the same source and params in every lane (mark the test HETEROGENEOUS)")
            # No warm-up probe: what it saves is memory per env, which these tests do not measure, and it
            # costs every pool start (tests/test_warmup.py tests it).
            options = {"step_timeout": STEP_TIMEOUT, "warmup": False}
            env = WithoutRuntimeInfo(BoltzLabsVecEnv.make(sources[0].source, len(sources), **options,
                                                          **sources[0].params, **vector_kwargs))
        made.append(env)
        return env

    yield make
    for env in made:
        env.close()  # idempotent on both sides: a test may have closed it already


@pytest.fixture
def make_vec(build):
    """`make_vec(vectoriser, env_id, num_envs=1, **kwargs)`: gym.make_vec(..., vectorization_mode="sync")
    on the sync side, the equivalent pool on ours."""

    def make(vectoriser: str, env_id: str, num_envs: int = 1, vector_kwargs=None, **kwargs):
        vector_kwargs = vector_kwargs or {}
        if vectoriser == "sync":
            env = gym.make_vec(env_id, num_envs=num_envs, vectorization_mode="sync", vector_kwargs=vector_kwargs,
                               **kwargs)
            return env
        return build(vectoriser, [gym_env(env_id, **kwargs)] * num_envs, **vector_kwargs)

    return make


# -- the differences (docs/gym.md, "Gymnasium's own tests") ------------------------------------------

REFUSED_SPACE = pytest.mark.xfail(
    strict=True, raises=ValueError,
    reason="the adapter refuses spaces it cannot rebuild from their spec, for an env directory (a custom "
           "space class); for gym ids and env_fns it builds one env in the trainer to read them")
HETEROGENEOUS = pytest.mark.skip(
    reason="a pool runs one source with one set of params in every lane: its sub-envs cannot differ")
SANDBOX_RNG = pytest.mark.xfail(
    strict=True, reason="seeding a sub-env's action_space inside its sandbox cannot seed the host's batched "
                        "action_space (SyncVectorEnv copies the first sub-env's)")
NO_PYGAME = pytest.mark.skipif(importlib.util.find_spec("pygame") is None,
                               reason="pygame is not installed (upstream needs it too)")
NO_BOX2D = pytest.mark.skipif(importlib.util.find_spec("Box2D") is None,
                              reason="box2d is not installed (upstream needs it too)")


def vectorisers(*, boltzlabs=(), sync=(), names=("sync", "boltzlabs")):
    """Parameters for `vectoriser`, with marks on ours (`boltzlabs=`) or on the reference (`sync=`)."""
    marks = {"boltzlabs": boltzlabs, "sync": sync, "async": sync}
    return [pytest.param(name, marks=marks[name], id=name) for name in names]


def space_params(*, boltzlabs=(), names=("sync", "boltzlabs")):
    """(space_index, vectoriser) over Gymnasium's TESTING_SPACES, ids upstream's space ids; on our side,
    `boltzlabs=` marks. Every one of them travels in the handshake (Graph too), so none is refused."""
    TESTING_SPACES_IDS = generic.testing_spaces().TESTING_SPACES_IDS
    params = []
    for index, space_id in enumerate(TESTING_SPACES_IDS):
        for vectoriser in vectorisers(boltzlabs=boltzlabs, names=names):
            params.append(pytest.param(index, vectoriser.values[0], marks=vectoriser.marks,
                                       id=f"{space_id}-{vectoriser.id}"))
    return params


NO_ASYNC_RESET = pytest.mark.xfail(
    strict=True, raises=(AttributeError, ValueError), reason="BoltzLabsVecEnv has step_async/step_wait but no reset_async/reset_wait, and raises "
                        "ValueError (not NoAsyncCallError/AlreadyPendingCallError) for a step_wait out of order")
CLOSED_ERROR = pytest.mark.xfail(
    strict=True, raises=PoolClosedError, reason="use after close raises boltzlabs' PoolClosedError, not gymnasium.error.ClosedEnvironmentError")
NO_SHARED_MEMORY = pytest.mark.skip(reason="observations cross a socket: there is no shared_memory option")
FAILURES_ARE_LANES = pytest.mark.xfail(
    strict=True, raises=EnvError, reason="an env's exception is a lane, not an exception: step() returns it truncated with "
                        "infos['error'] (reset raises EnvError) and no warnings are issued")
MP_TIMEOUT = pytest.mark.xfail(
    strict=True, raises=TimeoutError,
    reason="step_wait(timeout=) raises the built-in TimeoutError, not multiprocessing.TimeoutError (not a subclass)")
UPSTREAM_RENDER_LIST = pytest.mark.xfail(
    strict=True, raises=AssertionError,
    reason="upstream's test fails on SyncVectorEnv as well with gymnasium 1.4.0: HumanRendering asserts that "
           "render() returns arrays, and an rgb_array_list env returns lists")
NO_MOVIEPY = pytest.mark.skipif(importlib.util.find_spec("moviepy") is None,
                                reason="moviepy is not installed (upstream needs it too)")
PER_ENV_WRAPPERS = pytest.mark.skip(
    reason="make_vec(wrappers=...) wraps each sub-env in a Python callable, which cannot enter a sandbox")
SANDBOX_RNG_SEEN = pytest.mark.skip(
    reason="the same host-side action_space as every other id (test_sync_vector_determinism[CartPole-v1-boltzlabs] "
           "checks the difference, strict)")


def pytest_collection_modifyitems(config, items):
    """Gymnasium's own logger warnings ("WARN: Box high's precision lowered",
    "CartPole-v0 is out of date") are what the upstream tests provoke on
    purpose (upstream filters them in its own configuration): kept out of the
    summary for these tests only."""
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.filterwarnings("ignore:.*WARN"))
