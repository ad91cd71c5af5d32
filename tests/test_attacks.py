"""Attacks not covered elsewhere: UDP egress and DNS, signals to host pids and
to sibling envs, /proc and /sys leaks. One test per attack, each asserting the
attack is refused and the pool stays healthy; both spawn modes."""

import errno
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from boltzlabs import RLPool
from boltzlabs.host.policy import load_policy
from conftest import host_lock

ATTACK_ENV = r"""
import errno
import os
import signal
import socket

from boltzlabs.env import serve

def reset(seed, options=None):
    return {"pid": os.getpid()}

def attempt(fn):
    try:
        return {"ok": fn()}
    except OSError as exc:
        return {"errno": exc.errno}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}

def udp(host, port):
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        return s.sendto(b"x", (host, port))

def read(path, size=256):
    with open(path, "rb") as f:
        return f.read(size).decode("latin-1")

def step(action):
    if not isinstance(action, dict):
        return {"alive": True}, float(action), False, {}
    op = action["op"]
    if op == "udp":
        out = attempt(lambda: udp(action["host"], action["port"]))
    elif op == "dns":
        out = attempt(lambda: socket.getaddrinfo(action["name"], 80))
    elif op == "kill":
        out = attempt(lambda: os.kill(action["pid"], action.get("sig", signal.SIGKILL)))
    elif op == "kill_all":  # every process this env can signal: kill(-1) spares only the caller
        out = attempt(lambda: os.kill(-1, signal.SIGKILL))
    elif op == "read":
        out = attempt(lambda: read(action["path"]))
    elif op == "listdir":
        out = attempt(lambda: sorted(os.listdir(action["path"])))
    elif op == "write":
        out = attempt(lambda: open(action["path"], "w").write("1"))
    elif op == "plant":  # symlinks in the workspace to host paths, then writes through them
        links = {}
        for name, target in action["links"].items():
            os.symlink(target, name)
            links[name] = attempt(lambda: open(os.path.join(name, "x") if action.get("dirs") else name, "w").write("pwned"))
        out = links
    else:
        raise KeyError(op)
    return {"alive": True, "out": out}, 0.0, False, {}

serve(reset=reset, step=step)
"""


@pytest.fixture
def attack(env_dir, pool_factory):
    """(pool, run): run(action) runs it on lane 0 while lane 1 steps normally;
    returns lane 0's result and checks lane 1 and then both lanes are healthy."""
    pool = pool_factory(env_dir(ATTACK_ENV), 2, step_timeout=10.0)
    pool.reset()

    def run(action):
        obs, rewards, dones, infos = pool.step([action, 1.0])
        assert rewards[1] == 1.0 and not dones[1], infos[1]
        assert "error" not in infos[0], infos[0]
        _, rewards, dones, _ = pool.step([1.0, 1.0])
        assert rewards.tolist() == [1.0, 1.0] and not dones.any()
        return obs[0]["out"]

    return pool, run


@pytest.mark.parametrize("host", ["8.8.8.8", "127.0.0.1", "::1", "192.0.2.1"])
def test_udp_egress_is_refused(attack, host):
    _, run = attack
    assert run({"op": "udp", "host": host, "port": 53}) == {"errno": errno.EAFNOSUPPORT}


def test_dns_lookups_fail(attack):
    _, run = attack
    out = run({"op": "dns", "name": "example.com"})
    # No resolver is reachable: no inet socket can even be made. getaddrinfo
    # reports it as a gaierror (an OSError) whatever errno the libc picks.
    assert "ok" not in out, out


def test_host_pids_cannot_be_signalled(attack):
    pool, run = attack
    victims = [os.getpid(), pool._proc.pid] + [p for p in pool.pids() if p > 0]
    for pid in victims:
        if pid <= 3:
            continue  # a small host pid can exist inside the sandbox's own pid namespace
        assert run({"op": "kill", "pid": pid}) == {"errno": errno.ESRCH}
    assert all(psutil.pid_exists(pid) for pid in victims)


