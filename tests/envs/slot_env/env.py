"""An env with a fixed-shape observation space, honest or hostile about its slot (tests/test_shm.py).

params: space "box" (float32 (3, 4)), "dict" ({"pos": float64 (2,), "frame": uint8 (2, 2, 3)}) or "tuple"
(a Box and a Dict); tamper: at import (in both modes env.py runs in the env, its slot on fd 7), "grow" or "seal" (against
growing) the memfd on fd 7 before the worker sizes it; or "keep" a copy of that fd in the first reset. The obs is a deterministic function of (seed, t).
An action that is a dict is an attack:
  {"op": "header", "seq": k}     write the obs, a header naming request k, and reply with the marker
  {"op": "nested"}               reply with an honest obs and a slot marker inside info
  {"op": "wrong_seq"}            reply with a marker naming the next request
  {"op": "resize"}               ftruncate and fallocate the kept fd: returns what the kernel said
  {"op": "wire"}                 reply with an obs of another shape (it goes by the wire)
  {"op": "marker_anyway"}        reply with a marker as the obs, slot or no slot
"""

import errno
import fcntl
import os

import msgpack
import numpy as np
from gymnasium import spaces

from boltzlabs import abi, wire
from boltzlabs.env import params, serve
from boltzlabs.runtime import serve as runtime

P = params()
KIND = P.get("space", "box")
BOX = spaces.Box(-1e6, 1e6, (3, 4), np.float32)
DICT = spaces.Dict({"pos": spaces.Box(-1e6, 1e6, (2,), np.float64), "frame": spaces.Box(0, 255, (2, 2, 3), np.uint8)})
SPACE = {"box": BOX, "dict": DICT, "tuple": spaces.Tuple((BOX, DICT))}[KIND]
state = {"seed": 0, "t": 0, "seq": 0}
kept = {}

try:  # at import: in exec mode the env's own process, which holds its slot; a template holds none
    if P.get("tamper") == "grow":
        os.ftruncate(abi.SLOT_FD, 1 << 20)
    elif P.get("tamper") == "seal":
        fcntl.fcntl(abi.SLOT_FD, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW)
except OSError:
    pass


def observe():
    base = state["seed"] * 1000 + state["t"]
    box = (np.arange(12, dtype=np.float32).reshape(3, 4) + base).astype(np.float32)
    # In the space's order (a Dict space sorts its keys): a dict in another order goes by the wire.
    one = {"frame": np.full((2, 2, 3), base % 256, np.uint8), "pos": np.array([base, -base], np.float64)}
    return {"box": box, "dict": one, "tuple": (box, one)}[KIND]


def reset(seed, options=None):
    if P.get("tamper") == "keep" and "fd" not in kept:  # the runtime maps and closes fd 7 after this reply
        try:
            kept["fd"] = os.dup(abi.SLOT_FD)
        except OSError:  # the template's warm-up probe: no slot there
            pass
    state["seed"], state["t"] = seed or 0, 0
    return observe(), {"t": 0}


# The request being answered: the runtime's own reply builder sees it; kept for the attacks.
_step_reply = runtime._step_reply


def _spy(seq, result):
    state["seq"] = seq
    return _step_reply(seq, result)


runtime._step_reply = _spy


def step(action):
    state["t"] += 1
    if not isinstance(action, dict):
        return observe(), float(state["t"]), False, False, {"t": state["t"]}
    op = action["op"]
    if op == "nested":
        return observe(), 0.0, False, False, {"mark": msgpack.ExtType(wire.SLOT_EXT, (0).to_bytes(8, "little"))}
    if op == "wrong_seq":
        return _Marker(1), 0.0, False, False, {}
    if op == "header":
        return _Marker(0, header=action["seq"]), 0.0, False, False, {}
    if op == "resize":
        out = []
        for call in (
            lambda fd: os.ftruncate(fd, 1),
            lambda fd: os.ftruncate(fd, 1 << 30),
            lambda fd: os.posix_fallocate(fd, 0, 1 << 30),
        ):
            try:
                call(kept["fd"])
                out.append("ok")
            except OSError as exc:
                out.append(errno.errorcode[exc.errno])
        return observe(), 0.0, False, False, {"resize": out}
    if op == "wire":
        return np.zeros(5, np.float32), 0.0, False, False, {}
    if op == "marker_anyway":  # a marker whether or not there is a slot
        return msgpack.ExtType(wire.SLOT_EXT, state["seq"].to_bytes(8, "little")), 0.0, False, False, {}
    raise ValueError(op)


class _Marker:
    """Stands for an obs: the runtime's slot sees no array and leaves it; serve packs what this becomes."""

    def __init__(self, ahead, header=None):
        self.ahead, self.header = ahead, header


_put = runtime._Slot.put


def _put_or_forge(self, obs, seq):
    if type(obs) is _Marker:
        if obs.header is not None:
            _put(self, observe(), seq)
            wire.SLOT_SEQ.pack_into(self.mapping, 8, obs.header)
        return msgpack.ExtType(wire.SLOT_EXT, (seq + obs.ahead).to_bytes(8, "little"))
    return _put(self, obs, seq)


runtime._Slot.put = _put_or_forge

serve(reset=reset, step=step, observation_space=SPACE, action_space=spaces.Discrete(2))
