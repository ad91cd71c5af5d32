"""The Stable-Baselines3 adapter: an RLPool as an SB3 `VecEnv` (boltzlabs[sb3]).

    PPO / A2C / VecNormalize / VecMonitor / VecFrameStack
        | reset() / step_async(actions) / step_wait() / env_method / get_attr / set_attr
    BoltzLabsSB3VecEnv --send(actions)--> RLPool --one request--> worker --> n sandboxes
        | <--recv()------------------ per-lane (obs, reward, terminated, truncated, info)
        | --reset(where=finished lanes)--> (only when some lane finished)

It behaves as SB3's DummyVecEnv, lane for lane: a finished lane is reset at
once, its last observation goes to info["terminal_observation"] and the
reset's obs to the batch; info["TimeLimit.truncated"] is `truncated and not
terminated`; `seed()` and `set_options()` only take effect at the next
`reset()`, once. step_async() hands the actions to the envs and returns:
they step while the trainer works, and step_wait() collects them.

A lane whose env failed (raised, died, missed its step_timeout) comes back
done and truncated with info["error"] saying why; its terminal observation is
its last good one, and the autoreset respawns a dead env. A lane that cannot
be reset raises EnvError naming the lane.

This is the only module that imports stable_baselines3 (and through it,
torch); nothing in boltzlabs imports it.
"""

from __future__ import annotations

import logging
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from copy import deepcopy
from typing import Any

import numpy as np

try:
    from stable_baselines3.common.vec_env.base_vec_env import VecEnv
    from stable_baselines3.common.vec_env.util import dict_to_obs, obs_space_info
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "boltzlabs.sb3 needs Stable-Baselines3: pip install -e '.[sb3]' in a checkout of boltzlabs"
    ) from exc

from boltzlabs.pool.client import RLPool
from boltzlabs.pool.groups import GroupedPool
from boltzlabs.runtime.serve import WRAPPER_CLASSES
from boltzlabs.cluster import ClusterPool
from boltzlabs.errors import EnvError
from boltzlabs.pool.spaces import gym_rebuilder, rebuilder, space_or_rebuild

__all__ = ["BoltzLabsSB3VecEnv"]

logger = logging.getLogger("boltzlabs")


