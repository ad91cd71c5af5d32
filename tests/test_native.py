"""The native step path (boltzlabs.worker._fastpath, native/fastpath.c; issue 16).

step(), the worker's entry point, is driven directly over real AF_UNIX
socketpairs (and pipe lanes) and a real epoll set, one case per outcome (a
reply vouched for, each unusual read, EOF, the deadline, a foreign fd, a short
write, the byte budget, a signal, bad arguments), then fuzzed: streams of
replies and garbage cut at random points go through a real socket and step()
(framers.NativeReader), which must vouch for every whole reply and hand
everything else back byte for byte. The pool-level tests check which path a
pool runs and that both give the same results. The walker itself, the frames
step() writes and Batch.compose are tests/test_native_step.py's; the frame
fuzz tests of test_wire.py and the attacks of test_hostile_wire.py run on
both paths too.
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
import threading
import time
from pathlib import Path

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from boltzlabs.errors import ProtocolError
from boltzlabs import RLPool, wire
from framers import ENV, SEQ, WORKER_PACK, Lanes, NativeReader, caps_of, fp, request, same

ROOT = Path(__file__).resolve().parent.parent
COUNTER = ROOT / "examples" / "counter"

native = pytest.mark.skipif(fp is None, reason="boltzlabs.worker._fastpath is not built")


def frame(body: bytes) -> bytes:
    return struct.pack("<I", len(body)) + body


REPLY = wire.encode([wire.STEPPED, SEQ, {"t": 1}, 1.0, False, False, {}])


def rest_of(batch) -> dict:
    """Batch.rest as {lane: (kind, value)}."""
    rest = {lane: (kind, value) for lane, kind, value in batch.rest}
    assert len(rest) == len(batch.rest), batch.rest  # a lane at most once
    return rest


def obs_of(batch, n: int) -> list:
    """The obs of the REPLY Batch.compose makes of n lanes: None for each
    lane step() did not complete (compose takes an override only for those)."""
    overrides = {lane: (wire.pack(None), 0.0, False, True, wire.pack({})) for lane in range(n)}
    return msgpack.unpackb(batch.compose(overrides, wire.pack([])), **ENV.kwargs)[0]


def nothing_to_read(sock) -> bool:
    sock.setblocking(False)
    try:
        sock.recv(1)
    except BlockingIOError:
        return True
    return False


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
def test_lanes_answer_and_a_lane_outside_the_call_is_neither_written_nor_read(lanes):
    ls = lanes(3)
    ls.env(0).sendall(REPLY)
    ls.env(2).sendall(REPLY)
    fds = ls.fds
    outside = [fds[0], -1, fds[2]]  # lane 1 is busy or dead: the worker leaves it out
    batch = ls.step([5, 6, 7], fds=outside)
    assert batch.why == fp.DONE and batch.done == 2 and batch.rest == []
    assert batch.held == 2 * len(REPLY)
    assert ls.env(0).recv(100) == request(5, SEQ, False) and ls.env(2).recv(100) == request(7, SEQ, False)
    assert nothing_to_read(ls.env(1))  # nothing written to lane 1
    with pytest.raises(ValueError, match="lane 1"):  # a lane outside the call is Python's to fill in
        batch.compose({}, wire.pack([]))
    assert obs_of(batch, 3) == [{"t": 1}, None, {"t": 1}]
    # Its channel ready during a later call is the event loop's business: foreign, left unread.
    ls.env(1).sendall(REPLY)
    batch = ls.step(fds=outside, timeout=5)
    assert batch.why == fp.FOREIGN and rest_of(batch) == {0: (fp.PENDING, None), 2: (fp.PENDING, None)}
    assert ls.pairs[1][0].recv(100) == REPLY


@native
@pytest.mark.parametrize(
    "data",
    [
        REPLY[:3],  # not even a whole prefix
        REPLY + REPLY,  # two frames in one read
        REPLY + b"\x00",  # a frame and the start of another
        struct.pack("<I", 2**32 - 1) + b"x" * 8,  # a prefix over the cap
        frame(b"\xc0"),  # one frame, but not an array
        frame(b"\x90\x01"),  # an empty array
        frame(b"\x92\xa1x\x01"),  # an array led by a string
        frame(b"\x92\xff\x01"),  # led by a negative int
        frame(b"\xdc\x00"),  # array16 cut short
        wire.encode([wire.STEPPED, SEQ + 1, 1, 1.0, False, False, {}]),  # a reply, but not the one due
    ],
    ids=[
        "part-prefix",
        "two-frames",
        "frame-and-a-bit",
        "prefix-over-cap",
        "not-array",
        "empty-array",
        "led-by-str",
        "led-by-negative",
        "array16-cut",
        "stale-seq",
    ],
)
def test_unusual_reads_are_handed_back_whole(lanes, data):
    ls = lanes(2)
    ls.env(0).sendall(data)
    ls.env(1).sendall(REPLY)
    batch = ls.step()
    assert batch.why == fp.DONE and batch.done == 1  # the other lane is untouched
    assert batch.rest == [(0, fp.UNUSUAL, data)]


@native
@pytest.mark.parametrize("head", [b"\xdc\x00\x07", b"\xdd\x00\x00\x00\x07"], ids=["array16", "array32"])
def test_array16_and_array32_messages_are_vouched_for(lanes, head):
    body = wire.pack([wire.STEPPED, SEQ, [1, 2], 0.5, False, True, {"k": 1}])
    reply = frame(head + body[1:])  # the same message, its array header in a wider form
    ls = lanes(1)
    ls.env(0).sendall(reply)
    batch = ls.step()
    assert batch.why == fp.DONE and batch.done == 1 and obs_of(batch, 1) == [[1, 2]]


@native
def test_the_frame_cap_is_inclusive(lanes):
    body_size = len(REPLY) - 4
    for max_frame, done in ((body_size, 1), (body_size - 1, 0)):
        ls = lanes(1)
        ls.env(0).sendall(REPLY)
        limits = wire.Limits(max_frame, arrays="check", max_depth=8, max_objects=100)
        batch = ls.step(limits=limits)
        assert batch.why == fp.DONE and batch.done == done
        assert batch.rest == ([] if done else [(0, fp.UNUSUAL, REPLY)])


@native
def test_eof_and_a_closed_peer(lanes):
    ls = lanes(2)
    ls.env(0).close()
    ls.env(1).sendall(REPLY)
    batch = ls.step()
    assert batch.why == fp.DONE and batch.done == 1
    assert batch.rest == [(0, fp.EOF, b"")]


@native
def test_the_deadline_leaves_silent_lanes_pending(lanes):
    ls = lanes(2)
    ls.env(1).sendall(REPLY)
    started = time.monotonic()
    batch = ls.step(timeout=0.2)
    waited = time.monotonic() - started
    assert batch.why == fp.TIMEOUT and batch.done == 1
    assert batch.rest == [(0, fp.PENDING, None)]
    assert 0.2 <= waited < 10  # never before the deadline; a bound only to catch a hang
    ls.env(0).sendall(REPLY)
    started = time.monotonic()
    batch = ls.step(timeout=-1)  # a deadline already past: written, then one look that does not wait
    assert batch.why == fp.TIMEOUT and batch.done == 1  # the reply already there is taken
    assert rest_of(batch) == {1: (fp.PENDING, None)}
    assert time.monotonic() - started < 5  # a bound only to catch a wait


@native
def test_a_foreign_fd_returns_to_the_event_loop(lanes):
    ls = lanes(2)
    r, w = os.pipe()
    try:
        ls.epoll.register(r, select.EPOLLIN)  # a log pipe, a pidfd, the client: not a lane
        os.write(w, b"log line")
        ls.env(0).sendall(REPLY)
        batch = ls.step(timeout=5)
        assert batch.why == fp.FOREIGN
        assert rest_of(batch)[1] == (fp.PENDING, None)
        assert os.read(r, 100) == b"log line"  # left unread, for the event loop
    finally:
        ls.epoll.unregister(r)
        os.close(r)
        os.close(w)


@native
def test_the_byte_budget_stops_reading(lanes):
    ls = lanes(3)
    for i in range(3):
        ls.env(i).sendall(REPLY)
    batch = ls.step(budget=len(REPLY) + 1)
    assert batch.why == fp.BUDGET
    # The first read is within the budget (vouched for, held); the one that passes it is
    # handed back unvouched; no third read.
    assert batch.done == 1 and batch.held == len(REPLY)
    assert sorted((kind, value) for _, kind, value in batch.rest) == [(fp.PENDING, None), (fp.UNUSUAL, REPLY)]


# --- a frame longer than one read (an image observation) -------------------------------


def image_reply(seq=SEQ, size=100_800):
    """A reply carrying an Atari-sized frame: more bytes than one read (READ_SIZE)."""
    frame_ = bytes(range(256)) * (size // 256) + bytes(size % 256)
    return wire.encode([wire.STEPPED, seq, frame_, 0.5, False, False, {"lives": 3}]), frame_


def send_later(sock, data: bytes, delay: float) -> threading.Thread:
    """Send data on sock from a thread after `delay`: the rest of a frame the env is still writing."""
    thread = threading.Thread(target=lambda: (time.sleep(delay), sock.sendall(data)), daemon=True)
    thread.start()
    return thread


@native
def test_a_frame_longer_than_a_read_is_completed_in_c_and_vouched_for(lanes):
    ls = lanes(3)
    big, pixels = image_reply()
    assert len(big) > fp.READ_SIZE
    ls.env(0).sendall(REPLY)
    ls.env(1).sendall(big[:1000])  # the first part now, the rest while step() waits
    ls.env(2).sendall(big)
    later = send_later(ls.env(1), big[1000:], 0.05)
    batch = ls.step(timeout=10)
    later.join()
    assert batch.why == fp.DONE and batch.done == 3 and batch.rest == []
    assert batch.held == len(REPLY) + 2 * len(big)
    obs, rewards, _, _, infos, _ = msgpack.unpackb(batch.compose({}, wire.pack([])), **ENV.kwargs)
    assert obs == [{"t": 1}, pixels, pixels] and infos == [{}, {"lives": 3}, {"lives": 3}]
    assert struct.unpack("<3d", rewards) == (1.0, 0.5, 0.5)


@native
def test_many_long_frames_at_once_keep_their_bytes_apart(lanes):
    """Lanes read in turns into one growing buffer (it moves as it grows):
    each lane's frame must come out whole and its own."""
    n = 8
    ls = lanes(n)
    replies = [image_reply(size=70_000 + 997 * i) for i in range(n)]
    threads = [send_later(ls.env(i), replies[i][0], 0.001 * i) for i in range(n)]
    batch = ls.step(timeout=10)
    for thread in threads:
        thread.join()
    assert batch.why == fp.DONE and batch.done == n
    obs = msgpack.unpackb(batch.compose({}, wire.pack([])), **ENV.kwargs)[0]
    assert obs == [pixels for _, pixels in replies]


