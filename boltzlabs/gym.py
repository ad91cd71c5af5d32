"""The Gymnasium adapter: any pool (RLPool, ClusterPool) as a `gymnasium.vector.VectorEnv`.

    training loop / Gymnasium wrappers
        | reset(seed=, options=) / step(actions) / render()
    BoltzLabsVecEnv --iterate(action_space)--> Pool (RLPool or ClusterPool) --one request--> worker(s)
        | <--concatenate(observation_space)-- per-lane obs as the envs sent them

The adapter follows SyncVectorEnv (Gymnasium 1.x) step for step, so a seed
and an action sequence give the same arrays in every autoreset mode:
NEXT_STEP resets the lanes that finished at the previous step in the same
request as stepping the others, SAME_STEP resets the finished lanes right
after the step (the finished episode's obs and info in infos["final_obs"] and
infos["final_info"]), DISABLED leaves resets to you (options["reset_mask"]).

Every key of infos is in Gymnasium's vector format (an array per key and
its `_key` mask; a dict of them for a nested dict), so DictInfoToList and the
vector wrappers work on top. Besides the envs' own keys, infos carry two of
the runtime's (an env key of the same name wins; the shadowing is logged once):
  episode_ids         the UUIDv7 episode id of every lane (object array)
  episode_record      for each lane whose episode ended on this step: its
                      "id", "seed" (None unless the reset that began it was
                      seeded), "length" and "return"; `_episode_record` masks them
How many episodes ended on the latest step is `envs.completed_episodes` (a
count for the batch has no place in a per-lane format).
A lane whose env failed (exception, death, missed deadline) comes back
truncated with infos["error"] and its last observation; autoreset respawns it.

Seeds are checked as Gymnasium checks them, before anything runs;
`np_random_seed` is each env's own (asked of the env where the source
serves a Gymnasium env object: gym ids and env_fns; an env with no
generator yet draws its seed then, as SyncVectorEnv's does), else the seed
each lane's latest seeded reset was given (-1 where none was). `call`,
`get_attr` and `set_attr` reach the envs in their sandboxes (RLPool.call and
friends).

Built as AsyncVectorEnv is, from env_fns: `BoltzLabsVecEnv([make_env(i) for i
in range(n)])` pickles each callable here (the trainer is the trusted side)
and calls env_fns[i]() in lane i's own sandbox (boltzlabs/pool/sources.py,
boltzlabs/runtime/env_fns.py). Failures that every lane keeps hitting are
warned about once per pool and kind (boltzlabs.pool.protocol).
"""

from __future__ import annotations

import copy as _copy
import logging
from collections.abc import Callable
from typing import Any

import gymnasium
import numpy as np
from gymnasium import error as gym_error
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array, iterate

from boltzlabs.pool.protocol import Pool
from boltzlabs.errors import EnvError
from boltzlabs.pool.spaces import gym_rebuilder, rebuilder, space_or_rebuild
from boltzlabs.runtime.gym_serve import NP_RANDOM_SEED, SPACES
from boltzlabs.runtime.spec import graph_restorer

__all__ = ["BoltzLabsVecEnv"]

logger = logging.getLogger("boltzlabs")
_RUNTIME_KEYS = ("episode_ids", "episode_record")
# reset(options={SCRUB_OPTION: True}): the envs' sandboxes scrubbed first (RLPool.reset(scrub=True)).
SCRUB_OPTION = "boltzlabs.scrub"


