"""reset(scrub=True): every process but the env's server killed, the workspace emptied, the
sandbox kept (boltzlabs/runtime/scrub.py, docs/code-rl.md).

Each test's env leaves what a code action leaves (setsid daemons, a double fork, a fork bomb,
files in locked and deep directories, /dev/shm, SysV IPC, symlinks out of the workspace) and
asks the sandbox, from inside, what is left; the worker's count from outside is tried with a
server that skips its scrub. Both spawn modes; real sandboxes, nothing mocked.
"""

import os

import numpy as np
import psutil
import pytest

from boltzlabs import RLPool
from conftest import run_benchmark, scaled, wait_until

LITTER = """
    import ctypes, os, subprocess, sys, time
    from boltzlabs.env import serve

    born = os.getpid()

    def inodes():  # in use in the workspace's tmpfs (/dev/shm is the same one): any depth, any mode
        st = os.statvfs("/dev/shm")
        return st.f_files - st.f_ffree

    empty = inodes()
    resets = [0]

    def census():
        procs = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
        ipc = sum(len(open(f"/proc/sysvipc/{k}").read().splitlines()) - 1 for k in ("shm", "sem", "msg"))
        return {"procs": procs, "entries": inodes() - empty, "ipc": ipc, "cwd": os.getcwd(),
                "server": os.getpid(), "born": born, "resets": resets[0]}

    def reset(seed=None, options=None):
        resets[0] += 1
        return 0, dict(census(), seed=seed, options=options)

    def daemon(body):
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                body()
            os._exit(0)
        os.wait()

    def writer():
        n = 0
        while True:
            n += 1
            try:
                open(f"w{n % 50}", "w").write("x")
            except OSError:
                pass
            time.sleep(0.001)

    def bomb():
        while True:
            try:
                if os.fork() == 0:
                    time.sleep(0.01)
            except OSError:
                time.sleep(0.001)

    def step(action):
        home = os.path.expanduser("~")
        if action == "litter":
            os.makedirs("a/b/c", exist_ok=True)
            open("a/b/c/f", "w").write("x")
            os.mkdir("locked")
            open("locked/x", "w").write("y")
            os.chmod("locked", 0)
            open("/dev/shm/seg", "w").write("z")
            os.symlink("/env", "env-link")
            os.symlink("/proc/self/root", "root-link")
            subprocess.Popen(["sleep", "1000"], start_new_session=True)
            daemon(writer)
            libc = ctypes.CDLL(None)
            assert libc.shmget(0, 4096, 0o1000 | 0o600) >= 0  # IPC_PRIVATE, IPC_CREAT
            assert libc.semget(0, 1, 0o1000 | 0o600) >= 0
            assert libc.msgget(0, 0o1000 | 0o600) >= 0
        elif action == "deep":  # deeper than PATH_MAX allows to name, and than the fd limit
            for _ in range(3000):
                os.mkdir("d")
                os.chdir("d")
            open("bottom", "w").write("x")
            os.chdir(home)
        elif action == "bomb":
            daemon(bomb)
            time.sleep(0.2)
        elif action == "fill":
            try:
                with open("big", "wb") as f:
                    while True:
                        f.write(b"x" * (1 << 20))
            except OSError:
                pass
            try:
                for i in range(100000):
                    open(f"i{i}", "w").close()
            except OSError:
                pass
        elif action == "lock-workspace":
            os.chmod(home, 0)
        return 0, 0.0, False, census()

    serve(reset=reset, step=step)
"""


def lane_processes(pool, i: int) -> int:
    """The processes of lane i's sandbox, seen from the host: its pid and every descendant."""
    root = psutil.Process(pool.pids()[i])
    return 1 + len(root.children(recursive=True))


def clean(census: dict, spawn: str) -> bool:
    """Nothing of an earlier episode: the server alone (with bubblewrap's init in exec mode), no
    workspace entry, no IPC object, back in the workspace."""
    alone = [1] if spawn == "template" else [1, 2]
    return census["procs"] == alone and census["entries"] == 0 and census["ipc"] == 0 and census["cwd"] == "/workspace"


