"""The wire format: length-prefixed msgpack frames and their hostile-input guards.

Pure unit tests of `boltzlabs.wire` (no pools, no sandboxes), property-based
where the input space is large: every message must survive any chunking of the
byte stream, and any byte string a peer can send must end in either messages
or `ProtocolError` -- never another exception, a hang, or an unbounded buffer.
"""

from __future__ import annotations

import ast
import collections
import contextlib
import enum
import itertools
import math
import signal
import struct
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from boltzlabs.errors import ProtocolError
from boltzlabs import wire
from framers import PATHS, make_reader

ROOT = Path(__file__).resolve().parent.parent

SETTINGS = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])

BIG = wire.Limits(1 << 22)


# --- helpers -----------------------------------------------------------------


def same(a, b) -> bool:
    """Exact structural equality: types must match (True is not 1, 1.0 is not 1),
    floats are compared bit for bit (nan == nan, -0.0 != 0.0), dict order counts."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return len(a) == len(b) and all(
            same(ka, kb) and same(va, vb) for (ka, va), (kb, vb) in zip(a.items(), b.items())
        )
    return a == b


def assert_same(got, want):
    assert same(got, want), f"\n got: {got!r}\nwant: {want!r}"


def split(data: bytes, cuts) -> list[bytes]:
    """`data` cut at the given offsets (any order, duplicates give empty chunks)."""
    points = [0, *sorted(cuts), len(data)]
    return [data[a:b] for a, b in zip(points, points[1:])]


def frame(body: bytes) -> bytes:
    return struct.pack("<I", len(body)) + body


@contextlib.contextmanager
def no_hang(seconds: float = 5.0):
    """Fail (instead of hanging the suite) if the block runs longer than `seconds`."""

    def expired(signum, frame_):
        raise AssertionError(f"hung for more than {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def as_buffer(kind: str, chunk: bytes):
    if kind == "bytearray":
        return bytearray(chunk)
    if kind == "memoryview":
        return memoryview(chunk)
    return chunk


# --- strategies ----------------------------------------------------------------

ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)
floats = st.floats(allow_nan=True, allow_infinity=True)  # includes nan, +-inf, -0.0, subnormals
scalars = st.none() | st.booleans() | ints | floats | st.text(max_size=40) | st.binary(max_size=64)
keys = st.none() | st.booleans() | ints | floats | st.text(max_size=8) | st.binary(max_size=8)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(keys, inner, max_size=5),
    max_leaves=12,
)
messages = st.builds(lambda code, rest: [code, *rest], ints, st.lists(values, max_size=4))
message_lists = st.lists(messages, max_size=6)
buffer_kinds = st.sampled_from(["bytes", "bytearray", "memoryview"])


# --- 1. round trip under arbitrary chunking --------------------------------------


@pytest.mark.parametrize("path", PATHS)
@SETTINGS
@given(msgs=message_lists, data=st.data())
def test_round_trip_any_chunking(path, msgs, data):
    frames = [wire.encode(m) for m in msgs]
    stream = b"".join(frames)
    ends = []  # offset just past each frame
    for f in frames:
        ends.append((ends[-1] if ends else 0) + len(f))
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=20), label="cuts")
    kind = data.draw(buffer_kinds, label="buffer")

    reader = make_reader(path, BIG)
    got = []
    fed = 0
    for chunk in split(stream, cuts):
        got.extend(reader.feed(as_buffer(kind, chunk)))
        fed += len(chunk)
        # Exactly the frames that ended by now are out; the rest is held back.
        complete = sum(1 for e in ends if e <= fed)
        assert len(got) == complete
        assert reader.pending == fed - (ends[complete - 1] if complete else 0)
    assert len(got) == len(msgs)
    for g, m in zip(got, msgs):
        assert_same(g, m)
    assert reader.pending == 0


@pytest.mark.parametrize("path", PATHS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(msgs=message_lists)
def test_round_trip_one_byte_at_a_time(path, msgs):
    stream = b"".join(wire.encode(m) for m in msgs)
    reader = make_reader(path, BIG)
    got = []
    for i in range(len(stream)):
        got.extend(reader.feed(stream[i : i + 1]))
    assert len(got) == len(msgs)
    for g, m in zip(got, msgs):
        assert_same(g, m)
    assert reader.pending == 0


@pytest.mark.parametrize("path", PATHS)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(msg=messages)
def test_round_trip_whole_frame_fast_path(path, msg):
    # One read carrying exactly one frame takes the no-buffering path.
    reader = make_reader(path, BIG)
    got = reader.feed(wire.encode(msg))
    assert len(got) == 1
    assert_same(got[0], msg)
    assert reader.pending == 0


def test_round_trip_special_values():
    msg = [
        wire.STEPPED,
        2**64 - 1,
        -(2**63),
        math.nan,
        math.inf,
        -math.inf,
        -0.0,
        0.0,
        "",
        "ünïcødé ☃",
        b"",
        b"\x00\xff",
        None,
        True,
        False,
        [],
        {},
        {None: 1, b"k": [1, {2: 3}]},
        {1.5: "float key", -1: "int key", True: "bool key"},
    ]
    reader = wire.FrameReader(BIG)
    (got,) = reader.feed(wire.encode(msg))
    assert_same(got, msg)
    assert reader.pending == 0


def test_empty_feeds_and_zero_length_tail():
    reader = wire.FrameReader(BIG)
    assert reader.feed(b"") == []
    assert reader.feed(b"\x02\x00") == []
    assert reader.pending == 2
    assert reader.feed(b"") == []
    assert reader.pending == 2
    assert reader.feed(b"\x00\x00\x91") == []
    assert reader.pending == 5
    assert reader.feed(b"\x01") == [[1]]
    assert reader.pending == 0


# --- 2. oversized length prefix ----------------------------------------------------


@pytest.mark.parametrize("length", [2**31, 2**32 - 1, 4097, 1 << 20])
def test_oversized_prefix_refused_on_header_alone(length):
    limits = wire.Limits(4096)
    reader = wire.FrameReader(limits)
    with pytest.raises(ProtocolError, match="over the cap"):
        reader.feed(struct.pack("<I", length))
    assert reader.pending == 4  # nothing of the body was awaited or allocated


def test_oversized_prefix_refused_byte_by_byte():
    reader = wire.FrameReader(wire.Limits(1000))
    header = struct.pack("<I", 2**31)
    for b in header[:3]:
        assert reader.feed(bytes([b])) == []
    with pytest.raises(ProtocolError):
        reader.feed(header[3:])
    assert reader.pending == 4


def test_oversized_prefix_after_valid_frame_in_same_read():
    reader = wire.FrameReader(wire.Limits(1000))
    with pytest.raises(ProtocolError):
        reader.feed(wire.encode([1, "ok"]) + struct.pack("<I", 1001))
    assert reader.pending <= len(wire.encode([1, "ok"])) + 4


def test_oversized_whole_frame_in_one_read_is_refused():
    # The fast path (read == exactly one frame) must check the cap too.
    limits = wire.Limits(64)
    msg = [1, "x" * 100]
    with pytest.raises(ProtocolError, match="over the cap"):
        wire.FrameReader(limits).feed(wire.encode(msg))


def test_cap_boundary_is_inclusive():
    body = msgpack.packb([1, b"x" * 50], use_bin_type=True)
    at_cap = wire.FrameReader(wire.Limits(len(body)))
    assert at_cap.feed(frame(body)) == [[1, b"x" * 50]]
    below = wire.FrameReader(wire.Limits(len(body) - 1))
    with pytest.raises(ProtocolError):
        below.feed(frame(body)[:4])
    # A frame exactly at the cap is awaited, not refused, when its body is late.
    waiting = wire.FrameReader(wire.Limits(len(body)))
    assert waiting.feed(frame(body)[:4]) == []
    assert waiting.pending == 4


@settings(max_examples=200, deadline=None)
@given(cap=st.integers(0, 1 << 16), excess=st.integers(1, 2**32 - 1), tail=st.binary(max_size=64))
def test_any_prefix_over_cap_refused_and_memory_bounded(cap, excess, tail):
    assume(cap + excess <= 2**32 - 1)
    reader = wire.FrameReader(wire.Limits(cap))
    with pytest.raises(ProtocolError):
        reader.feed(struct.pack("<I", cap + excess) + tail)
    assert reader.pending <= 4 + len(tail)


# --- 3. garbage ----------------------------------------------------------------------


def reference_parse(stream: bytes, limits: wire.Limits):
    """An independent model of the framing: (messages, error_trigger, consumed).

    `error_trigger` is the stream offset whose arrival must raise ProtocolError
    (the end of an over-cap header, or the end of a bad frame), or None;
    `consumed` is the offset just past the last good frame. Each message is
    paired with the offset just past its frame."""
    pos = 0
    out = []
    while len(stream) - pos >= 4:
        (length,) = struct.unpack_from("<I", stream, pos)
        if length > limits.max_frame:
            return out, pos + 4, pos
        if len(stream) - pos - 4 < length:
            break
        body = stream[pos + 4 : pos + 4 + length]
        try:
            value = msgpack.unpackb(body, **limits.kwargs)
        except Exception:
            return out, pos + 4 + length, pos
        if type(value) is not list or not value or type(value[0]) is not int:
            return out, pos + 4 + length, pos
        pos += 4 + length
        out.append((value, pos))
    return out, None, pos


def check_hostile(stream: bytes, cuts, limits: wire.Limits, path: str = "pure"):
    """Feed `stream` cut at `cuts` on `path` (framers.PATHS) and check the
    outcome exactly against the model: the same messages in order,
    ProtocolError from exactly the read that delivers the offending byte,
    never another exception, never a hang."""
    expected, trigger, consumed = reference_parse(stream, limits)
    reader = make_reader(path, limits)
    got = []
    fed = 0
    taken = 0  # bytes of whole frames handed out so far
    with no_hang():
        for chunk in split(stream, cuts):
            try:
                out = reader.feed(chunk)
            except ProtocolError:
                assert trigger is not None and fed < trigger <= fed + len(chunk), (fed, len(chunk), trigger)
                # Messages completed in earlier reads came out; the failing read's are dropped.
                want = [m for m, end in expected if end <= fed]
                assert len(got) == len(want)
                for g, m in zip(got, want):
                    assert_same(g, m)
                # The stream is dead now; all that matters is that nothing grew past what was fed.
                assert reader.pending <= fed + len(chunk) - taken
                return got
            fed += len(chunk)
            got.extend(out)
            taken = max([taken] + [end for _, end in expected[: len(got)]])
            assert reader.pending == fed - taken
    assert trigger is None, f"no ProtocolError, expected one at offset {trigger}"
    assert len(got) == len(expected)
    for g, (m, _) in zip(got, expected):
        assert_same(g, m)
    assert reader.pending == len(stream) - consumed
    return got


@pytest.mark.parametrize("path", PATHS)
@settings(max_examples=500, deadline=None)
@given(garbage=st.binary(max_size=2048), data=st.data())
def test_random_bytes_give_messages_or_protocol_error(path, garbage, data):
    cuts = data.draw(st.lists(st.integers(0, len(garbage)), max_size=10), label="cuts")
    check_hostile(garbage, cuts, wire.Limits(4096), path)


@pytest.mark.parametrize("path", PATHS)
@settings(max_examples=500, deadline=None)
@given(body=st.binary(max_size=512), extra=st.binary(max_size=16), data=st.data())
def test_valid_prefix_with_garbage_body(path, body, extra, data):
    # A correct length prefix around arbitrary bytes: the cap never fires, so
    # every failure here comes from msgpack decoding or the message-shape check.
    stream = frame(body) + extra
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=6), label="cuts")
    check_hostile(stream, cuts, wire.Limits(4096), path)


@pytest.mark.parametrize("path", PATHS)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(msgs=st.lists(messages, min_size=1, max_size=4), garbage=st.binary(min_size=1, max_size=256), data=st.data())
def test_valid_frames_then_garbage(path, msgs, garbage, data):
    frames = [wire.encode(m) for m in msgs]
    stream = b"".join(frames) + garbage
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=8), label="cuts")
    got = check_hostile(stream, cuts, wire.Limits(4096), path)
    for g, m in zip(got, msgs):  # the genuine messages come first, intact
        assert_same(g, m)


@pytest.mark.parametrize("path", PATHS)
def test_garbage_body_byte_by_byte(path):
    stream = frame(b"\x92\x01\xc1")
    check_hostile(stream, range(len(stream)), wire.Limits(4096), path)


@pytest.mark.parametrize(
    "body",
    [
        b"",  # zero-length frame
        b"\xc1",  # the never-used msgpack byte
        b"\x92\x01",  # array of 2 with 1 item: truncated
        b"\x91\x01\x02",  # trailing bytes after the value
        b"\x92\x01\xa3ab",  # str cut short
        b"\x92\x01\xa2\xff\xfe",  # str that is not UTF-8
        b"\x92\x01\x81\x91\x01\x02",  # map keyed by a list (unhashable)
        b"\x92\x01\xdb\xff\xff\xff\xff" + b"a" * 8,  # str32 claiming 4 GiB
        b"\x92\x01\xdd\xff\xff\xff\xff",  # array32 claiming 4 billion items
        b"\x92\x01\xdf\xff\xff\xff\xff",  # map32 claiming 4 billion pairs
        b"\x92\x01\xc6\xff\xff\xff\xff",  # bin32 claiming 4 GiB
        b"\x92\x01\xc9\xff\xff\xff\xff\x05",  # ext32 claiming 4 GiB
        b"\x92\x01\xd7\xff" + b"\xff" * 8,  # timestamp ext with out-of-range nanoseconds
    ],
)
@pytest.mark.parametrize("split_read", [False, True])
def test_malformed_bodies_raise_protocol_error(body, split_read):
    data = frame(body)
    reader = wire.FrameReader(wire.Limits(4096))
    with pytest.raises(ProtocolError, match="malformed frame|not a message|over its cap"):
        if split_read:
            reader.feed(data[:3])
            reader.feed(data[3:])
        else:
            reader.feed(data)


# --- 4. deep nesting ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        b"\x92\x01" + b"\x91" * 10_000 + b"\xc0",  # [1, [[[...[nil]...]]]]
        b"\x91" * 10_000 + b"\x01",  # nesting from the outermost array
        b"\x92\x01" + b"\x81\xc0" * 10_000 + b"\xc0",  # {nil: {nil: ...}}
        b"\x92\x01" + b"\x91\x81\xc0" * 5_000 + b"\xc0",  # alternating arrays and maps
        b"\x92\x01" + b"\xdd\x00\x00\x00\x01" * 10_000 + b"\xc0",  # array32 of one, 10_000 deep
    ],
    ids=["arrays", "outer-arrays", "maps", "mixed", "array32"],
)
@pytest.mark.parametrize("split_read", [False, True])
def test_deep_nesting_raises_protocol_error(body, split_read):
    data = frame(body)
    limits = wire.Limits(1 << 20)
    assert len(body) <= limits.max_frame
    reader = wire.FrameReader(limits)
    with pytest.raises(ProtocolError):
        if split_read:
            reader.feed(data[: len(data) // 2])
            reader.feed(data[len(data) // 2 :])
        else:
            reader.feed(data)


def test_moderate_nesting_still_decodes():
    nested = None
    for _ in range(200):
        nested = [nested]
    msg = [1, nested]
    (got,) = wire.FrameReader(BIG).feed(wire.encode(msg))
    assert got == msg


def test_encoding_deep_nesting_raises_value_error():
    nested = []
    for _ in range(10_000):
        nested = [nested]
    with pytest.raises(ValueError):
        wire.encode([1, nested])


# --- 5. valid msgpack that is not a message -------------------------------------------------


NOT_MESSAGES = [
    {1: 2},
    {"code": 1},
    7,
    None,
    "hello",
    b"bytes",
    1.5,
    True,
    [],
    ["1", 2],
    [None, 1],
    [True, 1],  # bool is not an int code
    [False],
    [1.0, 2],
    [[1], 2],
    [{1: 2}],
    [b"\x01"],
]


@pytest.mark.parametrize("value", NOT_MESSAGES, ids=repr)
@pytest.mark.parametrize("split_read", [False, True])
def test_non_message_bodies_raise_protocol_error(value, split_read):
    data = wire.encode(value)  # encode() frames anything; the reader must refuse it
    reader = wire.FrameReader(wire.Limits(4096))
    with pytest.raises(ProtocolError, match="not a message"):
        if split_read:
            reader.feed(data[:2])
            reader.feed(data[2:])
        else:
            reader.feed(data)


def test_non_message_after_good_frame_in_one_read():
    reader = wire.FrameReader(wire.Limits(4096))
    with pytest.raises(ProtocolError, match="not a message"):
        reader.feed(wire.encode([1, "fine"]) + wire.encode({"not": "a message"}))


def test_int_code_extremes_are_messages():
    reader = wire.FrameReader(wire.Limits(4096))
    assert reader.feed(wire.encode([2**64 - 1]) + wire.encode([-(2**63)]) + wire.encode([0])) == [
        [2**64 - 1],
        [-(2**63)],
        [0],
    ]


# --- 6. decode limits inside the frame cap ----------------------------------------------------


def test_str_over_max_str_len_raises():
    limits = wire.Limits(4096, max_str_len=16)
    assert wire.FrameReader(limits).feed(wire.encode([1, "a" * 16])) == [[1, "a" * 16]]
    with pytest.raises(ProtocolError):
        wire.FrameReader(limits).feed(wire.encode([1, "a" * 17]))
    # The limit counts encoded bytes: 9 two-byte characters are 18 bytes.
    with pytest.raises(ProtocolError):
        wire.FrameReader(limits).feed(wire.encode([1, "é" * 9]))
    assert wire.FrameReader(limits).feed(wire.encode([1, "é" * 8])) == [[1, "é" * 8]]


@pytest.mark.parametrize(
    "field, ok, too_long",
    [
        ("max_str_len", "s" * 10, "s" * 11),
        ("max_bin_len", b"b" * 10, b"b" * 11),
        ("max_array_len", list(range(10)), list(range(11))),
        ("max_map_len", {i: i for i in range(10)}, {i: i for i in range(11)}),
    ],
)
def test_each_length_limit(field, ok, too_long):
    limits = wire.Limits(4096, **{field: 10})
    assert limits.kwargs[field] == 10
    assert wire.FrameReader(limits).feed(wire.encode([1, ok])) == [[1, ok]]
    data = wire.encode([1, too_long])
    assert len(data) - 4 <= limits.max_frame  # within the frame cap: the msgpack limit is what fires
    with pytest.raises(ProtocolError):
        wire.FrameReader(limits).feed(data)


def test_limits_are_clamped_to_the_frame_cap():
    limits = wire.Limits(100, max_str_len=10**9, max_bin_len=10**9, max_array_len=10**9, max_map_len=10**9)
    for key in ("max_str_len", "max_bin_len", "max_array_len", "max_map_len", "max_ext_len"):
        assert limits.kwargs[key] == 100
    defaults = wire.Limits(100)
    for key in ("max_str_len", "max_bin_len", "max_array_len", "max_map_len", "max_ext_len"):
        assert defaults.kwargs[key] == 100


@settings(max_examples=200, deadline=None)
@given(limit=st.integers(1, 300), length=st.integers(0, 600))
def test_str_limit_property(limit, length):
    limits = wire.Limits(4096, max_str_len=limit)
    msg = [wire.STEP, "z" * length]
    reader = wire.FrameReader(limits)
    if length <= limit:
        assert reader.feed(wire.encode(msg)) == [msg]
    else:
        with pytest.raises(ProtocolError):
            reader.feed(wire.encode(msg))


# --- 7. independent readers ---------------------------------------------------------------------


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(a_msgs=message_lists, b_msgs=message_lists, data=st.data())
def test_interleaved_readers_never_mix(a_msgs, b_msgs, data):
    # Tag every message with its stream so a leak between readers cannot go unseen.
    a_msgs = [[1, "a", *m] for m in a_msgs]
    b_msgs = [[2, "b", *m] for m in b_msgs]
    a_stream = b"".join(wire.encode(m) for m in a_msgs)
    b_stream = b"".join(wire.encode(m) for m in b_msgs)
    a_chunks = split(a_stream, data.draw(st.lists(st.integers(0, len(a_stream)), max_size=12), label="a cuts"))
    b_chunks = split(b_stream, data.draw(st.lists(st.integers(0, len(b_stream)), max_size=12), label="b cuts"))
    order = data.draw(st.permutations(["a"] * len(a_chunks) + ["b"] * len(b_chunks)), label="order")

    readers = {"a": wire.FrameReader(BIG), "b": wire.FrameReader(BIG)}
    chunks = {"a": iter(a_chunks), "b": iter(b_chunks)}
    got = {"a": [], "b": []}
    for who in order:
        got[who].extend(readers[who].feed(next(chunks[who])))

    assert len(got["a"]) == len(a_msgs) and len(got["b"]) == len(b_msgs)
    for g, m in zip(got["a"], a_msgs):
        assert_same(g, m)
    for g, m in zip(got["b"], b_msgs):
        assert_same(g, m)
    assert readers["a"].pending == 0 and readers["b"].pending == 0


def test_error_in_one_reader_does_not_touch_another():
    good, bad = wire.FrameReader(BIG), wire.FrameReader(wire.Limits(16))
    stream = wire.encode([1, "x" * 40])
    assert good.feed(stream[:10]) == []
    with pytest.raises(ProtocolError):
        bad.feed(stream[:10])
    assert good.feed(stream[10:]) == [[1, "x" * 40]]
    assert good.pending == 0


# --- 8. encode() ----------------------------------------------------------------------------------


class _Unpackable:
    pass


class _FakeTolist:
    """Has tolist() but is not numpy: must not be converted."""

    def tolist(self):
        return [1, 2, 3]


@pytest.mark.parametrize(
    "value",
    [object(), _Unpackable(), _FakeTolist(), {1, 2}, frozenset(), 1j, lambda: 0, range(3), 2**64, -(2**63) - 1],
    ids=["object", "class", "fake-tolist", "set", "frozenset", "complex", "lambda", "range", "2**64", "-2**63-1"],
)
def test_encode_unserializable_raises_type_error(value):
    with pytest.raises(TypeError):
        wire.encode(value)
    with pytest.raises(TypeError):
        wire.encode([wire.STEP, 0, {"nested": [value]}, False])


def test_encode_frame_layout():
    data = wire.encode([wire.HELLO, 1, {}])
    body = msgpack.packb([0, 1, {}], use_bin_type=True)
    assert data == struct.pack("<I", len(body)) + body
    assert data == b"\x04\x00\x00\x00\x93\x00\x01\x80"
    # bytes travel as msgpack bin, str as str
    assert wire.encode([1, b"x"])[4:] == b"\x92\x01\xc4\x01x"
    assert wire.encode([1, "x"])[4:] == b"\x92\x01\xa1x"


@pytest.mark.parametrize(
    "value",
    [
        np.int64(-7),
        np.uint64(2**64 - 1),
        np.int8(5),
        np.int32(-3),
        np.float32(0.1),
        np.float64(2.0),
        np.float16(1.5),
        np.bool_(True),
        np.complex64(1 + 2j),
        np.float32(np.nan),
    ],
    ids=repr,
)
def test_numpy_scalars_keep_their_type_and_dtype(value):
    # Issue 17, point 4: an env's np.float32 info must batch as float32, not float64.
    msg = [wire.STEPPED, 0, value, {"obs": value, "in a list": [value], "in a tuple": (value,)}]
    (got,) = wire.FrameReader(BIG).feed(wire.encode(msg))
    for item in (got[2], got[3]["obs"], got[3]["in a list"][0], got[3]["in a tuple"][0]):
        assert type(item) is type(value) and item.dtype == value.dtype
        assert item == value or (np.isnan(item) and np.isnan(value))


@pytest.mark.parametrize(
    "value, plain",
    [
        (np.str_("hi"), "hi"),
        # arrays of dtypes the array extension does not carry fall back to lists
        (np.array(["a", "bc"]), ["a", "bc"]),
        (np.array([1, "x", None], dtype=object), [1, "x", None]),
    ],
    ids=repr,
)
def test_other_numpy_values_encode_as_plain_values(value, plain):
    msg = [wire.STEPPED, 0, value, {"obs": value}]
    want = [wire.STEPPED, 0, plain, {"obs": plain}]
    data = wire.encode(msg)
    assert data == wire.encode(want)  # byte-identical to the plain-Python message
    (got,) = wire.FrameReader(BIG).feed(data)
    assert_same(got, want)


class _Color(enum.IntEnum):
    RED = 3


_Point = collections.namedtuple("_Point", "x y")


def test_tuples_stay_tuples_and_subclasses_travel_as_their_base():
    msg = [
        wire.STEPPED,
        (),
        (1, (2, [3, (4,)])),
        {"key": (22, 7, 0)},
        {(1, 2): "tuple key"},
        _Point(1, 2),
        _Color.RED,
        collections.OrderedDict(a=1),
        [(), [()]],
    ]
    want = [
        wire.STEPPED,
        (),
        (1, (2, [3, (4,)])),
        {"key": (22, 7, 0)},
        {(1, 2): "tuple key"},
        (1, 2),
        3,
        {"a": 1},
        [(), [()]],
    ]
    for limits in (BIG, GUARDED):
        for data in (wire.encode(msg), wire.encode(msg + ["x" * 100])):  # short and guarded decodes
            (got,) = wire.FrameReader(limits).feed(data)
            assert got[: len(want)] == want
            assert [type(x) for x in got[: len(want)]] == [type(x) for x in want]
            assert type(got[2][1][1][1]) is tuple and type(got[3]["key"]) is tuple


def test_the_worker_passes_tuples_and_scalars_on_unchanged():
    # The worker ("check") keeps scalars as checked ExtTypes and decodes tuples
    # under its caps; what it re-encodes decodes, client side, to the env's values.
    msg = [wire.STEPPED, 0, ((np.float32(1.5), np.arange(3, dtype=np.int16)),), {"x": np.int32(7)}, "y" * 100]
    (checked,) = wire.FrameReader(GUARDED).feed(wire.encode(msg))
    assert isinstance(checked[3]["x"], msgpack.ExtType) and type(checked[2]) is tuple
    (got,) = wire.FrameReader(BIG).feed(wire.encode(checked))
    assert type(got[2][0][0]) is np.float32 and got[2][0][1].dtype == np.int16 and type(got[3]["x"]) is np.int32


@pytest.mark.parametrize("depth", [33, 100, 400])
def test_tuples_nested_past_the_cap_are_refused_both_ways(depth):
    value = ()
    for _ in range(depth):
        value = (value,)
    with pytest.raises(ValueError, match="tuples nested more than 32 deep"):
        wire.encode([1, value])
    body = b""  # the same, hand-packed, as a hostile peer would send it
    inner = msgpack.packb([])
    for _ in range(depth):
        inner = msgpack.packb([msgpack.ExtType(wire.TUPLE_EXT, inner)])
    body = b"\x92\x01" + inner
    for limits in (BIG, GUARDED):
        with pytest.raises(ProtocolError, match="tuples nested more than 32 deep"):
            wire.FrameReader(limits).feed(frame(body))
    ok = ()  # 32 tuples, the innermost empty
    for _ in range(31):
        ok = (ok,)
    assert wire.FrameReader(GUARDED).feed(wire.encode([1, ok])) == [[1, ok]]


def test_tuple_items_count_toward_the_frame_caps():
    wide = [1, tuple(range(20_000))]
    with pytest.raises(ProtocolError, match="more than 10000 objects"):
        wire.FrameReader(GUARDED).feed(wire.encode(wide))
    deep_value = None
    for k in range(70):  # lists and tuples: 70 levels, 24 of them tuples
        deep_value = [deep_value] if k % 3 else (deep_value,)
    with pytest.raises(ProtocolError, match="nested deeper than 64"):
        wire.FrameReader(GUARDED).feed(wire.encode([1, deep_value, "z" * 100]))


@pytest.mark.parametrize(
    "payload, match",
    [
        (b"\x0e\x00<f4:1         \x00\x00\x00?", "shape"),  # a 1-element array, not a scalar
        (b"\x0e\x00<f4:          \x00\x00", "does not match"),  # 2 bytes for a float32
        (b"\x0e\x00<O8:          \x00" + b"\x00" * 7, "unsupported dtype"),  # an object pointer
        (b"\x01", "shorter than its header"),
    ],
    ids=["array-shape", "short", "object-dtype", "truncated"],
)
def test_bogus_scalar_ext_is_refused(payload, match):
    body = b"\x92\x01" + msgpack.packb(msgpack.ExtType(wire.SCALAR_EXT, payload))
    for limits in (BIG, GUARDED):
        with pytest.raises(ProtocolError, match=match):
            wire.FrameReader(limits).feed(frame(body))


def test_a_tuple_ext_that_is_not_an_array_is_refused():
    body = b"\x92\x01" + msgpack.packb(msgpack.ExtType(wire.TUPLE_EXT, msgpack.packb({"a": 1})))
    with pytest.raises(ProtocolError, match="tuple ext does not hold an array"):
        wire.FrameReader(GUARDED).feed(frame(body))
    body = b"\x92\x01" + msgpack.packb(msgpack.ExtType(wire.TUPLE_EXT, msgpack.packb([1]) + b"\x01"))
    with pytest.raises(ProtocolError, match="malformed frame"):
        wire.FrameReader(GUARDED).feed(frame(body))


@pytest.mark.parametrize("module", ["boltzlabs.env", "boltzlabs.wire"])
def test_env_side_does_not_import_numpy(module):
    code = f"import {module}, sys; print('numpy' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_encode_numpy_without_numpy_imported_by_wire():
    # Encoding plain values in a fresh interpreter must not pull numpy in either.
    code = (
        "import sys; from boltzlabs import wire; "
        "r = wire.FrameReader(wire.Limits(1 << 20)); "
        "assert r.feed(wire.encode([1, 2.5, 'x', b'y', [None], {1: 2}])) == [[1, 2.5, 'x', b'y', [None], {1: 2}]]; "
        "print('numpy' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_a_caught_protocol_error_pins_no_buffer():
    # The error's traceback must not hold a view of the reader's or the
    # caller's buffer: either would stop that buffer from being resized.
    reader = wire.FrameReader(wire.Limits(100))
    with pytest.raises(ProtocolError) as first:
        reader.feed(wire.encode([1]) + wire.encode({1: 2}))
    with pytest.raises(ProtocolError):
        reader.feed(b"\x00")  # not a BufferError
    buf = bytearray(wire.encode({1: 2}))
    with pytest.raises(ProtocolError) as second:
        wire.FrameReader(wire.Limits(100)).feed(buf)
    buf.clear()
    assert first.value is not None and second.value is not None


# --- objects and depth per frame (issue 13, points 2 and 4) ---------------------------------------

GUARDED = wire.Limits(1 << 24, max_array_len=1 << 20, arrays="check", max_depth=64, max_objects=10_000)


def nested(depth):
    value = None
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("depth", [65, 200, 1000])
def test_depth_over_the_cap_is_refused(depth):
    with pytest.raises(ProtocolError, match="nested deeper than 64 levels"):
        wire.FrameReader(GUARDED).feed(wire.encode([1, nested(depth)]))


def test_depth_at_the_cap_decodes_and_wide_frames_are_not_deep():
    msg = [1, nested(63)]  # the message is level 1: 64 levels of lists
    assert wire.FrameReader(GUARDED).feed(wire.encode(msg)) == [msg]
    wide = [1, [[i] for i in range(3000)]]  # many containers, shallow: measured, accepted
    assert wire.FrameReader(GUARDED).feed(wire.encode(wide)) == [wide]


@pytest.mark.parametrize(
    "body",
    [
        b"\x92\x01\xdd\x00\x01\x00\x00" + b"\x90" * 65536,  # [1, [[], [], ...]]: 65,536 empty lists
        b"\x92\x01\xdd\x00\x01\x00\x00" + b"\xa2ab" * 65536,  # [1, ["ab", ...]]: items count too
        b"\x92\x01\xdf\x00\x00\x80\x00" + b"\x01\x80" * 32768,  # [1, {1: {}, ...}]
    ],
    ids=["empty-lists", "strings", "maps"],
)
def test_more_objects_than_the_cap_are_refused(body):
    with pytest.raises(ProtocolError, match="more than 10000 objects"):
        wire.FrameReader(GUARDED).feed(frame(body))
    # The same reader goes on with the next peer's frame (its count restarts).
    assert wire.FrameReader(GUARDED).feed(wire.encode([1, list(range(100))])) == [[1, list(range(100))]]


def test_limits_without_object_cap_keep_the_plain_decode():
    assert wire.Limits(1 << 20).guarded is None
    assert GUARDED.guarded is not None and GUARDED.max_depth == 64


@pytest.mark.parametrize(
    "shape", [(0, 2**62), (2**62, 0), (0, 2**63 - 1, 2**63 - 1), (2**31, 2**31, 0, 2**31), (0,) * 33, (1 << 41, 0)]
)
def test_array_headers_with_impossible_shapes_are_refused(shape):
    text = ("<f8:" + ",".join(map(str, shape))).encode()
    pad = -(2 + len(text)) % 16
    payload = struct.pack("<H", len(text) + pad) + text + b" " * pad
    with pytest.raises(ValueError, match="array ext"):
        wire.check_array_header(payload)


def test_empty_arrays_with_sane_shapes_still_pass():
    for shape in [(0,), (0, 3), (5, 0, 7), (0,) * 32]:
        text = ("<f8:" + ",".join(map(str, shape))).encode()
        pad = -(2 + len(text)) % 16
        payload = struct.pack("<H", len(text) + pad) + text + b" " * pad
        assert wire.check_array_header(payload)[1] == shape


# --- FrameReader(allocate=): a long frame read in place (the client's REPLY) ------------------


def _read_in_place(reader, stream: bytes, cuts) -> list:
    """Drive `reader` as the client does: recv_into room() while there is one, else
    feed a piece; pieces of the sizes in `cuts`, then whatever is left at once."""
    messages, at = [], 0
    sizes = itertools.chain(cuts, itertools.repeat(len(stream)))
    while at < len(stream):
        size = next(sizes)
        room = reader.room()
        if room is None:
            messages += reader.feed(stream[at : at + size])
            at += size
        else:
            n = min(size, len(room), len(stream) - at)
            room[:n] = stream[at : at + n]
            room.release()
            messages += reader.filled(n)
            at += n
    return messages


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(
        st.sampled_from([10, 5_000, wire.FrameReader.DIRECT_MIN - 5, wire.FrameReader.DIRECT_MIN, 600_000]),
        min_size=1,
        max_size=5,
    ),
    cuts=st.lists(st.integers(1, 300_000), max_size=40),
    numpy_buffers=st.booleans(),
)
def test_long_frames_read_in_place_give_the_same_messages(sizes, cuts, numpy_buffers):
    messages = [[wire.STEPPED, i, bytes([i]) * size, 0.5, False, False, {}] for i, size in enumerate(sizes)]
    stream = b"".join(wire.encode(m) for m in messages)
    allocate = (lambda n: np.empty(n, np.uint8)) if numpy_buffers else bytearray
    reader = wire.FrameReader(wire.Limits(1 << 22), allocate=allocate)
    got = _read_in_place(reader, stream, cuts)
    assert got == messages and reader.pending == 0 and reader.room() is None


def test_a_long_frame_can_be_finished_by_feed_and_what_follows_is_parsed():
    limits = wire.Limits(1 << 22)
    big = [wire.STEPPED, 1, b"x" * 400_000, 0.0, False, False, {}]
    small = [wire.STEPPED, 2, b"y", 0.0, False, False, {}]
    stream = wire.encode(big) + wire.encode(small)
    reader = wire.FrameReader(limits, allocate=bytearray)
    assert reader.feed(stream[:1000]) == [] and reader.room() is not None and reader.pending == 1000
    assert reader.feed(stream[1000:]) == [big, small] and reader.pending == 0


def test_a_prefix_over_the_cap_is_refused_before_anything_is_allocated():
    allocated = []
    reader = wire.FrameReader(wire.Limits(1 << 20), allocate=lambda n: allocated.append(n) or bytearray(n))
    with pytest.raises(ProtocolError, match="over the cap"):
        reader.feed(struct.pack("<I", (1 << 20) + 1) + b"\x97")
    assert allocated == []


def _message_codes(tree) -> dict[str, int]:
    """wire.py's message table: the module-level int constants from HELLO to PROBED, in source order."""
    codes: dict[str, int] = {}
    inside = False
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            inside = inside or name == "HELLO"
            if inside and isinstance(node.value, ast.Constant) and isinstance(node.value.value, int):
                codes[name] = node.value.value
            if name == "PROBED":
                break
    return codes


