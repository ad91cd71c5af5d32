"""Reproducibility as a test: `assert_reproducible(source)` for users' CI.

    RLPool A: reset(seeds), play `steps` ----------------------> run 1 (one Episode per lane)
              reset(seeds, hard=True), the same actions -------> run 2  --first_difference(1, 2)--> "after hard reset"
    RLPool B (fresh): reset(seeds), the same actions ----------> run 3  --first_difference(1, 3)--> "across pools"
    a difference ---> NotReproducible (an AssertionError): lane, seed, step, field, path, both values

Each field of each step (obs, reward, terminated, truncated, info) is kept as
its wire encoding (msgpack, as `boltzlabs.wire` packs it, numpy arrays as raw
bytes), and runs are compared byte for byte: 0.1 + 0.2 against 0.3, a float32
array against a float64 one, a NaN's payload, a dict's key order all count.
Only when two records differ are their decoded values walked, to name the
first differing path (`obs["x"][1]`); that walk is bounded (`_MAX_DEPTH`
levels, values shown through reprlib), since everything an env sends is
untrusted.

The comparison across a hard reset catches what an env draws while it runs
(the clock, os.urandom, uuid.uuid4, a generator seeded from them). The one
across pools also catches what it drew at import: in template mode every env
is forked from one template, so a `random.Random()` made at import holds the
same state in every child and after every hard reset, and differs only in
another pool.

Episodes that end before `steps`: the lane is autoreset as the pool's
Gymnasium adapter does it by default (next step): at the step after its
episode ended it is reset with seed None instead of stepped, its action for
that step unused, and that step records the reset's obs and info. So every
lane plays exactly `steps` steps, and an env's unseeded reset path is compared
too.

`boltzlabs check` uses the same `Episode`, `first_difference` and message for
its replay stage.
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass

from boltzlabs import wire

__all__ = [
    "assert_reproducible",
    "NotReproducible",
    "EpisodeFailed",
    "Episode",
    "Difference",
    "first_difference",
    "AFTER_HARD_RESET",
    "ACROSS_POOLS",
    "ACTION_SEED",
]

AFTER_HARD_RESET = "after hard reset"
ACROSS_POOLS = "across pools"
ACTION_SEED = 0  # the action space is seeded with this when actions=None

# How deep the walk that names a difference goes into an obs or info: each
# level re-encodes the values below it, so a hostile 500-deep value must not
# cost 500 encodings of itself. Below this depth the path ends with "...".
_MAX_DEPTH = 32

_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxlist = _REPR.maxdict = _REPR.maxtuple = _REPR.maxset = 8
_REPR.maxstring = _REPR.maxother = 80
_REPR.maxlong = 80


def _short(value, limit: int = 160) -> str:
    """A bounded repr of a value an env sent."""
    if type(value).__name__ == "ndarray":  # reprlib would print the whole array
        text = f"array(shape={tuple(value.shape)}, dtype={value.dtype})"
    else:
        text = _REPR.repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


class _Missing:
    """The side of a difference where a key or item does not exist."""

    def __repr__(self) -> str:
        return "(missing)"


MISSING = _Missing()


# -- recording and comparing ------------------------------------------------------------------


class Episode:
    """One lane's run, step by step, as the bytes its env sent.

    Step 0 is the reset (fields obs and info); every later step has obs,
    reward, terminated, truncated and info, or, for an autoreset, the
    reset's obs and info. `records[t]` holds each field's wire encoding (what
    is compared), `values[t]` the decoded values (to name a difference).
    """

    def __init__(self, lane: int, seed):
        self.lane, self.seed = lane, seed
        self.records: list[tuple] = []
        self.values: list[tuple] = []
        self.kinds: list[str] = []  # "reset", "autoreset" or "step", per step

    def add_reset(self, obs, info, autoreset: bool = False) -> None:
        """Record a reset: the first one (step 0), or an autoreset."""
        self._add("autoreset" if autoreset else "reset", (("obs", obs), ("info", info)))

    def add_step(self, obs, reward: float, terminated: bool, truncated: bool, info) -> None:
        """Record one step's results, as the env returned them."""
        self._add(
            "step",
            (
                ("obs", obs),
                ("reward", float(reward)),
                ("terminated", bool(terminated)),
                ("truncated", bool(truncated)),
                ("info", info),
            ),
        )

    def _add(self, kind: str, fields: tuple) -> None:
        encode = wire.encode
        self.kinds.append(kind)
        self.records.append(tuple(encode(value) for _, value in fields))
        self.values.append(fields)

    @property
    def steps(self) -> int:
        """Steps after the first reset."""
        return len(self.records) - 1

    @property
    def ended(self) -> bool:
        """Whether the last step ended the episode (terminated or truncated)."""
        if self.steps < 1 or self.kinds[-1] != "step":
            return False
        fields = dict(self.values[-1])
        return fields["terminated"] or fields["truncated"]


