"""Where an env comes from: a directory holding env.py, or a Gymnasium id.

    RLPool(source, n, **params) --resolve()--> Source(env dir, params for the env)
        "./my_env", "my_env/env.py"   a directory (a path that exists wins)
        "gym://CartPole-v1"           always a Gymnasium id
        "CartPole-v1"                 a Gymnasium id when no such path exists

A Gymnasium source runs the built-in env directory `boltzlabs/runtime/gym_env`,
which calls `gymnasium.make(id, **params)` inside each sandbox. Its id and
params are checked here, in the client, before any sandbox starts: against
Gymnasium's registry and the signature of the env's entry point.
"""

from __future__ import annotations

import difflib
import inspect
import json
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Source", "resolve"]

GYM_PREFIX = "gym://"
GYM_ENV_DIR = Path(__file__).resolve().parent.parent / "runtime" / "gym_env"
# Keywords gymnasium.make() takes for itself, beside the env's constructor's.
_MAKE_KEYWORDS = ("max_episode_steps", "disable_env_checker")


@dataclass(frozen=True)
class Source:
    """A resolved source: the env directory to run and what it is given."""

    env_dir: Path
    params: dict  # sent to every env as JSON (boltzlabs.env.params())
    name: str  # the human name: a gym id, or the directory's name
    gym_id: str | None = None


def resolve(source, params: dict) -> Source:
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"source must be a path to an env directory or a Gymnasium id, not {type(source).__name__}")
    text = os.fspath(source)
    if isinstance(text, str) and text.startswith(GYM_PREFIX):
        return _gym(text[len(GYM_PREFIX):], params)
    path = Path(text).expanduser()
    if path.exists() or not isinstance(source, str) or os.sep in text or text.startswith("."):
        return Source(_env_dir(path, text), _json_params(params, text), path.resolve().name)
    return _gym(text, params)


def _env_dir(path: Path, text: str) -> Path:
    if path.is_file() and path.name == "env.py":
        path = path.parent
    if not path.is_dir():
        raise ValueError(f"env source {text!r} is not a directory; give the directory that holds env.py")
    if not (path / "env.py").is_file():
        raise ValueError(f"env source {text!r} has no env.py; an env directory holds an env.py "
                         "that ends with boltzlabs.env.serve(reset=..., step=...)")
    return path.resolve()


def _json_params(params: dict, name: str) -> dict:
    try:
        json.dumps(params, allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"the params for {name!r} must be JSON values (numbers, str, bool, None, lists, "
                        f"dicts with str keys): {exc}") from None
    return dict(params)


def _gym(env_id: str, params: dict) -> Source:
    try:
        import gymnasium
    except ImportError:
        raise ValueError(f"{env_id!r} is not a directory, and Gymnasium ids need Gymnasium: "
                         "pip install 'boltzlabs[gym]'") from None
    spec = _spec(gymnasium, env_id)
    _check_params(spec, env_id, params)
    params = _json_params(params, env_id)
    return Source(GYM_ENV_DIR, {"id": env_id, "kwargs": params}, env_id, gym_id=env_id)


def _spec(gymnasium, env_id: str):
    name = env_id
    if ":" in env_id:  # "module:EnvId": importing the module registers the env
        module, _, name = env_id.partition(":")
        import importlib

        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ValueError(f"cannot import {module!r} to register {name!r}: {exc}") from None
    try:
        return gymnasium.spec(name)
    except gymnasium.error.Error as exc:
        close = difflib.get_close_matches(name, list(gymnasium.registry), n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise ValueError(f"{env_id!r} is not a directory and not a registered Gymnasium id "
                         f"({type(exc).__name__}: {exc}){hint}") from None


def _check_params(spec, env_id: str, params: dict) -> None:
    from gymnasium.envs.registration import load_env_creator

    entry = spec.entry_point
    try:
        creator = load_env_creator(entry) if isinstance(entry, str) else entry
    except Exception as exc:  # an optional dependency missing (box2d, mujoco, ...)
        raise ValueError(f"{env_id!r} cannot be made here: importing its entry point {entry!r} failed "
                         f"({type(exc).__name__}: {exc})") from None
    try:
        signature = inspect.signature(creator)
    except (TypeError, ValueError):
        return  # a builtin or C callable: nothing to check against
    accepted = signature.parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        known = [name for name, p in accepted.items()
                 if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
        known += _MAKE_KEYWORDS
        for name in params:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"{env_id!r} takes no argument {name!r}{hint} "
                                 f"(it takes {', '.join(known)})")
    render_mode = params.get("render_mode")
    modes = (getattr(creator, "metadata", None) or {}).get("render_modes")
    if render_mode is not None and modes is not None and render_mode not in modes:
        raise ValueError(f"{env_id!r} has no render_mode {render_mode!r}; it offers {', '.join(map(repr, modes))}")
