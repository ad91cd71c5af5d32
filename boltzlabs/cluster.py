"""Past one machine: one pool over a Ray cluster, one boltzlabs worker per node.

    ClusterPool (the trainer) --one batched request per node, all at once--+
        |                                                                   |
        +--TCP--> node A: NodeWorker actor -> `boltzlabs worker` -> pool worker -> sandboxes
        +--TCP--> node B: NodeWorker actor -> `boltzlabs worker` -> pool worker -> sandboxes

Ray only places things and keeps them alive: a NodeWorker actor, pinned to
its node, starts a `boltzlabs worker` listener there (remote.py) with a token
made for this pool, and dies with the driver that owns it. Steps do not go
through Ray: each node's share of the lanes is an ordinary remote RLPool
(`RLPool(worker="tcp://node:port")`), so the env code is shipped, cached and
sandboxed on every node exactly as for one remote worker, from the same
policy. A step splits the actions by node, sends one request per node from a
thread each (the sockets release the GIL), and joins the results in the
user's lane order.

A node that is lost (its raylet, actor, listener or worker gone: the
connection closes) loses nothing silently: its lanes come back done, reward
0, `info["error"]` naming the node; at their next reset they are placed again
on the nodes that are left, or the reset says the cluster has no room.

ClusterPool and RLPool are the two kinds of one protocol
(boltzlabs.pool.protocol.Pool): the public calls, their argument checks and
the episode bookkeeping are Pool's, so the same input means the same on both.
Make one with `ClusterPool(source, n, cluster="ray", envs_per_node=...)`;
`BoltzLabsVecEnv.make(..., cluster="ray")` does.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from boltzlabs.errors import EnvError, PoolClosedError, WorkerError
from boltzlabs.pool.client import MemoryReport, RLPool, Timing
from boltzlabs.pool.progress import shown
from boltzlabs.pool.protocol import Pool, RecvResult, StepResult, check_batch_size, check_n

__all__ = ["ClusterPool", "NodeWorker", "doctor", "placement"]

# Sizing a node from its memory when envs_per_node is not given: a generous
# per-env budget (measured: ~2-3 MiB in template mode, ~15 in exec mode) on
# half the node's memory, leaving the rest to the trainer and the system.
_ENV_BUDGET = 16 << 20
_MEMORY_SHARE = 0.5


def _ray():
    try:
        import ray
    except ImportError:
        raise ImportError("ClusterPool needs Ray: pip install -e '.[ray]' in a checkout of boltzlabs") from None
    return ray


def _connect(cluster) -> None:
    ray = _ray()
    if ray.is_initialized():
        return
    address = None if cluster == "ray" else cluster
    ray.init(address=address, logging_level="ERROR", log_to_driver=False)


class NodeWorker:
    """Ray actor: a `boltzlabs worker` listener on this node, for one pool.

    The listener dies with the actor (--parent), each pool's worker with the
    listener, each sandbox with its worker: removing the actor, or losing
    the node or the driver, leaves nothing running.
    """

    def __init__(self, token: str):
        import ray

        self.node_id = ray.get_runtime_context().get_node_id()
        from boltzlabs.worker.ceilings import CEILINGS

        host = ray.util.get_node_ip_address()
        env = dict(os.environ, BOLTZLABS_TOKEN=token)
        # The listener is this pool's alone (its token is the pool's): its one
        # client is the pool's owner, so no ceiling on what that asks for, and
        # its trust_env is the owner's to choose, as for a local pool.
        no_ceilings = [arg for flag, _, _ in CEILINGS.values() for arg in (flag, "none")]
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "boltzlabs",
                "worker",
                "--listen",
                f"{host}:0",
                "--parent",
                str(os.getpid()),
                "--max-envs",
                "100000",
                "--allow-trust-env",
                *no_ceilings,
            ],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
            start_new_session=True,
        )
        assert self.proc.stdout is not None  # stdout=PIPE
        line = self.proc.stdout.readline().strip()
        if not line.startswith("listening on "):
            raise RuntimeError(f"boltzlabs worker did not start on node {self.node_id}: {line!r}")
        self.url = line[len("listening on ") :]

    def address(self) -> tuple:
        """(node id, the listener's tcp:// url)."""
        return self.node_id, self.url

    def stop(self) -> None:
        """End the listener and every pool it serves."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _doctor_here(n: int) -> dict:
    import ray

    from boltzlabs.cli.doctor import run_checks

    return {"node": ray.get_runtime_context().get_node_id(), "findings": [f.to_dict() for f in run_checks(n)]}


def doctor(cluster="ray", n: int = 1000) -> list:
    """Run `boltzlabs doctor`'s checks on every alive node; one dict per node."""
    ray = _ray()
    _connect(cluster)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0)(_doctor_here)
    refs = [
        task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote(n)
        for node in ray.nodes()
        if node["Alive"]
    ]
    return ray.get(refs)