def test_kill_all_reaches_only_the_envs_own_processes(attack):
    pool, _ = attack
    before = pool.pids()
    obs, rewards, dones, infos = pool.step([{"op": "kill_all"}, 1.0])
    # kill(-1) in its own pid namespace: whatever happens to env 0, env 1 and
    # the worker are out of its reach.
    assert rewards[1] == 1.0 and not dones[1]
    _, rewards, dones, infos = pool.step([1.0, 1.0])
    assert rewards[1] == 1.0 and not dones[1]
    assert psutil.pid_exists(before[1]) and pool._proc.poll() is None
    pool.reset(where=[0])  # env 0 recovers (respawned if it took itself down)
    _, rewards, dones, _ = pool.step([1.0, 1.0])
    assert rewards.tolist() == [1.0, 1.0] and not dones.any()


def test_sys_is_not_mounted(attack):
    _, run = attack
    out = run({"op": "listdir", "path": "/sys"})
    assert out in ({"ok": []}, {"errno": errno.ENOENT}), out
    assert run({"op": "read", "path": "/sys/kernel/notes"}) == {"errno": errno.ENOENT}


@pytest.mark.parametrize("path", ["/proc/kcore", "/proc/kmsg", "/proc/1/environ"])
def test_proc_holds_no_host_secrets(attack, path):
    _, run = attack
    out = run({"op": "read", "path": path})
    if path == "/proc/1/environ":
        # pid 1 is the sandbox's own init (or the env): never the host's environment.
        assert "ok" not in out or "HOME=/root" not in out["ok"], out
    else:
        assert out.get("errno") in (errno.EACCES, errno.EPERM, errno.ENOENT), out


@pytest.mark.parametrize("path", ["/proc/sysrq-trigger", "/proc/sys/kernel/hostname", "/proc/sys/vm/drop_caches"])
def test_proc_writes_that_reach_the_kernel_are_refused(attack, path):
    _, run = attack
    out = run({"op": "write", "path": path})
    # ENOENT: a proc mounted from the env's own user namespace has no sysrq-trigger at all.
    assert out.get("errno") in (errno.EACCES, errno.EROFS, errno.EPERM, errno.ENOENT), out


def test_symlinks_planted_in_the_workspace_are_never_followed_by_the_host(attack, tmp_path):
    """The workspace is a tmpfs in the sandbox's own mount namespace: no host
    path leads into it, so nothing on the host (close, hard reset, cleanup)
    ever resolves a path the env planted. Writes through the links inside
    fail: their targets are not mounted in the sandbox."""
    pool, run = attack
    secret = tmp_path / "secret"
    secret.write_text("host data")
    before = sorted(p.name for p in tmp_path.iterdir())
    out = run(
        {
            "op": "plant",
            "links": {
                "to-secret": str(secret),
                "to-passwd": "/etc/passwd",
                "to-proc-root": "/proc/1/root/etc/hostname",
            },
        }
    )
    assert out["to-secret"] == {"errno": errno.ENOENT}
    assert "ok" not in out["to-passwd"] and "ok" not in out["to-proc-root"], out
    out = run({"op": "plant", "dirs": True, "links": {"to-tmp": str(tmp_path), "to-root": "/"}})
    assert all("ok" not in result for result in out.values()), out
    mounts = Path("/proc/self/mountinfo").read_text() + Path(f"/proc/{pool._proc.pid}/mountinfo").read_text()
    assert "/workspace" not in mounts  # no host path reaches any env's workspace
    pool.reset(hard=True)
    pool.close()
    assert secret.read_text() == "host data"
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert Path("/etc/passwd").read_text().startswith("root:")


# -- quotas of the shared host account (issue 13, points 6 and 7) ------------------------

