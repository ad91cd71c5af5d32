"""A 1000-env pool of the example env: starts, steps, partially resets, closes clean."""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from boltzlabs import RLPool
from conftest import COUNTER, open_fds


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_thousand_envs(spawn):
    n = 1000
    fds = open_fds()
    with RLPool(COUNTER, n, step_timeout=60, spawn=spawn) as pool:
        assert pool.states() == ["idle"] * n
        assert len(set(pool.pids())) == n
        obs = pool.reset(seed=0)
        assert obs == [{"t": 0}] * n
        actions = np.arange(n) % 3
        for _t in range(1, 101):
            obs, rewards, dones, infos = pool.step(actions)
            assert rewards.tolist() == actions.astype(np.float32).tolist()
            assert pool.timing.stragglers == []
        assert dones.all() and obs[n - 1] == {"t": 100}
        mask = np.zeros(n, bool)
        mask[::2] = True
        obs = pool.reset(where=mask)
        assert [o["t"] for o in obs[:4]] == [0, 100, 0, 100]
        memory = pool.memory()
        assert len(memory.per_env) == n and all(m > 0 for m in memory.per_env)
        assert pool.envs_per_gb() > 50
        pids = pool.pids()
        pool.reset(hard=True, seed=0)
        assert not set(pids) & set(pool.pids())
        assert pool.step(actions)[0] == [{"t": 1}] * n
    assert open_fds() == fds


def test_bench_faults_prints_each_page_table_figure():
    """benchmarks/bench_faults.py (docs/scale.md reads start-up from it): each figure, a positive time per page."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_faults.py"
    done = subprocess.run(
        [sys.executable, str(script), "--mib", "8", "--rounds", "1"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    figures = dict(re.findall(r"^  (first touch|COW|fork|exit) +([0-9.]+) us/page$", done.stdout, re.M))
    assert sorted(figures) == ["COW", "exit", "first touch", "fork"], done.stdout
    assert all(float(value) > 0 for value in figures.values()), done.stdout


def test_bench_faults_idles_before_each_round_when_asked():
    """--idle S sleeps before each round (memory the VM hands back to its host) and says so."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_faults.py"
    done = subprocess.run(
        [sys.executable, str(script), "--mib", "8", "--rounds", "2", "--idle", "0.2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "medians of 2 rounds, each after 0.2 s idle:" in done.stdout, done.stdout
    figures = dict(re.findall(r"^  (first touch|COW|fork|exit) +([0-9.]+) us/page$", done.stdout, re.M))
    assert sorted(figures) == ["COW", "exit", "first touch", "fork"], done.stdout


@pytest.mark.timeout(300)
def test_bench_shards_prints_where_each_pool_spends_a_step(tmp_path):
    """benchmarks/bench_shards.py (docs/sharding.md reads the second worker's cost from it): for each
    pool, k > 1 unpinned (cpus=False) too, the workers' CPU, their blocks and the machine's context
    switches per step, and the envs' CPU."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_shards.py"
    done = subprocess.run(
        [
            sys.executable,
            str(script),
            "--env",
            "counter",
            "--n",
            "8",
            "--workers",
            "1",
            "2",
            "--rounds",
            "1",
            "--env-steps",
            "400",
            "--no-async",
            "--unpinned",
            "--results",
            str(tmp_path / "shards.json"),
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stderr
    rows = re.findall(
        r"^\| counter \| 8 \| workers=(\d(?:, unpinned)?) \| ([0-9,]+) \| [0-9.]+x \| ([0-9.]+) \| ([0-9.]+) \(([0-9.]+)\) "
        r"\| (\d+) \| ([0-9,]+) \| ([0-9.]+) \| [0-9.]+ \|$",
        done.stdout,
        re.M,
    )
    assert [row[0] for row in rows] == ["1", "2", "2, unpinned"], done.stdout
    for _, steps_per_s, client, workers, busiest, _blocks, switches, envs in rows:
        assert float(steps_per_s.replace(",", "")) > 0 and float(client) > 0
        assert float(workers) >= float(busiest) > 0
        assert int(switches.replace(",", "")) > 0 and float(envs) > 0  # every step wakes every env
    assert (tmp_path / "shards.json").exists()
