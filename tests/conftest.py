"""Shared fixtures: real pools over real sandboxes; nothing is mocked."""

import contextlib
import fcntl
import functools
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from boltzlabs import RLPool

TESTS = Path(__file__).resolve().parent
PROBE = TESTS / "envs" / "probe"
COUNTER = TESTS.parent / "examples" / "counter"
# How much slower than this machine the tests run: ci/v2guest.sh's guest is
# emulated (QEMU TCG, ~10x) and sets BOLTZLABS_TIME_SCALE=10. Deadlines a test
# sets to catch a hang or a straggler are multiplied by it.
TIME_SCALE = float(os.environ.get("BOLTZLABS_TIME_SCALE") or 1)


# Test files that never build a sandbox (no pool, no bwrap): the lane state machine, the layout,
# the wire format, the C benchmarks' checks. Every other test is marked `sandbox`, and skips,
# saying why, on a host without bubblewrap or unprivileged user namespaces.
NO_SANDBOX = {"test_lanes.py", "test_layout.py", "test_wire.py", "test_benchmarks.py", "test_codec.py"}


# What bubblewrap says when the kernel refuses it a user namespace (sysctls, an LSM, a container):
# only these, and no bwrap at all, skip. Any other failure runs the tests, which then fail loudly:
# a loaded host's slow or failed bwrap must not turn the suite into skips.
_NO_USERNS = (
    "no permission to create",
    "operation not permitted",
    "permission denied",
    "user namespaces",
    "no space left on device",
    "creating new namespace failed",
)


@functools.cache
def sandbox_missing() -> str:
    """Why this host cannot build a sandbox ('' when it can, or when it is not sure): bubblewrap on
    PATH, and a user namespace it may make (what every sandbox starts with)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bubblewrap (bwrap) is not on PATH: apt-get install bubblewrap (`boltzlabs doctor` checks the host)"
    try:
        out = subprocess.run(
            [bwrap, "--unshare-user", "--ro-bind", "/", "/", "true"], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""  # not a missing feature: let the tests say what is wrong
    if out.returncode != 0 and any(words in out.stderr.lower() for words in _NO_USERNS):
        return (
            f"bubblewrap cannot make a user namespace here ({out.stderr.strip()[:200]}): enable unprivileged "
            "user namespaces (`boltzlabs doctor` says how)"
        )
    return ""


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name not in NO_SANDBOX and "sandbox" not in item.keywords:
            item.add_marker(pytest.mark.sandbox)


def pytest_runtest_setup(item):
    if item.get_closest_marker("sandbox") is not None and (why := sandbox_missing()):
        if os.environ.get("BOLTZLABS_REQUIRE_SANDBOX", "") not in ("", "0"):  # CI: a host that cannot is a failure
            pytest.fail(f"needs a sandbox, and BOLTZLABS_REQUIRE_SANDBOX is set: {why}", pytrace=False)
        pytest.skip(f"needs a sandbox: {why}")


def on_terminal(argv: list, until: str, timeout: float, stdout=subprocess.DEVNULL) -> str:
    """What `argv` writes to its stderr when that is a terminal of 24 x 80 (where tqdm draws a bar),
    read until `until` appears, the program closes the terminal, or `timeout` runs out; its stdout
    goes to `stdout` (a file)."""
    import pty
    import select
    import struct
    import termios
    import time

    master, slave = pty.openpty()
    # A bare pty has 0 columns, where tqdm draws nothing.
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    proc = subprocess.Popen(argv, stderr=slave, stdout=stdout, stdin=subprocess.DEVNULL)
    os.close(slave)
    out = b""
    deadline = time.monotonic() + timeout
    try:
        while until.encode() not in out:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([master], [], [], left)[0]:
                break
            try:
                chunk = os.read(master, 4096)
            except OSError:  # the program closed the terminal: it has ended
                break
            if not chunk:
                break
            out += chunk
        proc.wait(timeout=timeout)
    finally:
        proc.kill()
        os.close(master)
    return out.decode("utf-8", "replace")


def scaled(seconds: float) -> float:
    """`seconds` of this machine's time where the tests run now."""
    return seconds * TIME_SCALE


