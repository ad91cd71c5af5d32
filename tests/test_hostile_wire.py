"""What an env writes on its channel, as an attacker writes it (issue 13, points 2-5).

Each test runs a real pool of real sandboxes in both spawn modes. The hostile
env below answers a plain action normally and a {"op": ...} action with raw
bytes on fd 3 (its channel), bypassing serve()'s encoder; it learns the
sequence number of the request it answers by wrapping the runtime's reply
function. After every attack the other lane has its own normal result and
the pool is still usable.
"""

import time

import psutil
import pytest

from boltzlabs import EnvStartError
from framers import PATHS, pools_on_path, use_path

HOSTILE = """
    import os
    import struct
    import time

    import msgpack
    import numpy

    from boltzlabs.runtime import serve as runtime
    from boltzlabs import wire
    from boltzlabs.env import serve

    def put(body):
        view = memoryview(struct.pack("<I", len(body)) + body)
        while view:
            view = view[os.write(3, view):]

    def stepped(seq, obs):  # [STEPPED, seq, <obs bytes>, 0.0, False, False, {}]
        return (b"\\x97" + msgpack.packb(wire.STEPPED) + msgpack.packb(seq) + obs
                + msgpack.packb(0.0) + b"\\xc2\\xc2\\x80")

    def nest(depth):  # [[[...nil...]]], `depth` arrays deep
        return b"\\x91" * depth + b"\\xc0"

    def array32(count, item):
        return b"\\xdd" + count.to_bytes(4, "big") + item * count

    def bad_array(shape):
        text = ("<f8:" + ",".join(map(str, shape))).encode()
        pad = -(2 + len(text)) % 16
        payload = struct.pack("<H", len(text) + pad) + text + b" " * pad
        return msgpack.packb(msgpack.ExtType(wire.ARRAY_EXT, payload))

    def tuple_ext(payload):
        return msgpack.packb(msgpack.ExtType(wire.TUPLE_EXT, payload))

    def deep_tuple(depth):  # ((((...)))): `depth` tuple exts, one inside the other
        inner = msgpack.packb([])
        for _ in range(depth):
            inner = msgpack.packb([msgpack.ExtType(wire.TUPLE_EXT, inner)])
        return tuple_ext(inner)

    def scalar_ext(text, raw):
        pad = -(2 + len(text)) % 16
        return msgpack.packb(msgpack.ExtType(wire.SCALAR_EXT, struct.pack("<H", len(text) + pad) + text
                                             + b" " * pad + raw))

    def good_array():
        return wire.pack(numpy.zeros(2))

    def attack(seq, action):
        op = action["op"]
        if op == "array_key":  # obs {<array>: 1}: an array ext as a dict key
            put(stepped(seq, b"\\x81" + good_array() + b"\\x01"))
        elif op == "tuple_array_key":  # obs {(<array>, 1): 1}
            put(stepped(seq, b"\\x81" + tuple_ext(b"\\x92" + good_array() + b"\\x01") + b"\\x01"))
        elif op == "info_array_key":  # info {"ok": 1, <array>: 2}
            put(b"\\x97" + msgpack.packb(wire.STEPPED) + msgpack.packb(seq) + b"\\xc0" + msgpack.packb(0.0)
                + b"\\xc2\\xc2\\x82\\xa2ok\\x01" + good_array() + b"\\x02")
        elif op == "deep_tuple":
            put(stepped(seq, deep_tuple(action["depth"])))
        elif op == "wide_tuple":  # one tuple of 1,000,000 empty lists: 1 MB on the wire
            put(stepped(seq, tuple_ext(array32(1_000_000, b"\\x90"))))
        elif op == "tuples_of_lists":  # 600 levels of [[( ... )]], 30 of them tuples: the depth cap counts tuples too
            body = b"\\xc0"
            for level in range(600):
                body = b"\\x91" + body if level % 20 else tuple_ext(b"\\x91" + body)
            put(stepped(seq, body))
        elif op == "tuple_not_array":
            put(stepped(seq, tuple_ext(msgpack.packb({"a": 1}))))
        elif op == "bad_scalar":
            put(stepped(seq, scalar_ext(action["text"].encode(), b"\\x00" * action["bytes"])))
        elif op == "deep":
            put(stepped(seq, nest(action["depth"])))
        elif op == "deep_unsolicited":
            put(stepped(seq - 1, nest(action["depth"])))
            return False
        elif op == "deep_future":
            put(stepped(seq + 1, nest(action["depth"])))
            return False
        elif op == "bad_array":
            put(stepped(seq, bad_array(action["shape"])))
        elif op == "flood":  # 15 MB of empty arrays: 15 arrays of 1,000,000 empty arrays
            put(stepped(seq, array32(15, array32(1_000_000, b"\\x90"))))
        elif op == "stale_flood":
            frame = stepped(seq - 1, b"\\xc0")
            for _ in range(action["frames"]):
                put(frame)
            return False
        elif op == "twice":
            put(stepped(seq, msgpack.packb("first")))
            return False
        return True

    original = runtime._reply

    def reply(channel, seq, phase, build, call, *args):
        try:
            result = call(*args)
        except Exception as exc:
            def again(exc=exc):
                raise exc
            return original(channel, seq, phase, build, again)
        if isinstance(result, tuple) and result[0] == "raw":
            if attack(seq, result[1]):
                return
            result = ("normal", 1.0, False, {})
        original(channel, seq, phase, build, lambda: result)

    runtime._reply = reply

    def reset(seed):
        return {"lane": int(os.environ["BOLTZLABS_ENV_INDEX"])}

    def step(action):
        if isinstance(action, dict) and "op" in action:
            if action["op"] == "sleep":
                time.sleep(action["s"])
                return "late", 1.0, False, {}
            if action["op"] == "plain_deep":  # a plain env bug: serve() encodes it
                nested = None
                for _ in range(action["depth"]):
                    nested = [nested]
                return nested, 1.0, False, {}
            return ("raw", action)
        return {"lane": int(os.environ["BOLTZLABS_ENV_INDEX"]), "action": action}, 1.0, False, {}

    serve(reset=reset, step=step)
"""


