"""The one pool protocol: `Pool`, what every pool kind is, and what adapters may call.

    gym.BoltzLabsVecEnv, cluster.ClusterPool, a training loop
        | reset / step / step_full / send / recv / recv_full / render / memory / states / log / close
    Pool (this module): checks every argument, keeps each lane's latest
        | observation and result and each lane's episode (id, seed, length, return)
        | _reset_lanes / _step_lanes / _send_lanes / _recv_lanes / _render_lanes / ...
    RLPool (client.py: one worker, local or remote)   ClusterPool (cluster.py: one RLPool per Ray node)

A pool kind implements the underscored hooks only; the public surface, the
argument checks (so the same bad input raises the same exception on every
kind) and the episode bookkeeping live here, once, so the kinds cannot drift.
Adapters call public names only (tests/test_protocol.py reads them with ast).
"""

from __future__ import annotations

import abc
from typing import NamedTuple

import numpy as np

from boltzlabs import wire
from boltzlabs.pool.ids import uuid7, uuid7s
from boltzlabs.pool.text import refuse_long_strs

_INT = frozenset((int,))  # an env index's one type (_resets' fast check)

__all__ = ["Pool", "StepResult", "RecvResult"]


class StepResult(NamedTuple):
    """A step with terminations and truncations apart (`Pool.step_full`).

    obs: list of n; rewards: float64[n], exactly as the envs returned them;
    terminated, truncated: bool[n] (a failed lane counts as truncated, with
    info["error"]); infos: list of n dicts.
    """

    obs: list
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    infos: list


class RecvResult(NamedTuple):
    """An asynchronous receive with terminations and truncations apart
    (`Pool.recv_full`): every field aligned with env_ids, in the order the
    envs finished; rewards float64."""

    env_ids: np.ndarray
    obs: list
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    infos: list


