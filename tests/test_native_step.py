"""The native synchronous step (_fastpath.step, Batch.compose; native/fastpath.c; issue 16).

The C walker vouches for an env's reply only if Python would accept it:
`vouch()` is run against wire.decode + check_reply (the worker's own
checks) on random values, on random mutations of valid replies, and on a
hostile corpus, and each cap is tried at its limit and one past it, where
both must agree. What C vouches for must reach the client as the same
value as Python's decode-and-re-encode gives. step()'s frames are compared
with wire.encode's over real sockets, Batch.compose's REPLY with the pure
path's, and real pools (both spawn modes) with BOLTZLABS_PURE=1.
"""

from __future__ import annotations

import math
import socket
import struct
import threading
import time

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from boltzlabs.errors import ProtocolError
from boltzlabs import wire
from boltzlabs.worker.native import caps
from boltzlabs.worker.reactor import check_reply
from conftest import scaled
from framers import ENV, SEQ, WORKER_PACK, Lanes, same

try:
    from boltzlabs.worker import _fastpath as fp
except ImportError:
    fp = None

pytestmark = pytest.mark.skipif(fp is None, reason="boltzlabs.worker._fastpath is not built")

CLIENT = wire.Limits(1 << 30)  # how the client decodes the REPLY


def python_reply(data: bytes, reset: bool, seq: int, limits: wire.Limits):
    """What the worker's pure path makes of one read as the reply due: the
    decoded message, or None where it kills the lane (lifecycle.Lifecycle.take, _on_message)."""
    reader = wire.FrameReader(limits)
    try:
        messages = reader.feed(data)
    except ProtocolError:
        return None
    if len(messages) != 1 or reader.pending:
        return None
    message = messages[0]
    if len(message) < 2 or message[1] != seq:
        return None
    result = check_reply(message)
    if result is None or result[0] != (wire.RESET_DONE if reset else wire.STEPPED):
        return None
    return result


def client(data: bytes):
    return msgpack.unpackb(data, **CLIENT.kwargs)


def check_vouch(data: bytes, reset: bool = False, seq: int = SEQ, limits: wire.Limits = ENV):
    """C vouches => Python accepts, and the client sees the same values either way.
    Returns (C's verdict, Python's)."""
    got = fp.vouch(data, reset, seq, caps(limits))
    want = python_reply(data, reset, seq, limits)
    if got is not None:
        assert want is not None, f"C vouched for a reply Python refuses: {data[:200]!r}"
        obs, reward, terminated, truncated, info = got
        assert same(client(obs), client(wire.pack(want[2])))
        if reset:
            assert (reward, terminated, truncated) == (0.0, False, False)
            assert same(client(info), client(wire.pack(want[3])))
        else:
            assert struct.pack("<d", reward) == struct.pack("<d", float(want[3])) or math.isnan(reward)
            assert (terminated, truncated) == (want[4], want[5])
            assert same(client(info), client(wire.pack(want[6])))
    return got is not None, want is not None


# --- random values ------------------------------------------------------------------------

_DTYPES = ["<f4", "<f8", ">f8", "<f2", "<i8", "|i1", "<u2", "|u1", "|b1", "<c8", "<c16"]
keys = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=6)
    | st.binary(max_size=6)
)
arrays = st.builds(
    lambda dtype, shape, seed: np.random.default_rng(seed).integers(0, 3, shape).astype(dtype),
    st.sampled_from(_DTYPES),
    st.lists(st.integers(0, 3), max_size=3).map(tuple),
    st.integers(0, 99),
)
numpy_scalars = st.builds(lambda dtype, v: np.array(v).astype(dtype)[()], st.sampled_from(_DTYPES), st.integers(0, 5))
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=12)
    | arrays
    | numpy_scalars
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4) | st.lists(inner, max_size=3).map(tuple)
    ),
    max_leaves=25,
)
rewards = st.floats() | st.integers(-(2**63), 2**64 - 1) | st.floats(width=32).map(np.float32).map(float)
infos = st.dictionaries(keys, values, max_size=4)
# Edits of a frame (mutated()): (offset, byte, how), one to four of them.
EDITS = st.lists(
    st.tuples(st.integers(0, 1 << 16), st.integers(0, 255), st.sampled_from(["flip", "insert", "delete", "cut"])),
    min_size=1,
    max_size=4,
)


class Packed(bytes):
    """A value's msgpack bytes, made by hand (wire.pack refuses some hostile shapes)."""


def stepped(obs, reward, terminated, truncated, info, seq=SEQ) -> bytes:
    message = [wire.STEPPED, seq, obs, reward, terminated, truncated, info]
    if type(obs) is not Packed:
        return wire.encode(message)
    body = b"\x97" + wire.pack(message[:2])[1:] + obs + wire.pack(message[3:])[1:]  # fixarray heads: one byte
    return wire.HEADER.pack(len(body)) + body


def ext(code: int, payload: bytes) -> bytes:
    return wire.pack(msgpack.ExtType(code, payload))


def array_ext(header: str, raw: bytes, code: int = wire.ARRAY_EXT) -> bytes:
    text = header.encode("latin-1")
    return ext(code, struct.pack("<H", len(text)) + text + raw)


def tuples(k: int, leaf: bytes = b"\xc0") -> Packed:
    """k tuples nested, as TUPLE_EXT bytes (past MAX_TUPLE_NESTING wire.pack refuses to make them)."""
    for _ in range(k):
        leaf = ext(wire.TUPLE_EXT, b"\x91" + leaf)
    return Packed(leaf)


def float32_reward(obs, reward, info) -> bytes:
    """A reply whose reward is a msgpack float32 (Python's packer writes float64)."""
    body = msgpack.packb([wire.STEPPED, SEQ, None, 0.0, False, True, {}])
    head = body[:3]  # fixarray, code, seq
    tail = b"\xc2\xc3\x80"
    obs_bytes, info_bytes = wire.pack(obs), wire.pack(info)
    body = head + obs_bytes + b"\xca" + struct.pack(">f", reward) + tail[:2] + info_bytes
    return wire.HEADER.pack(len(body)) + body


