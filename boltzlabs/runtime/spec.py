"""Gymnasium spaces as plain data, the env's half: a space in, a spec for the handshake out.

    env: serve(observation_space=Box(...)) --to_spec()--> {"type": "Box", ...}
         --HELLO--> worker --READY--> client: pool.env_contract.observation_space
    (the trainer rebuilds the space with boltzlabs/pool/spaces.py:from_spec)

Runs inside the sandbox. `to_spec` reads a space's public attributes and
imports nothing: an env that passes a space has imported Gymnasium already,
and one that passes none must not pay for it. A spec is a dict of str, int,
float, bool and lists (JSON-able except for infinite bounds).

Supported: Box, Discrete, MultiDiscrete, MultiBinary, Dict, Tuple, Text,
Sequence and OneOf (a subclass travels as the Gymnasium space it derives
from). Any other space (Graph: its GraphInstance values would arrive as plain
tuples; a space class of a package's own, such as MiniGrid's MissionSpace)
becomes {"type": name, "class": "module.qualname", "repr": ...}: the pool
works, and the adapters rebuild it in the trainer from the same id or thunk,
or name the override to pass (boltzlabs/pool/spaces.py).
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing is not imported at run time: every env would pay for it
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

__all__ = ["to_spec"]


def _bound(values: Any) -> Any:
    # A uniform bound (the common case: Box(-1, 1, (84, 84, 3))) is one number.
    flat = values.reshape(-1).tolist()
    if flat and all(v == flat[0] for v in flat):
        return flat[0]
    return values.tolist()


def to_spec(space: Any) -> dict[str, Any] | None:
    """The spec of a Gymnasium space (None for None). Imports nothing."""
    if space is None:
        return None
    kind = type(space).__name__
    # Match on the class this space derives from, so subclasses of Box etc. work.
    for klass in type(space).__mro__:
        if klass.__module__.startswith("gymnasium.spaces"):
            kind = klass.__name__
            if kind in _ENCODERS:
                return _ENCODERS[kind](space)
    return {"type": kind, "class": f"{type(space).__module__}.{type(space).__qualname__}", "repr": repr(space)[:2000]}


_ENCODERS: dict[str, Callable[[Any], dict[str, Any]]] = {
    "Box": lambda s: {
        "type": "Box",
        "low": _bound(s.low),
        "high": _bound(s.high),
        "shape": list(s.shape),
        "dtype": str(s.dtype),
    },
    "Discrete": lambda s: {"type": "Discrete", "n": int(s.n), "start": int(s.start), "dtype": str(s.dtype)},
    "MultiDiscrete": lambda s: {
        "type": "MultiDiscrete",
        "nvec": s.nvec.tolist(),
        "start": s.start.tolist(),
        "dtype": str(s.dtype),
    },
    "MultiBinary": lambda s: {"type": "MultiBinary", "n": s.n if isinstance(s.n, int) else list(s.n)},
    "Dict": lambda s: {"type": "Dict", "spaces": [[key, to_spec(sub)] for key, sub in s.spaces.items()]},
    "Tuple": lambda s: {"type": "Tuple", "spaces": [to_spec(sub) for sub in s.spaces]},
    "Text": lambda s: {
        "type": "Text",
        "min_length": int(s.min_length),
        "max_length": int(s.max_length),
        "charset": "".join(s.character_list),
    },
    "Sequence": lambda s: {"type": "Sequence", "space": to_spec(s.feature_space), "stack": bool(s.stack)},
    "OneOf": lambda s: {"type": "OneOf", "spaces": [to_spec(sub) for sub in s.spaces]},
}