def test_scrub_kills_every_other_process_and_empties_the_workspace(pool_factory, env_dir, spawn):
    pool = pool_factory(env_dir(LITTER), 3)
    pool.reset()
    _, _, _, infos = pool.step(["litter", "litter", "none"])
    assert infos[0]["entries"] >= 7 and infos[0]["ipc"] == 3 and len(infos[0]["procs"]) > 2
    before = lane_processes(pool, 1)
    obs = pool.reset(where=[0], scrub=True)
    info = pool.reset_infos[0]
    assert obs[0] == 0 and clean(info, spawn), info
    scrubbed = info["scrubbed"]
    assert scrubbed["processes"] >= 2 and scrubbed["entries"] >= 7 and scrubbed["ipc"] == 3, scrubbed
    # The sandbox was kept: the same server, its state (a second reset counted) and host pid.
    assert info["server"] == info["born"] and info["resets"] == 2
    # From outside: lane 0 holds its server alone (bwrap's two with it in exec mode).
    assert lane_processes(pool, 0) == (1 if spawn == "template" else 3)
    # Lane 1, not scrubbed, keeps what it made; its writer is still writing.
    assert lane_processes(pool, 1) == before
    _, _, _, infos = pool.step(["none", "none", "none"])
    assert infos[1]["entries"] >= 7 and infos[1]["ipc"] == 3
    assert clean(infos[0], spawn) or infos[0]["entries"] == 0, infos[0]
    # The symlinks were removed, never followed: /env is as it was.
    assert infos[0]["procs"] == ([1] if spawn == "template" else [1, 2])


def test_scrub_empties_deep_locked_and_full_workspaces(pool_factory, env_dir, spawn):
    pool = pool_factory(env_dir(LITTER), 3, workspace_size="16M")
    pool.reset()
    pool.step(["deep", "fill", "lock-workspace"])
    pool.reset(scrub=True)
    for i in range(3):
        assert clean(pool.reset_infos[i], spawn), (i, pool.reset_infos[i])
    assert pool.reset_infos[0]["scrubbed"]["entries"] >= 3001
    # The workspace is usable again: a second round fills and empties it the same way.
    pool.step(["fill", "deep", "litter"])
    pool.reset(scrub=True)
    assert all(clean(pool.reset_infos[i], spawn) for i in range(3)), pool.reset_infos


def test_scrub_stops_a_fork_bomb_that_is_still_forking(pool_factory, env_dir, spawn):
    pool = pool_factory(env_dir(LITTER), 2, limits={"pids": 64})
    pool.reset()
    pool.step(["bomb", "none"])
    assert wait_until(lambda: lane_processes(pool, 0) > 20, scaled(10))
    pool.reset(where=[0], scrub=True)
    assert clean(pool.reset_infos[0], spawn), pool.reset_infos[0]
    assert lane_processes(pool, 0) == (1 if spawn == "template" else 3)
    obs, _, _, infos = pool.step(["none", "none"])
    assert "error" not in infos[0] and "error" not in infos[1]


def skipping_scrub(env: int | None = None) -> str:
    """LITTER whose server (env `env`'s, or every env's) replaces its scrub with one that kills
    nothing and says it is done, as an action that ran in the server's own process could."""
    when = "True" if env is None else f"os.environ.get('BOLTZLABS_ENV_INDEX') == '{env}'"
    return LITTER.replace(
        "    serve(reset=reset, step=step)",
        "    import boltzlabs.runtime.scrub as _scrub\n"
        f"    if {when}:\n"
        "        _scrub.scrub = lambda workspace, ipc=False: {'processes': 0}\n"
        "    serve(reset=reset, step=step)",
    )