class BoltzLabsVecEnv(VectorEnv):
    """A Gymnasium vector env whose envs each run in their own sandbox: AsyncVectorEnv's drop-in.

        envs = BoltzLabsVecEnv([make_env(i) for i in range(8)])    # as AsyncVectorEnv(env_fns)
        envs = BoltzLabsVecEnv.make("CartPole-v1", num_envs=8)      # or a source: an id, an env directory
        obs, infos = envs.reset(seed=42)
        obs, rewards, terminations, truncations, infos = envs.step(envs.action_space.sample())

    `env_fns`: a list of callables, each returning a Gymnasium env (wrapped
    as you like: AtariPreprocessing, FrameStackObservation, an index of its
    own); env i is env_fns[i]() built in its own sandbox. Or an open pool
    (boltzlabs.pool.protocol.Pool: an RLPool or a ClusterPool) whose env
    declared its spaces in serve() (gym sources always do). The adapter owns
    the pool from then on and close() closes it. `observation_space` /
    `action_space` override the declared ones; a space the handshake cannot
    describe (a package's own space class) is read from one env built here
    from the same thunk or id, as AsyncVectorEnv builds one for its spaces.
    `copy`: return copies of the batched observations (as SyncVectorEnv).
    `observation_mode`: "same" or an (observation_space,
    single_observation_space) pair (a pool's lanes share one space).
    `shared_memory`, `context` and `daemon` are AsyncVectorEnv's and do
    nothing here (observations cross a pipe; every env is its own process).
    Other keywords are RLPool's options (step_timeout, memory_limit,
    spawn, env_vars, ...); a misspelt one is refused (TypeError naming it).
    """

    # Set by make() before __init__ for the pool it makes: how to build one env here to read a space the
    # handshake cannot describe (pool/spaces.py), or None. Absent otherwise (__init__ makes its own).
    _rebuild: Callable[[str], Any] | None

    def __init__(
        self,
        env_fns,
        *,
        autoreset_mode: str | AutoresetMode = AutoresetMode.NEXT_STEP,
        observation_space: gymnasium.Space | None = None,
        action_space: gymnasium.Space | None = None,
        copy: bool = True,
        observation_mode="same",
        shared_memory=None,
        context=None,
        daemon=None,
        **pool_kwargs,
    ):
        rebuild = None
        if isinstance(env_fns, Pool):
            if pool_kwargs:
                raise TypeError(
                    f"BoltzLabsVecEnv(pool) takes an open pool alone; pool options "
                    f"({', '.join(sorted(pool_kwargs))}) go with env_fns or a source "
                    "(BoltzLabsVecEnv.make(source, n, ...))"
                )
            pool = env_fns
        elif isinstance(env_fns, (list, tuple)) or (hasattr(env_fns, "__iter__") and not isinstance(env_fns, str)):
            env_fns = list(env_fns)
            if callable(pool_kwargs.get("worker")):
                raise TypeError(
                    "worker= is AsyncVectorEnv's custom worker function, which cannot run here: each "
                    "env is served by boltzlabs inside its sandbox (worker='tcp://host:port' runs the "
                    "pool on a remote boltzlabs worker)"
                )
            from boltzlabs.pool.client import RLPool

            pool = RLPool(env_fns, len(env_fns), **pool_kwargs)
            rebuild = rebuilder(env_fns[0] if env_fns else None)
        else:
            raise TypeError(
                f"BoltzLabsVecEnv takes a list of env_fns (callables returning Gymnasium envs, as "
                f"AsyncVectorEnv) or an open pool (an RLPool or a boltzlabs.cluster.ClusterPool), "
                f"not {type(env_fns).__name__}; for a source, BoltzLabsVecEnv.make(source, n)"
            )
        try:
            self._attach(
                pool,
                autoreset_mode,
                observation_space,
                action_space,
                copy,
                observation_mode,
                getattr(self, "_rebuild", rebuild),
            )
        except BaseException:
            if pool is not env_fns:
                pool.close()
            raise

    def _attach(self, pool, autoreset_mode, observation_space, action_space, copy, observation_mode, rebuild) -> None:
        self.pool = pool
        self.autoreset_mode = AutoresetMode(autoreset_mode)
        contract = pool.env_contract
        if isinstance(observation_mode, tuple) and len(observation_mode) == 2:
            batched, observation_space = observation_mode
        elif observation_mode == "same":
            batched = None
        else:
            raise ValueError(
                f"observation_mode={observation_mode!r}: a pool's envs share one observation space; "
                "use 'same' (the default) or an (observation_space, single_observation_space) pair"
            )
        self.single_observation_space = observation_space or space_or_rebuild(
            contract.observation_space, "observation_space", rebuild, "BoltzLabsVecEnv"
        )
        self.single_action_space = action_space or space_or_rebuild(
            contract.action_space, "action_space", rebuild, "BoltzLabsVecEnv"
        )
        self.num_envs = pool.n
        if SPACES in ((contract.attributes or {}).get("methods") or ()) and pool.n > 1:
            _check_same_spaces(pool, contract)
        self.observation_space = batched or batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self.metadata = dict(contract.metadata)
        self.metadata["autoreset_mode"] = self.autoreset_mode
        self.render_mode = contract.render_mode
        self.copy = copy
        self._observations = create_empty_array(self.single_observation_space, n=self.num_envs, fn=np.zeros)
        # For a space that holds a Graph: each obs with its GraphInstances back (the wire carries plain tuples).
        self._restore = graph_restorer(self.single_observation_space)
        self._env_obs = [None] * self.num_envs
        self._box = type(self.single_observation_space) is gymnasium.spaces.Box  # rows stacked in one call
        # Spaces whose batch Gymnasium's iterate() splits into its rows (list(actions)), as the pool does.
        self._array_actions = type(self.action_space) in (
            gymnasium.spaces.Box,
            gymnasium.spaces.MultiBinary,
            gymnasium.spaces.MultiDiscrete,
        )
        self._all_reset = False  # every lane has an observation: step() may run
        self._autoreset = np.zeros(self.num_envs, dtype=np.bool_)
        self._shadowed: set = set()
        self._waiting = False  # a step_async() awaits its step_wait()
        self._waited: dict = {}  # lane -> its result, gathered by step_wait()
        self._episodes_ended: list = []
        self._seeds = [-1] * self.num_envs  # the seed each lane was last reset with (-1: none yet)
        # A Gymnasium env object behind every lane (serve_env: gym ids, env_fns): ask it for its seed.
        self._env_objects = NP_RANDOM_SEED in ((contract.attributes or {}).get("methods") or ())
        # pool.episode_ids, and as infos carry it
        self._ids_list: list[Any] | None = None
        self._ids_array: np.ndarray | None = None
        self.completed_episodes = 0
        """How many episodes ended on the latest step (0 after a reset)."""

    @classmethod
    def make(
        cls, source: str, num_envs: int = 1, *, autoreset_mode=AutoresetMode.NEXT_STEP, copy: bool = True, **kwargs
    ) -> BoltzLabsVecEnv:
        """A pool of `num_envs` sandboxes of `source` ("CartPole-v1",
        "gym://Pendulum-v1" or an env directory) behind the adapter. `kwargs`
        are RLPool's options (step_timeout, memory_limit, ...) and the env's
        params (render_mode="rgb_array", ..., or params={...}), checked before
        any sandbox starts.
        `cluster="ray"` (or a Ray cluster's address, with `envs_per_node=`)
        spreads the envs over a Ray cluster (boltzlabs.cluster.ClusterPool)."""
        observation_space, action_space = kwargs.pop("observation_space", None), kwargs.pop("action_space", None)
        pool: Pool
        if kwargs.get("cluster") is not None:
            from boltzlabs.cluster import ClusterPool

            pool = ClusterPool(source, num_envs, **kwargs)
        else:
            from boltzlabs.pool.client import RLPool

            pool = RLPool(source, num_envs, **kwargs)
        self = cls.__new__(cls)
        self._rebuild = gym_rebuilder(source, kwargs)  # read by __init__ for a pool it did not make
        try:
            cls.__init__(
                self,
                pool,
                autoreset_mode=autoreset_mode,
                copy=copy,
                observation_space=observation_space,
                action_space=action_space,
            )
        except BaseException:
            pool.close()
            raise
        return self

    # -- what rlmesh's SandboxVectorEnv exposes --------------------------------------

    @property
    def source(self) -> str:
        return self.pool.source

    @property
    def env_id(self) -> str:
        """This pool's UUIDv7."""
        return self.pool.env_id

    @property
    def env_contract(self):
        return self.pool.env_contract

    @property
    def observation_space_spec(self) -> dict:
        return self.pool.env_contract.observation_space

    @property
    def action_space_spec(self) -> dict:
        return self.pool.env_contract.action_space

    # -- the VectorEnv API --------------------------------------------------------------

    @property
    # A tuple, as Gymnasium's own SyncVectorEnv and AsyncVectorEnv return, where VectorEnv declares int | None.
    def np_random_seed(self) -> tuple[int, ...]:  # type: ignore[override]
        """The seed each env's generator was made from, as SyncVectorEnv's
        ((42, 43) after reset(seed=42)). For envs served as Gymnasium env
        objects (serve_env: gym ids, env_fns) each env's own np_random_seed,
        read in its sandbox: a thunk that seeds its env is seen, and an env
        with no generator yet makes one from a seed drawn from entropy (a
        128-bit int), as SyncVectorEnv's envs do when asked. For an env
        directory that serves functions, the seed of the lane's latest
        seeded reset, -1 (Gymnasium's "unknown") before one: there is no
        generator to ask. A value an env sends that is not a seed is an
        EnvError naming its lane."""
        if self._env_objects:
            return tuple(_seed_from_env(seed, i) for i, seed in enumerate(self.pool.call(NP_RANDOM_SEED)))
        return tuple(self._seeds)

    def reset(self, *, seed: int | list | None = None, options: dict | None = None):
        """Reset every env (or those of options["reset_mask"]), as SyncVectorEnv.reset:
        it pops "reset_mask" from `options` (so a wrapper above sees what
        SyncVectorEnv's would), and each env is given the rest (`{}` when
        only the mask was there, None when no options were given).
        `options["boltzlabs.scrub"] = True` (popped too) scrubs each env's
        sandbox first: RLPool.reset(scrub=True), docs/code-rl.md."""
        n = self.num_envs
        seeds = _check_seeds(seed, n)
        lanes = list(range(n))
        scrub = False
        if options is not None and SCRUB_OPTION in options:
            scrub = options.pop(SCRUB_OPTION)
        if options is not None and "reset_mask" in options:
            mask = _check_reset_mask(options["reset_mask"], n)
            options.pop("reset_mask")
            lanes = np.flatnonzero(mask).tolist()
        self.pool.reset(seed=seeds, where=lanes, options=options, scrub=scrub)
        for i in lanes:
            if seeds[i] is not None:
                self._seeds[i] = seeds[i]
        infos: dict = {}
        failed = []
        observations = self.pool.observations
        for i in lanes:
            info = self.pool.reset_infos[i]
            if observations[i] is None and "error" in info:
                failed.append(i)
                continue
            self._env_obs[i] = observations[i]
            infos = self._add_info(infos, info, i)
        self._all_reset = self._all_reset or all(o is not None for o in self._env_obs)
        if failed:
            raise EnvError(
                f"env {failed[0]} could not be reset: {self.pool.reset_infos[failed[0]]['error']}", env_index=failed[0]
            )
        self._autoreset[lanes] = False
        self._add_runtime_info(infos, completed=None)
        return self._batch(), infos

    def step(self, actions):
        items, resets = self._prepare(actions)
        # Infos left in a grouped pool's columns until _stepped asks batched_infos (SAME_STEP reads each env's).
        return self._stepped(
            *self.pool.step_full(
                items, resets, lazy_infos=self.autoreset_mode != AutoresetMode.SAME_STEP, array_items=True
            )
        )

    def step_async(self, actions) -> None:
        """Send every env its action and return at once (the first half of
        step(), as Gymnasium 0.x's VectorEnv had it); step_wait() gives the
        step's results. Between the two the trainer is free to work."""
        items, resets = self._prepare(actions)
        self.pool.send(items, None, resets)
        self._waiting = True

    def step_wait(self, timeout=None):
        """The results of the step_async() before, exactly as step() returns
        them. `timeout` (seconds) bounds the wait; it raises TimeoutError when
        it passes (the results stay in flight: call step_wait() again)."""
        if not self._waiting:
            raise ValueError("step_wait() without a step_async() before it")
        pool = self.pool
        n = self.num_envs
        # Results come in the order envs finish; put them back in lane order.
        outstanding = n - len(self._waited)
        env_ids, obs, rewards, terminated, truncated, infos = pool.recv_full(outstanding, timeout)
        self._episodes_ended.extend(pool.finished_episodes)
        for k, i in enumerate(env_ids.tolist()):
            self._waited[i] = (obs[k], rewards[k], terminated[k], truncated[k], infos[k])
        if len(self._waited) < n:
            raise TimeoutError(f"step_wait(): {n - len(self._waited)} env(s) had not finished within {timeout} s")
        lanes = [self._waited[i] for i in range(n)]
        self._waited = {}
        self._waiting = False
        finished = sorted(self._episodes_ended, key=lambda e: e["env"])
        self._episodes_ended = []
        return self._stepped(
            [x[0] for x in lanes],
            np.array([x[1] for x in lanes], dtype=np.float64),
            np.array([x[2] for x in lanes], dtype=np.bool_),
            np.array([x[3] for x in lanes], dtype=np.bool_),
            [x[4] for x in lanes],
            finished,
        )

    def _prepare(self, actions):
        n = self.num_envs
        mode = self.autoreset_mode
        if self._waiting:
            raise ValueError("a step_async() is waiting for its step_wait()")
        if not self._all_reset:
            lanes = [i for i, o in enumerate(self._env_obs) if o is None]
            raise gym_error.ResetNeeded(
                f"Cannot call step() before calling reset(): env(s) {lanes[:10]} "
                f"{'have' if len(lanes) > 1 else 'has'} not been reset (as in "
                "SyncVectorEnv, whose envs raise this)"
            )
        if self._array_actions and type(actions) is np.ndarray and actions.ndim > 0:
            # iterate's rows or items (numpy scalars: a Discrete's), which the pool takes from the
            # array itself (step_full(array_items=True))
            items = actions
        else:
            items = list(iterate(self.action_space, actions))
        if len(items) != n:
            raise ValueError(f"step() needs {n} actions, one per env; got {len(items)}")
        resets = None
        if mode == AutoresetMode.NEXT_STEP:
            resets = np.flatnonzero(self._autoreset).tolist() if np.count_nonzero(self._autoreset) else None
        elif mode == AutoresetMode.DISABLED and self._autoreset.any():
            lanes = np.flatnonzero(self._autoreset).tolist()
            raise ValueError(
                f"envs {lanes} finished their episodes and autoreset is DISABLED: reset them first "
                "with reset(options={'reset_mask': mask})"
            )
        return items, resets

    def _stepped(self, obs, rewards, terminated, truncated, env_infos, finished=None):
        """The VectorEnv step results from every lane's (obs, reward, terminated, truncated, info)."""
        pool = self.pool
        n = self.num_envs
        mode = self.autoreset_mode
        if finished is None:
            finished = pool.finished_episodes
        rewards, terminated, truncated = rewards.copy(), terminated.copy(), truncated.copy()
        infos: dict = {}
        whole = None  # the pool's array of this step's obs rows (batched_obs)
        if mode == AutoresetMode.SAME_STEP:
            done = np.flatnonzero(terminated | truncated).tolist()
            if done:
                pool.reset(where=done)
            observations = pool.observations
            for i in range(n):
                if i in done:
                    final = obs[i] if obs[i] is not None else self._env_obs[i]
                    # The env's own (writable) arrays in SyncVectorEnv; ours are views of the frame.
                    final = _writable(final)
                    if self._restore is not None:
                        final = self._restore(final)
                    infos = self._add_info(infos, {"final_obs": final, "final_info": env_infos[i]}, i)
                    self._env_obs[i] = observations[i] if observations[i] is not None else final
                    infos = self._add_info(infos, pool.reset_infos[i], i)
                else:
                    self._lane_obs(i, obs[i])
                    infos = self._add_info(infos, env_infos[i], i)
        else:
            # Hot path: one obs and info per lane, batched below; infos of the
            # same keys and value types batched a key at a time.
            whole = pool.batched_obs(obs)
            if whole is None and any(o is None for o in obs):
                for i in range(n):
                    self._lane_obs(i, obs[i])
            else:
                self._env_obs[:] = obs
            batched = pool.batched_infos(env_infos)
            if batched is None:
                batched = _batch_infos(env_infos, n)
            if batched is not None:
                infos = batched
            else:
                for i in range(n):
                    infos = self._add_info(infos, env_infos[i], i)
        self._autoreset = terminated | truncated
        self._add_runtime_info(infos, completed=finished)
        return self._batch(whole), rewards, terminated, truncated, infos

    def render(self):
        """One frame per env, as SyncVectorEnv.render() (None for each when render_mode is None)."""
        return tuple(self.pool.render_all())

    def call(self, name: str, *args, **kwargs) -> tuple:
        """`name(*args, **kwargs)` in every env, as SyncVectorEnv.call: a
        method is called, any other attribute's value returned. One result
        per env; AttributeError for a name the env lacks (RLPool.call)."""
        return tuple(_writable(r) for r in self.pool.call(name, *args, **kwargs))

    def get_attr(self, name: str) -> tuple:
        """The attribute `name` of every env: SyncVectorEnv's get_attr, which is call(name)."""
        return self.call(name)

    def set_attr(self, name: str, values) -> None:
        """Set `name` in every env: one value for all, or a list or tuple of
        one per env (SyncVectorEnv.set_attr, its ValueError for a wrong length)."""
        self.pool.set_attr(name, values)

    def close_extras(self, **kwargs) -> None:
        self.pool.close()

    def __enter__(self) -> BoltzLabsVecEnv:
        return self

    def __exit__(self, *exc) -> None:
        """`with BoltzLabsVecEnv(...) as envs:` closes it (and every sandbox) at the end."""
        self.close()

    def __repr__(self) -> str:
        return f"BoltzLabsVecEnv({self.pool.source!r}, num_envs={self.num_envs})"

    # -- helpers -------------------------------------------------------------------------

    def _lane_obs(self, i: int, obs) -> None:
        # A failed lane has no observation: it keeps its last one (it is truncated
        # and carries infos["error"]).
        if obs is not None:
            self._env_obs[i] = obs

    def _batch(self, whole=None):
        """The batch of every lane's latest obs; `whole`: the pool's array of this step's obs
        rows, every lane's (Pool.batched_obs), or None."""
        if whole is not None and whole.dtype == self._observations.dtype and whole.shape == self._observations.shape:
            if self.copy:
                return whole.copy()
            self._observations[...] = whole
            return self._observations
        missing = [i for i, o in enumerate(self._env_obs) if o is None]
        if missing:
            raise EnvError(f"env {missing[0]} has no observation yet; reset it first", env_index=missing[0])
        if self.copy:
            batch = _rows_of_one_batch(self._env_obs)
            if (
                batch is not None
                and batch.dtype == self._observations.dtype
                and batch.shape == self._observations.shape
            ):  # the pool's batch (its slots'): one copy, not two
                return batch.copy()
        env_obs = self._env_obs if self._restore is None else [self._restore(o) for o in self._env_obs]
        stacked = _stacked(env_obs, self._observations) if self._box else None
        if stacked is not None:
            if self.copy:
                return stacked  # new, and held by nothing else
            self._observations[...] = stacked
            return self._observations
        self._observations = concatenate(self.single_observation_space, env_obs, self._observations)
        if not self.copy:
            return self._observations
        if type(self._observations) is np.ndarray:  # a Box: what deepcopy makes, without its machinery
            return self._observations.copy()
        return _copy.deepcopy(self._observations)

    def _add_runtime_info(self, infos: dict, completed) -> None:
        n = self.num_envs
        ids = self.pool.episode_ids
        ids_array = self._ids_array
        # The pool replaces the list at every reset: made again only then.
        if ids is not self._ids_list or ids_array is None:
            ids_array = np.array(ids, dtype=object)
            self._ids_list, self._ids_array = ids, ids_array
        # Each key's (value, mask), as _add_info makes them: an array, or a dict of arrays (episode_record).
        runtime: dict[str, tuple[Any, np.ndarray]] = {"episode_ids": (ids_array.copy(), np.ones(n, dtype=np.bool_))}
        self.completed_episodes = len(completed or ())
        if completed:
            mask = np.zeros(n, dtype=np.bool_)
            record = {
                "id": np.full(n, None, dtype=object),
                "seed": np.full(n, None, dtype=object),
                "length": np.zeros(n, dtype=np.int64),
                "return": np.zeros(n, dtype=np.float64),
            }
            for episode in completed:
                i = episode["env"]
                mask[i] = True
                for key in list(record):
                    record[key][i] = episode[key]
            for key in list(record):  # a nested dict has its masks too, as _add_info makes them
                record[f"_{key}"] = mask.copy()
            runtime["episode_record"] = (record, mask)
        for key, (value, mask) in runtime.items():
            if key in infos:
                if key not in self._shadowed:
                    self._shadowed.add(key)
                    logger.warning(
                        "the env's info key %r shadows boltzlabs' own %r (the env's value is kept)", key, key
                    )
                continue
            infos[key] = value
            infos[f"_{key}"] = mask


