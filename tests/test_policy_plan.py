"""The policy is compiled once and both spawn modes follow it (issue #15, "Policy compiled once").

Each test writes an operator policy (BOLTZLABS_POLICY: a copy of the shipped
sandbox/policy.toml with one change), starts a real pool in each spawn mode
and asks the env what its sandbox is: namespaces (compared by inode with this
process's, which shares the worker's and the host's), hostname, workspace
size (statvfs). A mode that falls back to the other would prove nothing, so
each test checks `pool.spawn` too.
"""

import os
import re
from pathlib import Path

import pytest

from boltzlabs import RLPool
from boltzlabs.errors import EnvStartError, SandboxUnavailable

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = (ROOT / "sandbox" / "policy.toml").read_text()

FACTS = """
import ctypes
import os
from boltzlabs.env import serve

libc = ctypes.CDLL(None, use_errno=True)

def unshare_user():
    # 0 if this env could make a user namespace of its own (it must not), else the errno.
    return 0 if libc.unshare(0x10000000) == 0 else ctypes.get_errno()

def wrote():
    with open("probe", "w") as f:
        f.write("x")
    return os.stat("probe").st_uid

def facts():
    workspace, shm = os.statvfs(os.getcwd()), os.statvfs("/dev/shm")
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {
        "cap_eff": int(status["CapEff"], 16),
        "sys_read_only": bool(os.statvfs("/proc/sys").f_flag & os.ST_RDONLY),
        "unshare_user": unshare_user(),
        "wrote_as": wrote(),
        "ns": {kind: os.readlink(f"/proc/self/ns/{kind}") for kind in ("net", "ipc", "uts", "cgroup")},
        "hostname": os.uname().nodename,
        "cwd": os.getcwd(),
        "workspace": workspace.f_blocks * workspace.f_frsize,
        "shm": shm.f_blocks * shm.f_frsize,
        "uid": os.getuid(),
        "gid": os.getgid(),
    }

def reset(seed):
    return facts()

def step(action):
    return facts(), 0.0, False, {}

serve(reset=reset, step=step)
"""


def _host_ns(kind: str) -> str:
    return os.readlink(f"/proc/self/ns/{kind}")


@pytest.fixture
def policy(tmp_path, monkeypatch):
    """`policy((pattern, replacement), ...)`: the shipped policy with each
    regex substitution made (each must match), in force for this test."""

    def write(*changes) -> Path:
        text = SHIPPED
        for pattern, replacement in changes:
            text, count = re.subn(pattern, replacement, text, count=1, flags=re.M)
            assert count == 1, f"the shipped policy has no line matching {pattern!r}"
        path = tmp_path / "policy.toml"
        path.write_text(text)
        monkeypatch.setenv("BOLTZLABS_POLICY", str(path))
        return path

    return write


@pytest.fixture
def facts_env(env_dir):
    return env_dir(FACTS)


def _facts(directory, spawn, n=2, **kwargs):
    """Each env's facts, at reset and after a step, and after a hard reset (a fresh sandbox)."""
    with RLPool(directory, n, spawn=spawn, step_timeout=10, **kwargs) as pool:
        assert pool.spawn == spawn, f"the pool fell back to spawn={pool.spawn!r}"
        seen = list(pool.reset(seed=0))
        seen += pool.step([0] * n)[0]
        seen += pool.reset(seed=0, hard=True)
    return seen


def _confined(facts: dict, uid: int, gid: int) -> None:
    """What every env is, whatever its ids: those ids, no capability, a read-only
    /proc/sys, no user namespace of its own, a workspace it writes as itself."""
    assert (facts["uid"], facts["gid"]) == (uid, gid), facts
    assert facts["cap_eff"] == 0, facts
    assert facts["sys_read_only"], facts
    assert facts["unshare_user"] != 0, facts
    assert facts["wrote_as"] == uid, facts


