"""Gymnasium spaces as plain data, the trainer's half: a spec from the handshake in, a space out.

    env --to_spec() (boltzlabs/runtime/spec.py)--> {"type": "Box", ...} --HELLO/READY-->
    adapter: from_spec(spec) --> gymnasium.spaces.Box(...)

Runs in the trainer; `from_spec` imports numpy and Gymnasium when called.
Supported: Box, Discrete, MultiDiscrete, MultiBinary, Dict, Tuple, Text,
Sequence, OneOf and Graph. A Dict's spec lists its keys in the space's own
order (pairs) and `from_spec` keeps it, so batched and flattened
observations line up with the env's. Any other space (a package's own space
class, such as MiniGrid's MissionSpace) raises UnsupportedSpace naming where
it sits; the adapters then rebuild the space in the trainer from the same
Gymnasium id or env_fns thunk (`rebuild`), or say which override to pass.
"""

from __future__ import annotations

from boltzlabs.errors import UnsupportedSpace

__all__ = ["from_spec", "UnsupportedSpace", "space_or_rebuild", "rebuilder", "gym_rebuilder"]

CARRIED = "Box, Discrete, MultiDiscrete, MultiBinary, Dict, Tuple, Text, Sequence, OneOf and Graph"


def from_spec(spec: dict | None, where: str = ""):
    """The Gymnasium space a spec describes. Raises UnsupportedSpace for a
    space it cannot rebuild, ValueError for a malformed spec."""
    if spec is None:
        return None
    import numpy as np
    from gymnasium import spaces

    kind = spec.get("type") if isinstance(spec, dict) else None
    try:
        if kind == "Box":
            shape = tuple(spec["shape"])
            low, high = (np.broadcast_to(np.asarray(spec[k], dtype=spec["dtype"]), shape) for k in ("low", "high"))
            return spaces.Box(low=low, high=high, shape=shape, dtype=spec["dtype"])
        if kind == "Discrete":
            return spaces.Discrete(spec["n"], start=spec["start"], dtype=spec.get("dtype", "int64"))
        if kind == "MultiDiscrete":
            return spaces.MultiDiscrete(np.asarray(spec["nvec"]), dtype=spec["dtype"], start=np.asarray(spec["start"]))
        if kind == "MultiBinary":
            return spaces.MultiBinary(spec["n"])
        if kind == "Dict":
            # Pairs, not a dict: Dict sorts a dict's keys, and the env's order is the spec's.
            return spaces.Dict([(key, from_spec(sub, f"{where}[{key!r}]")) for key, sub in spec["spaces"]])
        if kind == "Tuple":
            return spaces.Tuple([from_spec(sub, f"{where}[{i}]") for i, sub in enumerate(spec["spaces"])])
        if kind == "Text":
            return spaces.Text(spec["max_length"], min_length=spec["min_length"], charset=spec["charset"])
        if kind == "Sequence":
            return spaces.Sequence(from_spec(spec["space"], f"{where}.feature_space"), stack=bool(spec["stack"]))
        if kind == "OneOf":
            return spaces.OneOf([from_spec(sub, f"{where}.spaces[{i}]") for i, sub in enumerate(spec["spaces"])])
        if kind == "Graph":
            if spec["node_space"] is None:
                raise ValueError("a Graph has a node space")
            edge = spec["edge_space"]
            return spaces.Graph(
                node_space=from_spec(spec["node_space"], f"{where}.node_space"),
                edge_space=None if edge is None else from_spec(edge, f"{where}.edge_space"),
            )
    except UnsupportedSpace:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(
            f"the env sent a malformed {kind} space spec{f' at {where}' if where else ''} {str(spec)[:300]}: {exc}"
        ) from None
    name = spec.get("class") or kind if isinstance(spec, dict) else None
    shown = spec.get("repr", spec) if isinstance(spec, dict) else spec
    raise UnsupportedSpace(
        f"the env's space{where} is {str(shown)[:300]}, a {name}, which the handshake cannot "
        f"describe: boltzlabs carries {CARRIED} spaces",
        where,
        str(name),
    )


def space_or_rebuild(spec, what: str, rebuild=None, override: str = ""):
    """The space `what` ("observation_space"/"action_space") from its spec;
    for one the handshake cannot describe, `rebuild(what)` (the same space
    built in this process: an env made from the same id or thunk), else
    UnsupportedSpace saying which override to pass (`override`: where)."""
    if spec is None:
        raise ValueError(
            f"the env declared no {what}; pass it to serve(..., {what}=...) in its env.py, or to {override}({what}=...)"
        )
    try:
        return from_spec(spec)
    except UnsupportedSpace as exc:
        if rebuild is not None:
            return rebuild(what)
        raise UnsupportedSpace(
            f"{exc}. Pass the space yourself: {override}(..., {what}=...) (for "
            f"gymnasium.make's ids and env_fns the adapter builds one env here to read it)",
            exc.where,
            exc.kind,
        ) from None


def rebuilder(thunk):
    """For a space the handshake cannot describe: `rebuild(what)` builds one
    env here with `thunk` (as AsyncVectorEnv always does) and reads its space."""
    if thunk is None:
        return None

    def rebuild(what: str):
        env = thunk()
        try:
            return getattr(env, what)
        finally:
            env.close()

    return rebuild


def gym_rebuilder(source, kwargs: dict):
    """rebuilder for a Gymnasium id: gymnasium.make(id, **the env's params)
    (params={...} and the keywords that are not RLPool's options; the pool
    has checked them); None for an env directory."""
    import inspect
    import os

    from boltzlabs.pool import sources
    from boltzlabs.pool.client import RLPool

    if not isinstance(source, str) or (not source.startswith(sources.GYM_PREFIX) and os.path.exists(source)):
        return None
    options = set(inspect.signature(RLPool.__init__).parameters) | {"cluster", "envs_per_node", "workers_per_node"}
    params = {**(kwargs.get("params") or {}), **{k: v for k, v in kwargs.items() if k not in options}}
    env_id = source[len(sources.GYM_PREFIX) :] if source.startswith(sources.GYM_PREFIX) else source

    def make():
        import gymnasium

        return gymnasium.make(env_id, **params)

    return rebuilder(make)
