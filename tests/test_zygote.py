"""The template is a zygote: it runs no code of the env's author (issue 25).

Each test is an attack of an outside review (round three), written from its
description: env.py's import-time code, its at-fork hooks, its warm-up probe
and a hostile trusted template. Every one held before the zygote; each is
refused now, in both spawn modes where it applies, and trusted mode
(RLPool(trust_env=True): env.py imported in the template) keeps the limits
that can still hold there.
"""

import time
import warnings
from pathlib import Path

import psutil
import pytest

from boltzlabs import RLPool
from boltzlabs.errors import EnvStartError

MiB = 1 << 20


def quietly(make):
    """make() with the pool's RuntimeWarnings (an exec fallback, a failed probe) kept out of the way."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return make()


def template_process(pool) -> psutil.Process:
    """The template process of a template pool: the worker's bwrap -> its init -> the template."""
    worker = psutil.Process(pool._proc.pid)
    bwrap = next(p for p in worker.children() if p.name() == "bwrap")
    init = bwrap.children()[0]
    return init.children()[0]


# -- 1, 2: import-time memory ------------------------------------------------------------

BIG_IMPORT = """
from boltzlabs.env import serve

held = bytearray(640 << 20)
held[::4096] = b"\\x01" * (len(held) // 4096)  # every page touched: every page charged

serve(reset=lambda seed: 0, step=lambda action: (0, 0.0, False, {}))
"""


@pytest.mark.parametrize("trust_env", [False, True], ids=["zygote", "trusted"])
def test_memory_made_at_import_is_held_to_the_memory_limit(env_dir, trust_env):
    """640 MiB at import with memory_limit="128M": the template once held it all,
    in a cgroup with no limit. In the zygote the import runs in each env, under
    its limit; a trusted template's cgroup has the env's limit too."""
    directory = env_dir(BIG_IMPORT)
    with pytest.raises(EnvStartError, match="OOM"):
        quietly(lambda: RLPool(directory, 2, memory_limit="128M", trust_env=trust_env, start_timeout=60))


def test_a_remote_workers_memory_ceiling_holds_the_import_too(env_dir, tmp_path):
    """The same through `boltzlabs worker --max-memory 128M`: the ceiling is the
    pool's memory limit, and it binds whatever runs the env's code."""
    from test_remote import Worker

    directory = env_dir(BIG_IMPORT)
    (tmp_path / "remote").mkdir()
    worker = Worker(tmp_path / "remote", "--max-memory", "128M")
    try:
        with pytest.raises(EnvStartError, match="OOM"):
            quietly(lambda: worker.pool(directory, 2, spawn="template"))
    finally:
        worker.stop()


# -- 3: the probe's shared memory ------------------------------------------------------------

SHARED_IN_RESET = """
import mmap
from boltzlabs.env import serve

held = []

def reset(seed):
    if seed == 0:  # the warm-up probe's reset(0); the pool's envs below reset with seed 1
        area = mmap.mmap(-1, 640 << 20, flags=mmap.MAP_SHARED)
        for offset in range(0, len(area), 4096):
            area[offset] = 1
        held.append(area)
    return 1

serve(reset=reset, step=lambda action: (0, 0.0, False, {}))
"""


def test_the_probe_is_held_to_the_memory_limit_even_for_shared_memory(env_dir):
    """MAP_SHARED pages escape RLIMIT_DATA, which was all that held the probe:
    it now runs in a cgroup of its own with the env's memory limit."""
    pool = quietly(lambda: RLPool(env_dir(SHARED_IN_RESET), 2, spawn="template", memory_limit="128M"))
    with pool:
        report = pool.env_contract["warmup"]
        assert "OOM" in report["error"], report
        assert pool.reset(seed=1) == [1, 1]
        assert pool.memory().shared < 128 * MiB  # the template holds none of it


# -- 4: a hostile template's control channel -----------------------------------------------

EXITED_FLOOD = """
import os
from boltzlabs import wire
from boltzlabs.env import serve
import boltzlabs.runtime.template as template

# Import-time code of a trusted template answers every FORK with EXITED frames
# for the lane being forked (60 KB each), never FORKED.
def flood(main, index, fds, plan, slot=-1):
    for fd in fds:
        os.close(fd)
    frame = wire.encode([wire.EXITED, index, 1, "x" * 60000])
    while True:  # until the worker stops reading
        os.write(3, frame)  # the control socket

template._fork_child = flood

serve(reset=lambda seed: 0, step=lambda action: (0, 0.0, False, {}))
"""