def check_n(n) -> int:
    """n as an int, or ValueError: a pool holds at least one env."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n must be a whole number of envs, at least 1; got {n!r}")
    return int(n)


def check_batch_size(batch_size, n: int, what: str = "batch_size"):
    """batch_size as an int in [1, n], None kept; ValueError otherwise."""
    if batch_size is None:
        return None
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or not 1 <= batch_size <= n:
        raise ValueError(f"{what} must be a whole number in [1, n={n}], or None; got {batch_size!r}")
    return int(batch_size)


# The most CPU ids RLPool(cpus=) may name, and the highest id + 1 (the kernel's NR_CPUS tops out at 8192;
# the worker checks again, boltzlabs/worker/affinity.py).
_MAX_CPUS = 1 << 13


def check_cpus(cpus):
    """RLPool(cpus=) as None, False, or a sorted list of distinct CPU ids; TypeError/ValueError otherwise."""
    if cpus is None or cpus is False:
        return cpus
    if cpus is True or isinstance(cpus, (str, bytes, dict)) or not hasattr(cpus, "__iter__"):
        raise TypeError(
            f"cpus must be None (each shard of a pool over several workers on its own slice of the "
            f"CPUs), False (never pinned), or CPU ids like range(8, 64); not {cpus!r:.80}"
        )
    ids = []
    for c in cpus:
        if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or not 0 <= c < _MAX_CPUS:
            raise ValueError(f"cpus must hold CPU ids (whole numbers in [0, {_MAX_CPUS})); got {c!r:.40}")
        ids.append(int(c))
        if len(ids) > _MAX_CPUS:
            raise ValueError(f"cpus names more than {_MAX_CPUS} CPUs")
    if not ids:
        raise ValueError("cpus is empty: name at least one CPU, or give None or False")
    return sorted(set(ids))


class Pool(abc.ABC):
    """n envs behind one batched step: the contract every pool kind keeps.

    Public state, the same on every kind: `n`, `source`, `env_id` (UUIDv7),
    `env_contract`, `spawn`, `timing`, `batch_size`; after each call
    `observations` (each lane's latest), `rewards` (float64), `terminated`,
    `truncated`, `reset_infos`, `episode_ids` (a UUIDv7 per lane, minted at
    each reset) and `finished_episodes` (the episodes the latest step or
    recv ended: env, id, seed, length, return, terminated). Arrays and lists
    are replaced, never written in place: what a call returned stays as it was.
    """

    source: str  # what the envs are, in words (set by each kind's __init__)
    batch_size: int | None  # recv()'s default batch size (None: every env in flight or finished)
    # The most UTF-8 bytes one str may hold, each way between the trainer and an env: the worker's
    # (READY), RLPool(limits={"max_str_len": ...}) or the policy's [limits] max_str_len. An action
    # holding a longer str is refused here before anything is sent; None: not checked here.
    max_str_len: int | None = None

    def _init_lanes(self, n: int) -> None:
        """The per-lane state every pool kind starts with."""
        self.n = n
        self.env_id = uuid7()
        self.reset_infos: list = [None] * n
        self._obs: list = [None] * n
        self.terminated = np.zeros(n, dtype=np.bool_)
        self.truncated = np.zeros(n, dtype=np.bool_)
        self.rewards = np.zeros(n, dtype=np.float64)
        self.episode_ids: list = [None] * n
        self.finished_episodes: list = []
        self._episode_seeds: list = [None] * n
        self._episode_lengths = np.zeros(n, dtype=np.int64)
        self._episode_returns = np.zeros(n, dtype=np.float64)
        self._episode_open = np.zeros(n, dtype=np.bool_)
        self._pending_resets: set = set()  # lanes sent as autoresets, not yet received
        self._never_reset: set = set(range(n))  # lanes no reset has reached: step() refuses them
        # The step's actions as the one array they came in (an (n, ...) array), else None: a
        # grouped pool packs its slices instead of its rows (pool/groups.py _packed_rows).
        self._action_rows: np.ndarray | None = None
        self._lazy_infos = False  # step_full(lazy_infos=True), while it steps
        # Failures by kind ("step raised", "reset died", ...): [count, first lane, first error]; the
        # first of each kind is warned about, and close() sums them up (_failure_summary).
        self._failures: dict = {}

    # -- what each pool kind implements ---------------------------------------------

    @abc.abstractmethod
    def _check_open(self) -> None:
        """Raise PoolClosedError (saying why) when the pool is closed."""

    @abc.abstractmethod
    def _reset_lanes(
        self, lanes: list, seeds: list | None, hard: bool, options, scrub: bool = False
    ) -> tuple[list, list]:
        """Reset `lanes` (sorted, checked) with `seeds` (aligned, or None): (obs, infos) aligned with
        lanes; `scrub`: each sandbox scrubbed before its reset (reset()'s docstring)."""

    @abc.abstractmethod
    def _step_lanes(self, actions: list, resets: list | None) -> StepResult:
        """Step every lane with `actions` (n, checked); the lanes in `resets` are reset instead."""

    @abc.abstractmethod
    def _send_lanes(self, actions: list, lanes: list, resets: list | None, how: list | None = None) -> None:
        """Send `actions` (aligned with `lanes`, checked); the lanes in `resets` are reset instead,
        with `how`: [seeds (aligned with resets) or None, options, scrub], or None for neither."""

    @abc.abstractmethod
    def _recv_lanes(self, batch_size: int | None, timeout: float | None) -> RecvResult:
        """The first `batch_size` lanes to finish (None: every one in flight)."""

    @abc.abstractmethod
    def _render_lanes(self, lanes: list) -> list:
        """One frame per lane (None when the env has none); EnvError when an env failed to render."""

    @abc.abstractmethod
    def _log(self, index: int) -> str:
        """The tail of env `index`'s output."""

    @abc.abstractmethod
    def _attr(self, op: str, name, env_ids, args: list, kwargs: dict, values=None) -> list:
        """op "call", "get" or "set" of the env attribute `name` in the lanes
        `env_ids` (None: all); one result per lane, in lane order."""

    def batched_infos(self, infos: list):
        """Gymnasium's vector infos of the step whose `infos` these are, when the pool holds them
        batched already (a grouped pool's info columns: pool/groups.py), else None. The adapter's
        shortcut past batching n dicts again (gym.py's _batch_infos, whose result it equals).
        When it returns None, every entry of `infos` is its env's info (a grouped pool stepped
        by the adapter leaves a group's entries None until then)."""
        return None

    def batched_obs(self, obs: list):
        """The (n, ...) read-only array whose rows are `obs`, when `obs` are the latest step's and
        the pool holds them so (a grouped pool's slot batch: pool/groups.py), else None. The
        adapter's shortcut past stacking n rows again."""
        return None

    @abc.abstractmethod
    def memory(self):
        """Each env's memory in bytes and what the pool shares (a MemoryReport)."""

    @abc.abstractmethod
    def states(self) -> list:
        """Each lane's one state: 'idle', 'in_flight' (sent, not finished),
        'finished' (a result waiting for recv), 'straggler' (its result was
        given, it is still busy; reset it), 'dead' (reset it to respawn) and,
        over a cluster, 'lost' (its node was lost; reset it to place it again)."""

    @abc.abstractmethod
    def pids(self) -> list:
        """Each env's host pid (-1 when it has none)."""

    @abc.abstractmethod
    def shutdown(self, reason: str = "owner shutdown") -> bool:
        """Stop every env now, saying why; later calls raise PoolClosedError naming `reason`."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop every env and everything the pool started. Idempotent."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool:
        """Whether the pool is closed."""

    # -- the public surface -----------------------------------------------------------

    @property
    def observations(self) -> list:
        """Each lane's latest observation (None for a lane whose env failed and has none)."""
        return list(self._obs)

    def reset(self, seed=None, where=None, hard: bool = False, options=None, scrub: bool = False) -> list:
        """Reset envs and return all n observations.

        seed: an int gives env i the seed `seed + i`; a list gives one per env
        (length n); None lets each env choose. where: a bool mask or a list of
        indices; only those lanes reset, the others' latest observations are
        spliced in place. hard=True kills and respawns the selected sandboxes
        on a fresh workspace before resetting them (byte-identical starts).
        scrub=True keeps each sandbox and its env's server process but kills
        every other process in it and empties its workspace (and /dev/shm)
        before the env's reset, for envs that run an action's code
        (docs/code-rl.md); `reset_infos[i]["scrubbed"]` says what went. A
        hard reset does all that and more, so hard=True with it is a hard reset.
        A lane whose reset failed gets obs None and `reset_infos[i]["error"]`.
        """
        self._check_open()
        if not isinstance(scrub, (bool, np.bool_)):
            raise TypeError(f"reset() scrub must be True or False, not {scrub!r}")
        lanes = self._lanes(where)
        seeds = self._seeds(seed, lanes)
        if options is not None and self.max_str_len is not None:
            refuse_long_strs(None, [options], self.max_str_len, None, "reset()", "options")
        if not lanes:
            return list(self._obs)
        obs, infos = self._reset_lanes(lanes, seeds, bool(hard), options, bool(scrub) and not hard)
        self._note_failures("reset", lanes, obs, infos, stacklevel=3)
        self._obs = list(self._obs)
        self.reset_infos = list(self.reset_infos)
        for i, o, info in zip(lanes, obs, infos):
            self._obs[i] = o
            self.reset_infos[i] = info
        self.terminated = self.terminated.copy()
        self.truncated = self.truncated.copy()
        self.terminated[lanes] = False
        self.truncated[lanes] = False
        self._pending_resets.difference_update(lanes)
        self._begin_episodes(lanes, seeds)
        return list(self._obs)

    def step(self, actions):
        """Step every env with its action: (obs: list, rewards: float32[n], dones: bool[n], infos: list).

        `actions`: a length-n sequence of msgpack-able values or numpy
        arrays, or an array whose first dimension is n (a 1-d array gives
        each env a Python scalar, an (n, ...) array each env its row). A lane
        that failed (exception, death, bad frame, missed deadline) comes back
        done with reward 0, obs None and `info["error"]` saying why
        (`info["straggler"]` for a missed deadline). `step_full` keeps
        terminations and truncations apart and the rewards as float64.
        """
        obs, rewards, terminated, truncated, infos = self.step_full(actions)
        return obs, rewards.astype(np.float32), terminated | truncated, infos

    def step_full(self, actions, resets=None, *, lazy_infos: bool = False, array_items: bool = False) -> StepResult:
        """step(), with terminated and truncated apart and float64 rewards.

        The lanes in `resets` (env indices) are reset instead of stepped, in
        the same request, their action ignored (next-step autoreset: their
        obs is the reset's, their episode begins, unseeded).
        `lazy_infos=True` is for a caller that wants Gymnasium's vector infos
        (the adapter): a pool that holds them batched may leave those lanes'
        entries of `infos` None until `batched_infos(infos)` is asked, which
        fills them in when it returns None.
        `array_items=True`: a 1-d array of actions gives each env its item as a numpy scalar
        (Gymnasium's `iterate` of a Discrete batch), not a Python scalar.
        """
        self._check_open()
        given, actions = actions, self._actions(actions, self.n, "step()", array_items is True)
        if self.max_str_len is not None:
            refuse_long_strs(given, actions, self.max_str_len, None, "step()")
        resets = self._resets(resets)
        if self._never_reset:
            self._refuse_unreset(range(self.n), resets, "step()")
        self._action_rows = given if type(given) is np.ndarray and (given.ndim > 1 or array_items is True) else None
        self._lazy_infos = lazy_infos is True
        try:
            result = self._step_lanes(actions, resets)
        finally:
            self._action_rows, self._lazy_infos = None, False
        # Hot path: the kind's arrays are fresh; kept, not copied again. Failed lanes are truncated:
        # only those are looked at for the failure warnings.
        self._obs, self.rewards = result.obs, result.rewards
        self.terminated, self.truncated = result.terminated, result.truncated
        if np.count_nonzero(result.truncated):
            failed = np.flatnonzero(result.truncated).tolist()
            self._note_failures("step", failed, [result.obs[i] for i in failed], [result.infos[i] for i in failed])
        self._count_episodes(resets)
        return result

    def send(self, actions, env_ids=None, resets=None, *, seed=None, options=None, scrub: bool = False) -> None:
        """Hand `actions` to the envs `env_ids` (all when None) and return at once.

        `actions` is aligned with `env_ids` (a sequence or an array whose first
        dimension is len(env_ids)). Each env then runs its step; `recv()`
        collects the results. Refused (ValueError, nothing sent) when an env
        is in flight or has a result not yet received. A dead env, or a
        straggler still busy, gets a failure result at once (as in step()).
        The lanes in `resets` (a subset of env_ids) are reset instead of
        stepped (next-step autoreset), as in step_full(); recv() gives each its
        reset's obs and info, reward 0, not done. `seed`, `options` and
        `scrub` apply to those resets as reset() takes them (seed: an int gives
        env i `seed + i`, a list one per env, length n): a scrub in flight,
        without a blocking reset() that waits for its slowest lane.
        """
        self._check_open()
        lanes = list(range(self.n)) if env_ids is None else self._env_ids(env_ids)
        given, actions = actions, self._actions(actions, len(lanes), "send()")
        if self.max_str_len is not None:
            refuse_long_strs(given, actions, self.max_str_len, lanes, "send()")
        resets = self._resets(resets)
        if resets and not set(resets) <= set(lanes):
            raise ValueError("send(resets=...) names an env that is not among env_ids")
        if not isinstance(scrub, (bool, np.bool_)):
            raise TypeError(f"send() scrub must be True or False, not {scrub!r}")
        seeds = self._seeds(seed, resets) if resets else None
        if resets and options is not None and self.max_str_len is not None:
            refuse_long_strs(None, [options], self.max_str_len, None, "send()", "options")
        if self._never_reset:
            self._refuse_unreset(lanes, resets, "send()")
        how = [seeds, options, bool(scrub)] if resets and (seeds or options is not None or scrub) else None
        self._send_lanes(actions, lanes, resets, how)
        if resets:
            self._begin_episodes(resets, seeds)
            self._pending_resets.update(resets)

    def recv(self, batch_size=None, timeout=None):
        """The first `batch_size` envs to finish since their send().

        Returns (env_ids: int64[k], obs: list, rewards: float32[k], dones:
        bool[k], infos: list), aligned with env_ids, in the order the envs
        finished. batch_size defaults to the pool's batch_size, else every
        env in flight or finished. k < batch_size only when `timeout`
        (seconds; 0 takes only what has finished) passes first. An env that
        missed its deadline (counted from its send) or failed comes back as
        in step(). Refused (ValueError) when batch_size is more than can come.
        """
        env_ids, obs, rewards, terminated, truncated, infos = self.recv_full(batch_size, timeout)
        return env_ids, obs, rewards.astype(np.float32), terminated | truncated, infos

    def recv_full(self, batch_size=None, timeout=None) -> RecvResult:
        """recv(), with terminated and truncated apart and float64 rewards."""
        self._check_open()
        if batch_size is None:
            batch_size = self.batch_size
        if batch_size is not None and (
            isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1
        ):
            raise ValueError(f"recv() batch_size must be a whole number >= 1, not {batch_size!r}")
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
                raise ValueError(
                    f"recv() timeout must be a number of seconds >= 0 (0: only what has finished), not {timeout!r}"
                )
            timeout = float(timeout)
        result = self._recv_lanes(None if batch_size is None else int(batch_size), timeout)
        lanes = result.env_ids.tolist()
        if result.truncated.any():
            failed = np.flatnonzero(result.truncated).tolist()
            for phase in ("step", "autoreset"):  # a lane sent as a reset failed at its reset
                mine = [k for k in failed if (lanes[k] in self._pending_resets) == (phase == "autoreset")]
                self._note_failures(
                    phase, [lanes[k] for k in mine], [result.obs[k] for k in mine], [result.infos[k] for k in mine]
                )
        # New arrays and list, not in-place writes: what earlier calls returned stays as it was.
        self._obs = list(self._obs)
        for i, o in zip(lanes, result.obs):
            if o is not None:
                self._obs[i] = o
        self.rewards, self.terminated, self.truncated = (
            self.rewards.copy(),
            self.terminated.copy(),
            self.truncated.copy(),
        )
        self.rewards[result.env_ids] = result.rewards
        self.terminated[result.env_ids] = result.terminated
        self.truncated[result.env_ids] = result.truncated
        # Autoreset lanes (sent with resets) began their episode at send: not a step.
        stepped = [i for i in lanes if i not in self._pending_resets]
        self._pending_resets.difference_update(lanes)
        self._count_episodes(None, stepped)
        return result

    def render(self, env_index: int = 0):
        """The frame of env `env_index` (from its `serve(render=...)`; for a
        gym source, `env.render()` with the pool's render_mode), or None when
        the env has no frame. Raises EnvError if the env could not render."""
        self._check_open()
        return self._render_lanes([self._env_index(env_index)])[0]

    def call(self, name: str, *args, env_ids=None, **kwargs) -> list:
        """Call the env's method `name(*args, **kwargs)` in every env (or those
        in `env_ids`); one result per lane, in lane order. For an attribute
        that is not callable, its value (Gymnasium's VectorEnv.call).

        A gym source reaches its Gymnasium env through its wrappers; an env
        directory reaches only what its serve(methods=, attributes=, target=)
        offers. Raises AttributeError (naming what the env offers) for any
        other name, before anything is sent when the env listed its names;
        EnvError (with the lane and the env's traceback) when an env raised,
        died, missed the step deadline or returned a value that cannot cross
        the wire; arguments and results travel like actions and observations.
        """
        if self.max_str_len is not None:
            refuse_long_strs(None, [[args, kwargs]], self.max_str_len, None, f"call({name!r:.80}, ...)", "arguments")
        return self._attr("call", name, env_ids, list(args), kwargs)

    def get_attr(self, name: str, env_ids=None) -> list:
        """The value of the env attribute `name` in every env (or those in
        `env_ids`), one per lane. A method is not called (use call())."""
        return self._attr("get", name, env_ids, [], {})

    def set_attr(self, name: str, values, env_ids=None) -> None:
        """Set the env attribute `name` in every env (or those in `env_ids`):
        `values` is one value for all, or a list or tuple of one per lane
        (Gymnasium's rule: a list meant for every env goes as [v] * n)."""
        lanes = list(range(self.n)) if env_ids is None else self._env_ids(env_ids)
        if not isinstance(values, (list, tuple)):
            values = [values] * len(lanes)
        if len(values) != len(lanes):
            raise ValueError(
                "Values must be a list or tuple with length equal to the number of environments. "
                f"Got `{len(values)}` values for {len(lanes)} environments."
            )
        if self.max_str_len is not None:
            refuse_long_strs(None, list(values), self.max_str_len, lanes, f"set_attr({name!r:.80}, ...)", "value")
        self._attr("set", name, lanes, [], {}, list(values))

    def render_all(self) -> list:
        """Every env's frame, in lane order (as render() for each, in one request)."""
        self._check_open()
        return self._render_lanes(list(range(self.n)))

    def log(self, index: int) -> str:
        """The tail of env `index`'s stdout and stderr (bounded; see policy log_tail)."""
        self._check_open()
        return self._log(self._env_index(index))

    def lane_states(self) -> list:
        """Deprecated alias of states(), which now has this vocabulary."""
        import warnings

        warnings.warn("lane_states() is now states(); lane_states() will go", DeprecationWarning, stacklevel=2)
        return self.states()

    def envs_per_gb(self) -> float:
        """Envs per GiB: 2**30 / (pool memory / n), from the kernel's accounting.

        Pool memory is every env's charge plus what they share (the template).
        """
        return (1 << 30) / max(1.0, self.memory().mean)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __len__(self) -> int:
        return self.n

    # -- argument checks, shared so every kind refuses alike ----------------------------

    def _env_index(self, index) -> int:
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or not 0 <= index < self.n:
            raise ValueError(f"env index must be in [0, {self.n}); got {index!r}")
        return int(index)

    def _lanes(self, where) -> list:
        n = self.n
        if where is None:
            return list(range(n))
        mask = np.asarray(where)
        if mask.dtype == np.bool_:
            if mask.shape != (n,):
                raise ValueError(f"reset(where=...) as a mask needs {n} booleans; got shape {mask.shape}")
            return np.flatnonzero(mask).tolist()
        if mask.ndim != 1 or (mask.size and not np.issubdtype(mask.dtype, np.integer)):
            raise ValueError("reset(where=...) takes a boolean mask of length n or a list of env indices")
        lanes = sorted(set(int(i) for i in mask))
        if lanes and (lanes[0] < 0 or lanes[-1] >= n):
            raise ValueError(f"reset(where=...) has an env index outside [0, {n})")
        return lanes

    def _seeds(self, seed, lanes: list) -> list | None:
        if seed is None:
            return None
        if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
            return [int(seed) + i for i in lanes]
        if isinstance(seed, (list, tuple, np.ndarray)):
            if len(seed) != self.n:
                raise ValueError(f"reset(seed=[...]) needs one seed per env ({self.n}); got {len(seed)}")
            for i in lanes:
                s = seed[i]
                if s is not None and (isinstance(s, bool) or not isinstance(s, (int, np.integer))):
                    # A float seed is refused, not truncated: 1.5 and 1 must not seed alike.
                    raise TypeError(f"reset(seed=[...]) takes whole numbers or None; env {i}'s seed is {s!r}")
            return [None if seed[i] is None else int(seed[i]) for i in lanes]
        raise TypeError(f"seed must be an int, a list of n ints or None, not {type(seed).__name__}")

    def _env_ids(self, env_ids) -> list:
        ids = np.asarray(env_ids)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)) or ids.dtype == np.bool_:
            raise ValueError("env_ids must be a sequence of env indices")
        lanes = [int(i) for i in ids]
        if any(not 0 <= i < self.n for i in lanes):
            raise ValueError(f"env_ids has an env index outside [0, {self.n})")
        if len(set(lanes)) != len(lanes):
            raise ValueError("env_ids has an env index twice")
        return lanes

    def _resets(self, resets) -> list | None:
        if resets is None or len(resets) == 0:
            return None
        if type(resets) is list and set(map(type, resets)) == _INT and 0 <= min(resets) and max(resets) < self.n:
            if len(set(resets)) == len(resets):  # the adapter's list of lanes: each an index, once
                return resets
        return self._env_ids(resets)

    @staticmethod
    def _actions(actions, count: int, what: str, array_items: bool = False) -> list:
        if isinstance(actions, np.ndarray):
            if actions.ndim == 0 or actions.shape[0] != count:
                raise ValueError(
                    f"{what} needs {count} actions (an array whose first dimension is {count}); "
                    f"got an array of shape {actions.shape}"
                )
            return actions.tolist() if actions.ndim == 1 and not array_items else list(actions)
        try:
            got = len(actions)
        except TypeError:
            raise TypeError(f"{what} needs a sequence of {count} actions, not {type(actions).__name__}") from None
        if got != count:
            raise ValueError(f"{what} needs {count} actions, one per env; got {got}")
        return list(actions)

    def _refuse_unreset(self, lanes, resets, what: str) -> None:
        """ValueError, before anything is sent, for stepping a lane no reset has reached
        (Gymnasium's vector envs refuse it too: their envs raise ResetNeeded)."""
        unreset = sorted(set(lanes) & self._never_reset - set(resets or ()))
        if unreset:
            shown = ", ".join(map(str, unreset[:10])) + (", ..." if len(unreset) > 10 else "")
            raise ValueError(
                f"{what} before reset(): env(s) {shown} of {self.source} have never been reset; "
                "call reset() first (an env has no observation, and no episode, until then)"
            )

    # -- failures: warned once per kind, summed up at close -------------------------------

    def _note_failures(self, phase: str, lanes, obs, infos, stacklevel: int = 4) -> None:
        """Count the failed lanes among these results (obs None and
        info["error"]); warn at the first failure of each kind, with its error:
        a pool whose every env fails must not look like one that works."""
        for i, o, info in zip(lanes, obs, infos):
            if o is not None or not isinstance(info, dict) or "error" not in info:
                continue
            kind = f"{phase} {_failure_kind(info)}"
            seen = self._failures.get(kind)
            if seen is not None:
                seen[0] += 1
                continue
            text = _error_line(info["error"])
            self._failures[kind] = [1, i, text]
            import warnings

            where = "pool.reset_infos[i]" if phase == "reset" else "infos[i]"
            warnings.warn(
                f"{self.source}: env {i}'s {kind} ({text}); failures are lanes: the pool goes on and "
                f"{where}['error'] has each one's whole text (pool.log(i) the env's output). Warned once "
                "per pool and kind of failure; close() sums them up",
                RuntimeWarning,
                stacklevel=stacklevel,
            )

    def _failure_summary(self) -> None:
        """At close: one warning that sums up every kind of failure seen (once)."""
        if not getattr(self, "_failures", None):
            return
        parts = [
            f"{kind}: {count} time(s), first env {lane} ({text})"
            for kind, (count, lane, text) in self._failures.items()
        ]
        self._failures = {}
        import warnings

        warnings.warn(f"{self.source} closed; its envs failed: " + "; ".join(parts), RuntimeWarning, stacklevel=3)

    # -- episode bookkeeping ------------------------------------------------------------

    def _count_episodes(self, resets, lanes=None) -> None:
        """Episode bookkeeping after a step (of `lanes` only, when given):
        lengths, returns, finished episodes."""
        # Hot path (every lane stepped): whole-array operations, no copy of the open mask.
        stepped = self._episode_open
        if lanes is not None:
            received = np.zeros(self.n, dtype=np.bool_)
            received[lanes] = True
            stepped = stepped & received
        if resets:
            stepped = stepped.copy() if lanes is None else stepped
            stepped[resets] = False
            self._begin_episodes(resets, None)
        np.add(self._episode_lengths, stepped, out=self._episode_lengths)  # + 1 where stepped
        np.add(self._episode_returns, self.rewards, out=self._episode_returns, where=stepped)
        ended = stepped & (self.terminated | self.truncated)
        if not np.count_nonzero(ended):
            self.finished_episodes = []
            return
        self._episode_open[ended] = False
        self.finished_episodes = [
            {
                "env": i,
                "id": self.episode_ids[i],
                "seed": self._episode_seeds[i],
                "length": int(self._episode_lengths[i]),
                "return": float(self._episode_returns[i]),
                "terminated": bool(self.terminated[i]),
            }
            for i in np.flatnonzero(ended).tolist()
        ]

    def _begin_episodes(self, lanes, seeds) -> None:
        self.episode_ids = list(self.episode_ids)
        for k, (i, new) in enumerate(zip(lanes, uuid7s(len(lanes)))):
            self.episode_ids[i] = new
            self._episode_seeds[i] = None if seeds is None else seeds[k]
        self._episode_lengths[lanes] = 0
        self._episode_returns[lanes] = 0.0
        self._episode_open[lanes] = True
        if self._never_reset:
            self._never_reset.difference_update(lanes)


