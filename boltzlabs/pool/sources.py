"""Where an env comes from: a directory holding env.py, a Gymnasium id, or env_fns.

    RLPool(source, n, **params) --resolve()--> Source(env dir, params for the env)
        "./my_env", "my_env/env.py"   a directory (a path that exists wins)
        "gym://CartPole-v1"           always a Gymnasium id
        "CartPole-v1", "ALE/Pong-v5"  a Gymnasium id when no such path exists
        [make_env(i) for i in ...]    env_fns: lane i runs env_fns[i]() (as AsyncVectorEnv)

A Gymnasium source runs the built-in env directory `boltzlabs/runtime/gym_env`,
which calls `gymnasium.make(id, **params)` inside each sandbox. Its id and
params are checked here, in the client, before any sandbox starts: against
Gymnasium's registry and the signature of the env's entry point. An id a
plugin registered in this process (ale_py's "ALE/Pong-v5") names the module
that registered it, which the sandbox imports first.

env_fns run the built-in `boltzlabs/runtime/fn_env`: each callable is
pickled here with cloudpickle (the trainer is the trusted side, as with
AsyncVectorEnv), and lane i's is unpickled and called in its own sandbox
(boltzlabs/runtime/env_fns.py). A module the sandbox cannot import (one
imported from the script's directory: boltzlabs/pool/imports.py) is pickled
by value with the thunks that use it.
"""

from __future__ import annotations

import difflib
import inspect
import json
import os
import sys
import threading
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from boltzlabs.link import GYM_ENV_DIR
from boltzlabs.pool import keywords

__all__ = ["Source", "resolve"]

GYM_PREFIX = "gym://"
FN_ENV_DIR = GYM_ENV_DIR.parent / "fn_env"
_PICKLING = threading.Lock()  # held around cloudpickle's by-value registry (_env_fns)
# Namespaces and id prefixes of plugins whose ids a bare gymnasium does not know, and
# the module that registers them: named in the error for an id this process lacks.
_PLUGINS = {"ALE/": "ale_py", "MiniGrid-": "minigrid", "BabyAI-": "minigrid"}
# Keywords gymnasium.make() takes for itself, beside the env's constructor's.
_MAKE_KEYWORDS = ("max_episode_steps", "disable_env_checker")


@dataclass(frozen=True)
class Source:
    """A resolved source: the env directory to run and what it is given."""

    env_dir: Path
    params: dict  # sent to every env as JSON (boltzlabs.env.params())
    name: str  # the human name: a gym id, the directory's name, "env_fns[...]"
    gym_id: str | None = None
    env_fns: tuple | None = None  # env_fns: each lane's pickled thunk (bytes)
    thunks: tuple = ()  # env_fns: the callables themselves (the adapter may build one here, for its spaces)


def resolve(
    source, params: dict, n: int | None = None, bare: Collection[str] = (), options: Collection[str] = ()
) -> Source:
    """The Source for `source` (see the module docstring); `n` the pool's size,
    checked against env_fns' length. ValueError/TypeError saying what is wrong.

    `bare`: the names of `params` given as keywords RLPool does not know (not in
    params={...}). One close to the name of one of `options` (keywords.options)
    is refused as its misspelling,
    unless a Gymnasium env's constructor names it; any unknown to a source that
    takes no such param is refused (a gym id whose constructor does not take it,
    env_fns); an env directory whose code never reads params() is warned about
    once (pool/keywords.py)."""
    if isinstance(source, (list, tuple)):
        return _env_fns(source, params, n, bare, options)
    if callable(source):
        raise TypeError(
            "a single callable is not a source: give a list of them, one per env "
            "(env_fns, as AsyncVectorEnv takes them)"
        )
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(
            f"source must be a path to an env directory, a Gymnasium id or a list of env_fns, "
            f"not {type(source).__name__}"
        )
    text = os.fspath(source)
    if isinstance(text, str) and text.startswith(GYM_PREFIX):
        return _gym(text[len(GYM_PREFIX) :], params, bare, options)
    path = Path(text).expanduser()
    if path.exists() or not isinstance(source, str) or text.startswith((".", "/", "~")):
        keywords.refuse_misspelt(bare, options)
        env_dir = _env_dir(path, text)
        params = _json_params(params, text)
        if params:
            keywords.warn_unread(env_dir, params, options)
        return Source(env_dir, params, path.resolve().name)
    # A name that is no path: a Gymnasium id ("CartPole-v1", a namespaced "ALE/Pong-v5").
    return _gym(text, params, bare, options)


