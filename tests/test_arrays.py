"""NumPy arrays on the wire: the ARRAY_EXT extension, unit and end to end.

Unit: every numeric dtype, bool, 0-d, empty, non-contiguous and big-endian
arrays survive encode/decode bit for bit, decode to aligned read-only views
(no copy), and survive any chunking of the stream. The worker's "check" mode
passes arrays through byte for byte and refuses malformed headers.

End to end: arrays go client -> worker -> env -> worker -> client through
real sandboxes, a few MiB included; an env that sends a bad array or one over
the frame cap is killed on its lane and the others go on; an env that never
touches an array never imports numpy.
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from boltzlabs.errors import ProtocolError
from boltzlabs import RLPool, wire

DTYPES = [
    np.bool_,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.float16,
    np.float32,
    np.float64,
    np.longdouble,
    np.complex64,
    np.complex128,
    np.clongdouble,
]
BIG = wire.Limits(1 << 26)


def sample(dtype, shape, seed=0):
    return np.asarray(_values(dtype, shape, seed), dtype=dtype)  # 0-d stays an array


def _values(dtype, shape, seed):
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    values = rng.standard_normal(shape) * 1e3
    if dtype.kind == "c":
        values = values + 1j * rng.standard_normal(shape)
    return values.astype(dtype)


def roundtrip(value, limits=BIG):
    (message,) = wire.FrameReader(limits).feed(wire.encode([wire.STEPPED, value]))
    return message[1]


def assert_same_array(got, want):
    assert isinstance(got, np.ndarray), type(got)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == np.ascontiguousarray(want).tobytes()  # bit for bit, nan included


# --- unit ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(), (0,), (7,), (2, 3, 4), (1, 0, 5)], ids=str)
def test_every_dtype_and_shape_round_trips(dtype, shape):
    array = sample(dtype, shape)
    got = roundtrip(array)
    assert_same_array(got, array)
    assert not got.flags.writeable  # a view of the frame's bytes: no copy was made
    assert got.ctypes.data % got.dtype.alignment == 0


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.arange(24.0).reshape(4, 6).T,
        lambda: np.arange(100, dtype=np.int32)[::3],
        lambda: np.arange(60, dtype=np.uint8).reshape(3, 4, 5)[:, ::2, 1:],
        lambda: np.broadcast_to(np.arange(3.0), (4, 3)),
        lambda: np.arange(10, dtype=">i4"),  # big-endian
        lambda: np.asfortranarray(np.arange(12.0).reshape(3, 4)),
    ],
    ids=["transposed", "strided", "sliced-3d", "broadcast", "big-endian", "fortran"],
)
def test_non_contiguous_and_odd_layouts_round_trip(make):
    array = make()
    got = roundtrip(array)
    assert got.dtype == array.dtype and got.shape == array.shape
    np.testing.assert_array_equal(got, array)


def test_nested_in_messages_and_scalars_stay_scalars():
    value = {"obs": [np.ones((2, 2), np.float32), {"deep": np.array(3, np.int8)}], "r": np.float32(0.5)}
    got = roundtrip(value)
    assert_same_array(got["obs"][0], value["obs"][0])
    assert_same_array(got["obs"][1]["deep"], value["obs"][1]["deep"])  # a 0-d array stays an array
    assert type(got["r"]) is np.float32 and got["r"] == 0.5  # a numpy scalar stays a scalar of its dtype


def test_large_array_round_trips():
    array = sample(np.float64, (512, 1024))  # 4 MiB
    assert_same_array(roundtrip(array), array)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(0, 200), max_size=6), st.sampled_from(DTYPES), st.integers(0, 5))
def test_any_chunking_of_a_stream_of_arrays(cuts, dtype, size):
    arrays = [sample(dtype, (size, 2), seed) for seed in range(3)]
    data = b"".join(wire.encode([wire.STEPPED, a]) for a in arrays)
    points = [0, *sorted(c % (len(data) + 1) for c in cuts), len(data)]
    reader = wire.FrameReader(BIG)
    got = []
    for a, b in zip(points, points[1:]):
        got.extend(reader.feed(data[a:b]))
    assert len(got) == 3 and reader.pending == 0
    for message, array in zip(got, arrays):
        assert_same_array(message[1], array)


def test_fed_one_byte_at_a_time():
    array = sample(np.int16, (3, 5))
    reader = wire.FrameReader(BIG)
    got = []
    for byte in wire.encode([wire.STEPPED, array]):
        got.extend(reader.feed(bytes([byte])))
    assert_same_array(got[0][1], array)


def test_worker_passes_arrays_through_untouched():
    # The worker checks the header and re-packs the ExtType: byte-identical frames.
    frame = wire.encode([wire.STEPPED, 1, {"obs": sample(np.float32, (4, 4))}, 0.0, False, False, {}])
    (message,) = wire.FrameReader(wire.Limits(1 << 20, arrays="check")).feed(frame)
    assert isinstance(message[2]["obs"], msgpack.ExtType)
    assert wire.encode(message) == frame
    (message,) = wire.FrameReader(wire.Limits(1 << 20, arrays="pass")).feed(frame)
    assert wire.encode(message) == frame


def ext_frame(code, payload):
    return wire.encode([wire.STEPPED, 1, msgpack.ExtType(code, payload), 0.0, False, False, {}])


def header(text: str, pad_to: int = None) -> bytes:
    raw = text.encode("latin-1")
    return len(raw).to_bytes(2, "little") + raw


@pytest.mark.parametrize(
    "code, payload",
    [
        (7, b"anything"),  # unknown extension
        (wire.ARRAY_EXT, b""),  # no header
        (wire.ARRAY_EXT, b"\xff\xff<f8:1"),  # header runs past the payload
        (wire.ARRAY_EXT, header("|O8:1") + b"\0" * 8),  # object dtype
        (wire.ARRAY_EXT, header("<U4:1") + b"\0" * 16),  # str dtype
        (wire.ARRAY_EXT, header("<f3:1") + b"\0" * 3),  # no such float
        (wire.ARRAY_EXT, header("<f8:2") + b"\0" * 8),  # too few bytes
        (wire.ARRAY_EXT, header("<f8:1") + b"\0" * 9),  # too many bytes
        (wire.ARRAY_EXT, header("<f8:-1") + b""),  # negative dimension
        (wire.ARRAY_EXT, header("<f8:" + ",".join(["1"] * 33)) + b"\0" * 8),  # too many dimensions
        (wire.ARRAY_EXT, header("<f8:\u00b2") + b"\0" * 16),  # non-ASCII digit
        (wire.ARRAY_EXT, header("<f8:99999999999999999999") + b""),  # absurd size
        (wire.ARRAY_EXT, header("<f8") + b"\0" * 8),  # no shape separator
    ],
    ids=[
        "unknown-code",
        "empty",
        "header-overrun",
        "object",
        "str",
        "f3",
        "short",
        "long",
        "negative",
        "ndim",
        "unicode-digit",
        "huge",
        "no-colon",
    ],
)
@pytest.mark.parametrize("mode", ["check", "decode"])
def test_malformed_array_ext_is_a_protocol_error(code, payload, mode):
    if mode == "decode" and code != wire.ARRAY_EXT:
        pytest.skip("decode leaves unknown extensions to the worker's check")
    with pytest.raises(ProtocolError, match="malformed frame"):
        wire.FrameReader(wire.Limits(1 << 20, arrays=mode)).feed(ext_frame(code, payload))


# --- end to end ---------------------------------------------------------------------------------

ECHO = """
    import sys
    from boltzlabs.env import serve

    def reset(seed, options=None):
        return {"numpy_loaded": "numpy" in sys.modules}

    def step(action):
        if isinstance(action, dict) and action.get("op") == "plain":
            return {"numpy_loaded": "numpy" in sys.modules}, 0.0, False, {}
        if isinstance(action, dict) and action.get("op") == "bad_ext":
            import msgpack
            from boltzlabs import wire
            body = msgpack.packb([wire.STEPPED, 1, msgpack.ExtType(wire.ARRAY_EXT, b"\\x03\\x00<f8:1"),
                                  0.0, False, False, {}])
            import os
            os.write(3, len(body).to_bytes(4, "little") + body)
            return None, 0.0, False, {}
        if isinstance(action, dict) and action.get("op") == "huge":
            import numpy as np
            return np.zeros(17 << 20, np.uint8), 0.0, False, {}
        seen = {"type": type(action).__module__ + "." + type(action).__name__,
                "writeable": bool(getattr(getattr(action, "flags", None), "writeable", True))}
        return action, 1.0, False, seen
    serve(reset=reset, step=step)
