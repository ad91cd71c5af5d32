"""spawn="template": envs forked from one warm template, each its own sandbox."""

import os
import time
import warnings
from pathlib import Path

import pytest

from boltzlabs import RLPool
from conftest import COUNTER, PROBE, scaled

IMPORT_PROBE = """
import ctypes, os, errno
from boltzlabs.env import serve

libc = ctypes.CDLL(None, use_errno=True)

def unshare_user():
    if libc.unshare(0x10000000) != 0:  # CLONE_NEWUSER
        raise OSError(ctypes.get_errno(), "unshare")

def attempt(fn):
    try:
        fn()
        return "allowed"
    except OSError as exc:
        return errno.errorcode[exc.errno]

# Run at import, in the template (or, in exec mode, in the env itself).
AT_IMPORT = {
    "hidden": attempt(lambda: os.listdir("/.template/proc")),
    "sysctl": attempt(lambda: open("/proc/sys/kernel/hostname", "w").close()),
    "core_pattern": attempt(lambda: open("/proc/sys/kernel/core_pattern", "w").close()),
    "mount": attempt(lambda: os.listdir("/.template")),
    "caps": open("/proc/self/status").read().split("CapEff:")[1].split()[0],
    "no_new_privs": open("/proc/self/status").read().split("NoNewPrivs:")[1].split()[0],
}

def reset(seed):
    return AT_IMPORT

def step(action):
    status = open("/proc/self/status").read()
    return {
        "caps": status.split("CapEff:")[1].split()[0],
        "bounding": status.split("CapBnd:")[1].split()[0],
        "no_new_privs": status.split("NoNewPrivs:")[1].split()[0],
        "userns": attempt(unshare_user),
        "cgroup": open("/proc/self/cgroup").read(),
    }, 0.0, False, {}

serve(reset=reset, step=step)
"""


def test_no_privilege_before_env_code_runs(env_dir, spawn):
    directory = env_dir(IMPORT_PROBE)
    with RLPool(directory, 2, spawn=spawn) as pool:
        assert pool.spawn == spawn
        at_import = pool.reset(seed=0)[0]
        assert at_import["caps"] == "0000000000000000"
        if spawn == "template":  # bwrap sets no_new_privs only on the env's own exec
            assert at_import["no_new_privs"] == "1"
            assert at_import["mount"] == "EACCES"
        assert at_import["hidden"] in ("EACCES", "ENOENT")
        assert at_import["sysctl"] in ("EROFS", "EACCES", "EPERM")
        assert at_import["core_pattern"] in ("EROFS", "EACCES", "EPERM")
        obs, *_ = pool.step([0, 0])
        for o in obs:
            assert o["caps"] == o["bounding"] == "0000000000000000"
            assert o["no_new_privs"] == "1" or spawn == "exec"
            assert o["userns"] in ("ENOSPC", "EPERM", "EACCES"), o["userns"]  # no further user namespaces


def test_each_child_is_born_in_its_own_cgroup():
    with RLPool(PROBE, 3, spawn="template") as pool:
        check_cgroups(pool)


def check_cgroups(pool):
    from boltzlabs.host.cgroups import PoolView

    pool.reset(seed=0)
    view = PoolView(pool._cgroup)
    for i, pid in enumerate(pool.pids()):
        assert view.cgroup_of(pid) == view.group(i), (pid, view.cgroup_of(pid))
        # Its own pids cgroup whether or not it has a memory cgroup of its own.
        assert view.cgroup_of(pid, "pids") == view.group(i, "pids") and view.group(i, "pids").name == f"env-{i}"
    report = pool.memory()
    # The template's imported pages are the pool's, not env 0's.
    assert report.shared > 0
    assert max(report.per_env) < 2 * min(report.per_env) + (1 << 20)


def test_hard_reset_forks_a_fresh_child_from_the_pristine_template():
    with RLPool(PROBE, 2, spawn="template") as pool:
        check_hard_reset(pool)


def check_hard_reset(pool):
    pool.reset(seed=1)
    pool.step([{"op": "ws_write"}] * 2)
    pids = pool.pids()
    first = pool.reset(hard=True, seed=1)
    assert not set(pids) & set(pool.pids())
    assert first[0]["episodes"] == 1  # the template never ran reset: a fresh count
    obs, *_ = pool.step([{"op": "ws_read"}] * 2)
    assert "FileNotFoundError" in obs[0]["out"]["denied"]