def test_shipped_policy_unshares_every_namespace(facts_env, spawn):
    """The control: with the shipped policy no env shares a namespace with the host."""
    for seen in _facts(facts_env, spawn):
        for kind, link in seen["ns"].items():
            assert link != _host_ns(kind), (kind, seen)
        assert seen["hostname"] == "boltzlabs"
        assert seen["workspace"] == 64 << 20 and seen["cwd"] == "/workspace"
        _confined(seen, 0, 0)


def test_identity_uid_and_gid_follow_the_policy(facts_env, spawn, policy):
    """[identity] uid and gid other than 0 (software that refuses to run as
    root): the env is that uid and gid, confined as any env is. Both modes
    failed to start before (bubblewrap's --uid made the set-up's mounts fail)."""
    policy((r"^uid = 0$", "uid = 1000"), (r"^gid = 0$", "gid = 1001"))
    seen = _facts(facts_env, spawn)
    assert len(seen) == 6
    for facts in seen:
        _confined(facts, 1000, 1001)
        assert facts["workspace"] == 64 << 20 and facts["cwd"] == "/workspace"


def test_no_net_namespace_when_the_policy_drops_it(facts_env, spawn, policy):
    policy((r"^unshare = \[.*\]$", 'unshare = ["user", "pid", "ipc", "uts", "cgroup"]'))
    seen = _facts(facts_env, spawn)
    for facts in seen:
        assert facts["ns"]["net"] == _host_ns("net"), facts
        assert facts["ns"]["ipc"] != _host_ns("ipc") and facts["ns"]["uts"] != _host_ns("uts")
    # Sandboxes of one pool: separate ipc namespaces, still (and one shared net: the host's).
    assert len({facts["ns"]["ipc"] for facts in seen[:2]}) == 2


def test_ipc_and_cgroup_namespaces_follow_the_policy(facts_env, spawn, policy):
    policy((r"^unshare = \[.*\]$", 'unshare = ["user", "pid", "net", "uts"]'))
    for facts in _facts(facts_env, spawn):
        assert facts["ns"]["net"] != _host_ns("net")
        # The env shares its ipc and cgroup namespaces with its sandbox's
        # creator: the host's in exec mode, the template's (so the host's:
        # its bwrap did not unshare them either) in template mode.
        assert facts["ns"]["ipc"] == _host_ns("ipc"), facts
        assert facts["ns"]["cgroup"] == _host_ns("cgroup"), facts


def test_only_the_required_namespaces(facts_env, spawn, policy):
    """Only "user" and "pid", no hostname: no child unshares net, ipc, uts or
    cgroup, brings up a loopback or names a host (each would fail without
    its namespace), in either mode."""
    policy((r"^unshare = \[.*\]$", 'unshare = ["user", "pid"]'), (r"^hostname = .*$", 'hostname = ""'))
    for facts in _facts(facts_env, spawn):
        for kind in ("net", "ipc", "uts", "cgroup"):
            assert facts["ns"][kind] == _host_ns(kind), (kind, facts)
        assert facts["hostname"] == os.uname().nodename


def test_hostname_follows_the_policy(facts_env, spawn, policy):
    policy((r"^hostname = .*$", 'hostname = "operator-box"'))
    for facts in _facts(facts_env, spawn):
        assert facts["hostname"] == "operator-box"


def test_workspace_default_size_follows_the_policy(facts_env, spawn, policy):
    policy((r"^default_size = .*$", 'default_size = "24M"'))
    for facts in _facts(facts_env, spawn):
        # One tmpfs holds the workspace and /dev/shm (confine.py): both say its size.
        assert facts["workspace"] == facts["shm"] == 24 << 20, facts
    # A pool's own workspace_size still wins over the policy's default.
    for facts in _facts(facts_env, spawn, n=1, workspace_size="8M"):
        assert facts["workspace"] == 8 << 20


def test_workspace_path_follows_the_policy(facts_env, spawn, policy):
    policy((r'^path = "/workspace"$', 'path = "/scratch"'))
    for facts in _facts(facts_env, spawn):
        assert facts["cwd"] == "/scratch", facts
        assert (facts["uid"], facts["gid"]) == (0, 0), facts  # [identity] uid, gid