def placement(n: int, nodes: list, envs_per_node=None, held=None) -> list:
    """Split n lanes over nodes [(node id, cpus, memory bytes)]: by CPUs, each
    node capped at envs_per_node (or what half its memory holds) minus the
    lanes it already holds (`held`: {node id: lanes}). Returns [(node id,
    count)] with count > 0; ValueError when n does not fit."""
    held = held or {}
    caps = {
        node: (int(envs_per_node) if envs_per_node else max(1, int(memory * _MEMORY_SHARE) // _ENV_BUDGET))
        - held.get(node, 0)
        for node, _, memory in nodes
    }
    room = sum(max(0, cap) for cap in caps.values())
    if n > room:
        sizing = f"envs_per_node={envs_per_node}" if envs_per_node else "sized by memory"
        raise ValueError(
            f"the cluster has room for {room} more env(s) on {len(nodes)} alive node(s) ({sizing}); "
            f"{n} are needed: add nodes or raise envs_per_node"
        )
    counts = {node: 0 for node, _, _ in nodes}
    weights = {node: max(cpus, 1e-3) for node, cpus, _ in nodes}
    for _ in range(n):  # each lane to the node least loaded for its CPUs, among those with room
        node = min(
            (node for node in counts if counts[node] < caps[node]),
            key=lambda node: (held.get(node, 0) + counts[node] + 1) / weights[node],
        )
        counts[node] += 1
    return [(node, count) for node, count in counts.items() if count]


@dataclass(eq=False)  # hashed by identity: a shard is a key of each fan-out
class _Shard:
    """One node's share: a remote pool and the global lanes it holds, in order."""

    node: str
    pool: RLPool
    lanes: list[int]
    lost: str = ""  # why the node was lost, once it is


class ClusterPool(Pool):
    """n envs spread over a Ray cluster's nodes, behind RLPool's API.

        pool = ClusterPool("./my_env", 4096, cluster="ray")   # or a cluster address
        obs = pool.reset(seed=0)
        obs, rewards, dones, infos = pool.step(actions)

    Lanes keep the user's order whatever node holds them (`lane_nodes`).
    Every call sends one batched request per node, concurrently;
    `timing.worker_ms` is the slowest node's, `timing.nodes` each node's.
    envs_per_node caps how many lanes a node takes (default: by its memory;
    lanes are split by CPUs). workers_per_node (default 1) splits each
    node's lanes over that many worker processes there (RLPool(workers=),
    docs/sharding.md), for nodes with many cores, each on its slice of
    that node's CPUs (cpus= names CPUs of each node). progress= draws one
    bar over every node's envs as they start (on a terminal by default, as
    RLPool's). Everything else RLPool takes (step_timeout, spawn,
    memory_limit, ...) applies on every node.
    """

    def __init__(
        self, source, n: int, *, cluster="ray", envs_per_node=None, workers_per_node: int = 1, batch_size=None, **kwargs
    ):
        self._closed = True
        self._shards: list[_Shard] = []
        self._actors: dict = {}
        n = check_n(n)
        self.batch_size = check_batch_size(batch_size, n)
        for name in ("worker", "token", "workers"):
            if kwargs.get(name) is not None:
                more = " (workers_per_node= runs several on each)" if name == "workers" else ""
                raise TypeError(f"ClusterPool places its own workers, one per node{more}; do not pass {name}=")
        if isinstance(workers_per_node, bool) or not isinstance(workers_per_node, int) or workers_per_node < 1:
            raise ValueError(f"workers_per_node must be a whole number >= 1, not {workers_per_node!r:.80}")
        self._workers_per_node = workers_per_node
        self._init_lanes(n)
        self.source = str(source)
        self._progress = kwargs.pop("progress", None)  # one bar over every node's workers
        self._kwargs = kwargs
        self._envs_per_node = envs_per_node
        self._token = secrets.token_urlsafe(24)
        self.timing = Timing()
        self._executor = ThreadPoolExecutor(max_workers=32, thread_name_prefix="boltzlabs-node")
        _connect(cluster)
        self._closed = False
        try:
            self._place(list(range(self.n)))
        except BaseException:
            self.close()
            raise
        self._flying = np.zeros(self.n, dtype=np.bool_)
        self._ready: list = []  # async results taken from a node beyond what recv() asked for
        self.env_contract = self._live()[0].pool.env_contract
        self.spawn = self._live()[0].pool.spawn
        caps = [shard.pool.max_str_len for shard in self._live() if shard.pool.max_str_len is not None]
        self.max_str_len = min(caps) if caps else None  # every node's worker holds a str to its own

    # -- placement -------------------------------------------------------------------

    def _alive_nodes(self) -> list:
        ray = _ray()
        lost = {shard.node for shard in self._shards if shard.lost}
        return [
            (node["NodeID"], node["Resources"].get("CPU", 0.0), node["Resources"].get("memory", 0.0))
            for node in ray.nodes()
            if node["Alive"] and node["NodeID"] not in lost
        ]

    def _actor(self, node: str):
        ray = _ray()
        if node not in self._actors:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            actor_class = ray.remote(num_cpus=0, max_restarts=0)(NodeWorker)
            self._actors[node] = actor_class.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
            ).remote(self._token)
        return self._actors[node]

    def _place(self, lanes: list) -> None:
        """Start pools for `lanes` on the alive nodes, one per node, concurrently."""
        ray = _ray()
        held: dict[str, int] = {}  # lanes each node holds already
        for shard in self._live():
            held[shard.node] = held.get(shard.node, 0) + len(shard.lanes)
        try:
            plan = placement(len(lanes), self._alive_nodes(), self._envs_per_node, held)
        except ValueError as exc:
            raise WorkerError(str(exc)) from exc
        addresses = dict(ray.get([self._actor(node).address.remote() for node, _ in plan]))
        parts, start = [], 0
        for node, count in plan:
            parts.append((node, lanes[start : start + count]))
            start += count

        def open_pool(node: str, part: list[int]) -> _Shard:
            pool = RLPool(
                self.source,
                len(part),
                worker=addresses[node],
                token=self._token,
                progress=False,
                workers=min(self._workers_per_node, len(part)),
                _progress=bar,
                **self._kwargs,
            )
            return _Shard(node, pool, part)

        errors = []
        with shown(self._progress, len(lanes)) as bar:  # one bar over every node's workers
            futures = [self._executor.submit(open_pool, node, part) for node, part in parts]
            for future in futures:
                try:
                    self._shards.append(future.result())
                except Exception as exc:  # every node's failure is reported below
                    errors.append(exc)
        if errors:
            raise errors[0]
        self._index()

    def _index(self) -> None:
        self._lane_shard: dict[int, tuple[_Shard, int]] = {}  # global lane -> (its shard, its lane there)
        for shard in self._shards:
            if not shard.lost:
                for local, lane in enumerate(shard.lanes):
                    self._lane_shard[lane] = (shard, local)

    def _live(self) -> list:
        return [shard for shard in self._shards if not shard.lost]

    def _lose(self, shard: _Shard, exc: Exception) -> None:
        shard.lost = f"node {shard.node} was lost ({exc})"
        self._index()  # its lanes are on no node until their reset places them
        try:
            shard.pool.close()
        except Exception:  # the node is gone; closing is best effort
            pass

    # -- fan-out ---------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosedError("this ClusterPool is closed; create a new one")

    def _fan_out(self, calls: dict) -> dict:
        """Run {shard: fn(pool)} concurrently; {shard: result or exception}.

        A node whose connection broke is marked lost; its exception is its result.
        """
        started = time.perf_counter()
        futures = {shard: self._executor.submit(fn, shard.pool) for shard, fn in calls.items()}
        results, nodes = {}, {}
        for shard, future in futures.items():
            try:
                results[shard] = future.result()
                nodes[shard.node] = shard.pool.timing.worker_ms
            except (WorkerError, PoolClosedError, OSError) as exc:
                self._lose(shard, exc)
                results[shard] = exc
        self.timing = Timing(
            worker_ms=max(nodes.values(), default=0.0),
            roundtrip_ms=(time.perf_counter() - started) * 1000.0,
            nodes=nodes,
        )
        return results

    def _split(self, values, lanes: list) -> dict:
        """{shard: (local lanes, global lanes, values)} for `lanes` (global), values
        aligned with them (checked by Pool); shard None holds the lanes on no node (a lost one's)."""
        out: dict[_Shard | None, tuple[list[int | None], list[int], list[Any]]] = {}
        for value, lane in zip(values, lanes):
            shard, local = self._lane_shard.get(lane, (None, None))
            locals_, globals_, vals = out.setdefault(shard, ([], [], []))
            locals_.append(local)
            globals_.append(lane)
            vals.append(value)
        return out

    def _lost_lane(self, lane: int) -> str:
        for shard in self._shards:
            if shard.lost and lane in shard.lanes:
                return shard.lost + "; reset this env to place it on another node"
        return "this env is on no node; reset it"

    # -- the protocol's hooks (boltzlabs.pool.protocol.Pool) -------------------------------

    def _by_shard(self, lanes) -> dict:
        """{shard: [local lane, ...]} for global `lanes` that are on a node."""
        out: dict = {}
        for lane in lanes:
            if lane in self._lane_shard:
                shard, local = self._lane_shard[lane]
                out.setdefault(shard, []).append(local)
        return out

    def _step_lanes(self, actions: list, resets) -> StepResult:
        split = self._split(actions, list(range(self.n)))
        local_resets = self._by_shard(resets or [])
        calls = {
            shard: (lambda pool, a=vals, r=local_resets.get(shard): pool.step_full(a, r))
            for shard, (_, _, vals) in split.items()
            if shard
        }
        results = self._fan_out(calls)
        obs: list[Any] = [None] * self.n
        infos: list[Any] = [None] * self.n  # every lane's filled below: a result's, or a lost node's error
        rewards = np.zeros(self.n, dtype=np.float64)
        terminated = np.zeros(self.n, dtype=np.bool_)
        truncated = np.zeros(self.n, dtype=np.bool_)
        stragglers = []
        for shard, (_, lanes, _) in split.items():
            result = results.get(shard)
            if isinstance(result, StepResult):
                for k, lane in enumerate(lanes):
                    obs[lane], infos[lane] = result.obs[k], result.infos[k]
                rewards[lanes], terminated[lanes], truncated[lanes] = (
                    result.rewards,
                    result.terminated,
                    result.truncated,
                )
                stragglers += [shard.lanes[i] for i in shard.pool.timing.stragglers]
            else:
                for lane in lanes:
                    infos[lane] = {"error": self._lost_lane(lane)}
                truncated[lanes] = True
        self.timing.stragglers = sorted(stragglers)
        return StepResult(obs, rewards, terminated, truncated, infos)

    def _reset_lanes(self, lanes: list, seeds, hard: bool, options, scrub: bool = False) -> tuple:
        """Lanes of a lost node are placed again on the nodes left (WorkerError
        when the cluster has no room for them)."""
        by_lane = None if seeds is None else dict(zip(lanes, seeds))
        homeless = [lane for lane in lanes if lane not in self._lane_shard]
        if homeless:
            self._place(homeless)

        def call(shard, locals_):
            def run(pool):
                shard_seeds = (
                    None
                    if by_lane is None
                    else [by_lane.get(lane) if i in locals_ else None for i, lane in enumerate(shard.lanes)]
                )
                return pool.reset(seed=shard_seeds, where=locals_, hard=hard, options=options, scrub=scrub)

            return run

        results = self._fan_out({shard: call(shard, locals_) for shard, locals_ in self._by_shard(lanes).items()})
        obs: list[Any] = []
        infos: list[Any] = []
        for lane in lanes:
            placed = self._lane_shard.get(lane)
            if placed is None or isinstance(results.get(placed[0]), Exception):
                obs.append(None)
                infos.append({"error": self._lost_lane(lane)})
            else:
                shard, local = placed
                obs.append(results[shard][local])
                infos.append(shard.pool.reset_infos[local])
        self._flying[lanes] = False
        self._ready = [r for r in self._ready if r[0] not in set(lanes)]
        return obs, infos

    def _send_lanes(self, actions: list, lanes: list, resets, how=None) -> None:
        if self._flying[lanes].any():
            raise ValueError("send() to an env that is in flight or has a result not yet received")
        split = self._split(actions, lanes)
        local_resets = self._by_shard(resets or [])
        seeds, options, scrub = how if how is not None else (None, None, False)
        # Each node's pool takes its resets' seeds as reset() does: one per env of it (length n).
        local_seeds: dict = {}
        for lane, seed in zip(resets or [], seeds or []):
            if lane in self._lane_shard:
                shard, local = self._lane_shard[lane]
                local_seeds.setdefault(shard, [None] * shard.pool.n)[local] = seed

        def send(shard, where, a, r):
            return lambda pool: pool.send(a, where, r, seed=local_seeds.get(shard), options=options, scrub=scrub)

        results = self._fan_out(
            {shard: send(shard, loc, vals, local_resets.get(shard)) for shard, (loc, _, vals) in split.items() if shard}
        )
        self._flying[lanes] = True
        for shard, (_, globals_, _) in split.items():
            if shard is None or isinstance(results.get(shard), Exception):
                for lane in globals_:
                    self._ready.append((lane, None, 0.0, False, True, {"error": self._lost_lane(lane)}))

    def _recv_lanes(self, batch_size, timeout) -> RecvResult:
        flying = int(self._flying.sum())
        want = flying if batch_size is None else batch_size
        if flying == 0 or want > flying:
            raise ValueError(
                f"recv(batch_size={want}) would wait forever: only {flying} result(s) can come "
                "(envs in flight or finished); send() to more envs first"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        started = time.perf_counter()
        while len(self._ready) < want:
            held = {r[0] for r in self._ready}
            pending = {}
            for shard in self._live():
                count = sum(1 for lane in shard.lanes if self._flying[lane] and lane not in held)
                if count > 0:
                    pending[shard] = min(count, want - len(self._ready))
            if not pending:
                break
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            # One node: block on it. Several: poll each briefly, so one slow
            # node does not hold back the results another already has.
            wait = left if len(pending) == 1 else (0.005 if left is None else min(0.005, left))
            results = self._fan_out(
                {shard: (lambda pool, k=k, w=wait: pool.recv_full(k, w)) for shard, k in pending.items()}
            )
            for shard, result in results.items():
                if isinstance(result, Exception):
                    for lane in shard.lanes:
                        if self._flying[lane] and lane not in held:
                            self._ready.append((lane, None, 0.0, False, True, {"error": self._lost_lane(lane)}))
                    continue
                for k, local in enumerate(result.env_ids.tolist()):
                    self._ready.append(
                        (
                            shard.lanes[local],
                            result.obs[k],
                            float(result.rewards[k]),
                            bool(result.terminated[k]),
                            bool(result.truncated[k]),
                            result.infos[k],
                        )
                    )
            if deadline is not None and time.monotonic() >= deadline:
                break
        taken, self._ready = self._ready[:want], self._ready[want:]
        env_ids = np.array([r[0] for r in taken], dtype=np.int64)
        self._flying[env_ids] = False
        self.timing.roundtrip_ms = (time.perf_counter() - started) * 1000.0
        return RecvResult(
            env_ids,
            [r[1] for r in taken],
            np.array([r[2] for r in taken], dtype=np.float64),
            np.array([r[3] for r in taken], dtype=np.bool_),
            np.array([r[4] for r in taken], dtype=np.bool_),
            [r[5] for r in taken],
        )

    def _render_lanes(self, lanes: list) -> list:
        for lane in lanes:
            self._locate(lane)  # a lane on no node is an error, before any request

        def run(pool):
            try:
                return pool.render_all()
            except EnvError as exc:
                return exc

        wanted = self._by_shard(lanes)
        results = self._fan_out({shard: run for shard in wanted})
        frames = {}
        for shard, locals_ in wanted.items():
            result = results[shard]
            if isinstance(result, EnvError):
                lane = shard.lanes[result.env_index]
                raise EnvError(
                    f"env {lane} (env {result.env_index} of node {shard.node}) could not render: "
                    f"{str(result).partition('could not render: ')[2]}",
                    env_index=lane,
                ) from result
            if isinstance(result, Exception):
                raise WorkerError(
                    f"env {shard.lanes[locals_[0]]}: {shard.lost}; reset it to place it on another node"
                ) from result
            for local in locals_:
                frames[shard.lanes[local]] = result[local]
        return [frames[lane] for lane in lanes]

    def _attr(self, op: str, name, env_ids, args: list, kwargs: dict, values=None) -> list:
        # Each node's lanes in one request (RLPool.call/get_attr/set_attr), joined in lane order.
        lanes = list(range(self.n)) if env_ids is None else self._env_ids(env_ids)
        for lane in lanes:
            self._locate(lane)  # a lane on no node is an error, before any request
        split = self._split(values if values is not None else [None] * len(lanes), lanes)

        def run(locals_, vals):
            if op == "call":
                return lambda pool: pool.call(name, *args, env_ids=locals_, **kwargs)
            if op == "get":
                return lambda pool: pool.get_attr(name, env_ids=locals_)
            return lambda pool: pool.set_attr(name, vals, env_ids=locals_)

        results = self._fan_out({shard: run(locals_, vals) for shard, (locals_, _, vals) in split.items()})
        out: dict[int, Any] = {}  # global lane -> its value
        for shard, (_, globals_, _) in split.items():
            result = results[shard]
            if isinstance(result, Exception):  # the node was lost during the call
                raise WorkerError(f"env {globals_[0]}: {self._lost_lane(globals_[0])}") from result
            out.update(zip(globals_, result or [None] * len(globals_)))
        return [out[lane] for lane in lanes]

    def _log(self, index: int) -> str:
        shard, local = self._locate(index)
        return shard.pool.log(local)

    def memory(self) -> MemoryReport:
        """Each env's memory in lane order (0 for a lost node's lanes), and what each node's pool shares."""
        self._check_open()
        results = self._fan_out({shard: (lambda pool: pool.memory()) for shard in self._live()})
        per_env, shared, sources = [0] * self.n, 0, set()
        for shard, report in results.items():
            if isinstance(report, MemoryReport):
                for local, lane in enumerate(shard.lanes):
                    per_env[lane] = report.per_env[local]
                shared += report.shared
                sources.add(report.source)
        return MemoryReport(per_env, "; ".join(sorted(sources)) + f" (over {len(results)} node(s))", shared=shared)

    def pids(self) -> list:
        """Each env's host pid on its node (-1 for a lost node's lanes)."""
        return self._per_lane(lambda pool: pool.pids(), -1)

    def _per_lane(self, call, missing) -> list:
        """call(pool) on every live node concurrently, joined into lane order."""
        self._check_open()
        results = self._fan_out({shard: call for shard in self._live()})
        out = [missing] * self.n
        for shard, values in results.items():
            if isinstance(values, list):
                for local, lane in enumerate(shard.lanes):
                    out[lane] = values[local]
        return out

    def states(self) -> list:
        """Each lane's state (Pool.states); 'lost' for a lane whose node was lost."""
        return self._per_lane(lambda pool: pool.states(), "lost")

    def _locate(self, index: int) -> tuple:
        if index not in self._lane_shard:
            raise WorkerError(f"env {index}: {self._lost_lane(index)}")
        return self._lane_shard[index]

    def shutdown(self, reason: str = "owner shutdown") -> bool:
        """Ask every node's worker to stop its share now (RLPool.shutdown), then close."""
        if self._closed:
            return False
        results = self._fan_out({shard: (lambda pool: pool.shutdown(reason)) for shard in self._live()})
        self.close()
        return all(result is True for result in results.values())

    @property
    def lane_nodes(self) -> list:
        """The Ray node id holding each lane (None for a lane whose node was lost)."""
        return [self._lane_shard[lane][0].node if lane in self._lane_shard else None for lane in range(self.n)]

    @property
    def nodes(self) -> list:
        """The node ids this pool has lanes on now."""
        return sorted({shard.node for shard in self._live()})

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close every node's pool and remove every actor this pool created. Idempotent."""
        if self._closed and not self._shards and not self._actors:
            return
        self._closed = True
        self._failure_summary()
        for shard in self._shards:
            if shard.pool is not None:
                shard.pool.close()
        self._shards = []
        if self._actors:
            ray = _ray()
            for actor in self._actors.values():
                try:
                    ray.get(actor.stop.remote(), timeout=30)
                except Exception:  # a lost node's actor is gone already
                    pass
                ray.kill(actor)
            self._actors = {}
        self._executor.shutdown(wait=False)