# Each "take" op takes as many of one kernel resource as it can (up to `most`)
# and holds them until the pool closes; it answers how many and the errno
# that stopped it (0: none did).
QUOTA_ENV = r"""
import ctypes
import errno
import fcntl
import os

from boltzlabs.env import serve

libc = ctypes.CDLL(None, use_errno=True)
held = []
FAN_CLASS_NOTIF, FAN_REPORT_FID = 0, 0x200

def ptmx(i):
    return os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY)

pipes = []  # read ends of the pipes taken; their write ends are in `held`

def make_pipe(i):
    r, w = os.pipe()
    pipes.append(r)
    held.append(w)
    return r

def pipe_sizes():
    sizes = {}
    for fd in pipes:
        size = fcntl.fcntl(fd, 1032)  # F_GETPIPE_SZ
        sizes[size] = sizes.get(size, 0) + 1
    return {"held": sizes, "channel": [fcntl.fcntl(fd, 1032) for fd in (3, 4)]}

def c_call(fn):
    def call(i):
        fd = fn(i)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        return fd
    return call

TAKE = {
    "ptys": ptmx,
    "pipes": make_pipe,
    "inotify": c_call(lambda i: libc.inotify_init1(0)),
    "fanotify": c_call(lambda i: libc.fanotify_init(FAN_CLASS_NOTIF | FAN_REPORT_FID, os.O_RDONLY)),
    "mqueue": c_call(lambda i: libc.mq_open(f"/boltzlabs-q{os.getpid()}-{i}".encode(), os.O_CREAT | os.O_RDWR,
                                            0o600, None)),
}

def take(kind, most):
    for i in range(most):
        try:
            held.append(TAKE[kind](i))
        except OSError as exc:
            return {"took": i, "errno": exc.errno}
    return {"took": most, "errno": 0}

def pty_number():
    master, slave = os.openpty()
    held.extend((master, slave))
    return int(os.ttyname(slave).rsplit("/", 1)[1])

def open_path(path):
    try:
        held.append(os.open(path, os.O_RDWR | os.O_NOCTTY))
        return 0
    except OSError as exc:
        return exc.errno

def step(action):
    if not isinstance(action, dict):
        return {"alive": True}, float(action), False, {}
    if action["op"] == "take":
        out = take(action["kind"], action["most"])
    elif action["op"] == "pipe_sizes":
        out = pipe_sizes()
    elif action["op"] == "pty_number":
        out = pty_number()
    elif action["op"] == "open":
        out = open_path(action["path"])
    elif action["op"] == "pts":  # what /dev/pts is: the filesystems mounted there, its entries, writable
        types = [line.split(" - ")[1].split()[0] for line in open("/proc/self/mountinfo")
                 if line.split()[4] == "/dev/pts"]
        out = {"types": types, "entries": os.listdir("/dev/pts"), "writable": os.access("/dev/pts", os.W_OK)}
    return {"alive": True, "out": out}, 0.0, False, {}

serve(reset=lambda seed, options=None: 0, step=step)
"""

# What a process of the sandboxes' host account, outside any sandbox, takes of the same thing.
HOST_TAKE = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
kind = sys.argv[1]
if kind == "inotify":
    fd = libc.inotify_init1(0)
elif kind == "fanotify":
    fd = libc.fanotify_init(0x200, os.O_RDONLY)
elif kind == "mqueue":
    name = f"/boltzlabs-host-{os.getpid()}".encode()
    fd = libc.mq_open(name, os.O_CREAT | os.O_RDWR, 0o600, None)
    libc.mq_unlink(name)
print(0 if fd >= 0 else ctypes.get_errno())
"""


def _host_account_takes(kind: str) -> int:
    """0 if a host process of the sandboxes' account can take one `kind`, else its errno."""
    from boltzlabs.host.identity import host_account
    from boltzlabs.host.policy import load_policy

    account = host_account(load_policy().sandbox["identity"])
    # The system's interpreter when there is one: the account may not reach ours (pyenv under /root).
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    out = subprocess.run(
        [*account.prefix, python, "-S", "-c", HOST_TAKE, kind], capture_output=True, text=True, timeout=30, cwd="/"
    )
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


@pytest.fixture
def quota_pool(env_dir, pool_factory):
    source = env_dir(QUOTA_ENV)

    def make(**kwargs):
        pool = pool_factory(source, 2, step_timeout=20.0, **kwargs)
        pool.reset()  # a pool steps only lanes a reset has reached
        return pool

    return make


def _take(pool, kind: str, most: int) -> dict:
    obs, rewards, dones, infos = pool.step([{"op": "take", "kind": kind, "most": most}, 1.0])
    assert "error" not in infos[0], infos[0]
    assert rewards[1] == 1.0, infos[1]
    return obs[0]["out"]