BOGUS = {
    "namespace": ((r"^unshare = \[.*\]$", 'unshare = ["user", "pid", "net", "moon"]'), "[namespaces] unshare"),
    "no user namespace": ((r"^unshare = \[.*\]$", 'unshare = ["pid", "net"]'), "[namespaces] unshare"),
    "default_size": ((r"^default_size = .*$", 'default_size = "lots"'), "[workspace] default_size"),
    "hostname": ((r"^hostname = .*$", 'hostname = "a,b"'), "[process] hostname"),
    "ptys": ((r"^ptys = .*$", "ptys = -3"), "[quotas] ptys"),
    "warmup_timeout": ((r"^warmup_timeout = .*$", 'warmup_timeout = "soon"'), "[template] warmup_timeout"),
    "template uid": ((r"^uid = 1000$", 'uid = "x"'), "[template] uid"),
    "bytes_per_inode": ((r"^bytes_per_inode = .*$", "bytes_per_inode = 0"), "[workspace] bytes_per_inode"),
    "workspace path": ((r'^path = "/workspace"$', 'path = "relative"'), "[workspace] path"),
    "interpreter flags": ((r"^flags = .*$", 'flags = "-S"'), "[interpreter] flags"),
}


@pytest.mark.parametrize("case", sorted(BOGUS))
def test_a_bogus_policy_value_is_named(facts_env, spawn, policy, case):
    change, key = BOGUS[case]
    policy(change)
    with pytest.raises(SandboxUnavailable) as caught:
        RLPool(facts_env, 1, spawn=spawn, step_timeout=5)
    assert key in str(caught.value), str(caught.value)
    assert "BOLTZLABS_POLICY" in str(caught.value) or "policy.toml" in str(caught.value)


# -- the plan's child part, as the sandbox reads it ($BOLTZLABS_CONFINE) ----------------------

from boltzlabs.runtime import confine  # noqa: E402
from boltzlabs.host.builder import SandboxSpec, load_policy  # noqa: E402


def _child_values() -> dict:
    return confine.parse(SandboxSpec(load_policy(), ROOT / "examples" / "counter").plan.child_text())