@pytest.mark.timeout(900)
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(values, rewards, st.booleans(), st.booleans(), infos)
def test_valid_replies_are_vouched_for_and_reach_the_client_unchanged(obs, reward, terminated, truncated, info):
    data = stepped(obs, reward, terminated, truncated, info)
    assert check_vouch(data) == (True, True)  # a plain reply within the caps: C takes it
    assert check_vouch(wire.encode([wire.RESET_DONE, SEQ, obs, info]), reset=True) == (True, True)
    assert check_vouch(float32_reward(obs, 0.5, info)) == (True, True)


@pytest.mark.timeout(900)
@settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    values,
    rewards,
    infos,
    EDITS,
    st.booleans(),
)
def test_mutated_replies_are_vouched_for_only_when_python_accepts(obs, reward, info, edits, fix_prefix):
    data = mutated(stepped(obs, reward, False, True, info), edits, fix_prefix)
    if data:
        check_vouch(data)
        check_vouch(data, reset=True)


def mutated(frame: bytes, edits: list, fix_prefix: bool) -> bytes:
    """`frame` with each (offset, byte, how) edit made; its length prefix made right again if
    `fix_prefix`. b'' when the edits leave nothing."""
    data = bytearray(frame)
    for at, byte, how in edits:
        at %= len(data)
        if how == "flip":
            data[at] = byte
        elif how == "insert":
            data.insert(at, byte)
        elif how == "delete":
            del data[at]
        else:
            del data[at:]
        if not data:
            return b""
    if fix_prefix and len(data) >= 4:
        data[:4] = wire.HEADER.pack(len(data) - 4)
    return bytes(data)


# --- every cap at its limit and one past it: both sides agree --------------------------------


def small(**kw) -> wire.Limits:
    base = dict(
        max_frame=1 << 16,
        max_str_len=100,
        max_bin_len=100,
        max_array_len=100,
        max_map_len=100,
        arrays="check",
        max_depth=8,
        max_objects=1000,
    )
    base.update(kw)
    return wire.Limits(**base)


def nest(k: int, leaf=None, kind=list):
    for _ in range(k):
        leaf = kind([leaf])
    return leaf


@pytest.mark.parametrize(
    "limits, at_cap, past_cap",
    [
        (small(max_str_len=10), "s" * 10, "s" * 11),
        (small(max_str_len=10), {"k" * 10: 1}, {"k" * 11: 1}),
        (small(max_bin_len=10), b"b" * 10, b"b" * 11),
        (small(max_array_len=10), list(range(10)), list(range(11))),
        (small(max_array_len=10), tuple(range(10)), tuple(range(11))),
        (small(max_map_len=5), {i: 0 for i in range(5)}, {i: 0 for i in range(6)}),
        (small(max_frame=300, max_str_len=1000), "x" * 282, "x" * 283),  # a body of 18 + len bytes (str16)
        # objects: the message 1 + 7, its info 1, the obs 1 + len (a map 1 + 2 len)
        (small(max_objects=50), [0] * 40, [0] * 41),
        (small(max_objects=50), {i: 0 for i in range(20)}, {i: 0 for i in range(21)}),
        (small(max_objects=50), tuple([0] * 40), tuple([0] * 41)),
        # depth: the message is level 1, obs level 2; tuples are levels too
        (small(max_depth=8), nest(7), nest(8)),
        (small(max_depth=8), nest(7, kind=tuple), nest(8, kind=tuple)),
        (small(max_depth=8), nest(5, {"a": [1]}), nest(6, {"a": [1]})),
        (small(max_depth=512, max_objects=10**6), tuples(32), tuples(33)),  # MAX_TUPLE_NESTING
    ],
    ids=[
        "str",
        "str-key",
        "bin",
        "array",
        "tuple",
        "map",
        "frame",
        "objects-list",
        "objects-map",
        "objects-tuple",
        "depth",
        "depth-tuple",
        "depth-map",
        "tuple-nesting",
    ],
)
def test_each_cap_is_kept_exactly_as_python_keeps_it(limits, at_cap, past_cap):
    # Every body here is longer than max_depth bytes: Python counts its objects and measures its depth.
    assert check_vouch(stepped(at_cap, 1.0, False, False, {}), limits=limits) == (True, True)
    assert check_vouch(stepped(past_cap, 1.0, False, False, {}), limits=limits) == (False, False)


# --- the hostile corpus ---------------------------------------------------------------------


def body_frame(
    obs: bytes, info: bytes = b"\x80", head=b"\x97\x01" + bytes([SEQ]), mid=b"\xcb" + bytes(8) + b"\xc2\xc2"
):
    body = head + obs + mid + info
    return wire.HEADER.pack(len(body)) + body


