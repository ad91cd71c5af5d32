"""Memory from the kernel's accounting, memory_limit, and the measurement gate."""

import ast
import time
from pathlib import Path

import pytest

from boltzlabs import RLPool
from boltzlabs.host import cgroups
from boltzlabs.host.cgroups import PoolView
from conftest import PROBE, intervals, overlaps, scaled

MiB = 1 << 20


def test_envs_per_gb_tracks_a_known_allocation(probe_pool):
    # A per-env memory limit gives each env a memory cgroup of its own, so
    # memory() charges each allocation to the env that made it.
    pool = probe_pool(4, memory_limit="512M")
    pool.reset(seed=0)
    before = pool.memory()
    assert before.source.startswith(f"cgroup {PoolView(pool._cgroup).version} ")  # the kernel's, not PSS
    assert len(before.per_env) == 4 and all(b > 0 for b in before.per_env)
    epg_before = pool.envs_per_gb()
    pool.step([{"op": "alloc", "mb": 64}, 1, {"op": "alloc", "mb": 32}, 1])
    after = pool.memory()
    grew = [a - b for a, b in zip(after.per_env, before.per_env)]
    assert 60 * MiB < grew[0] < 72 * MiB, grew
    assert 28 * MiB < grew[2] < 40 * MiB, grew
    assert abs(grew[1]) < 4 * MiB and abs(grew[3]) < 4 * MiB, grew
    expected = (1 << 30) / (after.total / 4)
    assert pool.envs_per_gb() == pytest.approx(expected, rel=0.05)
    assert pool.envs_per_gb() < epg_before


def test_shared_env_memory_cgroup_without_per_env_limits(probe_pool):
    # No per-env memory limit: on cgroup v1 every env shares one memory
    # cgroup (a memory cgroup per env costs the kernel a slot per superblock
    # of the host in each: n x 3n); memory() splits it evenly over the live
    # envs, the pool's total stays exact. Each env keeps its own pids group.
    pool = probe_pool(4)
    view = PoolView(pool._cgroup)
    if view.version != "v1":
        pytest.skip("cgroup v2 pools keep a cgroup per env (one tree)")
    pool.reset(seed=0)
    memory = view.pool("memory")
    assert (memory / "envs").is_dir() and not any((memory / f"env-{i}").exists() for i in range(4))
    pids = pool.pids()
    for i in range(4):
        assert pids[i] in view.procs(i) and view.procs(i).isdisjoint(pids[:i] + pids[i + 1 :])
        assert view.pids_limit(i) is not None  # the per-env fork cap holds
        assert view.memory_limit(i) is None
    before = pool.memory()
    assert "split evenly" in before.source
    assert len(set(before.per_env)) == 1 and before.per_env[0] > 0
    pool.step([{"op": "alloc", "mb": 64}, 1, {"op": "alloc", "mb": 32}, 1])
    after = pool.memory()
    assert len(set(after.per_env)) == 1
    assert 90 * MiB < after.total - before.total < 108 * MiB, (before.total, after.total)
    # A dead lane is charged nothing; the live ones share the envs' cgroup.
    pool.step([{"op": "exit", "code": 3}, 1, 1, 1])
    memory_now = pool.memory()
    assert memory_now.per_env[0] == 0 and len(set(memory_now.per_env[1:])) == 1 and memory_now.per_env[1] > 0
    pool.reset(where=[0], hard=True, seed=0)
    assert pool.step([1] * 4)[1].tolist() == [1.0] * 4
    assert not any((memory / f"env-{i}").exists() for i in range(4))


def test_memory_limit_kills_and_reports_oom(probe_pool):
    pool = probe_pool(2, memory_limit="96M")
    view = PoolView(pool._cgroup)
    if view.version == "v1":  # a per-env limit: each env has a memory cgroup of its own
        assert not (view.pool("memory") / "envs").exists()
    pool.reset(seed=0)
    obs, rewards, dones, infos = pool.step([{"op": "alloc", "mb": 256}, 1])
    assert dones[0] and "OOM" in infos[0]["error"], infos[0]
    assert rewards[1] == 1.0 and "error" not in infos[1]
    pool.reset(where=[0], seed=0)
    obs, rewards, dones, infos = pool.step([{"op": "alloc", "mb": 16}, 1])
    assert obs[0]["out"] == {"held_mb": 16}