@native
def test_a_frame_cut_short_is_handed_back_at_the_deadline(lanes):
    """An env that stops halfway through a frame stalls nothing past the
    deadline: the part read goes back to Python (which waits for the rest or
    names a straggler), byte for byte."""
    ls = lanes(2)
    big, _ = image_reply()
    ls.env(0).sendall(big[:-1])  # all but the last byte
    ls.env(1).sendall(REPLY)
    started = time.monotonic()
    batch = ls.step(timeout=0.3)
    assert time.monotonic() - started < 5  # only a bound to catch a hang
    assert batch.why == fp.TIMEOUT and batch.done == 1
    assert batch.rest == [(0, fp.UNUSUAL, big[:-1])]


@native
def test_end_of_file_halfway_through_a_frame_hands_back_the_part(lanes):
    ls = lanes(2)
    big, _ = image_reply()
    ls.env(0).sendall(big[:70_000])
    ls.env(0).shutdown(socket.SHUT_WR)  # the env died mid-write
    ls.env(1).sendall(REPLY)
    batch = ls.step(timeout=10)
    assert batch.why == fp.DONE and batch.done == 1
    assert batch.rest == [(0, fp.UNUSUAL, big[:70_000])]  # Python reads the end of file itself


@native
@pytest.mark.parametrize(
    "announced",
    [
        ENV.max_frame + 1,  # over the frame cap: never reserved
        1 << 20,  # within the cap, over the byte budget given below
    ],
)
def test_a_frame_announcing_more_than_the_caps_allow_reserves_nothing(lanes, announced):
    """A hostile prefix must not make step() reserve memory or wait: the first
    read goes back to Python as before, which refuses the frame."""
    ls = lanes(2)
    head = struct.pack("<I", announced) + b"\x97" + b"\x00" * 20_000
    ls.env(0).sendall(head)
    ls.env(1).sendall(REPLY)
    batch = ls.step(timeout=10, budget=512 << 10)
    assert batch.done == 1
    assert batch.rest == [(0, fp.UNUSUAL, head)]


