"""Text in, text out (issue 44): str observations and actions of up to the pool's max_str_len.

RL where the action is a program (Python source as a str) and the observation a prompt or a
test log: strings of hundreds of KiB each way, under one bound, `max_str_len`, the policy's
(4 MiB) or a pool's own (`RLPool(..., limits={"max_str_len": "512K"})`, never above the
policy's). What each hop does with a str over it:

    trainer   an action (or call/set_attr argument) holding one: ValueError naming the env, before
              anything is sent (pool/protocol.py refuse_long_strs)
    env       its serve() fails a reply holding one (FAILED: the env lives); its decoder refuses a
              request holding one (exit abi.REFUSED_EXIT, named on the lane)
    worker    an env frame holding one (a hostile env, bypassing serve()): the env is killed, its
              lane says the size, the cap and what to set; the other lanes are untouched

Real sandboxes in both spawn modes, on both of the worker's step paths (framers.PATHS); a
hostile env writes raw frames on its channel as test_hostile_wire.py's does.
"""

import string
import warnings

import gymnasium
import numpy as np
import psutil
import pytest
from gymnasium import spaces
from gymnasium.vector import SyncVectorEnv

from boltzlabs import RLPool, wire
from boltzlabs.errors import ProtocolError
from boltzlabs.gym import BoltzLabsVecEnv
from boltzlabs.host import limits as host_limits
from boltzlabs.pool.text import refuse_long_strs, text_note
from conftest import COUNTER
from framers import PATHS, pools_on_path, use_path

KiB, MiB = 1 << 10, 1 << 20
POLICY_CAP = 4 * MiB  # sandbox/policy.toml [limits] max_str_len
CAP = 512 * KiB  # the pools' own below, limits={"max_str_len": "512K"}

# A plain str action is a "program": the env answers a "test log" of the same length and its
# lane (reward: the action's length in UTF-8 bytes). A dict {"op": ...} is an attack or a probe.
TEXT_ENV = """
    import os
    import struct

    import msgpack

    from boltzlabs import wire
    from boltzlabs.env import serve
    from boltzlabs.runtime import serve as runtime

    LANE = int(os.environ["BOLTZLABS_ENV_INDEX"])
    steps = [0]

    def put(body):
        view = memoryview(struct.pack("<I", len(body)) + body)
        while view:
            view = view[os.write(3, view):]

    def stepped(seq, obs):  # [STEPPED, seq, <obs bytes>, 0.0, False, False, {}]
        return (b"\\x97" + msgpack.packb(wire.STEPPED) + msgpack.packb(seq) + obs
                + msgpack.packb(0.0) + b"\\xc2\\xc2\\x80")

    def str32(raw):  # a msgpack str of these bytes, whatever they are
        return b"\\xdb" + len(raw).to_bytes(4, "big") + raw

    def attack(seq, action):
        op = action["op"]
        if op == "raw_str":  # a str of n bytes, past serve()'s own check
            put(stepped(seq, str32(b"x" * action["n"])))
        elif op == "bad_utf8":  # a str whose bytes are not UTF-8 (a lone continuation byte, an overlong form)
            put(stepped(seq, str32(b"log: ok \\x80\\xc0\\xaf tail")))
        elif op == "tiny_strs":  # a list of 1,000,000 one-character strs: 2 MB on the wire
            put(stepped(seq, b"\\xdd" + (1_000_000).to_bytes(4, "big") + b"\\xa1a" * 1_000_000))

    # A hostile group too: its runtime sends a raw_str member's over-long str instead of failing it.
    from boltzlabs.runtime import group
    honest_fail_long = group.Group.fail_long

    def fail_long(self, obs, infos, errors, kinds):
        if any(isinstance(info, dict) and info.get("raw") for info in infos):
            return False
        return honest_fail_long(self, obs, infos, errors, kinds)

    group.Group.fail_long = fail_long

    original = runtime._reply

    def reply(channel, seq, phase, build, call, *args):
        if phase == "step" and isinstance(args[0], dict) and args[0].get("op", "").startswith(("raw", "bad", "tiny")):
            steps[0] += 1
            attack(seq, args[0])
            return
        original(channel, seq, phase, build, call, *args)

    runtime._reply = reply

    def reset(seed, options=None):
        steps[0] = 0
        n = (options or {}).get("n", 16)
        return "p" * n, {"lane": LANE}

    def step(action):
        steps[0] += 1
        info = {"lane": LANE, "steps": steps[0]}
        if isinstance(action, dict):
            if action["op"] == "log":  # an honest env's log of n characters
                return action.get("char", "L") * action["n"], 0.0, False, False, info
            if action["op"] == "steps":
                return "", 0.0, False, False, info
            if action["op"] == "raw_str":  # in a group (no _reply): the hostile Group above sends it
                return "x" * action["n"], 0.0, False, False, dict(info, raw=True)
        return f"{LANE}:" + action, float(len(action.encode())), False, False, info

    serve(reset=reset, step=step)
"""


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """Pools made in the test run the worker's step path: native or pure (BOLTZLABS_PURE=1)."""
    return use_path(request, monkeypatch)


