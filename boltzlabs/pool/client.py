"""The client: `RLPool`, what a training loop holds.

    RLPool --CALL frames over a socketpair--> worker process (boltzlabs.worker)
    RLPool <--REPLY/ERROR/PROGRESS frames---- worker process

The client validates every argument before a byte is sent (a Gymnasium
source's id and params included, see sources.py), turns the worker's replies
into numpy arrays, keeps each lane's latest observation (so a partial reset
can splice) and each lane's episode (id, seed, length, return), and owns the
worker's life: `close()`, the context manager, garbage collection and
interpreter exit all end it, and a call interrupted by Ctrl-C kills it
rather than leave it half way.

Every call has a deadline: what it asked for (the step's timeout, a reset's
respawns, the start's timeout: _budget) plus DEADLINE_MARGIN, moved on by
each HEARTBEAT the worker sends while a long call progresses (wire.md). Past
it the worker is taken for stuck (stopped, deadlocked, a silent remote host):
the call raises WorkerError (kind "deadline") and the pool is closed as at a
worker's death, a local worker killed. close() returns once the worker, its
process group and its cgroups are gone, and warns naming what is not.
"""

from __future__ import annotations

import json
import math
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from boltzlabs import wire
from boltzlabs.link import worker_environment
from boltzlabs.pool import groups, imports, keywords, progress as start_progress, shards, slots, sources
from boltzlabs.errors import (
    CATEGORIES,
    DEADLINE,
    HOST,
    INTERNAL,
    POLICY,
    PROTOCOL,
    START,
    USAGE,
    USAGE_TYPE,
    EnvError,
    EnvStartError,
    PolicyError,
    PoolClosedError,
    ProtocolError,
    SandboxUnavailable,
    WorkerError,
    WorkerSideError,
    describe_exit,
    exit_signal,
    stopped,
)
from boltzlabs.pool.protocol import (
    Pool,
    RecvResult,
    StepResult,
    attr_error,
    check_batch_size,
    check_cpus,
    check_n,
    raise_unserializable,
)
from boltzlabs.pool.text import text_note
from boltzlabs.units import parse_size

if TYPE_CHECKING:
    from boltzlabs.pool.remote_link import RemoteLink

__all__ = ["RLPool", "ShardedPool", "Timing", "MemoryReport", "EnvContract"]

# Seconds a call may run past what it asked for (_budget), and past the worker's last HEARTBEAT,
# before the worker is taken for stuck: generous, for a loaded machine (docs/api.md#deadlines).
DEADLINE_MARGIN = 10.0
# What a start may take when RLPool(start_timeout=None) leaves it to the worker's policy (60 s as
# shipped), and a shutdown() (the worker's kills, then its cgroups); heartbeats move both on.
_START_BUDGET = 60.0
_CLOSE_BUDGET = 10.0
# How long close() waits for the worker to end the pool itself after CLOSE (then it is killed), for
# what is left of its process group, and at most for its cgroup guardian (which gives up on a
# cgroup only once none has gone for 5 s: host/cgroups.py).
_CLOSE_WAIT = 10.0
_GROUP_WAIT = 10.0
_GUARDIAN_WAIT = 300.0

# The client's socket timeout: a read wakes after a second of silence to look at the worker and the
# call's deadline. A CALL longer than _BIG_FRAME is sent with the call's whole deadline instead.
_SILENCE = 1.0
_BIG_FRAME = 1 << 20

# Reads from the worker. Not 1 MiB: a buffer that large is an mmap, mremap and
# munmap per read (~90 us here), most of the hop at small n.
_RECV_SIZE = 1 << 16


def _frame_buffer(size: int):
    """A long frame's own buffer (wire.FrameReader(allocate=)): not zeroed, it is read over."""
    return np.empty(size, np.uint8)


# A REPLY's result as a message wire.decode takes: [REPLY, result] (a two-item array and its code).
_REPLY_OF_TWO = b"\x92" + bytes([wire.REPLY])


class _Lent:
    """The lanes a worker lent its client for direct steps (RLPool._step_direct): each lane's
    channel (our copies of its read and write end), an epoll of the read ends, and what the
    worker's own step would use: its caps of a reply, byte budget, step_timeout, sequence numbers."""

    def __init__(self, fastpath: Any, info: dict, fds: list[int], n: int) -> None:
        self.fastpath = fastpath
        self.chans: list[int] = fds[0::2]
        self.wchans: list[int] = fds[1::2]
        self.caps: tuple = tuple(info["caps"])
        self.room: int = info["room"]
        self.step_timeout: float = info["step_timeout"]
        self.next: int = info["seq"]
        self.end: int = info["seq"] + info["seqs"]
        self.no_resets = bytes(n)
        self.epoll = select.epoll()
        for chan in self.chans:
            self.epoll.register(chan, select.EPOLLIN)

    @staticmethod
    def valid(info: Any, fds: list[int], n: int) -> bool:
        """Whether a "lend" REPLY's `info` and fds describe a lending of n lanes."""
        return (
            type(info) is dict
            and len(fds) == 2 * n
            and type(info.get("seq")) is int
            and type(info.get("seqs")) is int
            and info["seq"] > 0
            and info["seqs"] > 0
            and type(info.get("caps")) is list
            and len(info["caps"]) == 9
            and all(type(cap) is int and cap >= 0 for cap in info["caps"])
            and type(info.get("room")) is int
            and type(info.get("step_timeout")) is float
            and info["step_timeout"] > 0
        )

    def close(self) -> None:
        self.epoll.close()
        for fd in (*self.chans, *self.wchans):
            os.close(fd)


@dataclass
class Timing:
    """Timing of the latest call (`step()`, `reset()`, `send()`, `recv()`, ...).

    worker_ms: the call as measured on the worker (fan-out, env code,
    gather; for a grouped pool's direct step, which runs the worker's step
    here, that step: equal to roundtrip_ms); roundtrip_ms: this process's
    wall clock around the whole call;
    stragglers: lanes that missed their deadline in that call (for recv(),
    the received lanes that did).

    For asynchronous stepping, set by each recv() (0 after other calls):
    wait_ms: how long recv() blocked waiting for envs to finish (0 when
    batch_size results were already there). High: the trainer waits for
    envs; a smaller batch_size (or more envs) keeps it busy.
    queued_ms: the mean time the received results had been sitting
    finished in the worker before this recv() took them. High: envs wait
    for the trainer; a larger batch_size (or fewer envs) keeps them busy.

    nodes: for a pool spread over a cluster (boltzlabs.cluster.ClusterPool), each
    node's worker_ms in that call; worker_ms is then the slowest node's.

    shards: for a pool over several worker processes (RLPool(..., workers=k)),
    each shard's worker_ms in that call, in shard order (0 for a shard the
    call did not reach); worker_ms is then the slowest shard's (their sum
    with serialize_measurement, where the shards take turns).
    """

    worker_ms: float = 0.0
    roundtrip_ms: float = 0.0
    stragglers: list = field(default_factory=list)
    wait_ms: float = 0.0
    queued_ms: float = 0.0
    nodes: dict = field(default_factory=dict)
    shards: list = field(default_factory=list)

    def __str__(self) -> str:
        text = (
            f"worker {self.worker_ms:.2f} ms, roundtrip {self.roundtrip_ms:.2f} ms, {len(self.stragglers)} straggler(s)"
        )
        if self.wait_ms or self.queued_ms:
            text += f", waited {self.wait_ms:.2f} ms, results queued {self.queued_ms:.2f} ms"
        return text


@dataclass
class MemoryReport:
    """Memory in bytes: each env's own, what the pool shares, and the source.

    per_env: each env's charge (its cgroup: its processes, the pages they
    wrote, its kernel objects). shared: what the pool itself holds (the warm
    template and every page it imported, shared by all envs). total and
    mean include both: mean is what one env costs, the number on the bill.
    """

    per_env: list
    source: str
    note: str = ""
    shared: int = 0

    @property
    def total(self) -> int:
        return int(sum(self.per_env)) + self.shared

    @property
    def mean(self) -> float:
        return self.total / max(1, len(self.per_env))