@contextlib.contextmanager
def host_lock(name: str):
    """Held by one test process on this host at a time (an flock in /tmp). CI runs the
    suite on both step paths at once (ci/test.sh); what two sessions must not do
    together takes one of these."""
    with open(f"/tmp/boltzlabs-tests-{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(autouse=True)
def _slow_tests_one_at_a_time(request):
    """A test marked `slow` (a 1000-env pool) holds the host: two of them at once, one
    per CI session, would share two cores between 2000 sandboxes."""
    if request.node.get_closest_marker("slow") is None:
        yield
        return
    with host_lock("slow"):
        yield


@pytest.fixture(params=["template", "exec"])
def spawn(request):
    """Both ways of making sandboxes: every test that takes it runs in each."""
    return request.param


@pytest.fixture
def pool_factory(spawn):
    """`pool_factory(source, n, **kwargs)` makes a pool in this test's spawn mode
    (5 s step_timeout unless given); every one is closed at the end of the test."""
    made = []

    def make(source, n=2, **kwargs):
        kwargs.setdefault("step_timeout", scaled(5.0))
        kwargs.setdefault("spawn", spawn)
        pool = RLPool(source, n, **kwargs)
        made.append(pool)
        return pool

    yield make
    for pool in made:
        pool.close()


@pytest.fixture
def probe_pool(pool_factory):
    """A factory of probe pools, every one closed at the end of the test."""
    return lambda n=2, **kwargs: pool_factory(PROBE, n, **kwargs)


@pytest.fixture
def env_dir(tmp_path):
    """Write an env.py from source text; returns its directory."""
    counter = [0]

    def make(source: str) -> Path:
        counter[0] += 1
        directory = tmp_path / f"env{counter[0]}"
        directory.mkdir()
        (directory / "env.py").write_text(textwrap.dedent(source))
        return directory

    return make


def env_class(directory: Path, name: str):
    """The class `name` of a test env's env.py, imported in this process (for
    SyncVectorEnv beside the pool); the file serves only when run as a script."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"boltzlabs_test_{directory.name}", directory / "env.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def gone(pids) -> bool:
    """No process of `pids` is running (a zombie has ended: only its entry is left)."""
    import psutil

    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return True


def wait_until(predicate, timeout: float = 15.0) -> bool:
    """Poll `predicate` until it is true, at most `timeout` seconds of this machine's time (scaled):
    its last answer. The timeout only catches a hang."""
    import time

    deadline = time.monotonic() + scaled(timeout)
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return bool(predicate())


def open_fds() -> set:
    return set(os.listdir("/proc/self/fd"))


def has_ended(process) -> bool:
    """Whether a psutil.Process has exited (a zombie has)."""
    import psutil

    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def intervals(obs) -> list:
    """(start, end) of each probe {"op": "interval"} result, sorted by start."""
    return sorted((o["out"]["start"], o["out"]["end"]) for o in obs)


def overlaps(spans) -> bool:
    """Whether any two of the sorted intervals overlap."""
    return any(b[0] < a[1] for a, b in zip(spans, spans[1:]))


def two_node_ray_cluster():
    """A real two-node Ray cluster on this host (Ray's cluster_utils), every node
    127.0.0.1, and this process connected to it: a generator for a fixture."""
    # Ray swaps a loopback address for the machine's interface address unless
    # told this is a single-host setup.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "object_store_memory": 100 << 20}
    # One Ray cluster on this host at a time: CI runs the suite on both step paths at
    # once (ci/test.sh), and two clusters would race for Ray's default ports and
    # /tmp/ray, and starve each other's raylets of the two cores.
    with host_lock("ray"):
        c = Cluster(initialize_head=True, head_node_args=dict(node, include_dashboard=False))
        try:
            c.add_node(**node)
            ray.init(address=c.address, _node_ip_address="127.0.0.1", logging_level="ERROR", log_to_driver=False)
            yield c
        finally:
            ray.shutdown()
            c.shutdown()


def with_hierarchy_read_only(mount, code: str) -> str:
    """Run Python `code` in a private mount namespace where the cgroup hierarchy mounted at `mount`
    is read-only (the kernel, not a mock, refuses the worker's writes there); its stdout, stripped."""
    script = f'mount --make-rprivate / && mount -o remount,bind,ro {mount} && exec {sys.executable} -c "$0"'
    out = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, code], capture_output=True, text=True, timeout=scaled(120)
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def run_benchmark(name: str, *args: str, timeout: float = 120) -> str:
    """Run benchmarks/<name> with `args` (a smoke run at a small size); its stdout, once it has
    exited 0 (the benchmark's own checks passed) within `timeout` seconds (scaled)."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / name
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=scaled(timeout))
    assert done.returncode == 0, done.stderr
    return done.stdout