def test_serialize_measurement_gate(spawn):
    n = 4
    with RLPool(PROBE, n, serialize_measurement=True, step_timeout=scaled(5), spawn=spawn) as pool:
        pool.reset(seed=0)
        obs, rewards, dones, infos = pool.step([{"op": "interval", "s": 0.05}] * n)
        spans = intervals(obs)
        assert len(spans) == n and not overlaps(spans), spans
        assert pool.timing.worker_ms >= n * 50
        # Resets and normal steps still work behind the gate.
        pool.reset(where=[1], seed=3)
        assert pool.step([1] * n)[1].tolist() == [1.0] * n
    with RLPool(PROBE, n, step_timeout=scaled(5), spawn=spawn) as pool:
        pool.reset(seed=0)
        obs, *_ = pool.step([{"op": "interval", "s": scaled(0.2)}] * n)
        assert overlaps(intervals(obs))


def test_gate_holder_that_overruns_is_killed_so_the_gate_holds(spawn):
    with RLPool(PROBE, 3, serialize_measurement=True, step_timeout=scaled(0.5), spawn=spawn) as pool:
        pool.reset(seed=0)
        obs, rewards, dones, infos = pool.step(
            [{"op": "interval", "s": 0.05}, {"op": "loop"}, {"op": "interval", "s": 0.05}]
        )
        assert infos[1]["straggler"] and "holding the serialize_measurement gate" in infos[1]["error"]
        assert pool.states()[1] == "dead"
        spans = intervals([obs[0], obs[2]])
        assert not overlaps(spans)
        pool.reset(where=dones)
        assert pool.step([1, 1, 1])[1].tolist() == [1.0, 1.0, 1.0]


FALLBACK = """
import sys, warnings
sys.path.insert(0, {root!r})
from boltzlabs import RLPool
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    pool = RLPool({probe!r}, 2, spawn={spawn!r})
pool.reset(seed=0)
before = pool.memory()
pool.step([{{"op": "alloc", "mb": 64}}, 1])
after = pool.memory()
print(before.source)
print([str(w.message) for w in caught])
print((after.per_env[0] - before.per_env[0]) >> 20, (after.per_env[1] - before.per_env[1]) >> 20)
print(pool.envs_per_gb() > 0)
try:
    RLPool({probe!r}, 1, memory_limit="64M")
except ValueError as exc:
    print("limit refused:", exc)
pool.close()
"""


def test_without_a_writable_cgroup_memory_falls_back_to_pss(spawn):
    # A private mount namespace where the memory cgroup is read-only: the
    # kernel, not a mock, refuses the writes.
    import subprocess
    import sys

    code = FALLBACK.format(root=str(Path(__file__).parent.parent), probe=str(PROBE), spawn=spawn)
    script = (
        f"mount --make-rprivate / && mount -o remount,bind,ro {cgroups.hierarchy('memory')} && "
        f'exec {sys.executable} -c "$0"'
    )
    out = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, code], capture_output=True, text=True, timeout=scaled(120)
    )
    assert out.returncode == 0, out.stderr
    source, warned, grew, positive, refused = out.stdout.strip().splitlines()
    assert "PSS" in source
    assert "no cgroup memory accounting" in warned and "PSS" in warned
    # The warning carries the fix, with a fallback where there is no user session bus (issue 27).
    assert "systemd-run --user --scope -p Delegate=yes" in warned and "no user session bus" in warned
    grew0, grew1 = map(int, grew.split())
    assert 60 <= grew0 <= 70 and abs(grew1) <= 2
    assert positive == "True"
    assert "memory_limit needs a writable memory cgroup" in refused and "Delegate=yes" in refused


LEFTOVER_WORK = """
import mmap, os, threading, time
from boltzlabs.env import serve

state = {}

def spin(offset):
    n = 0
    while True:
        n += 1
        if n % 256 == 0:
            state["counters"][offset:offset + 8] = n.to_bytes(8, "little")

def read():
    return [int.from_bytes(state["counters"][i:i + 8], "little") for i in (0, 8)] if state else [0, 0]

def step(action):
    start = read()
    if action["spin"] and not state:
        # Work left running after the reply: a thread and a child process,
        # counting in memory shared with the env (made here, not at import).
        state["counters"] = mmap.mmap(-1, 16)
        threading.Thread(target=spin, args=(8,), daemon=True).start()
        if os.fork() == 0:
            spin(0)
    time.sleep(action["s"])
    return {"start": start, "end": read()}, 0.0, False, {}

serve(reset=lambda seed: 0, step=step)
"""


