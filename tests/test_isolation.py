"""Isolation: what an env must not see or do, tried for real from inside a sandbox.

Every test runs a real pool (real bwrap, real processes, nothing mocked),
tries an escape from inside an env, asserts it is refused, and then checks
that the pool is still healthy: a normal step (action 1) on every lane
returns reward 1.0 with no error.

Nothing here touches host state outside the test's own temporary files: the
only writes attempted from inside a sandbox go to new file names, and host
sysctls are probed with access()/open() only, never written.
"""

from __future__ import annotations

import errno
import os
import secrets
import site
import socket
import sys
import threading
from pathlib import Path

import psutil
import pytest

from boltzlabs import RLPool
from boltzlabs.host.builder import SandboxSpec, load_policy

PROBE = Path(__file__).resolve().parent / "envs" / "probe"
ENV_DIR = "/env"
RUNTIME_DIR = "/opt/boltzlabs"
WORKSPACE = "/workspace"
HOSTNAME = "boltzlabs"

# -- helpers --------------------------------------------------------------------------


@pytest.fixture
def pool_factory(pool_factory):
    """conftest's, each pool reset once when it is made: the probe's ops run in step(), and a
    pool refuses to step a lane no reset has reached (as Gymnasium's vector envs do)."""

    def make(*args, **kwargs):
        pool = pool_factory(*args, **kwargs)
        pool.reset()
        return pool

    return make


def assert_healthy(pool: RLPool) -> None:
    """A normal step on every lane answers reward 1.0 with no error."""
    assert pool.states() == ["idle"] * pool.n
    obs, rewards, dones, infos = pool.step([1] * pool.n)
    assert rewards.tolist() == [1.0] * pool.n
    for i in range(pool.n):
        assert obs[i] is not None, infos[i]
        assert "error" not in infos[i], infos[i]
    assert pool.states() == ["idle"] * pool.n


def run(pool: RLPool, action):
    """Send one probe action to every lane; return each lane's obs["out"]."""
    obs, rewards, dones, infos = pool.step([action] * pool.n)
    for i in range(pool.n):
        assert "error" not in infos[i], infos[i]
        assert obs[i] is not None, infos[i]
    return [o["out"] for o in obs]


def assert_denied(out: dict, *errnos: int) -> str:
    """`out` is a probe's refusal, with one of `errnos` when given."""
    assert set(out) == {"denied"}, f"expected a refusal, got {out!r}"
    text = out["denied"]
    if errnos:
        assert any(f"[Errno {e}]" in text for e in errnos), (
            f"expected one of {[errno.errorcode[e] for e in errnos]}, got {text!r}"
        )
    return text


def interpreter_paths() -> list[str]:
    """Where the interpreter profile (mounts/interpreter.toml) binds, inside:
    the installed interpreter and every site-packages (a venv's included)."""
    spec = SandboxSpec(load_policy(), PROBE, 1 << 20)
    paths = {sys.base_prefix} | {p for p in site.getsitepackages() if os.path.exists(p)}
    return sorted(spec.inside(p) for p in paths)


def expected_root_entries(spawn: str) -> set[str]:
    """What '/' may hold inside: the policy's mounts, nothing else."""
    entries = {"dev", "proc", "env", "opt", "usr", "workspace", "tmp"}
    if spawn == "template":  # the template's fully visible proc, covered in every env
        entries.add(Path(load_policy().sandbox["template"]["hidden_proc"]).parts[1])
    entries |= {name for name in ("bin", "lib", "lib64", "sbin") if os.path.lexists("/" + name)}
    if any(
        os.path.lexists(f"/etc/{name}")
        for name in ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "alternatives")
    ):
        entries.add("etc")
    entries |= {Path(p).parts[1] for p in interpreter_paths()}
    return entries


def policy_environment() -> dict:
    return SandboxSpec(load_policy(), PROBE, 1 << 20).environment()


