"""One pool protocol (issue #15): RLPool and ClusterPool are two kinds of
boltzlabs.pool.protocol.Pool; the same input means the same on both; the
adapters use public names only; every exception lives in errors.py.

Real pools throughout: a local RLPool, a ClusterPool over a real two-node
Ray cluster on 127.0.0.1, a real remote `boltzlabs worker` on loopback."""

import ast
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from boltzlabs import RLPool
from boltzlabs.pool.ids import uuid7, uuid7s
from boltzlabs.errors import PoolClosedError, WorkerError, WorkerSideError
from boltzlabs.pool.protocol import Pool, StepResult

from conftest import COUNTER, PROBE, has_ended, scaled, two_node_ray_cluster

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "boltzlabs"
ADAPTERS = [PACKAGE / "gym.py", PACKAGE / "cluster.py", PACKAGE / "sb3.py", PACKAGE / "testing.py"]


# -- the adapters call public names only ------------------------------------------------


def private_uses_on_pools(path: Path) -> list[str]:
    """file:line of every `<pool>._name` in `path`, where <pool> is a name or
    attribute called pool, or the class RLPool/Pool/ClusterPool (dunders allowed)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        target = node.value
        name = target.id if isinstance(target, ast.Name) else target.attr if isinstance(target, ast.Attribute) else ""
        if name == "pool" or name in ("RLPool", "Pool", "ClusterPool"):
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_adapters_call_only_public_names_of_a_pool():
    found = [use for path in ADAPTERS for use in private_uses_on_pools(path)]
    assert not found, f"an adapter reaches into a pool's privates; use the protocol's public names: {found}"


def test_the_private_use_check_catches_one(tmp_path):
    sample = tmp_path / "adapter.py"
    sample.write_text(
        "def f(self, shard):\n    self.pool._step(1)\n    shard.pool.step_full(1)\n"
        "    RLPool._lanes(self, None)\n    self.pool.__len__()\n"
    )
    assert private_uses_on_pools(sample) == ["adapter.py:2: self.pool._step", "adapter.py:4: RLPool._lanes"]


def test_both_kinds_are_pools_with_one_public_surface():
    from boltzlabs.cluster import ClusterPool

    public = lambda cls: {n for n in dir(cls) if not n.startswith("_")}  # noqa: E731
    assert issubclass(RLPool, Pool) and issubclass(ClusterPool, Pool)
    assert not RLPool.__abstractmethods__ and not ClusterPool.__abstractmethods__
    # What Pool defines, neither kind redefines: the shared surface cannot drift.
    shared = {
        "reset",
        "step",
        "step_full",
        "send",
        "recv",
        "recv_full",
        "render",
        "render_all",
        "log",
        "envs_per_gb",
        "lane_states",
        "observations",
        "_lanes",
        "_seeds",
        "_env_ids",
        "_actions",
        "_count_episodes",
        "_begin_episodes",
    }
    for cls in (RLPool, ClusterPool):
        assert not shared & set(vars(cls)), f"{cls.__name__} redefines {shared & set(vars(cls))}"
        assert public(Pool) <= public(cls)


def test_rlpool_with_cluster_says_to_make_a_cluster_pool():
    with pytest.raises(TypeError, match=re.escape("boltzlabs.cluster.ClusterPool(source, n, cluster='ray'")):
        RLPool(COUNTER, 2, cluster="ray")


# -- the same input, the same outcome, on both kinds -----------------------------------


@pytest.fixture(scope="module")
def ray_cluster():
    yield from two_node_ray_cluster()


@pytest.fixture(scope="module", params=["local", "cluster"])
def any_pool(request):
    if request.param == "local":
        pool = RLPool(PROBE, 4, step_timeout=10)
    else:
        from boltzlabs.cluster import ClusterPool

        pool = ClusterPool(
            PROBE, 4, cluster=request.getfixturevalue("ray_cluster").address, envs_per_node=2, step_timeout=10
        )
    yield pool
    pool.close()


BAD_INPUTS = [  # (what, call, exception, message)
    ("seed of a wrong type", lambda p: p.reset(seed="1"), TypeError, "seed must be an int"),
    ("seed list too short", lambda p: p.reset(seed=[1, 2]), ValueError, "one seed per env"),
    ("a seed in the list no int", lambda p: p.reset(seed=[0, 1, 1.5, 3]), TypeError, "whole numbers"),
    ("where out of range", lambda p: p.reset(where=[7]), ValueError, "outside"),
    ("where mask of a wrong length", lambda p: p.reset(where=np.ones(3, bool)), ValueError, "needs 4 booleans"),
    ("too few actions", lambda p: p.step([1.0]), ValueError, "needs 4 actions"),
    ("actions not a sequence", lambda p: p.step(3), TypeError, "sequence of 4 actions"),
    ("action array of a wrong shape", lambda p: p.step(np.zeros(5)), ValueError, "first dimension is 4"),
    ("resets out of range", lambda p: p.step_full([1.0] * 4, resets=[9]), ValueError, "outside"),
    ("env_ids out of range", lambda p: p.send([1.0], env_ids=[4]), ValueError, "outside"),
    ("env_ids twice", lambda p: p.send([1.0, 1.0], env_ids=[1, 1]), ValueError, "twice"),
    ("resets not among env_ids", lambda p: p.send([1.0], env_ids=[0], resets=[1]), ValueError, "not among"),
    ("recv batch_size 0", lambda p: p.recv(batch_size=0), ValueError, "batch_size"),
    ("recv negative timeout", lambda p: p.recv(timeout=-1), ValueError, "timeout"),
    ("recv with nothing in flight", lambda p: p.recv(batch_size=1), ValueError, "can come"),
    ("render index out of range", lambda p: p.render(4), ValueError, r"\[0, 4\)"),
    ("log index a bool", lambda p: p.log(True), ValueError, r"\[0, 4\)"),
]


@pytest.mark.parametrize("what,call,exception,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_the_same_bad_input_raises_the_same_exception_on_every_pool(any_pool, what, call, exception, message):
    any_pool.reset(seed=0)
    with pytest.raises(exception, match=message):
        call(any_pool)
    # Refused before anything was sent: the pool goes on as if nothing happened.
    obs, rewards, dones, _ = any_pool.step([1.0] * 4)
    assert rewards.tolist() == [1.0] * 4 and not dones.any() and [o["t"] for o in obs] == [1] * 4


def test_every_pool_keeps_episodes_and_terminations_apart_alike(any_pool):
    # The probe env terminates at t=100; a failed step is a truncation.
    any_pool.reset(seed=5)
    first = list(any_pool.episode_ids)
    assert all(first) and len(set(first)) == 4
    for _ in range(99):
        any_pool.step([1.0] * 4)
    any_pool.reset(where=[0, 2, 3])
    ids = list(any_pool.episode_ids)
    assert ids[1] == first[1] and not set(ids) & {first[0], first[2], first[3]}
    result = any_pool.step_full([1.0, 1.0, {"op": "raise"}, 2.0])
    assert isinstance(result, StepResult) and result.rewards.dtype == np.float64
    assert result.terminated.tolist() == [False, True, False, False]
    assert result.truncated.tolist() == [False, False, True, False]
    assert result.rewards.tolist() == [1.0, 1.0, 0.0, 2.0] and "error" in result.infos[2]
    ended = {e["env"]: e for e in any_pool.finished_episodes}
    assert sorted(ended) == [1, 2] and ended[1]["terminated"] and not ended[2]["terminated"]
    assert (ended[1]["id"], ended[1]["seed"], ended[1]["length"], ended[1]["return"]) == (first[1], 6, 100, 100.0)
    assert (ended[2]["id"], ended[2]["seed"], ended[2]["length"]) == (ids[2], None, 1)
    # Next-step autoreset through the public call: lanes 1 and 2 begin new episodes.
    result = any_pool.step_full([1.0] * 4, resets=[1, 2])
    assert [o["t"] for o in result.obs] == [2, 0, 0, 2] and any_pool.finished_episodes == []
    assert any_pool.episode_ids[0] == ids[0] and not {any_pool.episode_ids[1], any_pool.episode_ids[2]} & set(ids)
    # The asynchronous half, with an autoreset in the send.
    any_pool.send([1.0, 1.0], env_ids=[0, 3], resets=[3])
    got = any_pool.recv_full(batch_size=2)
    assert sorted(got.env_ids.tolist()) == [0, 3] and any_pool.states() == ["idle"] * 4
    assert any_pool.observations[3]["t"] == 0 and any_pool.observations[0]["t"] == 3


def test_a_closed_pool_says_so_on_every_kind(ray_cluster):
    from boltzlabs.cluster import ClusterPool

    for pool in (RLPool(PROBE, 2), ClusterPool(PROBE, 2, cluster=ray_cluster.address, envs_per_node=1)):
        pool.close()
        for call in (lambda: pool.step([1.0, 1.0]), lambda: pool.reset(), lambda: pool.states()):
            with pytest.raises(PoolClosedError, match="closed; create a new one"):
                call()


# -- the Gymnasium adapter over a Ray cluster -----------------------------------------------


def test_vec_env_over_a_ray_cluster_steps_as_a_local_one(ray_cluster):
    pytest.importorskip("gymnasium")
    from boltzlabs.cluster import ClusterPool
    from boltzlabs.gym import BoltzLabsVecEnv

    def trajectory(**kwargs):
        envs = BoltzLabsVecEnv.make("CartPole-v1", num_envs=4, **kwargs)
        try:
            kind = type(envs.pool)
            out = [envs.reset(seed=3)[0].copy()]
            rng = np.random.default_rng(0)
            episodes = 0
            for _ in range(60):  # long enough for CartPole episodes to end and autoreset
                obs, rewards, terminated, truncated, infos = envs.step(rng.integers(0, 2, size=4))
                assert len(set(infos["episode_ids"])) == 4
                episodes += envs.completed_episodes
                out.append((obs.copy(), rewards.copy(), terminated.copy(), truncated.copy()))
            return kind, out, episodes
        finally:
            envs.close()

    kind, remote, episodes = trajectory(cluster=ray_cluster.address, envs_per_node=2)
    assert kind is ClusterPool and episodes > 0
    _, local, _ = trajectory()
    assert len(remote) == len(local)
    for a, b in zip(remote, local):
        for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            np.testing.assert_array_equal(x, y)


def test_call_get_attr_set_attr_reach_every_lane_over_a_ray_cluster_as_locally(ray_cluster):
    """The env's methods and attributes through either kind of pool: each node's
    lanes in one request, results joined in lane order."""
    pytest.importorskip("gymnasium")
    from boltzlabs.cluster import ClusterPool

    def run(pool):
        with pool:
            pool.reset(seed=5)
            before = pool.get_attr("metadata")  # the real Gymnasium env's attribute, per lane
            pool.set_attr("marker", [10, 11, 12, 13])
            some = pool.get_attr("marker", env_ids=[3, 0])
            pool.set_attr("marker", 7, env_ids=[1])
            return (
                [metadata["render_fps"] for metadata in before],
                some,
                pool.get_attr("marker"),
                pool.call("get_wrapper_attr", "marker"),
            )

    local = run(RLPool("gym://CartPole-v1", 4))
    remote = run(ClusterPool("gym://CartPole-v1", 4, cluster=ray_cluster.address, envs_per_node=2))
    assert local == remote == ([50] * 4, [13, 10], [10, 7, 12, 13], [10, 7, 12, 13])


# -- errors: typed, chained, named -----------------------------------------------------------


def test_every_exception_class_is_defined_in_errors_py():
    elsewhere = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "errors.py" and path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            # AssertionError subclasses (boltzlabs.testing's failed checks for users' CI) are
            # assertions pytest reports, not errors of the pool: they stay with their checks.
            if isinstance(node, ast.ClassDef) and any(
                re.search(r"(Error|Exception|Unavailable|Refused|Gone)$", ast.unparse(base))
                and ast.unparse(base) != "AssertionError"
                for base in node.bases
            ):
                elsewhere.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.name}")
    assert not elsewhere, f"exception classes outside boltzlabs/errors.py: {elsewhere}"


def test_each_exception_has_one_home():
    """errors.py is where every exception is imported from: no other module hands one out as its own."""
    from boltzlabs import errors, wire
    from boltzlabs.remote import envcache
    from boltzlabs.host import cgroups, seccomp
    from boltzlabs.worker import lifecycle, spawn

    names = {name for name, value in vars(errors).items() if isinstance(value, type) and issubclass(value, Exception)}
    for module in (wire, envcache, cgroups, seccomp, lifecycle, spawn):
        assert not names & set(getattr(module, "__all__", ())), module.__name__
    assert issubclass(errors.TemplateUnavailable, errors.BoltzLabsError)


def test_a_worker_side_failure_keeps_its_kind_and_its_text_as_the_cause():
    with RLPool(COUNTER, 1) as pool:
        with pytest.raises(WorkerError, match=r"the worker failed no_such_call\(\): protocol error") as err:
            pool._call("no_such_call")  # what a newer client would ask an older worker
        assert err.value.kind == "protocol" and err.value.signal is None
        cause = err.value.__cause__
        assert isinstance(cause, WorkerSideError) and cause.kind == "protocol"
        assert "no call 'no_such_call'" in cause.text or "no_such_call" in cause.text


def test_a_worker_that_exits_is_reported_by_its_code_not_a_signal():
    pool = RLPool(COUNTER, 1)
    try:
        pool.reset()
        worker = pool._link.proc
        os.kill(worker.pid, signal.SIGTERM)  # the worker's handler exits with a code, or the signal kills it
        worker.wait(timeout=20)
        with pytest.raises(WorkerError) as err:
            pool.step([1])
        if worker.returncode < 0:
            assert f"was killed by {signal.Signals(-worker.returncode).name}" in str(err.value)
            assert err.value.signal == -worker.returncode
        else:
            assert f"exited with code {worker.returncode}" in str(err.value) and err.value.signal is None
        assert "exit code -" not in str(err.value)
    finally:
        pool.close()


# -- a remote pool is judged by the remote worker's policy ---------------------------------------


TOKEN = "protocol-test-token"


def _policy_without_pids(tmp_path: Path) -> Path:
    text = (ROOT / "sandbox" / "policy.toml").read_text()
    stripped = re.sub(r"(?m)^pids\s*=.*$", "", text)
    assert stripped != text, "sandbox/policy.toml has no pids line to remove"
    path = tmp_path / "policy.toml"
    path.write_text(stripped)
    return path


def _listener(env: dict) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "boltzlabs", "worker", "--listen", "127.0.0.1:0", "--token", TOKEN],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=dict(env, PYTHONPATH=str(ROOT)),
        start_new_session=True,
    )
    line = proc.stdout.readline()
    match = re.match(r"listening on (tcp://127\.0\.0\.1:\d+)", line)
    assert match, f"the worker did not start: {line!r}"
    return proc, match.group(1)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    proc.stdout.close()


def test_a_remote_pool_is_judged_by_the_remote_policy_not_the_local_one(tmp_path, monkeypatch):
    narrow = _policy_without_pids(tmp_path)
    shipped_env = {k: v for k, v in os.environ.items() if k != "BOLTZLABS_POLICY"}
    # The remote allows what this machine's policy refuses...
    proc, url = _listener(shipped_env)
    try:
        monkeypatch.setenv("BOLTZLABS_POLICY", str(narrow))
        with pytest.raises(ValueError, match=r"unknown env limit\(s\) \['pids'\]"):
            RLPool(COUNTER, 1, limits={"pids": 64})  # the local worker, under the local policy
        with RLPool(COUNTER, 1, worker=url, token=TOKEN, limits={"pids": 64}) as pool:
            assert pool.reset()[0] is not None
    finally:
        _stop(proc)
    # ...and refuses what this machine's policy allows.
    monkeypatch.delenv("BOLTZLABS_POLICY")
    proc, url = _listener(dict(shipped_env, BOLTZLABS_POLICY=str(narrow)))
    try:
        with RLPool(COUNTER, 1, limits={"pids": 64}) as pool:
            assert pool.reset()[0] is not None
        with pytest.raises(ValueError, match=r"unknown env limit\(s\) \['pids'\]"):
            RLPool(COUNTER, 1, worker=url, token=TOKEN, limits={"pids": 64})
    finally:
        _stop(proc)


# -- the worker's guardian removes the pool's cgroups, not the client --------------------------


def _guardian_of(worker_pid: int):
    """The worker's cgroup guardian: its child named so, in a session of its own."""
    import psutil

    for child in psutil.Process(worker_pid).children():
        if child.name() == "boltzlabs-guard" and os.getsid(child.pid) == child.pid:
            return child
    return None