UNFORKABLE_AT_IMPORT = [
    (
        "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n",
        "env.py's import started threads",
    ),
    ("import socket\nheld = socket.socketpair()\n", "env.py's import left sockets open"),
    # A process left running (here a daemon, reparented to the sandbox's init):
    # children would not have it, and the gate's freezer would not reach it.
    (
        "import os, time\nif os.fork() == 0:\n    if os.fork() == 0:\n        time.sleep(60)\n    os._exit(0)\n"
        "os.wait()\n",
        "env.py's import left processes running",
    ),
]
UNFORKABLE_SERVE = (
    "from boltzlabs.env import serve\nimport threading\n"
    "serve(reset=lambda seed: threading.active_count(), step=lambda a: (0, 1.0, False, {}))\n"
)


@pytest.mark.parametrize("source, reason", UNFORKABLE_AT_IMPORT)
def test_what_env_py_does_at_import_is_its_own_envs_business_in_the_zygote(env_dir, source, reason):
    """Threads, sockets and processes made at import cannot be forked; in the
    zygote env.py is imported by each env itself, once it is a sandbox, so
    each env has its own and the pool stays forked from the template."""
    directory = env_dir(source + UNFORKABLE_SERVE)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        pool = RLPool(directory, 2, spawn="template")
    with pool:
        assert pool.spawn == "template"
        counts = pool.reset(seed=0)
        assert pool.step([0, 0])[1].tolist() == [1.0, 1.0]
        if "threads" in reason:
            assert counts == [2, 2]  # each env started its own thread


@pytest.mark.parametrize("source, reason", UNFORKABLE_AT_IMPORT)
def test_an_unforkable_trusted_template_falls_back_to_exec_with_a_warning(env_dir, source, reason):
    directory = env_dir(source + UNFORKABLE_SERVE)
    with pytest.warns(RuntimeWarning, match=reason):
        pool = RLPool(directory, 2, spawn="template", trust_env=True)
    with pool:
        assert pool.spawn == "exec"
        pool.reset(seed=0)
        assert pool.step([0, 0])[1].tolist() == [1.0, 1.0]


def test_killing_the_template_fails_lanes_cleanly_and_reset_recovers():
    import psutil

    with RLPool(PROBE, 2, spawn="template", step_timeout=5) as pool:
        pool.reset(seed=0)
        worker = psutil.Process(pool._proc.pid)
        bwraps = [p for p in worker.children() if p.name() == "bwrap"]
        assert len(bwraps) == 1
        bwraps[0].kill()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and pool.states() != ["dead", "dead"]:
            time.sleep(0.05)
        _, rewards, dones, infos = pool.step([1, 1])
        assert dones.all() and "template" in infos[0]["error"]
        pool.reset(seed=0)  # a new template, new children
        result = pool.step([1, 1])
        assert result[1].tolist() == [1.0, 1.0], result


def test_exec_and_template_give_the_same_episodes():
    import msgpack

    episodes = []
    for spawn in ("exec", "template"):
        with RLPool(PROBE, 2, spawn=spawn) as pool:
            frames = [pool.reset(seed=7)]
            for _ in range(5):
                obs, rewards, dones, _ = pool.step([1, 2])
                frames.append([obs, rewards.tolist(), dones.tolist()])
            episodes.append(msgpack.packb(frames))
    assert episodes[0] == episodes[1]


THREADS_AND_FORKS = """
import os, random, threading, time
from boltzlabs.env import serve

def reset(seed):
    return random.random()  # unseeded: each env's own stream, as in exec mode

def step(action):
    names = []
    worker = threading.Thread(target=lambda: names.append(threading.current_thread().name), name="helper")
    worker.start()
    worker.join()
    sleeper = threading.Thread(target=time.sleep, args=(5,), daemon=True)
    sleeper.start()
    r, w = os.pipe()
    pid = os.fork()  # with a second thread alive: threading's after-fork hook must run
    if pid == 0:
        alive = len(threading.enumerate())
        main = threading.current_thread() is threading.main_thread()
        os.write(w, f"{alive} {main}".encode())
        os._exit(0)
    os.waitpid(pid, 0)
    return {"thread": names, "main": threading.current_thread() is threading.main_thread(),
            "threads": len(threading.enumerate()), "forked": os.read(r, 100).decode()}, 0.0, False, {}

serve(reset=reset, step=step)
"""


