"""Memory from the kernel's accounting, memory_limit, and the measurement gate."""

import warnings
from pathlib import Path

import pytest

from boltzlabs import RLPool
from conftest import PROBE, intervals, overlaps

MiB = 1 << 20


def test_envs_per_gb_tracks_a_known_allocation(probe_pool):
    pool = probe_pool(4)
    pool.reset(seed=0)
    before = pool.memory()
    assert before.source.startswith("cgroup v1")
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


def test_memory_limit_kills_and_reports_oom(probe_pool):
    pool = probe_pool(2, memory_limit="96M")
    pool.reset(seed=0)
    obs, rewards, dones, infos = pool.step([{"op": "alloc", "mb": 256}, 1])
    assert dones[0] and "OOM" in infos[0]["error"], infos[0]
    assert rewards[1] == 1.0 and "error" not in infos[1]
    pool.reset(where=[0], seed=0)
    obs, rewards, dones, infos = pool.step([{"op": "alloc", "mb": 16}, 1])
    assert obs[0]["out"] == {"held_mb": 16}


def test_serialize_measurement_gate(spawn):
    n = 4
    with RLPool(PROBE, n, serialize_measurement=True, step_timeout=5, spawn=spawn) as pool:
        pool.reset(seed=0)
        obs, rewards, dones, infos = pool.step([{"op": "interval", "s": 0.05}] * n)
        spans = intervals(obs)
        assert len(spans) == n and not overlaps(spans), spans
        assert pool.timing.worker_ms >= n * 50
        # Resets and normal steps still work behind the gate.
        pool.reset(where=[1], seed=3)
        assert pool.step([1] * n)[1].tolist() == [1.0] * n
    with RLPool(PROBE, n, step_timeout=5, spawn=spawn) as pool:
        pool.reset(seed=0)
        obs, *_ = pool.step([{"op": "interval", "s": 0.2}] * n)
        assert overlaps(intervals(obs))


def test_gate_holder_that_overruns_is_killed_so_the_gate_holds(spawn):
    with RLPool(PROBE, 3, serialize_measurement=True, step_timeout=0.5, spawn=spawn) as pool:
        pool.reset(seed=0)
        obs, rewards, dones, infos = pool.step([{"op": "interval", "s": 0.05}, {"op": "loop"},
                                                {"op": "interval", "s": 0.05}])
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
    script = ("mount --make-rprivate / && mount -o remount,bind,ro /sys/fs/cgroup/memory && "
              f"exec {sys.executable} -c \"$0\"")
    out = subprocess.run(["unshare", "-m", "sh", "-c", script, code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    source, warned, grew, positive, refused = out.stdout.strip().splitlines()
    assert "PSS" in source
    assert "no cgroup memory accounting" in warned and "PSS" in warned
    grew0, grew1 = map(int, grew.split())
    assert 60 <= grew0 <= 70 and abs(grew1) <= 2
    assert positive == "True"
    assert "memory_limit needs a writable memory cgroup" in refused
