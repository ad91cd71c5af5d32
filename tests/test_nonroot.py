"""Never host root: every sandbox process runs as an unprivileged host account.

A worker started by root starts each bwrap as sandbox/policy.toml's
[identity] host_user; a pool started by an ordinary user works too. The uids
are read from the host side (/proc/<pid>/status), never from inside.
"""

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from boltzlabs import RLPool
from boltzlabs.errors import SandboxUnavailable
from boltzlabs.host.identity import host_account, reachable
from boltzlabs.host.policy import load_policy
from conftest import PROBE, TESTS

REPO = TESTS.parent
IDENTITY = load_policy().sandbox["identity"]
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="the uid switch happens only when the worker runs as root")


def host_uids(pid: int) -> tuple[list[int], list[int]]:
    """(real, effective, saved, fs) uids and gids of a host process, as the host sees them."""
    lines = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return [int(x) for x in lines["Uid"].split()], [int(x) for x in lines["Gid"].split()]


def sandbox_processes(pool) -> list[psutil.Process]:
    """Every process of the pool below the worker: bwraps, the template, envs
    (not the worker's cgroup guardian, a fork of the worker that stays root)."""
    worker = psutil.Process(pool._proc.pid)
    return [p for p in worker.children(recursive=True) if p.name() != "boltzlabs-guard"]


@as_root
def test_every_sandbox_process_runs_as_the_policy_account(probe_pool):
    account = pwd.getpwnam(IDENTITY["host_user"])
    pool = probe_pool(2)
    pool.reset(seed=0)
    processes = sandbox_processes(pool)
    names = {p.name() for p in processes}
    assert "bwrap" in names and "python" in "".join(names), names
    for proc in processes:
        uids, gids = host_uids(proc.pid)
        assert uids == [account.pw_uid] * 4, f"{proc.name()} {proc.pid} has host uids {uids}"
        assert gids == [account.pw_gid] * 4, f"{proc.name()} {proc.pid} has host gids {gids}"
        assert 0 not in uids
    assert host_uids(pool._proc.pid)[0][0] == 0  # the worker itself stays root (cgroups)
    # Every env's own process is among them, and sees the policy's uid inside.
    for pid in pool.pids():
        assert psutil.Process(pid) in processes
    obs, *_ = pool.step([{"op": "identity"}] * 2)
    assert [o["out"]["uid"] for o in obs] == [IDENTITY["uid"]] * 2


@as_root
def test_a_root_only_file_bound_in_stays_unreadable(pool_factory, tmp_path):
    # tmp_path is 0700 root's: the env dir is reachable only through the
    # worker's staging, and the secret sits inside the bound directory. As
    # host root (the owner) the env would read it, capabilities or not.
    source = tmp_path / "env"
    source.mkdir(mode=0o755)
    shutil.copy(PROBE / "env.py", source / "env.py")
    (source / "env.py").chmod(0o644)
    (source / "public").write_text("anyone may read this")
    (source / "public").chmod(0o644)
    (source / "secret").write_text("root only")
    (source / "secret").chmod(0o600)
    account = pwd.getpwnam(IDENTITY["host_user"])
    assert not reachable(str(source), account.pw_uid, account.pw_gid)
    pool = pool_factory(source, 1)
    pool.reset(seed=0)
    obs, *_ = pool.step([{"op": "read", "path": "/env/public"}])
    assert obs[0]["out"] == {"ok": "anyone may read this"}
    obs, *_ = pool.step([{"op": "read", "path": "/env/secret"}])
    assert obs[0]["out"]["denied"].startswith("PermissionError: [Errno 13]"), obs[0]["out"]


def staging_dirs(worker: int) -> set[str]:
    """The worker's staging tmpfs mounts (not the binds below them)."""
    points = {line.split()[4] for line in Path(f"/proc/{worker}/mountinfo").read_text().splitlines()}
    return {p for p in points if "/boltzlabs-binds-" in p and p.count("/") == 2}


@as_root
def test_the_workers_staging_is_removed_at_close(probe_pool):
    pool = probe_pool(1)
    staged = staging_dirs(pool._proc.pid)
    account = pwd.getpwnam(IDENTITY["host_user"])
    needs = not all(reachable(p, account.pw_uid, account.pw_gid) for p in (sys.base_prefix, sys.prefix, str(PROBE)))
    assert len(staged) == needs, staged  # here: yes, the interpreter is under /root (0700)
    pool.close()
    assert not any(os.path.exists(p) for p in staged)
    if not needs:
        return
    # A worker killed outright cannot clean up: the next pool sweeps what it left.
    pool = probe_pool(1)
    left = staging_dirs(pool._proc.pid)
    os.kill(pool._proc.pid, signal.SIGKILL)
    pool._proc.wait(timeout=10)
    assert all(os.path.isdir(p) for p in left)
    probe_pool(1).reset()
    assert not any(os.path.exists(p) for p in left)


@as_root
def test_an_account_that_is_missing_or_root_is_a_clear_error():
    with pytest.raises(SandboxUnavailable, match="no such user.*useradd"):
        host_account({"host_user": "boltzlabs-no-such-user"})
    with pytest.raises(SandboxUnavailable, match="never run as host root"):
        host_account({"host_user": "root"})
    with pytest.raises(SandboxUnavailable, match="host_group 'boltzlabs-no-such-group'"):
        host_account({"host_user": "nobody", "host_group": "boltzlabs-no-such-group"})


# --- a pool started by an ordinary user -----------------------------------------