class TokenServer:
    """A listener on the host that sends a token to whoever connects, and counts them."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.token = "token-" + secrets.token_hex(8)
        self.accepted = 0
        self._stop = threading.Event()
        self.sock.settimeout(0.05)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            self.accepted += 1
            with conn:
                conn.sendall(self.token.encode())

    def close(self):
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


# A hostile env for what the probe cannot do: fill files, list its open fds,
# try the sysctls, forge frames on fds it should not hold.
HOSTILE_ENV = r'''
import errno
import os
import stat
import sys

from boltzlabs import wire
from boltzlabs.env import serve

def reset(seed, options=None):
    return 0

def errname(exc):
    return errno.errorcode.get(exc.errno, str(exc.errno))

def fill(path, mib):
    """Write `mib` MiB to path; 'ok' or the errno name of the first failure."""
    chunk = b"x" * (1 << 20)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError as exc:
        return errname(exc)
    try:
        for _ in range(mib):
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view):]
        return "ok"
    except OSError as exc:
        return errname(exc)
    finally:
        os.close(fd)

def open_fds():
    fds = []
    for fd in range(4096):
        try:
            os.fstat(fd)
        except OSError:
            continue
        fds.append(fd)
    return fds

def writable(path):
    """Could a write be opened on path? Opens O_WRONLY and closes; never writes."""
    try:
        os.close(os.open(path, os.O_WRONLY))
        return "open-for-write"
    except OSError as exc:
        return errname(exc)

def forge():
    """Send fake pool replies on every socket other than the own channel."""
    fake = [["forged"] * 2, b"\x00\x00\x7a\x44" * 2, bytes(2), bytes(2), [{"forged": True}] * 2, []]
    hit = []
    for fd in open_fds():
        if fd <= 3 or not stat.S_ISSOCK(os.fstat(fd).st_mode):
            continue
        for seq in range(1, 64):
            try:
                os.write(fd, wire.encode([wire.REPLY, seq, 0.0, fake]))
            except OSError:
                break
        hit.append(fd)
    return hit

def step(action):
    if not isinstance(action, dict):
        return {"honest": True}, float(action), False, {}
    op = action["op"]
    if op == "fill":
        out = fill(action["path"], action["mib"])
    elif op == "rm":
        try:
            os.unlink(action["path"])
            out = "ok"
        except OSError as exc:
            out = errname(exc)
    elif op == "fds":
        out = open_fds()
    elif op == "access":
        out = {p: (os.path.exists(p), os.access(p, os.W_OK)) for p in action["paths"]}
    elif op == "open_w":
        out = writable(action["path"])
    elif op == "statvfs":
        st = os.statvfs(action["path"])
        out = st.f_blocks * st.f_frsize
    elif op == "forge":
        out = forge()
    elif op == "touch":  # empty files, until refused
        os.makedirs(action["dir"], exist_ok=True)
        out = {"made": action["most"], "error": None}
        for i in range(action["most"]):
            try:
                os.close(os.open(f"{action['dir']}/{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            except OSError as exc:
                out = {"made": i, "error": errname(exc)}
                break
    elif op == "where":  # mount points, and where the interpreter thinks it is
        with open("/proc/self/mountinfo") as f:
            points = [line.split()[4] for line in f]
        out = {"mount_points": points, "executable": sys.executable, "prefix": sys.prefix,
               "base_prefix": sys.base_prefix, "path": sys.path, "file": __file__, "cwd": os.getcwd()}
    elif op == "inodes":
        out = os.statvfs(action["path"]).f_files
    else:
        raise KeyError(op)
    return {"honest": True, "out": out}, 0.0, False, {}

serve(reset=reset, step=step)
'''


@pytest.fixture
def hostile_pool(env_dir, pool_factory):
    """A factory of pools over HOSTILE_ENV, every one closed at the end of the test."""
    source = env_dir(HOSTILE_ENV)
    return lambda n=2, step_timeout=10.0, **kwargs: pool_factory(source, n, step_timeout=step_timeout, **kwargs)


def hostile(pool: RLPool, action):
    obs, rewards, dones, infos = pool.step([action] * pool.n)
    for i in range(pool.n):
        assert "error" not in infos[i], infos[i]
    return [o["out"] for o in obs]


# -- 1. read-only code and system dirs -----------------------------------------------


def test_env_code_dir_and_system_dirs_are_read_only(probe_pool):
    name = f"boltzlabs-test-write-{secrets.token_hex(6)}"
    targets = {  # path inside -> where it would land on the host
        f"{ENV_DIR}/{name}": PROBE / name,
        f"/usr/{name}": Path("/usr") / name,
        f"{RUNTIME_DIR}/boltzlabs/{name}": Path(__file__).resolve().parents[1] / "boltzlabs" / name,
        f"{SandboxSpec(load_policy(), PROBE, 1 << 20).inside(sys.base_prefix)}/{name}": Path(sys.base_prefix) / name,
    }
    for host in targets.values():
        assert not host.exists()
    pool = probe_pool(2)
    try:
        for inside in targets:
            for out in run(pool, {"op": "write", "path": inside}):
                assert_denied(out, errno.EROFS, errno.EACCES)
        for host in targets.values():
            assert not host.exists(), f"a write from inside the sandbox landed on the host: {host}"
        assert "serve(reset=reset, step=step)" in (PROBE / "env.py").read_text()
        assert_healthy(pool)
    finally:
        for host in targets.values():
            if host.exists():
                host.unlink()


# -- 2. host files are not visible ---------------------------------------------------


def test_host_secret_files_are_not_visible(probe_pool):
    token = secrets.token_hex(8)
    secret = f"boltzlabs-test-secret-{token}"
    homes = [Path("/root"), Path("/tmp"), Path("/work")]
    created = []
    try:
        for home in homes:
            if home.is_dir():
                path = home / secret
                path.write_text(f"the secret {token}")
                created.append(path)
        assert created
        pool = probe_pool(2)
        for path in created:
            for out in run(pool, {"op": "read", "path": str(path)}):
                text = assert_denied(out, errno.ENOENT, errno.EACCES)
                assert token not in text.replace(secret, "")
            for out in run(pool, {"op": "listdir", "path": str(path.parent)}):
                assert secret not in out.get("ok", [])
        assert_healthy(pool)
    finally:
        for path in created:
            path.unlink()


def test_root_holds_only_the_policys_mounts(probe_pool):
    pool = probe_pool(2)
    expected = expected_root_entries(pool.spawn)
    if pool.spawn == "template":
        hidden = load_policy().sandbox["template"]["hidden_proc"]
        for path in (os.path.dirname(hidden), hidden, hidden + "/1/environ", hidden + "/sys/kernel/core_pattern"):
            for out in run(pool, {"op": "listdir" if "environ" not in path else "read", "path": path}):
                assert_denied(out, errno.EACCES)
    for out in run(pool, {"op": "listdir", "path": "/"}):
        assert set(out["ok"]) == expected, f"unexpected top-level entries: {set(out['ok']) ^ expected}"
        # (a venv under /work or /home puts that top-level dir on the way to the interpreter)
        needed = {Path(p).parts[1] for p in interpreter_paths()}
        for forbidden in {"home", "sys", "work", "mnt", "media", "srv", "var", "boot", "run"} - needed:
            assert forbidden not in out["ok"]
    # A top-level dir that is only there to reach the interpreter (/root when
    # it lives in ~/.pyenv) holds nothing but the path to it, at every level.
    bound = interpreter_paths()
    covered = lambda d: any(d == b or d.startswith(b + os.sep) for b in bound)  # noqa: E731
    for path in bound:
        for ancestor in Path(path).parents:
            a = str(ancestor)
            if (
                a == "/"
                or covered(a)
                or any(
                    a == "/" + n or a.startswith("/" + n + "/")
                    for n in ("usr", "opt", "etc", "dev", "proc", "workspace")
                )
            ):
                continue
            children = {Path(b).relative_to(a).parts[0] for b in bound if b.startswith(a + os.sep)}
            for out in run(pool, {"op": "listdir", "path": a}):
                assert set(out["ok"]) == children, f"{a} shows more than the way to the interpreter"
    # No sysfs, so no host cgroup tree; the cgroup namespace shows only its root.
    for path in ("/sys", "/sys/fs/cgroup"):
        for out in run(pool, {"op": "listdir", "path": path}):
            assert_denied(out, errno.ENOENT)
    for out in run(pool, {"op": "read", "path": "/sys/fs/cgroup/cgroup.procs"}):
        assert_denied(out, errno.ENOENT)
    for out in run(pool, {"op": "read", "path": "/proc/self/cgroup"}):
        lines = out["ok"].splitlines()
        assert lines and all(line.endswith(":/") for line in lines), lines
    # /etc has only the loader's files: no passwd, shadow, ssl keys or resolv.conf.
    for out in run(pool, {"op": "listdir", "path": "/etc"}):
        assert set(out["ok"]) <= {"ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "alternatives"}
    assert_healthy(pool)


# -- 3. the host environment does not leak -------------------------------------------


def test_host_environment_does_not_leak(probe_pool, monkeypatch):
    value = "secret-" + secrets.token_hex(8)
    monkeypatch.setenv("BOLTZLABS_TEST_SECRET", value)
    pool = probe_pool(2)
    policy = policy_environment()
    assert policy["PYTHONHASHSEED"] == "0"
    assert policy["HOME"] == policy["TMPDIR"] == WORKSPACE
    for i, env in enumerate(run(pool, {"op": "environ"})):
        assert "BOLTZLABS_TEST_SECRET" not in env
        assert value not in repr(env)
        assert "BOLTZLABS_FD" not in env  # popped by serve()
        # The policy's variables, the lane index, the pool's str cap (limits.max_str_len, which
        # the env's decoder holds requests to) and PWD (set by bwrap's --chdir).
        assert env == {
            **policy,
            "BOLTZLABS_ENV_INDEX": str(i),
            "BOLTZLABS_PARAMS": "{}",
            "BOLTZLABS_MAX_STR_LEN": "4194304",
            "PWD": WORKSPACE,
        }
    # bwrap itself (pid 1 inside) is started with an empty environment.
    for out in run(pool, {"op": "read", "path": "/proc/1/environ"}):
        assert value not in out["ok"]
        assert "BOLTZLABS_TEST_SECRET" not in out["ok"]
    assert_healthy(pool)


# -- 4. network ----------------------------------------------------------------------


def test_host_loopback_tcp_is_unreachable(probe_pool):
    server = TokenServer(socket.create_server(("127.0.0.1", 0)))
    try:
        port = server.sock.getsockname()[1]
        # Control: the listener answers on the host.
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            assert s.recv(100).decode() == server.token
        before = server.accepted
        pool = probe_pool(2)
        for out in run(pool, {"op": "connect", "host": "127.0.0.1", "port": port}):
            # The seccomp filter refuses AF_INET sockets (sandbox/seccomp.toml);
            # behind it, the env's own loopback, where nobody listens.
            assert_denied(out, errno.EAFNOSUPPORT)
        assert server.accepted == before
        assert_healthy(pool)
    finally:
        server.close()


def test_host_loopback_ipv6_is_unreachable(probe_pool):
    try:
        sock = socket.create_server(("::1", 0), family=socket.AF_INET6)
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback on this host: {exc}")
    server = TokenServer(sock)
    try:
        port = server.sock.getsockname()[1]
        pool = probe_pool(2)
        for out in run(pool, {"op": "connect", "host": "::1", "port": port}):
            text = assert_denied(out)
            assert server.token not in text
        assert server.accepted == 0
        assert_healthy(pool)
    finally:
        server.close()


def test_host_abstract_unix_socket_is_unreachable(probe_pool):
    name = "boltzlabs-test-" + secrets.token_hex(8)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind("\0" + name)
    sock.listen()
    server = TokenServer(sock)
    try:
        # Control: the listener answers on the host.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2)
            s.connect("\0" + name)
            assert s.recv(100).decode() == server.token
        before = server.accepted
        pool = probe_pool(2)
        for out in run(pool, {"op": "abstract", "name": name}):
            assert_denied(out, errno.ECONNREFUSED)  # abstract names live in the net namespace
        assert server.accepted == before
        assert_healthy(pool)
    finally:
        server.close()


def test_no_route_off_the_sandbox(probe_pool):
    pool = probe_pool(2)
    # No AF_INET socket can be made (the seccomp filter), and behind that the
    # sandbox has only a loopback and no route: nothing leaves for the host's network.
    for out in run(pool, {"op": "connect", "host": "10.255.255.1", "port": 9}):
        assert_denied(out, errno.EAFNOSUPPORT)
    assert pool.timing.worker_ms < 900  # refused at once, not a 1 s timeout
    assert_healthy(pool)


# -- 5. host processes ---------------------------------------------------------------


def test_host_processes_are_not_visible(probe_pool):
    pool = probe_pool(2)
    host_pids = {os.getpid(), pool._proc.pid, *pool.pids()}
    for pids in run(pool, {"op": "pids"}):
        assert len(pids) <= 3, pids  # the sandbox's init and the env itself
        assert all(p <= 3 for p in pids), pids
        assert not (set(pids) & {p for p in host_pids if p > 3})
    for ident in run(pool, {"op": "identity"}):
        assert ident["pid"] <= 3
    # /proc/1 is the sandbox's own init (bwrap's, or in template mode the env itself), not the host's.
    for out in run(pool, {"op": "read", "path": "/proc/1/cmdline"}):
        assert "bwrap" in out["ok"] or ("boltzlabs.runtime.template" in out["ok"] and pool.spawn == "template")
    assert_healthy(pool)


def _sandbox_processes(pid: int) -> list[psutil.Process]:
    """The env's processes from the host: under its bwrap (exec), or itself (template)."""
    process = psutil.Process(pid)
    return [process] + process.children(recursive=True)


