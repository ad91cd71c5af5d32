"""One pool over a real local multi-node Ray cluster (Ray's own cluster_utils):
real raylets, real actors, real boltzlabs workers and sandboxes on each node."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

# Ray swaps a loopback address for the machine's interface address unless
# told this is a single-host setup; every node here is 127.0.0.1.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
import ray

from boltzlabs import wire
from boltzlabs.cluster import ClusterPool, doctor, placement
from boltzlabs.errors import WorkerError

from conftest import COUNTER, PROBE, has_ended, two_node_ray_cluster, wait_until

ROOT = Path(__file__).resolve().parent.parent
NODE = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "object_store_memory": 100 << 20}


@pytest.fixture(scope="module")
def cluster():
    yield from two_node_ray_cluster()


def listeners() -> list:
    """Every `boltzlabs worker --listen` process of this test process's clusters.

    Only those below this process (its clusters' raylets are its children, the
    actors theirs, each listener its actor's): CI runs the suite on both step
    paths at once, each session with its own clusters and listeners."""
    out = []
    for proc in psutil.Process().children(recursive=True):
        try:
            cmd = proc.cmdline()
        except psutil.Error:
            continue
        if "boltzlabs" in cmd and "worker" in cmd and "--listen" in cmd:
            out.append(proc)
    return out


def remove_node(cluster, node) -> None:
    """Remove a node and wait until every process it ran has ended: the raylet's
    actors, their listeners, workers and sandboxes. On a loaded machine they
    outlive the raylet for seconds, and a step sent meanwhile still reaches them."""
    family = []
    for name, proc in node.live_processes():
        if name == "raylet":
            root = psutil.Process(proc.pid)
            family += [root] + root.children(recursive=True)
    assert family, "the node has no raylet"
    cluster.remove_node(node)
    assert wait_until(lambda: all(has_ended(p) for p in family), 60), "a removed node's processes outlived it"


def test_placement_splits_by_cpus_within_each_nodes_room():
    nodes = [("a", 2.0, 8 << 30), ("b", 1.0, 8 << 30)]
    assert placement(9, nodes) == [("a", 6), ("b", 3)]
    assert placement(8, nodes, envs_per_node=4) == [("a", 4), ("b", 4)]
    assert placement(3, nodes, envs_per_node=4, held={"a": 4}) == [("b", 3)]
    with pytest.raises(ValueError, match="room for 1 more"):
        placement(2, nodes, envs_per_node=4, held={"a": 4, "b": 3})


def test_lanes_spread_over_two_nodes_in_the_users_order(cluster):
    with ClusterPool(PROBE, 6, cluster=cluster.address, envs_per_node=3, step_timeout=10) as pool:
        assert isinstance(pool, ClusterPool)
        assert len(pool.nodes) == 2
        assert sorted(pool.lane_nodes.count(node) for node in pool.nodes) == [3, 3]
        obs = pool.reset(seed=10)
        assert [o["seed"] for o in obs] == list(range(10, 16))
        obs, rewards, dones, infos = pool.step([float(i) for i in range(6)])
        assert rewards.tolist() == [float(i) for i in range(6)] and not dones.any()
        # One request per node per call, each node's time reported.
        assert set(pool.timing.nodes) == set(pool.nodes)
        assert pool.timing.worker_ms == max(pool.timing.nodes.values()) <= pool.timing.roundtrip_ms
        # A fault stays on its lane, wherever that lane lives.
        _, rewards, dones, infos = pool.step([1.0, 1.0, 1.0, {"op": "raise"}, 1.0, 1.0])
        assert dones.tolist() == [False, False, False, True, False, False]
        assert "step failed on purpose" in infos[3]["error"]
        obs = pool.reset(where=[3])
        assert obs[3]["t"] == 0
        # Resets in flight, seeded and scrubbed, on both nodes: each node's lanes get their own seeds.
        pool.send([1.0] * 6, resets=[1, 4], seed=[None, 21, None, None, 24, None], scrub=True)
        env_ids, obs, rewards, dones, infos = pool.recv(6)
        got = {i: (o, r, info) for i, o, r, info in zip(env_ids.tolist(), obs, rewards.tolist(), infos)}
        assert (got[1][0]["seed"], got[4][0]["seed"]) == (21, 24) and got[1][1] == got[4][1] == 0.0
        assert "scrubbed" in got[1][2] and "scrubbed" in got[4][2] and got[0][0]["t"] > 0
        report = pool.memory()
        assert len(report.per_env) == 6 and all(m > 0 for m in report.per_env)
        assert pool.envs_per_gb() > 0


def test_a_node_may_run_several_workers(cluster):
    with pytest.raises(TypeError, match="workers_per_node"):
        ClusterPool(COUNTER, 4, cluster=cluster.address, workers=2)
    with ClusterPool(PROBE, 6, cluster=cluster.address, envs_per_node=3, workers_per_node=2, step_timeout=10) as pool:
        assert sorted(shard.pool.workers for shard in pool._shards) == [2, 2]
        obs = pool.reset(seed=10)
        assert [o["seed"] for o in obs] == list(range(10, 16))
        _, rewards, dones, infos = pool.step([1.0, 2.0, {"op": "raise"}, 4.0, 5.0, 6.0])
        assert rewards.tolist() == [1.0, 2.0, 0.0, 4.0, 5.0, 6.0] and dones.tolist()[2]
        assert "step failed on purpose" in infos[2]["error"]
        assert len(pool.memory().per_env) == 6 and len(set(pool.pids())) == 6
        # Each node's two shards on its two slices of the node's CPUs (RLPool(cpus=None)): lane 0 of
        # each node's three on the first, lanes 1-2 on the second; each env's own view.
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) >= 2:
            from boltzlabs.worker.affinity import slice_of

            obs, *_ = pool.step([{"op": "cpus"}] * 6)
            views = [tuple(o["out"]) for o in obs]
            first, second = tuple(slice_of(cpus, 0, 2)), tuple(slice_of(cpus, 1, 2))
            assert (views.count(first), views.count(second)) == (2, 4), views


def test_a_cluster_pool_groups_envs_in_each_nodes_sandboxes(cluster):
    # envs_per_sandbox reaches each node's pool: 3 envs per node, 2 per sandbox, 4 sandboxes in all.
    with ClusterPool(PROBE, 6, cluster=cluster.address, envs_per_node=3, envs_per_sandbox=2, step_timeout=10) as pool:
        assert sorted(shard.pool.sandboxes for shard in pool._shards) == [2, 2]
        obs = pool.reset(seed=10)
        assert [o["seed"] for o in obs] == list(range(10, 16))
        _, rewards, dones, infos = pool.step([1.0, 2.0, {"op": "raise"}, 4.0, 5.0, 6.0])
        # One env's exception fails that env only, its sandbox's other env steps on.
        assert rewards.tolist() == [1.0, 2.0, 0.0, 4.0, 5.0, 6.0] and dones.tolist() == [0, 0, 1, 0, 0, 0]
        assert "step failed on purpose" in infos[2]["error"]
        pids = pool.pids()
        assert len(set(pids)) == 4 and pids[0] == pids[1] and pids[3] == pids[4] and pids[2] != pids[3]
        assert len(pool.memory().per_env) == 6


def test_hard_reset_and_async_stepping_across_nodes(cluster):
    with ClusterPool(COUNTER, 4, cluster=cluster.address, envs_per_node=2) as pool:

        def episode():
            out = [pool.reset(seed=1, hard=True)]
            for _ in range(4):
                out.append(pool.step([1, 1, 1, 1])[0])
            return wire.encode(out)

        assert episode() == episode()
        pool.reset()
        pool.send([1, 1, 1, 1])
        seen = []
        while len(seen) < 4:
            env_ids, obs, rewards, dones, infos = pool.recv(batch_size=2)
            assert len(env_ids) == 2 and rewards.tolist() == [1.0, 1.0]
            seen += env_ids.tolist()
        assert sorted(seen) == [0, 1, 2, 3]
        with pytest.raises(ValueError):
            pool.recv(batch_size=1)  # nothing in flight


def test_a_lost_node_loses_nothing_silently(cluster):
    extra = cluster.add_node(**NODE)
    pool = ClusterPool(COUNTER, 6, cluster=cluster.address, envs_per_node=3)
    try:
        nodes = pool.lane_nodes
        lost_node = extra.node_id
        lost = [lane for lane, node in enumerate(nodes) if node == lost_node]
        assert len(lost) == 2 and len(set(nodes)) == 3
        pool.reset()
        remove_node(cluster, extra)
        obs, rewards, dones, infos = pool.step([1] * 6)
        for lane in range(6):
            if lane in lost:
                assert dones[lane] and rewards[lane] == 0.0 and obs[lane] is None
                assert lost_node in infos[lane]["error"] and "lost" in infos[lane]["error"]
            else:
                assert rewards[lane] == 1.0 and not dones[lane]
        # Until reset, the lanes stay failed, reported each step.
        _, _, dones, infos = pool.step([1] * 6)
        assert all(dones[lane] and lost_node in infos[lane]["error"] for lane in lost)
        # Their reset places them on the two nodes left, which have room for one more each.
        obs = pool.reset(where=lost)
        assert all(obs[lane] == {"t": 0} for lane in lost)
        assert lost_node not in pool.lane_nodes and len(set(pool.lane_nodes)) == 2
        _, rewards, dones, _ = pool.step([1] * 6)
        assert rewards[lost].tolist() == [1.0, 1.0] and not dones.any()
    finally:
        pool.close()


@pytest.mark.timeout(300)
def test_a_stopped_node_worker_is_a_lost_node_not_a_hang(cluster, monkeypatch):
    # A node whose pool worker stops answering (SIGSTOP here; a hung host the same) while its TCP
    # connection stays up: its RLPool's call passes its deadline (issue 42), the node is lost and
    # its lanes say so; the other node's lanes step on.
    from boltzlabs.pool import client

    monkeypatch.setattr(client, "DEADLINE_MARGIN", 3.0)
    pool = ClusterPool(COUNTER, 4, cluster=cluster.address, envs_per_node=2, step_timeout=2)
    stopped = None
    try:
        pool.reset()
        workers = [
            child
            for listener in listeners()
            for child in listener.children()
            if "--remote" in child.cmdline() and "boltzlabs.worker" in child.cmdline()
        ]
        assert len(workers) == 2, workers
        stopped = workers[0]
        stopped.suspend()  # SIGSTOP
        started = time.monotonic()
        obs, rewards, dones, infos = pool.step([1] * 4)
        waited = time.monotonic() - started
        lost = [lane for lane in range(4) if obs[lane] is None]
        assert len(lost) == 2 and all("lost" in infos[lane]["error"] for lane in lost), infos
        assert all("did not answer step()" in infos[lane]["error"] for lane in lost), infos
        assert all(rewards[lane] == 1.0 for lane in set(range(4)) - set(lost))
        assert waited < 2 + 3 + 30, waited
    finally:
        if stopped is not None:
            stopped.resume()  # it then finds its client gone and ends its pool
        pool.close()


def test_a_cluster_without_room_says_so(cluster):
    extra = cluster.add_node(**NODE)
    pool = ClusterPool(COUNTER, 6, cluster=cluster.address, envs_per_node=2)
    try:
        pool.reset()  # a pool steps only lanes a reset has reached
        lost = [lane for lane, node in enumerate(pool.lane_nodes) if node == extra.node_id]
        remove_node(cluster, extra)
        pool.step([1] * 6)
        with pytest.raises(WorkerError, match="room for 0 more env"):
            pool.reset(where=lost)
        _, rewards, _, _ = pool.step([1] * 6)  # the other lanes go on
        assert sum(rewards) == 4.0
    finally:
        pool.close()


def test_close_removes_every_actor_and_sandbox(cluster):
    before = {p.pid for p in listeners()}
    pool = ClusterPool(COUNTER, 4, cluster=cluster.address, envs_per_node=2)
    pool.reset()
    pids = pool.pids()
    ours = [p for p in listeners() if p.pid not in before]
    assert len(ours) == 2
    pool.close()
    assert wait_until(lambda: not any(psutil.pid_exists(p) for p in pids), 30), "sandboxes outlived close()"
    assert wait_until(lambda: not any(p.is_running() for p in ours), 30), "a node's worker outlived close()"


DRIVER = textwrap.dedent("""
    import os, sys
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray
    from boltzlabs.cluster import ClusterPool
    ray.init(address=sys.argv[2], _node_ip_address="127.0.0.1", logging_level="ERROR", log_to_driver=False)
    pool = ClusterPool(sys.argv[1], 4, cluster=sys.argv[2], envs_per_node=2)
    pool.reset()
    print(" ".join(map(str, pool.pids())), flush=True)
    pool.step([{"op": "sleep", "s": 60}] * 4)
""")


def test_a_dead_client_leaves_nothing_on_the_cluster(cluster):
    before = {p.pid for p in listeners()}
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(PROBE), cluster.address],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        start_new_session=True,
    )
    try:
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert len(pids) == 4
        ours = [p for p in listeners() if p.pid not in before]
        time.sleep(0.5)
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()
        assert wait_until(lambda: not any(psutil.pid_exists(p) for p in pids), 60), "sandboxes outlived their client"
        assert wait_until(lambda: not any(p.is_running() for p in ours), 60), "a node's worker outlived its client"
    finally:
        if driver.poll() is None:
            driver.kill()
        driver.stdout.close()


def test_doctor_runs_on_every_node(cluster):
    reports = doctor(cluster.address, n=10)
    assert len(reports) == len([n for n in ray.nodes() if n["Alive"]]) >= 2
    for report in reports:
        names = {f["name"]: f["status"] for f in report["findings"]}
        assert names["bwrap sandbox"] == "ok"


def test_doctor_command_runs_on_the_cluster(cluster):
    import json

    out = subprocess.run(
        [sys.executable, "-m", "boltzlabs", "doctor", "--ray", cluster.address, "-n", "10", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["ok"] and len(report["nodes"]) >= 2


def test_per_lane_calls_and_shutdown(cluster, capfd):
    pool = ClusterPool(PROBE, 4, cluster=cluster.address, envs_per_node=2, progress=True)
    # One bar of the pool's 4 envs over both nodes' workers, not one of 2 per node.
    totals = set(re.findall(r"starting envs.*?\d+/(\d+)", capfd.readouterr().err))
    assert totals == {"4"}, totals
    pool.reset(seed=0)
    assert pool.states() == ["idle"] * 4
    assert "reset called" in pool.log(3)
    assert all(info is not None for info in pool.reset_infos)
    pids = pool.pids()
    assert pool.shutdown("preempted") is True and pool.closed
    assert wait_until(lambda: not any(psutil.pid_exists(p) for p in pids), 30), "sandboxes outlived shutdown()"
