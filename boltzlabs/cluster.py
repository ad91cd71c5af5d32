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

Not a subclass of RLPool: `RLPool(source, n, cluster="ray")` returns a
ClusterPool, which keeps RLPool's calls and their meaning.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from boltzlabs.pool.client import MemoryReport, RLPool, Timing
from boltzlabs.errors import PoolClosedError, WorkerError

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
        raise ImportError("RLPool(cluster=...) needs Ray: pip install 'boltzlabs[ray]'") from None
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
        # client is the pool's owner, so no ceiling on what that asks for.
        no_ceilings = [arg for flag, _, _ in CEILINGS.values() for arg in (flag, "none")]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "boltzlabs", "worker", "--listen", f"{host}:0", "--parent", str(os.getpid()),
             "--max-envs", "100000", *no_ceilings],
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env, start_new_session=True)
        line = self.proc.stdout.readline().strip()
        if not line.startswith("listening on "):
            raise RuntimeError(f"boltzlabs worker did not start on node {self.node_id}: {line!r}")
        self.url = line[len("listening on "):]

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
    refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote(n)
            for node in ray.nodes() if node["Alive"]]
    return ray.get(refs)


def placement(n: int, nodes: list, envs_per_node=None, held=None) -> list:
    """Split n lanes over nodes [(node id, cpus, memory bytes)]: by CPUs, each
    node capped at envs_per_node (or what half its memory holds) minus the
    lanes it already holds (`held`: {node id: lanes}). Returns [(node id,
    count)] with count > 0; ValueError when n does not fit."""
    held = held or {}
    caps = {node: (int(envs_per_node) if envs_per_node else max(1, int(memory * _MEMORY_SHARE) // _ENV_BUDGET))
            - held.get(node, 0) for node, _, memory in nodes}
    room = sum(max(0, cap) for cap in caps.values())
    if n > room:
        sizing = f"envs_per_node={envs_per_node}" if envs_per_node else "sized by memory"
        raise ValueError(f"the cluster has room for {room} more env(s) on {len(nodes)} alive node(s) ({sizing}); "
                         f"{n} are needed: add nodes or raise envs_per_node")
    counts = {node: 0 for node, _, _ in nodes}
    weights = {node: max(cpus, 1e-3) for node, cpus, _ in nodes}
    for _ in range(n):  # each lane to the node least loaded for its CPUs, among those with room
        node = min((node for node in counts if counts[node] < caps[node]),
                   key=lambda node: (held.get(node, 0) + counts[node] + 1) / weights[node])
        counts[node] += 1
    return [(node, count) for node, count in counts.items() if count]


@dataclass(eq=False)  # hashed by identity: a shard is a key of each fan-out
class _Shard:
    """One node's share: a remote pool and the global lanes it holds, in order."""

    node: str
    pool: RLPool | None
    lanes: list
    lost: str = ""  # why the node was lost, once it is


class ClusterPool:
    """n envs spread over a Ray cluster's nodes, behind RLPool's API.

        pool = RLPool("./my_env", 4096, cluster="ray")   # or a cluster address
        obs = pool.reset(seed=0)
        obs, rewards, dones, infos = pool.step(actions)

    Lanes keep the user's order whatever node holds them (`lane_nodes`).
    Every call sends one batched request per node, concurrently;
    `timing.worker_ms` is the slowest node's, `timing.nodes` each node's.
    envs_per_node caps how many lanes a node takes (default: by its memory;
    lanes are split by CPUs). Everything else RLPool takes (step_timeout,
    spawn, memory_limit, ...) applies on every node.
    """

    def __init__(self, source, n: int, *, cluster="ray", envs_per_node=None, **kwargs):
        self._closed = True
        self._shards: list[_Shard] = []
        self._actors: dict = {}
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"n must be a whole number of envs, at least 1; got {n!r}")
        for name in ("worker", "token"):
            if kwargs.get(name) is not None:
                raise ValueError(f"RLPool(cluster=...) places its own workers; do not pass {name}=")
        self.n = int(n)
        self.source = str(source)
        kwargs.pop("progress", None)  # each node's pool starts quietly
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

    # -- placement -------------------------------------------------------------------

    def _alive_nodes(self) -> list:
        ray = _ray()
        lost = {shard.node for shard in self._shards if shard.lost}
        return [(node["NodeID"], node["Resources"].get("CPU", 0.0), node["Resources"].get("memory", 0.0))
                for node in ray.nodes() if node["Alive"] and node["NodeID"] not in lost]

    def _actor(self, node: str):
        ray = _ray()
        if node not in self._actors:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            actor_class = ray.remote(num_cpus=0, max_restarts=0)(NodeWorker)
            self._actors[node] = actor_class.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(self._token)
        return self._actors[node]

    def _place(self, lanes: list) -> None:
        """Start pools for `lanes` on the alive nodes, one per node, concurrently."""
        ray = _ray()
        held = {}
        for shard in self._live():
            held[shard.node] = held.get(shard.node, 0) + len(shard.lanes)
        try:
            plan = placement(len(lanes), self._alive_nodes(), self._envs_per_node, held)
        except ValueError as exc:
            raise WorkerError(str(exc)) from None
        addresses = dict(ray.get([self._actor(node).address.remote() for node, _ in plan]))
        shards, start = [], 0
        for node, count in plan:
            shards.append(_Shard(node, None, lanes[start:start + count]))
            start += count

        def open_pool(shard):
            shard.pool = RLPool(self.source, len(shard.lanes), worker=addresses[shard.node], token=self._token,
                                progress=False, **self._kwargs)
            return shard

        futures = [self._executor.submit(open_pool, shard) for shard in shards]
        errors = []
        for future in futures:
            try:
                self._shards.append(future.result())
            except Exception as exc:  # noqa: BLE001 - every node's failure is reported below
                errors.append(exc)
        if errors:
            raise errors[0]
        self._index()

    def _index(self) -> None:
        self._lane_shard = {}
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
        except Exception:  # noqa: BLE001 - the node is gone; closing is best effort
            pass

    # -- fan-out ---------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosedError("this pool is closed; create a new one")

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
        self.timing = Timing(worker_ms=max(nodes.values(), default=0.0),
                             roundtrip_ms=(time.perf_counter() - started) * 1000.0, nodes=nodes)
        return results

    def _split(self, values, lanes: list, what: str) -> dict:
        """{shard: (local lanes, global lanes, values)} for `lanes` (global), values
        aligned with them; shard None holds the lanes on no node (a lost one's)."""
        if len(values) != len(lanes):
            raise ValueError(f"{what} needs {len(lanes)} actions, one per env; got {len(values)}")
        out = {}
        for value, lane in zip(values, lanes):
            shard, local = self._lane_shard.get(lane, (None, None))
            locals_, globals_, vals = out.setdefault(shard, ([], [], []))
            locals_.append(local)
            globals_.append(lane)
            vals.append(value)
        return out

    @staticmethod
    def _rows(actions) -> list:
        if isinstance(actions, np.ndarray):
            return actions.tolist() if actions.ndim == 1 else list(actions)
        try:
            return list(actions)
        except TypeError:
            raise TypeError(f"actions must be a sequence, not {type(actions).__name__}") from None

    def _lost_lane(self, lane: int) -> str:
        for shard in self._shards:
            if shard.lost and lane in shard.lanes:
                return shard.lost + "; reset this env to place it on another node"
        return "this env is on no node; reset it"

    # -- the API ---------------------------------------------------------------------

    def step(self, actions):
        """Step every env (RLPool.step): (obs, rewards float32[n], dones, infos)."""
        self._check_open()
        rows = self._rows(actions)
        if len(rows) != self.n:
            raise ValueError(f"step() needs {self.n} actions, one per env; got {len(rows)}")
        split = self._split(rows, list(range(self.n)), "step()")
        calls = {shard: (lambda pool, a=vals: pool._step(a)) for shard, (_, _, vals) in split.items() if shard}
        results = self._fan_out(calls)
        obs, infos = [None] * self.n, [None] * self.n
        rewards = np.zeros(self.n, dtype=np.float64)
        terminated = np.zeros(self.n, dtype=np.bool_)
        truncated = np.zeros(self.n, dtype=np.bool_)
        stragglers = []
        for shard, (_, lanes, _) in split.items():
            result = results.get(shard)
            if isinstance(result, tuple):
                o, r, te, tr, inf = result
                for k, lane in enumerate(lanes):
                    obs[lane], infos[lane] = o[k], inf[k]
                rewards[lanes], terminated[lanes], truncated[lanes] = r, te, tr
                stragglers += [shard.lanes[i] for i in shard.pool.timing.stragglers]
            else:
                for lane in lanes:
                    infos[lane] = {"error": self._lost_lane(lane)}
                truncated[lanes] = True
        self.rewards, self.terminated, self.truncated = rewards, terminated, truncated
        self.timing.stragglers = sorted(stragglers)
        return obs, rewards.astype(np.float32), terminated | truncated, infos

    def reset(self, seed=None, where=None, hard: bool = False, options=None) -> list:
        """Reset envs (RLPool.reset). Lanes of a lost node are placed again on
        the nodes left (WorkerError when the cluster has no room for them)."""
        self._check_open()
        lanes = RLPool._lanes(self, where)
        if seed is None:
            seeds = None
        elif isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
            seeds = {lane: int(seed) + lane for lane in lanes}
        elif isinstance(seed, (list, tuple, np.ndarray)) and len(seed) == self.n:
            seeds = {lane: seed[lane] for lane in lanes}
        else:
            raise ValueError(f"seed must be an int, a list of n={self.n} ints or None")
        homeless = [lane for lane in lanes if lane not in self._lane_shard]
        if homeless:
            self._place(homeless)
        by_shard: dict = {}
        for lane in lanes:
            shard, local = self._lane_shard[lane]
            by_shard.setdefault(shard, []).append(local)

        def call(shard, locals_):
            def run(pool):
                shard_seeds = None if seeds is None else [
                    seeds.get(lane) if i in locals_ else None for i, lane in enumerate(shard.lanes)]
                return pool.reset(seed=shard_seeds, where=locals_, hard=hard, options=options)
            return run

        results = self._fan_out({shard: call(shard, locals_) for shard, locals_ in by_shard.items()})
        obs = [None] * self.n
        for shard in self._shards:
            result = results.get(shard)
            if shard.lost or isinstance(result, Exception):
                continue
            current = result if result is not None else shard.pool._obs
            for local, lane in enumerate(shard.lanes):
                obs[lane] = current[local]
        self._flying[lanes] = False
        return obs

    def send(self, actions, env_ids=None) -> None:
        """Hand actions to envs and return at once (RLPool.send), one request per node."""
        self._check_open()
        lanes = list(range(self.n)) if env_ids is None else RLPool._env_ids(self, env_ids)
        rows = self._rows(actions)
        if self._flying[lanes].any():
            raise ValueError("send() to an env that is in flight or has a result not yet received")
        split = self._split(rows, lanes, "send()")
        results = self._fan_out({shard: (lambda pool, l=loc, a=vals: pool.send(a, l))
                                 for shard, (loc, _, vals) in split.items() if shard})
        self._flying[lanes] = True
        for shard, (_, globals_, _) in split.items():
            if shard is None or isinstance(results.get(shard), Exception):
                for lane in globals_:
                    self._ready.append((lane, None, 0.0, False, True, {"error": self._lost_lane(lane)}))

    def recv(self, batch_size=None, timeout=None):
        """The first batch_size envs to finish, over every node (RLPool.recv)."""
        self._check_open()
        flying = int(self._flying.sum())
        want = flying if batch_size is None else int(batch_size)
        if not 1 <= want <= max(flying, 1) or flying == 0:
            raise ValueError(f"recv() batch_size must be in [1, {flying}] (envs in flight or finished)")
        deadline = None if timeout is None else time.monotonic() + float(timeout)
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
            results = self._fan_out({shard: (lambda pool, k=k, w=wait: pool._recv(k, w))
                                     for shard, k in pending.items()})
            for shard, result in results.items():
                if isinstance(result, Exception):
                    for lane in shard.lanes:
                        if self._flying[lane] and lane not in held:
                            self._ready.append((lane, None, 0.0, False, True, {"error": self._lost_lane(lane)}))
                    continue
                ids, obs, rewards, terminated, truncated, infos = result
                for k, local in enumerate(ids.tolist()):
                    self._ready.append((shard.lanes[local], obs[k], float(rewards[k]), bool(terminated[k]),
                                        bool(truncated[k]), infos[k]))
            if deadline is not None and time.monotonic() >= deadline:
                break
        taken, self._ready = self._ready[:want], self._ready[want:]
        env_ids = np.array([r[0] for r in taken], dtype=np.int64)
        self._flying[env_ids] = False
        rewards = np.array([r[2] for r in taken], dtype=np.float64)
        terminated = np.array([r[3] for r in taken], dtype=np.bool_)
        truncated = np.array([r[4] for r in taken], dtype=np.bool_)
        self.timing.roundtrip_ms = (time.perf_counter() - started) * 1000.0
        return env_ids, [r[1] for r in taken], rewards.astype(np.float32), terminated | truncated, [r[5] for r in taken]

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
        return MemoryReport(per_env, "; ".join(sorted(sources)) + f" (over {len(results)} node(s))",
                            shared=shared)

    def envs_per_gb(self) -> float:
        """Envs per GiB over the whole cluster (RLPool.envs_per_gb)."""
        return (1 << 30) / max(1.0, self.memory().mean)

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
        """Each lane's state (RLPool.states); 'lost' for a lane whose node was lost."""
        return self._per_lane(lambda pool: pool.states(), "lost")

    def lane_states(self) -> list:
        """Each lane's async state (RLPool.lane_states); 'lost' for a lost node's lanes."""
        return self._per_lane(lambda pool: pool.lane_states(), "lost")

    def _locate(self, index) -> tuple:
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or not 0 <= index < self.n:
            raise ValueError(f"env index must be in [0, {self.n}); got {index!r}")
        if int(index) not in self._lane_shard:
            raise WorkerError(f"env {index}: {self._lost_lane(int(index))}")
        return self._lane_shard[int(index)]

    def log(self, index: int) -> str:
        """The tail of env `index`'s output (RLPool.log), from its node."""
        self._check_open()
        shard, local = self._locate(index)
        return shard.pool.log(local)

    def render(self, env_index: int = 0):
        """Env `env_index`'s frame (RLPool.render), from its node."""
        self._check_open()
        shard, local = self._locate(env_index)
        return shard.pool.render(local)

    @property
    def reset_infos(self) -> list:
        """Each lane's latest reset info (RLPool.reset_infos)."""
        out = [None] * self.n
        for shard in self._live():
            for local, lane in enumerate(shard.lanes):
                out[lane] = shard.pool.reset_infos[local]
        return out

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

    def __len__(self) -> int:
        return self.n

    def __enter__(self) -> "ClusterPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close every node's pool and remove every actor this pool created. Idempotent."""
        if self._closed and not self._shards and not self._actors:
            return
        self._closed = True
        for shard in self._shards:
            if shard.pool is not None:
                shard.pool.close()
        self._shards = []
        if self._actors:
            ray = _ray()
            for actor in self._actors.values():
                try:
                    ray.get(actor.stop.remote(), timeout=30)
                except Exception:  # noqa: BLE001 - a lost node's actor is gone already
                    pass
                ray.kill(actor)
            self._actors = {}
        self._executor.shutdown(wait=False)
