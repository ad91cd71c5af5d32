"""`boltzlabs check`: does one env keep the contract a pool relies on?

    check_env(source, ...) --yields--> Finding, Finding, ...  --cli--> PASS/WARN/FAIL lines

One env runs in a real pool (RLPool, one lane) and goes through, in order:
  start      it completes its handshake (else: its start-up output)
  handshake  it declares observation and action spaces (needed by the
             Gymnasium adapter and to sample actions)
  reset      reset(seed) answers, with an obs inside the declared space
  steps      K steps (actions sampled from the action space with a fixed
             seed, or given) answer without error
  exception  a step whose env raises is reported on its lane (done,
             info["error"] with the traceback), not raised; the env then
             resets and steps normally. An arbitrary env is made to raise by
             sending an action no action space contains (INVALID_ACTION);
             an env that accepts it is a warning: the path was not exercised.
  replay     reset(seed, hard=True) and the same actions give the same
             episode byte for byte (obs, rewards, terminated, truncated,
             compared as the msgpack bytes the env sent)

Each stage yields Findings (boltzlabs.doctor.Finding: status ok, warn or
fail) as it ends, so a caller can print them as they come.
"""

from __future__ import annotations

import math
import time
import warnings

from boltzlabs.doctor import FAIL, OK, WARN, Finding

__all__ = ["check_env", "INVALID_ACTION"]

# No Gymnasium space contains a dict with this key, and float(), int() and
# indexing with it all raise: the most portable way to make an env's step fail.
INVALID_ACTION = {"boltzlabs check": "an action outside every action space"}


def _last_line(text: str) -> str:
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no message)"


def _sample_actions(space, steps: int, seed: int) -> list:
    space.seed(seed)
    return [space.sample() for _ in range(steps)]


def _contains(space, obs) -> bool:
    try:
        return bool(space.contains(obs))
    except Exception:
        return False


class _Episode:
    """The steps of one episode as the bytes the env sent, for comparison."""

    def __init__(self, obs):
        from boltzlabs import wire

        self._encode = wire.encode
        self.records = [self._encode([obs])]
        self.values = [obs]

    def add(self, obs, reward: float, terminated: bool, truncated: bool) -> None:
        self.records.append(self._encode([obs, reward, terminated, truncated]))
        self.values.append((obs, reward, terminated, truncated))

    @property
    def steps(self) -> int:
        return len(self.records) - 1

    @property
    def ended(self) -> bool:
        return self.steps > 0 and (self.values[-1][2] or self.values[-1][3])

    def first_difference(self, other: "_Episode") -> str | None:
        """Where two episodes part, in words; None when byte-identical."""
        for t, (a, b) in enumerate(zip(self.records, other.records)):
            if a != b:
                what = "the reset obs" if t == 0 else f"step {t} (obs, reward, terminated, truncated)"
                return f"{what} differs: first {_short(self.values[t])}, then {_short(other.values[t])}"
        if len(self.records) != len(other.records):
            return f"the first episode had {len(self.records) - 1} steps, the replay {len(other.records) - 1}"
        return None