def _env_fns(fns, params: dict, n: int | None, bare: Collection[str] = (), options: Collection[str] = ()) -> Source:
    if not fns or not all(callable(fn) for fn in fns):
        raise TypeError(
            "env_fns must be a non-empty list of callables, each returning a Gymnasium env "
            "(as AsyncVectorEnv takes them); got "
            + (f"{type(next(f for f in fns if not callable(f))).__name__} in it" if fns else "none")
        )
    if n is not None and n != len(fns):
        raise ValueError(f"env_fns has {len(fns)} callables but n={n}: one env per callable")
    if params:
        keywords.refuse_misspelt(bare, options, "env_fns take no params: their thunks carry their own arguments")
        raise TypeError(
            f"env_fns carry their own arguments; these are not options of the pool: {', '.join(sorted(params))}"
        )
    try:
        import cloudpickle
    except ImportError:
        raise ValueError(
            "env_fns are pickled with cloudpickle, which Gymnasium installs: "
            "pip install -e '.[gym]' (from a checkout of boltzlabs)"
        ) from None
    from boltzlabs.pool import imports

    roots = imports.roots()
    hidden = [
        module
        for name, module in list(sys.modules.items())
        if "." not in name
        and name != "__main__"
        and isinstance(where := getattr(module, "__file__", None), str)
        and not imports.visible(where, roots)
    ]
    # cloudpickle's by-value registry is one per process: the shards of one
    # pool pickle their env_fns in threads at once, and a caller may have
    # registered modules of its own. So one pickling at a time, and only what
    # this call registered is unregistered after it.
    with _PICKLING:
        ours = [m for m in hidden if m.__name__ not in cloudpickle.list_registry_pickle_by_value()]
        for module in ours:  # the sandbox cannot import them: their code travels with the thunks
            cloudpickle.register_pickle_by_value(module)
        try:
            blobs = tuple(cloudpickle.dumps(fn) for fn in fns)
        except Exception as exc:  # any pickling failure: what the callable holds cannot travel
            raise TypeError(
                f"env_fns cannot be pickled to enter their sandboxes ({type(exc).__name__}: {exc}); "
                "a thunk must hold only what pickles (no open files, locks or sockets): build those "
                "inside it"
            ) from exc
        finally:
            for module in ours:
                cloudpickle.unregister_pickle_by_value(module)
    first = getattr(fns[0], "__qualname__", None) or type(fns[0]).__name__
    return Source(
        FN_ENV_DIR,
        {"import": _registering_modules(roots)},
        f"env_fns[{len(fns)}: {first}, ...]",
        env_fns=blobs,
        thunks=tuple(fns),
    )


def _registering_modules(roots) -> list[str]:
    """The plugins whose ids this process's Gymnasium registry holds (ale_py
    for "ALE/Pong-v5", after `gym.register_envs(ale_py)`): a thunk's
    gymnasium.make(id) inside needs them imported first, as a forked
    AsyncVectorEnv worker has them. Only modules imported here already, and
    that a sandbox can import."""
    from boltzlabs.pool import imports

    gymnasium = sys.modules.get("gymnasium")
    found = set()
    for spec in list(getattr(gymnasium, "registry", {}).values()):
        entry = spec.entry_point
        name = entry.split(":")[0] if isinstance(entry, str) else getattr(entry, "__module__", None) or ""
        top = name.split(".")[0]
        module = sys.modules.get(top)
        if (
            top not in ("", "gymnasium", "__main__")
            and isinstance(where := getattr(module, "__file__", None), str)
            and imports.visible(where, roots)
        ):
            found.add(top)
    return sorted(found)


def _env_dir(path: Path, text: str) -> Path:
    if path.is_file() and path.name == "env.py":
        path = path.parent
    if not path.is_dir():
        raise ValueError(f"env source {text!r} is not a directory; give the directory that holds env.py")
    if not (path / "env.py").is_file():
        raise ValueError(
            f"env source {text!r} has no env.py; an env directory holds an env.py "
            "that ends with boltzlabs.env.serve(reset=..., step=...)"
        )
    return path.resolve()


def _json_params(params: dict, name: str) -> dict:
    try:
        json.dumps(params, allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"the params for {name!r} must be JSON values (numbers, str, bool, None, lists, dicts with str keys): {exc}"
        ) from None
    return dict(params)


def _gym(env_id: str, params: dict, bare: Collection[str] = (), options: Collection[str] = ()) -> Source:
    try:
        import gymnasium
    except ImportError:
        raise ValueError(
            f"{env_id!r} is not a directory, and Gymnasium ids need Gymnasium: "
            "pip install -e '.[gym]' (from a checkout of boltzlabs)"
        ) from None
    spec = _spec(gymnasium, env_id)
    _check_params(spec, env_id, params, bare, options)
    params = _json_params(params, env_id)
    module = None if ":" in env_id else _registering_module(spec, env_id)
    return Source(GYM_ENV_DIR, {"id": env_id, "kwargs": params, "import": module}, env_id, gym_id=env_id)