def _env_pid(pid: int) -> int:
    """The env's own interpreter: the innermost python at or under pid."""
    inner = [p for p in _sandbox_processes(pid) if "python" in p.name()]
    assert inner, f"no env process at or under {pid}"
    return inner[-1].pid


def _namespaces(pid: int) -> dict:
    return {ns: os.readlink(f"/proc/{pid}/ns/{ns}") for ns in ("user", "pid", "net", "ipc", "uts", "mnt", "cgroup")}


def test_each_env_has_namespaces_of_its_own(probe_pool):
    """Seen from the host: every env's process is in its own set of namespaces."""
    pool = probe_pool(2)
    host = _namespaces(os.getpid())
    seen = []
    for pid in pool.pids():
        ns = _namespaces(_env_pid(pid))
        for kind, ident in ns.items():
            assert ident != host[kind], f"env shares the host's {kind} namespace"
        seen.append(ns)
    for kind in host:
        assert seen[0][kind] != seen[1][kind], f"envs 0 and 1 share a {kind} namespace"
    assert_healthy(pool)


def test_a_hard_reset_gives_each_lane_namespaces_it_never_had(probe_pool):
    """Nothing of a lane's last episode carries over through a namespace (SysV
    IPC objects, for one, outlive their process in an IPC namespace): after a
    hard reset every namespace of every lane is a new one."""
    pool = probe_pool(2)
    before = []
    pinned = []  # open ns fds keep the old namespaces, so no new one can reuse their inode numbers
    for pid in pool.pids():
        inner = _env_pid(pid)
        before.append(_namespaces(inner))
        pinned += [os.open(f"/proc/{inner}/ns/{kind}", os.O_RDONLY) for kind in before[-1]]
    try:
        pool.reset(seed=0, hard=True)
        for lane, pid in enumerate(pool.pids()):
            for kind, ident in _namespaces(_env_pid(pid)).items():
                assert ident != before[lane][kind], f"lane {lane} kept its {kind} namespace across a hard reset"
    finally:
        for fd in pinned:
            os.close(fd)
    assert_healthy(pool)