def _check_same_spaces(pool, contract) -> None:
    """RuntimeError, as AsyncVectorEnv raises it, when some env's spaces differ
    from env 0's (the handshake's): env_fns may build different envs, and a
    batch of observations from differing spaces would be wrong, not refused."""
    for i, (observation, action) in enumerate(pool.call(SPACES)):
        if _comparable(observation) != _comparable(contract.observation_space):
            raise RuntimeError(
                f"BoltzLabsVecEnv(..., observation_mode='same') however env {i}'s observation space "
                f"({observation}) is not env 0's ({contract.observation_space}): the envs of a pool "
                "must share one observation space"
            )
        if _comparable(action) != _comparable(contract.action_space):
            raise RuntimeError(
                f"Some environments have an action space different from env 0's (env {i}: "
                f"{action}, env 0: {contract.action_space}). In order to batch actions, the action "
                "spaces from all environments must be equal."
            )


def _comparable(spec):
    # A space the handshake cannot describe travels as its repr, which may name addresses of
    # its process (MiniGrid's MissionSpace names a function): its class is what can be compared.
    if isinstance(spec, dict):
        return {k: _comparable(v) for k, v in spec.items() if k != "repr"}
    if isinstance(spec, list):
        return [_comparable(v) for v in spec]
    return spec


