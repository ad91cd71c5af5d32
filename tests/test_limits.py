"""The adversarial suite for resource limits, bounded input and killing for sure.

One test per attack, in both spawn modes. Each asserts that the kernel
refused the attack where the policy says it must (a fork bomb at pids.max,
EMFILE, EFBIG, ENOSPC, the OOM killer), that the lane reports a limit that
killed it by name, and that the other lanes, the worker and a new pool never
noticed. Limits come from sandbox/policy.toml [env_limits]; tests lower them
per pool with RLPool(limits=...).
"""

import errno
import os
import resource
import signal
import struct
import subprocess
import sys
import time
import warnings
from pathlib import Path

import msgpack
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from boltzlabs import EnvStartError, RLPool, wire
from boltzlabs.host.cgroups import PoolView
from boltzlabs.host.policy import load_policy
from conftest import COUNTER, TESTS, gone, scaled, wait_until

HOSTILE = TESTS / "envs" / "hostile"
MiB = 1 << 20


def descendants() -> set:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def assert_own_lanes(obs, rewards, infos, actions, skip=()):
    """Every lane not in `skip` answered with its own lane and action."""
    for i, action in enumerate(actions):
        if i in skip:
            continue
        assert obs[i] == {"lane": i, "echo": action}, (i, obs[i], infos[i])
        assert rewards[i] == float(i) and infos[i] == {"lane": i}, (i, infos[i])


def test_policy_has_every_env_limit():
    table = load_policy().sandbox["env_limits"]
    assert {"memory", "pids", "pool_pids", "open_files", "file_size", "core_size", "straggler_grace"} <= set(table)
    assert table["core_size"] == 0


@pytest.mark.parametrize(
    "limits, message",
    [
        ({"pidz": 3}, "unknown env limit"),
        ({"pids": 2}, "at least 8"),
        ({"open_files": "many"}, "whole number"),
        ({"straggler_grace": 0}, "positive number"),
        ({"file_size": "lots"}, "cannot read"),
        # The whole pool's cap: a count or a share, and always below the host's task limit.
        ({"pool_pids": 4}, "at least 8"),
        ({"pool_pids": "100%"}, "share below 100%"),
        ({"pool_pids": "many%"}, "share below 100%"),
        ({"pool_pids": True}, "whole number of tasks"),
        ({"pool_pids": 10**9}, "not below this host's task limit"),
    ],
)
def test_bad_limits_are_refused_before_anything_starts(limits, message):
    before = descendants()
    with pytest.raises(ValueError, match=message):
        RLPool(COUNTER, 1, limits=limits)
    assert descendants() == before


RLIMITS_AT_IMPORT = """
import resource
from boltzlabs.env import serve
AT_IMPORT = {name: list(resource.getrlimit(getattr(resource, "RLIMIT_" + name))) for name in ("NOFILE", "FSIZE", "CORE")}
serve(reset=lambda seed: AT_IMPORT, step=lambda action: (AT_IMPORT, 0.0, False, {}))
"""


def test_rlimits_bind_env_code_from_its_first_line(pool_factory, env_dir, spawn):
    limits = {"open_files": 100, "file_size": "1M"}
    # At import: in template mode that is the template itself.
    at_import = pool_factory(env_dir(RLIMITS_AT_IMPORT), 2, limits=limits).reset(seed=0)
    for seen in at_import:
        assert seen["FSIZE"] == [MiB, MiB] and seen["CORE"] == [0, 0]
        assert seen["NOFILE"][1] <= max(100, 2 + 64)  # the template has room for its pipes
    pool = pool_factory(HOSTILE, 2, limits=limits)
    pool.reset(seed=0)
    obs, _, _, infos = pool.step([{"op": "rlimits"}] * 2)
    for o in obs:
        assert o["out"]["NOFILE"] == [100, 100] and o["out"]["FSIZE"] == [MiB, MiB], o
        assert o["out"]["CORE"] == [0, 0]
        assert "not allowed to raise" in o["out"]["raise"]  # hard = soft: the env can only lower them


# -- pids --------------------------------------------------------------------------