# -- 6. identity ---------------------------------------------------------------------


def test_identity_and_tmp_is_the_workspace(probe_pool):
    pool = probe_pool(2)
    for ident in run(pool, {"op": "identity"}):
        assert ident["uid"] == os.getuid()  # bwrap maps the caller's uid to itself
        assert ident["hostname"] == HOSTNAME
        assert ident["cwd"] == ident["home"] == ident["tmpdir"] == WORKSPACE
    text = "note-" + secrets.token_hex(4)
    for out in run(pool, {"op": "ws_write", "text": text}):
        assert out == {"cwd": WORKSPACE}
    for path in ("/tmp/note.txt", f"{WORKSPACE}/note.txt"):
        for out in run(pool, {"op": "read", "path": path}):
            assert out == {"ok": text}
    # The note lives in the sandbox's tmpfs, not in the host's /tmp.
    assert not Path("/tmp/note.txt").exists() or text not in Path("/tmp/note.txt").read_text()
    assert_healthy(pool)


# -- 7. envs of one pool do not see each other ---------------------------------------


def test_envs_cannot_see_each_other(probe_pool):
    pool = probe_pool(2)
    name = f"only-env0-{secrets.token_hex(4)}.txt"
    obs, rewards, dones, infos = pool.step([{"op": "ws_write", "name": name, "text": "env 0 was here"}, 1])
    assert "error" not in infos[0] and "error" not in infos[1]
    obs, rewards, dones, infos = pool.step([{"op": "ws_read", "name": name}] * 2)
    assert obs[0]["out"] == {"ok": "env 0 was here"}
    assert_denied(obs[1]["out"], errno.ENOENT)
    obs, rewards, dones, infos = pool.step([{"op": "read", "path": f"/tmp/{name}"}] * 2)
    assert obs[0]["out"] == {"ok": "env 0 was here"}
    assert_denied(obs[1]["out"], errno.ENOENT)
    # Each sees only its own init and itself: pid-for-pid the same small view,
    # and env 0's processes (on the host: the children of its bwrap) are not in env 1's.
    pids = run(pool, {"op": "pids"})
    assert pids[0] == pids[1] and len(pids[1]) <= 3
    env0 = {p.pid for p in _sandbox_processes(pool.pids()[0])} | {pool.pids()[0]}
    assert not (set(pids[1]) & {p for p in env0 if p > 3})
    # The hostnames are separate too: both are the policy's, and neither is the host's.
    for ident in run(pool, {"op": "identity"}):
        assert ident["hostname"] == HOSTNAME
    assert_healthy(pool)