def test_a_template_that_breaks_its_control_protocol_is_given_up_at_once(env_dir):
    """Only what is due is taken from the template's control channel (one FORKED
    per fork asked for, one EXITED per child): the first frame that is not
    ends it, named, and the worker keeps none of it."""
    started = time.monotonic()
    with pytest.raises(EnvStartError, match=r"the template failed: it sent \[EXITED"):
        quietly(
            lambda: RLPool(env_dir(EXITED_FLOOD), 2, spawn="template", trust_env=True, warmup=False, start_timeout=120)
        )
    assert time.monotonic() - started < 60  # not the start timeout


# -- 5: user namespaces made by import-time code ---------------------------------------

USERNS_HOARD = """
import ctypes, os
from boltzlabs.env import serve

libc = ctypes.CDLL(None, use_errno=True)

def hoard(limit):
    # A helper per namespace: it makes one and waits; an fd on it keeps it alive.
    held = []
    for _ in range(limit):
        ready_r, ready_w = os.pipe()
        go_r, go_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            os.close(go_w)
            os.write(ready_w, b"1" if libc.unshare(0x10000000) == 0 else b"0")  # CLONE_NEWUSER
            os.read(go_r, 1)
            os._exit(0)
        os.close(ready_w)
        os.close(go_r)
        made = os.read(ready_r, 1) == b"1"
        if made:
            held.append(os.open(f"/proc/{pid}/ns/user", os.O_RDONLY))
        os.close(go_w)
        os.close(ready_r)
        os.waitpid(pid, 0)
        if not made:
            break
    for fd in held:
        os.close(fd)
    return len(held)

MADE = hoard(200)  # at import: in a trusted template, in the template itself

serve(reset=lambda seed: MADE, step=lambda action: (hoard(8), 0.0, False, {}))
"""


@pytest.mark.parametrize("trust_env", [False, True], ids=["zygote", "trusted"])
def test_import_time_code_cannot_hoard_user_namespaces(env_dir, trust_env):
    """Every namespace counts against the sandboxes' host account. A trusted
    template's import once made 600 in 4 s; now its own user namespace has
    quotas: what all its children may make together (4 n + 64 of each kind).
    In the zygote the import runs in the env, whose quota is 0."""
    n = 2
    with RLPool(env_dir(USERNS_HOARD), n, spawn="template", trust_env=trust_env) as pool:
        made = pool.reset(seed=0)
        if trust_env:
            assert all(0 < m <= 4 * n + 64 for m in made), made
        else:
            assert made == [0] * n
        obs, *_ = pool.step([0] * n)
        assert obs == [0] * n  # and none in a step


# -- 6, 9: at-fork hooks ---------------------------------------------------------------

AT_FORK_SHARED = """
import mmap, os
from boltzlabs.env import serve

AREA = []

def share():  # a MAP_SHARED mapping made just before a fork: every child would have it
    if not AREA:
        AREA.append(mmap.mmap(-1, 4096, flags=mmap.MAP_SHARED))

os.register_at_fork(before=share)

def area():
    if not AREA:
        AREA.append(mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE))
    return AREA[0]

def step(action):
    if action is not None:
        area()[:8] = action.encode().ljust(8)
    return area()[:8].rstrip(b"\\x00 ").decode(), 0.0, False, {}

serve(reset=lambda seed: 0, step=step)
"""


def test_a_shared_mapping_an_at_fork_hook_makes_reaches_no_other_lane(pool_factory, env_dir):
    pool = pool_factory(env_dir(AT_FORK_SHARED), 2)
    assert pool.spawn in ("template", "exec")
    pool.reset(seed=0)
    obs, *_ = pool.step(["lane0", None])
    assert obs == ["lane0", ""]
    pool.reset(hard=True, seed=0)
    obs, *_ = pool.step(["again", None])
    assert obs == ["again", ""]