@dataclass(frozen=True)
class Difference:
    """Where two runs of one lane first part: the step, the field, the path
    inside it (`obs["x"][1]`) and the value in each run."""

    step: int
    kind: str  # "reset", "autoreset", "step", or "length" when one run is longer
    field: str
    path: str
    first: object
    then: object


def first_difference(a: Episode, b: Episode) -> Difference | None:
    """The first step and field where `b` differs from `a` byte for byte; None when identical."""
    for t, (ra, rb) in enumerate(zip(a.records, b.records)):
        if ra == rb:
            continue
        for (name, va), (_, vb), ea, eb in zip(a.values[t], b.values[t], ra, rb):
            if ea != eb:
                path, first, then = _locate(va, vb, name)
                return Difference(t, a.kinds[t], name, path, first, then)
    if len(a.records) != len(b.records):
        return Difference(
            min(len(a.records), len(b.records)), "length", "length", "the number of steps", a.steps, b.steps
        )
    return None


def _locate(a, b, path: str, depth: int = 0):
    """(path, value in a, value in b) of the first place two differently encoded values differ."""
    if depth >= _MAX_DEPTH:
        return path + "...", a, b
    if isinstance(a, dict) and isinstance(b, dict):
        for key, value in a.items():
            if key not in b:
                return f"{path}[{_key(key)}]", value, MISSING
            if wire.encode(value) != wire.encode(b[key]):
                return _locate(value, b[key], f"{path}[{_key(key)}]", depth + 1)
        for key, value in b.items():
            if key not in a:
                return f"{path}[{_key(key)}]", MISSING, value
        return f"{path} (the same keys, in another order)", list(a), list(b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        for i, (x, y) in enumerate(zip(a, b)):
            if wire.encode(x) != wire.encode(y):
                return _locate(x, y, f"{path}[{i}]", depth + 1)
        i = min(len(a), len(b))
        return f"{path}[{i}]", a[i] if i < len(a) else MISSING, b[i] if i < len(b) else MISSING
    if (
        type(a).__name__ == "ndarray"
        and type(b).__name__ == "ndarray"
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.size
    ):
        return _locate_in_array(a, b, path)
    return path, a, b


def _key(key) -> str:
    """A dict key as it would be written in Python, with double quotes for str: obs["x"]."""
    if isinstance(key, str):
        import json

        text = json.dumps(key, ensure_ascii=False)
        return text if len(text) <= 60 else text[:60] + '..."'
    return _short(key, 60)


def _locate_in_array(a, b, path: str):
    """The first element of two same-shaped arrays whose bytes differ (NaNs compared by their bits)."""
    import numpy as np

    width = a.dtype.itemsize
    rows_a = np.ascontiguousarray(a).reshape(-1).view(np.uint8).reshape(a.size, width)
    rows_b = np.ascontiguousarray(b).reshape(-1).view(np.uint8).reshape(b.size, width)
    differing = np.flatnonzero((rows_a != rows_b).any(axis=1))
    if not differing.size:  # the same elements: the difference is in the header (byte order)
        return path, a, b
    index = np.unravel_index(int(differing[0]), a.shape)
    return path + "".join(f"[{int(i)}]" for i in index), a[index].item(), b[index].item()


# -- what a failure says ----------------------------------------------------------------------

_REMEDY = (
    "An env must take all its randomness from the seed given to reset (no clock, os.urandom, "
    "uuid.uuid4 or unseeded random.Random())"
)


class NotReproducible(AssertionError):
    """Two runs with the same seeds and actions differ.

    `comparison` is AFTER_HARD_RESET (the same pool, reset(seeds, hard=True))
    or ACROSS_POOLS (a second, fresh pool); `lane`, `seed`, `step` (0 is the
    reset), `field` (obs, reward, terminated, truncated or info), `path`
    (inside the field, e.g. `obs["x"][1]`), `first` and `then` (the value in
    the first run and in the other) say where. A subclass of AssertionError,
    so pytest reports it as a failed assertion.
    """

    def __init__(self, difference: Difference, *, lane: int, seed, comparison: str):
        self.difference = difference
        self.lane, self.seed, self.comparison = lane, seed, comparison
        self.step, self.field, self.path = difference.step, difference.field, difference.path
        self.first, self.then = difference.first, difference.then
        super().__init__(self._message())

    def _message(self) -> str:
        d = self.difference
        if self.comparison == AFTER_HARD_RESET:
            how = f"replayed with reset(seed={self.seed}, hard=True) and the same actions"
        else:
            how = "replayed in a second, fresh pool with the same seed and actions"
        head = (
            f"not reproducible {self.comparison}: lane {self.lane} (seed {self.seed}), {how}, gave a different "
            "episode: "
        )
        if d.kind == "length":
            return head + f"the first run had {d.first} steps, the other {d.then}. {_REMEDY}."
        where = {"reset": " (the reset)", "autoreset": " (an autoreset, seed None, after the episode ended)"}
        field = f"{'reset ' if d.kind != 'step' else ''}{d.field}"
        text = (
            f"at step {d.step}{where.get(d.kind, '')} the {field} differs at {d.path}: first {_short(d.first)}, "
            f"then {_short(d.then)}. {_REMEDY}."
        )
        if self.comparison == ACROSS_POOLS:
            text += (
                " A hard reset replayed the episode, so this was drawn before the env's first reset, e.g. at "
                "import: in template mode every env and every hard reset inherits what the template drew "
                "there. Seed in reset."
            )
        return head + text


class EpisodeFailed(AssertionError):
    """An env failed (raised, died, missed its deadline) during a run, so
    there is no episode to compare. `lane`, `seed`, `step` (0 is the reset),
    `run` (which run) and `error` (the env's error, with its traceback)."""

    def __init__(self, *, lane: int, seed, step: int, run: str, error: str, log: str = ""):
        self.lane, self.seed, self.step, self.run, self.error = lane, seed, step, run, str(error)
        text = (
            f"lane {lane} (seed {seed}) failed at step {step}{' (the reset)' if step == 0 else ''} of "
            f"{run}: {_tail(self.error, 4000)}"
        )
        if log:
            text += f"\n--- the tail of env {lane}'s log ---\n{_tail(log, 2000)}\n--- end ---"
        super().__init__(text + "\nFix the env so that it answers every reset and step of the episode.")


def _tail(text: str, limit: int) -> str:
    return text if len(text) <= limit else "..." + text[-limit:]


# -- assert_reproducible ----------------------------------------------------------------------


def assert_reproducible(source, *, seeds=(0, 1, 2, 3), steps: int = 100, actions=None, **pool_kwargs) -> None:
    """Assert that `source`'s episodes are byte-identical after a hard reset and across pools.

    One lane per seed plays `steps` steps (autoreset at the next step when
    an episode ends; see the module docstring), then every lane is reset
    with `hard=True` and the same seeds and replays the same actions, then a
    second, fresh pool does the same; every run is compared with the first,
    byte for byte. `actions`: None samples them from the env's declared
    action space (seeded with ACTION_SEED; needs Gymnasium); a list with one
    list of len(seeds) actions per step (actions[0] for step 1); or a
    callable `(step, obs) -> actions` given the number of the step about to
    be taken (1 for the first) and the previous obs of every lane, called
    during the first run only (the others replay what it returned).
    `pool_kwargs` go to both RLPools (spawn=, step_timeout=, env params...).

    Raises NotReproducible on the first difference, EpisodeFailed when an env
    fails during a run, ValueError/TypeError for bad arguments.
    """
    from boltzlabs import RLPool

    seeds = _check_seeds(seeds)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a whole number of steps, at least 1; got {steps!r}")
    n = len(seeds)
    plan = _Plan(actions, steps, n)  # a bad list or callable fails here, before any sandbox starts
    with RLPool(source, n, **pool_kwargs) as pool:
        plan.resolve(pool.env_contract)
        first = _run(pool, seeds, steps, plan, hard=False, run="the first run")
        _compare(first, _run(pool, seeds, steps, plan, hard=True, run="the run after a hard reset"), AFTER_HARD_RESET)
    with RLPool(source, n, **pool_kwargs) as pool:
        _compare(first, _run(pool, seeds, steps, plan, hard=False, run="the run in a second pool"), ACROSS_POOLS)


def _check_seeds(seeds) -> list:
    try:
        seeds = list(seeds)
    except TypeError:
        raise TypeError(f"seeds must be a sequence of ints, one lane each, not {type(seeds).__name__}") from None
    if not seeds or any(isinstance(s, bool) or not isinstance(s, int) for s in seeds):
        raise ValueError(f"seeds must be a non-empty sequence of ints, one lane each; got {seeds!r}")
    return seeds


def _compare(first: list, other: list, comparison: str) -> None:
    """Raise NotReproducible at the earliest step where any lane differs."""
    found = [
        (d.step, lane.lane, d, lane.seed)
        for lane, again in zip(first, other)
        if (d := first_difference(lane, again)) is not None
    ]
    if found:
        _, lane, difference, seed = min(found, key=lambda f: f[:2])
        raise NotReproducible(difference, lane=lane, seed=seed, comparison=comparison)


def _run(pool, seeds: list, steps: int, plan: _Plan, *, hard: bool, run: str) -> list:
    """Reset every lane with its seed and play `steps` steps; one Episode per lane."""
    episodes = [Episode(lane, seed) for lane, seed in enumerate(seeds)]
    obs = pool.reset(seed=seeds, hard=hard)
    for lane, episode in enumerate(episodes):
        info = pool.reset_infos[lane]
        _raise_if_failed(pool, episode, 0, info, run)
        episode.add_reset(obs[lane], info)
    ended: list = []
    for t in range(1, steps + 1):
        obs, rewards, terminated, truncated, infos = pool.step_full(plan.actions(t, obs), resets=ended)
        for lane, episode in enumerate(episodes):
            _raise_if_failed(pool, episode, t, infos[lane], run)
            if lane in ended:
                episode.add_reset(obs[lane], infos[lane], autoreset=True)
            else:
                episode.add_step(obs[lane], rewards[lane], terminated[lane], truncated[lane], infos[lane])
        ended = [lane for lane in range(len(seeds)) if terminated[lane] or truncated[lane]]
    return episodes


def _raise_if_failed(pool, episode: Episode, step: int, info, run: str) -> None:
    error = info.get("error") if isinstance(info, dict) else None  # an env's info may be anything msgpack-able
    if not error:
        return
    try:
        log = pool.log(episode.lane)
    except Exception:  # the pool itself broke: the error says enough
        log = ""
    raise EpisodeFailed(lane=episode.lane, seed=episode.seed, step=step, run=run, error=error, log=log)


class _Plan:
    """The actions of every step: given, sampled, or asked of a callable once and then replayed."""

    def __init__(self, actions, steps: int, n: int):
        self.n, self.steps = n, steps
        self.table: list | None = None
        self.policy = None
        if actions is None:
            return
        if callable(actions):
            self.policy, self.table = actions, []
            return
        try:
            given = len(actions)
        except TypeError:
            raise TypeError(
                "actions must be None (sampled from the action space), a list of per-step action "
                f"lists, or a callable (step, obs) -> actions; not {type(actions).__name__}"
            ) from None
        if given < steps:
            raise ValueError(
                f"actions has {given} step(s) of actions but steps={steps}: give one list of {n} "
                "actions per step, or fewer steps"
            )
        self.table = [self._checked(actions[t], t + 1) for t in range(steps)]

    def resolve(self, contract) -> None:
        """Sample the actions from the env's declared action space when none were given."""
        if self.table is not None:
            return
        spec = contract.action_space
        if spec is None:
            raise ValueError(
                f"the env {contract.id!r} declares no action_space, so actions cannot be sampled: "
                "pass actions= (a list of per-step action lists, or a callable (step, obs) -> "
                "actions), or declare serve(..., action_space=...)"
            )
        try:
            from boltzlabs.pool.spaces import from_spec

            space = from_spec(spec)
        except ImportError:
            raise ValueError(
                "sampling actions from the env's action space needs Gymnasium: pip install "
                "-e '.[gym]' in a checkout of boltzlabs, or pass actions="
            ) from None
        space.seed(ACTION_SEED)
        self.table = [[space.sample() for _ in range(self.n)] for _ in range(self.steps)]

    def actions(self, t: int, obs: list) -> list:
        """The n actions of step t (1 for the first)."""
        table = self.table
        assert table is not None, "resolve() makes the table before the first step"
        if self.policy is not None and len(table) < t:
            table.append(self._checked(self.policy(t, obs), t))
        return table[t - 1]

    def _checked(self, actions, t: int) -> list:
        try:
            got = len(actions)
        except TypeError:
            raise TypeError(
                f"the actions for step {t} must be a list of {self.n} actions (one per seed), not "
                f"{type(actions).__name__}"
            ) from None
        if got != self.n:
            raise ValueError(f"the actions for step {t} are {got}, but there are {self.n} lanes (one per seed)")
        return list(actions)