def test_fork_bomb_hits_its_pids_limit_and_disturbs_nobody(spawn):
    before = descendants()
    pool = RLPool(HOSTILE, 3, spawn=spawn, step_timeout=scaled(30), limits={"pids": 32})
    try:
        pool.reset(seed=0)
        groups, view = pool._cgroup, PoolView(pool._cgroup)
        obs, rewards, _, infos = pool.step([{"op": "bomb", "s": scaled(1.0)}, 7, 8])
        assert "Resource temporarily unavailable" in obs[0]["out"]["refused"], obs[0]
        assert_own_lanes(obs, rewards, infos, [None, 7, 8], skip={0})
        assert view.pids_limit(0) == 32
        assert view.pids_current(0) == 32  # full, and held full by the bomb
        assert view.pids_refused(0) > 0 and pool.states()[0] == "idle"
        # The bomb goes on; other lanes and a new pool do not notice.
        obs, rewards, _, infos = pool.step([1, 2, 3])
        assert_own_lanes(obs, rewards, infos, [1, 2, 3], skip={0})
        with RLPool(HOSTILE, 2, spawn=spawn) as other:
            other.reset(seed=0)
            obs, rewards, _, infos = other.step([4, 5])
            assert_own_lanes(obs, rewards, infos, [4, 5])
        # A hard reset ends the bomb, and its leftovers never eat the new sandbox's pids.
        pool.reset(where=[0], hard=True, seed=0)
        assert "error" not in pool.reset_infos[0], pool.reset_infos[0]
        assert view.pids_current(0) < 8
        obs, rewards, _, infos = pool.step([1, 2, 3])
        assert_own_lanes(obs, rewards, infos, [1, 2, 3])
        pool.step([{"op": "bomb", "s": scaled(0.5)}, 1, 2])  # and one still running at close
    finally:
        pool.close()
    assert descendants() == before  # the whole bomb was reaped at close
    assert not any(Path(g).exists() for g in groups)


@pytest.mark.parametrize("spawn, n", [("template", 7), ("exec", 3)])
def test_a_pool_whose_envs_at_rest_pass_its_pids_cap_is_refused_before_any_starts(spawn, n):
    """n envs need n tasks at rest in template mode (3 each in exec mode) and the template
    and probe 2: past the cap of 8, a pool that would fail env by env is refused at once,
    saying what it needs at the least and the two ways out."""
    before = descendants()
    with pytest.raises(ValueError) as caught:
        RLPool(COUNTER, n, spawn=spawn, limits={"pool_pids": 8})
    text = str(caught.value)
    assert (
        f"a pool of {n} envs in {spawn} mode holds at least {n * (1 if spawn == 'template' else 3) + 2} tasks" in text
    )
    assert "limits.pool_pids" in text and "workers=k" in text
    assert descendants() == before
    with RLPool(COUNTER, 3 if spawn == "template" else 1, spawn=spawn, limits={"pool_pids": 8}) as pool:
        pool.reset(seed=0)  # under the cap: it starts


def test_envs_that_together_pass_the_pool_cap_stop_there_and_other_pools_do_not_notice(spawn):
    """Each env may have 64 tasks, but the pool (every env, the template and its
    probe) 96: three envs forking until refused fill the pool's cap, not
    theirs (3 x 64 = 192), each sees EAGAIN, and another pool forks freely."""
    before = descendants()
    pool = RLPool(HOSTILE, 3, spawn=spawn, step_timeout=scaled(30), limits={"pids": 64, "pool_pids": 96})
    try:
        pool.reset(seed=0)
        view = PoolView(pool._cgroup)
        assert view.pids_limit() == 96 and view.pids_limit(0) == 64
        obs, rewards, _, infos = pool.step([{"op": "fork_until_refused"}] * 3)
        for o in obs:
            assert "Resource temporarily unavailable" in o["out"]["refused"], obs
        assert view.pids_current() == 96  # full: the sleeping children hold it
        held = [view.pids_current(i) for i in range(3)]
        assert sum(held) <= 96 and min(held) < 64, held  # the pool's cap, not each env's
        obs, rewards, _, infos = pool.step([1, 2, 3])  # the envs still serve
        assert_own_lanes(obs, rewards, infos, [1, 2, 3])
        with RLPool(HOSTILE, 2, spawn=spawn, limits={"pids": 64}) as other:  # a pool of its own cap
            other.reset(seed=0)
            obs, *_ = other.step([{"op": "fork_until_refused"}, 5])
            assert obs[0]["out"]["forked"] >= 60, obs[0]  # its env's own 64, less itself
            assert obs[1] == {"lane": 1, "echo": 5}
        # An env that dies at the pool's cap is told so.
        _, _, dones, infos = pool.step([{"op": "fork_until_refused", "then": "exit"}, 1, 2])
        assert dones[0] and "the pool's limit of 96 tasks" in infos[0]["error"], infos[0]
    finally:
        pool.close()
    assert descendants() == before