def test_threads_forks_and_random_in_an_env_work_as_in_exec_mode(env_dir, spawn):
    """The template skips threading's after-fork hook in its children (it has
    one thread, so the hook would only copy pages); env code must not notice."""
    with RLPool(env_dir(THREADS_AND_FORKS), 3, spawn=spawn) as pool:
        draws = pool.reset()
        assert len(set(draws)) == 3, f"unseeded random is the same in every env: {draws}"
        obs, _, _, infos = pool.step([0, 0, 0])
        for lane in range(3):
            assert "error" not in infos[lane], infos[lane]
            assert obs[lane] == {"thread": ["helper"], "main": True, "threads": 2, "forked": "1 True"}


SUPERBLOCKS = """
import os
from boltzlabs.env import serve

def reset(seed):
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    top = {m[4]: m[2] for m in mounts}  # the last mount on a path is the one in use
    own = {top[path] for path in ("/workspace", "/dev/shm", "/proc")}
    # What this child left in its tmpfs, and the pid its proc shows: a new
    # superblock of each after a hard reset shows neither.
    marked = os.path.exists("/workspace/marker")
    open("/workspace/marker", "w").close()
    return {"same": os.stat("/workspace").st_dev == os.stat("/dev/shm").st_dev, "devices": sorted(own),
            "marked": marked}

serve(reset=reset, step=lambda action: (0, 0.0, False, {}))
"""


def test_each_child_mounts_one_tmpfs_for_its_workspace_and_dev_shm(env_dir):
    """Every superblock an env mounts costs every memory cgroup on the host a
    slot (docs/hard-reset.md), so a child makes two: one tmpfs, one proc."""
    with RLPool(env_dir(SUPERBLOCKS), 2, spawn="template") as pool:
        for obs in pool.reset():
            assert obs["same"] is True
            assert len(obs["devices"]) == 2, obs  # the tmpfs and the proc
        assert pool.reset()[0]["marked"] is True  # a soft reset keeps the tmpfs
        # A new tmpfs per child. (Not compared by device number: a freed
        # anonymous device's number is reused, so the new child may get the old one.)
        after = pool.reset(hard=True)[0]
        assert after["marked"] is False and len(after["devices"]) == 2, after


SHARED_MAPPING = """
import ctypes, os
from boltzlabs.env import serve

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
PROT_READ, PROT_WRITE, MAP_SHARED, MAP_ANONYMOUS = 1, 2, 0x01, 0x20
# Made at import: in a template, every forked child would map the same pages.
# With PROT_READ only it is still writable later (mprotect): shared memory all the same.
ADDRESS = libc.mmap(None, 4096, {prot}, MAP_SHARED | MAP_ANONYMOUS, -1, 0)

def reset(seed):
    return 0

def step(action):
    if action is not None:
        if libc.mprotect(ctypes.c_void_p(ADDRESS), 4096, PROT_READ | PROT_WRITE) != 0:
            raise OSError(ctypes.get_errno(), "mprotect")
        ctypes.memmove(ADDRESS, action.encode().ljust(8), 8)
    return ctypes.string_at(ADDRESS, 8).rstrip(b"\\x00 ").decode(), 0.0, False, {{}}

serve(reset=reset, step=step)
"""


@pytest.mark.parametrize("prot", ["PROT_READ | PROT_WRITE", "PROT_READ"])
def test_a_shared_mapping_made_at_import_falls_back_to_exec_in_a_trusted_template(env_dir, prot):
    """A MAP_SHARED mapping in the template would be one memory for every lane,
    kept across hard resets: the pool must not fork such a template."""
    directory = env_dir(SHARED_MAPPING.format(prot=prot))
    with pytest.warns(RuntimeWarning, match=r"shared writable memory mapping \(anonymous shared memory"):
        pool = RLPool(directory, 2, spawn="template", trust_env=True)
    with pool:
        assert pool.spawn == "exec"
        check_lanes_apart(pool)


@pytest.mark.parametrize("prot", ["PROT_READ | PROT_WRITE", "PROT_READ"])
def test_a_shared_mapping_made_at_import_is_each_envs_own_in_the_zygote(env_dir, prot):
    """env.py's import runs in each env: its mapping is that env's alone."""
    with RLPool(env_dir(SHARED_MAPPING.format(prot=prot)), 2, spawn="template") as pool:
        assert pool.spawn == "template"
        check_lanes_apart(pool)