def test_a_server_that_skips_its_scrub_is_caught_from_outside(pool_factory, env_dir, spawn):
    """An action that ran in the server's own process can replace the scrub; the worker's count
    of the lane's cgroup still sees the processes left, kills the lane and says so."""
    pool = pool_factory(env_dir(skipping_scrub()), 2)
    if pool.memory().source == "pss":
        pytest.skip("no cgroups here: the count from outside needs the lane's cgroup")
    pool.reset()
    pool.step(["litter", "none"])
    with pytest.warns(RuntimeWarning, match="scrub reported done"):
        obs = pool.reset(scrub=True)
    assert obs[0] is None
    assert "scrub reported done" in pool.reset_infos[0]["error"], pool.reset_infos[0]
    assert obs[1] == 0 and "error" not in pool.reset_infos[1]
    # A later reset respawns it; the lane is whole again.
    pool.reset(where=[0])
    assert pool.reset_infos[0]["server"] == pool.reset_infos[0]["born"]
    assert clean(pool.reset_infos[0], spawn)


def test_scrub_of_a_dead_lane_respawns_it_and_hard_wins(pool_factory, env_dir, spawn):
    pool = pool_factory(env_dir(LITTER), 2)
    pool.reset()
    pool.step(["litter", "litter"])
    os.kill(pool.pids()[0], 9)
    assert wait_until(lambda: pool.states()[0] == "dead", scaled(10))
    pool.reset(scrub=True)
    assert clean(pool.reset_infos[0], spawn) and "scrubbed" not in pool.reset_infos[0]  # a new sandbox
    assert clean(pool.reset_infos[1], spawn) and "scrubbed" in pool.reset_infos[1]
    first = pool.pids()[1]
    pool.reset(where=[1], hard=True, scrub=True)  # hard does all a scrub does: a new sandbox
    assert pool.pids()[1] != first and "scrubbed" not in pool.reset_infos[1]


def test_scrub_is_checked_and_refused_while_in_flight(pool_factory, env_dir):
    pool = pool_factory(env_dir(LITTER), 2)
    pool.reset()
    with pytest.raises(TypeError, match="scrub must be True or False"):
        pool.reset(scrub="yes")
    pool.send(["none"], [0])
    with pytest.raises(ValueError, match="recv it first"):
        pool.reset(where=[0], scrub=True)
    pool.recv()
    pool.reset(where=np.array([True, False]), scrub=np.bool_(True))
    assert "scrubbed" in pool.reset_infos[0] and "scrubbed" not in pool.reset_infos[1]


def test_scrub_in_a_sharded_and_a_gated_pool(env_dir, spawn):
    with RLPool(env_dir(LITTER), 4, workers=2, spawn=spawn, step_timeout=scaled(5)) as pool:
        pool.reset()
        pool.step(["litter"] * 4)
        pool.reset(where=[1, 2], scrub=True)
        _, _, _, infos = pool.step(["none"] * 4)
        assert [clean(info, spawn) for info in infos] == [False, True, True, False], infos
    with RLPool(env_dir(LITTER), 2, serialize_measurement=True, spawn=spawn, step_timeout=scaled(5)) as pool:
        pool.reset()
        pool.step(["litter", "litter"])
        pool.reset(scrub=True)
        assert all(clean(pool.reset_infos[i], spawn) for i in range(2)), pool.reset_infos


def test_scrub_in_a_group_resets_every_env_of_the_sandbox_and_says_so(env_dir):
    with RLPool(env_dir(LITTER), 4, envs_per_sandbox=2, step_timeout=scaled(5)) as pool:
        pool.reset()
        pool.step(["litter", "none", "litter", "none"])
        pool.reset(where=[0], scrub=True)
        assert clean(pool.reset_infos[0], "template"), pool.reset_infos[0]
        assert "scrubbed" in pool.reset_infos[1]["group_reset"]
        assert "scrubbed" in pool.reset_infos[1] and "group_reset" not in pool.reset_infos[0]
        # The other sandbox was not touched.
        _, _, _, infos = pool.step(["none"] * 4)
        assert infos[2]["entries"] >= 7 and infos[0]["entries"] == 0