BOMB_AT_IMPORT = """
import os, time
from boltzlabs.env import serve
forked = 0
while True:  # at import: in template mode, in the template itself
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        while True:
            time.sleep(3600)
    forked += 1
serve(reset=lambda seed: forked, step=lambda action: (forked, 0.0, False, {}))
"""


def test_a_fork_bomb_at_import_is_bounded_too(env_dir, spawn):
    before = descendants()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pool = RLPool(env_dir(BOMB_AT_IMPORT), 2, spawn=spawn, limits={"pids": 24})
    with pool:
        # In both modes the bomb runs in the env itself (the template never
        # imports env.py), bounded by the env's own pids limit.
        assert pool.spawn == spawn, [str(w.message) for w in caught]
        forked = pool.reset(seed=0)
        assert all(0 < f < 24 for f in forked), forked
        assert pool.step([1, 1])[0] == forked
    assert descendants() == before


def test_a_fork_bomb_at_import_in_a_trusted_template_is_bounded_by_the_templates_cgroup(env_dir):
    """In a trusted template the bomb runs in the template, bounded by the env's
    pids limit on the template's own cgroup; it left processes running, so the
    pool fell back to exec mode (and the template's namespace took them with it)."""
    before = descendants()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pool = RLPool(env_dir(BOMB_AT_IMPORT), 2, spawn="template", trust_env=True, limits={"pids": 24})
    with pool:
        assert pool.spawn == "exec"
        assert any("env.py's import left processes running" in str(w.message) for w in caught), caught
        forked = pool.reset(seed=0)
        assert all(0 < f < 24 for f in forked), forked
    assert descendants() == before


def test_an_env_that_dies_at_its_pids_limit_says_so(pool_factory):
    pool = pool_factory(HOSTILE, 2, limits={"pids": 16})
    pool.reset(seed=0)
    _, _, dones, infos = pool.step([{"op": "fork_until_refused", "then": "exit"}, 1])
    assert dones[0] and "exited with code 11" in infos[0]["error"], infos[0]
    assert "pids limit" in infos[0]["error"] and "16 tasks" in infos[0]["error"], infos[0]
    assert "error" not in infos[1]
    pool.reset(where=[0], seed=0)  # its leftovers are killed with it; the lane is usable again
    assert pool.step([1, 1])[0][0] == {"lane": 0, "echo": 1}


FORKS_AT_START = """
import os, sys, time
while True:  # at import: children that hold their task until the lane is killed
    try:
        if os.fork() == 0:
            time.sleep(600)
            os._exit(0)
    except OSError:
        sys.exit(11)
"""
ALLOCATES_AT_START = """
held = bytearray(256 << 20)
held[:: 4096] = b"x" * len(held[:: 4096])
"""


@pytest.mark.parametrize(
    "source, n, kwargs, fix",
    [
        (FORKS_AT_START, 2, {"limits": {"pids": 16}}, "limits={'pids': N}) gives each env more tasks"),
        (FORKS_AT_START, 4, {"limits": {"pids": 64, "pool_pids": 40}}, "limits={'pool_pids': N})"),
        (ALLOCATES_AT_START, 2, {"memory_limit": "64M"}, "memory_limit=...) gives each env more"),
    ],
    ids=["pids", "pool_pids", "memory"],
)
def test_an_env_that_dies_at_a_limit_while_starting_is_told_which_limit_to_raise(
    env_dir, spawn, source, n, kwargs, fix
):
    """Not "fix the error in env.py": its code may be right, for a bigger limit."""
    with pytest.raises(EnvStartError) as caught:
        RLPool(env_dir(source), n, spawn=spawn, start_timeout=scaled(60), **kwargs)
    message = str(caught.value)
    assert fix in message, message
    assert "Fix the error in" not in message, message


