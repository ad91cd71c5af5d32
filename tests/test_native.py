"""The native step path (boltzlabs.worker._fastpath, native/fastpath.c; issue 16).

exchange() is driven directly over real AF_UNIX socketpairs (and pipe lanes) and a real epoll
set, one case per outcome (a whole frame, each unusual read, EOF, timeout, a
foreign fd, a short write, the byte budget, a signal), then fuzzed: its framer
against the Python one on random bytes, and random streams cut at random
points through a real socket. The pool-level tests check which path a pool
runs and that both give the same results. The frame fuzz tests of
test_wire.py and the attacks of test_hostile_wire.py run on both paths too.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from boltzlabs import RLPool, wire

try:  # the C module itself, whichever path pools run (BOLTZLABS_PURE only steers the worker)
    from boltzlabs.worker import _fastpath as fp
except ImportError:
    fp = None

ROOT = Path(__file__).resolve().parent.parent
COUNTER = ROOT / "examples" / "counter"

native = pytest.mark.skipif(fp is None, reason="boltzlabs.worker._fastpath is not built")


def frame(body: bytes) -> bytes:
    return struct.pack("<I", len(body)) + body


REPLY = wire.encode([wire.STEPPED, 7, {"t": 1}, 1.0, False, False, {}])


class Lanes:
    """n socketpairs: `ours[i]` (non-blocking, in an epoll set) as the
    worker's channel, `theirs[i]` as the env's end."""

    def __init__(self, n: int):
        self.epoll = select.epoll()
        self.pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(n)]
        for ours, _ in self.pairs:
            ours.setblocking(False)
            self.epoll.register(ours.fileno(), select.EPOLLIN)

    @property
    def fds(self) -> list:
        return [ours.fileno() for ours, _ in self.pairs]

    def env(self, i: int) -> socket.socket:
        return self.pairs[i][1]

    def exchange(self, frames=None, timeout=2.0, max_frame=1 << 20, budget=1 << 30, fds=None):
        frames = [None] * len(self.pairs) if frames is None else frames
        fds = self.fds if fds is None else fds
        return fp.exchange(self.epoll.fileno(), fds, fds, frames, time.monotonic() + timeout, max_frame, budget)

    def close(self):
        self.epoll.close()
        for a, b in self.pairs:
            a.close()
            b.close()


@pytest.fixture
def lanes():
    made = []

    def make(n=2):
        made.append(Lanes(n))
        return made[-1]

    yield make
    for lane_set in made:
        lane_set.close()


# --- one case per outcome -------------------------------------------------------------------


@native
def test_whole_replies_come_back_as_read_and_frames_are_written(lanes):
    ls = lanes(3)
    for i in range(3):
        ls.env(i).sendall(REPLY)
    why, results = ls.exchange([b"abc", None, b"xyz"])
    assert why == fp.DONE
    assert results == [REPLY, REPLY, REPLY]
    assert ls.env(0).recv(100) == b"abc" and ls.env(2).recv(100) == b"xyz"
    ls.env(1).setblocking(False)
    with pytest.raises(BlockingIOError):  # None: nothing written
        ls.env(1).recv(100)


@native
@pytest.mark.parametrize("data, kind", [
    (REPLY[:5], "FRAME_SHORT"),                      # a partial frame
    (REPLY[:3], "FRAME_SHORT"),                      # not even a whole prefix
    (REPLY + REPLY, "FRAME_EXTRA"),                  # two frames in one read
    (REPLY + b"\x00", "FRAME_EXTRA"),                # a frame and the start of another
    (struct.pack("<I", 2**32 - 1) + b"x" * 8, "FRAME_BIG"),  # a prefix over the cap
    (frame(b"\xc0"), "FRAME_SHAPE"),                 # one frame, but not an array
    (frame(b"\x90\x01"), "FRAME_SHAPE"),             # an empty array
    (frame(b"\x92\xa1x\x01"), "FRAME_SHAPE"),        # an array led by a string
    (frame(b"\x92\xff\x01"), "FRAME_SHAPE"),         # led by a negative int
    (frame(b"\xdc\x00"), "FRAME_SHAPE"),             # array16 cut short
])
def test_unusual_reads_are_handed_back_whole(lanes, data, kind):
    assert fp.frame_kind(data, 1 << 20) == getattr(fp, kind)
    ls = lanes(2)
    ls.env(0).sendall(data)
    ls.env(1).sendall(REPLY)
    why, results = ls.exchange()
    assert why == fp.DONE
    assert results == [(fp.UNUSUAL, data), REPLY]  # the other lane is untouched


@native
@pytest.mark.parametrize("body, first", [(b"\xdc\x00\x02\x01\xc0", 7), (b"\xdd\x00\x00\x00\x02\x01\xc0", 9)])
def test_array16_and_array32_messages_are_whole_frames(body, first):
    assert fp.frame_kind(frame(body), 1 << 20) == fp.FRAME_ONE


@native
def test_the_cap_is_inclusive(lanes):
    data = frame(b"\x91\x01")
    assert fp.frame_kind(data, 2) == fp.FRAME_ONE
    assert fp.frame_kind(data, 1) == fp.FRAME_BIG


@native
def test_eof_and_a_closed_peer(lanes):
    ls = lanes(2)
    ls.env(0).close()
    ls.env(1).sendall(REPLY)
    why, results = ls.exchange()
    assert why == fp.DONE
    assert results == [(fp.EOF, b""), REPLY]


@native
def test_the_deadline_leaves_silent_lanes_pending(lanes):
    ls = lanes(2)
    ls.env(1).sendall(REPLY)
    started = time.monotonic()
    why, results = ls.exchange(timeout=0.2)
    waited = time.monotonic() - started
    assert why == fp.TIMEOUT
    assert results == [None, REPLY]
    assert 0.2 <= waited < 10  # never before the deadline; a bound only to catch a hang
    why, results = ls.exchange(timeout=-1)  # a deadline already past: no wait at all
    assert why == fp.TIMEOUT and results == [None, None]


@native
def test_a_foreign_fd_returns_to_the_event_loop(lanes):
    ls = lanes(2)
    r, w = os.pipe()
    try:
        ls.epoll.register(r, select.EPOLLIN)  # a log pipe, a pidfd, the client: not a lane
        os.write(w, b"log line")
        ls.env(0).sendall(REPLY)
        why, results = ls.exchange(timeout=5)
        assert why == fp.FOREIGN
        assert results[1] is None
        assert os.read(r, 100) == b"log line"  # left unread, for the event loop
    finally:
        ls.epoll.unregister(r)
        os.close(r)
        os.close(w)


@native
def test_a_short_write_returns_before_waiting(lanes):
    ls = lanes(2)
    big = b"\x00" * (8 << 20)  # more than a socket buffer holds
    ls.env(1).sendall(REPLY)
    why, results = ls.exchange([big, b"hi"])
    assert why == fp.SHORT_WRITE
    kind, sent = results[0]
    assert kind == fp.SHORT_WRITE_KIND and 0 < sent < len(big)
    assert results[1] is None  # written, not read: the pure path takes over from here
    assert ls.env(1).recv(10) == b"hi"


@native
def test_the_byte_budget_stops_reading(lanes):
    ls = lanes(3)
    for i in range(3):
        ls.env(i).sendall(REPLY)
    why, results = ls.exchange(budget=len(REPLY) + 1)
    assert why == fp.BUDGET
    assert sum(r is not None for r in results) == 2  # the read that passed the budget, and no more
    assert sum(len(r) for r in results if r is not None) == 2 * len(REPLY)


@native
def test_a_signal_handler_that_raises_interrupts_the_wait(lanes):
    ls = lanes(1)

    class Stop(Exception):
        pass

    def handler(signum, frame_):
        raise Stop

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 0.1)
    try:
        with pytest.raises(Stop):
            ls.exchange(timeout=20)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@native
@pytest.mark.parametrize("fds, wfds, frames, error", [
    ([3, 3], [3, 3], [None, None], ValueError),  # one fd for two lanes
    ([-1], [-1], [None], ValueError),          # a lane with no channel
    ([0], [-1], [None], ValueError),           # a lane with no write end
    ([1 << 30], [0], [None], ValueError),      # no such fd
    ([0], [1 << 30], [None], ValueError),      # no such write fd
    ([0], [0], [b"x", b"y"], ValueError),      # counts differ
    ([0], [0, 1], [None], ValueError),         # counts differ
    ([0], [0], ["text"], TypeError),           # not bytes
])
def test_bad_arguments_are_refused_before_any_write(lanes, fds, wfds, frames, error):
    ls = lanes(1)
    with pytest.raises(error):
        fp.exchange(ls.epoll.fileno(), fds, wfds, frames, time.monotonic() + 1, 1 << 20, 1 << 30)


@native
def test_a_reply_bigger_than_one_read_is_handed_back_in_pieces(lanes):
    ls = lanes(1)
    big = wire.encode([wire.STEPPED, 1, b"x" * (200 << 10), 0.0, False, False, {}])
    ls.env(0).setblocking(False)
    sent = ls.env(0).send(big)
    got = b""
    reader = wire.FrameReader(wire.Limits(1 << 22))
    messages = []
    while len(got) < len(big):
        if sent < len(big):
            try:
                sent += ls.env(0).send(big[sent:])
            except BlockingIOError:
                pass
        why, (result,) = ls.exchange(max_frame=1 << 22)
        assert why == fp.DONE
        kind, data = result
        assert kind == fp.UNUSUAL and 0 < len(data) <= fp.READ_SIZE
        got += data
        messages += reader.feed(data)
    assert got == big and len(messages) == 1 and messages[0][2] == b"x" * (200 << 10)


# --- fuzz -------------------------------------------------------------------------------------


def python_kind(data: bytes, max_frame: int):
    """The Python framer's view of one read from an empty buffer, in
    frame_kind's terms, and the messages it decoded (None: it raised)."""
    reader = wire.FrameReader(wire.Limits(max_frame))
    try:
        messages = reader.feed(data)
    except wire.ProtocolError as exc:
        messages = None
        if "over the cap" in str(exc) and int.from_bytes(data[:4], "little") > max_frame:
            return fp.FRAME_BIG, None
    if len(data) < 4:
        return fp.FRAME_SHORT, messages
    length = int.from_bytes(data[:4], "little")
    assert length <= max_frame  # else the framer raised above
    if len(data) - 4 < length:
        assert messages == [] and reader.pending == len(data)
        return fp.FRAME_SHORT, messages
    if len(data) - 4 > length:
        return fp.FRAME_EXTRA, messages
    return fp.FRAME_ONE, messages