def test_one_env_takes_at_most_its_own_ptys_and_other_pools_still_get_theirs(quota_pool):
    """Each env has a devpts instance of its own with the policy's `max=`: an
    env that opens ptys until it is refused stops there (ENOSPC), not at the
    host-wide count that every sandbox of the account shares; meanwhile a
    second pool opens ptys as usual."""
    cap = load_policy().sandbox["quotas"]["ptys"]
    pool = quota_pool(limits={"open_files": 512})
    out = _take(pool, "ptys", 400)
    assert out == {"took": cap, "errno": errno.ENOSPC}, out
    other = quota_pool()
    assert _take(other, "ptys", 4) == {"took": 4, "errno": 0}
    assert _take(pool, "ptys", 1) == {"took": 0, "errno": errno.ENOSPC}  # still held, still capped


@pytest.mark.parametrize(
    "kind, refused", [("inotify", errno.ENOSYS), ("fanotify", errno.EPERM), ("mqueue", errno.EMFILE)]
)
def test_one_env_cannot_use_up_the_host_accounts_quota(quota_pool, kind, refused):
    """inotify instances, fanotify groups and message-queue bytes are counted per
    host account (through every user namespace); the sandboxes share one. An
    env that takes all it can leaves a host process of that account, and
    another pool, able to take theirs."""
    pool = quota_pool()
    out = _take(pool, kind, 300)
    assert out == {"took": 0, "errno": refused}, out
    assert _host_account_takes(kind) == 0
    assert _take(quota_pool(), kind, 1)["errno"] == refused  # refused by policy, not by exhaustion


@pytest.mark.skipif(os.geteuid() != 0, reason="the worker's pipes are the account's own when it is not root")
def test_an_env_spending_the_accounts_pipe_quota_leaves_other_pools_channels_whole(quota_pool):
    """fs.pipe-user-pages-soft (16384 pages) counts per host account, and every
    sandbox shares one: past it, the account's new pipes get 2 pages. An env
    can spend it (this one holds 1500 pipes, 1024 fill it) and so shrink the
    pipes other envs make for themselves; but the channels and log pipes
    are the worker's (root, held to no such quota here), made before any
    env runs: another pool's channel pipes keep their 64 KiB.

    It holds a host lock: in CI the other session runs this test too, and its
    env, spending the same account's quota first and then closing its pipes,
    would leave this one's env holding only small pipes under the limit."""
    with host_lock("pipe-quota"):
        pool = quota_pool(limits={"open_files": 4096})
        assert _take(pool, "pipes", 1500) == {"took": 1500, "errno": 0}
        sizes = pool.step([{"op": "pipe_sizes"}, 1.0])[0][0]["out"]
        assert min(int(size) for size in sizes["held"]) < 65536, sizes  # the account's quota is spent
        other = quota_pool()
        assert other.channel == "pipes"
        assert _take(other, "pipes", 1) == {"took": 1, "errno": 0}
        other_sizes = other.step([{"op": "pipe_sizes"}, 1.0])[0][0]["out"]
        assert other_sizes["channel"] == [65536, 65536], other_sizes
        assert max(map(int, other_sizes["held"])) < 65536, other_sizes  # its own pipe: the account's, spent
        other.close()
        pool.close()  # inside the lock: its env's pipes are spent quota until it is gone


def test_a_policy_of_no_ptys_mounts_no_devpts_and_hides_every_other(quota_pool, tmp_path, monkeypatch):
    """`[quotas] ptys = 0`: no env mounts a devpts (one superblock less per
    env); /dev/pts is an empty read-only directory over whatever devpts was
    below (bwrap's, the template's), so /dev/ptmx names nothing and no env
    reaches a pty of another."""
    text = (Path(__file__).resolve().parent.parent / "sandbox" / "policy.toml").read_text()
    assert "\nptys = 16\n" in text
    policy = tmp_path / "policy.toml"
    policy.write_text(text.replace("\nptys = 16\n", "\nptys = 0\n"))
    monkeypatch.setenv("BOLTZLABS_POLICY", str(policy))
    pool = quota_pool()
    for lane in (0, 1):
        actions = [1.0, 1.0]
        actions[lane] = {"op": "pts"}
        obs, _, _, infos = pool.step(actions)
        assert "error" not in infos[lane], infos[lane]
        pts = obs[lane]["out"]
        assert "devpts" != pts["types"][-1] and pts["entries"] == [] and not pts["writable"], pts
    assert _take(pool, "ptys", 4) == {"took": 0, "errno": errno.ENOENT}
    pool.reset(seed=0, hard=True)
    assert _take(pool, "ptys", 1) == {"took": 0, "errno": errno.ENOENT}