VALID = stepped({"t": 1}, 1.0, False, False, {})
HOSTILE = {
    "deep-600": body_frame(b"\x91" * 600 + b"\xc0"),
    "deep-tuples-40": body_frame(tuples(40)),
    "500k-empty-arrays": body_frame(b"\xdd" + struct.pack(">I", 500_000) + b"\x90" * 500_000),
    "str-past-cap": body_frame(b"\xdb" + struct.pack(">I", (4 << 20) + 1) + b"s" * ((4 << 20) + 1)),
    "array-past-cap": body_frame(b"\xdd" + struct.pack(">I", (1 << 20) + 1) + b"\xc0" * ((1 << 20) + 1)),
    "map-past-cap": body_frame(b"\xdf" + struct.pack(">I", (1 << 18) + 1) + b"\xc0" * (2 * (1 << 18) + 2)),
    "str-past-end": body_frame(b"\xdb\x00\x00\x10\x00abc"),
    "bin-past-end": body_frame(b"\xc6\xff\xff\xff\xffabc"),
    "array-past-end": body_frame(b"\xdd\xff\xff\xff\xff\xc0"),
    "map-past-end": body_frame(b"\xdf\xff\xff\xff\xff\xc0\xc0"),
    "ext-past-end": body_frame(b"\xc9\x7f\xff\xff\xff\x01abc"),
    "ext-no-type": body_frame(b"\xc7\x05"),
    "ext-no-length": body_frame(b"\xc8\x00"),
    "array-ext-1-byte": body_frame(ext(1, b"\x05")),
    "array-ext-header-past-payload": body_frame(ext(1, b"\x40\x00<f8:1")),
    "bad-dtype-kind": body_frame(array_ext("<x8:1", bytes(8))),
    "bad-dtype-size": body_frame(array_ext("<f3:1", bytes(3))),
    "bad-dtype-order": body_frame(array_ext("=f8:1", bytes(8))),
    "object-dtype": body_frame(array_ext("|O8:1", bytes(8))),
    "non-ascii-header": body_frame(array_ext("<f8:\xe91", bytes(8))),
    "33-dims": body_frame(array_ext("|u1:" + ",".join(["1"] * 33), b"\x00")),
    "20-digit-dim": body_frame(array_ext("|u1:00000000000000000001", b"\x00")),
    "empty-dim": body_frame(array_ext("|u1:1,", b"\x00")),
    "signed-dim": body_frame(array_ext("|u1:+1", b"\x00")),
    "overflow-shape": body_frame(array_ext("<f8:4294967296,4294967296", b"")),
    "zero-dim-huge-virtual": body_frame(array_ext("<f8:0,1099511627777", b"")),
    "uint64-wrap-shape": body_frame(array_ext("|u1:18446744073709551616", b"")),
    "nbytes-mismatch": body_frame(array_ext("<f8:2", bytes(15))),
    "scalar-with-shape": body_frame(array_ext("<f8:1", bytes(8), code=wire.SCALAR_EXT)),
    "unknown-ext": body_frame(ext(9, b"abc")),
    "timestamp-ext": body_frame(b"\xd6\xff" + bytes(4)),
    "tuple-not-array": body_frame(ext(wire.TUPLE_EXT, b"\xa1x")),
    "tuple-extra-bytes": body_frame(ext(wire.TUPLE_EXT, b"\x91\x01\x02")),
    "tuple-short": body_frame(ext(wire.TUPLE_EXT, b"\x92\x01")),
    "utf8-invalid": body_frame(b"\xa2\xc3\x28"),
    "utf8-surrogate": body_frame(b"\xa3\xed\xa0\x80"),
    "utf8-overlong": body_frame(b"\xa2\xc0\x80"),
    "utf8-past-max": body_frame(b"\xa4\xf4\x90\x80\x80"),
    "utf8-cut": body_frame(b"\xa2\xe2\x82"),
    "utf8-key": body_frame(b"\x80", info=b"\x81\xa1\xff\x01"),
    "array-key": body_frame(b"\x80", info=b"\x81\x91\x01\x01"),
    "map-key": body_frame(b"\x80", info=b"\x81\x80\x01"),
    "ext-key": body_frame(b"\x80", info=b"\x81" + ext(1, struct.pack("<H", 6) + b"|u1:1 " + b"\x00") + b"\x01"),
    "tuple-key": body_frame(b"\x80", info=b"\x81" + wire.pack((1, 2)) + b"\x01"),
    "tuple-array-key": body_frame(b"\x80", info=b"\x81" + wire.pack((1, np.zeros(2))) + b"\x01"),
    "scalar-key": body_frame(b"\x80", info=b"\x81" + wire.pack(np.float32(1)) + b"\x01"),
    "reserved-c1": body_frame(b"\xc1"),
    "wrong-seq": body_frame(b"\xc0", head=b"\x97\x01" + bytes([SEQ + 1])),
    "negative-seq": body_frame(b"\xc0", head=b"\x97\x01\xd0\xb3"),
    "wrong-code": body_frame(b"\xc0", head=b"\x97\x02" + bytes([SEQ])),
    "failed-code": wire.encode([wire.FAILED, SEQ, "step", "boom", "traceback"]),
    "too-few-items": body_frame(b"\xc0", head=b"\x96\x01" + bytes([SEQ]), mid=b"\xcb" + bytes(8) + b"\xc2"),
    "too-many-items": body_frame(b"\xc0", head=b"\x98\x01" + bytes([SEQ]), info=b"\x80\xc0"),
    "bool-reward": body_frame(b"\xc0", mid=b"\xc3\xc2\xc2"),
    "str-reward": body_frame(b"\xc0", mid=b"\xa1x\xc2\xc2"),
    "int-terminated": body_frame(b"\xc0", mid=b"\x01\x01\xc2"),
    "list-info": body_frame(b"\xc0", info=b"\x90"),
    "nil-info": body_frame(b"\xc0", info=b"\xc0"),
    "trailing-byte": body_frame(b"\xc0", info=b"\x80\xc0"),
    "two-frames": VALID + VALID,
    "frame-and-a-bit": VALID + b"\x01",
    "short-prefix": VALID[:3],
    "prefix-too-long": wire.HEADER.pack(len(VALID) - 3) + VALID[4:],
    "prefix-too-short": wire.HEADER.pack(len(VALID) - 5) + VALID[4:],
    "over-max-frame": body_frame(b"\xc6" + struct.pack(">I", 16 << 20) + bytes(16 << 20)),
    "not-an-array": wire.HEADER.pack(1) + b"\x01",
    "empty-body": wire.HEADER.pack(0),
}


# Python accepts these; C leaves them to it (C takes no ext as a key: a tuple of scalars and a
# numpy scalar are hashable keys, an array, or a tuple holding one, is refused by both).
CONSERVATIVE = {"tuple-key", "scalar-key", "timestamp-ext"}  # msgpack decodes ext -1 itself


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_the_hostile_corpus_is_never_vouched_for(name):
    assert check_vouch(HOSTILE[name]) == (False, name in CONSERVATIVE), name
    assert check_vouch(HOSTILE[name], reset=True)[0] is False


@pytest.mark.parametrize(
    "data",
    [
        body_frame(b"\xc0", head=b"\x97\x01\xcb" + struct.pack(">d", SEQ)),  # seq 77.0 == 77 for Python
        body_frame(b"\xc0", head=b"\xdc\x00\x07\x01" + bytes([SEQ])),  # the message as an array16
        body_frame(b"\xc0", head=b"\x97\xcc\x01\xcf" + struct.pack(">Q", SEQ)),  # code and seq in wide forms
    ],
    ids=["float-seq", "array16-message", "wide-ints"],
)
def test_odd_but_valid_forms_are_safe_either_way(data):
    check_vouch(data)  # C may leave these to Python; it must not vouch for anything Python refuses