AT_FORK_TAMPER = """
import ctypes, os
from boltzlabs.env import serve

MARK = ctypes.create_string_buffer(b"pristine", 16)

def tamper(pid_holder=[]):
    # After each fork, in the parent: write into the new child's memory.
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) not in (1, os.getpid()):
            try:
                with open(f"/proc/{name}/mem", "r+b", buffering=0) as mem:
                    mem.seek(ctypes.addressof(MARK))
                    mem.write(b"tampered")
            except OSError:
                pass

os.register_at_fork(after_in_parent=tamper)

serve(reset=lambda seed: MARK.value.decode(), step=lambda action: (MARK.value.decode(), 0.0, False, {}))
"""


def test_an_at_fork_hook_cannot_write_into_a_lanes_memory(pool_factory, env_dir):
    """Code in the template keeps every capability over each child's user
    namespace: an after-fork hook left by import-time code opened every
    lane's /proc/<pid>/mem read-write. The zygote never runs it."""
    pool = pool_factory(env_dir(AT_FORK_TAMPER), 2)
    assert pool.reset(seed=0) == ["pristine", "pristine"]
    assert pool.reset(seed=0, hard=True) == ["pristine", "pristine"]
    assert pool.step([0, 0])[0] == ["pristine", "pristine"]


# -- 7: the template during a gated turn ------------------------------------------------

TEMPLATE_THREAD = """
import os, threading, time
from boltzlabs.env import serve

STAMPS = "/workspace/stamps"  # the template's own workspace

def tick():
    fd = os.open(STAMPS, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    while True:
        os.write(fd, f"{time.monotonic_ns()}\\n".encode())
        time.sleep(0.001)

def start_thread():  # after a fork, in the template: a thread that keeps running there
    if not any(t.name == "tick" for t in threading.enumerate()):
        threading.Thread(target=tick, name="tick", daemon=True).start()

os.register_at_fork(after_in_parent=start_thread)

def step(action):
    begun = time.monotonic_ns()
    while time.monotonic_ns() - begun < 150_000_000:  # 150 ms of the env's own, measured work
        pass
    return [begun, time.monotonic_ns()], 0.0, False, {}

serve(reset=lambda seed: 0, step=step)
"""


def test_nothing_outside_the_served_env_runs_during_a_gated_turn(env_dir):
    """serialize_measurement: a thread an at-fork hook started in a trusted
    template ran during other lanes' turns; the template is frozen during
    every turn now, like every env that is not being served."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pool = RLPool(
            env_dir(TEMPLATE_THREAD),
            2,
            spawn="template",
            trust_env=True,
            warmup=False,
            serialize_measurement=True,
            step_timeout=10,
        )
    with pool:
        if any("cannot freeze" in str(w.message) for w in caught):
            pytest.skip("no freezer on this host")
        assert pool.spawn == "template"
        stamps_path = Path(f"/proc/{template_process(pool).pid}/root/workspace/stamps")
        pool.reset(seed=0)
        turns = []
        for _ in range(3):
            obs, *_ = pool.step([0, 0])
            turns += obs
        time.sleep(0.3)  # no turn: the template runs
        stamps = [int(line) for line in stamps_path.read_text().split()]
        assert len(stamps) > 20  # the thread runs, outside turns
        inside = [t for t in stamps if any(begun < t < ended for begun, ended in turns)]
        assert not inside, f"{len(inside)} of the template's stamps fell inside gated turns"


# -- 8: output at import ---------------------------------------------------------------------

LOUD_IMPORT = """
import os
from boltzlabs.env import serve

os.write(1, b"x" * (256 << 10) + b"\\nend of the import's output\\n")

serve(reset=lambda seed: 0, step=lambda action: (0, 1.0, False, {}))
"""


@pytest.mark.parametrize("trust_env", [False, True], ids=["zygote", "trusted"])
def test_output_at_import_never_stalls_the_start(env_dir, spawn, trust_env):
    """256 KiB printed at import blocked the template on its log pipe (the pool
    started after 41 s, in exec mode): every start-up drains what it prints."""
    if spawn == "exec" and trust_env:
        pytest.skip("trust_env is template mode's")
    started = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        pool = RLPool(env_dir(LOUD_IMPORT), 2, spawn=spawn, trust_env=trust_env, start_timeout=30)
    with pool:
        assert pool.spawn == spawn
        assert time.monotonic() - started < 25  # far from the start timeout
        pool.reset(seed=0)
        assert pool.step([0, 0])[1].tolist() == [1.0, 1.0]
        if not trust_env:
            assert "end of the import's output" in pool.log(0)


# -- 9: runtime patched to skip confinement: the outside check -------------------------

SKIP_FILTER = """
import boltzlabs.runtime.filter as seccomp
from boltzlabs.env import serve

