"""RLPool's keywords: the pool's own options, the env's params, or a misspelt option.

    RLPool(source, n, step_timeout=5, level=3, params={"worker_id": 1})
        step_timeout=5            an option: a keyword of RLPool's signature
        level=3                   a bare keyword the pool does not know: an env param, checked
        params={"worker_id": 1}   env params given as such: taken as they are

    client.RLPool --merge(), options(RLPool.__init__)--> sources.resolve(source, params, n, bare, options)
        refuse_misspelt(): a bare name close to an option's (any source, but one a
                           Gymnasium env's constructor names) is a TypeError naming it
        warn_unread():     an env directory whose code never reads params(): one warning

Runs in the trainer, before any worker starts. The options are read from
RLPool's own signature, handed in by the pool (a new option is known here at
once), and from the adapters' and ClusterPool's (ADAPTER_OPTIONS), whose
misspelt keywords reach RLPool's **params too.
"""

from __future__ import annotations

import difflib
import inspect
import os
import re
import threading
import warnings
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Any

__all__ = ["merge", "misspelt", "misspelling", "refuse_misspelt", "warn_unread", "reads_params", "options"]

# Keywords of the layers above RLPool (BoltzLabsVecEnv and its make(), BoltzLabsSB3VecEnv,
# ClusterPool) that pass every keyword they do not take to RLPool: a misspelling of one arrives here.
ADAPTER_OPTIONS = (
    "autoreset_mode",
    "observation_space",
    "action_space",
    "copy",
    "observation_mode",
    "shared_memory",
    "context",
    "daemon",
    "num_envs",
    "n_envs",
    "start_method",
    "envs_per_node",
    "workers_per_node",
)
# difflib's ratio from which a bare keyword is taken for an option's misspelling: 'step_timout',
# 'memory_limt' and 'steps_timeout' are; 'level', 'seed', 'horizon' and 'render_mode' are not.
CUTOFF = 0.8
# What an env directory's code calls to read its params, or reads them from (runtime/serve.py
# params(): the BOLTZLABS_PARAMS variable), found by a text scan of its .py files.
_READS = re.compile(rb"\bparams\s*\(|\bparams\s+as\b|BOLTZLABS_PARAMS")
# The scan's bounds: past them the directory is taken to read its params (no warning).
_SCAN_FILES = 2000
_SCAN_BYTES = 16 << 20
_warned: set[tuple[str, tuple[str, ...]]] = set()  # (env dir, param names) warned about in this process
_warned_lock = threading.Lock()  # a sharded pool's shards resolve their source in threads at once


def options(init: Callable[..., Any]) -> list[str]:
    """Every keyword name a pool option may be given by: those of `init` (RLPool.__init__), and
    ADAPTER_OPTIONS."""
    own = [
        name
        for name, p in inspect.signature(init).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and not name.startswith("_") and name != "params"
    ]
    return own + [name for name in ADAPTER_OPTIONS if name not in own]


def merge(bare: dict, given) -> dict:
    """The env's params: `given` (params={...}) and the bare keywords. TypeError for a
    `given` that is not a dict of str keys, or a name in both."""
    if given is None:
        return dict(bare)
    if not isinstance(given, dict) or not all(isinstance(k, str) for k in given):
        raise TypeError(f"params must be a dict of the env's params by name, like {{'level': 3}}; got {given!r:.200}")
    both = sorted(set(bare) & set(given))
    if both:
        raise TypeError(f"env param {both[0]!r} is given twice: as a keyword and in params={{...}}")
    return {**given, **bare}


def misspelt(name: str, known: Collection[str], cutoff: float = CUTOFF) -> str | None:
    """The option of `known` that `name` (a bare keyword nobody takes) is a misspelling of, or None."""
    close = difflib.get_close_matches(name, known, n=1, cutoff=cutoff)
    # The very name is an adapter's option given to RLPool itself: no misspelling.
    return close[0] if close and close[0] != name else None


def misspelling(name: str, option: str, then: str = "") -> TypeError:
    """The refusal of `name`, a misspelling of `option`; `then`: what it says of params here."""
    where = then or f"an env param of that name goes in params={{{name!r}: ...}}"
    return TypeError(f"unknown option {name!r}: did you mean {option!r}? ({where})")


def refuse_misspelt(names: Iterable[str], known: Collection[str], then: str = "") -> None:
    """TypeError for the first of `names` (bare keywords nobody takes) that is close to the name
    of an option of `known`: a misspelt option, which would otherwise reach the env as a param."""
    for name in names:
        option = misspelt(name, known)
        if option is not None:
            raise misspelling(name, option, then)


def reads_params(env_dir: Path) -> bool:
    """Whether the code of an env directory may read its params: some .py file in it calls
    params() (or reads BOLTZLABS_PARAMS), by a bounded text scan. True past the bounds, or
    for a file that cannot be read: a warning on a guess would be noise."""
    files, read = 0, 0
    for root, dirs, names in os.walk(env_dir):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        for name in names:
            if not name.endswith(".py"):
                continue
            files += 1
            if files > _SCAN_FILES or read > _SCAN_BYTES:
                return True
            try:
                with open(os.path.join(root, name), "rb") as f:
                    text = f.read(_SCAN_BYTES - read + 1)
            except OSError:
                return True
            read += len(text)
            if _READS.search(text):
                return True
    return False


def warn_unread(env_dir: Path, names: Collection[str], known: Collection[str]) -> None:
    """Warn, once per process for an env directory and these param names, when its code
    never reads params(): the params would reach nothing. `known`: the options' names."""
    key = (str(env_dir), tuple(sorted(names)))
    with _warned_lock:
        if key in _warned or reads_params(env_dir):
            return
        _warned.add(key)
    hints = []
    for name in key[1]:
        option = misspelt(name, known, cutoff=0.6)  # below a misspelling's cutoff: a question, not a refusal
        if option is not None:
            hints.append(f" Did you mean the option {option!r} for {name!r}?")
    warnings.warn(
        f"env params {', '.join(map(repr, key[1]))} go to {env_dir}, whose code never reads them: no .py file "
        "there calls boltzlabs.env.params() (a text scan). Read them there, or leave them out." + "".join(hints),
        UserWarning,
        stacklevel=_caller_level(),
    )


def _caller_level() -> int:
    # The stacklevel of the first frame outside boltzlabs: the warning points at the user's call.
    package = str(Path(__file__).resolve().parent.parent)
    frame, level = inspect.currentframe(), 0  # this function's frame; warn_unread's is stacklevel 1
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level