# -- 8. the workspace size cap -------------------------------------------------------


def test_workspace_size_cap_gives_enospc(hostile_pool):
    pool = hostile_pool(2, workspace_size="4M")
    assert hostile(pool, {"op": "statvfs", "path": WORKSPACE}) == [4 << 20] * 2
    assert hostile(pool, {"op": "fill", "path": "big", "mib": 8}) == ["ENOSPC"] * 2
    assert_healthy(pool)
    # Through /tmp (a symlink to the workspace) it is the same cap.
    assert hostile(pool, {"op": "rm", "path": "big"}) == ["ok"] * 2
    assert hostile(pool, {"op": "fill", "path": "/tmp/big", "mib": 8}) == ["ENOSPC"] * 2
    # The space comes back when the file goes.
    assert hostile(pool, {"op": "rm", "path": "/tmp/big"}) == ["ok"] * 2
    assert hostile(pool, {"op": "fill", "path": "small", "mib": 2}) == ["ok"] * 2
    assert_healthy(pool)


def test_no_host_directory_is_named_by_a_mount_point_or_the_interpreter(hostile_pool):
    """The interpreter, its site-packages, the runtime and the env's code are
    bound at neutral paths: the project directory, the venv, the
    interpreter's prefix and the env's directory on the host appear in no
    mount point of /proc/self/mountinfo, nor in sys.executable, sys.prefix
    or sys.path. (mountinfo's fourth field, the bound directory's path within
    its file system, still names them: docs/seccomp.md, "What remains".)"""
    pool = hostile_pool(2)
    source = str(Path(pool.source).resolve())
    host = {str(Path(__file__).resolve().parents[1]), sys.prefix, sys.base_prefix, source}
    host = {path for path in host if not path.startswith("/usr/")}
    for out in hostile(pool, {"op": "where"}):
        named = [
            value
            for value in [
                *out["mount_points"],
                out["executable"],
                out["prefix"],
                out["base_prefix"],
                *out["path"],
                out["file"],
                out["cwd"],
            ]
            if any(value == h or value.startswith(h + "/") for h in host)
        ]
        assert not named, f"host directories named inside: {named}"
        assert out["file"] == f"{ENV_DIR}/env.py"
    assert_healthy(pool)