@native
@pytest.mark.parametrize(
    "obs",
    [
        [None] * (ENV.kwargs["max_array_len"] - 1) + [[None] * 100_000],  # a huge count of tiny objects
        "nest",  # deeper than max_depth
    ],
    ids=["tiny-objects", "deep"],
)
def test_a_long_hostile_frame_is_walked_whole_and_handed_back(lanes, obs):
    """A frame longer than one read is still walked under every cap before
    anything is vouched for: over max_objects or max_depth it goes back to
    Python whole (which refuses it), never into the REPLY."""
    if obs == "nest":
        body = b"\x97\x01" + bytes([SEQ]) + b"\x91" * (ENV.max_depth + 10) + b"\xc0" * 1 + b"\x00" * 70_000
        data = frame(body)
    else:
        data = wire.encode([wire.STEPPED, SEQ, obs, 0.0, False, False, {}])
    assert len(data) > fp.READ_SIZE
    ls = lanes(1)
    writer = send_later(ls.env(0), data, 0)
    batch = ls.step(timeout=10)
    writer.join()
    assert batch.done == 0 and batch.rest == [(0, fp.UNUSUAL, data)]
    with pytest.raises(ProtocolError):
        wire.FrameReader(ENV).feed(data)


@native
def test_a_long_frame_that_is_not_the_reply_due_is_handed_back_whole(lanes):
    ls = lanes(1)
    stale, _ = image_reply(seq=SEQ + 1)
    ls.env(0).sendall(stale + REPLY[:2])  # the stale frame, and the start of another left in the socket
    batch = ls.step(timeout=10)
    assert batch.why == fp.DONE and batch.done == 0
    assert batch.rest == [(0, fp.UNUSUAL, stale)]  # exactly the frame: what follows stays for the event loop
    assert ls.env(0).fileno() >= 0 and ls.pairs[0][0].recv(10) == REPLY[:2]