def _registering_module(spec, env_id: str) -> str | None:
    """The module to import in the sandbox before gymnasium.make(env_id): the
    top-level package of the entry point when it is not Gymnasium's own (a
    plugin, such as ale_py for "ALE/Pong-v5", registers its ids when imported;
    this process has imported it). ValueError when the sandbox could not."""
    import importlib.util

    entry = spec.entry_point
    name = entry.split(":")[0] if isinstance(entry, str) else getattr(entry, "__module__", None)
    top = (name or "").split(".")[0]
    if not top or top == "gymnasium":
        return None
    if top == "__main__":
        raise ValueError(
            f"{env_id!r} is registered with an entry point of this script ({entry!r}), which a "
            "sandbox cannot import: register it from a module of an installed package, or serve "
            "it from an env directory (boltzlabs.env.serve_env)"
        )
    found = importlib.util.find_spec(top)
    origin = getattr(found, "origin", None) or next(
        iter(getattr(found, "submodule_search_locations", None) or ()), None
    )
    from boltzlabs.pool import imports

    if origin and not imports.visible(origin, imports.roots()):
        raise ValueError(
            f"{env_id!r} is registered by {top!r}, which this process imports from "
            f"{os.path.dirname(origin)}, where a sandbox cannot see it (only installed packages, "
            "editable installs and $PYTHONPATH are bound): install it (pip install -e .) or put its "
            "directory on PYTHONPATH"
        )
    return top


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
        plugin = next((module for prefix, module in _PLUGINS.items() if name.startswith(prefix)), None)
        if plugin and ":" not in env_id:
            hint += (
                f". {plugin} registers it when imported: import {plugin} in this process before making the "
                f"pool, or name it in the source: 'gym://{plugin}:{name}'"
            )
        elif ":" not in env_id:
            hint += (
                ". If a package registers it, import that package first, or name it in the source: "
                f"'gym://<module>:{name}'"
            )
        raise ValueError(
            f"{env_id!r} is not a directory and not a registered Gymnasium id ({type(exc).__name__}: {exc}){hint}"
        ) from None


def _likeness(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()  # get_close_matches' measure


def _check_params(spec, env_id: str, params: dict, bare: Collection[str] = (), options: Collection[str] = ()) -> None:
    from gymnasium.envs.registration import load_env_creator

    entry = spec.entry_point
    try:
        creator = load_env_creator(entry) if isinstance(entry, str) else entry
    except Exception as exc:  # an optional dependency missing (box2d, mujoco, ...)
        raise ValueError(
            f"{env_id!r} cannot be made here: importing its entry point {entry!r} failed ({type(exc).__name__}: {exc})"
        ) from None
    try:
        accepted = inspect.signature(creator).parameters
    except (TypeError, ValueError):
        accepted = None  # a builtin or C callable: nothing to check against but the options' names
    known = list(_MAKE_KEYWORDS)
    if accepted is not None:
        known[:0] = [
            name
            for name, p in accepted.items()
            if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        ]
    # With **kwargs the constructor takes any name, its own to refuse (its TypeError fails the start).
    open_ended = accepted is None or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    for name in params:
        if name in known:
            continue  # the env's own, whatever option it resembles
        close = difflib.get_close_matches(name, known, n=1)
        option = keywords.misspelt(name, options) if name in bare else None
        # A misspelt option, unless the name is closer still to one of the env's own.
        if option is not None and not (close and _likeness(name, close[0]) > _likeness(name, option)):
            raise keywords.misspelling(name, option)
        if not open_ended:
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"{env_id!r} takes no argument {name!r}{hint} (it takes {', '.join(known)})")
    render_mode = params.get("render_mode")
    modes = (getattr(creator, "metadata", None) or {}).get("render_modes")
    # gymnasium.make serves "human" through HumanRendering from an rgb_array mode, and "<mode>_list"
    # through RenderCollection from <mode> (registration.make).
    wrapped = {"human"} if {"rgb_array", "rgb_array_list"} & set(modes or ()) else set()
    wrapped |= {f"{mode}_list" for mode in modes or ()}
    if render_mode is not None and modes is not None and render_mode not in modes and render_mode not in wrapped:
        raise ValueError(f"{env_id!r} has no render_mode {render_mode!r}; it offers {', '.join(map(repr, modes))}")
