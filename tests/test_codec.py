"""boltzlabs._wire (native/wire.c) against wire.py's Python codec, which it must equal.

The encoder must make the very bytes the Python packer makes, or decline
(None: Python packs the value); the ext hook must return what the Python
hook returns, and hand every header it does not accept, and every other
ext, to the Python hook (whose caps and error messages stay the rule).
Pure unit tests, no pools: ci/asan.sh runs this file under ASan and UBSan.
"""

from __future__ import annotations

import collections
import enum
import struct

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from boltzlabs import wire
from boltzlabs.errors import ProtocolError

native = pytest.importorskip("boltzlabs._wire")

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NUMERIC = [
    "?",
    "i1",
    "u1",
    "<i2",
    "<u2",
    "<i4",
    "<u4",
    "<i8",
    "<u8",
    "<f2",
    "<f4",
    "<f8",
    "<f16",
    "<c8",
    "<c16",
    "<c32",
    ">i2",
    ">u4",
    ">i8",
    ">f4",
    ">f8",
    ">c16",
    "intc",
    "longlong",
    "ulonglong",
]


def python_frame(value) -> bytes:
    body = wire._packer.pack(value)
    return wire.HEADER.pack(len(body)) + body


def python_hook(check: bool):
    native_, wire._native = wire._native, None
    try:
        return wire._ext_hook("check" if check else "decode", [wire.Limits(1 << 30).kwargs], [-1])
    finally:
        wire._native = native_