@pytest.fixture
def text_pool(env_dir, pool_factory, path):
    return pools_on_path(env_dir(TEXT_ENV), pool_factory, path)


def log_of(lane: int, action: str) -> str:
    return f"{lane}:{action}"


def assert_honest(obs, dones, infos, lane, action):
    assert not dones[lane] and "error" not in infos[lane], infos[lane]
    assert obs[lane] == log_of(lane, action)


def steps_taken(pool) -> list:
    obs, _, _, infos = pool.step([{"op": "steps"}] * len(pool))
    return [info["steps"] for info in infos]


# --- what works: every size, every call -----------------------------------------------------------


def test_str_actions_and_observations_of_every_size_cross_every_call(text_pool):
    """1 KiB, 100 KiB, 500 KiB and 3 MiB (under the policy's 4 MiB) through step, send/recv and
    reset, ASCII and not (the cap counts UTF-8 bytes: 'é' is 2, '𝄞' 4)."""
    pool = text_pool(2)
    assert pool.max_str_len == POLICY_CAP
    for size in (KiB, 100 * KiB, 500 * KiB, 3 * MiB):
        obs = pool.reset(options={"n": size})
        assert obs == ["p" * size] * 2
        actions = ["a" * size, ("é" * (size // 4)) + ("𝄞" * (size // 8))]
        obs, rewards, dones, infos = pool.step(actions)
        for lane in range(2):
            assert_honest(obs, dones, infos, lane, actions[lane])
        assert rewards.tolist() == [float(size)] * 2
        pool.send(actions[::-1])
        env_ids, obs, rewards, dones, infos = pool.recv(batch_size=2)
        for i, lane in enumerate(env_ids.tolist()):
            assert obs[i] == log_of(lane, actions[1 - lane]) and not dones[i], infos[i]


# --- a str over the cap from an env ----------------------------------------------------------------


def test_an_honest_env_over_the_cap_fails_that_request_and_keeps_its_env(text_pool):
    """serve() checks its own reply: a str one byte over the pool's cap is a FAILED reply naming
    the size, the cap and what to set; the env keeps its state, the other lane its result."""
    pool = text_pool(2, limits={"max_str_len": "512K"})
    assert pool.max_str_len == CAP
    pool.reset()
    obs, _, dones, infos = pool.step([{"op": "log", "n": CAP}, "ok"])
    assert obs[0] == "L" * CAP and not dones[0]  # exactly the cap: fine
    obs, _, dones, infos = pool.step([{"op": "log", "n": CAP // 2 + 1, "char": "é"}, "ok"])
    assert dones[0] and obs[0] is None
    error = infos[0]["error"]
    assert f"{CAP + 2:,} bytes" in error and f"max_str_len of {CAP:,}" in error, error
    assert "limits={'max_str_len'" in error, error
    assert_honest(obs, dones, infos, 1, "ok")
    assert steps_taken(pool) == [3, 3]  # the env was not respawned: it kept counting


@pytest.mark.parametrize("n, killed", [(CAP, False), (CAP + 1, True)], ids=["at-the-cap", "one-over"])
def test_a_raw_str_over_the_cap_kills_only_its_lane(text_pool, n, killed):
    """Past serve(): the worker's decoder (both paths) refuses the frame, names it, kills the env."""
    pool = text_pool(3, limits={"max_str_len": "512K"})
    pool.reset()
    worker = pool._link.proc.pid
    obs, _, dones, infos = pool.step(["left", {"op": "raw_str", "n": n}, "right"])
    assert_honest(obs, dones, infos, 0, "left")
    assert_honest(obs, dones, infos, 2, "right")
    if not killed:
        assert obs[1] == "x" * n and not dones[1]
        return
    assert dones[1] and obs[1] is None
    error = infos[1]["error"]
    assert f"str of {CAP + 1:,} bytes" in error and f"cap of {CAP:,} (limits.max_str_len)" in error, error
    assert "RLPool(..., limits={'max_str_len': ...})" in error and f"up to the policy's {POLICY_CAP:,}" in error
    assert psutil.Process(worker).is_running()
    pool.reset(where=[1])
    obs, _, dones, infos = pool.step(["a", "b", "c"])
    for lane, action in enumerate("abc"):
        assert_honest(obs, dones, infos, lane, action)


def test_a_raw_str_over_the_policys_cap_says_the_policy_is_the_ceiling(text_pool):
    pool = text_pool(2)
    pool.reset()
    obs, _, dones, infos = pool.step([{"op": "raw_str", "n": POLICY_CAP + 1}, "ok"])
    assert dones[0] and f"cap of {POLICY_CAP:,} (limits.max_str_len)" in infos[0]["error"], infos[0]
    assert "the most a pool may ask for" in infos[0]["error"] and "BOLTZLABS_POLICY" in infos[0]["error"]
    assert_honest(obs, dones, infos, 1, "ok")


def test_a_str_that_is_not_utf8_fails_its_lane_and_the_worker_lives(text_pool):
    pool = text_pool(2)
    pool.reset()
    worker = pool._link.proc.pid
    obs, _, dones, infos = pool.step([{"op": "bad_utf8"}, "ok"])
    assert dones[0] and obs[0] is None
    assert "not valid UTF-8" in infos[0]["error"] and "as bytes" in infos[0]["error"], infos[0]
    assert_honest(obs, dones, infos, 1, "ok")
    assert psutil.Process(worker).is_running()
    pool.reset(where=[0])
    obs, _, dones, infos = pool.step(["x", "y"])
    assert_honest(obs, dones, infos, 0, "x")


def test_a_million_tiny_strs_hit_the_object_cap(text_pool):
    pool = text_pool(2)
    pool.reset()
    obs, _, dones, infos = pool.step([{"op": "tiny_strs"}, "ok"])
    assert dones[0] and "objects" in infos[0]["error"], infos[0]
    assert_honest(obs, dones, infos, 1, "ok")


# --- a str over the cap from the trainer -----------------------------------------------------------


def test_an_action_over_the_cap_is_refused_before_anything_is_sent(text_pool):
    pool = text_pool(3, limits={"max_str_len": "512K"})
    pool.reset()
    cases = [
        (lambda: pool.step(["a", "b", "c" * (CAP + 1)]), "step(): the action for env 2", CAP + 1),
        (lambda: pool.step(["a", {"code": "é" * (CAP // 2 + 1)}, "c"]), "env 1", CAP + 2),  # nested, 2 bytes each
        (lambda: pool.send(["x" * (CAP + 1)], env_ids=[2]), "send(): the action for env 2", CAP + 1),
        (lambda: pool.step([("ok", ["y" * (CAP + 7)]), "b", "c"]), "env 0", CAP + 7),
    ]
    for call, words, size in cases:
        with pytest.raises(ValueError) as refused:
            call()
        text = str(refused.value)
        assert words in text and f"{size:,} bytes" in text and f"max_str_len of {CAP:,}" in text, text
        assert "limits={'max_str_len': ...}" in text, text
    with pytest.raises(ValueError, match="an argument holds a str"):
        pool.call("anything", "z" * (CAP + 1))
    with pytest.raises(ValueError, match="the value for env 1 holds a str"):
        pool.set_attr("anything", ["a", "z" * (CAP + 1), "c"])
    # Reset options go to every env reset: refused as a whole, and the pool goes on (the env's own
    # decoder would refuse them too, and each env asked would die of it).
    with pytest.raises(ValueError, match=r"reset\(\): a reset option holds a str of [\d,]+ bytes"):
        pool.reset(where=[1], options={"prompt": "z" * (CAP + 1)})
    with pytest.raises(ValueError, match=r"send\(\): a reset option holds a str"):
        pool.send(["a"], env_ids=[0], resets=[0], options={"prompt": ["z" * (CAP + 1)]})
    assert steps_taken(pool) == [1, 1, 1]  # nothing was sent: no env stepped or reset
    obs, _, dones, infos = pool.step(["a" * CAP, "b", "c"])  # the cap itself goes (the reply: 2 bytes over)
    assert dones[0] and f"returned a str of {CAP + 2:,} bytes" in infos[0]["error"], infos[0]
    assert steps_taken(pool) == [3, 3, 3]


def test_the_envs_own_decoder_bounds_a_request(text_pool):
    """With the trainer's check out of the way (a client that skips it), the env's decoder refuses
    a request holding a str over the cap: it exits REFUSED_EXIT, named on its lane; reset options
    go the same way."""
    pool = text_pool(2, limits={"max_str_len": "4K"})
    pool.reset()
    pool.max_str_len = None  # as a client without the check
    obs, _, dones, infos = pool.step(["a" * 5000, "ok"])
    assert dones[0] and "exited with code 89" in infos[0]["error"] and "max_str_len" in infos[0]["error"], infos[0]
    assert "refused a request from the worker: frame holds a str of 5,000 bytes" in pool.log(0)
    assert_honest(obs, dones, infos, 1, "ok")
    pool.reset(where=[0])
    obs, _, dones, infos = pool.step(["a" * 4096, "ok"])  # the cap, less the lane's prefix in the reply
    assert dones[0] and "max_str_len of 4,096" in infos[0]["error"]  # 4098 back: serve() fails it, the env lives
    assert_honest(obs, dones, infos, 1, "ok")


# --- groups ------------------------------------------------------------------------------------------


def test_in_a_group_an_honest_member_over_the_cap_fails_alone_and_a_raw_one_fails_its_sandbox(text_pool):
    pool = text_pool(4, envs_per_sandbox=2, limits={"max_str_len": "512K"})
    assert pool.max_str_len == CAP
    pool.reset()
    obs, _, dones, infos = pool.step([{"op": "log", "n": CAP + 1}, "b", "c", "d"])
    assert dones[0] and f"max_str_len of {CAP:,}" in infos[0]["error"], infos[0]
    for lane, action in ((1, "b"), (2, "c"), (3, "d")):
        assert_honest(obs, dones, infos, lane, action)
    with pytest.raises(ValueError, match="the action for env 3"):
        pool.step(["a", "b", "c", "d" * (CAP + 1)])
    # Past serve(): the worker refuses the group's frame, every env of that sandbox with it.
    obs, _, dones, infos = pool.step(["a", "b", "c", {"op": "raw_str", "n": CAP + 1}])
    assert dones[2] and dones[3], infos
    assert "max_str_len" in infos[3]["error"], infos[3]
    for lane, action in ((0, "a"), (1, "b")):
        assert_honest(obs, dones, infos, lane, action)
    pool.reset(where=[2, 3])
    obs, _, dones, infos = pool.step(list("abcd"))
    for lane, action in enumerate("abcd"):
        assert_honest(obs, dones, infos, lane, action)


# --- the option ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "asked, words",
    [
        ("8M", "over the sandbox policy's [limits] max_str_len of 4,194,304 bytes"),
        (POLICY_CAP + 1, "over the sandbox policy's"),
        (100, "below the least a pool may have, 1024 bytes"),
        ("lots", "must be a size in bytes"),
        (-1, "must be a size in bytes"),
    ],
)
def test_max_str_len_above_the_policy_or_malformed_is_refused(asked, words):
    with pytest.raises(ValueError, match="limits\\['max_str_len'\\]") as refused:
        RLPool(COUNTER, 1, limits={"max_str_len": asked})
    assert words in str(refused.value), refused.value


def test_the_bound_is_split_from_the_env_limits_and_checked():
    assert host_limits.split({"pids": 64, "max_str_len": "1M"}) == ({"pids": 64}, {"max_str_len": "1M"})
    assert host_limits.split({"pids": 64}) == ({"pids": 64}, {})
    assert host_limits.split(None) == (None, {})
    assert host_limits.bound("max_str_len", None, POLICY_CAP) == POLICY_CAP
    assert host_limits.bound("max_str_len", "512K", POLICY_CAP) == CAP
    assert host_limits.bound("max_str_len", POLICY_CAP, POLICY_CAP) == POLICY_CAP
    with pytest.raises(ValueError, match="unknown env limit.*max_str_len"):
        host_limits.resolve({"pids": 256}, {"max_string_len": 10})


def test_a_remote_pool_takes_the_bound_within_the_remote_policy(tmp_path):
    from test_remote import Worker

    w = Worker(tmp_path)
    try:
        with w.pool(limits={"max_str_len": "64K"}) as pool:
            assert pool.max_str_len == 64 * KiB
            pool.reset()
            with pytest.raises(ValueError, match="env 1 holds a str of 65,537 bytes"):
                pool.step([0, "x" * (64 * KiB + 1)])
        with pytest.raises(ValueError, match="over the sandbox policy's"):
            w.pool(limits={"max_str_len": "5M"})
    finally:
        w.stop()


# --- the trainer's check and the wire's, alone -----------------------------------------------------


def test_long_str_finds_the_first_str_over_the_cap_wherever_it_is():
    cap = 100
    assert wire.long_str("a" * 100, cap) == 0
    assert wire.long_str("a" * 101, cap) == 101
    assert wire.long_str("é" * 50, cap) == 0 and wire.long_str("é" * 51, cap) == 102
    assert wire.long_str("𝄞" * 26, cap) == 104 and wire.long_str("𝄞" * 25, cap) == 0
    assert wire.long_str({"k" * 101: 1}, cap) == 101  # keys count too
    assert wire.long_str([1, (2, {"x": ["y" * 200]})], cap) == 200
    assert wire.long_str(np.array(["z" * 101]), cap) == 101  # a str array travels as a list of str
    assert wire.long_str(np.zeros(1000), cap) == 0 and wire.long_str(b"b" * 1000, cap) == 0
    looped: list = []
    looped.append(looped)
    assert wire.long_str(looped, cap) == 0  # bounded: encode() refuses it


def test_refuse_long_strs_names_the_env_and_passes_plain_batches():
    refuse_long_strs(None, [1, 2.0, None, True, b"x" * 500], 100)
    refuse_long_strs(np.zeros((3, 1000)), list(np.zeros((3, 1000))), 100)
    refuse_long_strs(None, ["a" * 25] * 3, 100)
    refuse_long_strs(None, [np.zeros(3), 1, np.ones((2, 2), np.uint8)], 100)  # numeric arrays: by their dtypes
    refuse_long_strs(None, list(np.arange(3)) + [np.float32(1), np.bool_(True)], 100)  # numpy scalars (Discrete)
    with pytest.raises(ValueError, match="send\\(\\): the action for env 7 holds a str of 101 bytes"):
        refuse_long_strs(None, ["a", "b" * 101], 100, [3, 7], "send()")
    with pytest.raises(ValueError, match="the action for env 1 holds a str of 200 bytes"):
        refuse_long_strs(None, [np.zeros(3), np.array(["x" * 200])], 100)  # a str array among numeric ones
    with pytest.raises(ValueError, match="the action for env 2 holds a str of 101 bytes"):
        refuse_long_strs(None, [np.int64(1), np.float64(2), np.str_("c" * 101)], 100)  # numpy's str scalar


def test_the_decoders_refusals_say_what_and_how_big():
    limits = wire.Limits(1 << 20, max_str_len=1000, str_fix="; set it")
    with pytest.raises(
        ProtocolError, match=r"a str of 1,001 bytes \(UTF-8\), over its cap of 1,000 \(limits.max_str_len\); set it"
    ):
        wire.decode(wire.pack([1, "s" * 1001]), limits)
    with pytest.raises(
        ProtocolError, match=r"a bytes value of 2,000 bytes, over its cap of 1,000 \(limits.max_bin_len\)"
    ):
        wire.decode(wire.pack([1, b"b" * 2000]), wire.Limits(1 << 20, max_bin_len=1000))
    with pytest.raises(ProtocolError, match="not valid UTF-8"):
        wire.decode(b"\x92\x01\xa2\xc0\xaf", wire.Limits(1 << 20))


# --- Gymnasium's Text spaces -------------------------------------------------------------------------


class TextEnv(gymnasium.Env):
    """A prompt in, a program out, a test log back: Text spaces both ways."""

    def __init__(self, max_length=4096):
        self.observation_space = spaces.Text(max_length, charset=string.printable)
        self.action_space = spaces.Text(max_length, charset=string.printable)
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return f"prompt {self.np_random.integers(100)}", {}

    def step(self, action):
        self.t += 1
        return f"log {self.t}: {action[::-1]}", float(len(action)), self.t >= 3, False, {"t": self.t}


def test_a_text_space_batches_as_syncvectorenv_batches_it():
    """Text observations as a tuple of str, Text actions taken as one, episode for episode
    (autoreset included) as SyncVectorEnv gives them."""
    reference = SyncVectorEnv([TextEnv] * 3)
    with BoltzLabsVecEnv([TextEnv] * 3) as envs:
        assert envs.single_observation_space == reference.single_observation_space
        assert envs.observation_space == reference.observation_space
        assert envs.action_space == reference.action_space
        ours, theirs = envs.reset(seed=5), reference.reset(seed=5)
        assert type(ours[0]) is tuple and ours[0] == theirs[0]
        for t in range(7):
            actions = tuple(f"print({t * 100 + i})" * (t + 1) for i in range(3))
            ours, theirs = envs.step(actions), reference.step(actions)
            assert type(ours[0]) is tuple and ours[0] == theirs[0]
            for a, b in zip(ours[1:4], theirs[1:4]):
                np.testing.assert_array_equal(a, b)
        assert envs.observation_space.contains(ours[0])


def test_a_text_space_longer_than_the_cap_is_warned_about_at_open(recwarn):
    hello = {"observation_space": {"type": "Text", "max_length": 200_000, "min_length": 1, "charset": "ab"}}
    assert text_note(hello, 200_000) == ""
    assert "Text observation space of up to 200,000 characters" in text_note(hello, 199_999)
    wide = {"group": {"action_space": {"type": "Text", "max_length": 10, "min_length": 1, "charset": "aé"}}}
    assert "(20 bytes in UTF-8: an action over the cap is refused)" in text_note(wide, 19)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        envs = BoltzLabsVecEnv([lambda: TextEnv(max_length=600_000)] * 2, limits={"max_str_len": "512K"})
        envs.close()
    notes = [str(w.message) for w in caught if "declares a Text" in str(w.message)]
    assert len(notes) == 1 and "Text observation space of up to 600,000 characters" in notes[0], [
        str(w.message) for w in caught
    ]


# --- the benchmark ----------------------------------------------------------------------------------


def test_bench_text_runs_and_reports_every_figure(tmp_path):
    """benchmarks/bench_text.py at a tiny n: every way, every size, no failed lane, a JSON record."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "text.json"
    run = subprocess.run(
        [sys.executable, "benchmarks/bench_text.py", "--n", "4", "--sizes", "1K", "8K", "--steps", "4"]
        + ["--rounds", "2", "--max-str-len", "64K", "--out", str(out)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(row["n"], row["size"], row["max_str_len"]) for row in rows] == [(4, 1024, 65536), (4, 8192, 65536)]
    for row in rows:
        for way in ("step", "async"):
            figures = row[way]
            assert figures["failed_lanes"] == 0 and figures["env_steps_per_s"] > 0, figures
            assert set(figures["cpu_us_per_env_step_by"]) >= {"client", "worker", "envs"}
        assert row["memory_in_flight"]["envs_per_gb"] > 0 and row["memory_in_flight"]["worker_rss_mib"] > 0
    assert "| 4 | 8K | async |" in run.stdout