def test_a_lane_cannot_open_another_lanes_pty(quota_pool):
    """Each env mounts its own devpts: lane 0's /dev/pts/N does not exist for lane 1."""
    pool = quota_pool()
    obs, _, _, infos = pool.step([{"op": "pty_number"}, 1.0])
    assert "error" not in infos[0], infos[0]
    number = obs[0]["out"]
    obs, _, _, infos = pool.step([1.0, {"op": "open", "path": f"/dev/pts/{number}"}])
    assert obs[1]["out"] == errno.ENOENT, obs[1]
    obs, _, _, infos = pool.step([{"op": "open", "path": f"/dev/pts/{number}"}, 1.0])
    assert obs[0]["out"] == 0  # its own pty: there, for itself


FORGED_HANDSHAKE = r"""
import ctypes, os
from boltzlabs import wire
from boltzlabs.runtime import serve as _env
from boltzlabs.env import serve

_real_loop = _env._serve_loop
forger = {}


class _HandshakeAlreadySent:
    # The env's channel, less the HELLO the serve loop writes first.
    def __init__(self, channel):
        self.channel, self.first = channel, True

    def write(self, data):
        if self.first:
            self.first = False
            return
        self.channel.write(data)

    def receive(self):
        return self.channel.receive()

    def __getattr__(self, name):  # the rest of the channel (its observation slot, ...) as it is
        return getattr(self.channel, name)


def _forging_loop(channel, reset, step, render, info):
    if "BOLTZLABS_ENV_INDEX" not in os.environ:  # the template's warm-up: leave it alone
        return _real_loop(channel, reset, step, render, info)
    # The handshake comes from a short-lived grandchild, not from the env.
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        ctypes.CDLL(None).prctl(15, b"bl-forger", 0, 0, 0)  # PR_SET_NAME: the test finds it
        channel.write(wire.encode([wire.HELLO, wire.PROTOCOL_VERSION, dict(info, pid=1)]))
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    forger.update(pid=pid, release=w)
    _real_loop(_HandshakeAlreadySent(channel), reset, step, render, info)


_env._serve_loop = _forging_loop  # import-time code can replace anything of the runtime


def step(action):
    if action == "release":  # the grandchild exits and is reaped: its pid is free
        os.close(forger["release"])
        os.waitpid(forger["pid"], 0)
    return 0, 1.0, False, {}


serve(reset=lambda seed: 0, step=step)
"""


def _host_process_with_pid(pid: int) -> subprocess.Popen:
    """A host `sleep` given exactly `pid`: the kernel hands out ns_last_pid + 1
    next, and root may write it. Other processes of the host can race us."""
    for _ in range(50):
        if psutil.pid_exists(pid):
            pytest.skip(f"pid {pid} was taken by another host process before the test could take it")
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        proc = subprocess.Popen(["sleep", "60"])
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    pytest.skip(f"could not start a host process with pid {pid}")


def test_a_handshake_from_a_short_lived_grandchild_never_gets_a_host_process_killed(env_dir, spawn):
    """The worker once took an env's host pid from the credentials of its
    first message and SIGKILLed that pid at hard reset and close; a grandchild
    that sent the handshake and exited left a pid any host process could reuse."""
    pool = RLPool(env_dir(FORGED_HANDSHAKE), 1, spawn=spawn, step_timeout=10.0)
    with pool:
        pool.reset(seed=0)
        forgers = [p for p in psutil.Process(pool._proc.pid).children(recursive=True) if p.name() == "bl-forger"]
        assert len(forgers) == 1
        forged = forgers[0].pid
        _, rewards, _, infos = pool.step(["release"])
        assert rewards[0] == 1.0, infos
        assert not psutil.pid_exists(forged)
        bystander = _host_process_with_pid(forged)
        try:
            recorded = pool.pids()[0]
            pool.reset(hard=True)  # kills the env's sandbox
            _, rewards, _, _ = pool.step([0])
            assert rewards[0] == 1.0
            pool.close()  # and again
            assert bystander.poll() is None, f"host process {forged} was killed: {bystander.returncode}"
        finally:
            bystander.kill()
            bystander.wait()
        assert recorded != forged  # pids() shows the env's own process, not what its handshake claimed