def test_the_child_part_round_trips():
    plan = SandboxSpec(load_policy(), ROOT / "examples" / "counter").plan
    values = confine.parse(plan.child_text())
    built = confine.Plan(values)
    assert built.unshare == {"net", "ipc", "uts", "cgroup"} and built.ids == (0, 0)
    assert built.hostname == "boltzlabs" and built.workspace == b"/workspace" and built.proc == "/proc"
    assert values["size"] == str(64 << 20) and values["inodes"] == str((64 << 20) // 4096)
    template = confine.parse(plan.template_text(100, trusted=True, namespaces=472))
    assert template["warmup"] == "5.0" and template["hidden_proc"] == "/.template/proc"
    assert template["trusted"] == "1" and template["namespaces"] == "472"
    assert confine.parse(plan.template_text(100))["trusted"] == "0"


@pytest.mark.parametrize(
    "text, complaint",
    [
        ("x" * 20000, "too long"),
        ("\n".join(f"sysctl.max_{chr(97 + i % 26) * (1 + i // 26)}=0" for i in range(200)), "more than"),
        ("unshare=net\nunshare=net", "repeated"),
        ("bogus=1", "unknown"),
        ("sysctl.../../kernel/core_pattern=|/x", "unknown"),
        ("sysctl.Max=1", "unknown"),
        ("no equals sign", "malformed"),
        ("unshare=net\0", "not text"),
        ("unshare=net", "lacks"),
        (None, "missing"),
    ],
)
def test_a_hostile_plan_text_is_refused(text, complaint):
    with pytest.raises(ValueError, match=complaint):
        confine.parse(text)


@pytest.mark.parametrize(
    "key, value",
    [
        ("unshare", "net,moon"),
        ("unshare", "user"),
        ("unshare", "net,net"),
        ("workspace", "relative"),
        ("workspace", "/a/../etc"),
        ("workspace", "/"),
        ("dev", "/dev,x"),
        ("proc", ""),
        ("size", "-1"),
        ("size", "0"),
        ("size", "1e9"),
        ("size", "9" * 30),
        ("ptys", "x"),
        ("uid", "-5"),
        ("sysctl.max_user_namespaces", "-1"),
    ],
)
def test_a_bad_plan_value_is_refused(key, value):
    values = dict(_child_values(), **{key: value})
    with pytest.raises(ValueError, match=r"BOLTZLABS_CONFINE"):
        confine.Plan(values)


def test_a_hostname_without_a_uts_namespace_is_refused():
    values = dict(_child_values(), unshare="net,ipc")
    with pytest.raises(ValueError, match="uts"):
        confine.Plan(values)
    confine.Plan(dict(values, hostname=""))  # no uts namespace, no name: fine


def test_the_host_refuses_to_encode_what_the_sandbox_would_refuse():
    with pytest.raises(ValueError):
        confine.encode({"hostname": "a\nsysctl.max_user_namespaces=99"})


def test_a_failed_sandbox_set_up_is_not_blamed_on_the_env(facts_env, policy):
    """A policy that breaks the set-up inside the sandbox (exec mode's set-up
    capabilities without CAP_SYS_ADMIN: its first mount fails): the error shows
    the set-up's traceback and says it is the policy or the host, not env.py.
    (A template whose set-up fails falls back to exec mode with its traceback
    in the warning: test_template.py.)"""
    policy(
        (
            r'^cap_add = \["CAP_SYS_ADMIN", "CAP_SYS_RESOURCE", "CAP_SETPCAP"\]$',
            'cap_add = ["CAP_SYS_RESOURCE", "CAP_SETPCAP"]',
        )
    )
    with pytest.raises(EnvStartError) as caught:
        RLPool(facts_env, 1, spawn="exec", start_timeout=30).close()
    text = str(caught.value)
    assert "mount the workspace tmpfs: Operation not permitted" in text, text
    assert "set-up failed before any env code ran" in text and "boltzlabs doctor" in text, text
    assert "Fix the error in" not in text, text


CALLS = """
import ctypes
from boltzlabs.env import serve

libc = ctypes.CDLL(None, use_errno=True)

def calls():
    # [modify_ldt(0: read, buf, 16), syncfs(0)]: each its result, or -errno. Both harmless;
    # the shipped filter refuses modify_ldt (EPERM) and allows syncfs.
    buf = ctypes.create_string_buffer(16)
    out = []
    for result in (libc.syscall(154, 0, buf, 16), libc.syncfs(0)):
        out.append(result if result >= 0 else -ctypes.get_errno())
    return out

def reset(seed):
    return calls()

def step(action):
    return calls(), 0.0, False, {}

serve(reset=reset, step=step)
"""

LDT_RULE = """[[deny]]
why = "16-bit segments: a historic source of kernel information leaks"
syscalls = ["modify_ldt"]
errno = "EPERM"
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="modify_ldt is x86's")
def test_an_operators_seccomp_file_is_the_filter(env_dir, spawn, tmp_path, monkeypatch):
    """BOLTZLABS_SECCOMP names a copy of sandbox/seccomp.toml, edited: the
    envs run under it, in both modes. The copy drops the rule that refuses
    modify_ldt (an env that needs a call the shipped list refuses) and adds
    one refusing syncfs with EACCES (a host that refuses more)."""
    source = env_dir(CALLS)
    shipped = (ROOT / "sandbox" / "seccomp.toml").read_text()
    assert LDT_RULE in shipped
    with RLPool(source, 1, spawn=spawn) as pool:
        assert pool.spawn == spawn
        assert pool.reset(seed=0)[0] == [-1, 0]  # modify_ldt: EPERM; syncfs: done
    path = tmp_path / "seccomp.toml"
    path.write_text(
        shipped.replace(LDT_RULE, "") + '\n[[deny]]\nwhy = "a test"\nsyscalls = ["syncfs"]\nerrno = "EACCES"\n'
    )
    monkeypatch.setenv("BOLTZLABS_SECCOMP", str(path))
    with RLPool(source, 1, spawn=spawn) as pool:
        assert pool.spawn == spawn
        assert pool.reset(seed=0)[0] == [0, -13]  # modify_ldt: no LDT, 0 bytes read; syncfs: EACCES
        assert pool.step([0])[0][0] == [0, -13]


def test_an_unreadable_seccomp_file_is_named(facts_env, monkeypatch, tmp_path):
    monkeypatch.setenv("BOLTZLABS_SECCOMP", str(tmp_path / "missing.toml"))
    with pytest.raises(SandboxUnavailable, match="missing.toml.*unset BOLTZLABS_SECCOMP"):
        RLPool(facts_env, 1)
    (tmp_path / "bad.toml").write_text("[[deny]\n")
    monkeypatch.setenv("BOLTZLABS_SECCOMP", str(tmp_path / "bad.toml"))
    with pytest.raises(SandboxUnavailable, match="bad.toml.*unset BOLTZLABS_SECCOMP"):
        RLPool(facts_env, 1)


# -- the one reader: a key missing, of the wrong type or out of range is named with its file --------

import tomllib  # noqa: E402

from boltzlabs.host.policy import Policy  # noqa: E402

OPERATOR = "/etc/boltzlabs/operator-policy.toml"


def _policy(change) -> Policy:
    """The shipped policy's tables with `change(tables)` made, as if read from OPERATOR."""
    tables = tomllib.loads(SHIPPED)
    change(tables)
    return Policy(tables, {}, {}, OPERATOR)


@pytest.mark.parametrize(
    "change, read, key, what",
    [
        (lambda t: t["limits"].pop("log_tail"), "pool_limits", "[limits] log_tail", "has no"),
        (lambda t: t["limits"].pop("max_pool_bytes"), "pool_limits", "[limits] max_pool_bytes", "has no"),
        (lambda t: t["limits"].update(log_tail="64K"), "pool_limits", "[limits] log_tail", "must be a whole number"),
        (lambda t: t["limits"].update(max_frame=True), "pool_limits", "[limits] max_frame", "must be a whole number"),
        (lambda t: t["limits"].update(step_timeout="30s"), "pool_limits", "[limits] step_timeout", "must be a number"),
        (lambda t: t["limits"].update(max_depth=1 << 20), "pool_limits", "[limits] max_depth", "from 1 to 512"),
        (
            lambda t: t["limits"].update(max_objects_per_frame=0),
            "pool_limits",
            "[limits] max_objects_per_frame",
            "from 1 to",
        ),
        (lambda t: t["limits"].update(start_timeout=-1.0), "pool_limits", "[limits] start_timeout", "0 or more"),
        (lambda t: t.pop("limits"), "pool_limits", "[limits]", "has no"),
        (lambda t: t.pop("identity"), "identity", "[identity]", "has no"),
        (lambda t: t.update(env_limits=3), "env_limits_table", "[env_limits]", "must be a table"),
        (lambda t: t["workspace"].pop("default_size"), "default_workspace_size", "[workspace] default_size", "has no"),
        (
            lambda t: t["workspace"].update(default_size="0"),
            "default_workspace_size",
            "[workspace] default_size",
            "a positive size",
        ),
    ],
)
def test_the_reader_names_the_key_and_the_file(change, read, key, what):
    policy = _policy(change)
    with pytest.raises(SandboxUnavailable) as caught:
        getattr(policy, read)()
    message = str(caught.value)
    assert key in message and OPERATOR in message and what in message, message
    assert "KeyError" not in message


def test_the_shipped_policy_reads_whole():
    limits = _policy(lambda t: None).pool_limits()
    shipped = tomllib.loads(SHIPPED)["limits"]
    assert {name: getattr(limits, name) for name in shipped} == shipped


def test_a_policy_without_log_tail_fails_the_pool_naming_it(facts_env, policy):
    """The pool's start says which key of which file is missing (not `WorkerError: 'log_tail'`)."""
    path = policy((r"^log_tail = .*$", ""))
    with pytest.raises(SandboxUnavailable) as caught:
        RLPool(facts_env, 1, step_timeout=5)
    message = str(caught.value)
    assert "[limits] log_tail" in message and str(path) in message and "BOLTZLABS_POLICY" in message, message