@pytest.fixture(autouse=True, params=PATHS)
def path(request, monkeypatch):
    """Every attack, on both of the worker's step paths (framers.PATHS):
    native (boltzlabs.worker._fastpath) and pure Python (BOLTZLABS_PURE=1)."""
    return use_path(request, monkeypatch)


@pytest.fixture
def hostile_pool(env_dir, pool_factory, path):
    return pools_on_path(env_dir(HOSTILE), pool_factory, path)


def assert_lane_failed(obs, dones, infos, lane, *words):
    assert dones[lane] and obs[lane] is None, (obs[lane], infos[lane])
    for word in words:
        assert word in infos[lane]["error"], infos[lane]


def assert_normal(obs, dones, infos, lane, action=7):
    assert not dones[lane] and "error" not in infos[lane], infos[lane]
    assert obs[lane] == {"lane": lane, "action": action}


def assert_pool_recovers(pool, lane):
    """The pool is usable: the broken lane comes back at its reset, every lane steps."""
    pool.reset(where=[lane])
    assert "error" not in pool.reset_infos[lane], pool.reset_infos[lane]
    n = len(pool)
    obs, rewards, dones, infos = pool.step([3] * n)
    assert not dones.any(), infos
    assert obs == [{"lane": i, "action": 3} for i in range(n)]


# --- 2. deep nesting ----------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [600, 1000, 5000])
def test_plain_env_returning_deep_nesting_fails_its_lane(hostile_pool, depth):
    pool = hostile_pool(2)
    pool.reset()
    obs, _, dones, infos = pool.step([{"op": "plain_deep", "depth": depth}, 7])
    assert_lane_failed(obs, dones, infos, 0, "nested deeper than")
    assert_normal(obs, dones, infos, 1)
    assert_pool_recovers(pool, 0)


@pytest.mark.parametrize("depth", [1000, 1022, 5000])
@pytest.mark.parametrize("op", ["deep", "deep_unsolicited", "deep_future"])
def test_raw_deep_frame_fails_its_lane(hostile_pool, op, depth):
    pool = hostile_pool(2)
    pool.reset()
    obs, _, dones, infos = pool.step([{"op": op, "depth": depth}, 7])
    assert_lane_failed(obs, dones, infos, 0)
    assert "nest" in infos[0]["error"] or "stack" in infos[0]["error"].lower(), infos[0]
    assert_normal(obs, dones, infos, 1)
    assert_pool_recovers(pool, 0)


# --- 3. array headers ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape", [(0, 2**62), (2**62, 0), (0, 2**63 - 1, 2**63 - 1), (0,) * 33, (2**31, 2**31, 0, 2**31)]
)
def test_array_header_with_absurd_shape_fails_its_lane(hostile_pool, shape):
    pool = hostile_pool(2)
    pool.reset()
    obs, _, dones, infos = pool.step([{"op": "bad_array", "shape": list(shape)}, 7])
    assert_lane_failed(obs, dones, infos, 0, "array")
    assert_normal(obs, dones, infos, 1)
    assert_pool_recovers(pool, 0)