ints64 = st.integers(-(2**63), 2**64 - 1)
frames_st = st.lists(st.builds(lambda code, rest: wire.encode([code, *rest]), st.integers(0, 200),
                               st.lists(ints64 | st.text(max_size=8) | st.none(), max_size=3)),
                     max_size=4)


@native
@settings(max_examples=1000, deadline=None)
@given(data=st.binary(max_size=64) | frames_st.map(b"".join), max_frame=st.sampled_from([0, 1, 5, 64, 4096]))
def test_frame_kind_agrees_with_the_python_framer(data, max_frame):
    """The same frame boundaries and cap as the Python framer; a message it
    decodes led by a code in 0..127 (every code there is) is FRAME_ONE, and
    FRAME_SHAPE only refuses what is not such a message (a body that does not
    decode, or a code over 127): those go the pure way, which names them."""
    kind = fp.frame_kind(data, max_frame)
    theirs, messages = python_kind(data, max_frame)
    if theirs == fp.FRAME_ONE:
        decoded = messages is not None and len(messages) == 1
        if decoded and 0 <= messages[0][0] <= 127:
            assert kind == fp.FRAME_ONE
        elif kind == fp.FRAME_SHAPE:
            assert not decoded or not 0 <= messages[0][0] <= 127
        else:  # FRAME_ONE for a body that does not decode: the pure decoder refuses it
            assert kind == fp.FRAME_ONE and not decoded
    else:
        assert kind == theirs