# -- memory, disk, files -------------------------------------------------------------


def test_memory_hog_is_oom_killed_by_name_and_never_swaps(pool_factory):
    pool = pool_factory(HOSTILE, 2, limits={"memory": "64M"})
    pool.reset(seed=0)
    view = PoolView(pool._cgroup)
    assert view.memory_limit(0) == 64 * MiB and view.memory_limit(1) == 64 * MiB
    assert view.swap_limit(0) == 0  # swap off for the env: memory+swap capped at the limit itself
    obs, rewards, dones, infos = pool.step([{"op": "alloc", "mb": 256}, 1])
    assert dones[0] and "OOM" in infos[0]["error"] and "SIGKILL" in infos[0]["error"], infos[0]
    assert view.oom_kills(0) > 0 and view.oom_kills(1) == 0
    assert view.swap_used(0) == 0
    assert_own_lanes(obs, rewards, infos, [None, 1], skip={0})
    pool.reset(where=[0], seed=0)
    assert pool.step([{"op": "alloc", "mb": 16}, 1])[0][0]["out"] == {"held_mb": 16}


def test_disk_fill_is_enospc_and_nothing_else(pool_factory):
    pool = pool_factory(HOSTILE, 2, workspace_size="8M")
    pool.reset(seed=0)
    obs, rewards, dones, infos = pool.step([{"op": "fill"}, {"op": "fill"}])
    for o in obs:  # each env filled its own workspace, to its own cap
        assert o["out"]["errno"] == errno.ENOSPC, o
        assert 6 * MiB <= o["out"]["written"] <= 8 * MiB, o
    assert not dones.any() and pool.states() == ["idle", "idle"]
    obs, rewards, _, infos = pool.step([1, 2])
    assert_own_lanes(obs, rewards, infos, [1, 2])


def test_fd_exhaustion_is_emfile_inside_and_the_worker_keeps_its_fds(pool_factory):
    pool = pool_factory(HOSTILE, 2, limits={"open_files": 64})
    pool.reset(seed=0)
    worker = psutil.Process(pool._proc.pid)
    fds = worker.num_fds()
    obs, rewards, dones, infos = pool.step([{"op": "open_files"}, 1])
    assert obs[0]["out"]["errno"] == errno.EMFILE and obs[0]["out"]["opened"] < 64, obs[0]
    assert_own_lanes(obs, rewards, infos, [None, 1], skip={0})
    assert worker.num_fds() == fds
    obs, rewards, _, infos = pool.step([3, 4])
    assert_own_lanes(obs, rewards, infos, [3, 4])


def test_file_size_limit_is_efbig_or_a_named_sigxfsz(pool_factory, spawn):
    pool = pool_factory(HOSTILE, 2, workspace_size="16M", limits={"file_size": "1M"})
    pool.reset(seed=0)
    obs, _, dones, _ = pool.step([{"op": "fsize"}, 1])
    # Python ignores SIGXFSZ, so its write fails with EFBIG and the env lives.
    assert obs[0]["out"]["errno"] == errno.EFBIG and obs[0]["out"]["written"] == MiB, obs[0]
    assert not dones[0]
    # A process that does not ignore it is killed by SIGXFSZ: the lane names the limit.
    obs, rewards, dones, infos = pool.step([{"op": "fsize", "signal": True}, 1])
    if spawn == "exec":
        assert dones[0] and "SIGXFSZ" in infos[0]["error"] and "file size limit" in infos[0]["error"], infos[0]
    else:
        # A template child is pid 1 of its pid namespace, and the kernel does not
        # deliver a signal it raises itself to a namespace's init when the action
        # is the default: the write fails with EFBIG instead. Either way, no byte
        # past the limit.
        assert obs[0]["out"]["errno"] == errno.EFBIG and obs[0]["out"]["written"] == MiB, obs[0]
    assert_own_lanes(obs, rewards, infos, [None, 1], skip={0})


@pytest.fixture
def cores_allowed():
    """The host's core limit raised to unlimited for this test (root may), so
    that only the pool's own limit can stop a core."""
    before = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    yield
    resource.setrlimit(resource.RLIMIT_CORE, before)


