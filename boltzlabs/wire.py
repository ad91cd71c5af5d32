"""The wire: length-prefixed msgpack frames, shared by every hop.

    client --(one frame per batch)--> worker --(one frame per env)--> env
    client <--(one frame per batch)-- worker <--(one frame per env)-- env

A frame is a 4-byte little-endian body length followed by one msgpack value,
always an array whose first item is a message code (below). The length prefix
lets a reader refuse an oversized frame before it buffers a byte of it.

Everything a peer sends may be hostile: `FrameReader` caps the frame size and
decodes with msgpack's length limits and, for frames from an env, caps on the
objects one frame makes and on their depth (`Limits`), and a malformed frame
raises `ProtocolError` for its caller to attribute to the peer that sent it.

Three msgpack extension types carry what plain msgpack would change (a
tuple would come back a list, a numpy scalar a Python scalar):

  code  name        payload                                   decoded as
  1     ARRAY_EXT   header "<dtype>:<dims>" + raw C-order bytes  read-only ndarray view (no copy)
  2     TUPLE_EXT   a msgpack array of the items               tuple (items decoded as usual)
  3     SCALAR_EXT  ARRAY_EXT's payload with shape ()          numpy scalar of that dtype

Only plain numeric and bool dtypes travel as ARRAY_EXT and SCALAR_EXT (any
other array goes as nested lists, other numpy scalars as Python values); a
namedtuple goes as a plain tuple; subclasses of int, float, str, bytes, list
and dict as their base type. The worker checks ARRAY_EXT and SCALAR_EXT
headers (`check_array_header`) and passes them on without NumPy; it decodes a
TUPLE_EXT's items under the same caps as the rest of the frame (its objects
count toward `max_objects`, its levels toward `max_depth`, and tuples nest at
most `MAX_TUPLE_NESTING` deep: each level is a nested decode), and encodes
the tuple again when it passes it on.

The encoder and the ext hook have a C twin, boltzlabs._wire (native/wire.c),
used when it was built and BOLTZLABS_PURE is unset: it makes exactly the bytes
and values the Python code below makes, and hands back to it anything it does
not handle exactly (the Python packer then packs the whole value; the Python
hook decodes tuples and names every bad header). A real env's reply (an
array, numpy scalars, an info dict) costs a fraction of the Python hooks'
time on each side (docs/wire.md, "The codec in C").

This module imports only the standard library and msgpack (and the C twin,
which imports nothing more): it runs inside every env, and what an env
imports every env pays for. NumPy is imported by the ext hook only when an
array arrives, and an env that receives or sends one has imported NumPy already.

Who holds each end: the trainer's is pool/ (client.py; remote_link.py for a
remote worker), the worker's worker/, an env's runtime/, a remote node's
listener remote/: host code beside the workers, which never imports pool/.
What both ends of the remote handshake share is boltzlabs/link.py; the fds and
variable names shared by host and sandbox are boltzlabs/abi.py. Every message
code of every hop is in the one table below, each value once
(tests/test_wire.py checks it).
"""

from __future__ import annotations

import os
import struct
import sys

import msgpack

from boltzlabs import errors
from boltzlabs.errors import ProtocolError, TooMany

TYPE_CHECKING = False  # typing is not imported at run time: every env would pay for it
if TYPE_CHECKING:
    from typing import Any

PROTOCOL_VERSION = 4  # 2: arrays as ARRAY_EXT, spaces in HELLO, RENDER; 3: TUPLE_EXT, SCALAR_EXT, ATTR;
# 4: ERROR frames carry a category (errors.CATEGORIES), not a class name

HEADER = struct.Struct("<I")

# env -> worker
HELLO = 0  # [HELLO, protocol, info]
STEPPED = 1  # [STEPPED, seq, obs, reward, terminated, truncated, info]
RESET_DONE = 2  # [RESET_DONE, seq, obs, info]
FAILED = 3  # [FAILED, seq, phase, message, traceback]
# worker -> env
STEP = 10  # [STEP, seq, action, gated]
RESET = 11  # [RESET, seq, seed, options]
GO = 12  # [GO, seq]: the serialize_measurement gate is yours
RENDER = 13  # [RENDER, seq]
# [ATTR, seq, op, name, args, kwargs]: op "call" (a method with args and
# kwargs, or an attribute's value), "get" (an attribute's value) or "set"
# (args is [value]); the env's serve(methods=, attributes=, target=)
ATTR = 14
# env -> worker, answering RENDER and ATTR
RENDERED = 4  # [RENDERED, seq, frame]
ATTR_DONE = 5  # [ATTR_DONE, seq, value]
# client <-> worker
OPEN = 20
PROGRESS = 21
READY = 22
CALL = 25
REPLY = 26
ERROR = 27  # [ERROR, seq, category, text, detail]: error_frame() below; errors.CATEGORIES
CLOSE = 28
# worker -> client, during a call (OPEN included, seq 0) that runs past HEARTBEAT_AFTER seconds, about
# once a second: [HEARTBEAT, seq, seconds the call has run]. It says the call is progressing and
# moves the client's deadline for it on (docs/wire.md#heartbeats); anything else of that code is a
# broken worker.
HEARTBEAT = 29