# --- tuples and numpy scalars (issue 17, point 4) ----------------------------------------------


@pytest.mark.parametrize(
    "attack, words",
    [
        ({"op": "deep_tuple", "depth": 40}, "tuples nested more than 32 deep"),
        ({"op": "deep_tuple", "depth": 5000}, "tuples nested more than 32 deep"),
        ({"op": "wide_tuple"}, "objects"),
        ({"op": "tuples_of_lists"}, "nested deeper than 512"),
        ({"op": "tuple_not_array"}, "tuple ext does not hold an array"),
        ({"op": "bad_scalar", "text": "<f4:3", "bytes": 12}, "scalar ext has the shape of an array"),
        ({"op": "bad_scalar", "text": "<f4:", "bytes": 3}, "does not match"),
        ({"op": "bad_scalar", "text": "<O8:", "bytes": 8}, "unsupported dtype"),
        ({"op": "bad_scalar", "text": "<f8:" + "0," * 40 + "0", "bytes": 0}, "bad shape"),
        ({"op": "array_key"}, "a dict key that is a list, a dict or an array"),
        ({"op": "tuple_array_key"}, "a dict key that is a list, a dict or an array"),
        ({"op": "info_array_key"}, "a dict key that is a list, a dict or an array"),
    ],
    ids=[
        "deep-40",
        "deep-5000",
        "wide",
        "tuples-of-lists",
        "not-an-array",
        "scalar-shaped",
        "scalar-short",
        "scalar-object",
        "scalar-ndim",
        "array-key",
        "tuple-array-key",
        "info-array-key",
    ],
)
def test_hostile_tuple_and_scalar_exts_fail_their_lane(hostile_pool, attack, words):
    pool = hostile_pool(2)
    pool.reset()
    worker = pool._link.proc.pid
    obs, _, dones, infos = pool.step([attack, 7])
    assert_lane_failed(obs, dones, infos, 0, words)
    assert_normal(obs, dones, infos, 1)
    assert psutil.Process(worker).is_running()
    assert_pool_recovers(pool, 0)


# --- 4. amplification ---------------------------------------------------------------------------


def _peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_flood_of_empty_arrays_costs_the_worker_little(hostile_pool):
    pool = hostile_pool(2)
    pool.reset()
    worker = pool._link.proc.pid
    pool.step([7, 7])
    before = _peak_rss(worker)
    obs, _, dones, infos = pool.step([{"op": "flood"}, 7])
    grown = _peak_rss(worker) - before
    assert_lane_failed(obs, dones, infos, 0, "objects")
    assert_normal(obs, dones, infos, 1)
    assert grown < 100 << 20, f"the worker's peak RSS grew by {grown >> 20} MiB for a 15 MB frame"
    assert psutil.Process(worker).is_running()
    assert_pool_recovers(pool, 0)


# --- 5. replies that are not due ----------------------------------------------------------------


def test_stale_frames_kill_the_lane_at_the_first(hostile_pool):
    pool = hostile_pool(2)
    pool.reset()
    obs, _, dones, infos = pool.step([{"op": "stale_flood", "frames": 20_000}, 7])
    assert_lane_failed(obs, dones, infos, 0, "sequence number")
    assert_normal(obs, dones, infos, 1)
    assert pool.states()[0] == "dead"
    assert_pool_recovers(pool, 0)


def test_a_second_reply_kills_the_lane(hostile_pool):
    pool = hostile_pool(2)
    pool.reset()
    obs, _, dones, infos = pool.step([{"op": "twice"}, 7])
    assert obs[0] == "first" or dones[0], (obs[0], infos[0])  # the first reply may win the race
    assert_normal(obs, dones, infos, 1)
    deadline = time.monotonic() + 5
    while pool.states()[0] != "dead" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.states()[0] == "dead"
    obs, _, dones, infos = pool.step([7, 7])
    assert_lane_failed(obs, dones, infos, 0, "no reply was due")
    assert_pool_recovers(pool, 0)


def test_a_stragglers_one_late_reply_is_still_dropped_quietly(hostile_pool):
    pool = hostile_pool(2, step_timeout=0.5)
    pool.reset()
    obs, _, dones, infos = pool.step([{"op": "sleep", "s": 1.5}, 7])
    assert infos[0].get("straggler") is True
    assert_normal(obs, dones, infos, 1)
    deadline = time.monotonic() + 5
    while pool.states()[0] != "idle" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.states()[0] == "idle"  # its late reply came and was dropped: alive and serving
    obs, _, dones, infos = pool.step([7, 7])
    assert_normal(obs, dones, infos, 0)
    assert_normal(obs, dones, infos, 1)