# Run as root in a private mount namespace (unshare -m): make every path the
# pool needs reachable by the ordinary user without touching the host's
# permissions, then become that user with runuser.
EXPOSE = r"""
import ctypes, json, os, sys, tempfile
from boltzlabs.host.identity import reachable, may
user, uid, gid, needed, command = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18

def mount(source, target, fstype, flags, data=None):
    if libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(), flags,
                  data and data.encode()) != 0:
        sys.exit(f"mount {target}: {os.strerror(ctypes.get_errno())}")

mount(None, "/", None, MS_REC | MS_PRIVATE)
hold = tempfile.mkdtemp()
mount("tmpfs", hold, "tmpfs", 0, "mode=0700")
blocked = [p for p in needed if not reachable(p, uid, gid)]
covers = set()
for i, path in enumerate(blocked):
    os.mkdir(f"{hold}/{i}")
    mount(path, f"{hold}/{i}", None, MS_BIND | MS_REC)
    parent = "/"
    for part in path.split("/")[1:]:  # the first directory the user cannot search
        parent = os.path.join(parent, part)
        if not may(os.stat(parent), uid, gid, 1):
            covers.add(parent)
            break
for cover in sorted(covers, key=len):
    if not any(cover.startswith(c + "/") for c in covers):
        mount("tmpfs", cover, "tmpfs", 0, "mode=0755")
for i, path in enumerate(blocked):
    os.makedirs(path, mode=0o755, exist_ok=True)
    mount(f"{hold}/{i}", path, None, MS_BIND | MS_REC)
missing = [p for p in needed if not reachable(p, uid, gid)]
if missing:
    print(json.dumps({"skip": f"{user} cannot read {missing} even with its parents exposed"}))
    sys.exit(0)
os.execvp("runuser", ["runuser", "-u", user, "--", *command])
"""

CLIENT = r"""
import json, os, sys, warnings
import psutil
from boltzlabs import RLPool
probe, spawn, tag = sys.argv[1:]
out = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    pool = RLPool(probe, 2, spawn=spawn, step_timeout=20, tag=tag)
    out["warnings"] = [str(w.message) for w in caught]
out["spawn"] = pool.spawn
out["reset"] = pool.reset(seed=3)
obs, rewards, dones, infos = pool.step([1, 2])
out["step"] = [obs, rewards.tolist(), infos]
out["identity"] = [o["out"] for o in pool.step([{"op": "identity"}] * 2)[0]]
out["hard"] = pool.reset(seed=3, hard=True)
out["again"] = pool.step([1, 2])[0]
out["memory_source"] = pool.memory().source
out["uids"] = sorted({psutil.Process(p.pid).uids().real for p in psutil.Process().children(recursive=True)})
out["me"] = os.getuid()
pool.close()
with RLPool(probe, 2, spawn=spawn, step_timeout=20, tag=tag, pin_sandboxes=True) as pinned:  # its own sandboxes
    pinned.reset(seed=0)
    out["pinned"] = [o["out"] for o in pinned.step([{"op": "cpus"}] * 2)[0]]
out["cpus"] = sorted(os.sched_getaffinity(0))
out["left"] = [p.pid for p in psutil.Process().children(recursive=True)]
print(json.dumps(out))
"""


@as_root
def test_a_pool_started_by_an_ordinary_user_works(spawn, tmp_path):
    if shutil.which("runuser") is None or shutil.which("unshare") is None:
        pytest.skip("needs runuser and unshare (util-linux)")
    user = pwd.getpwnam(IDENTITY["host_user"])
    tag = uuid.uuid4().hex
    # What the user must reach: the interpreter, the venv, the repo (the
    # probe and an editable install). Anything below /root (or another 0700
    # directory) is exposed in the private namespace only.
    needed = sorted({sys.base_prefix, sys.prefix, str(REPO)})
    command = [sys.executable, "-c", CLIENT, str(PROBE), spawn, tag]
    argv = [
        "unshare",
        "--mount",
        sys.executable,
        "-c",
        EXPOSE,
        json.dumps([user.pw_name, user.pw_uid, user.pw_gid, needed, command]),
    ]
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": "/",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONPATH": str(REPO),
    }
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd="/", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(out["skip"])
    assert out["me"] == user.pw_uid
    assert out["spawn"] == spawn
    assert out["uids"] == [user.pw_uid]  # the worker and every sandbox: the user, nobody else
    assert out["reset"] == out["hard"] == [{"t": 0, "episodes": 1, "seed": 3}, {"t": 0, "episodes": 1, "seed": 4}]
    obs, rewards, infos = out["step"]
    assert [o["t"] for o in obs] == [1, 1] and rewards == [1.0, 2.0]
    assert out["again"] == obs  # the hard reset replayed the same episode
    assert [i["uid"] for i in out["identity"]] == [IDENTITY["uid"]] * 2
    assert "PSS" in out["memory_source"]  # an ordinary user has no writable memory cgroup here
    assert out["left"] == []
    cpus = out["cpus"]  # pin_sandboxes: an ordinary user's worker pins its own sandboxes
    assert out["pinned"] == [[cpus[0]], [cpus[1 % len(cpus)]]]
    leftovers = [p.pid for p in psutil.process_iter(["cmdline"]) if tag in " ".join(p.info["cmdline"] or [])]
    assert leftovers == []


@as_root
def test_env_code_the_account_cannot_read_is_a_clear_error(env_dir):
    source = env_dir(
        "from boltzlabs.env import serve\nserve(reset=lambda seed: 0, step=lambda a: (0, 0.0, False, {}))\n"
    )
    (source / "env.py").chmod(0o600)
    with pytest.raises(SandboxUnavailable, match=r"env\.py is not readable by .*chmod -R o\+rX"):
        RLPool(source, 1)
