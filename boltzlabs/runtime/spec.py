"""Gymnasium spaces as plain data, the env's half: a space in, a spec for the handshake out.

    env: serve(observation_space=Box(...)) --to_spec()--> {"type": "Box", ...}
         --HELLO--> worker --READY--> client: pool.env_contract.observation_space
    (the trainer rebuilds the space with boltzlabs/pool/spaces.py:from_spec)

Runs inside the sandbox. `to_spec` reads a space's public attributes and
imports nothing: an env that passes a space has imported Gymnasium already,
and one that passes none must not pay for it. A spec is a dict of str, int,
float, bool and lists (JSON-able except for infinite bounds).

Supported: Box, Discrete, MultiDiscrete, MultiBinary, Dict, Tuple, Text,
Sequence, OneOf and Graph (a subclass travels as the Gymnasium space it
derives from). Any other space (a space class of a package's own, such as
MiniGrid's MissionSpace) becomes {"type": name, "class": "module.qualname",
"repr": ...}: the pool works, and the adapters rebuild it in the trainer from
the same id or thunk, or name the override to pass (boltzlabs/pool/spaces.py).

A Graph's values, GraphInstance, are named tuples, which msgpack carries as
plain tuples; `graph_restorer(space)` gives them back their class, on both
sides: serve() for the actions an env is given, the Gymnasium adapter for the
observations it batches.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # typing is not imported at run time: every env would pay for it
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

__all__ = ["to_spec", "graph_restorer"]


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
    "Graph": lambda s: {"type": "Graph", "node_space": to_spec(s.node_space), "edge_space": to_spec(s.edge_space)},
}


def _kind(space: Any) -> str:
    # The Gymnasium space class this space derives from, as to_spec matches it.
    for klass in type(space).__mro__:
        if klass.__module__.startswith("gymnasium.spaces"):
            return klass.__name__
    return type(space).__name__


def _holds_graph(space: Any) -> bool:
    kind = _kind(space)
    if kind == "Graph":
        return True
    if kind in ("Tuple", "OneOf"):
        return any(_holds_graph(sub) for sub in space.spaces)
    if kind == "Dict":
        return any(_holds_graph(sub) for sub in space.spaces.values())
    if kind == "Sequence":
        return _holds_graph(space.feature_space)
    return False


def graph_restorer(space: Any) -> Callable[[Any], Any] | None:
    """For a space that holds a Graph (at any depth): a function from one of
    its values as the wire delivers it, each GraphInstance a plain 3-tuple, to
    the value with its GraphInstances back. None for any other space, whose
    values need nothing. The value may come from an env (the adapter) or the
    trainer (serve()): what does not have the space's structure is left as it
    is, for the space's own contains() to refuse; the space bounds the depth."""
    if space is None or not _holds_graph(space):
        return None
    # A Graph space exists, so its module has been imported (by whoever made the space).
    instance = sys.modules["gymnasium.spaces.graph"].GraphInstance
    return lambda value: _restore(space, value, False, instance)


def _restore(space: Any, value: Any, batched: bool, instance: Any) -> Any:
    """`value` of `space` (of batch_space(space, n) when `batched`) with its GraphInstances back."""
    kind = _kind(space)
    if kind == "Tuple" and isinstance(value, (tuple, list)) and len(value) == len(space.spaces):
        return tuple(_restore(sub, v, batched, instance) for sub, v in zip(space.spaces, value))
    if kind == "Dict" and isinstance(value, dict):
        subs = space.spaces
        return {k: _restore(subs[k], v, batched, instance) if k in subs else v for k, v in value.items()}
    if kind == "Sequence" and space.stack and not batched:  # stacked: batch_space(feature_space, length)'s value
        return _restore(space.feature_space, value, True, instance)
    if kind not in ("Graph", "Sequence", "OneOf") or not isinstance(value, (tuple, list)):
        return value  # no Graph below, or not the space's structure
    if batched:  # batch_space makes a Tuple of n copies of these: a tuple of n values
        return tuple(_restore(space, v, False, instance) for v in value)
    if kind == "Graph":
        if len(value) != 3:
            return value
        nodes, edges, links = value
        nodes = _restore(space.node_space, nodes, True, instance)  # (n, ...): batch_space(node_space, n)'s
        if edges is not None and space.edge_space is not None:
            edges = _restore(space.edge_space, edges, True, instance)
        return instance(nodes, edges, links)
    if kind == "Sequence":
        return tuple(_restore(space.feature_space, v, False, instance) for v in value)
    # OneOf: (index, value of spaces[index])
    if len(value) != 2:
        return value
    try:
        index = value[0].__index__()  # an int, or the np.int64 OneOf.sample gives
    except (AttributeError, TypeError):
        return value
    if not 0 <= index < len(space.spaces):
        return value
    return (value[0], _restore(space.spaces[index], value[1], False, instance))