# --- HELLO --------------------------------------------------------------------------------------

BIG_HELLO = """
    from boltzlabs.env import serve

    serve(reset=lambda seed: 0, step=lambda action: (0, 0.0, False, {}), metadata={METADATA})
"""


def test_a_large_hello_starts_in_template_mode_promptly(env_dir):
    from boltzlabs import RLPool

    source = env_dir(BIG_HELLO.replace("{METADATA}", '{"blob": "x" * 1_000_000}'))
    started = time.monotonic()
    with RLPool(source, 2, start_timeout=15) as pool:
        assert pool.spawn == "template"
        assert time.monotonic() - started < 12
        assert len(pool.env_contract.metadata["blob"]) == 1_000_000
        pool.reset()
        assert pool.step([0, 0])[0] == [0, 0]


@pytest.mark.parametrize(
    "metadata, words",
    [
        ('{"a": "x" * (3 << 20), "b": "x" * (3 << 20)}', "handshake"),
        ("[[]] * 1_000_000", "objects"),
    ],
)
def test_an_oversized_hello_is_a_clear_start_error(env_dir, spawn, metadata, words):
    from boltzlabs import RLPool

    source = env_dir(BIG_HELLO.replace("{METADATA}", metadata))
    with pytest.raises(EnvStartError, match=words):
        RLPool(source, 2, spawn=spawn, start_timeout=20).close()


# --- 4. the pool's budget (limits.max_pool_bytes) -------------------------------------------------

BIG_REPLIES = """
    import os

    from boltzlabs.env import serve

    def reset(seed):
        return 0

    def step(size):
        lane = int(os.environ["BOLTZLABS_ENV_INDEX"])
        return bytes([lane]) * size, 1.0, False, {}

    serve(reset=reset, step=step)
"""


@pytest.fixture
def small_budget(tmp_path, monkeypatch):
    """A policy whose pool budget is 4 MiB: BOLTZLABS_POLICY, read by the worker."""
    from boltzlabs.host.policy import _data_dir

    text = (_data_dir("sandbox") / "policy.toml").read_text()
    assert "\nmax_pool_bytes = 1073741824\n" in text
    policy = tmp_path / "policy.toml"
    policy.write_text(text.replace("\nmax_pool_bytes = 1073741824\n", "\nmax_pool_bytes = 4194304\n"))
    monkeypatch.setenv("BOLTZLABS_POLICY", str(policy))
    return 4 << 20


def test_replies_within_the_pools_budget_are_released_as_they_are_returned(env_dir, pool_factory, small_budget):
    pool = pool_factory(env_dir(BIG_REPLIES), 3)
    pool.reset(seed=0)
    for _ in range(6):  # 3 MiB a step under a 4 MiB budget: it must be given back every time
        obs, _, dones, infos = pool.step([1 << 20] * 3)
        assert not dones.any(), infos
        assert [o == bytes([i]) * (1 << 20) for i, o in enumerate(obs)] == [True] * 3
    pool.send([1 << 20] * 3)  # and by recv
    for _ in range(3):
        ids, obs, _, dones, infos = pool.recv(batch_size=1, timeout=10)
        assert not dones.any(), infos


def test_replies_past_the_pools_budget_fail_their_lanes_only(env_dir, pool_factory, small_budget):
    n = 6
    pool = pool_factory(env_dir(BIG_REPLIES), n)
    pool.reset(seed=0)
    obs, _, dones, infos = pool.step([1 << 20] * n)  # 6 MiB held at once: over 4 MiB
    failed = [i for i in range(n) if dones[i]]
    kept = [i for i in range(n) if not dones[i]]
    assert failed and kept, infos
    for i in failed:
        assert obs[i] is None and "max_pool_bytes" in infos[i]["error"], infos[i]
    for i in kept:
        assert obs[i] == bytes([i]) * (1 << 20) and "error" not in infos[i]
    assert len(kept) * (1 << 20) <= small_budget
    pool.reset(where=failed)  # the pool goes on: small replies from every lane
    obs, _, dones, infos = pool.step([8] * n)
    assert not dones.any(), infos
    assert obs == [bytes([i]) * 8 for i in range(n)]


def test_a_broken_policy_file_is_a_clear_error(env_dir, tmp_path, monkeypatch):
    from boltzlabs.errors import SandboxUnavailable
    from boltzlabs.host.policy import load_policy

    broken = tmp_path / "policy.toml"
    broken.write_text("[limits\n")
    monkeypatch.setenv("BOLTZLABS_POLICY", str(broken))
    with pytest.raises(SandboxUnavailable, match="BOLTZLABS_POLICY"):
        load_policy()