@pytest.mark.parametrize("gated", [False, True])
def test_a_killed_workers_cgroups_are_removed_by_its_guardian_without_the_client(gated):
    import time

    pool = RLPool(PROBE, 2, serialize_measurement=gated)
    try:
        pool.reset(seed=0)
        if not pool._cgroup:
            pytest.skip("no writable cgroups here")
        guardian = _guardian_of(pool._proc.pid)
        assert guardian is not None, "the worker forked no guardian"
        uss = guardian.memory_full_info().uss
        print(
            f"guardian USS {uss / 2**20:.2f} MiB (worker USS "
            f"{__import__('psutil').Process(pool._proc.pid).memory_full_info().uss / 2**20:.2f} MiB)"
        )
        assert uss < 16 << 20, f"the guardian holds {uss} private bytes"
        os.kill(pool._proc.pid, signal.SIGKILL)  # the client does nothing: no call, no close
        deadline = time.monotonic() + scaled(30)
        while time.monotonic() < deadline and any(os.path.exists(p) for p in pool._cgroup):
            time.sleep(0.05)
        assert not any(os.path.exists(p) for p in pool._cgroup), pool._cgroup
        # It exits just after its last rmdir: on a loaded machine, some time after.
        while time.monotonic() < deadline and not has_ended(guardian):
            time.sleep(0.05)
        assert has_ended(guardian), guardian
    finally:
        pool.close()


def test_episode_ids_are_uuid7s_of_this_millisecond_and_distinct_in_a_batch():
    before = time.time_ns() // 1_000_000
    ids = uuid7s(64) + [uuid7()]
    after = time.time_ns() // 1_000_000
    assert len(set(ids)) == 65 and uuid7s(0) == []
    for text in ids:
        value = uuid.UUID(text)
        assert str(value) == text and value.version == 7 and value.variant == uuid.RFC_4122
        assert before <= value.int >> 80 <= after  # its first 48 bits: Unix time in ms
