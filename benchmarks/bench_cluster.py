"""The cost of the Ray hop: the example env through a two-node local Ray cluster
against the same pool run locally, in one run.

    python benchmarks/bench_cluster.py                 # n = 512, 2000 steps
    python benchmarks/bench_cluster.py --n 512 --steps 3000 --rounds 6

Three pools of examples/counter stay open and take turns in --rounds chunks
of the steps (so load on a shared machine slows all alike):
  * local:   RLPool(counter, n)                       (worker on this host)
  * remote:  RLPool(counter, n, worker="tcp://127.0.0.1:...")  (one remote worker)
  * cluster: ClusterPool(counter, n, cluster=<2-node Ray cluster>)  (n/2 lanes per node)
Every node of the test cluster is this same 2-core machine, so the cluster
row measures the hop's overhead (two workers, two TCP round trips, threads),
not extra capacity. A markdown table goes to stdout and the figures to
benchmarks/results/cluster.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # every node is 127.0.0.1

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np
import ray
from ray.cluster_utils import Cluster

from boltzlabs import RLPool
from boltzlabs.cluster import ClusterPool

COUNTER = ROOT / "examples" / "counter"
RESULTS = ROOT / "benchmarks" / "results" / "cluster.json"
NODE = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "object_store_memory": 100 << 20}


def local_cluster(nodes: int) -> Cluster:
    """A Ray cluster of `nodes` one-CPU nodes on 127.0.0.1, with this driver connected."""
    cluster = Cluster(initialize_head=True, head_node_args=dict(NODE, include_dashboard=False))
    for _ in range(nodes - 1):
        cluster.add_node(**NODE)
    ray.init(address=cluster.address, _node_ip_address="127.0.0.1", logging_level="ERROR", log_to_driver=False)
    return cluster


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_steps(pool, n: int, steps: int) -> tuple[float, list, list]:
    actions = np.ones(n, dtype=np.int64)
    worker, roundtrip = [], []
    started = time.perf_counter()
    for _ in range(steps):
        _, _, dones, _ = pool.step(actions)
        worker.append(pool.timing.worker_ms)
        roundtrip.append(pool.timing.roundtrip_ms)
        if dones.any():
            pool.reset(where=dones)
    return time.perf_counter() - started, worker, roundtrip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    n, steps, rounds = args.n, args.steps, args.rounds

    log("starting a 2-node Ray cluster on 127.0.0.1")
    cluster = local_cluster(2)
    token = "bench-" + os.urandom(8).hex()
    listener = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "boltzlabs",
            "worker",
            "--listen",
            "127.0.0.1:0",
            "--token",
            token,
            "--max-envs",
            str(n),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    url = listener.stdout.readline().split()[-1]
    pools, figures = {}, {}
    try:
        for name, make in (
            ("local", lambda: RLPool(COUNTER, n)),
            ("remote", lambda: RLPool(COUNTER, n, worker=url, token=token)),
            ("cluster", lambda: ClusterPool(COUNTER, n, cluster=cluster.address, envs_per_node=(n + 1) // 2)),
        ):
            started = time.perf_counter()
            pools[name] = make()
            figures[name] = {"start_s": time.perf_counter() - started, "seconds": 0.0, "worker": [], "roundtrip": []}
            pools[name].reset(seed=0)
            run_steps(pools[name], n, 20)  # warm-up
            log(f"{name}: started in {figures[name]['start_s']:.2f} s")
        chunk = steps // rounds
        for r in range(rounds):
            for name, pool in pools.items():
                seconds, worker, roundtrip = run_steps(pool, n, chunk)
                figures[name]["seconds"] += seconds
                figures[name]["worker"] += worker
                figures[name]["roundtrip"] += roundtrip
            log(f"round {r + 1}/{rounds} done")
        for name, pool in pools.items():
            figures[name]["envs_per_gb"] = pool.envs_per_gb()
    finally:
        for pool in pools.values():
            pool.close()
        listener.terminate()
        listener.wait()
        ray.shutdown()
        cluster.shutdown()

    base = n * chunk * rounds / figures["local"]["seconds"]
    rows = []
    print(f"\n| pool (n={n}) | env-steps/s | vs local | worker ms | roundtrip ms | start s | envs/GiB |")
    print("|---|---|---|---|---|---|---|")
    for name, f in figures.items():
        rate = n * chunk * rounds / f["seconds"]
        row = {
            "pool": name,
            "n": n,
            "env_steps_per_s": rate,
            "vs_local": rate / base,
            "worker_ms": float(np.mean(f["worker"])),
            "roundtrip_ms": float(np.mean(f["roundtrip"])),
            "start_s": f["start_s"],
            "envs_per_gb": f["envs_per_gb"],
        }
        rows.append(row)
        print(
            f"| {name} | {rate:,.0f} | {rate / base:.2f}x | {row['worker_ms']:.2f} | {row['roundtrip_ms']:.2f} | "
            f"{row['start_s']:.2f} | {row['envs_per_gb']:.0f} |"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"rows": rows, "steps": chunk * rounds, "load": os.getloadavg()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