# A remote client's handshake with `boltzlabs worker --listen` (remote.py),
# before the connection is handed to a worker and OPEN/CALL begin.
CHALLENGE = 30  # [CHALLENGE, protocol, nonce]
AUTH = 31  # [AUTH, HMAC-SHA256(token, nonce)]
SOURCE = 32  # [SOURCE, {"kind": "dir", "sha256": hex, "size": n} or {"kind": "gym"}]
NEED = 33  # [NEED, bool]: send the env directory's bytes
BLOB = 34  # [BLOB, tar bytes]
ACCEPTED = 35  # [ACCEPTED, {"pid": worker pid}]

# The warm template's control channel (boltzlabs/runtime/template.py, the
# worker's TemplateSpawner), and the report of its warm-up probe.
FORK = 40  # worker -> template: [FORK, lane, generation, probe, slot] + the child's channel and log fds (+ its slot)
KILL = 41  # worker -> template: [KILL, lane, generation]
WARM = 42  # worker -> template: [WARM, module names, code]: import them, then fork envs (+ a memfd if code)
FORKED = 43  # template -> worker: [FORKED, lane, generation] + the child's pidfd
EXITED = 44  # template -> worker: [EXITED, lane, generation, wait status]
WARMED = 45  # template -> worker: [WARMED, {imported, failed, refused, import_seconds, forkable, reason}]
# probe -> worker, on the probe's channel: [PROBED, module names, how many,
# private bytes at birth, after, steps, error or None, serve(preload=) names,
# env.py's code marshalled or None]
PROBED = 46


def error_frame(seq: int, exc: BaseException) -> list[Any]:
    """The worker's ERROR frame for an exception it caught: [ERROR, seq, category, text, detail], the
    category decided by errors.category_of. A start failure's detail names the env, its log, how many
    failed, whether the sandbox's own set-up failed and the limit the env died at; an internal
    fault's carries its traceback."""
    category = errors.category_of(exc)
    detail: dict[str, Any] = {}
    if isinstance(exc, errors.StartFailure):
        detail = {"env": exc.index, "log": exc.log, "failed": exc.count, "set_up": exc.set_up, "limit": exc.limit}
    elif category == errors.INTERNAL:
        import traceback  # only on failure: nothing of it in an env's pages

        detail = {"traceback": "".join(traceback.format_exception(exc))[-16384:]}
    return [ERROR, seq, category, str(exc), detail]


# --- arrays ---------------------------------------------------------------------
#
# ARRAY_EXT payload: u16 little-endian header length h, then h bytes of ASCII
# "<dtype.str>:<dim>,<dim>,..." padded with spaces so that the raw bytes start
# at a multiple of 16 (the payload is a fresh bytes object, itself 16-aligned
# by CPython's allocator, so frombuffer gets an aligned array), then the
# C-order bytes. Only plain numeric and bool dtypes travel this way; any other
# array (object, str, datetime) is sent as nested lists, as before.

ARRAY_EXT = 1
TUPLE_EXT = 2  # payload: a msgpack array of the tuple's items (packed by this module: may hold ext types)
SCALAR_EXT = 3  # payload: ARRAY_EXT's, with shape ()
SLOT_EXT = 4  # payload: the request's seq, u64 little-endian: "the obs is in my slot" (below)
# Each tuple level is a nested msgpack decode (and encode), whose C unpacker
# puts a ~40 KiB context on the stack: 32 levels stay far inside 8 MiB.
MAX_TUPLE_NESTING = 32
_HEAD = struct.Struct("<H")
_MAX_NDIM = 32  # NumPy 1.x's NPY_MAXDIMS
# The size an array's shape may describe, empty dimensions counted as 1. A
# real array is at most one frame; 2**40 leaves NumPy's intp far away.
_MAX_ARRAY_BYTES = 1 << 40
_NUMERIC = frozenset(
    [("b", 1)]
    + [(k, s) for k in "iu" for s in (1, 2, 4, 8)]
    + [("f", s) for s in (2, 4, 8, 16)]
    + [("c", s) for s in (8, 16, 32)]
)


def _array_ext(array: Any, code: int = ARRAY_EXT) -> Any:
    dtype = array.dtype
    if (dtype.kind, dtype.itemsize) not in _NUMERIC or dtype.fields is not None:
        return None
    text = f"{dtype.str}:{','.join(map(str, array.shape))}".encode("ascii")
    pad = -(_HEAD.size + len(text)) % 16
    head = _HEAD.pack(len(text) + pad) + text + b" " * pad
    # C-contiguous arrays are joined straight from their buffer: one copy.
    raw = array.data if array.flags.c_contiguous else array.tobytes()
    return msgpack.ExtType(code, b"".join((head, raw)))