@native
def test_a_sigterm_handler_that_raises_interrupts_the_wait(lanes):
    """The worker's SIGTERM handler raises to stop it: step() must let it out
    of its epoll wait (as the pure path's epoll.poll does), not wait on."""
    ls = lanes(1)

    class Stop(Exception):
        pass

    def handler(signum, frame_):
        raise Stop

    old = signal.signal(signal.SIGTERM, handler)
    timer = threading.Timer(0.1, signal.pthread_kill, (threading.main_thread().ident, signal.SIGTERM))
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(Stop) as caught:
            ls.step(timeout=20)
        assert time.monotonic() - started < 15  # the signal, not the deadline, ended it
        assert "step" in [entry.name for entry in caught.traceback]  # raised inside the call, not before it
    finally:
        timer.cancel()
        timer.join()
        signal.signal(signal.SIGTERM, old)


def _bad_calls(fd, other):
    """(rfds, wfds, packed actions, resets, caps, the exception) of step() calls refused before any write."""
    one, two, caps = WORKER_PACK.pack([0]), WORKER_PACK.pack([0, 0]), caps_of(ENV)
    return {
        "same-fd-twice": ([fd, fd], [fd, fd], two, bytes(2), caps, ValueError),
        "fd-below-minus-1": ([-2], [fd], one, bytes(1), caps, ValueError),
        "no-write-end": ([fd], [-1], one, bytes(1), caps, ValueError),
        "no-such-fd": ([1 << 30], [fd], one, bytes(1), caps, ValueError),
        "no-such-write-fd": ([fd], [1 << 30], one, bytes(1), caps, ValueError),
        "fd-past-long": ([1 << 70], [fd], one, bytes(1), caps, OverflowError),
        "fd-not-int": (["3"], [fd], one, bytes(1), caps, TypeError),
        "fds-not-list": ((fd,), [fd], one, bytes(1), caps, TypeError),
        "fewer-write-fds": ([fd, other], [fd], two, bytes(2), caps, ValueError),
        "fewer-resets": ([fd, other], [fd, other], two, bytes(1), caps, ValueError),
        "actions-not-bytes": ([fd], [fd], "text", bytes(1), caps, TypeError),
        "caps-too-few": ([fd], [fd], one, bytes(1), caps[:7], TypeError),
        "caps-deeper-than-the-stack": ([fd], [fd], one, bytes(1), caps[:6] + (1025, caps[7]), ValueError),
    }