def raise_unserializable(actions: list, envs=None) -> None:
    """TypeError naming the first action that cannot cross the wire; `envs`: the env of each
    action (default: its position). Returns when every action can."""
    for i, action in zip(range(len(actions)) if envs is None else envs, actions):
        try:
            wire.encode(action)
        except (TypeError, ValueError, OverflowError) as exc:
            raise TypeError(
                f"the action for env {i} cannot be sent ({exc}); actions must be msgpack-able "
                "values (numbers, str, bytes, lists, dicts, None) or numpy arrays"
            ) from exc


def attr_error(verb: str, name: str, errors: dict) -> Exception:
    """The exception for a call/get_attr/set_attr some envs failed: {env: (message, detail)}; the
    first env's AttributeError as one, else EnvError naming it and how many others failed."""
    from boltzlabs.errors import EnvError

    index, (message, detail) = min((int(k), v) for k, v in errors.items())
    if message.startswith("AttributeError: "):  # the env's own: no such name (Gymnasium raises it too)
        return AttributeError(f"env {index}: {message[len('AttributeError: ') :]}")
    others = f" ({len(errors) - 1} other env(s) failed too)" if len(errors) > 1 else ""
    return EnvError(f"env {index} could not {verb} {name!r}{others}: {detail or message}", env_index=index)


def _failure_kind(info: dict) -> str:
    """What kind of failure a lane's info["error"] reports, in a few words."""
    text = str(info.get("error"))[:200]
    if info.get("straggler"):
        return "missed its deadline"
    if info.get("cpu_budget") is True:
        return "went over its cpu_budget"
    if text.startswith("Traceback") or "Error: " in text[:200]:
        return "raised"
    if "died" in text or "dead" in text or "killed" in text:
        return "died"
    return "failed"


def _error_line(error) -> str:
    """The line of an error that says most (a traceback's last), shortened: the env wrote it."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    line = lines[-1] if lines and lines[0].startswith("Traceback") else (lines[0] if lines else "")
    return line[:300] + ("..." if len(line) > 300 else "")


# Abstract members every kind defines; listed for tests/test_protocol.py.
HOOKS = tuple(sorted(Pool.__abstractmethods__))