seccomp._child_program = type("Nothing", (), {"load": lambda self: None})()  # children skip the env's filter

serve(reset=lambda seed: 0, step=lambda action: (0, 0.0, False, {}))
"""

SKIP_NAMESPACES = """
import boltzlabs.runtime.template as template
from boltzlabs.env import serve

# Children keep the template's IPC namespace (SysV objects shared by every lane).
template._NAMESPACE_FLAGS = tuple((name, flag) for name, flag in template._NAMESPACE_FLAGS if name != "ipc")

serve(reset=lambda seed: 0, step=lambda action: (0, 0.0, False, {}))
"""


@pytest.mark.parametrize(
    "source, problem",
    [
        (SKIP_FILTER, r"1 seccomp filter\(s\) attached where the policy loads 2"),
        (SKIP_NAMESPACES, r"shares its ipc namespace with the template"),
    ],
    ids=["seccomp", "namespaces"],
)
def test_a_lane_that_is_not_confined_is_refused_by_the_check_from_outside(env_dir, source, problem):
    """Import-time code of a trusted template patched the runtime so that
    children skipped their own seccomp filter (1 filter where a benign lane
    has 2) or namespaces. The worker reads each lane's /proc/<pid>/status
    and /proc/<pid>/ns/* before its first request and refuses it, named."""
    directory = env_dir(source)
    with pytest.raises(EnvStartError, match=r"env \d failed to start: failed the confinement check.*" + problem):
        quietly(lambda: RLPool(directory, 2, spawn="template", trust_env=True, warmup=False))


PROBE_SKIPS_FILTER = """
import os
import boltzlabs.runtime.filter as seccomp
from boltzlabs.env import serve

real = seccomp._child_program
FORKS = [0]
os.register_at_fork(before=lambda: FORKS.__setitem__(0, FORKS[0] + 1))  # counted in the template

class FirstChildSkips:  # the first child forked (the warm-up probe) skips the env's filter
    def load(self):
        if FORKS[0] > 1:
            real.load()

seccomp._child_program = FirstChildSkips()

serve(reset=lambda seed: 0, step=lambda action: (0, 0.0, False, {}))
"""


def test_a_probe_that_is_not_confined_is_refused_by_the_check_from_outside(env_dir):
    """The probe runs env code like an env and is checked like one, once it
    has reported: a report from a process that fails the check is not used."""
    with pytest.warns(RuntimeWarning, match=r"the probe failed the confinement check and was killed: 1 seccomp"):
        pool = RLPool(env_dir(PROBE_SKIPS_FILTER), 2, spawn="template", trust_env=True)
    with pool:
        report = pool.env_contract["warmup"]
        assert "confinement check" in report["error"] and report["modules"] == [], report
        assert pool.reset(seed=0) == [0, 0]  # its lanes load their filter: they pass


def test_a_confined_lane_passes_the_check_in_both_modes(pool_factory):
    """The check passes every lane that is what the policy says (here, every
    lane of the example env), after hard resets too, and nothing else of the
    pool changes."""
    from conftest import COUNTER

    pool = pool_factory(COUNTER, 3)
    assert pool.reset(seed=0) == [{"t": 0}] * 3
    assert pool.reset(seed=0, hard=True) == [{"t": 0}] * 3


# -- trust is the worker's to give -----------------------------------------------------------


def test_a_remote_worker_refuses_trust_env_unless_its_operator_allows_it(env_dir, tmp_path):
    from conftest import COUNTER
    from test_remote import Worker

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    closed = Worker(tmp_path / "a")
    try:
        with pytest.raises(ValueError, match="trust_env=True is refused.*--allow-trust-env"):
            closed.pool(COUNTER, 2, trust_env=True)
    finally:
        closed.stop()
    opened = Worker(tmp_path / "b", "--allow-trust-env")
    try:
        with opened.pool(COUNTER, 2, trust_env=True) as pool:
            assert pool.spawn == "template"
            assert pool.reset(seed=0) == [{"t": 0}] * 2
    finally:
        opened.stop()


# -- what the template imports --------------------------------------------------------------


def test_the_template_never_imports_the_envs_own_modules(env_dir):
    """A module of the env's directory, and env.py itself, are imported by each
    env, never by the template, even when the probe names them (a probe's
    report is env code's) or the pool's preload list does."""
    directory = env_dir("""
import sys
import helper
from boltzlabs.env import serve
serve(reset=lambda seed: [helper.WHERE, sorted(m for m in ("helper", "json") if m in sys.modules)],
      step=lambda action: (0, 0.0, False, {}), preload=["helper", "json"])
""")
    (directory / "helper.py").write_text("import time\nWHERE = time.monotonic_ns()\nimport json\n")
    pool = quietly(lambda: RLPool(directory, 2, spawn="template", preload=["helper", "colorsys"]))
    with pool:
        report = pool.env_contract["warmup"]
        assert "helper" not in report["imported"] and "helper" not in report["modules"], report
        assert "the env's directory has its own 'helper'" in report["failed"]["helper"]
        assert {"json", "colorsys"} <= set(report["imported"])
        first = pool.reset(seed=0)
        assert first[0][0] != first[1][0]  # each env imported helper itself, at a time of its own
        assert all(obs[1] == ["helper", "json"] for obs in first)
        template = template_process(pool)
        maps = Path(f"/proc/{template.pid}/maps").read_text()
        assert "/env/" not in maps


PRELOAD_FILE = """
import sys
from boltzlabs.env import serve
serve(reset=lambda seed: ["colorsys" in sys.modules, "xml.dom.minidom" in sys.modules],
      step=lambda action: (0, 0.0, False, {}))
"""


def test_preload_comes_from_the_pool_and_from_boltzlabs_toml(env_dir):
    directory = env_dir(PRELOAD_FILE)
    (directory / "boltzlabs.toml").write_text('[boltzlabs]\npreload = ["xml.dom.minidom"]\n')
    with RLPool(directory, 2, spawn="template", warmup=False, preload=["colorsys"]) as pool:
        report = pool.env_contract["warmup"]
        assert report["preload"] == ["colorsys", "xml.dom.minidom"]
        assert pool.reset(seed=0) == [[True, True]] * 2
    with RLPool(directory, 2, spawn="template", warmup=False) as pool:
        assert pool.reset(seed=0) == [[False, True]] * 2


@pytest.mark.parametrize(
    "text, error",
    [
        ("[boltzlabs]\npreload = 'colorsys'\n", "must be a list of module names"),
        ("[boltzlabs]\npreload = ['../../etc/passwd']\n", "is not a module name"),
        ("[boltzlabs\n", "is not valid TOML"),
        ("#" * 70000, "is over 65536 bytes"),
    ],
)
def test_a_bad_boltzlabs_toml_is_a_clear_error_before_anything_starts(env_dir, text, error):
    directory = env_dir(PRELOAD_FILE)
    (directory / "boltzlabs.toml").write_text(text)
    with pytest.raises(ValueError, match=error):
        RLPool(directory, 1, spawn="template")


def test_a_boltzlabs_toml_that_is_a_link_is_refused(env_dir, tmp_path):
    directory = env_dir(PRELOAD_FILE)
    (tmp_path / "elsewhere.toml").write_text("[boltzlabs]\npreload = ['colorsys']\n")
    (directory / "boltzlabs.toml").symlink_to(tmp_path / "elsewhere.toml")
    with pytest.raises(ValueError, match="plain file"):
        RLPool(directory, 1, spawn="template")


def test_preload_names_are_checked_before_anything_starts():
    from conftest import COUNTER

    with pytest.raises(TypeError, match="preload must be a list"):
        RLPool(COUNTER, 1, preload="colorsys")
    with pytest.raises(ValueError, match="is not a module name"):
        RLPool(COUNTER, 1, preload=["os; rm -rf /"])
    with pytest.raises(TypeError, match="trust_env must be True or False"):
        RLPool(COUNTER, 1, trust_env="yes")


# -- what a sandbox's pid 1 shows ----------------------------------------------------------

CMDLINE = """
from boltzlabs.env import serve

def reset(seed):
    with open("/proc/1/cmdline", "rb") as f:
        return f.read().decode("utf-8", "replace")

serve(reset=reset, step=lambda action: (0, 0.0, False, {}))
"""


def test_the_sandboxs_pid_1_shows_no_host_path_nor_the_plan(pool_factory, env_dir):
    """In exec mode /proc/1 is bwrap's init, a fork of bwrap: its command line
    named every host bind source, the worker's host pid, the whole
    confinement plan and the params. bwrap now reads its options from an fd:
    what is left is the command (the interpreter, its flags, /env/env.py)."""
    directory = env_dir(CMDLINE)
    pool = pool_factory(directory, 2, seed_param="secret-param")
    for cmdline in pool.reset(seed=0):
        args = cmdline.split("\0")
        assert str(directory) not in cmdline and "BOLTZLABS_CONFINE" not in cmdline, args
        assert "secret-param" not in cmdline and "--ro-bind" not in args and "--setenv" not in args, args
        assert str(pool._proc.pid) not in args, args
        assert "/env/env.py" in args, args


# -- env.py's code, compiled once by the probe ------------------------------------------

FORGED_CODE = """
import os
from boltzlabs import wire
from boltzlabs.env import serve

if os.environ.get("BOLTZLABS_PROBE"):  # in the warm-up probe: a report of its own making
    os.write(3, wire.encode([wire.PROBED, [], 0, 0, 0, 0, None, [], {code}]))
    os._exit(0)

serve(reset=lambda seed: "env.py ran", step=lambda action: (0, 0.0, False, {{}}))
"""

OTHER_ENV = (
    "from boltzlabs.env import serve\n"
    "serve(reset=lambda seed: 'the code the probe sent ran', step=lambda action: (0, 0.0, False, {}))\n"
)


@pytest.mark.parametrize(
    "code, expected",
    [
        ("b'\\x00not marshal data' * 100", "env.py ran"),
        (f"__import__('marshal').dumps(compile({OTHER_ENV!r}, '/env/env.py', 'exec'))", "the code the probe sent ran"),
        ("b'x' * ((4 << 20) + 1)", "env.py ran"),
    ],
    ids=["garbage", "other-code", "too-big"],
)
def test_env_code_the_probe_sends_is_only_ever_read_by_the_envs(env_dir, code, expected):
    """The probe compiles env.py once and sends it marshalled; the template keeps
    the bytes unread and each env unmarshals them (less memory than compiling
    env.py itself). Bytes that do not unmarshal to code: each env compiles
    env.py. Other code: it runs in each env, a sandbox checked from outside,
    as env.py's author's (the probe runs env.py). Over 4 MiB: the report is
    refused."""
    pool = quietly(lambda: RLPool(env_dir(FORGED_CODE.format(code=code)), 2, spawn="template"))
    with pool:
        report = pool.env_contract["warmup"]
        if "4 << 20" in code:
            assert "no valid report" in report["error"], report
        else:
            assert report["error"] is None, report
        assert pool.reset(seed=1) == [expected] * 2


WHAT_THE_TEMPLATE_HOLDS = """
import sys
from boltzlabs.env import serve

AT_IMPORT = sorted(name for name in ("traceback", "linecache", "re") if name in sys.modules)

serve(reset=lambda seed: AT_IMPORT, step=lambda action: (0, 0.0, False, {}))
"""


def test_the_templates_warm_up_of_the_serve_loop_takes_no_failure_path(env_dir):
    """The template runs the serve loop once with stand-in callables, to settle
    its bytecode before the forks. A stand-in that did not fit the loop's
    calls made every warm-up request fail: the template imported traceback
    (with re, linecache, tokenize...) and every env started ~0.2 MiB heavier."""
    with RLPool(env_dir(WHAT_THE_TEMPLATE_HOLDS), 2, spawn="template") as pool:
        assert pool.reset(seed=0) == [[], []]