# Byte runs that test the walker's UTF-8 check around its eight-bytes-at-a-time ASCII path: valid
# 2-, 3- and 4-byte forms and each kind Python's strict decoder refuses (a lone continuation byte,
# overlong forms, a surrogate, past U+10FFFF, a truncated sequence, bytes no UTF-8 holds).
UTF8_RUNS = [
    "é".encode(),
    "€".encode(),
    "𝄞".encode(),
    b"\x80",
    b"\xc0\xaf",
    b"\xe0\x80\xaf",
    b"\xed\xa0\x80",
    b"\xf4\x90\x80\x80",
    b"\xe2\x82",
    b"\xf8\x88\x80\x80\x80",
    b"\xff",
]


@pytest.mark.parametrize("run", UTF8_RUNS, ids=lambda run: run.hex())
def test_utf8_is_checked_as_python_checks_it_at_every_offset_around_the_ascii_words(run):
    """Text is mostly ASCII, which the walker checks eight bytes at a time: a multibyte form or a
    bad byte at any offset of a word, across two, at either end, after an ASCII run or none, is
    judged exactly as Python's decoder judges it."""
    for length in (0, 1, 7, 8, 9, 15, 16, 17, 24, 40):
        for at in range(length + 1):
            for tail in (b"", run):
                raw = b"a" * at + run + b"b" * (length - at) + tail
                verdict = check_vouch(body_frame(b"\xdb" + struct.pack(">I", len(raw)) + raw))
                assert verdict[0] == verdict[1], (raw, verdict)


def test_python_agrees_the_edge_forms_it_accepts_are_accepted():
    # Not everything odd is refused: C takes these as Python does.
    for data in (
        body_frame(b"\xc0", head=b"\xdc\x00\x07\x01" + bytes([SEQ])),
        body_frame(b"\xc0", head=b"\x97\xcc\x01\xcf" + struct.pack(">Q", SEQ)),
        body_frame(array_ext("<f8:0,3", b"")),
        body_frame(array_ext("<f08:1   ", bytes(8))),
        body_frame(b"\xa4\xf0\x9f\x98\x80"),
        body_frame(tuples(32)),
    ):
        assert check_vouch(data) == (True, True), data[:60]


# --- step(): the frames, over real sockets ----------------------------------------------------


@pytest.fixture
def channels():
    """framers.Lanes: socketpairs in an epoll set, driven by step()."""
    made = []

    def make(n):
        made.append(Lanes(n))
        return made[-1]

    yield make
    for c in made:
        c.close()


ACTIONS = [
    0,
    1,
    -1,
    2**64 - 1,
    -(2**63),
    1.5,
    None,
    True,
    "a",
    "é" * 40,
    b"\x00" * 300,
    [1, [2, [3]]],
    {"a": {"b": 1}},
    msgpack.ExtType(1, b"\x06\x00|u1:3" + b"\x01\x02\x03"),
    msgpack.ExtType(2, b"\x92\x01\x02"),
    list(range(70_000)),
    {str(i): i for i in range(20)},
]


@pytest.mark.parametrize("seq", [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1])
def test_step_writes_exactly_the_frames_wire_encode_writes(channels, seq):
    n = len(ACTIONS)
    ch = channels(n)
    resets = bytes(i % 5 == 4 for i in range(n))
    batch = ch.step(ACTIONS, seq=seq, resets=resets, timeout=0)
    assert batch.why == fp.TIMEOUT and batch.done == 0
    assert sorted(i for i, kind, _ in batch.rest) == list(range(n))
    for i, action in enumerate(ACTIONS):
        message = [wire.RESET, seq, None, None] if resets[i] else [wire.STEP, seq, action, False]
        body = WORKER_PACK.pack(message)
        want = wire.HEADER.pack(len(body)) + body
        env = ch.env(i)
        env.settimeout(2)
        got = b""
        while len(got) < len(want):
            got += env.recv(len(want) - len(got))
        assert got == want


def test_actions_it_cannot_split_write_nothing(channels):
    ch = channels(2)
    epfd, fds = ch.epoll.fileno(), ch.fds
    for packed in (
        WORKER_PACK.pack([1]),
        WORKER_PACK.pack([1, 2, 3]),
        WORKER_PACK.pack([1, 2]) + b"\x00",
        b"\x92\x01",
        b"\x92\xc1\x01",
        b"\xc0",
        b"",
        b"\xdd\xff\xff\xff\xff",
    ):
        assert fp.step(epfd, fds, fds, packed, 1, bytes(2), time.monotonic() + 1, caps(ENV), 1 << 30) is None
    for _, env in ch.pairs:
        env.setblocking(False)
        with pytest.raises(BlockingIOError):
            env.recv(1)