def test_the_gymnasium_adapter_scrubs_through_its_options(env_dir):
    from boltzlabs.gym import BoltzLabsVecEnv

    source = LITTER.replace(
        "    serve(reset=reset, step=step)",
        "    from gymnasium.spaces import Discrete\n"
        "    serve(reset=reset, step=lambda a: step('litter' if a else 'none'),\n"
        "          observation_space=Discrete(2), action_space=Discrete(2))",
    )
    with RLPool(env_dir(source), 2, step_timeout=scaled(5), warmup=False) as pool:
        adapter = BoltzLabsVecEnv(pool)
        adapter.reset()
        adapter.step(np.array([1, 1]))
        options = {"boltzlabs.scrub": True, "reset_mask": np.array([True, False])}
        adapter.reset(options=options)
        assert options == {}  # popped, as the mask is
        assert clean(pool.reset_infos[0], "template") and "scrubbed" in pool.reset_infos[0]
        adapter.step(np.array([0, 0]))
        assert pool.reset_infos[1]["resets"] == 1  # lane 1 was not reset at all


def test_send_scrubs_lanes_in_flight_seeded_while_the_others_step(pool_factory, env_dir, spawn):
    """send(resets=, seed=, options=, scrub=True): the scrub is an async reset, received with the
    steps sent beside it, not a reset() that blocks until its slowest lane is done."""
    pool = pool_factory(env_dir(LITTER), 3)
    pool.reset()
    pool.step(["litter", "litter", "litter"])
    pool.send(["ignored", "none", "none"], [0, 1, 2], resets=[0], seed=[7, None, None], options={"k": 1}, scrub=True)
    ids, obs, rewards, dones, infos = pool.recv(3)
    got = {i: (o, r, d, info) for i, o, r, d, info in zip(ids.tolist(), obs, rewards.tolist(), dones.tolist(), infos)}
    o, r, d, info = got[0]
    assert (o, r, d) == (0, 0.0, False) and clean(info, spawn), info
    assert info["seed"] == 7 and info["options"] == {"k": 1}
    assert info["scrubbed"]["processes"] >= 2 and info["scrubbed"]["entries"] >= 7, info
    assert info["server"] == info["born"] and info["resets"] == 2  # the sandbox and its server kept
    for i in (1, 2):  # stepped in the same send: what they made is still there
        assert got[i][3]["entries"] >= 7 and len(got[i][3]["procs"]) > 2, got[i][3]
    # An int seed gives env i seed + i, as reset() does; no scrub: the litter stays.
    pool.send(["x", "x", "x"], resets=[1, 2], seed=100)
    ids, obs, _, _, infos = pool.recv(3)
    by_id = dict(zip(ids.tolist(), infos))
    assert (by_id[1]["seed"], by_id[2]["seed"]) == (101, 102)
    assert "scrubbed" not in by_id[1] and by_id[1]["entries"] >= 7


def test_send_scrub_is_counted_from_outside_and_a_dead_lane_is_respawned(pool_factory, env_dir, spawn):
    pool = pool_factory(env_dir(skipping_scrub(env=0)), 3)
    if pool.memory().source == "pss":
        pytest.skip("no cgroups here: the count from outside needs the lane's cgroup")
    pool.reset()
    pool.step(["litter", "litter", "litter"])
    os.kill(pool.pids()[2], 9)
    assert wait_until(lambda: pool.states()[2] == "dead", scaled(10))
    pool.send(["x", "x", "x"], resets=[0, 1, 2], scrub=True)
    with pytest.warns(RuntimeWarning, match="scrub reported done"):
        ids, obs, _, dones, infos = pool.recv(3)
    by_id = {i: (o, d, info) for i, o, d, info in zip(ids.tolist(), obs, dones.tolist(), infos)}
    assert by_id[0][0] is None and by_id[0][1] and "scrub reported done" in by_id[0][2]["error"], by_id[0]
    assert clean(by_id[1][2], spawn) and "scrubbed" in by_id[1][2]
    assert clean(by_id[2][2], spawn) and "scrubbed" not in by_id[2][2]  # a new sandbox: nothing to scrub
    pool.reset(where=[0])  # respawned: whole again
    assert clean(pool.reset_infos[0], spawn)