@native
@pytest.mark.parametrize("case", sorted(_bad_calls(3, 4)))
def test_bad_arguments_are_refused_before_any_write(lanes, case):
    ls = lanes(2)
    rfds, wfds, actions, resets, caps, error = _bad_calls(*ls.fds)[case]
    with pytest.raises(error):
        fp.step(ls.epoll.fileno(), rfds, wfds, actions, SEQ, resets, time.monotonic() + 1, caps, 1 << 30)
    assert nothing_to_read(ls.env(0)) and nothing_to_read(ls.env(1))


@native
def test_a_reply_bigger_than_the_socket_buffer_is_read_as_the_env_writes_it(lanes):
    """The env's write blocks until step() has read what the socket holds:
    the frame is completed over many reads, never handed back in pieces."""
    ls = lanes(1)
    payload = b"x" * (2 << 20)
    big = wire.encode([wire.STEPPED, SEQ, payload, 0.0, False, False, {}])
    writer = send_later(ls.env(0), big, 0)
    batch = ls.step(limits=wire.Limits(4 << 20, arrays="check", max_depth=8, max_objects=100), timeout=20)
    writer.join()
    assert batch.why == fp.DONE and batch.done == 1 and batch.held == len(big)
    assert msgpack.unpackb(batch.compose({}, wire.pack([])), **ENV.kwargs)[0] == [payload]


# --- fuzz -------------------------------------------------------------------------------------


ints64 = st.integers(-(2**63), 2**64 - 1)
plain = st.recursive(
    st.none() | st.booleans() | ints64 | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
seqs = st.integers(0, 2**64 - 1)
infos = st.dictionaries(st.text(max_size=4), plain, max_size=3)
replies = st.builds(
    lambda seq, obs, reward, t, u, info: wire.encode([wire.STEPPED, seq, obs, reward, t, u, info]),
    seqs,
    plain,
    st.floats() | ints64,
    st.booleans(),
    st.booleans(),
    infos,
) | st.builds(lambda seq, obs, info: wire.encode([wire.RESET_DONE, seq, obs, info]), seqs, plain, infos)


@native
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=st.lists(replies, max_size=4), garbage=st.binary(max_size=32), data=st.data())
def test_random_reply_streams_cut_anywhere_are_vouched_for_or_handed_back_whole(frames, garbage, data):
    """Replies, then garbage, written to a real socket in random pieces and
    read by step() (framers.NativeReader checks each read it vouches for
    against Python's decode, and that every byte comes back in order): a
    piece that is exactly one whole reply, due (its seq), is vouched for;
    no other piece is; the messages are the pure FrameReader's."""
    stream = b"".join(frames) + garbage
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8), label="cuts"))
    pieces = [p for p in (stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)])) if p]
    ends, at = {}, 0  # where each reply starts -> where it ends
    for f in frames:
        ends[at] = at + len(f)
        at += len(f)
    whole, at = 0, 0
    for piece in pieces:
        whole += ends.get(at) == at + len(piece)
        at += len(piece)
    ours, theirs = NativeReader(ENV), wire.FrameReader(ENV)
    try:
        for piece in pieces:
            try:
                want = theirs.feed(piece)
            except ProtocolError:
                with pytest.raises(ProtocolError):
                    ours.feed(piece)
                break
            got = ours.feed(piece)
            assert same(got, want)
        assert ours.vouched == whole
    finally:
        ours.close()


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
        "sys.meta_path.insert(0, Refuse())\n"
    )
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
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=str(tmp_path), env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "True"]