class BoltzLabsSB3VecEnv(VecEnv):
    """A Stable-Baselines3 VecEnv over an RLPool; each env in its own sandbox.

        venv = BoltzLabsSB3VecEnv("CartPole-v1", 8)            # a source and n
        venv = BoltzLabsSB3VecEnv(RLPool("./my_env", 8))        # or an open pool
        model = PPO("MlpPolicy", VecMonitor(venv)).learn(10_000)

        venv = BoltzLabsSB3VecEnv([make_env(i) for i in range(8)])   # as SubprocVecEnv(env_fns)

    `source`: env_fns, a list of callables each returning a Gymnasium env
    (SubprocVecEnv's and make_vec_env's thunks; env i is env_fns[i]() built in
    its own sandbox); an open RLPool (the adapter owns it from now on: close()
    closes it); or a source as RLPool takes it ("CartPole-v1", "gym://...",
    an env directory) with `n_envs` and RLPool's options and the env's params
    in `pool_kwargs`. The env must declare its spaces in serve() (gym
    sources and env_fns always do); `observation_space` / `action_space`
    override them, and a space the handshake cannot describe is read from
    one env built here from the same thunk or id. `start_method` is
    SubprocVecEnv's and does nothing here.
    """

    def __init__(
        self,
        source,
        n_envs: int | None = None,
        *,
        observation_space=None,
        action_space=None,
        start_method=None,
        **pool_kwargs,
    ):
        if isinstance(source, ClusterPool) or pool_kwargs.get("cluster") is not None:
            raise TypeError(
                "BoltzLabsSB3VecEnv runs on one worker's RLPool; a cluster pool (RLPool(cluster=...)) "
                "is not supported: drop cluster=, or use RLPool(..., worker='tcp://...') for a remote one"
            )
        rebuild = None
        if isinstance(source, (RLPool, GroupedPool)):  # an open pool (envs_per_sandbox=k makes a GroupedPool)
            if n_envs is not None or pool_kwargs:
                raise TypeError(
                    "BoltzLabsSB3VecEnv(pool) takes an open RLPool alone; n_envs and pool options "
                    "go with a source: BoltzLabsSB3VecEnv('CartPole-v1', 8, step_timeout=5)"
                )
            pool = source
        elif isinstance(source, (list, tuple)):
            pool = RLPool(list(source), len(source) if n_envs is None else n_envs, **pool_kwargs)
            rebuild = rebuilder(source[0] if source else None)
        else:
            if n_envs is None:
                raise TypeError(f"BoltzLabsSB3VecEnv({source!r}) needs n_envs, the number of sandboxed envs")
            pool = RLPool(source, n_envs, **pool_kwargs)
            rebuild = gym_rebuilder(source, pool_kwargs)
        try:
            self._attach(pool, observation_space, action_space, rebuild)
        except BaseException:
            if pool is not source:
                pool.close()
            raise

    def _attach(self, pool: RLPool | GroupedPool, observation_space, action_space, rebuild=None) -> None:
        self.pool = pool
        contract = pool.env_contract
        observation_space = observation_space or space_or_rebuild(
            contract.observation_space, "observation_space", rebuild, "BoltzLabsSB3VecEnv"
        )
        action_space = action_space or space_or_rebuild(
            contract.action_space, "action_space", rebuild, "BoltzLabsSB3VecEnv"
        )
        self._waiting = False
        # super().__init__ asks get_attr("render_mode"), answered from the contract.
        super().__init__(pool.n, observation_space, action_space)
        self.metadata = dict(contract.metadata)  # as DummyVecEnv: the env's own
        self.keys, shapes, dtypes = obs_space_info(observation_space)
        self.buf_obs = OrderedDict((k, np.zeros((self.num_envs, *shapes[k]), dtype=dtypes[k])) for k in self.keys)
        self._last_obs: list = [None] * self.num_envs  # each lane's latest good observation

    # -- the VecEnv API -------------------------------------------------------------------

    def reset(self):
        """Reset every env with the seeds of seed() and options of set_options()
        (each used once, as DummyVecEnv); the observations as a batch."""
        self._drain()
        # One request per distinct options object: set_options(dict) gives every env the same
        # one, so that is one request; an empty dict is no options.
        groups: dict = {}
        for i, options in enumerate(self._options):
            options = options or None
            groups.setdefault(id(options), (options, []))[1].append(i)
        for options, lanes in groups.values():
            obs = self.pool.reset(seed=list(self._seeds), where=lanes, options=options)
        self._take_resets(range(self.num_envs), obs)
        self._reset_seeds()
        self._reset_options()
        return self._obs_from_buf()

    def step_async(self, actions) -> None:
        """Hand every env its action and return at once; the envs step while
        the trainer works. step_wait() collects the results."""
        if self._waiting:
            raise ValueError("step_async() while a step is in flight: call step_wait() first")
        self.pool.send(actions)
        self._waiting = True

    def step_wait(self):
        """The results of the step_async() before: (obs, rewards, dones, infos),
        finished lanes already reset (DummyVecEnv's autoreset)."""
        if not self._waiting:
            raise ValueError("step_wait() without a step_async() before it")
        pool, n = self.pool, self.num_envs
        try:
            env_ids, obs, rewards, _, infos = pool.recv(batch_size=n)
        finally:
            self._waiting = False
        order = np.argsort(env_ids)  # results come in the order the envs finished
        lanes = env_ids[order]
        rewards = rewards[order]
        terminated = pool.terminated[lanes]
        truncated = pool.truncated[lanes]
        dones = terminated | truncated
        # Copies, as DummyVecEnv's deepcopy(buf_infos): writable arrays (the wire's are read-only views).
        infos = [deepcopy(infos[k]) if infos[k] else {} for k in order.tolist()]
        obs = [obs[k] for k in order.tolist()]
        for i in range(n):
            info = infos[i]
            if obs[i] is not None or "error" not in info:  # None with no error: the env sent None
                # Hot path: the obs goes straight into the batch buffers (an env's obs is
                # untrusted: one that does not fit the space fails its lane).
                error = self._save_obs(i, obs[i])
                if error is None:
                    self._last_obs[i] = obs[i]
                else:
                    obs[i], info["error"] = None, error
                    dones[i] = truncated[i] = True
                    terminated[i] = False
            info["TimeLimit.truncated"] = bool(truncated[i] and not terminated[i])
            if obs[i] is None:  # a failed lane: why is in info["error"]
                logger.warning("env %d of %s failed and is reset: %s", i, pool.source, info.get("error"))
            if dones[i]:
                # A copy: arrays from the wire are read-only views (torch warns on those).
                info["terminal_observation"] = deepcopy(self._last_obs[i])
        finished = np.flatnonzero(dones).tolist()
        if finished:
            self._take_resets(finished, pool.reset(where=finished))
        return self._obs_from_buf(), rewards.astype(np.float32), dones, infos

    def close(self) -> None:
        """Stop every env and the worker (RLPool.close()). Idempotent."""
        self.pool.close()

    def get_attr(self, attr_name: str, indices=None) -> list[Any]:
        """An attribute of each env (RLPool.get_attr: for gym sources the
        Gymnasium env's, for env directories what serve() names).
        render_mode is answered from the env's handshake."""
        lanes = self._lanes(indices)
        if attr_name == "render_mode":
            return [self.pool.env_contract.render_mode] * len(lanes)
        return self.pool.get_attr(attr_name, env_ids=lanes)

    def set_attr(self, attr_name: str, value: Any, indices=None) -> None:
        """Set an attribute to `value` in each env (the same value for all, as SB3's)."""
        lanes = self._lanes(indices)
        self.pool.set_attr(attr_name, [value] * len(lanes), env_ids=lanes)

    def env_method(self, method_name: str, *method_args, indices=None, **method_kwargs) -> list[Any]:
        """Call a method of each env (RLPool.call); one result per env."""
        return self.pool.call(method_name, *method_args, env_ids=self._lanes(indices), **method_kwargs)

    def env_is_wrapped(self, wrapper_class, indices=None) -> list[bool]:
        """Whether each env is wrapped in `wrapper_class` (or a subclass), as
        DummyVecEnv says. A Gymnasium source's env names its wrappers' classes
        (the ones gymnasium.make put around it: TimeLimit, OrderEnforcing, ...);
        the class is matched by module and qualified name, since no class
        crosses the wire. An env directory's env is False: what it wraps
        inside itself is its own. SB3's Monitor never wraps an env in a
        sandbox: wrap the VecEnv instead (VecMonitor)."""
        lanes = self._lanes(indices)
        offered = self.pool.env_contract.attributes
        if not lanes or offered is None or WRAPPER_CLASSES not in offered["methods"]:
            return [False] * len(lanes)
        name = f"{wrapper_class.__module__}.{wrapper_class.__qualname__}"
        return [
            isinstance(classes, list) and name in classes for classes in self.pool.call(WRAPPER_CLASSES, env_ids=lanes)
        ]

    def get_images(self) -> Sequence[np.ndarray | None]:
        """Each env's frame (render_mode "rgb_array"), in one request."""
        if self.render_mode != "rgb_array":
            warnings.warn(
                f"The render mode is {self.render_mode}, but this method assumes it is `rgb_array` to obtain images.",
                stacklevel=2,
            )
            return [None] * self.num_envs
        return self.pool.render_all()

    def render(self, mode: str | None = None):
        """All envs' frames tiled into one image (VecEnv.render)."""
        return super().render(mode=mode)

    def __repr__(self) -> str:
        return f"BoltzLabsSB3VecEnv({self.pool.source!r}, n_envs={self.num_envs})"

    # -- helpers --------------------------------------------------------------------------

    def _drain(self) -> None:
        # SB3: a reset cancels a step in flight. The pool cannot cancel it, so wait it out.
        if self._waiting:
            self.pool.recv(batch_size=self.num_envs)
            self._waiting = False

    def _take_resets(self, lanes, obs: list) -> None:
        """Take the reset lanes' observations (`obs`: all n, as RLPool.reset returns them)."""
        pool = self.pool
        for i in lanes:
            info = pool.reset_infos[i]
            if obs[i] is None and "error" in info:
                raise EnvError(
                    f"env {i} of {pool.source} could not be reset: {info.get('error')}; "
                    f"its output: pool.log({i}). Fix the env, or close this VecEnv.",
                    env_index=i,
                )
            error = self._save_obs(i, obs[i])
            if error is not None:
                raise EnvError(f"env {i} of {pool.source}: its reset: {error}", env_index=i)
            self.reset_infos[i] = info
            self._last_obs[i] = obs[i]

    def _save_obs(self, i: int, obs) -> str | None:
        """Put env i's obs into the batch buffers; what is wrong with it, or None."""
        try:
            for key in self.keys:
                value = obs if key is None else obs[key]
                # numpy would broadcast a scalar or a shorter row over the slot: refuse it.
                if np.shape(value) != self.buf_obs[key].shape[1:]:
                    raise ValueError(f"shape {np.shape(value)} where the space has {self.buf_obs[key].shape[1:]}")
                self.buf_obs[key][i] = value
        except (ValueError, TypeError, KeyError, IndexError, OverflowError) as exc:
            where = "" if key is None else f"[{key!r}]"
            return (
                f"the env sent an observation{where} that does not fit {self.observation_space}: "
                f"{type(exc).__name__}: {str(exc)[:200]}"
            )
        return None

    def _obs_from_buf(self):
        return dict_to_obs(self.observation_space, deepcopy(self.buf_obs))

    def _lanes(self, indices) -> list:
        """SB3's indices (None, an int, an iterable; negative counts from the end) as lanes."""
        n = self.num_envs
        if indices is None:
            return list(range(n))
        if isinstance(indices, (int, np.integer)):
            indices = [indices]
        lanes = []
        for i in indices:
            if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not -n <= i < n:
                raise IndexError(f"env index {i!r} is out of range for {n} envs")
            lanes.append(int(i) % n)
        return lanes