def check_lanes_apart(pool):
    pool.reset(seed=0)
    obs, *_ = pool.step(["lane0", None])
    assert obs == ["lane0", ""]
    obs, *_ = pool.step([None, "lane1"])
    assert obs == ["lane0", "lane1"]
    pool.reset(hard=True, where=[0])
    assert pool.step([None, None])[0] == ["", "lane1"]


FORGED_TEMPLATE_HANDSHAKE = """
import os
from boltzlabs import wire
from boltzlabs.env import serve

# Import-time code speaks first on the template's channel, from a process of
# its own that exits at once: its pid is free for the host to reuse.
pid = os.fork()
if pid == 0:
    os.write(int(os.environ["BOLTZLABS_FD"]),
             wire.encode([wire.HELLO, wire.PROTOCOL_VERSION, {"pid": 2, "forkable": True, "reason": ""}]))
    os._exit(0)
os.waitpid(pid, 0)

serve(reset=lambda seed: 0, step=lambda action: (0, 1.0, False, {}))
"""


def test_a_template_handshake_sent_by_another_process_moves_only_the_template(env_dir):
    """The worker moves the template into each env's cgroups around a fork, by
    pid. It once took that pid from the credentials of the first message on
    the template's channel: a process of import-time code was moved instead
    (a host process, once that pid is reused) and the envs were born in the
    template's cgroup. No pid is learnt from a message now, and a template
    that says HELLO twice has broken its protocol: it is given up. (Only a
    trusted template runs import-time code.)"""
    with pytest.warns(RuntimeWarning, match=r"the template failed .*HELLO"):
        pool = RLPool(env_dir(FORGED_TEMPLATE_HANDSHAKE), 2, spawn="template", trust_env=True)
    with pool:
        assert pool.spawn == "exec"
        pool.reset(seed=0)
        for i, pid in enumerate(pool.pids()):
            # Its own cgroup: the pids one on v1 (the envs share a memory
            # cgroup without a per-env memory limit), the one cgroup on v2.
            lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
            line = next((text for text in lines if ":pids:" in text), None) or next(
                text for text in lines if text.startswith("0::")
            )
            assert line.endswith(f"/env-{i}"), line
        assert pool.step([0, 0])[1].tolist() == [1.0, 1.0]


def test_the_worker_byte_compiles_what_every_sandbox_imports(tmp_path):
    """The package is read-only inside the sandboxes, which cannot write
    __pycache__; an env whose runtime has no .pyc compiles it in every
    template (measured: ~80 KiB more private memory per forked env). The
    worker compiles it on the host before the first spawn."""
    import importlib.util

    from boltzlabs.host.policy import PACKAGE_DIR

    source = PACKAGE_DIR / "runtime" / "serve.py"
    cached = Path(importlib.util.cache_from_source(str(source)))
    if not os.access(cached.parent if cached.parent.exists() else source.parent, os.W_OK):
        pytest.skip("the installed package is not writable here (a wheel carries its .pyc files)")
    cached.unlink(missing_ok=True)
    pool = RLPool(COUNTER, n=1)
    try:
        assert cached.exists(), "the worker did not byte-compile runtime/serve.py"
        pool.reset(seed=0)
    finally:
        pool.close()


def test_a_process_the_env_forks_imports_its_own_modules(env_dir):
    """The template's import guard (LibrariesOnly) steps aside in every env process: a child the
    env forks is pid 2 of the env's namespace, which can be the template's own number in its
    namespace, and must still import a module from the workspace (as a code action's does)."""
    source = env_dir("""
        import os, sys
        from boltzlabs.env import serve

        def step(action):
            with open("solution.py", "w") as f:
                f.write("ANSWER = 42\\n")
            read, write = os.pipe()
            child = os.fork()
            if child == 0:
                try:
                    sys.path.insert(0, os.getcwd())
                    import solution
                    os.write(write, f"{os.getpid()} {solution.ANSWER}".encode())
                except BaseException as exc:
                    os.write(write, f"{os.getpid()} {type(exc).__name__}: {exc}".encode())
                os._exit(0)
            os.close(write)
            said = os.read(read, 4096).decode()
            os.waitpid(child, 0)
            return 0, 0.0, False, {"child": said}

        serve(reset=lambda seed=None: 0, step=step)
    """)
    with RLPool(source, 1, spawn="template", step_timeout=scaled(10)) as pool:
        pool.reset()
        _, _, _, infos = pool.step([0])
        assert infos[0]["child"].split(" ", 1)[1] == "42", infos[0]