def test_no_core_dump_is_written(pool_factory, cores_allowed):
    if not Path("/proc/sys/kernel/core_pattern").read_text().startswith("core"):
        pytest.skip("the host pipes core dumps to a helper; a file in the workspace cannot be observed")
    # The control: with core dumps allowed, the same crash writes a core.
    allowed = pool_factory(HOSTILE, 1, limits={"core_size": "64M"})
    allowed.reset(seed=0)
    out = allowed.step([{"op": "abort_child"}])[0][0]["out"]
    assert out["signal"] == signal.SIGABRT and out["core_dumped"] and any(f.startswith("core") for f in out["files"])
    pool = pool_factory(HOSTILE, 1)  # the policy: core_size = 0
    pool.reset(seed=0)
    out = pool.step([{"op": "abort_child"}])[0][0]["out"]
    assert out["signal"] == signal.SIGABRT and not out["core_dumped"], out
    assert not any(f.startswith("core") for f in out["files"]), out


# -- deadlines ----------------------------------------------------------------------------


def test_a_straggler_burning_cpu_is_killed_after_its_grace(pool_factory):
    pool = pool_factory(HOSTILE, 2, step_timeout=scaled(0.5), limits={"straggler_grace": scaled(1.0)})
    pool.reset(seed=0)
    obs, rewards, dones, infos = pool.step([{"op": "spin"}, 1])
    assert infos[0]["straggler"] and "missed the step deadline" in infos[0]["error"]
    assert_own_lanes(obs, rewards, infos, [None, 1], skip={0})
    spinning = PoolView(pool._cgroup).procs(0)
    assert spinning
    # Nobody calls in between: the worker kills it on its own, deadline + grace later.
    assert wait_until(lambda: gone(spinning))
    assert pool.states()[0] == "dead"
    _, _, _, infos = pool.step([1, 1])
    assert "straggler_grace" in infos[0]["error"], infos[0]
    # The async path too.
    pool.reset(where=[0], seed=0)
    pool.send([{"op": "spin"}], env_ids=[0])
    _, _, _, _, infos = pool.recv()
    assert infos[0]["straggler"]
    assert wait_until(lambda: pool.states()[0] == "dead")


# -- bounded input ---------------------------------------------------------------------


def test_a_1_gib_stdout_flood_costs_the_worker_bounded_memory(pool_factory):
    pool = pool_factory(HOSTILE, 2, step_timeout=120)
    pool.reset(seed=0)
    pool.step([{"op": "flood", "mb": 16}, 1])  # the worker's buffers are warm
    worker = psutil.Process(pool._proc.pid)
    rss, cpu = worker.memory_info().rss, sum(worker.cpu_times()[:2])
    started = time.monotonic()
    obs, rewards, _, infos = pool.step([{"op": "flood", "mb": 1024}, 1])
    elapsed = time.monotonic() - started
    assert obs[0]["out"] == {"flooded": 1024}
    assert_own_lanes(obs, rewards, infos, [None, 1], skip={0})
    grew = worker.memory_info().rss - rss
    print(
        f"1 GiB flood: worker RSS {grew / MiB:+.1f} MiB, worker CPU {sum(worker.cpu_times()[:2]) - cpu:.2f} s, "
        f"step {elapsed:.2f} s"
    )
    assert grew < 16 * MiB, grew
    tail = pool.log(0).split("--- env 0 ---\n")[-1]
    assert len(tail) <= load_policy().pool_limits().log_tail and tail.endswith("x")


def test_a_2_gib_length_prefix_breaks_only_its_lane(pool_factory):
    pool = pool_factory(HOSTILE, 3)
    pool.reset(seed=0)
    worker = psutil.Process(pool._proc.pid)
    rss = worker.memory_info().rss
    obs, rewards, dones, infos = pool.step([5, {"op": "prefix", "length": 2 << 30}, 6])
    assert dones[1] and "invalid frame" in infos[1]["error"], infos[1]
    assert_own_lanes(obs, rewards, infos, [5, None, 6], skip={1})
    assert worker.memory_info().rss - rss < 16 * MiB  # refused before a byte of the body
    pool.reset(where=[1], seed=0)
    obs, rewards, _, infos = pool.step([1, 2, 3])
    assert_own_lanes(obs, rewards, infos, [1, 2, 3])