@dataclass(frozen=True)
class EnvContract:
    """What the env declared in its handshake (env 0's; every env runs the same code).

    observation_space and action_space are space specs (boltzlabs.pool.spaces;
    `from_spec` rebuilds the Gymnasium space), None when the env declared none.
    """

    id: str
    protocol_version: int
    observation_space: dict | None
    action_space: dict | None
    metadata: dict
    render_mode: str | None
    # The template's warm-up (spawn="template"; docs/templates.md): {"modules":
    # the library modules env.py's import and its first reset and steps
    # imported, "preload": RLPool(preload=), boltzlabs.toml and
    # serve(preload=...), "imported", "failed": {name: error},
    # "private_birth"/"private_after": the probe's Private_Dirty bytes at its
    # birth and after its steps, "steps", "seconds", "error": None or why the
    # probe failed}. None in exec mode, or with RLPool(warmup=False) and no
    # preload list.
    warmup: dict | None = None
    # What pool.call / get_attr / set_attr reach (boltzlabs.env.serve's
    # methods=, attributes=, target=): {"methods": [names], "attributes":
    # {name: writable}, "target": the target's type name or None (None: only
    # the names listed)}.
    attributes: dict | None = None

    def __getitem__(self, key: str):
        """`contract["warmup"]` is `contract.warmup`, and so on for every field."""
        if key not in self.__dataclass_fields__:
            raise KeyError(key)
        return getattr(self, key)


def _positive(name: str, value, allow_none: bool = True):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")
    return float(value)