# The decimal digits of the largest np_random_seed read from an env: 256 bits, twice what numpy
# draws from entropy, and far below what int() parses in linear time.
_SEED_DIGITS = 78


def _seed_from_env(value, lane: int) -> int:
    """Lane `lane`'s np_random_seed as its env sent it (boltzlabs/runtime/gym_serve.py):
    an int of at least -1 that fits msgpack's 64 bits, or a larger one as its decimal digits.
    The env is untrusted: anything else is an EnvError naming the lane."""
    if type(value) is int and value >= -1:
        return value
    if type(value) is str and 0 < len(value) <= _SEED_DIGITS and value.isascii() and value.isdigit():
        return int(value)
    raise EnvError(
        f"env {lane} sent {value!r:.100} as its np_random_seed, which is not a seed (an int >= -1, "
        f"or the decimal digits of one below 10**{_SEED_DIGITS})",
        env_index=lane,
    )


def _check_seeds(seed, n: int) -> list:
    """One seed (or None) per env, checked as Gymnasium checks them (SyncVectorEnv.reset,
    then seeding.np_random in each env), with its exception types, before anything runs."""
    if seed is None:
        return [None] * n
    if isinstance(seed, int):
        seeds = [seed + i for i in range(n)]
    else:
        try:
            seeds = list(seed)
        except TypeError:
            raise TypeError(
                f"seed must be an int, a list of {n} ints (or None) or None, not "
                f"{type(seed).__name__} (as SyncVectorEnv)"
            ) from None
        if len(seeds) != n:
            raise ValueError(
                f"If seeds are passed as a list the length must match num_envs={n} but got length={len(seeds)}."
            )
    for i, value in enumerate(seeds):
        if value is None or (isinstance(value, int) and value >= 0):
            continue
        if not isinstance(value, int):
            raise gym_error.Error(f"Seed must be a python integer, actual type: {type(value)} (env {i})")
        raise gym_error.Error(f"Seed must be greater or equal to zero, actual value: {value} (env {i})")
    return seeds