def test_send_scrub_in_sharded_and_grouped_pools_and_what_it_refuses(env_dir):
    with RLPool(env_dir(LITTER), 4, workers=2, step_timeout=scaled(5)) as pool:
        pool.reset()
        pool.step(["litter"] * 4)
        pool.send(["x"] * 4, resets=[1, 2], seed=[None, 11, 12, None], scrub=True)
        ids, _, _, _, infos = pool.recv(4)
        by_id = dict(zip(ids.tolist(), infos))
        assert [clean(by_id[i], "template") for i in range(4)] == [False, True, True, False], by_id
        assert (by_id[1]["seed"], by_id[2]["seed"]) == (11, 12)  # each shard its own lanes' seeds
        with pytest.raises(TypeError, match="scrub must be True or False"):
            pool.send(["x"], [0], resets=[0], scrub="yes")
        with pytest.raises(TypeError, match="whole numbers"):
            pool.send(["x"], [0], resets=[0], seed=[1.5, 0, 0, 0])
        assert pool.states() == ["idle"] * 4  # nothing was sent
    with RLPool(env_dir(LITTER), 4, envs_per_sandbox=2, step_timeout=scaled(5)) as pool:
        pool.reset()
        pool.step(["litter", "none", "litter", "none"])
        with pytest.raises(ValueError, match="resets whole sandboxes"):
            pool.send(["x", "none"], [0, 1], resets=[0], scrub=True)
        pool.send(["x", "x", "none", "none"], resets=[0, 1], seed=20, scrub=True)
        ids, _, _, _, infos = pool.recv(4)
        by_id = dict(zip(ids.tolist(), infos))
        assert clean(by_id[0], "template") and "scrubbed" in by_id[0] and by_id[1]["seed"] == 21, by_id
        assert by_id[2]["entries"] >= 7  # the other sandbox stepped, untouched


def test_the_worker_refuses_a_malformed_send_how(pool_factory, env_dir):
    """What a remote client sends is checked in the worker: the reset part of a send()."""
    pool = pool_factory(env_dir(LITTER), 2)
    pool.reset()
    for how, match in (
        ("scrub", "how must be"),
        ([None, None, "yes"], "scrub must be a bool"),
        ([[1, 2], None, True], "one seed per reset env"),
        ([[1.5], None, False], "whole numbers or None"),
    ):
        with pytest.raises(ValueError, match=match):
            pool._call("send", ["x"], [0], [0], how)
    assert pool.states() == ["idle", "idle"]
    pool.send(["x", "x"], resets=[0], seed=[3, None])
    _, _, _, _, infos = pool.recv(2)
    assert sorted(info.get("seed", -1) for info in infos) == [-1, 3]


def test_bench_scrub_runs_and_checks_every_lane():
    """benchmarks/bench_scrub.py at a small n: it fails (exit status) when any lane is not clean."""
    out = run_benchmark("bench_scrub.py", "--n", "4", "--rounds", "1", "--files", "5")
    assert "median hard/scrub" in out and "one lane: scrub" in out, out


def test_the_kill_loop_waits_for_a_starved_process_and_gives_up_only_on_uninterruptible_sleep():
    """On a loaded node a killed process may wait seconds for a core to exit: the scrub waits
    for it (the reset's deadline bounds the wait) and fails only when every process left is in
    the kernel's uninterruptible sleep, which no signal ends. States as /proc gives them."""
    from boltzlabs.runtime import scrub

    assert not scrub._stuck({}) and not scrub._stuck({7: "R"}) and not scrub._stuck({7: "D", 8: "R"})
    assert not scrub._stuck({7: "Z"}) and not scrub._stuck({7: "S"})
    assert scrub._stuck({7: "D"}) and scrub._stuck({7: "D", 8: "D"})
    me = os.getpid()
    states = scrub._states()  # this process's namespace (the test's), without this process and pid 1
    assert me not in states and 1 not in states and all(len(s) == 1 and s.isalpha() for s in states.values())