def _short(value, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def check_env(source, *, actions=None, steps: int = 10, spawn: str = "template", params=None,
              step_timeout: float = 10.0, seed: int = 0):
    """Yield the Findings of checking one env (see the module docstring).

    `actions`: a list of actions to step with (cycled), else actions sampled
    from the declared action space (seeded with `seed`), else 0. Raises
    ValueError/TypeError for a bad source or params (nothing started).
    """
    from boltzlabs import RLPool, sources
    from boltzlabs.errors import BoltzLabsError, EnvStartError

    sources.resolve(source, params or {})  # a bad source is the caller's mistake: raise, start nothing
    started = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pool = RLPool(source, 1, spawn=spawn, step_timeout=step_timeout, **(params or {}))
    except EnvStartError as exc:
        yield Finding("start", FAIL, f"the env did not complete its handshake: {exc}")
        return
    except Exception as exc:
        yield Finding("start", FAIL, f"the pool could not start: {type(exc).__name__}: {exc}")
        return
    with pool:
        yield Finding("start", OK, f"1 env ready in {time.perf_counter() - started:.2f} s (spawn={pool.spawn})")
        for warning in caught:
            yield Finding("start", WARN, str(warning.message))
        try:
            yield from _stages(pool, actions, steps, seed)
        except BoltzLabsError as exc:  # the worker died: the pool is gone, the command is not
            yield Finding("pool", FAIL, f"the pool broke during the check: {type(exc).__name__}: {exc}")


def _stages(pool, actions, steps: int, seed: int):
    contract = pool.env_contract
    obs_space, action_space = yield from _spaces(contract)
    if actions is None:
        if action_space is not None:
            actions = _sample_actions(action_space, steps, seed)
            how = f"sampled from the action space (seed {seed})"
        else:
            actions = [0] * steps
            how = "all 0 (no action space to sample from; give --actions)"
    else:
        how = "given"
        actions = [actions[t % len(actions)] for t in range(steps)]

    episode = yield from _reset(pool, seed, hard=False, stage="reset", obs_space=obs_space)
    if episode is None:
        return
    if not (yield from _play(pool, episode, actions, "steps", obs_space)):
        return
    yield Finding("steps", OK, f"{episode.steps} step(s) answered, actions {how}"
                  + (" (the episode ended)" if episode.ended else ""))
    played = actions[:episode.steps]
    yield from _exception_path(pool, seed, played[:1])
    replay = yield from _reset(pool, seed, hard=True, stage="replay", obs_space=None)
    if replay is None:
        return
    if not (yield from _play(pool, replay, played, "replay", None)):
        return
    difference = episode.first_difference(replay)
    if difference is None:
        yield Finding("replay", OK, f"a hard reset with seed {seed} and the same {len(played)} action(s) gives a "
                      "byte-identical episode")
    else:
        yield Finding("replay", FAIL, f"a hard reset with seed {seed} and the same actions gave a different "
                      f"episode: {difference}. An env must take all its randomness from the seed given to reset "
                      "(no time, os.urandom or unseeded generators)")


def _spaces(contract):
    """(observation space, action space) rebuilt as Gymnasium spaces, or None."""
    specs = {"observation_space": contract.observation_space, "action_space": contract.action_space}
    missing = [name for name, spec in specs.items() if spec is None]
    if missing:
        yield Finding("handshake", WARN, f"the env declares no {' and no '.join(missing)}: the Gymnasium adapter "
                      "needs both, and actions cannot be sampled (serve(..., observation_space=..., "
                      "action_space=...))")
    rebuilt = {}
    for name, spec in specs.items():
        if spec is None:
            rebuilt[name] = None
            continue
        try:
            from boltzlabs.spaces import from_spec

            rebuilt[name] = from_spec(spec)
        except ImportError:
            yield Finding("handshake", WARN, f"{name} declared, but Gymnasium is not installed to rebuild it "
                          "(pip install 'boltzlabs[gym]')")
            rebuilt[name] = None
        except ValueError as exc:
            yield Finding("handshake", FAIL, f"{name} cannot be rebuilt: {exc}")
            rebuilt[name] = None
    declared = [f"{name} {' '.join(str(rebuilt[name]).split())}" for name in specs if rebuilt[name] is not None]
    if declared:
        yield Finding("handshake", OK, "the env declares " + " and ".join(declared))
    return rebuilt["observation_space"], rebuilt["action_space"]


def _reset(pool, seed: int, *, hard: bool, stage: str, obs_space):
    what = f"reset(seed={seed}{', hard=True' if hard else ''})"
    obs = pool.reset(seed=seed, hard=hard)[0]
    info = pool.reset_infos[0] or {}
    if info.get("error"):
        log = f"\n{info['log']}" if info.get("log") else ""
        yield Finding(stage, FAIL, f"{what} failed: {info['error']}{log}")
        return None
    if obs_space is not None and not _contains(obs_space, obs):
        yield Finding(stage, WARN, f"{what} returned an obs outside the declared observation_space: {_short(obs)}")
    elif stage == "reset":
        yield Finding(stage, OK, f"{what} answered: obs {_short(obs, 80)}")
    return _Episode(obs)


def _play(pool, episode: _Episode, actions: list, stage: str, obs_space):
    """Step through `actions` until the episode ends; False after a failure."""
    flagged = False
    for t, action in enumerate(actions, 1):
        obs, _, _, infos = pool.step([action])
        reward = float(pool.rewards[0])
        terminated, truncated = bool(pool.terminated[0]), bool(pool.truncated[0])
        if infos[0].get("error"):
            yield Finding(stage, FAIL, f"step {t} (action {_short(action, 80)}) failed: {infos[0]['error']}")
            return False
        episode.add(obs[0], reward, terminated, truncated)
        if not flagged and not math.isfinite(reward):
            yield Finding(stage, WARN, f"step {t} returned a reward that is not finite: {reward}")
            flagged = True
        if not flagged and obs_space is not None and not _contains(obs_space, obs[0]):
            yield Finding(stage, WARN, f"step {t} returned an obs outside the declared observation_space: "
                          f"{_short(obs[0])}")
            flagged = True
        if terminated or truncated:
            break
    return True


def _exception_path(pool, seed: int, good: list):
    obs, _, dones, infos = pool.step([INVALID_ACTION])
    info = infos[0]
    if info.get("straggler"):
        yield Finding("exception", FAIL, f"the env did not answer an invalid action: {info.get('error')}")
        return
    if not info.get("error"):
        yield Finding("exception", WARN, f"the env accepted the action {INVALID_ACTION!r}, which no action space "
                      "contains, without raising, so the exception path was not exercised; an env should "
                      "reject invalid actions (e.g. assert self.action_space.contains(action))")
        return
    if obs[0] is not None or not dones[0]:
        yield Finding("exception", FAIL, f"a failed step came back with done={bool(dones[0])}, obs {_short(obs[0])}; "
                      "expected done=True, obs None")
        return
    yield Finding("exception", OK, f"a step that raised is reported on its lane (done, obs None, info['error']: "
                  f"{_last_line(info['error'])})")
    obs = pool.reset(seed=seed)[0]
    error = (pool.reset_infos[0] or {}).get("error")
    if not error and good:
        _, _, _, infos = pool.step(good)
        error = infos[0].get("error")
    if error:
        yield Finding("exception", FAIL, f"after the failed step the env does not reset and step normally: {error}")
    else:
        yield Finding("exception", OK, "after it, the env resets and steps normally")