"""


@pytest.fixture
def echo_pool(env_dir):
    pools = []

    def make(n=2):
        pool = RLPool(env_dir(ECHO), n, step_timeout=20.0)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()


def test_arrays_round_trip_through_sandboxes_both_ways(echo_pool):
    pool = echo_pool(2)
    pool.reset()
    for dtype in DTYPES:
        for shape in [(), (3,), (2, 0), (2, 3, 2)]:
            actions = [sample(dtype, shape, 0), sample(dtype, shape, 1)]
            obs, rewards, dones, infos = pool.step(actions)
            assert not dones.any(), infos
            for got, want, info in zip(obs, actions, infos):
                assert info == {"type": "numpy.ndarray", "writeable": False}  # a view in the env too
                assert_same_array(got, want)


def test_a_few_mib_and_non_contiguous_through_sandboxes(echo_pool):
    pool = echo_pool(2)
    pool.reset()
    big = sample(np.float32, (1024, 1024))  # 4 MiB each way, under the 16 MiB frame cap
    strided = sample(np.int64, (40, 30))[::3, ::-2]
    obs, _, dones, infos = pool.step([big, strided])
    assert not dones.any(), infos
    assert_same_array(obs[0], big)
    assert_same_array(obs[1], np.ascontiguousarray(strided))
    # An (n, ...) array of actions gives each env its row, as an array.
    batch = sample(np.uint8, (2, 5, 5))
    obs, *_ = pool.step(batch)
    assert_same_array(obs[0], batch[0]) and assert_same_array(obs[1], batch[1])


def test_an_env_that_never_sees_an_array_never_imports_numpy(echo_pool):
    pool = echo_pool(1)
    assert pool.reset() == [{"numpy_loaded": False}]
    obs, *_ = pool.step([{"op": "plain"}])
    assert obs == [{"numpy_loaded": False}]
    pool.step([np.zeros(2)])
    obs, *_ = pool.step([{"op": "plain"}])
    assert obs == [{"numpy_loaded": True}]  # only once an array arrived


@pytest.mark.parametrize("op, cause", [("bad_ext", "invalid frame"), ("huge", "over the cap")])
def test_a_bad_or_oversized_array_kills_only_its_env(echo_pool, op, cause):
    pool = echo_pool(2)
    pool.reset()
    obs, _, dones, infos = pool.step([{"op": op}, np.arange(3)])
    assert dones[0] and obs[0] is None and cause in infos[0]["error"], infos[0]
    assert not dones[1] and np.array_equal(obs[1], np.arange(3))
    assert pool.truncated[0] and not pool.terminated[0]
    pool.reset(where=[0])  # respawned
    obs, _, dones, _ = pool.step([np.ones(2), np.ones(2)])
    assert not dones.any() and np.array_equal(obs[0], np.ones(2))