def same(a, b) -> bool:
    """Equal values of equal types: arrays by dtype, shape, bytes and writability."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return (
            a.dtype == b.dtype
            and a.dtype.str == b.dtype.str
            and a.shape == b.shape
            and a.tobytes() == b.tobytes()
            and a.flags.writeable == b.flags.writeable
        )
    if isinstance(a, np.generic):
        return a.dtype.str == b.dtype.str and a.tobytes() == b.tobytes()
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return len(a) == len(b) and all(same(k, j) and same(v, w) for (k, v), (j, w) in zip(a.items(), b.items()))
    return a == b


def arrays(draw_shape=st.lists(st.integers(0, 4), max_size=4)):
    return st.builds(
        lambda dtype, shape, seed, transpose: _array(dtype, shape, seed, transpose),
        st.sampled_from(NUMERIC),
        draw_shape,
        st.integers(0, 2**32 - 1),
        st.booleans(),
    )


def _array(dtype, shape, seed, transpose):
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8).tobytes()
    array = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    return array.T if transpose else array  # transposed: not C-contiguous


scalars = st.builds(
    lambda dtype, seed: _array(dtype, (), seed, False)[()], st.sampled_from(NUMERIC), st.integers(0, 2**32 - 1)
)
leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**64), 2**64),
    st.floats(allow_nan=True),
    st.text(max_size=40),
    st.binary(max_size=300),
    st.binary(max_size=3).map(bytearray),
    arrays(),
    scalars,
)
values = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=20),
        st.lists(inner, max_size=5).map(tuple),
        st.dictionaries(st.one_of(st.text(max_size=8), st.integers(-5, 5)), inner, max_size=6),
    ),
    max_leaves=40,
)


@SETTINGS
@given(value=values)
def test_the_encoder_makes_the_python_packers_bytes_or_declines(value):
    try:
        want = python_frame(value)
    except (TypeError, ValueError, OverflowError):
        want = None
    got = native.frame(value)
    if got is not None:
        assert got == want
        assert native.pack(value) == want[4:]


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        0,
        -1,
        127,
        128,
        -32,
        -33,
        255,
        256,
        65535,
        65536,
        2**32 - 1,
        2**32,
        2**63 - 1,
        2**63,
        2**64 - 1,
        -(2**63),
        -129,
        -32769,
        -(2**31) - 1,
        1.5,
        float("nan"),
        "",
        "a" * 31,
        "a" * 32,
        "é" * 200,
        "x" * 70000,
        b"",
        b"x" * 255,
        b"x" * 256,
        b"x" * 70000,
        bytearray(b"ab"),
        [],
        list(range(16)),
        list(range(70000)),
        {},
        {i: i for i in range(16)},
        (),
        (1, (2, (3,))),
        [np.zeros(3)] * 2,
        np.zeros((0, 2**20)),
        np.zeros(()),
        np.arange(12).reshape(3, 4)[:, ::2],
        np.float64(1.5),
        np.float32(2),
        np.int64(-3),
        np.bool_(True),
        np.uint64(2**64 - 1),
        np.float16(1),
        np.complex64(1j),
        msgpack.ExtType(5, b"abc"),
        {"obs": np.ones(17), "reward_ctrl": np.float32(-0.1), "x": np.float64(2)},
    ],
    ids=lambda v: type(v).__name__,
)
def test_the_common_values_are_encoded_in_c(value):
    assert native.frame(value) == python_frame(value)


class Color(enum.IntEnum):
    RED = 1


@pytest.mark.parametrize(
    "value",
    [
        2**64,
        -(2**63) - 1,
        "\ud800",
        Color.RED,
        collections.OrderedDict(a=1),
        memoryview(b"ab"),
        np.zeros(2, dtype=object),
        np.array(["a"]),
        np.zeros(2, dtype=[("a", "<i4")]),
        np.datetime64(1, "s"),
        np.str_("a"),
        np.longdouble(3),
        np.zeros(2, np.clongdouble),
        object(),
        [[1]] * 3 + [object()],
    ],
    ids=lambda v: type(v).__name__,
)
def test_what_c_does_not_make_exactly_is_left_to_python(value):
    assert native.frame(value) is None and native.pack(value) is None


def test_nesting_past_the_c_limit_and_deep_tuples_are_left_to_python():
    deep = []
    for _ in range(600):
        deep = [deep]
    assert native.frame(deep) is None
    tuples = ()
    for _ in range(32):  # 33 tuples, one inside the other
        tuples = (tuples,)
    assert native.frame(tuples) is None
    with pytest.raises(ValueError, match="MAX_TUPLE_NESTING"):
        wire.encode(tuples)  # Python names the limit, as before
    ok = ()
    for _ in range(31):
        ok = (ok,)
    assert native.frame(ok) == python_frame(ok)


def ext_payloads():
    """Real ARRAY_EXT / SCALAR_EXT payloads (the test mutates them, with its own data)."""
    return st.one_of(
        arrays().map(lambda a: (wire.ARRAY_EXT, wire._array_ext(a).data)),
        scalars.map(lambda s: (wire.SCALAR_EXT, wire._array_ext(np.asarray(s), wire.SCALAR_EXT).data)),
    )


@SETTINGS
@given(item=ext_payloads(), check=st.booleans(), data=st.data())
def test_the_hook_returns_what_the_python_hook_returns_or_raises_alike(item, check, data):
    code, payload = item
    payload = bytearray(payload)
    for _ in range(data.draw(st.integers(0, 3))):
        if payload and data.draw(st.booleans()):
            payload[data.draw(st.integers(0, len(payload) - 1))] = data.draw(st.integers(0, 255))
        else:
            cut = data.draw(st.integers(0, len(payload)))
            payload[cut:cut] = data.draw(st.binary(max_size=4))
    code = data.draw(st.sampled_from([code, code, wire.ARRAY_EXT, wire.SCALAR_EXT, wire.TUPLE_EXT, 7]))
    payload = bytes(payload)
    python, c = python_hook(check), native.Hook(check, python_hook(check), wire.CheckedArray)
    try:
        want = python(code, payload)
    except Exception as exc:
        with pytest.raises(type(exc)) as got:
            c(code, payload)
        assert str(got.value) == str(exc)
        return
    assert same(c(code, payload), want)


@pytest.mark.parametrize("dtype", NUMERIC)
def test_scalars_of_every_dtype_decode_as_python_decodes_them(dtype):
    python, c = python_hook(False), native.Hook(False, python_hook(False))
    for raw in (b"\x00" * 32, b"\xff" * 32, bytes(range(32)), struct.pack("<f", float("nan")) * 8):
        value = np.frombuffer(raw[: np.dtype(dtype).itemsize], dtype=dtype)[0]
        payload = wire._array_ext(np.asarray(value), wire.SCALAR_EXT).data
        assert same(c(wire.SCALAR_EXT, payload), python(wire.SCALAR_EXT, payload))


def test_a_decoded_array_is_a_read_only_view_of_the_frame():
    frame = wire.encode([wire.STEPPED, 1, np.arange(6.0).reshape(2, 3), 1.0, False, False, {"r": np.float32(1)}])
    message = wire.FrameReader(wire.Limits(1 << 20)).feed(frame)[0]
    obs = message[2]
    assert obs.shape == (2, 3) and not obs.flags.writeable and obs.base is not None
    assert type(message[6]["r"]) is np.float32


def test_the_check_hook_passes_headers_it_accepts_and_python_names_the_rest():
    hook = native.Hook(True, python_hook(True), wire.CheckedArray)
    good = wire._array_ext(np.zeros((2, 2), np.uint8)).data
    checked = hook(wire.ARRAY_EXT, good)
    assert type(checked) is wire.CheckedArray and checked == msgpack.ExtType(wire.ARRAY_EXT, good)
    assert native.Hook(True, python_hook(True))(wire.ARRAY_EXT, good) == msgpack.ExtType(wire.ARRAY_EXT, good)
    with pytest.raises(TypeError, match="subclass of msgpack.ExtType"):
        native.Hook(True, python_hook(True), tuple)
    bad = good[:2] + b"<f8:2,2" + good[9:]
    with pytest.raises(ValueError, match="does not match"):
        hook(wire.ARRAY_EXT, bad)
    with pytest.raises(ValueError, match="unknown msgpack extension type 9"):
        hook(9, b"x")


def test_pure_mode_uses_the_python_codec(monkeypatch):
    monkeypatch.setenv("BOLTZLABS_PURE", "1")
    assert wire._load_native() is None
    monkeypatch.delenv("BOLTZLABS_PURE")
    assert wire._load_native() is native


def test_a_slot_marker_is_the_python_hooks_in_both_modes():
    marker = (5).to_bytes(8, "little")
    check = wire.Limits(1 << 20, arrays="check", max_depth=16, max_objects=100)
    hook = check.kwargs["ext_hook"]
    with pytest.raises(ValueError, match="unknown msgpack extension type 4"):  # a pool without slots
        hook(wire.SLOT_EXT, marker)
    check.slot_marks[0] = 0
    assert hook(wire.SLOT_EXT, marker) == msgpack.ExtType(wire.SLOT_EXT, marker) and check.slot_marks[0] == 1
    with pytest.raises(ValueError):
        hook(wire.SLOT_EXT, marker[:7])
    slot = wire.Limits(1 << 20).kwargs["ext_hook"](wire.SLOT_EXT, marker)  # the client's
    assert type(slot) is wire.Slot and slot.seq == 5


@pytest.mark.parametrize("pure", [False, True], ids=["native", "pure"])
def test_a_checked_array_is_passed_on_as_it_came_and_is_no_dict_key(monkeypatch, pure):
    """The worker's decode of an env's frame keeps an array as a CheckedArray: re-encoded, the
    same bytes; as a dict key (or in a tuple that is one), refused there, as the trainer's decode
    (an unhashable ndarray) would refuse the whole frame it came in."""
    if pure:
        monkeypatch.setattr(wire, "_native", None)
    check = wire.Limits(1 << 20, arrays="check")
    array = wire.pack(np.arange(3.0))
    value = wire.decode(b"\x92\x01\x81\xa1x" + array, check)
    assert type(value[1]["x"]) is wire.CheckedArray
    assert wire.encode(value) == wire.encode([1, {"x": np.arange(3.0)}])
    assert python_frame(value) == wire.encode(value)
    for key in (array, wire.pack((np.arange(3.0), 1)), b"\x91\x01", b"\x80"):
        for limits in (check, wire.Limits(1 << 20, arrays="check", max_objects=100), wire.Limits(1 << 20)):
            with pytest.raises(ProtocolError, match="a dict key that is a list, a dict or an array"):
                wire.decode(b"\x92\x01\x81" + key + b"\x01", limits)