def _cpu_budget(value) -> float | None:
    """RLPool(cpu_budget=) checked: None (off), or CPU seconds per step, finite and > 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(
            f"cpu_budget must be a positive, finite number of CPU seconds per step (None: no budget), not {value!r:.80}"
        )
    return float(value)


def _preload(names):
    """RLPool(preload=...) as a list of str (the worker checks each name)."""
    if names is None:
        return None
    if isinstance(names, str) or not all(isinstance(name, str) for name in names):
        raise TypeError(f"preload must be a list of module names, like ['scipy.special'], not {names!r:.80}")
    return list(names)


def _flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, not {value!r:.80}")
    return value


class RLPool(Pool):
    """n live envs, each in its own bubblewrap sandbox, behind one batched step.

        with RLPool("./my_env", 1000) as pool:
            obs = pool.reset(seed=0)
            obs, rewards, dones, infos = pool.step(actions)
            obs = pool.reset(where=dones)

    Parameters:
      source: directory holding env.py (which calls boltzlabs.env.serve).
      n: number of envs.
      step_timeout: seconds an env has to answer a step or reset; one that
        misses it is a straggler (done, reward 0, info["straggler"]). None
        takes the policy default (sandbox/policy.toml). With
        serialize_measurement it bounds each env's turn at the gate.
      cpu_budget: CPU seconds each lane's sandbox may use per step, all its
        processes together (children and daemons it starts included), as its
        cgroup counts them: from the step's send until its next step or reset
        is sent, so what a step leaves running after its reply counts too.
        A lane over it is killed (its whole cgroup) and reported on its lane:
        reward 0, truncated, obs None, info["error"] saying how much it used,
        info["cpu_budget"] True; the other lanes are not touched. Resets are
        not budgeted. None (default): no budget. Needs the pool's cgroups
        (refused without them); steps through the pure-Python step path.
        With envs_per_sandbox it bounds each sandbox as a whole.
        docs/limits.md#cpu-budget.
      cpu_share: True gives each sandbox one equal share of the CPU, all
        its processes together: the scheduler weighs each as one group,
        however many processes it forks or sessions it starts, and the
        pool's sandboxes together weigh as one against the trainer's and
        worker's processes. False (default): the kernel's own weighing
        (per session, where autogroup is on). Needs a cgroup of the cpu
        controller (refused without one). docs/limits.md#cpu-share.
      serialize_measurement: at most one env's step code runs at any instant.
      memory_limit: per-env memory limit (bytes or '512M'); an env over it is
        killed by the kernel and reported on its lane. Needs a memory cgroup.
      limits: per-env limits overriding the policy's [env_limits] for this
        pool, e.g. {"pids": 64, "open_files": 256, "file_size": "16M",
        "straggler_grace": 2.0}; see docs/limits.md.
      workspace_size: size of each env's private tmpfs workspace; None: the
        sandbox policy's [workspace] default_size (64M as shipped).
      spawn: "template" (default) forks every env from one warm template
        that has imported the library modules the env uses (never env.py:
        each forked env runs env.py once it is a sandbox): a fraction of the
        memory and start-up time. "exec" starts one interpreter per env. A
        template that cannot be forked safely (threads or sockets left by an
        import) falls back to "exec" with a warning; `pool.spawn` says which
        is in use.
      start_timeout: seconds each env has to complete its handshake.
      warmup: with spawn="template", run env.py, its reset and a few steps
        once in a throwaway sandbox (confined like an env, held to its
        limits) before the first fork, and import in the template the
        library modules that work imported (numpy.random, say), so no env
        pays for them on its own. A probe that fails is a warning, never a
        failed pool. `env_contract["warmup"]` reports it. False turns it off.
      preload: library modules the template imports besides what the
        warm-up finds (e.g. ["scipy.special"], one your env imports only
        sometimes); a `boltzlabs.toml` beside env.py can list more
        (`[boltzlabs] preload = [...]`). Names only: the template resolves
        them on the read-only library mounts, never in the env's directory.
      trust_env: with spawn="template", import env.py in the template itself
        (the trusted mode, for env code you wrote): module-level state made
        at import (tables, a loaded model) is then shared copy on write by
        every env, and env.py's import-time code keeps every power the
        template has over each env it forks (docs/templates.md says what
        that gives up). Default False. A remote worker refuses it unless its
        operator allows it (`boltzlabs worker --allow-trust-env`).
      batch_size: the default batch_size of recv() (asynchronous stepping:
        send() actions, recv() the first batch_size envs to finish).
      progress: show a progress bar while starting (default: on a terminal,
        for 64 envs or more): one bar of n envs, however many worker
        processes start them.
      worker: None runs the pool here, in a worker process of this machine.
        "tcp://host:port" (or "tls://host:port") runs it on a remote
        `boltzlabs worker --listen`: the env directory is shipped there
        (content-addressed, cached), and every call keeps its meaning;
        timing.worker_ms is measured there, roundtrip_ms here.
      token: the remote worker's token (default: $BOLTZLABS_TOKEN).
      tls_ca: for tls://, the worker's certificate or its CA (PEM) to verify it.
      env_vars: variables every env sees, e.g. {"MUJOCO_GL": "osmesa"}. The
        sandbox clears the environment: an env sees the policy's variables
        (sandbox/policy.toml [environment]), those of [pass_environment] that
        are set here (shipped: the ones that change numerical results, such
        as OPENBLAS_CORETYPE, and MUJOCO_GL), and these. PYTHON*, LD_* and
        the policy's own names are refused (ValueError).
      expose: paths of this machine that envs may read besides what they
        import (read-only), each below an import root: what this trainer
        imports from outside its site-packages, $PYTHONPATH's entries and
        editable installs, is bound narrowed to its packages and modules (a
        project root's .env, .git, data and notes stay out; the pool says
        once at start what it left out), e.g. expose=["/proj/data"].
        Refused for a remote worker, which binds none of this machine's paths.
      workers: the number of worker processes the lanes are split over
        (contiguous lane ranges, stepped concurrently; docs/sharding.md).
        None chooses from n and the cores this process may use
        (os.sched_getaffinity): 1 unless the pool is big enough to gain.
        Every call keeps its meaning: lane order, failures on their lanes,
        resets, send/recv, timing (timing.shards), memory().
      cpus: where the pool's worker processes and envs run. None (default):
        a pool over k > 1 workers runs shard i, its worker, template and
        every env (respawns too), on the i-th of k equal slices of the
        CPUs its worker may use (on all of them when they do not divide
        by k), so the shards' envs do not share cores (on shared cores
        they cost more CPU per env-step: docs/sharding.md); a one-worker
        pool is not pinned. CPU ids, like range(8, 64): the same
        over these CPUs only (of the machine that runs the workers), e.g. to
        leave CPUs 0-7 to the trainer; a one-worker pool runs on all of them.
        False: never pinned. `pool.affinity` lists each worker's CPUs (None:
        not pinned). Placement, not a limit: an env may widen its own.
      pin_sandboxes: True pins each sandbox (an env's, or with
        envs_per_sandbox a group's) to one CPU of those its worker runs on,
        in turn: sandbox i on the (i mod C)-th of C, at its start and every
        respawn. A sandbox's envs keep their caches on one core: a grouped
        pool with a sandbox per core steps faster (docs/performance.md:
        1.02x-1.17x with 2 sandboxes on 2 cores). False (default): the kernel places them. Not a
        default, since pools that share a node would all start at the same
        first CPUs: give each its own cpus= then.
      eager_reset: True resets an env whose step ended its episode as soon
        as that step's results are sent, unseeded, while the trainer works and
        the sandbox would wait; the next autoreset (a reset with no seed, no
        options, no scrub: the Gymnasium adapter's, or reset(where=...)) takes
        its result, and a reset holds up the batch less (LunarLander-v3,
        n = 32, k = 16, pinned: 1.04x-1.06x in the same-run table,
        docs/performance.md). Same results; what
        differs: until that autoreset, render() and get_attr of that env see
        the new episode, and a seeded reset, a call/set_attr or a step of it
        first means one more reset of it. Refused with serialize_measurement.
        False (default): each reset runs when it is asked for.
      envs_per_sandbox: k envs in each sandbox, ceil(n / k) sandboxes (the
        last holds the rest; a k above n is n), each one lane of an ordinary
        pool stepped in one turn: one frame in and one out per sandbox. None
        or 1 (default): a sandbox per env. With k > 1 the call returns a
        GroupedPool (boltzlabs.pool.groups): every call keeps its meaning,
        and `envs_per_sandbox`, `sandboxes` and `inner` (the pool of the
        sandboxes) say how it is built. The envs of a sandbox share its
        process, its workspace, the modules env.py imports (each runs
        env.py as a module of its own) and every limit: memory_limit,
        limits, workspace_size and step_timeout bound the sandbox as a
        whole, not each env. An exception fails its env alone; a death,
        OOM or missed deadline fails every env of the sandbox; a hard reset
        respawns the whole sandbox (reset_infos[i]["group_reset"]).
        trust_env=True is refused with k > 1. docs/groups.md.
      vectorization_mode: envs_per_sandbox in Gymnasium's and rlmesh's
        words: "sync" puts every env in one sandbox (k = n), "async" gives
        each its own (k = 1). envs_per_sandbox, when given, decides.
      cluster: refused (TypeError): a pool over a Ray cluster is
        boltzlabs.cluster.ClusterPool(source, n, cluster="ray", ...), the
        same protocol (boltzlabs.pool.protocol.Pool).
      params: the env's construction params, as a dict: a Gymnasium source
        passes them to gymnasium.make(id, **params), checked against the
        env's constructor here; an env directory reads them with
        boltzlabs.env.params(); env_fns take none. A keyword this signature
        does not take is such a param too (RLPool(src, n, level=3)), unless
        its name is close to an option's (step_timout=): that is refused as a
        misspelling (TypeError naming the option), unless a Gymnasium env's
        constructor names it; a param of such a name goes in params={...}.
        An env directory whose code never reads params() is warned about
        once (a text scan of its .py files). docs/api.md#env-params.

    `source` is a directory holding env.py, "gym://<id>" for a Gymnasium env,
    a bare Gymnasium id ("CartPole-v1", "ALE/Pong-v5") when no such path
    exists, or env_fns: a list of n callables, each returning a Gymnasium env
    (as AsyncVectorEnv takes them); lane i runs env_fns[i]() in its sandbox.

    Episodes: every reset mints a UUIDv7 episode id per lane
    (`episode_ids`); `finished_episodes` lists the episodes the latest step
    ended (lane, id, seed, length, return, terminated). `env_id` is this
    pool's UUIDv7, `env_contract` the env's handshake. `fast_path` says
    whether the worker steps through the native path (boltzlabs.worker._fastpath)
    or the pure-Python one (no extension built, BOLTZLABS_PURE=1, or a cpu_budget);
    `direct` whether this process steps the lanes itself, on channels the
    worker lends it (a local grouped pool's sandboxes, docs/native-step.md);
    `channel` whether each env talks to it over two pipes ("pipes") or, when
    the worker's open-file limit cannot hold 4 fds per env, a socketpair
    ("socketpair", 3 fds per env; BOLTZLABS_CHANNEL=socketpair forces it).
    """

    _link: _LocalLink | RemoteLink  # the worker process, local or over the network (_start_worker)
    _finalizer: weakref.finalize[[], RLPool]  # shuts the worker down when the pool is collected unclosed

    def __new__(cls, *args, workers=None, envs_per_sandbox=None, vectorization_mode=None, **kwargs):
        if cls is RLPool and (envs_per_sandbox is not None or vectorization_mode is not None):
            # RLPool(source, n, envs_per_sandbox=k) with k > 1: ceil(n / k) sandboxes of k envs each
            # (pool/groups.py), a pool of those sandboxes inside. Made whole here: not an RLPool.
            kwargs = dict(kwargs)
            source = args[0] if args else kwargs.pop("source", None)
            n = check_n(args[1] if len(args) > 1 else kwargs.pop("n", None))
            if len(args) > 2:
                raise TypeError("RLPool takes source and n positionally, its options by keyword")
            k = groups.group_size(envs_per_sandbox, vectorization_mode, n)
            if k > 1:
                if kwargs.get("trust_env"):
                    raise ValueError(
                        "trust_env=True imports env.py in the template, once; a sandbox of several envs runs "
                        "it once per env: leave trust_env out with envs_per_sandbox"
                    )
                batch_size = check_batch_size(kwargs.pop("batch_size", None), n)

                def inner(sandboxes: int, group: list):
                    return RLPool(source, sandboxes, workers=workers, _group=group, **kwargs)

                return groups.GroupedPool(inner, n, k, batch_size)
        # RLPool(source, n, workers=k) with k > 1 (or chosen so) is a pool over k
        # worker processes (pool/shards.py), still an RLPool to its caller.
        if cls is RLPool and shards.workers_for(args, kwargs, workers) > 1:
            cls = ShardedPool
        return super().__new__(cls)

    def __init__(
        self,
        source,
        n: int,
        *,
        step_timeout=None,
        cpu_budget=None,
        cpu_share: bool = False,
        serialize_measurement: bool = False,
        memory_limit=None,
        workspace_size=None,
        spawn: str = "template",
        start_timeout=None,
        progress=None,
        batch_size=None,
        limits=None,
        worker=None,
        token=None,
        tls_ca=None,
        cluster=None,
        warmup: bool = True,
        preload=None,
        trust_env: bool = False,
        env_vars=None,
        expose=None,
        workers=None,
        cpus=None,
        pin_sandboxes: bool = False,
        eager_reset: bool = False,
        envs_per_sandbox=None,
        vectorization_mode=None,
        _group: list | None = None,
        params=None,
        _shard: tuple[int, int] = (0, 1),
        _progress: start_progress.StartProgress | None = None,
        **env_params,
    ):
        self._closed = True
        self.workers = 1  # the worker processes the lanes are split over (pool/shards.py for more than one)
        self._closed_reason: str | None = None
        if cluster is not None:
            raise TypeError(
                "RLPool(..., cluster=...) no longer makes a cluster pool: make it with "
                "boltzlabs.cluster.ClusterPool(source, n, cluster='ray', ...) (same options)"
            )
        n = check_n(n)
        self.batch_size = check_batch_size(batch_size, n)
        cpus = check_cpus(cpus)
        if _flag("pin_sandboxes", pin_sandboxes) and cpus is False:
            raise ValueError(
                "pin_sandboxes=True pins each sandbox to one CPU, and cpus=False pins nothing: give "
                "cpus=None (the CPUs the worker may use) or the CPUs to spread the sandboxes over"
            )
        if _flag("eager_reset", eager_reset) and serialize_measurement:
            raise ValueError(
                "eager_reset=True runs an env's reset outside its turn, and serialize_measurement=True lets "
                "one env's code run at a time, in turn: ask for one of them"
            )
        # A grouped pool's lanes are sandboxes (pool/groups.py): _group is [k, envs], and the source
        # (env_fns) holds an env per env, not per lane. envs_per_sandbox of 1 is this pool.
        groups.group_size(envs_per_sandbox, vectorization_mode, n)
        # The env's params: params={...} as given, and the keywords this signature does not take, each
        # checked for a misspelt option first (pool/keywords.py).
        resolved = sources.resolve(
            source,
            keywords.merge(env_params, params),
            _group[1] if _group else n,
            bare=env_params,
            options=keywords.options(RLPool.__init__),
        )
        if env_vars is not None and (
            not isinstance(env_vars, dict)
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in env_vars.items())
        ):
            raise TypeError(
                f"env_vars must be a dict of variable names to strings, like {{'MUJOCO_GL': 'osmesa'}}; "
                f"got {env_vars!r:.200}"
            )
        import_roots = imports.roots()
        config = {
            "source_dir": str(resolved.env_dir),
            # As the sandbox will see them (JSON: a tuple is a list), not as the wire
            # would carry them: the worker writes them out as JSON.
            "params": json.loads(json.dumps(resolved.params, allow_nan=True)),
            "n": n,
            "step_timeout": _positive("step_timeout", step_timeout),
            "cpu_budget": _cpu_budget(cpu_budget),
            "cpu_share": _flag("cpu_share", cpu_share),
            "start_timeout": _positive("start_timeout", start_timeout),
            "serialize_measurement": bool(serialize_measurement),
            "memory_limit": parse_size(memory_limit) if memory_limit is not None else None,
            "workspace_size": None if workspace_size is None else parse_size(workspace_size),
            "spawn": spawn,
            "limits": limits,
            "warmup": bool(warmup),
            "preload": _preload(preload),
            "trust_env": _flag("trust_env", trust_env),
            "env_fns": list(resolved.env_fns) if resolved.env_fns is not None else None,
            # What this interpreter imports from outside its site-packages (pool/imports.py),
            # and what of those roots the envs may read besides (bound narrowed: host/roots.py).
            "import_roots": import_roots,
            "expose": imports.exposed(expose, import_roots, remote=worker is not None),
            "env_vars": env_vars,
            "group": _group,
            "eager_reset": eager_reset,
            # A local worker can hand us each env's observation slot (pool/slots.py): asked for unless
            # BOLTZLABS_NO_SHM=1; it gives them when the env's space has a fixed shape.
            "shared_memory": worker is None and slots.wanted(),
            # Where the worker and its envs run (worker/affinity.py): shard s of k on the s-th slice of
            # `cpus` (None: of the CPUs the worker may use); a one-worker pool only when cpus is given;
            # with pin_sandboxes, each sandbox on one CPU of the worker's.
            "affinity": (
                None
                if cpus is False or (cpus is None and _shard[1] == 1 and not pin_sandboxes)
                else {"cpus": cpus, "shard": _shard[0], "of": _shard[1], "spread": pin_sandboxes}
            ),
        }
        # The limits (against the policy of the worker that runs the pool, local
        # or remote) and bwrap are checked by the worker, before any sandbox
        # starts: its refusal comes back as ValueError/TypeError/SandboxUnavailable.
        if spawn not in ("template", "exec"):
            raise ValueError(f"spawn must be 'template' or 'exec', not {spawn!r}")
        if worker is not None and not isinstance(worker, str):
            raise TypeError(f"worker must be an address like 'tcp://host:port', not {type(worker).__name__}")
        self.source = resolved.name if resolved.env_fns is not None else str(source)
        self._resolved = resolved
        self._init_lanes(n)
        self.timing = Timing()
        self._seq = 0
        self._started = 0.0  # perf_counter at the latest CALL's send: its roundtrip_ms counts from there
        # The call waited for (its name, or "start"), the seconds it asked for (_budget) and its
        # deadline (perf_counter): _started + budget + DEADLINE_MARGIN, moved on by each heartbeat.
        self._asked: str = "start"
        self._asked_budget: float = 0.0
        self._deadline: float = math.inf
        self._start_timeout: float = _START_BUDGET  # a reset's respawns: the worker's, from READY
        # A long REPLY (image observations) is read straight into a buffer of its own.
        self._reader = wire.FrameReader(wire.Limits(1 << 30), allocate=_frame_buffer)
        self._inbox: list = []
        self._start_worker(worker, token, tls_ca, resolved)
        # A shard of a larger pool reports to that pool's bar (_progress); a pool of its own draws its own.
        with start_progress.shown(progress, n, _progress, "sandbox" if _group else "env") as bar:
            try:
                ready = self._open(config, bar.counter() if bar is not None else None)
            except BaseException:
                self._shutdown()
                raise
        self.memory_source = ready["memory_source"]
        self.hello = hello = ready["hello"] or {}
        self.env_contract = EnvContract(
            id=resolved.name,
            protocol_version=wire.PROTOCOL_VERSION,
            observation_space=hello.get("observation_space"),
            action_space=hello.get("action_space"),
            metadata=hello.get("metadata") or {},
            render_mode=hello.get("render_mode"),
            warmup=ready.get("warmup"),
            attributes=_offered(hello.get("attributes")),
        )
        self.step_timeout = ready["step_timeout"]
        max_str_len = ready.get("max_str_len")
        self.max_str_len = max_str_len if type(max_str_len) is int and max_str_len > 0 else None
        # CPU seconds per step each lane's sandbox may use (RLPool(cpu_budget=)); None: no budget.
        self.cpu_budget: float | None = ready.get("cpu_budget")
        # Whether each sandbox weighs as one in the CPU scheduler (RLPool(cpu_share=True)).
        self.cpu_share: bool = ready.get("cpu_share") is True
        start_timeout = ready.get("start_timeout")
        if type(start_timeout) in (int, float) and 0 < start_timeout < math.inf:
            self._start_timeout = float(start_timeout)
        # Per worker process, the CPUs it and its envs are pinned to (None: not pinned).
        self.affinity: list[list[int] | None] = [ready.get("affinity")]
        self._cgroup = ready["cgroup"]  # the worker's (and its guardian's) to remove; kept for diagnostics
        self._link.watch_guardian(ready.get("guardian"), self._cgroup)
        self.spawn: str = ready["spawn"]
        # Which step path the worker runs: native (boltzlabs.worker._fastpath) or pure Python.
        self.fast_path: bool = bool(ready.get("fast_path"))
        # Each env's channel: "pipes", or "socketpair" when the worker's fd limit
        # cannot hold two pipes per env (docs/wire.md#the-channel).
        self.channel: str = ready.get("channel", "socketpair")
        # Each env's observation slot (pool/slots.py), when the worker made them: None otherwise.
        self._slots: slots.Slots | None = None
        # The direct step (docs/native-step.md#the-direct-step): whether this pool steps its lanes
        # itself when the worker lends them (set by a grouped pool), and the lending it holds.
        self.direct: bool = False
        self._lent: _Lent | None = None
        self._lend_refused: bool = False  # asked again only after a reset
        if ready.get("slots"):
            try:
                self._slots = self._map_slots(ready["slots"])
            except BaseException:
                self._shutdown()
                raise
        self.shared_memory: bool = self._slots is not None
        if ready.get("fast_path_note"):
            import warnings

            # Always the same text from the same line: Python shows it once per process.
            warnings.warn(ready["fast_path_note"], RuntimeWarning, stacklevel=2)
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, self._link.shutdown)
        long_text = text_note(hello, self.max_str_len) if _shard[0] == 0 else ""  # one shard says it
        for note in (ready["memory_note"], ready["warning"], ready.get("import_note"), long_text):
            if note:
                import warnings

                warnings.warn(note, RuntimeWarning, stacklevel=2)

    # -- worker life --------------------------------------------------------------

    def _start_worker(self, worker, token, tls_ca, resolved) -> None:
        if worker is None:
            self._link = _LocalLink()
            self._proc = self._link.proc
        else:
            from boltzlabs.pool.remote_link import connect

            self._link = connect(worker, token, resolved, tls_ca)
        self.worker: str = worker or "local"
        self._conn = self._link.conn
        self._conn.settimeout(_SILENCE)  # _receive wakes each second: is the worker dead, or stuck?
        self._closed = False
        self._finalizer = weakref.finalize(self, self._link.shutdown)

    def _open(self, config: dict, report) -> dict:
        """OPEN, then the worker's messages until READY: each PROGRESS checked and passed to report
        (one worker's ready count, or None: no bar), an ERROR raised as the start's failure."""
        self._expect("start", config["start_timeout"] or _START_BUDGET)
        self._conn.sendall(wire.encode([wire.OPEN, config]))
        while True:
            message = self._receive()
            code = message[0]  # the reader passes only arrays led by an integer code
            if code == wire.PROGRESS:
                ready = start_progress.check(message, self.n)
                self._deadline = max(self._deadline, time.perf_counter() + DEADLINE_MARGIN)
                if report is not None:
                    report(ready)
            elif code == wire.HEARTBEAT:
                self._heartbeat(message, 0)
            elif code == wire.READY and len(message) == 2 and isinstance(message[1], dict):
                return message[1]
            elif code == wire.ERROR:
                category, text, detail = _error_parts(message)
                if category == START:
                    raise _start_error(text, detail, config, self._resolved, self.n)
                raise _error(category, text, "the worker could not start the pool") from WorkerSideError(
                    category, detail.get("traceback") or text
                )
            else:
                raise WorkerError(
                    f"the worker sent {message!r:.120} while starting the pool (expected PROGRESS, READY or "
                    "ERROR): it does not speak this client's protocol; run the same boltzlabs version on both sides"
                )

    def _call_for_fds(self, name: str, args: list) -> tuple:
        """A call whose REPLY brings fds by SCM_RIGHTS ("slots", "lend"): (the REPLY or ERROR
        message, the fds in order), which the caller checks and owns."""
        self._seq += 1
        frame = wire.encode([wire.CALL, self._seq, name, args])
        self._expect(name, 0.0)
        try:
            return slots.receive(self._conn, frame, self._reader, lambda: self._link.alive() and not self._overdue())
        except (OSError, EOFError):
            if self._link.alive() and self._overdue():
                raise self._stuck() from None
            self._link.wait_dead()
            raise self._worker_died() from None

    def _map_slots(self, layout: dict):
        """Every lane's memfd from the worker ("slots" calls, PER_CALL at a time), mapped read-only."""
        mapped = slots.Slots(layout, self.n)
        try:
            for start in range(0, self.n, slots.PER_CALL):
                message, fds = self._call_for_fds("slots", [start, slots.PER_CALL])
                lanes = message[3] if message[0] == wire.REPLY and message[1] == self._seq else None
                if type(lanes) is not list or len(lanes) != len(fds):
                    for fd in fds:
                        os.close(fd)
                    raise WorkerError(f"the worker sent {len(fds)} observation slot(s) with {message!r:.200}")
                for k, (lane, fd) in enumerate(zip(lanes, fds)):
                    if type(lane) is not int or not 0 <= lane < self.n or mapped.maps[lane] is not None:
                        for rest in fds[k:]:
                            os.close(rest)
                        raise WorkerError(f"the worker sent an observation slot for lane {lane!r}")
                    try:
                        mapped.map(lane, fd)
                    except OSError as exc:
                        for rest in fds[k + 1 :]:
                            os.close(rest)
                        raise WorkerError(f"could not map env {lane}'s observation slot: {exc}") from exc
        except BaseException:
            mapped.close()
            raise
        return mapped

    def _receive(self) -> list:
        """Next message from the worker; never blocks past the worker's death."""
        while not self._inbox:
            self._read()
        return self._inbox.pop(0)

    def _read(self) -> None:
        """One read from the worker into the inbox (nothing when it timed out
        with the worker alive); WorkerError when the worker is gone."""
        room = self._reader.room()  # the rest of a long frame, read in place
        data, got = b"", 0  # what recv read, or how many bytes recv_into put in place
        try:
            if room is None:
                data = self._conn.recv(_RECV_SIZE)
            else:
                got = self._conn.recv_into(room)
        except TimeoutError:  # a second of silence: is the worker dead, or stuck past the call's deadline?
            if not self._link.alive():
                raise self._worker_died() from None
            if self._overdue():
                raise self._stuck() from None
            return
        except OSError:
            data, got = b"", 0
        finally:
            if room is not None:
                room.release()
        if not data and not got:
            self._link.wait_dead()
            raise self._worker_died()
        try:
            messages = self._reader.feed(data) if room is None else self._reader.filled(got)
        except ProtocolError as exc:
            self._shutdown()  # the stream is out of step: nothing after this frame can be read
            raise WorkerError(
                f"the boltzlabs worker ({self.worker}) sent a frame this client cannot read ({exc}); the pool "
                "is closed. A worker of another boltzlabs version does this: run the same boltzlabs version on both sides"
            ) from exc
        self._inbox.extend(messages)

    def _worker_died(self) -> WorkerError:
        self._closed = True
        return self._link.died()

    def _call(self, name: str, *args, diagnose=None):
        return self._reply(name, self._request(name, args, diagnose))

    def _request(self, name: str, args, diagnose=None) -> int:
        """Send one CALL; its sequence number, for _reply."""
        return self._send_frame(self._frame(name, args, diagnose), name, self._budget(name, args))

    def _budget(self, name: str, args) -> float:
        """The seconds call `name` may take by what it asks (DEADLINE_MARGIN comes on top, and
        the worker's heartbeats move the deadline on while a longer call progresses)."""
        step = self.step_timeout
        if name == "step":
            return step + (self._start_timeout if args[-1] else 0.0)  # autoreset lanes respawn first
        if name == "send":
            return step + (self._start_timeout if args[2] else 0.0)
        if name == "reset":
            return step + self._start_timeout  # dead lanes (every one, when hard) respawn first
        if name == "recv":
            timeout = args[1]
            return step if timeout is None else min(float(timeout), step)
        if name == "render" or name == "attr" or name == "direct_rest":
            return step
        if name == "shutdown":
            return _CLOSE_BUDGET
        return 0.0  # memory, log, states, pids, lane_states: reads

    def _expect(self, name: str, budget: float) -> None:
        """Call `name` (asking for `budget` seconds) is sent now: its deadline."""
        self._asked, self._asked_budget = name, budget
        self._started = time.perf_counter()
        self._deadline = self._started + budget + DEADLINE_MARGIN

    def _overdue(self) -> bool:
        return time.perf_counter() >= self._deadline

    def _heartbeat(self, message: list, seq: int) -> None:
        """A HEARTBEAT from the worker, checked (a remote worker's is input): call `seq` goes on,
        its deadline moves on. WorkerError (the pool closed) for any other."""
        if (
            len(message) != 3
            or type(message[1]) is not int
            or type(message[2]) not in (int, float)
            or not 0 <= message[2] < 1e9  # NaN too
        ):
            raise self._broken(f"sent a malformed heartbeat {message!r:.100}")
        if message[1] != seq:
            raise self._broken(f"sent a heartbeat for call {message[1]} while call {seq} ({self._what()}) was running")
        self._deadline = max(self._deadline, time.perf_counter() + DEADLINE_MARGIN)

    def _what(self) -> str:
        return "the pool's start (OPEN)" if self._asked == "start" else f"{self._asked}()"

    def _stuck(self) -> WorkerError:
        """The call waited for is past its deadline: the worker is killed (a remote one's connection
        closed), the pool closed; the error saying who, what and how long."""
        waited = time.perf_counter() - self._started
        self._link.stuck = True  # its shutdown kills at once: no CLOSE, no wait for an answer
        self._shutdown()
        fate = "it was killed" if self._link.kind == "local" else "its connection was closed"
        return WorkerError(
            f"the boltzlabs worker ({self._link.who}) did not answer {self._what()} within its deadline: "
            f"waited {waited:.1f} s ({self._asked_budget:g} s for what was asked + a margin of "
            f"{DEADLINE_MARGIN:g} s, moved on by each heartbeat). It is stopped (SIGSTOP, a debugger), "
            f"deadlocked, or its host or network is gone; {fate} and the pool is closed: create a new RLPool",
            kind=DEADLINE,
        )

    def _broken(self, text: str) -> WorkerError:
        """The worker broke the protocol (`text` says how): the pool is closed."""
        self._shutdown()  # the stream cannot be trusted past this frame
        return WorkerError(
            f"the boltzlabs worker ({self._link.who}) {text}; the pool is closed. A worker of another "
            "boltzlabs version does this: run the same boltzlabs version on both sides",
            kind=PROTOCOL,
        )

    def _frame(self, name: str, args, diagnose=None) -> bytes:
        """The next CALL, encoded (a sharded pool encodes every shard's before it sends any)."""
        self._check_open()
        try:
            return wire.encode([wire.CALL, self._seq + 1, name, list(args)])
        except (TypeError, ValueError, OverflowError) as exc:
            if diagnose is not None:
                diagnose()  # raises, naming the culprit
            raise TypeError(f"{name}() arguments cannot be serialized: {exc}") from exc

    def _send_frame(self, frame: bytes, name: str, budget: float) -> int:
        """Send a CALL _frame made (call `name`, asking for `budget` seconds: _budget); its sequence number."""
        if self._lent is not None:  # any call takes lent lanes back: our copies are closed first
            self._unlend()
        self._seq += 1
        # Hot path: the deadline is a sum; it is read only after a second of silence (_read).
        self._started = now = time.perf_counter()
        self._asked, self._asked_budget = name, budget
        self._deadline = now + budget + DEADLINE_MARGIN
        # sendall's timeout bounds the whole send: a long frame (a remote pool's big batch) may
        # take more than the socket's second to cross, and has until the call's deadline.
        big = len(frame) > _BIG_FRAME
        try:
            if big:
                self._conn.settimeout(budget + DEADLINE_MARGIN)
            self._conn.sendall(frame)
            if big:
                self._conn.settimeout(_SILENCE)
        except TimeoutError:  # the worker took nothing in for the send's timeout
            raise self._stuck() from None
        except OSError:
            self._link.wait_dead()
            raise self._worker_died() from None
        except BaseException:
            self._shutdown()  # interrupted half way (Ctrl-C): the stream is out of step; end it
            raise
        return self._seq

    def _reply(self, name: str, seq: int):
        """The reply to CALL `seq`, waiting for it."""
        try:
            while True:
                while not self._inbox:
                    self._read()
                found, value = self._take(name, seq)
                if found:
                    return value
        except (ValueError, TypeError, SandboxUnavailable, WorkerError):
            raise
        except BaseException:
            # Interrupted half way (Ctrl-C): the stream is out of step; end it.
            self._shutdown()
            raise

    def _take(self, name: str, seq: int) -> tuple:
        """(True, the reply's value) when the inbox holds the reply to `seq`,
        (False, None) when it does not yet; raises what an ERROR reply says."""
        inbox = self._inbox
        while inbox:
            message = inbox.pop(0)
            if message[0] == wire.REPLY and message[1] == seq:
                self.timing.roundtrip_ms = (time.perf_counter() - self._started) * 1000.0
                self.timing.worker_ms = message[2]
                self.timing.wait_ms = self.timing.queued_ms = 0.0
                return True, message[3]
            if message[0] == wire.ERROR:
                category, text, detail = _error_parts(message)
                raise _error(
                    category,
                    text,
                    f"the worker failed {name}()",
                    "; the pool may be unusable: close it and create a new one",
                ) from WorkerSideError(category, detail.get("traceback") or text)
            if message[0] == wire.HEARTBEAT:
                self._heartbeat(message, seq)
        return False, None

    def _shutdown(self) -> None:
        self._closed = True
        self._unlend()
        self._finalizer()

    def shutdown(self, reason: str = "owner shutdown") -> bool:
        """Ask the worker to stop this pool now, saying why (the worker logs it).

        Every sandbox ends; the pool is closed, and later calls raise
        PoolClosedError naming `reason`. True when the worker confirmed it,
        False when the pool was already closed or the worker was gone.
        """
        if self._closed:
            return False
        try:
            confirmed = bool(self._call("shutdown", str(reason)))
        except (WorkerError, PoolClosedError):
            confirmed = False
        self._closed_reason = str(reason)
        self._shutdown()
        return confirmed

    def close(self) -> None:
        """Stop every env and the worker; remove every cgroup. Idempotent.
        Warns once with a sum of the envs' failures, if there were any."""
        self._closed = True
        self._unlend()
        if hasattr(self, "_finalizer"):
            self._finalizer()
        self._failure_summary()
        mapped = getattr(self, "_slots", None)  # not there when __init__ failed before the worker was up
        if mapped is not None:
            mapped.close()
            self._slots = None

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"RLPool({self.source!r}, {self.n}, {state})"

    @property
    def closed(self) -> bool:
        return self._closed

    # -- the protocol's hooks (boltzlabs.pool.protocol.Pool) -------------------------------

    def _check_open(self) -> None:
        if self._closed:
            if self._closed_reason is not None:
                raise PoolClosedError(f"this RLPool was shut down ({self._closed_reason}); create a new one")
            raise PoolClosedError("this RLPool is closed; create a new one")

    def _step_lanes(self, actions: list, resets, whole=None) -> StepResult:
        """`whole(batch, seq)`: a grouped pool's reader of a direct step's Batch read whole
        (GroupedPool._read_whole); the StepResult it returns, when not None, is this step's."""
        if self.direct and not resets and not self._lend_refused:
            reply = self._step_direct(actions, whole)
            if type(reply) is StepResult:
                return reply
            if reply is not None:
                return self._stepped(reply)
        return self._stepped(self._call("step", actions, resets, diagnose=lambda: self._raise_unserializable(actions)))

    # -- the direct step (docs/native-step.md#the-direct-step) ---------------------------------

    def _step_direct(self, actions: list, whole=None):
        """THE HOT PATH of a grouped pool: the step the worker's _fastpath.step() runs, run here
        on the lanes the worker lent (their channels), so a step crosses no process but the
        sandboxes': the same frames, the same C check of each reply, the same REPLY bytes. The
        lanes C did not finish go to the worker (direct_rest), which handles them as in its own
        step. None when there is no lending (refused: asked again after a reset) or C would not
        split the actions (nothing was written): the worker steps the batch."""
        lent = self._lent if self._lent is not None else self._lend()
        if lent is None:
            return None
        if lent.next >= lent.end:  # the lending's sequence numbers are used up: ask for more
            self._unlend()
            return None
        try:
            packed = wire.pack(actions)
        except (TypeError, ValueError, OverflowError):
            return None
        seq = lent.next
        started = time.perf_counter()
        deadline = time.monotonic() + lent.step_timeout
        try:
            batch = lent.fastpath.step(
                lent.epoll.fileno(),
                lent.chans,
                lent.wchans,
                packed,
                seq,
                lent.no_resets,
                deadline,
                lent.caps,
                lent.room,
                True,  # ordered: woken by the first group still out, not by each that answers
            )
            if batch is None:
                return None
            lent.next += 1
            if whole is not None and not batch.rest:
                self._direct_timing(started)
                step = whole(batch, seq)
                if step is not None:
                    return step
            overrides: dict = {}
            stragglers: list = []
            if batch.rest:
                rest = [[index, kind, value] for index, kind, value in batch.rest]
                done, stragglers = self._call("direct_rest", seq, deadline, rest)  # _send_frame unlends
                for index, *override in done:
                    overrides[index] = tuple(override)
            raw = batch.compose(overrides, wire.pack(stragglers))
        except (ValueError, TypeError, SandboxUnavailable, WorkerError):
            raise
        except BaseException:
            # Interrupted half way (Ctrl-C): replies may be on their way to lanes the worker takes
            # back; end the pool, as an interrupted call does (_reply).
            self._shutdown()
            raise
        self._direct_timing(started)
        message = wire.decode(_REPLY_OF_TWO + raw, self._reader.limits)
        return message[1]

    def _direct_timing(self, started: float) -> None:
        """A direct step's timing: the whole call is the worker's part; nothing waited or queued."""
        timing = self.timing
        timing.roundtrip_ms = timing.worker_ms = (time.perf_counter() - started) * 1000.0
        timing.wait_ms = timing.queued_ms = 0.0
        timing.stragglers = []

    def _lend(self):
        """Ask the worker to lend its lanes (a "lend" call: their channels come attached); the
        _Lent, or None when it will not (remote, gated, a lane not idle, ...: asked again after
        the next reset)."""
        from boltzlabs.worker import native

        fastpath, _ = native.load()
        if fastpath is None or not self.fast_path or self._link.kind != "local":
            self.direct = False
            return None
        self._check_open()
        message, fds = self._call_for_fds("lend", [])
        for fd in fds:
            os.set_inheritable(fd, False)
        info = message[3] if message[0] == wire.REPLY and message[1] == self._seq and len(message) == 4 else None
        if message[0] == wire.ERROR and not fds:  # a worker that does not lend: stepped through it
            self.direct = False
            return None
        if type(info) is dict and "refused" in info and not fds:
            if info.get("lasting") is True:
                self.direct = False  # this pool never lends (gated, a cpu_budget, ...): not asked again
            else:
                self._lend_refused = True  # a lane not idle: asked again after the next reset
            return None
        if not _Lent.valid(info, fds, self.n):
            for fd in fds:
                os.close(fd)
            raise self._broken(f"lent {len(fds)} fds with {message!r:.200}")
        self._lent = _Lent(fastpath, info, fds, self.n)
        return self._lent

    def _unlend(self) -> None:
        """Close our copies of the lent channels (before any call: the worker takes them back)."""
        lent, self._lent = getattr(self, "_lent", None), None
        if lent is not None:
            lent.close()

    def _stepped(self, reply) -> StepResult:
        """A step's reply as a StepResult (a sharded pool turns each shard's reply so, as it lands)."""
        obs, rewards, terminated, truncated, infos, stragglers = reply
        # Hot path: the arrays come as raw bytes, one copy each.
        self.timing.stragglers = stragglers
        result = StepResult(
            obs,
            np.frombuffer(rewards, dtype=np.float64).copy(),
            np.frombuffer(terminated, dtype=np.bool_).copy(),
            np.frombuffer(truncated, dtype=np.bool_).copy(),
            infos,
        )
        batch = None
        if self._slots is not None:  # the obs some lanes left in their slots, copied once into one batch
            batch = self._slots.fill(range(self.n), obs, result.rewards, result.terminated, result.truncated, infos)
        self._obs_batch = None if batch is None else (obs, batch)
        return result

    # (the latest step's obs, their slot batch) or None: batched_obs. None for a sharded pool,
    # whose shards' batches are theirs.
    _obs_batch: tuple | None = None

    def batched_obs(self, obs: list):
        """The (n, ...) read-only array whose rows are `obs`, when `obs` are the latest step's and
        each came from its slot (a Box space): the one batch the slots were copied into."""
        held = self._obs_batch
        return held[1] if held is not None and held[0] is obs else None

    def _send_lanes(self, actions: list, lanes: list, resets, how=None) -> None:
        args = (actions, lanes, resets) if how is None else (actions, lanes, resets, how)
        self._call("send", *args, diagnose=lambda: self._raise_unserializable(actions))

    def _recv_lanes(self, batch_size, timeout) -> RecvResult:
        return self._received(self._call("recv", batch_size, timeout))

    def _received(self, reply) -> RecvResult:
        lanes, obs, rewards, terminated, truncated, infos, stragglers, wait_ms, queued_ms = reply
        self.timing.wait_ms, self.timing.queued_ms, self.timing.stragglers = wait_ms, queued_ms, stragglers
        result = RecvResult(
            np.array(lanes, dtype=np.int64),
            obs,
            np.frombuffer(rewards, dtype=np.float64).copy(),
            np.frombuffer(terminated, dtype=np.bool_).copy(),
            np.frombuffer(truncated, dtype=np.bool_).copy(),
            infos,
        )
        if self._slots is not None:
            self._slots.fill(lanes, obs, result.rewards, result.terminated, result.truncated, infos)
        return result

    def _reset_lanes(self, lanes: list, seeds, hard: bool, options, scrub: bool = False) -> tuple:
        self._lend_refused = False  # a reset may leave every lane idle: a lending may be asked again
        return self._was_reset(lanes, self._call("reset", lanes, seeds, hard, options, scrub))

    def _was_reset(self, lanes: list, reply) -> tuple:
        _, obs, infos = reply
        if self._slots is not None:
            count = len(lanes)
            self._slots.fill(lanes, obs, np.zeros(count), np.zeros(count, np.bool_), np.zeros(count, np.bool_), infos)
        self.timing.stragglers = [i for i, info in zip(lanes, infos) if info.get("straggler")]
        return obs, infos

    def _render_lanes(self, lanes: list) -> list:
        frames, errors = self._render_request(lanes)
        if errors:
            index, error = min((int(k), v) for k, v in errors.items())
            raise EnvError(f"env {index} could not render: {error}", env_index=index)
        return frames

    def _render_request(self, lanes: list) -> tuple:
        """(frames aligned with lanes, {lane: error} of the lanes that could not render)."""
        return self._call("render", lanes)

    def _log(self, index: int) -> str:
        return self._call("log", index)

    # The TypeError naming the first action that cannot be sent (step's and send's diagnosis).
    _raise_unserializable = staticmethod(raise_unserializable)

    # -- methods and attributes of the envs (serve(methods=, attributes=, target=)) ------

    def _attr(self, op: str, name, env_ids, args: list, kwargs: dict, values=None) -> list:
        lanes = list(range(self.n)) if env_ids is None else self._env_ids(env_ids)
        self._attr_check(op, name)
        if not lanes:
            return []
        verb = {"call": "call", "get": "get the attribute", "set": "set the attribute"}[op]
        try:
            results, errors = self._attr_request(lanes, op, name, args, kwargs, values)
        except TypeError as exc:
            raise TypeError(
                f"{verb} {name!r}: the arguments cannot cross the wire ({exc}); they must be "
                "msgpack-able values or numpy arrays, like actions"
            ) from None
        if errors:
            raise attr_error(verb, name, errors)
        return results

    def _attr_check(self, op: str, name) -> None:
        """Refuse, before anything is sent, a name the env's handshake says it does not offer."""
        if not isinstance(name, str):
            raise TypeError(f"the attribute name must be a str, not {type(name).__name__}")
        offered = self.env_contract.attributes
        if offered is not None and offered["target"] is None:  # the env listed everything it offers
            methods, attributes = offered["methods"], offered["attributes"]
            if not (name in attributes or (op == "call" and name in methods)):
                raise AttributeError(_missing(op, name, methods, attributes, self.env_contract.id))
            if op == "set" and not attributes[name]:
                raise AttributeError(
                    f"the env's attribute {name!r} is read-only (its serve(attributes=) gave it no setter)"
                )

    def _attr_request(self, lanes: list, op: str, name: str, args: list, kwargs: dict, values) -> tuple:
        """(results aligned with lanes, {lane: (message, detail)} of the lanes that failed)."""
        return self._call("attr", lanes, op, name, args, kwargs, values)

    def memory(self) -> MemoryReport:
        """Each env's memory in bytes (kernel accounting) and its source."""
        report = self._call("memory")
        return MemoryReport(report["per_env"], report["source"], report["note"], report["shared"])

    def states(self) -> list:
        """Each lane's one state: 'idle', 'in_flight' (sent, not finished),
        'finished' (a result waiting for recv), 'straggler' (its result was
        given, it is still busy; reset it) or 'dead' (reset it to respawn)."""
        return self._call("lane_states")

    def pids(self) -> list:
        """Host pid of each env's sandbox (its bwrap process), -1 when dead."""
        return self._call("pids")


class ShardedPool(shards.Sharding, RLPool):
    """An RLPool over several worker processes: RLPool(source, n, workers=k) with k > 1 (pool/shards.py)."""

    _one_worker = RLPool
    _timing = Timing
    _memory = MemoryReport


def _offered(described):
    """The env's handshake's list of methods and attributes, checked: an
    env sends anything. None (ask the env) when it is missing or malformed."""
    if not isinstance(described, dict):
        return None
    methods, attributes, target = described.get("methods"), described.get("attributes"), described.get("target")
    if (
        not isinstance(methods, list)
        or not all(isinstance(m, str) for m in methods)
        or not isinstance(attributes, dict)
        or not all(isinstance(k, str) and isinstance(v, bool) for k, v in attributes.items())
        or not (target is None or isinstance(target, str))
    ):
        return None
    return {"methods": methods, "attributes": attributes, "target": target}


def _missing(op: str, name: str, methods: list, attributes: dict, source: str) -> str:
    if op != "call" and name in methods:
        return f"{name!r} is a method of the env, not an attribute: use call({name!r}, ...)"
    return (
        f"the env {source!r} has no method or attribute {name!r}; it offers methods {sorted(methods)} and "
        f"attributes {sorted(attributes)} (name them in serve(..., methods=, attributes=) in its env.py)"
    )


class _LocalLink:
    """The worker as our child process, over a socketpair (RLPool without worker=)."""

    kind = "local"
    guardian = None  # a pidfd of the worker's cgroup guardian, once the pool is open
    cgroups: list | None = None  # the pool's cgroups (one per hierarchy), once the pool is open
    stuck = False  # set when a call passed its deadline: shutdown() kills at once

    def __init__(self):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.stderr = tempfile.TemporaryFile()  # unlinked at once: nothing left behind
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "boltzlabs.worker", "--fd", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=self.stderr,
                stderr=self.stderr,
                start_new_session=True,  # Ctrl-C reaches us, not the worker
                env=worker_environment(),
            )
        except BaseException:
            ours.close()
            self.stderr.close()
            raise
        finally:
            theirs.close()
        self.conn = ours
        self.who = f"pid {self.proc.pid}"  # how errors name the worker

    def alive(self) -> bool:
        return self.proc.poll() is None

    exit_wait = 10.0  # seconds the worker has to exit after its connection ended, before died() says so

    def wait_dead(self) -> None:
        """The connection ended: give the worker time to exit, so died() can say how it went."""
        try:
            self.proc.wait(timeout=self.exit_wait)
        except subprocess.TimeoutExpired:
            pass  # still running: died() says so, and close() kills it

    def died(self) -> WorkerError:
        self.stderr.seek(0)
        tail = self.stderr.read()[-4000:].decode("utf-8", "replace")
        code = self.proc.poll()
        if code is None:
            return WorkerError(
                f"the connection to the boltzlabs worker (pid {self.proc.pid}) ended and the worker had not exited "
                f"{self.exit_wait:g} s later; the pool is gone: close() kills what is left of it, then create a "
                f"new RLPool. Its output:\n{tail or '(none)'}"
            )
        how, signum = describe_exit(code), exit_signal(code)
        fix = (
            "if nobody here sent it, the kernel's OOM killer may have (see `dmesg`): give the host more "
            "memory or the pool fewer envs; "
            if signum is not None
            else ""
        )
        return WorkerError(
            f"the boltzlabs worker (pid {self.proc.pid}) {how}; the pool is gone: {fix}create a "
            f"new RLPool. Its output:\n{tail or '(none)'}",
            signal=signum,
        )

    def shutdown(self) -> None:
        """End the worker: ask, then insist (at once when it is stuck: a stopped process dies of
        SIGKILL too), then wait for what is left of its process group and for its cgroup
        guardian; warn naming whatever is still there. Runs once, from close(), GC or exit."""
        proc, conn = self.proc, self.conn
        try:
            if proc.poll() is None and not self.stuck:
                try:
                    conn.settimeout(5.0)
                    conn.sendall(wire.encode([wire.CLOSE]))
                except OSError:
                    pass
                end = time.monotonic() + _CLOSE_WAIT
                # A stopped worker (SIGSTOP, a debugger) never reads its CLOSE: it is killed at once.
                while proc.poll() is None and time.monotonic() < end and not stopped(proc.pid):
                    try:
                        proc.wait(timeout=min(0.25, max(0.0, end - time.monotonic())))
                    except subprocess.TimeoutExpired:
                        pass
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the worker and every bwrap it started
                except ProcessLookupError:
                    pass
                proc.wait()
            group = self._wait_group()
            self._wait_guardian()
        finally:
            conn.close()
            self.stderr.close()
            if self.guardian is not None:
                os.close(self.guardian)
                self.guardian = None
        self._report_leftovers(group)

    def watch_guardian(self, pid, cgroups) -> None:
        """Hold a pidfd of the worker's cgroup guardian (worker._guard_cgroups), so
        shutdown() returns once the pool's cgroups (their paths: `cgroups`) are gone, and not before."""
        self.cgroups = list(cgroups) if isinstance(cgroups, list) else None
        if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0:
            try:
                self.guardian = os.pidfd_open(pid)
            except OSError:  # already gone (nothing to wait for)
                pass

    def _wait_group(self) -> bool:
        """Wait until no process is left in the worker's process group (it leads one of its own:
        the bwrap processes it started, which --die-with-parent ends once it is gone); whether
        none is. kill(-pgid, 0) asks the kernel without touching any of them."""
        end = time.monotonic() + _GROUP_WAIT
        pause = 0.001
        while True:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return True
            except PermissionError:  # one of another user's: still there
                pass
            if time.monotonic() >= end:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def _wait_guardian(self) -> None:
        # The guardian removes the cgroups once the worker is gone, however it went, giving up on
        # one only once none has gone for a while (10,000 sandboxes take long to die); its pidfd
        # turns readable when it exits.
        if self.guardian is not None:
            # poll, not select: a trainer may well hold fd numbers past 1024 (select's limit).
            poller = select.poll()
            poller.register(self.guardian, select.POLLIN)
            poller.poll(int(_GUARDIAN_WAIT * 1000))

    def _report_leftovers(self, group_gone: bool) -> None:
        """close() returns with the pool's processes and cgroups gone, or says what is not."""
        left = [path for path in self.cgroups or () if os.path.exists(path)]
        if not left and group_gone:
            return
        import warnings

        parts = []
        if left:
            parts.append(
                f"{len(left)} of its cgroups could not be removed ({', '.join(left)}): something else "
                "holds them (a process moved in, a cgroup made inside); `rmdir` each once it is empty"
            )
        if not group_gone:
            parts.append(
                f"processes of its process group {self.proc.pid} were still running {_GROUP_WAIT:g} s after "
                f"it ended (`pgrep -a -g {self.proc.pid}` lists them)"
            )
        warnings.warn(
            f"close(): the boltzlabs worker ({self.who}) has ended, but " + "; ".join(parts),
            RuntimeWarning,
            stacklevel=2,
        )


# The exception each ERROR category (errors.CATEGORIES) raises here; any other: WorkerError.
_RAISES = {USAGE: ValueError, USAGE_TYPE: TypeError, POLICY: PolicyError, HOST: SandboxUnavailable}


# What to do about an env that died at a limit while starting (the worker names the limit, and
# the cause above says by how much): not "fix env.py", whose code may be right for a bigger limit.
_PIDS_FIX = "RLPool(..., limits={'pids': N}) gives each env more tasks"
_POOL_PIDS_FIX = (
    "RLPool(..., limits={'pool_pids': N}) (a count, or a share of the host's tasks like '40%') "
    "gives the envs together more, and workers=k splits the pool over k caps"
)
_LIMIT_FIXES = {
    "pids": f"The env died at its task limit (above): {_PIDS_FIX}, or find what it forks.",
    "pool_pids": f"The pool's envs together reached its task cap (above): {_POOL_PIDS_FIX}; or find what they fork.",
    "pids or pool_pids": (
        f"The env died at a task limit, its own or the pool's (above): {_PIDS_FIX}; {_POOL_PIDS_FIX}."
    ),
    "memory": (
        "The env was OOM-killed over its memory limit (above): RLPool(..., memory_limit=...) gives "
        "each env more, or find what it allocates at start-up."
    ),
    "file_size": "The env wrote a file past its size limit (above): RLPool(..., limits={'file_size': ...}).",
}


_START_LOG_CHARS = 1 << 16  # of a start failure's log tail (the worker keeps log_tail bytes of it)


def _start_error(text: str, detail: dict, config: dict, resolved: sources.Source, n: int) -> EnvStartError:
    """The EnvStartError for a START frame: which env, the tail of its output and what to do.
    `detail` is the worker's (a remote one's is input): each field is checked before use."""
    env = detail.get("env")
    env = env if type(env) is int and 0 <= env < n else None
    failed = detail.get("failed")
    others = failed - 1 if type(failed) is int else 0
    more = f" ({others} other env(s) failed too)" if others > 0 else ""
    log = detail.get("log")
    log = log[-_START_LOG_CHARS:] if isinstance(log, str) else ""
    limit = detail.get("limit")
    if "without calling serve()" in text:
        fix = (
            f"End {config['source_dir']}/env.py with serve(reset=..., step=...) (from "
            "boltzlabs.env), or serve_env(env) for a Gymnasium env object."
        )
    elif isinstance(limit, str) and limit in _LIMIT_FIXES:
        fix = _LIMIT_FIXES[limit]
    elif detail.get("set_up") is True:
        fix = (
            "The sandbox's own set-up failed before any env code ran (boltzlabs.runtime, "
            "above): not your env's doing. Check the policy (sandbox/policy.toml, or "
            "$BOLTZLABS_POLICY) and the host: `boltzlabs doctor` says what it lacks."
        )
    elif resolved.env_fns is not None:
        fix = (
            f"env_fns[{env}]() failed inside its sandbox (its traceback is "
            "above); the same thunk called here would show it too."
        )
    elif resolved.gym_id:
        fix = (
            f"gymnasium.make({resolved.gym_id!r}, **{config['params']['kwargs']!r}) failed inside "
            "the sandbox (its traceback is above)."
        )
    else:
        fix = f"Fix the error in {config['source_dir']}/env.py (its traceback is above)."
    return EnvStartError(
        f"{text}{more}.\n--- the tail of env {env}'s output ---\n{log}\n--- end ---\n{fix}",
        env_index=env,
        log=log,
    )


def _error_parts(message: list) -> tuple[str, str, dict]:
    """(category, text, detail) of an ERROR frame, checked: what a remote worker sends is input.
    An unknown category is the worker's fault (INTERNAL)."""
    category, text, detail = (list(message[2:5]) + [None, None, None])[:3]
    return (
        category if category in CATEGORIES else INTERNAL,
        text if isinstance(text, str) else repr(text)[:2000],
        detail if isinstance(detail, dict) else {},
    )


def _error(category: str, text: str, failed: str, then: str = "") -> Exception:
    """The exception for an ERROR frame other than START: the caller's mistake as ValueError or
    TypeError (its text says what), the policy's as PolicyError, the host's as SandboxUnavailable,
    anything else (the worker's own fault, a protocol break) as WorkerError. The caller raises it
    from a WorkerSideError holding the worker's text or traceback."""
    kind = _RAISES.get(category)
    if kind is not None:
        return kind(text)
    return WorkerError(f"{failed}: {category} error (the worker's account is the cause, above){then}", kind=category)