_SCALARS = (int, float, bool)
_BIG_OBS = 4096  # bytes: below this, stacking the rows costs less than checking where they lie


def _rows_of_one_batch(obs: list):
    """The array whose rows, in order, are exactly these obs (a pool with observation slots
    returns each call's obs as rows of one batch), or None. Checked only for big obs."""
    first = obs[0]
    if type(first) is not np.ndarray or first.nbytes < _BIG_OBS:
        return None
    batch = first.base
    if type(batch) is not np.ndarray or batch.shape != (len(obs), *first.shape) or not batch.flags.c_contiguous:
        return None
    start, stride = batch.ctypes.data, batch.strides[0]
    for i, row in enumerate(obs):
        if (
            type(row) is not np.ndarray
            or row.base is not batch
            or row.ctypes.data != start + i * stride
            or row.dtype != batch.dtype
            or row.shape != first.shape
        ):
            return None
    return batch


def _stacked(rows: list, like: np.ndarray) -> np.ndarray | None:
    """A Box's rows as one new array, when that is an array of `like`'s dtype and shape, else
    None (Gymnasium's concatenate then casts, or says what is wrong): one C call, where
    np.stack takes Python steps per row (12 us against 4 for 32 rows of 8 floats)."""
    try:
        stacked = np.array(rows)
    except (ValueError, TypeError):
        return None
    if stacked.dtype != like.dtype or stacked.shape != like.shape:
        return None
    return stacked