@pytest.mark.parametrize("ordered", [False, True], ids=["epoll", "ordered"])
def test_lanes_answer_done_or_handed_back_and_compose_matches_the_pure_reply(channels, ordered):
    n = 6
    ch = channels(n)
    replies = {
        0: stepped({"t": (1, 2)}, 0.25, False, True, {"x": np.float32(2)}),
        1: wire.encode([wire.RESET_DONE, SEQ, np.arange(3, dtype=np.int16), {"r": [1]}]),
        2: float32_reward([None, "ü"], 0.125, {b"k": 1.5}),
        3: stepped(1, 1, False, False, {}, seq=SEQ + 1),  # a stale seq: handed back
        4: b"\xc1garbage",
    }  # 5 sends nothing: pending
    for i, data in replies.items():
        ch.env(i).sendall(data)
    batch = ch.step([i for i in range(n)], resets=bytes([0, 1, 0, 0, 0, 0]), timeout=0.5, ordered=ordered)
    assert batch.why == fp.TIMEOUT and batch.done == 3
    assert batch.held == sum(len(replies[i]) for i in (0, 1, 2))
    rest = {i: (kind, value) for i, kind, value in batch.rest}
    assert rest == {3: (fp.UNUSUAL, replies[3]), 4: (fp.UNUSUAL, replies[4]), 5: (fp.PENDING, None)}
    overrides = {i: (wire.pack(None), 0.0, False, True, wire.pack({"error": f"lane {i}"})) for i in rest}
    got = client(batch.compose(overrides, wire.pack([5])))
    decoded = {i: python_reply(replies[i], i == 1, SEQ, ENV) for i in (0, 1, 2)}
    obs = [decoded[0][2], decoded[1][2], decoded[2][2], None, None, None]
    rewards = [0.25, 0.0, 0.125, 0.0, 0.0, 0.0]
    infos = [decoded[0][6], decoded[1][3], decoded[2][6]] + [{"error": f"lane {i}"} for i in (3, 4, 5)]
    want = client(
        wire.pack([obs, np.array(rewards).tobytes(), bytes([0, 0, 0, 0, 0, 0]), bytes([1, 0, 1, 1, 1, 1]), infos, [5]])
    )
    assert same(got, want)
    with pytest.raises(ValueError, match="lane 5"):
        batch.compose({3: overrides[3], 4: overrides[4]}, wire.pack([]))
    with pytest.raises(TypeError, match="lane 3"):
        batch.compose({**overrides, 3: ("not bytes", 0.0, False, False, b"\x80")}, wire.pack([]))


@pytest.mark.parametrize("ordered", [False, True], ids=["epoll", "ordered"])
def test_eof_short_write_and_budget_are_handed_back(channels, ordered):
    ch = channels(3)
    ch.env(0).close()
    ch.env(1).sendall(stepped(1, 1.0, False, False, {}))
    batch = ch.step([0, 1, 2], timeout=0.3, budget=0, ordered=ordered)  # lane 1's read passes a budget of 0
    rest = {i: kind for i, kind, _ in batch.rest}
    assert batch.done == 0 and rest[1] == fp.UNUSUAL and rest.get(0) in (fp.EOF, fp.PENDING)
    ch2 = channels(2)
    ch2.pairs[0][0].setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    big = b"x" * (1 << 22)
    batch = ch2.step([big, 1], timeout=1, ordered=ordered)
    assert batch.why == fp.SHORT_WRITE
    rest = {i: (kind, value) for i, kind, value in batch.rest}
    assert rest[0][0] == fp.SHORT_WRITE_KIND and big.endswith(rest[0][1][:-1]) and rest[1] == (fp.PENDING, None)


@pytest.mark.parametrize("ordered", [False, True], ids=["epoll", "ordered"])
def test_a_lane_read_once_then_ready_again_is_not_read_twice(channels, ordered):
    ch = channels(2)
    ch.env(0).sendall(stepped(1, 1.0, False, False, {}))
    ch.env(0).sendall(b"more")  # may land in the same read (then the read is not one frame) or stay queued
    batch = ch.step([0, 1], timeout=0.3, ordered=ordered)
    lanes = [i for i, _, _ in batch.rest]
    assert lanes.count(0) <= 1 and batch.done + len(lanes) == 2


def _answer_later(env, data: bytes, delay: float) -> threading.Thread:
    """A thread that sends `data` (a reply, or a part of one) on env after `delay` seconds."""

    def send():
        time.sleep(delay)
        env.sendall(data)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def test_ordered_reads_every_lane_whatever_order_they_answer_in(channels):
    # The lent step waits on the first lane still out alone: lanes that answer before it are
    # read once it has, in one step, whatever the order.
    ch = channels(3)
    reply = stepped(1, 1.0, False, False, {})
    ch.env(2).sendall(reply)
    threads = [_answer_later(ch.env(1), reply, 0.05), _answer_later(ch.env(0), reply, 0.2)]
    batch = ch.step([0, 1, 2], timeout=scaled(10.0), ordered=True)
    for thread in threads:
        thread.join()
    assert batch.why == fp.DONE and batch.done == 3 and not batch.rest


def test_ordered_takes_at_the_deadline_what_the_lanes_after_a_silent_one_sent(channels):
    # Lane 0 never answers; the step waits on it until the deadline, then looks once at every
    # lane: lane 1's reply, there since the start, is read, not taken for a straggler's.
    ch = channels(3)
    ch.env(1).sendall(stepped(1, 1.0, False, False, {}))
    batch = ch.step([0, 1, 2], timeout=0.3, ordered=True)
    rest = {i: kind for i, kind, _ in batch.rest}
    assert batch.why == fp.TIMEOUT and batch.done == 1 and rest == {0: fp.PENDING, 2: fp.PENDING}


def test_ordered_a_lane_trickling_its_frame_cannot_hold_the_step_past_its_deadline(channels):
    # Lane 0 sends the start of a frame, then the rest a byte at a time, never whole: every byte
    # wakes the wait on it, and still the step ends at its deadline, lane 0's part handed back.
    ch = channels(2)
    frame = stepped(list(range(2000)), 1.0, False, False, {})
    ch.env(1).sendall(stepped(1, 1.0, False, False, {}))
    stop = threading.Event()

    ch.env(0).sendall(frame[:100])  # its header and a first part: the rest is awaited, whole

    def trickle():
        for byte in frame[100:-1]:
            if stop.is_set():
                return
            try:
                ch.env(0).sendall(bytes([byte]))
            except OSError:
                return
            time.sleep(0.001)

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    started = time.monotonic()
    batch = ch.step([0, 1], timeout=0.5, ordered=True)
    took = time.monotonic() - started
    stop.set()
    thread.join()
    rest = {i: kind for i, kind, _ in batch.rest}
    assert batch.why == fp.TIMEOUT and batch.done == 1 and rest[0] in (fp.UNUSUAL, fp.PENDING)
    assert took < scaled(10.0)  # a hang, not a duration: the deadline held


# --- real pools: the native path against BOLTZLABS_PURE=1 ----------------------------------------


def run(pool_factory, monkeypatch, pure: bool, source, n, script, **kwargs):
    if pure:
        monkeypatch.setenv("BOLTZLABS_PURE", "1")
    else:
        monkeypatch.delenv("BOLTZLABS_PURE", raising=False)
    pool = pool_factory(source, n, **kwargs)
    assert pool.fast_path is not pure
    try:
        return script(pool)
    finally:
        pool.close()