@native
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=frames_st, garbage=st.binary(max_size=32), data=st.data())
def test_random_streams_cut_anywhere_lose_no_byte(frames, garbage, data):
    """A stream (frames, then garbage) written to a real socket in random
    pieces: whatever exchange returns, read after read, is each piece as
    written (a piece under one read size comes back in one read), so the
    FrameReader that is fed it sees exactly what the pure path's reads give."""
    stream = b"".join(frames) + garbage
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8), label="cuts"))
    pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)])]
    ls = Lanes(1)
    try:
        got = []
        for piece in pieces:
            if not piece:
                continue
            ls.env(0).sendall(piece)
            why, (result,) = ls.exchange(max_frame=4096)
            assert why == fp.DONE
            if type(result) is bytes:
                assert fp.frame_kind(result, 4096) == fp.FRAME_ONE
                got.append(result)
            else:
                assert result[0] == fp.UNUSUAL and fp.frame_kind(result[1], 4096) != fp.FRAME_ONE
                got.append(result[1])
        assert got == [piece for piece in pieces if piece]
    finally:
        ls.close()


# --- the pool --------------------------------------------------------------------------------


@native
def test_a_pool_runs_the_native_path_and_the_environment_can_force_python(monkeypatch):
    monkeypatch.delenv("BOLTZLABS_PURE", raising=False)
    with RLPool(COUNTER, 3, step_timeout=10) as pool:
        assert pool.fast_path is True
        pool.reset(seed=0)
        native_obs = [pool.step([1, 0, 1])[:3] for _ in range(3)]
    monkeypatch.setenv("BOLTZLABS_PURE", "1")
    with RLPool(COUNTER, 3, step_timeout=10) as pool:
        assert pool.fast_path is False
        pool.reset(seed=0)
        pure_obs = [pool.step([1, 0, 1])[:3] for _ in range(3)]
    for (o1, r1, d1), (o2, r2, d2) in zip(native_obs, pure_obs):
        assert o1 == o2 and (r1 == r2).all() and (d1 == d2).all()