def _batch_infos(infos: list, n: int) -> dict | None:
    """Gymnasium's vector infos (VectorEnv._add_info over every lane) for n
    infos that hold the same keys in the same order, each key's values all of
    one type: a number type (an array of it), or arrays of one shape and dtype
    (stacked). None for anything else (nested dicts, object values, keys some
    lanes lack, final_obs): the caller adds them lane by lane, as Gymnasium does.

    The hot path of a real env's step: HalfCheetah's four numpy scalars per
    lane took _add_info ~8 us a lane."""
    first = infos[0]
    if type(first) is not dict:
        return None
    if not first and not any(infos):  # every info empty (LunarLander's, CartPole's): no key to batch
        return {} if infos.count({}) == len(infos) else None
    keys = tuple(first)
    for info in infos:
        if type(info) is not dict or len(info) != len(keys) or tuple(info) != keys:
            return None
    out = {}
    for key in keys:
        if key == "final_obs":
            return None
        values = [info[key] for info in infos]
        kind = type(values[0])
        for value in values:
            if type(value) is not kind:
                return None
        if kind in _SCALARS or issubclass(kind, np.number):
            # np.zeros(n, dtype=kind) with each value assigned, as _add_info makes it
            try:
                array = np.array(values, dtype=kind)
            except (OverflowError, TypeError, ValueError):
                return None  # _add_info raises its own error
        elif kind is np.ndarray:
            shape, dtype = values[0].shape, values[0].dtype
            if any(v.shape != shape or v.dtype != dtype for v in values):
                return None
            array = np.stack(values)
        else:
            return None
        out[key] = array
        out[f"_{key}"] = np.ones(n, dtype=np.bool_)
    return out


def _writable(value):
    """`value` with writable copies of the read-only arrays the wire hands out
    (Gymnasium hands out the env's own arrays). Values came through the
    worker, whose depth cap keeps this recursion short."""
    if isinstance(value, np.ndarray):
        return value if value.flags.writeable else value.copy()
    kind = type(value)
    if kind is list or kind is tuple:
        return kind(_writable(v) for v in value)
    if kind is dict:
        return {k: _writable(v) for k, v in value.items()}
    return value


def _check_reset_mask(mask, n: int) -> np.ndarray:
    # The checks and messages of SyncVectorEnv, so code written for it behaves the same.
    if not isinstance(mask, np.ndarray):
        raise TypeError(f"`options['reset_mask']` must be a numpy array, got {type(mask)}")
    if mask.shape != (n,):
        raise ValueError(f"`options['reset_mask']` must have shape `({n},)`, got {mask.shape}")
    if mask.dtype != np.bool_:
        raise TypeError(f"`options['reset_mask']` must have `dtype=np.bool_`, got {mask.dtype}")
    if not np.any(mask):
        raise ValueError(
            f"`options['reset_mask']` must contain a boolean array with at least one True value, got reset_mask={mask}"
        )
    return mask