class CheckedArray(msgpack.ExtType):  # type: ignore[misc]  # msgpack ships no types
    """An ARRAY_EXT whose header the worker checked ("check" mode), passed on as it came.

    Unhashable, like the ndarray the trainer decodes it into: a dict an env keys by an array (or
    by a tuple holding one) is refused by the worker's decode, on that env's lane, and never
    reaches the trainer, whose own decode would refuse the whole frame it arrives in."""

    __slots__ = ()
    __hash__ = None  # type: ignore[assignment]


def check_array_header(data: bytes, max_bytes: int = _MAX_ARRAY_BYTES) -> Any:
    """(dtype str, shape, offset of the raw bytes) of an ARRAY_EXT payload.

    Raises ValueError unless the header is well formed, the dtype is a plain
    numeric one, there are at most 32 dimensions, and the raw bytes are
    exactly itemsize x the product of the dimensions. An empty array still
    has its other dimensions multiplied (zeros counted as ones) and that
    size must stay under `max_bytes`: NumPy refuses a shape like (0, 2**62)
    ("array is too big"), and the refusal must come here, where it fails one
    lane, not in the client's decode of a whole batch. Needs no NumPy: the
    worker runs it on every array an env sends.
    """
    if len(data) < _HEAD.size:
        raise ValueError("array ext shorter than its header")
    (length,) = _HEAD.unpack_from(data)
    start = _HEAD.size + length
    if start > len(data):
        raise ValueError("array ext header runs past the payload")
    try:
        text = bytes(data[_HEAD.size : start]).decode("ascii").rstrip(" ")
    except UnicodeDecodeError:
        raise ValueError("array ext header is not ASCII") from None
    dtype, colon, dims = text.partition(":")
    if (
        not colon
        or len(dtype) < 3
        or len(dtype) > 4
        or dtype[0] not in "<>|"
        or not dtype[2:].isdigit()
        or not dtype[2:].isascii()
        or (dtype[1], int(dtype[2:])) not in _NUMERIC
    ):
        raise ValueError(f"array ext has an unsupported dtype {dtype[:16]!r}")
    parts = dims.split(",") if dims else []
    if len(parts) > _MAX_NDIM or not all(p.isdigit() and p.isascii() and len(p) <= 19 for p in parts):
        raise ValueError(f"array ext has a bad shape {dims[:100]!r} (at most {_MAX_NDIM} dimensions of decimal digits)")
    shape = tuple(int(p) for p in parts)
    itemsize = int(dtype[2:])
    # Python ints do not overflow; each step is checked against the cap so
    # the product never grows past it by more than one factor.
    nbytes = virtual = itemsize
    for dim in shape:
        nbytes *= dim
        virtual *= dim or 1
        if virtual > max_bytes:
            raise ValueError(
                f"array ext of shape {shape[:_MAX_NDIM]} and dtype {dtype} is too big: "
                f"over {max_bytes} bytes even counting empty dimensions as 1"
            )
    if nbytes != len(data) - start:
        raise ValueError(f"array ext of shape {shape} and dtype {dtype} does not match its {len(data) - start} bytes")
    return dtype, shape, start


def _numpy() -> Any:
    np = sys.modules.get("numpy")
    if np is None:
        import numpy as np
    return np


def _scalar(data: bytes, check_only: bool) -> Any:
    dtype, shape, start = check_array_header(data)
    if shape:
        raise ValueError("scalar ext has the shape of an array")
    if check_only:  # the worker: the header is checked, the bytes are passed on untouched
        return msgpack.ExtType(SCALAR_EXT, data)
    np = _numpy()
    return np.frombuffer(data, dtype=np.dtype(dtype), offset=start)[0]


def _default(obj: Any) -> Any:
    # The packer runs with strict_types: anything not exactly a msgpack type
    # comes here. numpy values are converted only when they appear, so numpy
    # is never imported here: an env that does not use it does not pay for it.
    cls = type(obj)
    if cls.__module__ == "numpy":
        if cls.__name__ == "ndarray":
            ext = _array_ext(obj)
            if ext is not None:
                return ext
        elif getattr(obj, "ndim", None) == 0 and hasattr(obj, "dtype"):
            ext = _array_ext(_numpy().asarray(obj), SCALAR_EXT)  # a scalar keeps its dtype
            if ext is not None:
                return ext
        tolist = getattr(obj, "tolist", None)
        if tolist is not None:
            return tolist()  # np.str_ and friends become Python values; odd arrays nested lists
    if cls is CheckedArray:
        return msgpack.ExtType(ARRAY_EXT, obj.data)
    if isinstance(obj, tuple):
        return msgpack.ExtType(TUPLE_EXT, _pack_items(obj))
    if isinstance(obj, int):
        if cls is int:
            raise TypeError(f"integer {obj} is out of msgpack's 64-bit range")
        return int(obj)  # an IntEnum, say: as its value (bool is exact, never here)
    for base in (float, str, bytes, list, dict):
        if isinstance(obj, base):
            return base(obj)  # type: ignore[arg-type]
    raise TypeError(f"cannot serialize object of type {type(obj).__name__}")