@native
def test_log_output_mid_step_returns_to_the_event_loop_and_the_step_completes(env_dir, monkeypatch):
    """An env that prints in every step makes its log pipe ready during the
    native wait: the native call returns FOREIGN, the event loop reads the log, and
    the step finishes with every lane's reply."""
    monkeypatch.delenv("BOLTZLABS_PURE", raising=False)
    source = env_dir("""
        import sys
        from boltzlabs.env import serve

        def reset(seed):
            return 0

        def step(action):
            print("stepping", action, flush=True)
            return action, 1.0, False, {}

        serve(reset=reset, step=step)
    """)
    with RLPool(source, 4, step_timeout=10) as pool:
        assert pool.fast_path
        pool.reset()
        for k in range(5):
            obs, _, dones, infos = pool.step([k] * 4)
            assert obs == [k] * 4 and not dones.any(), infos
        assert "stepping 4" in pool.log(2)


def test_without_the_extension_pools_run_python_and_warn_once(tmp_path):
    """A host that could not build the extension: pools run the pure path
    and say so with one RuntimeWarning per process, however many pools. The
    missing build is simulated in the worker too: a sitecustomize on
    PYTHONPATH (which the worker inherits) refuses boltzlabs.worker._fastpath."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import sys\n"
        "class Refuse:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'boltzlabs.worker._fastpath':\n"
        "            raise ImportError('no compiler here')\n"
        "sys.meta_path.insert(0, Refuse())\n")
    script = f"""
import warnings
warnings.simplefilter("default")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("default")
    from boltzlabs import RLPool
    for _ in range(2):
        with RLPool({str(COUNTER)!r}, 2, step_timeout=10) as pool:
            assert pool.fast_path is False
            pool.reset(seed=0)
            assert pool.step([1, 1])[0] == [{{"t": 1}}, {{"t": 1}}]