NO_HANDSHAKE = """
import os, time
from boltzlabs.runtime import serve as runtime

serve_loop = runtime._serve_loop

def hang(*args):
    if os.environ.get("BOLTZLABS_ENV_INDEX") == "2":  # the env, in both modes
        time.sleep(600)
    return serve_loop(*args)

runtime._serve_loop = hang
runtime.serve(reset=lambda seed: 0, step=lambda action: (0, 0.0, False, {}))
"""


def test_an_env_that_never_answers_its_handshake_is_named(env_dir, spawn):
    before = descendants()
    started = time.monotonic()
    with pytest.raises(EnvStartError) as caught:
        RLPool(env_dir(NO_HANDSHAKE), 4, start_timeout=scaled(2), spawn=spawn)
    assert time.monotonic() - started < scaled(60)
    assert caught.value.env_index == 2 and "env 2" in str(caught.value)
    assert f"did not complete its handshake within {scaled(2):g} s" in str(caught.value)
    assert wait_until(lambda: descendants() == before)
    with RLPool(HOSTILE, 2, spawn=spawn) as pool:
        pool.reset(seed=0)
        assert pool.step([1, 2])[0] == [{"lane": 0, "echo": 1}, {"lane": 1, "echo": 2}]


# -- worker-level decode fuzz -------------------------------------------------------------


def _frame(body: bytes) -> bytes:
    return struct.pack("<I", len(body)) + body


PIECES = st.one_of(
    st.binary(min_size=1, max_size=48),  # garbage
    st.integers(1 << 24, (1 << 32) - 1).map(lambda n: struct.pack("<I", n)),  # huge length prefixes
    st.integers(1, 3000).map(lambda depth: _frame(b"\x91" * depth + b"\xc0")),  # deep nesting
    st.binary(max_size=32).map(_frame),  # well-framed garbage
    st.builds(
        lambda code, seq, lane: _frame(
            msgpack.packb([code, seq, {"lane": lane, "echo": lane}, float(lane), False, False, {"lane": lane}])
        ),
        st.sampled_from([wire.STEPPED, wire.RESET_DONE, wire.HELLO, 99]),
        st.integers(-1, 1 << 40),
        st.integers(0, 3),
    ),  # well-formed replies claiming any sequence number and any lane
)


def _cut(stream: bytes, how: str, points: list) -> list:
    if how == "whole":
        return [stream]
    if how == "bytes":
        return [stream[i : i + 1] for i in range(min(len(stream), 160))]
    edges = sorted({0, len(stream), *(p % (len(stream) + 1) for p in points)})
    return [stream[a:b] for a, b in zip(edges, edges[1:])]


