"""Text in, text out, the trainer's half: each str held to the pool's max_str_len before it is sent.

    RLPool(..., limits={"max_str_len": "512K"}) --OPEN--> worker/config.py: at most the policy's
        [limits] max_str_len --READY--> pool.max_str_len
    Pool.step / send / call / set_attr --refuse_long_strs()--> ValueError naming the env, or sent
    RLPool.__init__ --text_note(hello)--> a warning for a declared Text space longer than the cap

The other hops hold a str to the same cap: the env's serve() fails a reply holding a longer one
and its decoder refuses a request holding one (runtime/serve.py), the worker kills an env whose
frame holds one (wire.Limits, worker/config.py). docs/api.md#text-observations-and-actions.
Runs in the trainer; imports wire (long_str) and numpy.
"""

from __future__ import annotations

import operator

import numpy as np

from boltzlabs import wire

__all__ = ["refuse_long_strs", "text_note"]

# Action types that hold no str: a batch of only these is passed at the cost of one set().
_NO_STR = frozenset((int, float, bool, type(None), bytes))
_NUMERIC = "biufcmM"  # the dtype kinds of arrays that hold no str
_dtype = operator.attrgetter("dtype")


def refuse_long_strs(given, values: list, cap: int, envs=None, what: str = "step()", kind: str = "action") -> None:
    """ValueError naming the env, the size and the cap when one of `values` (one per env; `envs`:
    their env indices, default their positions) holds a str of more than `cap` UTF-8 bytes (the
    pool's max_str_len), before anything is sent. `given`: the batch as the caller gave it (a
    numeric array holds no str). The hot path, each step: numbers cost one set() of their
    types, strs one max() of their lengths, numeric arrays one set() of their dtypes; anything
    else is looked through (wire.long_str: a non-ASCII str longer than a quarter of the cap is
    encoded once to count its bytes)."""
    if isinstance(given, np.ndarray) and given.dtype.kind in _NUMERIC:
        return
    types = set(map(type, values))
    if types <= _NO_STR or (types == {str} and max(map(len, values)) <= cap >> 2):
        return
    if all(issubclass(kind, np.generic) and np.dtype(kind).kind in _NUMERIC for kind in types):
        return  # numpy's numeric scalars, by their dtypes as arrays are: a Discrete space's actions
    if np.ndarray in types and types <= _NO_STR | {np.ndarray}:  # a list of numeric arrays: one set() of dtypes
        arrays = values if len(types) == 1 else [value for value in values if type(value) is np.ndarray]
        if all(dtype.kind in _NUMERIC for dtype in set(map(_dtype, arrays))):
            return
    if not wire.long_str(values, cap):
        return
    for position, value in enumerate(values):
        size = wire.long_str(value, cap)
        if size:
            env = position if envs is None else envs[position]
            whose = {"arguments": "an argument", "options": "a reset option"}.get(kind, f"the {kind} for env {env}")
            raise ValueError(
                f"{what}: {whose} holds a str of {size:,} bytes (UTF-8), over the pool's max_str_len of "
                f"{cap:,} bytes, the longest a str may be each way between the trainer and an env; send "
                "less, or make the pool with a larger cap, RLPool(..., limits={'max_str_len': ...}), up to "
                "the sandbox policy's [limits] max_str_len (docs/limits.md)"
            )


def text_note(hello: dict, cap: int | None) -> str:
    """A warning, or '', for an env whose declared spaces (its handshake's, a group's member's
    too) hold a Text whose longest value passes `cap`, the pool's max_str_len: max_length
    characters of its charset's widest in UTF-8. Such an observation fails its lane, such an
    action is refused; nothing holds a value to its declared max_length, as SyncVectorEnv does
    not. Looks through the specs with no recursion; they were capped as a handshake."""
    if not cap:
        return ""
    group = hello.get("group")
    stack: list = [("observation", hello.get("observation_space")), ("action", hello.get("action_space"))]
    if isinstance(group, dict):
        stack += [("observation", group.get("observation_space")), ("action", group.get("action_space"))]
    longest: dict[str, tuple[int, int]] = {}  # role -> (characters, bytes) of its longest Text over the cap
    seen = 0
    while stack and seen < 1 << 16:
        seen += 1
        role, node = stack.pop()
        if isinstance(node, list):
            stack += [(role, item) for item in node]
        elif isinstance(node, dict):
            if node.get("type") == "Text" and isinstance(node.get("max_length"), int):
                charset = node.get("charset")
                chars = charset if isinstance(charset, str) else ""
                width = max((len(c.encode("utf-8", "surrogatepass")) for c in chars), default=4)
                size = node["max_length"] * width
                if size > cap and size > longest.get(role, (0, 0))[1]:
                    longest[role] = (node["max_length"], size)
            else:
                stack += [(role, value) for value in node.values() if isinstance(value, (dict, list))]
    if not longest:
        return ""
    what = {"observation": "fails its lane", "action": "is refused"}
    parts = [
        f"a Text {role} space of up to {chars:,} characters ({size:,} bytes in UTF-8: an {role} over the cap "
        f"{what[role]})"
        for role, (chars, size) in sorted(longest.items(), reverse=True)
    ]
    return (
        f"the env declares {' and '.join(parts)}, more than the pool's max_str_len of {cap:,} bytes. Make the "
        "pool with RLPool(..., limits={'max_str_len': ...}) (up to the sandbox policy's [limits] max_str_len), "
        "or declare a smaller max_length"
    )