def both(pool_factory, monkeypatch, source, n, script, **kwargs):
    native = run(pool_factory, monkeypatch, False, source, n, script, **kwargs)
    pure = run(pool_factory, monkeypatch, True, source, n, script, **kwargs)
    assert same(native, pure), (native, pure)
    return native


def steps(actions_of, count, resets_of=lambda t: None):
    def script(pool):
        out = [pool.reset(seed=list(range(pool.n)))]
        for t in range(count):
            r = pool.step_full(actions_of(t, pool.n), resets=resets_of(t))
            out.append((r.obs, r.rewards, r.terminated, r.truncated, r.infos))
        return out

    return script


def test_pools_agree_on_the_counter(pool_factory, monkeypatch):
    from tests.conftest import COUNTER

    out = both(
        pool_factory,
        monkeypatch,
        COUNTER,
        5,
        steps(lambda t, n: [t % 3] * n, 12, lambda t: [1, 3] if t % 4 == 3 else None),
    )
    assert out[-1][0][0] is not None


def test_pools_agree_on_typed_values(pool_factory, monkeypatch):
    from tests.conftest import TESTS

    both(
        pool_factory,
        monkeypatch,
        TESTS / "envs" / "typed_env",
        3,
        steps(lambda t, n: [t % 3] * n, 8, lambda t: [0] if t == 5 else None),
    )


def test_pools_agree_on_numpy_observations(pool_factory, monkeypatch, env_dir):
    source = env_dir("""
        import numpy as np
        from boltzlabs.env import serve

        def reset(seed):
            return np.zeros((2, 3), np.float32), {"seed": seed}

        def step(action):
            obs = np.arange(6, dtype=np.float32).reshape(2, 3) * action
            return obs, np.float32(action), action > 4, False, {"n": np.int64(action), "v": obs[0].astype(np.uint8)}

        serve(reset=reset, step=step)
    """)
    both(pool_factory, monkeypatch, source, 3, steps(lambda t, n: [t] * n, 6, lambda t: [2] if t == 3 else None))


def test_pools_agree_on_image_observations_bigger_than_a_read(pool_factory, monkeypatch, env_dir):
    """Atari-sized frames (100,800 bytes) and bigger: over C's 64 KiB read and
    the pipe's capacity, so each env writes its reply in parts and C hands
    the lane to Python after the first read; both paths give the same values."""
    source = env_dir("""
        import numpy as np
        from boltzlabs.env import serve

        frame = np.zeros((210, 160, 3), np.uint8)

        def reset(seed):
            frame[:] = seed % 251
            return frame, {}

        def step(action):
            frame[action % 210] = action % 256
            obs = frame if action % 3 else np.tile(frame, (3, 1, 1))
            return obs, float(action), False, action % 5 == 4, {"sum": int(frame.sum())}

        serve(reset=reset, step=step)
    """)
    out = both(pool_factory, monkeypatch, source, 3, steps(lambda t, n: [t + lane for lane in range(n)], 6))
    assert {obs.shape for obs in out[-1][0]} <= {(210, 160, 3), (630, 160, 3)}


def test_pools_agree_on_faults_lane_by_lane(pool_factory, monkeypatch):
    from tests.conftest import PROBE

    faults = [
        {"op": "raise"},
        {"op": "garbage", "fd": 3},
        {"op": "exit", "code": 3},
        {"op": "sleep", "s": 3},
        {"op": "bad_return"},
        2.5,
    ]

    def script(pool):
        out = [pool.reset(seed=list(range(pool.n)))]
        for t in range(3):
            actions = [1.5] * pool.n if t != 1 else faults
            r = pool.step_full(actions, resets=[3] if t == 2 else None)
            out.append(
                (
                    r.obs,
                    r.rewards,
                    r.terminated,
                    r.truncated,
                    [
                        {k: v for k, v in info.items() if k != "error"}
                        | ({"error": str(info["error"])[:60]} if "error" in info else {})
                        for info in r.infos
                    ],
                )
            )
        return out

    out = both(pool_factory, monkeypatch, PROBE, len(faults), script, step_timeout=1.0)
    failed = out[2]
    assert [bool(info.get("error")) for info in failed[4]] == [True, True, True, True, True, False]
    assert failed[4][3].get("straggler") is True and failed[1][5] == 2.5


def test_pools_agree_when_many_lanes_answer_at_staggered_times_and_one_hangs(pool_factory, monkeypatch, env_dir):
    """The native fan-in naps between its epoll waits while more than 8 lanes
    are out (fastpath.c nap()): replies that come while it naps are all read,
    in lane order, and a lane that hangs is a straggler at the deadline, as on
    the pure path. The time bound only catches a nap that overran the deadline."""
    source = env_dir("""
        import os, time
        from boltzlabs.env import serve

        def step(action):
            lane = int(os.environ["BOLTZLABS_ENV_INDEX"])  # set in each env, not in the template
            time.sleep(30 if action == "hang" else (lane % 7) * 0.002)
            return lane * 10 + action, float(lane), False, {"lane": lane}

        serve(reset=lambda seed: int(os.environ["BOLTZLABS_ENV_INDEX"]), step=step)
    """)
    n, timeout = 24, 1.5

    def script(pool):
        out = [pool.reset(seed=list(range(n)))]
        for t in range(4):
            actions = [t] * n if t != 2 else [t] * (n - 1) + ["hang"]
            started = time.monotonic()
            r = pool.step_full(actions, resets=[n - 1] if t == 3 else None)
            assert time.monotonic() - started < timeout + 5.0
            out.append(
                (
                    r.obs,
                    r.rewards,
                    r.terminated,
                    r.truncated,
                    [{k: v for k, v in info.items() if k != "error"} for info in r.infos],
                )
            )
        return out

    out = both(pool_factory, monkeypatch, source, n, script, step_timeout=timeout)
    assert out[1][0] == [lane * 10 for lane in range(n)]
    assert out[3][0][: n - 1] == [lane * 10 + 2 for lane in range(n - 1)]
    assert out[3][4][n - 1].get("straggler") is True