notes = [str(w.message) for w in caught if "not built" in str(w.message)]
print(len(notes), "no compiler here" in notes[0])
"""
    env = dict(os.environ, PYTHONPATH=f"{hide}:{ROOT}")
    env.pop("BOLTZLABS_PURE", None)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=str(tmp_path), env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "True"]


@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("gcc") is None, reason="no C compiler here (ci/setup.sh installs gcc)")
def test_a_wheel_built_from_the_tree_carries_the_extension_and_uses_it(tmp_path):
    """pip builds native/fastpath.c from a plain copy of the tree (no editable
    install, no build directory), and the installed package imports it."""
    import zipfile

    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(ROOT)],
                   check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = wheels.glob("boltzlabs-*.whl")
    assert [n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("boltzlabs/worker/_fastpath")]
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    code = "import boltzlabs.worker._fastpath as f; print(f.__file__)"
    out = subprocess.run([sys.executable, "-S", "-c", code], env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(str(site / "boltzlabs" / "worker" / "_fastpath"))


@native
@pytest.mark.parametrize("deadline", [float("nan"), float("-inf")])
def test_a_deadline_that_is_not_a_time_waits_for_nothing(lanes, deadline):
    ls = lanes(1)
    why, results = fp.exchange(ls.epoll.fileno(), ls.fds, ls.fds, [None], deadline, 1 << 20, 1 << 30)
    assert why == fp.TIMEOUT and results == [None]


@native
def test_an_infinite_deadline_still_returns_when_every_lane_answered(lanes):
    ls = lanes(1)
    ls.env(0).sendall(REPLY)
    why, results = fp.exchange(ls.epoll.fileno(), ls.fds, ls.fds, [None], float("inf"), 1 << 20, 1 << 30)
    assert why == fp.DONE and results == [REPLY]


# --- a lane of two pipes (the default channel: docs/wire.md#the-channel) -------------------------


class PipeLane:
    """One lane as the worker holds a pipe channel: it writes `wfd` (the env
    reads `env_r`) and reads `rfd` (the env writes `env_w`), rfd in epoll."""

    def __init__(self):
        self.env_r, self.wfd = os.pipe()
        self.rfd, self.env_w = os.pipe()
        os.set_blocking(self.rfd, False)
        os.set_blocking(self.wfd, False)
        self.epoll = select.epoll()
        self.epoll.register(self.rfd, select.EPOLLIN)

    def exchange(self, frame, timeout=2.0):
        return fp.exchange(self.epoll.fileno(), [self.rfd], [self.wfd], [frame], time.monotonic() + timeout,
                           1 << 20, 1 << 30)

    def close(self):
        self.epoll.close()
        for fd in (self.env_r, self.wfd, self.rfd, self.env_w):
            try:
                os.close(fd)
            except OSError:
                pass


@pytest.fixture
def pipe_lane():
    lane = PipeLane()
    yield lane
    lane.close()


@native
def test_a_pipe_lane_is_written_on_its_write_end_and_read_on_its_read_end(pipe_lane):
    os.write(pipe_lane.env_w, REPLY)
    why, results = pipe_lane.exchange(b"request")
    assert why == fp.DONE and results == [REPLY]
    assert os.read(pipe_lane.env_r, 100) == b"request"


@native
def test_a_full_pipe_is_a_short_write(pipe_lane):
    capacity = fcntl.fcntl(pipe_lane.wfd, 1032)  # F_GETPIPE_SZ
    why, results = pipe_lane.exchange(b"x" * (capacity + 100))
    assert why == fp.SHORT_WRITE and results == [(fp.SHORT_WRITE_KIND, capacity)]


@native
def test_a_pipe_whose_reader_is_gone_fails_the_write_without_a_signal(pipe_lane):
    """EPIPE, not SIGPIPE (Python ignores it): the write counts as done, as
    on a closed socket, and the lane waits for its reply or its deadline."""
    os.close(pipe_lane.env_r)
    why, results = pipe_lane.exchange(b"request", timeout=0.2)
    assert why == fp.TIMEOUT and results == [None]


@native
def test_a_write_end_waiting_for_room_is_the_event_loops_business(pipe_lane):
    pipe_lane.epoll.register(pipe_lane.wfd, select.EPOLLOUT)  # as reactor._watch_out does
    why, results = pipe_lane.exchange(None)
    assert why == fp.FOREIGN and results == [None]