@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("gcc") is None, reason="no C compiler here (ci/setup.sh installs gcc)")
def test_a_wheel_built_from_the_tree_carries_the_extension_and_uses_it(tmp_path):
    """pip builds native/fastpath.c from a plain copy of the tree (no editable
    install, no build directory), and the installed package imports it."""
    import zipfile

    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(ROOT)],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    (wheel,) = wheels.glob("boltzlabs-*.whl")
    assert [n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("boltzlabs/worker/_fastpath")]
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
    )
    code = "import boltzlabs.worker._fastpath as f; print(f.__file__)"
    out = subprocess.run(
        [sys.executable, "-S", "-c", code],
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(str(site / "boltzlabs" / "worker" / "_fastpath"))


@native
@pytest.mark.parametrize("deadline", [float("nan"), float("-inf")])
def test_a_deadline_that_is_not_a_time_waits_for_nothing(lanes, deadline):
    # Taken for a deadline already past: one look that does not wait, the reply there taken.
    ls = lanes(2)
    ls.env(0).sendall(REPLY)
    started = time.monotonic()
    batch = fp.step(
        ls.epoll.fileno(), ls.fds, ls.fds, WORKER_PACK.pack([0, 0]), SEQ, bytes(2), deadline, caps_of(ENV), 1 << 30
    )
    assert batch.why == fp.TIMEOUT and batch.done == 1 and batch.rest == [(1, fp.PENDING, None)]
    assert time.monotonic() - started < 5  # a bound only to catch a wait


@native
def test_an_infinite_deadline_still_returns_when_every_lane_answered(lanes):
    ls = lanes(1)
    ls.env(0).sendall(REPLY)
    batch = fp.step(
        ls.epoll.fileno(), ls.fds, ls.fds, WORKER_PACK.pack([0]), SEQ, bytes(1), float("inf"), caps_of(ENV), 1 << 30
    )
    assert batch.why == fp.DONE and batch.done == 1 and batch.rest == []


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

    def step(self, action=0, timeout=2.0):
        return fp.step(
            self.epoll.fileno(),
            [self.rfd],
            [self.wfd],
            WORKER_PACK.pack([action]),
            SEQ,
            bytes(1),
            time.monotonic() + timeout,
            caps_of(ENV),
            1 << 30,
        )

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
    batch = pipe_lane.step("request")
    assert batch.why == fp.DONE and batch.done == 1 and batch.rest == []
    assert os.read(pipe_lane.env_r, 100) == request("request", SEQ, False)


@native
def test_a_full_pipe_is_a_short_write_with_the_unsent_rest(pipe_lane):
    capacity = fcntl.fcntl(pipe_lane.wfd, 1032)  # F_GETPIPE_SZ
    action = b"x" * (capacity + 100)
    want = request(action, SEQ, False)
    batch = pipe_lane.step(action)
    assert batch.why == fp.SHORT_WRITE and batch.done == 0
    assert batch.rest == [(0, fp.SHORT_WRITE_KIND, want[capacity:])]  # the event loop writes the rest
    written = b""
    while len(written) < capacity:
        written += os.read(pipe_lane.env_r, capacity - len(written))
    assert written == want[:capacity]


@native
def test_a_pipe_whose_reader_is_gone_fails_the_write_without_a_signal(pipe_lane):
    """EPIPE, not SIGPIPE (Python ignores it): the write counts as done, as
    on a closed socket, and the lane waits for its reply or its deadline."""
    os.close(pipe_lane.env_r)
    batch = pipe_lane.step(timeout=0.2)
    assert batch.why == fp.TIMEOUT and batch.rest == [(0, fp.PENDING, None)]


@native
def test_a_write_end_waiting_for_room_is_the_event_loops_business(pipe_lane, lanes):
    pipe_lane.epoll.register(pipe_lane.wfd, select.EPOLLOUT)  # as reactor._watch_out does
    batch = pipe_lane.step()
    assert batch.why == fp.FOREIGN and batch.rest == [(0, fp.PENDING, None)]
    ls = lanes(1)  # a socket lane: the one fd watched for room is also the lane's read fd
    ls.epoll.modify(ls.fds[0], select.EPOLLIN | select.EPOLLOUT)
    batch = ls.step(timeout=5)
    assert batch.why == fp.FOREIGN and batch.rest == [(0, fp.PENDING, None)]


@native
def test_keep_heap_stops_the_per_step_page_faults_of_big_buffers():
    """What keep_heap() is for, in a real process: allocating and freeing the
    same 24 MB every "step" (as the worker does with 256 image replies) faults
    every page in again each time by default, and almost none with it."""
    script = """
import os, sys
from boltzlabs.worker import _fastpath
if sys.argv[1] == "keep":
    assert _fastpath.keep_heap()
def faults():
    return int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[7])  # minflt
for step in range(12):
    if step == 4:
        start = faults()
    bufs = [bytearray(8 << 20) for _ in range(3)]  # written: zero-filled pages are touched
    del bufs
print((faults() - start) / 8)
"""
    per_step = {}
    for mode in ("default", "keep"):
        out = subprocess.run(
            [sys.executable, "-c", script, mode],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert out.returncode == 0, out.stderr
        per_step[mode] = float(out.stdout)
    assert per_step["default"] > 3000, per_step  # 24 MB is ~6,000 pages
    assert per_step["keep"] < 300, per_step