def test_every_message_code_is_in_one_table_once():
    """Every hop (env, client, remote handshake, template control, probe) shares one code space: a frame
    sent on the wrong channel is refused as an unknown code, never read as another message."""
    root = Path(wire.__file__).resolve().parent
    codes = _message_codes(ast.parse((root / "wire.py").read_text()))
    assert {"HELLO", "STEP", "OPEN", "ERROR", "CHALLENGE", "ACCEPTED", "FORK", "WARMED", "PROBED"} <= set(codes)
    by_value = collections.defaultdict(list)
    for name, value in codes.items():
        by_value[value].append(name)
        assert getattr(wire, name) == value
    assert not {v: n for v, n in by_value.items() if len(n) > 1}, "message codes used twice"
    # No other module defines a code of its own under one of the table's names.
    elsewhere = [
        f"{path.relative_to(root.parent)}:{node.lineno}: {target.id}"
        for path in sorted(root.rglob("*.py"))
        if path.name != "wire.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, int)
        for target in node.targets
        if isinstance(target, ast.Name) and target.id in codes
    ]
    assert not elsewhere, elsewhere


def test_the_table_check_catches_a_repeated_code():
    tree = ast.parse("HELLO = 0\nSTEP = 10\nFORK = 10\nPROBED = 46\nLATER = 0\n")
    codes = _message_codes(tree)
    assert codes == {"HELLO": 0, "STEP": 10, "FORK": 10, "PROBED": 46}
    assert len(set(codes.values())) < len(codes)