def test_workspace_files_are_capped_too(hostile_pool):
    """Empty files cost kernel memory that the size cap does not count (~1 KiB
    an inode): the workspace has an inode cap too, one per [workspace]
    bytes_per_inode of its size, shared with /dev/shm. Past it: ENOSPC."""
    per_inode = load_policy().sandbox["workspace"]["bytes_per_inode"]
    pool = hostile_pool(2, workspace_size="4M")
    cap = (4 << 20) // per_inode
    assert hostile(pool, {"op": "inodes", "path": WORKSPACE}) == [cap] * 2
    for out in hostile(pool, {"op": "touch", "dir": "many", "most": 20 * cap}):
        # The tmpfs's root and its two directories (workspace, shm) and "many" hold four.
        assert out == {"made": cap - 4, "error": "ENOSPC"}, out
    for out in hostile(pool, {"op": "touch", "dir": "/dev/shm", "most": 10}):
        assert out["error"] == "ENOSPC", out
    assert_healthy(pool)


# -- holes found by this suite and closed: the fd leak, /proc/sys, bwrap's own tmpfs --


def test_env_holds_no_fd_but_its_own(hostile_pool):
    pool = hostile_pool(2)
    # stdin (/dev/null), stdout and stderr (the log pipe), the channel (two
    # pipes: 3 read, 4 written; or a socket on 3) and in a local pool its
    # observation slot on 7 (this env declares no space: an empty memfd, sealed
    # at 0 bytes); nothing else. Lane 0 is spawned before any HELLO; a lane
    # spawned after lane 0's HELLO said the space has no slot gets none
    # (worker/slots.py fd_for): which one lane 1 is depends on the timing.
    assert pool.channel == "pipes"
    first, second = hostile(pool, {"op": "fds"})
    assert first == [0, 1, 2, 3, 4, 7]
    assert second in ([0, 1, 2, 3, 4, 7], [0, 1, 2, 3, 4])
    assert_healthy(pool)


