"""A 1000-env pool of the example env: starts, steps, partially resets, closes clean."""

import json
import re
import subprocess
import sys
import time
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
def test_bench_noise_splits_each_pools_steps_by_whether_the_host_thread_ran(tmp_path):
    """benchmarks/bench_noise.py (docs/sharding.md reads kdamond's cost to a pinned shard from it):
    workers=1, workers=2 pinned and unpinned, each step timed and tagged by the watched thread's CPU.
    A thread no process is named after never runs, so every step is one without it: known in advance."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_noise.py"
    results = tmp_path / "noise.json"
    done = subprocess.run(
        [sys.executable, str(script), "--env", "counter", "--n", "4", "--steps", "12"]
        + ["--thread", "pytest-noise-", "--results", str(results)],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stderr
    assert "no process named pytest-noise-* on this host" in done.stderr
    rows = re.findall(
        r"^\| counter \| 4 \| (workers=1|workers=2|workers=2, cpus=False) \| ([0-9,]+) \| [0-9.]+x \| [0-9.]+ "
        r"\| 0 of 12 \| 0 \| ([0-9.]+) / - \| ([-0-9 /]+) \|$",
        done.stdout,
        re.M,
    )
    assert [row[0] for row in rows] == ["workers=1", "workers=2", "workers=2, cpus=False"], done.stdout
    assert rows[0][3] == "-" and all(sum(map(int, row[3].split(" / "))) == 12 for row in rows[1:])
    saved = json.loads(results.read_text())
    assert [len(r["steps"]) for r in saved] == [12, 12, 12]
    assert all(len(step["shards"]) == 2 for r in saved[1:] for step in r["steps"])


def test_bench_noise_counts_the_cpu_of_the_thread_it_watches():
    # The reading the table rests on: a process that burns CPU is seen to, one that sleeps is not.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from bench_noise import cpu_ms, threads_named

    burner = subprocess.Popen(
        [sys.executable, "-c", "import time\nwhile True: time.process_time()"], stdout=subprocess.DEVNULL
    )
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        time.sleep(0.5)
        before = cpu_ms([burner.pid, sleeper.pid])
        time.sleep(0.5)
        assert cpu_ms([burner.pid]) - before > 100  # it ran about half a second
        slept = cpu_ms([sleeper.pid])
        time.sleep(0.3)
        assert cpu_ms([sleeper.pid]) == slept
        assert sleeper.pid in threads_named("sleep") and burner.pid not in threads_named("sleep")
    finally:
        burner.kill()
        sleeper.kill()
        burner.wait()
        sleeper.wait()
    assert cpu_ms([sleeper.pid]) == 0  # gone: counts nothing


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