def test_a_lane_holding_part_of_a_frame_is_judged_as_the_pure_path_judges_it(pool_factory, monkeypatch, env_dir):
    """Two stray bytes after a reply (a frame's start) are held by the lane's
    reader while it is idle; the next reply completes a garbled frame on
    both paths: C, which reads only what comes now, must not vouch for it."""
    source = env_dir("""
        import os, threading, time
        from boltzlabs.env import serve

        def stray():
            time.sleep(0.2)
            os.write(3, b"\\x05\\x00")

        def reset(seed):
            return 0

        def step(action):
            if action == 1:
                threading.Thread(target=stray).start()
            return action, 1.0, False, {}

        serve(reset=reset, step=step)
    """)

    def script(pool):
        out = [pool.reset()]
        for action in ([0, 1], [0, 0], [0, 0]):
            r = pool.step_full(action)
            out.append((r.obs, r.rewards, r.truncated, [sorted(info) for info in r.infos]))
            time.sleep(0.5)
        return out

    out = both(pool_factory, monkeypatch, source, 2, script)
    assert out[2][2].tolist() == [False, True]  # lane 1's next reply completed the garbled frame


# --- observation slots (wire.SLOT_EXT) ---------------------------------------------------------


def _marker(seq: int):
    return msgpack.ExtType(wire.SLOT_EXT, seq.to_bytes(8, "little"))


def test_the_walker_vouches_for_a_slot_marker_only_as_the_obs():
    slots = wire.Limits(
        16 << 20, 4 << 20, 16 << 20, 1 << 20, 1 << 18, arrays="check", max_depth=512, max_objects=1 << 19
    )
    slots.slot_marks[0] = 0  # the pool has slots (worker/slots.py turns this on)
    honest = wire.encode([wire.STEPPED, SEQ, _marker(SEQ), 1.5, False, False, {"x": np.float32(1)}])
    got = fp.vouch(honest, False, SEQ, caps(slots))
    assert got is not None and got[0] == wire.pack(_marker(SEQ))
    assert python_reply(honest, False, SEQ, slots) is not None
    reset = wire.encode([wire.RESET_DONE, SEQ, _marker(SEQ), {}])
    assert fp.vouch(reset, True, SEQ, caps(slots)) is not None
    # Without slots, or naming another request: C does not vouch (Python kills the lane).
    assert fp.vouch(honest, False, SEQ, caps(ENV)) is None and python_reply(honest, False, SEQ, ENV) is None
    assert (
        fp.vouch(wire.encode([wire.STEPPED, SEQ, _marker(SEQ + 1), 1.5, False, False, {}]), False, SEQ, caps(slots))
        is None
    )
    # Anywhere but the obs: neither C nor Python accepts it.
    for message in (
        [wire.STEPPED, SEQ, np.zeros(2), 1.5, False, False, {"m": _marker(SEQ)}],
        [wire.STEPPED, SEQ, [_marker(SEQ)], 1.5, False, False, {}],
        [wire.STEPPED, SEQ, _marker(SEQ), 1.5, False, False, {"m": _marker(SEQ)}],
    ):
        frame = wire.encode(message)
        assert fp.vouch(frame, False, SEQ, caps(slots)) is None
        assert python_reply(frame, False, SEQ, slots) is None
    for cut in range(len(honest)):  # a marker cut short anywhere
        assert check_vouch(honest[:cut], limits=slots) == (False, False)


# --- a group's reply read whole (Batch.groups, GroupedPool._read_whole) ---------------------------
#
# C reads a group's reply straight into the trainer's arrays only when pool/groups.py's
# _stepped_whole would take it whole (and its obs is in the slot): then both give the same
# rewards, flags and infos. C may leave to Python what Python takes (an unusual but valid
# encoding); it never takes what Python refuses, nor reads it otherwise.

SLOTS = wire.Limits(16 << 20, 4 << 20, 16 << 20, 1 << 20, 1 << 18, arrays="check", max_depth=512, max_objects=1 << 19)
SLOTS.slot_marks[0] = 0  # the pool has slots (worker/slots.py turns this on)


def group_frame(kinds, rewards, terminated, truncated, infos, errors, obs=None) -> bytes:
    results = [kinds, rewards, terminated, truncated, infos, errors]
    obs = _marker(SEQ) if obs is None else obs
    return wire.encode([wire.STEPPED, SEQ, obs, 0.0, False, False, {"boltzlabs.group": results}])


def check_group(data: bytes, sent: list) -> tuple:
    """C reads it whole => Python's _stepped_whole takes it whole, with the same values.
    Returns (C's verdict, Python's)."""
    from boltzlabs.pool.groups import _ONE_VALUE, RESET, _infos_whole, _stepped_whole

    got = fp.group_reply(data, SEQ, caps(SLOTS), bytes(sent))
    want = python_reply(data, False, SEQ, SLOTS)
    undecodable = want is not None and not decodes(wire.pack(want[6]))
    if got is not None and got[3] is not None:  # the infos C spanned: decoded and checked as _read_whole does
        if undecodable:  # the decoded path's decode raises: reading the span in C raises the same
            assert not decodes(got[3]), data[:300]
            return True, True
        if not _infos_whole(wire.decode(_ONE_VALUE + got[3], CLIENT)[1], len(sent)):
            got = None
    whole = None
    if undecodable:
        # An info the worker passes and the client cannot decode (an array as a map key: the
        # note of issue 43 says so): what C leaves to Python raises there, as ever.
        assert got is None, data[:300]
        return False, False
    if want is not None:
        info = client(wire.pack(want[6]))  # as the client decodes it
        rows = np.zeros((len(sent), 1)) if type(want[2]) is msgpack.ExtType else client(wire.pack(want[2]))
        whole = _stepped_whole(rows, info, sent)
    if got is not None:
        assert whole is not None, f"C read a group reply whole that Python does not: {data[:300]!r}"
        assert type(want[2]) is msgpack.ExtType  # only a slot's obs
        _, rewards, terminated, truncated, _, _ = info["boltzlabs.group"]
        for j, kind in enumerate(sent):
            if kind == RESET:  # the trainer's own, whatever the group sent
                rewards[j], terminated[j], truncated[j] = 0.0, False, False
        c_rewards, c_terminated, c_truncated, span = got
        assert [struct.pack("<d", r) for r in c_rewards] == [struct.pack("<d", float(r)) for r in rewards] or any(
            math.isnan(r) for r in c_rewards
        )
        assert (c_terminated, c_truncated) == (terminated, truncated)
        if span is None:
            assert type(whole) is list and all(x in ({}, None) for x in whole), whole
        else:
            assert same(client(span), whole)
    return got is not None, whole is not None