_packer = msgpack.Packer(default=_default, use_bin_type=True, strict_types=True)


def _load_native() -> Any:
    """boltzlabs._wire (native/wire.c), or None: not built, or BOLTZLABS_PURE=1."""
    if os.environ.get("BOLTZLABS_PURE", "").strip() not in ("", "0"):
        return None
    try:
        from boltzlabs import _wire
    except ImportError:
        return None
    return _wire


_native = _load_native()
_nesting = [0]  # tuples being packed inside one another


def _pack_items(items: Any) -> bytes:
    # A packer is not reentrant: a tuple's items are packed by a fresh one.
    if _nesting[0] >= MAX_TUPLE_NESTING:
        raise ValueError(
            f"tuples nested more than {MAX_TUPLE_NESTING} deep cannot be sent (MAX_TUPLE_NESTING): "
            "use lists for deep structures"
        )
    _nesting[0] += 1
    try:
        return msgpack.packb(list(items), default=_default, use_bin_type=True, strict_types=True)  # type: ignore[no-any-return]
    finally:
        _nesting[0] -= 1


def encode(message: Any) -> bytes:
    """One frame: length prefix and msgpack body. Raises TypeError/ValueError."""
    if type(message) is list and message and type(message[-1]) is Raw:
        # The last item is msgpack already (the native step's result): the
        # rest is packed with a nil in its place, and the nil (always the
        # body's last byte) is replaced by the raw bytes, joined with the
        # prefix in one copy (a step of image observations is megabytes).
        head = _packer.pack(message[:-1] + [None])[:-1]
        raw = message[-1].data
        return b"".join((HEADER.pack(len(head) + len(raw)), head, raw))
    if _native is not None:
        frame = _native.frame(message)
        if frame is not None:  # the hot path: None when C leaves the value to the Python packer
            return frame  # type: ignore[no-any-return]
    body = _packer.pack(message)
    return HEADER.pack(len(body)) + body  # type: ignore[no-any-return]


def pack(value: Any) -> bytes:
    """One value's msgpack bytes, as encode packs it inside a frame."""
    if _native is not None:
        packed = _native.pack(value)
        if packed is not None:
            return packed  # type: ignore[no-any-return]
    return _packer.pack(value)  # type: ignore[no-any-return]


class Raw:
    """The msgpack bytes of one value, already encoded (`data`): as the last
    item of a message given to `encode`, spliced into the frame as they are.
    It holds the bytes, not a copy of them."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


# --- observations in shared memory ------------------------------------------------------
#
# A local pool whose observation space has a fixed shape (a Box, or a Dict or
# Tuple of Boxes) gives each env a slot: a memfd of its own, made by the worker,
# sized from the declared space and sealed against resizing once the space is
# known, mapped by that env (fd abi.SLOT_FD) and by the trainer, nobody else. An env
# writes its obs there, then the header's seq, and replies with a SLOT_EXT marker
# carrying the same seq in place of the obs; the trainer copies the slot out once
# that reply has come, after checking the header (docs/wire.md, "Observations in
# shared memory"; docs/threat-model.md has each point).
#
# A slot: a 64-byte header (magic, version, then u64 little-endian: the seq of the
# reply whose obs it holds, and the data's size), then each of the space's Boxes
# in the space's order, each at a multiple of 64 bytes.

SLOT_MAGIC = 0x534C5A42  # "BZLS"
SLOT_HEADER = struct.Struct("<IIQQ")  # magic, version, seq, data size
SLOT_SEQ = struct.Struct("<Q")  # the seq alone, at offset 8
SLOT_HEADER_SIZE = 64
SLOT_ALIGN = 64
# The Box dtypes a slot holds (the spec's str(dtype)): their item sizes, no NumPy needed.
_SLOT_DTYPES = {
    "bool": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "uint16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
}


class Slot:
    """The client's decoding of a SLOT_EXT marker: this lane's obs is in its slot, for reply `seq`."""

    __slots__ = ("seq",)

    def __init__(self, seq: int) -> None:
        self.seq = seq

    def __repr__(self) -> str:
        return f"Slot(seq={self.seq})"


class SlotLayout:
    """Where each Box of an observation space lies in a slot.

    `leaves`: (path, dtype name, shape, offset) in the space's order, where path
    is () for a Box, (key,) for a Dict's item, (index,) for a Tuple's, deeper
    for nested ones; `kind`: "box", "dict" or "tuple" at the top; `size`: the
    slot's bytes, header included; `spec`: the space spec it was made from."""

    __slots__ = ("leaves", "size", "spec")

    def __init__(self, leaves: list[Any], size: int, spec: dict[str, Any]) -> None:
        self.leaves, self.size, self.spec = leaves, size, spec

    def describe(self) -> dict[str, Any]:
        """Plain data for the READY (the client builds its views from it)."""
        return {
            "leaves": [[list(path), dtype, list(shape), offset] for path, dtype, shape, offset in self.leaves],
            "size": self.size,
        }


