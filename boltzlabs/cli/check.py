"""`boltzlabs check`: does one env keep the contract a pool relies on?

    check_env(source, ...) --yields--> Finding, Finding, ...  --cli--> PASS/WARN/FAIL lines

One env runs in a real pool (RLPool, one lane) and goes through, in order:
  start      it completes its handshake (else: its start-up output)
  handshake  it declares observation and action spaces (needed by the
             Gymnasium adapter and to sample actions)
  reset      reset(seed) answers, with an obs inside the declared space
  steps      K steps (actions sampled from the action space with a fixed
             seed, or given) answer without error
  memory     the env's private memory (Private_Dirty of its process, read
             by the host from /proc/<pid>/smaps_rollup) at birth, before
             reset, against after the reset and steps; the extension
             modules it loaded after the fork (/proc/<pid>/maps), and the
             modules the warm template's probe found the env's work imports
             (pool.env_contract "warmup", when this boltzlabs has it). In
             template mode, more than PRELOAD_HINT bytes written after birth
             by modules imported after the fork is a warning that suggests
             a preload list (a boltzlabs.toml beside env.py, RLPool(preload=...))
  exception  a step whose env raises is reported on its lane (done,
             info["error"] with the traceback), not raised; the env then
             resets and steps normally. An arbitrary env is made to raise by
             sending an action no action space contains (INVALID_ACTION);
             an env that accepts it is a warning: the path was not exercised.
  replay     reset(seed, hard=True) and the same actions give the same
             episode byte for byte (obs, rewards, terminated, truncated,
             info, compared as the msgpack bytes the env sent), by the
             comparison of boltzlabs.testing.assert_reproducible, whose
             NotReproducible message a failure prints

Each stage yields Findings (boltzlabs.cli.doctor.Finding: status ok, warn or
fail) as it ends, so a caller can print them as they come.
"""

from __future__ import annotations

import math
import re
import sys
import time
import warnings

from boltzlabs.cli.doctor import FAIL, OK, WARN, Finding
from boltzlabs.testing import AFTER_HARD_RESET, Episode, NotReproducible, first_difference

__all__ = ["check_env", "INVALID_ACTION", "PRELOAD_HINT"]

# Private memory an env may write after its birth before `check` suggests a
# preload list: a forked child of the template is ~1.5 MiB in all,
# and its first reset and steps write ~0.3-0.6 MiB when they import nothing
# (docs/hard-reset.md); one lazily imported numpy.random writes ~5.6 MiB.
PRELOAD_HINT = 1 << 20

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