def decodes(value: bytes) -> bool:
    """Whether the client decodes this msgpack value (wire.decode, as the trainer does)."""
    from boltzlabs.pool.groups import _ONE_VALUE

    try:
        wire.decode(_ONE_VALUE + value, CLIENT)
    except ProtocolError:
        return False
    return True


group_infos = st.one_of(
    st.just("empty"),
    st.just("none"),
    st.lists(st.one_of(st.none(), infos), min_size=1, max_size=3),  # cycled over the members
    st.dictionaries(st.text(max_size=4), st.sampled_from(["<f8", "<f4", "<i8", "|b1"]), min_size=1, max_size=3),
)


def _infos_for(kind, count: int):
    if kind == "empty":
        return [{} for _ in range(count)]
    if kind == "none":
        return [None] * count
    if type(kind) is list:
        return [kind[j % len(kind)] for j in range(count)]
    return {key: np.arange(count).astype(dtype) for key, dtype in kind.items()}  # info columns


@pytest.mark.timeout(900)
@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.lists(st.sampled_from([0, 1]), min_size=1, max_size=20),
    st.lists(rewards, min_size=1, max_size=3),
    st.lists(st.booleans(), min_size=2, max_size=2),
    group_infos,
)
def test_a_groups_plain_reply_is_read_whole_as_python_reads_it(sent, reward_cycle, flags, infos_kind):
    count = len(sent)
    data = group_frame(
        list(sent),
        [reward_cycle[j % len(reward_cycle)] for j in range(count)],
        [flags[0]] * count,
        [flags[1]] * count,
        _infos_for(infos_kind, count),
        [None] * count,
    )
    assert check_group(data, sent) == (True, True)  # what runtime/group.py sends: read whole in C


def _plain(count: int) -> dict:
    return dict(
        kinds=[0] * count,
        rewards=[1.5] * count,
        terminated=[False] * count,
        truncated=[False] * count,
        infos=[{}] * count,
        errors=[None] * count,
    )


@pytest.mark.parametrize(
    "change",
    [
        dict(kinds=[1, 0, 0]),  # answered as reset where it was stepped
        dict(kinds=[0, 0]),  # one member short
        dict(kinds=[0, 0, 0, 0]),
        dict(kinds=[0, 0, -1]),
        dict(kinds=[0, 0, 2]),
        dict(kinds=[0, 0, True]),
        dict(kinds=(0, 0, 0)),  # a tuple (its own ext), not a list
        dict(rewards=[1.5, True, 1.5]),  # a bool is not a number here
        dict(rewards=[1.5, None, 1.5]),
        dict(rewards=[1.5, "1", 1.5]),
        dict(rewards=[1.5, np.float32(1), 1.5]),  # a numpy scalar
        dict(rewards=[1.5, 1.5]),
        dict(terminated=[False, 0, False]),
        dict(truncated=[False, False, None]),
        dict(truncated=[False, False]),
        dict(infos=[{}, {}, []]),
        dict(infos=[{}, {}]),
        dict(infos={"x": np.zeros(2)}),  # columns of the wrong length
        dict(infos={"x": np.zeros((3, 1))}),
        dict(infos={"x": [1, 2, 3]}),
        dict(infos={}),
        dict(infos=7),
        dict(errors=[None, ["step", "ValueError: no", ""], None]),
        dict(errors=[None, None]),
        dict(errors=None),
        dict(obs=np.zeros((3, 2))),  # the obs by the wire, not in the slot: Python's
    ],
)
def test_a_group_reply_that_is_not_plain_is_left_to_python(change):
    fields = _plain(3)
    fields.update(change)
    obs = fields.pop("obs", None)
    data = group_frame(*fields.values(), obs=obs)
    c, python = check_group(data, [0, 0, 0])
    assert not c, change


def test_a_group_reply_wrapped_otherwise_is_left_to_python():
    plain = [[0], [1.5], [False], [False], [{}], [None]]
    for info in (
        {"boltzlabs.group": plain, "x": 1},  # a second key
        {b"boltzlabs.group": plain},  # the key as bytes
        {"boltzlabs.grouq": plain},
        {"boltzlabs.group": plain[:5]},
        {"boltzlabs.group": tuple(plain)},
    ):
        data = wire.encode([wire.STEPPED, SEQ, _marker(SEQ), 0.0, False, False, info])
        assert check_group(data, [0])[0] is False, info
    # A reply to another request, or a reset's: never read as this step's.
    data = wire.encode([wire.STEPPED, SEQ + 1, _marker(SEQ + 1), 0.0, False, False, {"boltzlabs.group": plain}])
    assert fp.group_reply(data, SEQ, caps(SLOTS), bytes(1)) is None
    reset = wire.encode([wire.RESET_DONE, SEQ, _marker(SEQ), {"boltzlabs.group": plain}])
    assert fp.group_reply(reset, SEQ, caps(SLOTS), bytes(1)) is None


@pytest.mark.timeout(900)
@settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.lists(st.sampled_from([0, 1]), min_size=1, max_size=18),
    group_infos,
    EDITS,
    st.booleans(),
)
def test_mutated_group_replies_are_read_whole_only_when_python_takes_them(sent, infos_kind, edits, fix_prefix):
    count = len(sent)
    frame = group_frame(
        list(sent), [0.5] * count, [False] * count, [True] * count, _infos_for(infos_kind, count), [None] * count
    )
    data = mutated(frame, edits, fix_prefix)
    if data:
        check_group(data, sent)
        check_group(data, [1 - kind for kind in sent])  # the same bytes against other kinds sent