def test_hostile_channel_bytes_never_crash_hang_or_cross_lanes(spawn):
    """Random and adversarial bytes on an env's channel, cut anywhere (one byte
    per read, too): the worker survives, answers every step within its
    deadline, and the other lanes always get their own data."""
    with RLPool(HOSTILE, 4, spawn=spawn, step_timeout=2.0) as pool:
        pool.reset(seed=0)

        @settings(
            max_examples=25,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(
            pieces=st.lists(PIECES, min_size=1, max_size=4),
            how=st.sampled_from(["whole", "bytes", "random"]),
            points=st.lists(st.integers(0, 1 << 16), max_size=8),
            lane=st.integers(0, 3),
            then=st.sampled_from(["exit", "exit", "return"]),
        )
        def attack(pieces, how, points, lane, then):
            chunks = _cut(b"".join(pieces), how, points)
            actions = [10 + i for i in range(4)]
            actions[lane] = {"op": "emit", "chunks": chunks, "gap": 0.001 if how != "whole" else 0, "then": then}
            started = time.monotonic()
            obs, rewards, dones, infos = pool.step(actions)
            assert time.monotonic() - started < 30  # only a hang would take this long
            assert_own_lanes(obs, rewards, infos, actions, skip={lane})
            assert pool._proc.poll() is None
            pool.reset(where=[lane], hard=True, seed=0)  # a clean lane for the next example

        attack()
        obs, rewards, _, infos = pool.step([1, 2, 3, 4])
        assert_own_lanes(obs, rewards, infos, [1, 2, 3, 4])


# -- killing for sure ------------------------------------------------------------------------


def _env_processes(pool, index: int) -> set:
    """Env `index`'s processes, as the kernel lists them in its cgroup."""
    return PoolView(pool._cgroup).procs(index)


def test_close_and_hard_reset_reap_children_that_ignore_signals(spawn):
    before = descendants()
    pool = RLPool(HOSTILE, 2, spawn=spawn)
    try:
        pool.reset(seed=0)
        pool.step([{"op": "daemons"}, {"op": "daemons"}])
        old = _env_processes(pool, 0)
        assert len(old) >= 3  # the env, a child ignoring signals, a setsid daemon (and exec mode's bwraps)
        pool.reset(where=[0], hard=True, seed=0)
        assert wait_until(lambda: gone(old)), [psutil.Process(p).cmdline() for p in old if psutil.pid_exists(p)]
        assert not old & _env_processes(pool, 0)
        obs, rewards, _, infos = pool.step([1, 2])
        assert_own_lanes(obs, rewards, infos, [1, 2])
        pool.step([{"op": "daemons"}, 2])
        everything = _env_processes(pool, 0) | _env_processes(pool, 1)
    finally:
        pool.close()
    assert gone(everything)
    assert descendants() == before


def _namespace_init(pids: set) -> int:
    """The process that is pid 1 of the env's own pid namespace."""
    for pid in pids:
        status = Path(f"/proc/{pid}/status").read_text()
        nspid = next(line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:"))
        if len(nspid) > 1 and nspid[-1] == "1":
            return pid
    raise AssertionError(f"no pid 1 of a namespace among {pids}")


def test_the_pid_namespace_takes_every_process_when_its_pid_1_dies(pool_factory):
    """Not assumed: kill only the env's pid 1 (no cgroup kill, no close) and
    every process of the env, daemons that ignore signals included, is gone."""
    pool = pool_factory(HOSTILE, 2)
    pool.reset(seed=0)
    pool.step([{"op": "daemons"}, 1])
    everything = _env_processes(pool, 0)
    os.kill(_namespace_init(everything), signal.SIGKILL)
    assert wait_until(lambda: gone(everything))
    assert wait_until(lambda: pool.states()[0] == "dead")
    _, _, _, infos = pool.step([1, 2])
    assert "SIGKILL" in infos[0]["error"] and infos[1] == {"lane": 1}


DYING_CLIENT = """
import os, sys, json
sys.path.insert(0, {root!r})
from boltzlabs import RLPool
from boltzlabs.host.cgroups import PoolView
pool = RLPool({hostile!r}, 2, spawn={spawn!r}, serialize_measurement={gated!r})
pool.reset(seed=0)
pool.step([{{"op": "daemons"}}] * 2)
view = PoolView(pool._cgroup)
print(json.dumps({{"worker": pool._proc.pid, "pids": sorted(view.procs(0) | view.procs(1)),
                  "cgroups": pool._cgroup}}), flush=True)
if {who!r} == "stopped":  # a debugger's stop, a ^Z: the worker cannot see the client go
    os.kill(pool._proc.pid, 19)
if {who!r} in ("client", "stopped"):
    os.kill(os.getpid(), 9)
os.kill(pool._proc.pid, 9)
if {who!r} == "both":
    os.kill(os.getpid(), 9)
import time; time.sleep(1)
"""


@pytest.mark.parametrize(
    "who, gated",
    [
        ("client", False),
        ("worker", False),
        ("both", False),
        # serialize_measurement freezes idle envs, and a frozen
        # task ignores SIGKILL until thawed
        ("client", True),
        ("worker", True),
        ("both", True),
        ("stopped", False),
        ("stopped", True),
    ],
)
def test_no_sandbox_outlives_a_killed_client_or_worker(spawn, who, gated):
    import json

    code = DYING_CLIENT.format(root=str(TESTS.parent), hostile=str(HOSTILE), spawn=spawn, who=who, gated=gated)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(120))
    seen = json.loads(out.stdout.strip().splitlines()[0])
    assert len(seen["pids"]) >= 6, seen  # two envs, each with children that ignore signals
    assert wait_until(lambda: gone(seen["pids"] + [seen["worker"]])), seen
    assert wait_until(lambda: not any(os.path.exists(path) for path in seen["cgroups"])), seen