def _short(value, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def check_env(
    source,
    *,
    actions=None,
    steps: int = 10,
    spawn: str = "template",
    params=None,
    step_timeout: float = 10.0,
    seed: int = 0,
    warmup=None,
):
    """Yield the Findings of checking one env (see the module docstring).

    `actions`: a list of actions to step with (cycled), else actions sampled
    from the declared action space (seeded with `seed`), else 0. `warmup`:
    None leaves RLPool's default, else RLPool(..., warmup=warmup) (the warm
    template's probe). Raises ValueError/TypeError for a bad source or params
    (nothing started).
    """
    from boltzlabs import RLPool
    from boltzlabs.pool import sources
    from boltzlabs.errors import BoltzLabsError, EnvStartError

    sources.resolve(source, params or {})  # a bad source is the caller's mistake: raise, start nothing
    started = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            options = {} if warmup is None else {"warmup": bool(warmup)}
            pool = RLPool(source, 1, spawn=spawn, step_timeout=step_timeout, **options, params=params)
    except EnvStartError as exc:
        yield Finding("start", FAIL, f"the env did not complete its handshake: {exc}")
        return
    except Exception as exc:
        yield Finding("start", FAIL, f"the pool could not start: {type(exc).__name__}: {exc}")
        return
    with pool:
        birth = _Snapshot.of(pool)  # before anything else runs in the env
        yield Finding("start", OK, f"1 env ready in {time.perf_counter() - started:.2f} s (spawn={pool.spawn})")
        for warning in caught:
            yield Finding("start", WARN, str(warning.message))
        try:
            yield from _stages(pool, actions, steps, seed, birth)
        except BoltzLabsError as exc:  # the worker died: the pool is gone, the command is not
            yield Finding("pool", FAIL, f"the pool broke during the check: {type(exc).__name__}: {exc}")


def _stages(pool, actions, steps: int, seed: int, birth: _Snapshot):
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
    yield Finding(
        "steps",
        OK,
        f"{episode.steps} step(s) answered, actions {how}" + (" (the episode ended)" if episode.ended else ""),
    )
    yield from _memory(pool, birth, _Snapshot.of(pool), episode.steps)
    played = actions[: episode.steps]
    yield from _exception_path(pool, seed, played[:1])
    replay = yield from _reset(pool, seed, hard=True, stage="replay", obs_space=None)
    if replay is None:
        return
    if not (yield from _play(pool, replay, played, "replay", None)):
        return
    difference = first_difference(episode, replay)
    if difference is None:
        yield Finding(
            "replay",
            OK,
            f"a hard reset with seed {seed} and the same {len(played)} action(s) gives a byte-identical episode",
        )
    else:
        failure = NotReproducible(difference, lane=0, seed=seed, comparison=AFTER_HARD_RESET)
        yield Finding("replay", FAIL, str(failure))


def _spaces(contract):
    """(observation space, action space) rebuilt as Gymnasium spaces, or None."""
    specs = {"observation_space": contract.observation_space, "action_space": contract.action_space}
    missing = [name for name, spec in specs.items() if spec is None]
    if missing:
        yield Finding(
            "handshake",
            WARN,
            f"the env declares no {' and no '.join(missing)}: the Gymnasium adapter "
            "needs both, and actions cannot be sampled (serve(..., observation_space=..., "
            "action_space=...))",
        )
    rebuilt = {}
    for name, spec in specs.items():
        if spec is None:
            rebuilt[name] = None
            continue
        try:
            from boltzlabs.pool.spaces import from_spec

            rebuilt[name] = from_spec(spec)
        except ImportError:
            yield Finding(
                "handshake",
                WARN,
                f"{name} declared, but Gymnasium is not installed to rebuild it "
                "(pip install -e '.[gym]' in a checkout of boltzlabs)",
            )
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
    episode = Episode(0, seed)
    episode.add_reset(obs, info)
    return episode


def _play(pool, episode: Episode, actions: list, stage: str, obs_space):
    """Step through `actions` until the episode ends; False after a failure."""
    flagged = False
    for t, action in enumerate(actions, 1):
        obs, _, _, infos = pool.step([action])
        reward = float(pool.rewards[0])
        terminated, truncated = bool(pool.terminated[0]), bool(pool.truncated[0])
        if infos[0].get("error"):
            yield Finding(stage, FAIL, f"step {t} (action {_short(action, 80)}) failed: {infos[0]['error']}")
            return False
        episode.add_step(obs[0], reward, terminated, truncated, infos[0])
        if not flagged and not math.isfinite(reward):
            yield Finding(stage, WARN, f"step {t} returned a reward that is not finite: {reward}")
            flagged = True
        if not flagged and obs_space is not None and not _contains(obs_space, obs[0]):
            yield Finding(
                stage, WARN, f"step {t} returned an obs outside the declared observation_space: {_short(obs[0])}"
            )
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
        yield Finding(
            "exception",
            WARN,
            f"the env accepted the action {INVALID_ACTION!r}, which no action space "
            "contains, without raising, so the exception path was not exercised; an env should "
            "reject invalid actions (e.g. assert self.action_space.contains(action))",
        )
        return
    if obs[0] is not None or not dones[0]:
        yield Finding(
            "exception",
            FAIL,
            f"a failed step came back with done={bool(dones[0])}, obs {_short(obs[0])}; expected done=True, obs None",
        )
        return
    yield Finding(
        "exception",
        OK,
        f"a step that raised is reported on its lane (done, obs None, info['error']: {_last_line(info['error'])})",
    )
    obs = pool.reset(seed=seed)[0]
    error = (pool.reset_infos[0] or {}).get("error")
    if not error and good:
        _, _, _, infos = pool.step(good)
        error = infos[0].get("error")
    if error:
        yield Finding("exception", FAIL, f"after the failed step the env does not reset and step normally: {error}")
    else:
        yield Finding("exception", OK, "after it, the env resets and steps normally")


# -- memory: what the env's first reset and steps cost, read by the host ------------------------

# An extension module's file, as the env's process maps it: below a
# site-packages directory (the sandbox binds them at /opt/site-packages/N) or
# the standard library's lib-dynload.
_EXTENSION_PATH = re.compile(r"/(?:(?:site|dist)-packages(?:/\d+)?|lib-dynload)/(?P<rel>[^ ]+?\.so)$")


class _Snapshot:
    """The env process's private memory and mapped extension modules at one moment.

    Read from /proc on the host: the env's code runs nothing for it. The env
    process is pool.pids()[0] in template mode (the forked child itself) and
    the Python process below bwrap's pid in exec mode. `private` is
    Private_Dirty of /proc/<pid>/smaps_rollup (the pages the env wrote: what
    copy on write makes each env pay), None with `error` when unreadable.
    """

    def __init__(self, pid: int | None, private: int | None, extensions: set, error: str = ""):
        self.pid, self.private, self.extensions, self.error = pid, private, extensions, error

    @classmethod
    def of(cls, pool) -> _Snapshot:
        try:
            pid = _env_process(pool.pids()[0])
            if pid is None:
                return cls(None, None, set(), "the env has no live process")
            with open(f"/proc/{pid}/smaps_rollup") as smaps:
                found = re.search(r"^Private_Dirty:\s+(\d+) kB", smaps.read(), re.M)
            with open(f"/proc/{pid}/maps") as maps:
                extensions = {
                    line.split(None, 5)[5].strip()
                    for line in maps
                    if line.count(" ") >= 5 and line.rstrip().endswith(".so")
                }
        except (OSError, IndexError, ValueError) as exc:  # another host, another user, a process gone
            return cls(None, None, set(), f"{type(exc).__name__}: {exc}")
        if found is None:
            return cls(pid, None, extensions, "no Private_Dirty line in smaps_rollup")
        return cls(pid, int(found.group(1)) * 1024, extensions)


def _env_process(pid: int) -> int | None:
    """The env's Python process: `pid` itself, or the first python below it (exec mode's bwrap)."""
    if pid is None or pid <= 0:
        return None
    import psutil

    try:
        root = psutil.Process(pid)
        for process in [root] + root.children(recursive=True):
            if process.name().startswith("python"):
                return process.pid
    except psutil.Error:
        return None
    return pid


def _module_of(path: str) -> str | None:
    """The module an extension file is (numpy.random._generator), None for a plain library."""
    found = _EXTENSION_PATH.search(path)
    if found is None:
        return None
    *packages, filename = found.group("rel").split("/")
    parts = packages + [filename.split(".", 1)[0]]
    # numpy.libs/libopenblas...so and the like are libraries the modules load, not modules.
    return ".".join(parts) if all(part.isidentifier() for part in parts) else None


def _preloadable(modules, *, packages: bool = False) -> list:
    """Names for a preload list (boltzlabs.toml, RLPool(preload=...)) that import `modules`, third-party ones first.

    Importing a module imports its parents, not its children (scipy loads
    scipy.special lazily), so the deepest public packages are named:
    numpy.random, not numpy and not numpy.random._generator. `packages`:
    the names are packages already (from _packages_of); else a module that
    is no package stands for its package. Standard-library names are listed
    only when nothing else is: a package imports them itself.
    """
    names = set(modules)
    if not packages:
        names = {
            name if any(other.startswith(name + ".") for other in names) else (name.rpartition(".")[0] or name)
            for name in names
        }
    public = {name for name in names if not any(part.startswith("_") for part in name.split("."))} or names
    leaves = sorted(name for name in public if not any(other.startswith(name + ".") for other in public))
    outside = [name for name in leaves if name.split(".")[0] not in sys.stdlib_module_names]
    return outside or leaves


def _packages_of(extensions: set) -> list:
    modules = {module for path in extensions if (module := _module_of(path)) is not None}
    return sorted({module.rpartition(".")[0] or module for module in modules})


def _warmup(pool):
    """(whether this boltzlabs has the probe, its report or None) from pool.env_contract."""
    contract = pool.env_contract
    if isinstance(contract, dict):
        return "warmup" in contract, contract.get("warmup")
    try:
        return True, contract["warmup"]
    except (TypeError, KeyError):
        pass
    return hasattr(contract, "warmup"), getattr(contract, "warmup", None)


def _mib(size: float) -> str:
    return f"{size / (1 << 20):.1f} MiB"


def _preload_fix(names: list, why: str) -> str:
    listed = ", ".join(f'"{name}"' for name in names[:8]) + (", ..." if len(names) > 8 else "")
    return f"preload = [{listed}] under [boltzlabs] in a boltzlabs.toml beside env.py (or RLPool(preload=[...])) {why}"


def _memory(pool, birth: _Snapshot, after: _Snapshot, steps: int):
    has_probe, report = _warmup(pool)
    if not has_probe:
        probe = "; this boltzlabs has no warm-up probe, so only extension modules are named"
    elif report is None:
        probe = "; the warm-up probe did not run (" + ("exec mode" if pool.spawn == "exec" else "warmup=False") + ")"
    else:
        probe = ""
    if birth.private is None or after.private is None or birth.pid != after.pid:
        reason = birth.error or after.error or "the env's process changed between the two readings"
        yield Finding(
            "memory", WARN, f"the env's private memory could not be read from /proc on this host: {reason}{probe}"
        )
    else:
        yield from _growth(pool.spawn, birth, after, steps, probe)
    if report is not None:
        yield from _probe(report)


def _named(packages: list) -> str:
    """Third-party modules by name, then the standard library's in brackets."""
    ours = [name for name in packages if name.split(".")[0] not in sys.stdlib_module_names]
    stdlib = [name for name in packages if name not in ours]
    if not ours:
        return ", ".join(stdlib)
    return ", ".join(ours) + (f" (and {len(stdlib)} of the standard library: {', '.join(stdlib)})" if stdlib else "")


def _growth(spawn: str, birth: _Snapshot, after: _Snapshot, steps: int, probe: str):
    assert birth.private is not None and after.private is not None, "_memory calls it when both were read"
    grown = after.private - birth.private
    packages = _packages_of(after.extensions - birth.extensions)
    detail = (
        f"env process {after.pid}: private memory (Private_Dirty) {_mib(birth.private)} at birth, "
        f"{_mib(after.private)} after reset and {steps} step(s) ({'+' if grown >= 0 else ''}{_mib(grown)})"
    )
    if packages:
        detail += f"; extension modules loaded after the fork: {_named(packages)}"
    if spawn != "template":
        if packages:
            detail += " (exec mode: each env imports everything itself; in template mode preload= would share these)"
        yield Finding("memory", OK, detail + probe)
        return
    suggest = _preloadable(packages, packages=True)
    if grown > PRELOAD_HINT and suggest:
        yield Finding(
            "memory",
            WARN,
            detail + probe + f". In a pool every env writes these {_mib(grown)} itself: "
            "what an env imports after the fork is private to it",
            _preload_fix(suggest, "imports them once in the template, shared by every env"),
        )
    elif grown > PRELOAD_HINT:
        yield Finding(
            "memory",
            OK,
            detail + probe + ". No extension module was loaded after the fork: the growth "
            "is the env's own state, or pure-Python modules its reset or step import (those can be "
            "preloaded: RLPool(preload=[...]), or a boltzlabs.toml beside env.py)",
        )
    else:
        yield Finding("memory", OK, detail + probe)


def _probe(report: dict):
    """The warm template's probe report (pool.env_contract "warmup"), in words."""
    if report.get("error"):
        yield Finding(
            "memory",
            WARN,
            f"the warm-up probe failed: {_last_line(report['error'])}; the pool started "
            "without it, so the template imported only what env.py imports",
            "fix the env's reset/step under the probe, or name the modules: preload = [...] in a boltzlabs.toml beside env.py",
        )
        return
    modules = list(report.get("modules") or [])
    failed = dict(report.get("failed") or {})
    preload = list(report.get("preload") or [])
    private_birth, private_after = report.get("private_birth"), report.get("private_after")
    grown = (
        (private_after - private_birth) if isinstance(private_birth, int) and isinstance(private_after, int) else None
    )
    names = _preloadable(modules)
    detail = (
        f"the warm-up probe's reset and {report.get('steps', 0)} step(s) took {report.get('seconds', 0.0):.2f} s "
        f"and imported {len(modules)} module(s)"
        + (f" ({', '.join(names[:8])}{', ...' if len(names) > 8 else ''})" if names else "")
    )
    if grown is not None:
        detail += f", writing {_mib(grown)} of private memory"
    if preload:
        detail += f"; preload= asked for {', '.join(preload)}"
    detail += f"; the template imported {len(report.get('imported') or [])} before forking"
    if failed:
        first = next(iter(failed.items()))
        yield Finding(
            "memory",
            WARN,
            detail + f"; {len(failed)} import(s) failed in the template, e.g. {first[0]}: {_last_line(first[1])}",
            "make the module importable in the template, or drop it from preload=",
        )
    elif grown is not None and grown > PRELOAD_HINT and names and not set(names) <= set(preload):
        yield Finding("memory", OK, detail, _preload_fix(names, "says so explicitly (and keeps it with warmup=False)"))
    else:
        yield Finding("memory", OK, detail)