def _cpu_seconds(pid: int) -> float:
    """CPU time used so far by a process, its threads and its descendants."""
    import psutil

    root = psutil.Process(pid)
    return sum(sum(p.cpu_times()[:2]) for p in [root] + root.children(recursive=True))


def test_the_gate_freezes_work_an_env_leaves_running_after_its_reply(env_dir, spawn):
    """serialize_measurement promises one env's code at a time: a thread or a
    child an env leaves spinning after its reply must not run during another
    env's turn, nor between calls."""
    with RLPool(env_dir(LEFTOVER_WORK), 2, serialize_measurement=True, step_timeout=scaled(10), spawn=spawn) as pool:
        assert pool.spawn == spawn
        view = PoolView(pool._cgroup)
        for i, pid in enumerate(pool.pids()):  # born in its freezer cgroup
            assert view.cgroup_of(pid, "freezer") == view.group(i, "freezer"), pid
        pool.reset(seed=0)
        # Turns long against how long a freeze takes to land (slower where emulated).
        actions = [{"spin": True, "s": scaled(0.2)}, {"spin": False, "s": scaled(0.5)}]
        obs, *_ = pool.step(actions)
        # Between calls: env 0 and what it left running use no CPU at all.
        assert view.frozen(0)
        before = _cpu_seconds(pool.pids()[0])
        time.sleep(scaled(0.3))
        idle = _cpu_seconds(pool.pids()[0]) - before
        assert idle < 0.02, f"env 0's leftover work used {idle:.2f} s of CPU in {scaled(0.3):g} s between calls"
        # During env 1's turn: env 0 and its leftover work are frozen, so they use no CPU, however
        # loaded the machine is (CPU time, not counts: a count depends on how much CPU a turn got).
        long = [actions[0], {"spin": False, "s": scaled(1.5)}]
        for _ in range(2):
            pool.send(long)
            deadline = time.monotonic() + scaled(10)
            while view.frozen(1):  # until env 1's turn: its sandbox alone is thawed then
                assert time.monotonic() < deadline, "env 1's turn never came"
                time.sleep(0.005)
            before = _cpu_seconds(pool.pids()[0])
            time.sleep(scaled(0.3))
            used = _cpu_seconds(pool.pids()[0]) - before
            assert not view.frozen(1), "env 1's turn ended before the measurement did: lengthen it"
            assert used < 0.02, f"env 0's leftover work used {used:.2f} s of CPU during env 1's turn"
            env_ids, obs, *_ = pool.recv()
            now = obs[env_ids.tolist().index(0)]
            for k, kind in enumerate(["child", "thread"]):
                assert now["end"][k] > now["start"][k], (kind, now)  # it runs in its own env's turn


def test_without_a_freezer_the_gate_warns(spawn):
    import subprocess
    import sys

    code = f"""
import sys, warnings
sys.path.insert(0, {str(Path(__file__).parent.parent)!r})
from boltzlabs import RLPool
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with RLPool({str(PROBE)!r}, 2, spawn={spawn!r}, serialize_measurement=True) as pool:
        pool.reset(seed=0)
        assert pool.step([1, 1])[1].tolist() == [1.0, 1.0]
    with RLPool({str(PROBE)!r}, 1, spawn={spawn!r}) as pool:
        pass
print([str(w.message) for w in caught if w.category is RuntimeWarning])
"""
    # cgroup v1: the freezer hierarchy alone read-only. cgroup v2's freezer is
    # cgroup.freeze in the one tree, so there the whole tree goes (and with it
    # memory accounting, which warns too).
    script = (
        f"mount --make-rprivate / && mount -o remount,bind,ro {cgroups.hierarchy('freezer')} && "
        f'exec {sys.executable} -c "$0"'
    )
    out = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, code], capture_output=True, text=True, timeout=scaled(120)
    )
    assert out.returncode == 0, out.stderr
    warned = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    gate = [w for w in warned if "serialize_measurement" in w]
    assert len(gate) == 1 and "freez" in gate[0], warned
    others = [w for w in warned if w not in gate]
    if cgroups.version() == "v1":
        assert not others, warned
    else:  # no cgroups at all: memory accounting and the pids limits say so too
        assert all("no cgroup memory accounting" in w or "are not enforced" in w for w in others), warned
