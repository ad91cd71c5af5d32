"""Gymnasium spaces as plain data, the trainer's half: a spec from the handshake in, a space out.

    env --to_spec() (boltzlabs/runtime/spec.py)--> {"type": "Box", ...} --HELLO/READY-->
    adapter: from_spec(spec) --> gymnasium.spaces.Box(...)

Runs in the trainer; `from_spec` imports numpy and Gymnasium when called.
Supported: Box, Discrete, MultiDiscrete, MultiBinary, Dict, Tuple. A Dict's spec lists
its keys in the space's own order (pairs) and `from_spec` keeps it, so batched and
flattened observations line up with the env's.
"""

from __future__ import annotations

__all__ = ["from_spec"]


def from_spec(spec: dict | None):
    """The Gymnasium space a spec describes. Raises ValueError if it cannot."""
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
            return spaces.MultiDiscrete(np.asarray(spec["nvec"]), dtype=spec["dtype"],
                                        start=np.asarray(spec["start"]))
        if kind == "MultiBinary":
            return spaces.MultiBinary(spec["n"])
        if kind == "Dict":
            # Pairs, not a dict: Dict sorts a dict's keys, and the env's order is the spec's.
            return spaces.Dict([(key, from_spec(sub)) for key, sub in spec["spaces"]])
        if kind == "Tuple":
            return spaces.Tuple([from_spec(sub) for sub in spec["spaces"]])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"the env sent a malformed {kind} space spec {spec!r}: {exc}") from None
    raise ValueError(f"cannot rebuild the env's space {spec.get('repr', spec) if isinstance(spec, dict) else spec!r}: "
                     "boltzlabs carries Box, Discrete, MultiDiscrete, MultiBinary, Dict and Tuple spaces")