def test_env_cannot_forge_the_pools_replies(hostile_pool):
    pool = hostile_pool(2)
    pool.step([{"op": "forge"}] * 2)
    obs, rewards, dones, infos = pool.step([1, 1])
    assert obs == [{"honest": True}] * 2, obs
    assert rewards.tolist() == [1.0, 1.0]
    assert_healthy(pool)


def test_sysctls_are_read_only(hostile_pool):
    pool = hostile_pool(2)
    paths = [
        "/proc/sys/kernel/core_pattern",
        "/proc/sys/vm/drop_caches",
        "/proc/sys/kernel/hostname",
        "/proc/sys/net/ipv4/ip_forward",
        "/proc/sysrq-trigger",
    ]
    # access() only: host-wide sysctls are never opened for writing here.
    for result in hostile(pool, {"op": "access", "paths": paths}):
        writable = [p for p, (exists, w) in result.items() if exists and w]
        assert not writable, f"writable from inside the sandbox: {writable}"
    # kernel.hostname is per UTS namespace (the sandbox's own): safe to open for write.
    assert hostile(pool, {"op": "open_w", "path": "/proc/sys/kernel/hostname"})[0] in ("EROFS", "EACCES", "EPERM")
    assert_healthy(pool)


def test_nothing_writable_outside_the_workspace(hostile_pool):
    pool = hostile_pool(2, workspace_size="4M")
    for path in ("/big", "/opt/big", "/etc/big", "/dev/big"):
        for result in hostile(pool, {"op": "fill", "path": path, "mib": 1}):
            assert result in ("EROFS", "EACCES", "ENOSPC", "ENOENT"), f"{path}: {result}"
    assert_healthy(pool)


def test_dev_shm_is_capped_by_workspace_size(hostile_pool):
    pool = hostile_pool(2, workspace_size="4M")
    for result in hostile(pool, {"op": "fill", "path": "/dev/shm/big", "mib": 8}):
        assert result in ("EROFS", "EACCES", "ENOSPC", "ENOENT"), result
    assert_healthy(pool)