def slot_layout(spec: Any, max_bytes: int) -> SlotLayout | None:
    """The slot layout of a space spec (boltzlabs.runtime.spec.to_spec's), or
    None when the space has no fixed shape (anything but Box, and Dict and
    Tuple of them), is malformed, or needs more than `max_bytes`. The spec may
    come from an env: it is only read, with bounds (at most 64 Boxes of at
    most 32 dimensions, 8 levels deep)."""
    leaves: list[Any] = []
    stack: list[tuple[tuple[Any, ...], Any, int]] = [((), spec, 0)]
    while stack:
        path, node, depth = stack.pop()
        if type(node) is not dict or depth > 8 or len(leaves) > 64:
            return None
        kind = node.get("type")
        if kind == "Box":
            shape, dtype = node.get("shape"), node.get("dtype")
            if (
                type(shape) is not list
                or len(shape) > 32
                or dtype not in _SLOT_DTYPES
                or not all(type(d) is int and 0 <= d < 1 << 40 for d in shape)
            ):
                return None
            leaves.append((path, dtype, tuple(shape)))
        elif kind == "Dict":
            items = node.get("spaces")
            if type(items) is not list or not items:
                return None
            for item in reversed(items):
                if type(item) is not list or len(item) != 2 or type(item[0]) is not str:
                    return None
                stack.append((path + (item[0],), item[1], depth + 1))
        elif kind == "Tuple":
            items = node.get("spaces")
            if type(items) is not list or not items:
                return None
            for index in reversed(range(len(items))):
                stack.append((path + (index,), items[index], depth + 1))
        else:
            return None
    placed, offset = [], SLOT_HEADER_SIZE
    for path, dtype, shape in leaves:
        nbytes = _SLOT_DTYPES[dtype]
        for dim in shape:
            nbytes *= dim
            if nbytes > max_bytes:
                return None
        placed.append((path, dtype, shape, offset))
        offset += -(-max(nbytes, 1) // SLOT_ALIGN) * SLOT_ALIGN
        if offset > max_bytes:
            return None
    return SlotLayout(placed, offset, spec)


class Limits:
    """Caps applied to what a peer sends: frame size, msgpack lengths, and
    (when `max_objects` is given) how many objects one frame may hold (lists
    and maps, and the items they hold) and how deep they may nest.

    `arrays` says what happens to extension values: "decode" (client, env:
    read-only numpy arrays, numpy scalars, tuples), "check" (worker, from an
    env: validate array and scalar headers and keep their ExtType, an array's
    as a `CheckedArray`, decode tuples under these same caps; any other
    extension is malformed) or
    "pass" (worker, from the client: keep every ExtType as is).

    Objects are what make a frame cost more memory than its bytes: an empty
    list is one byte on the wire and 64 in the worker, a 2-byte string 51.
    msgpack's C decoder stops at 1024 levels on its own, but a 1000-deep
    value then breaks everything that walks it (repr, re-encoding with its
    extra levels). A body of at most `max_depth` bytes can neither nest
    deeper nor hold more objects than that, so it is decoded with no hook
    (the hot path: small frames). A longer one is decoded with a list and
    map hook that counts each container and its items and stops the decoder
    past `max_objects` (a container's items exist before its hook runs, so
    one container of up to max_array_len items can come on top); only if it
    holds more than `max_depth` containers is its depth measured, by a loop
    (no recursion), after the decode.
    """

    __slots__ = (
        "max_frame",
        "kwargs",
        "max_depth",
        "max_objects",
        "guarded",
        "_count",
        "made",
        "_inner",
        "slot_marks",
        "str_fix",
    )

    def __init__(
        self,
        max_frame: int,
        max_str_len: int | None = None,
        max_bin_len: int | None = None,
        max_array_len: int | None = None,
        max_map_len: int | None = None,
        arrays: str = "decode",
        max_depth: int | None = None,
        max_objects: int | None = None,
        str_fix: str = "",
    ) -> None:
        self.max_frame = int(max_frame)
        # What the refusal of a str over max_str_len adds: how its owner raises the cap (the
        # worker's env limits name RLPool(limits={'max_str_len': ...}) and the policy's ceiling).
        self.str_fix = str_fix
        cap = self.max_frame

        def clamp(limit: Any) -> Any:  # None: only the frame cap applies
            return cap if limit is None else min(int(limit), cap)

        self.kwargs = dict(
            raw=False,
            strict_map_key=False,
            max_str_len=clamp(max_str_len),
            max_bin_len=clamp(max_bin_len),
            max_array_len=clamp(max_array_len),
            max_map_len=clamp(max_map_len),
            max_ext_len=cap,
        )
        # The decode options a tuple's items are decoded with: those of the
        # frame around it (decode() switches it to the guarded ones).
        self._inner = [self.kwargs]
        # SLOT_EXT markers in a frame: [-1] refuses them ("check": a pool without
        # slots), [k] counts them per frame (decode() zeroes it), for the worker
        # to check that the one marker a reply may hold is its obs.
        self.slot_marks = [-1]
        if arrays != "pass":  # "pass" keeps every ExtType: msgpack's default, no hook
            self.kwargs["ext_hook"] = _ext_hook(arrays, self._inner, self.slot_marks)
        self.max_depth: int | None = None
        self.max_objects: int | None = None
        self.guarded = None
        self._count = [0, 0]  # objects, containers: of the frame being decoded
        # Objects made by every frame decoded under these limits (an upper
        # bound: a short frame counts its length), for its owner to charge and
        # reset: the worker bounds what a pool holds with it.
        self.made = 0
        if max_objects is not None:
            # Everything a frame holds sits one level below the message itself,
            # and re-encoding adds a few levels (the worker's REPLY): stay well
            # inside msgpack's 1024 on both sides.
            self.max_depth = max(1, min(int(max_depth if max_depth is not None else MAX_DEPTH), MAX_DEPTH))
            self.max_objects = max(self.max_depth, int(max_objects))
            count, limit = self._count, self.max_objects

            def counted_list(obj: Any) -> Any:
                count[0] += 1 + len(obj)
                count[1] += 1
                if count[0] > limit:
                    raise TooMany
                return obj

            def counted_map(obj: Any) -> Any:
                count[0] += 1 + 2 * len(obj)
                count[1] += 1
                if count[0] > limit:
                    raise TooMany
                return obj

            self.guarded = dict(self.kwargs, list_hook=counted_list, object_hook=counted_map)


def _ext_hook(mode: str, inner: list[Any], marks: list[Any]) -> Any:
    """The ext hook of a Limits in `mode` "decode" (client, env) or "check"
    (worker, from an env: anything unknown is malformed). `inner[0]` holds
    the decode options a tuple's items are decoded with; `marks[0]` counts the
    SLOT_EXT markers of the frame ("check": -1 refuses them)."""
    level = [0]  # tuples being decoded inside one another
    check_only = mode == "check"

    def items_of(data: Any) -> Any:
        if level[0] >= MAX_TUPLE_NESTING:
            raise ValueError(f"tuples nested more than {MAX_TUPLE_NESTING} deep (MAX_TUPLE_NESTING)")
        level[0] += 1
        try:
            # The same caps: a tuple's items count toward the frame's objects.
            items = msgpack.unpackb(data, **inner[0])
        finally:
            level[0] -= 1
        if type(items) is not list:
            raise ValueError("tuple ext does not hold an array of items")
        return tuple(items)

    # Hot path: an array is the common ext, tested first, decoded inline.
    if check_only:

        def hook(code: int, data: bytes) -> Any:
            if code == ARRAY_EXT:
                check_array_header(data)
                return CheckedArray(code, data)
            if code == TUPLE_EXT:
                return items_of(data)
            if code == SCALAR_EXT:
                return _scalar(data, True)
            if code == SLOT_EXT and marks[0] >= 0 and len(data) == 8:
                marks[0] += 1
                return msgpack.ExtType(code, data)
            raise ValueError(f"unknown msgpack extension type {code}")
    else:

        def hook(code: int, data: bytes) -> Any:
            if code == ARRAY_EXT:
                dtype, shape, start = check_array_header(data)
                np = sys.modules.get("numpy")
                if np is None:
                    import numpy as np
                # Zero-copy: a read-only view of the payload's bytes.
                return np.frombuffer(data, dtype=np.dtype(dtype), offset=start).reshape(shape)  # type: ignore[union-attr]
            if code == TUPLE_EXT:
                return items_of(data)
            if code == SCALAR_EXT:
                return _scalar(data, False)
            if code == SLOT_EXT:
                if len(data) != 8:
                    raise ValueError(f"slot ext of {len(data)} bytes (a seq is 8)")
                return Slot(int.from_bytes(data, "little"))
            return msgpack.ExtType(code, data)

    if _native is not None:
        # Arrays and numpy scalars in C; a tuple, any other code and any header C
        # refuses go to the Python hook above (its caps, its error messages).
        return _native.Hook(check_only, hook, CheckedArray)
    return hook


# The deepest a Limits may allow: re-encoded inside a REPLY (3 more levels)
# and decoded again, it stays under msgpack's 1024-level stack in C, and
# under Python's default recursion limit (1000) for code that walks it.
MAX_DEPTH = 512


def _too_deep(message: Any, limit: int) -> bool:
    """Whether a decoded value nests deeper than `limit` levels (the message is level 1)."""
    stack = [(message, 1)]
    pop, push = stack.pop, stack.append
    while stack:
        value, depth = pop()
        if depth > limit:
            return True
        items = value.values() if type(value) is dict else value
        for item in items:
            if type(item) is list or type(item) is dict or type(item) is tuple:
                push((item, depth + 1))
    return False


# msgpack's "N exceeds max_X_len(M)": what X counts, in words.
_LENGTHS = {
    "max_str_len": ("a str of", "bytes (UTF-8)"),
    "max_bin_len": ("a bytes value of", "bytes"),
    "max_array_len": ("a list of", "items"),
    "max_map_len": ("a dict of", "entries"),
    "max_ext_len": ("an extension value (array, tuple) of", "bytes"),
}


def _refusal(exc: BaseException, limits: Limits) -> str:
    """Why msgpack refused a frame body, in words: a length over one of the Limits' caps (which,
    how long, the cap, and for a str its owner's `str_fix`), a str that is not UTF-8, or malformed."""
    text = str(exc)
    if type(exc).__name__ == "StackError":
        return "frame is nested deeper than msgpack's limit of 1024 levels"
    if type(exc) is ValueError and " exceeds max_" in text:
        size, _, rest = text.partition(" exceeds ")
        name, _, cap = rest.partition("(")
        cap = cap.rstrip(")")
        if name in _LENGTHS and size.isdigit() and cap.isdigit():
            what, unit = _LENGTHS[name]
            fix = limits.str_fix if name == "max_str_len" else ""
            return f"frame holds {what} {int(size):,} {unit}, over its cap of {int(cap):,} (limits.{name}){fix}"
    if type(exc) is TypeError and text.startswith("unhashable type"):
        return (
            "malformed frame: a dict key that is a list, a dict or an array, or a tuple holding one "
            "(keys must be hashable: str, numbers, bytes, None, or tuples of those)"
        )
    if isinstance(exc, UnicodeDecodeError):
        return (
            f"malformed frame: a str that is not valid UTF-8 ({exc.reason} at byte {exc.start} of a "
            f"{len(exc.object):,}-byte str); binary data travels as bytes"
        )
    return f"malformed frame ({type(exc).__name__}: {exc})"


def long_str(value: Any, cap: int) -> int:
    """The size in UTF-8 bytes of the first str in `value` longer than `cap` bytes, or 0 when none is.

    Looks through lists, tuples, dicts (keys too) and numpy arrays of str or objects, the way
    encode() would send them, with no recursion; a str's bytes are counted only when its length
    in characters could pass the cap (ASCII: its length, at no cost). For the trainer's check of
    actions (pool/protocol.py) and an env's of its own replies (runtime/serve.py), each against
    the pool's max_str_len, before the bytes go anywhere. A value that holds itself is looked
    through a bounded number of items, then left to encode() to refuse."""
    quarter = cap >> 2  # a character is at most 4 bytes
    stack = [value]
    pop, extend = stack.pop, stack.extend
    left = 1 << 24
    while stack and left:
        left -= 1
        item = pop()
        if isinstance(item, str):
            if len(item) > quarter:
                size = len(item) if item.isascii() else len(item.encode("utf-8", "surrogatepass"))
                if size > cap:
                    return size
        elif isinstance(item, (list, tuple)):
            extend(item)
        elif isinstance(item, dict):
            extend(item)
            extend(item.values())
        elif type(item).__module__ == "numpy" and getattr(getattr(item, "dtype", None), "kind", "") in ("U", "O"):
            stack.append(item.tolist())
    return 0


def decode(body: Any, limits: Limits) -> Any:
    """Decode one frame body (bytes or memoryview) under `limits`."""
    message = None
    guarded = limits.guarded
    marks = limits.slot_marks
    if marks[0] > 0:
        marks[0] = 0
    try:
        if guarded is None:
            message = msgpack.unpackb(body, **limits.kwargs)
        elif len(body) <= limits.max_depth:  # type: ignore[operator]
            limits.made += len(body)
            message = msgpack.unpackb(body, **limits.kwargs)
        else:
            count = limits._count
            count[0] = count[1] = 0
            inner = limits._inner
            inner[0] = guarded
            try:
                message = msgpack.unpackb(body, **guarded)
            finally:
                inner[0] = limits.kwargs
                limits.made += count[0]
    except TooMany:
        error = (
            f"frame holds more than {limits.max_objects} objects (lists, maps and their items); "
            "send big data as numpy arrays or bytes"
        )
    except Exception as exc:  # msgpack raises several types for bad input
        error = _refusal(exc, limits)
    else:
        error = None  # type: ignore[assignment]  # (a str in the branches above)
        if type(message) is not list or not message or type(message[0]) is not int:
            error = "frame is not a message (an array led by an integer code)"
        elif guarded is not None and limits._count[1] > limits.max_depth and _too_deep(message, limits.max_depth):  # type: ignore[arg-type,operator]
            error = f"frame is nested deeper than {limits.max_depth} levels (limits.max_depth)"
        elif marks[0] > 0 and not (
            marks[0] == 1
            and message[0] in (STEPPED, RESET_DONE)
            and len(message) > 2
            and type(message[2]) is msgpack.ExtType
            and message[2].code == SLOT_EXT
        ):
            error = "frame holds a slot marker (SLOT_EXT) where no observation goes: only a step's or a reset's obs may be one"
    if error is not None:
        message = None
        # Raised outside the except block with the view released, so the
        # traceback pins no export of the caller's buffer (it could not grow).
        if isinstance(body, memoryview):
            body.release()
        raise ProtocolError(error)
    return message


class FrameReader:
    """Incremental frame parser for one peer's byte stream.

    `feed(data)` returns every whole message the bytes complete, in order, and
    keeps a partial frame for the next call. A length over the cap or a body
    that does not decode raises `ProtocolError`; after that the stream is
    unusable (frame boundaries are lost) and the peer must be dropped.

    With `allocate` (a callable returning a writable buffer of n bytes, e.g.
    numpy.empty(n, uint8)), a frame of at least DIRECT_MIN bytes whose prefix
    has arrived gets a buffer of its own: `room()` is the part still missing,
    for the caller to `recv_into`, and `filled(n)` says how many bytes went
    in. The client uses it for the worker's REPLY, megabytes with image
    observations, which would otherwise be read in 64 KiB pieces and copied
    into a growing bytearray. Never for a peer that is not trusted: the
    buffer is allocated when the prefix announces the frame.
    """

    __slots__ = ("limits", "_buf", "_allocate", "_frame", "_have")
    DIRECT_MIN = 1 << 18

    def __init__(self, limits: Limits, allocate: Any = None) -> None:
        self.limits = limits
        self._buf = bytearray()
        self._allocate = allocate
        self._frame: Any = None  # a long frame read in place (allocate given), and how much of it is in
        self._have = 0

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame held back."""
        return self._have if self._frame is not None else len(self._buf)

    def room(self) -> Any:
        """The rest of a long frame still to come, as a writable memoryview
        (release it before the next call), or None: then read and feed()."""
        if self._frame is None:
            return None
        return memoryview(self._frame).cast("B")[self._have :]

    def filled(self, n: int) -> list[Any]:
        """n bytes were read into room(): the frame's message once it is whole."""
        self._have += n
        if self._have < len(self._frame):
            return []
        frame, self._frame, self._have = self._frame, None, 0
        with memoryview(frame) as view:
            return [decode(view.cast("B")[4:], self.limits)]

    def feed(self, data: Any) -> list[Any]:
        if self._frame is not None:  # the rest of a long frame came by feed(), not room()
            with self.room() as room:
                n = min(len(room), len(data))
                room[:n] = data[:n]
            out = self.filled(n)
            return out + self.feed(data[n:]) if n < len(data) else out
        # Hot path: most reads deliver exactly one whole frame and nothing else.
        buf = self._buf
        if not buf and len(data) >= 4:
            (length,) = HEADER.unpack_from(data)
            if length + 4 == len(data):
                if length > self.limits.max_frame:
                    self._too_big(length)
                with memoryview(data) as view:
                    return [decode(view[4:], self.limits)]
        buf += data
        out = []
        start = 0
        end = len(buf)
        while end - start >= 4:
            (length,) = HEADER.unpack_from(buf, start)
            if length > self.limits.max_frame:
                self._too_big(length)
            if end - start - 4 < length:
                if self._allocate is not None and length >= self.DIRECT_MIN:
                    self._frame = self._allocate(4 + length)
                    self._have = end - start
                    with memoryview(self._frame) as into:
                        into.cast("B")[: self._have] = buf[start:end]
                    start = end
                break
            with memoryview(buf) as view:
                out.append(decode(view[start + 4 : start + 4 + length], self.limits))
            start += 4 + length
        if start:
            del buf[:start]
        return out

    def _too_big(self, length: int) -> None:
        raise ProtocolError(f"frame of {length} bytes is over the cap of {self.limits.max_frame} bytes")
