"""The seccomp filter (sandbox/seccomp.toml): each refused call, tried for real from inside an env.

Every attack runs on lane 0 of a real pool while lane 1 steps normally, and
then every lane must step normally again. Calls Python lacks go through
ctypes' syscall() with x86_64 numbers. Where the kernel itself would refuse
a call anyway, the arguments are chosen so that without the filter it fails
with another errno (a bad pointer gives EFAULT, an invalid flag combination
EINVAL, a pty that is the controlling terminal takes TIOCSTI). With the
filter removed (no --seccomp, no per-child load) 77 of the 90 in-env checks
fail. Those that pass anyway are the allowed calls and the calls the kernel
refuses with EPERM before reading any argument, for want of a capability:
pivot_root, kexec_load, init_module, finit_module, syslog (dmesg_restrict),
and in template mode ptrace attach; plus the x32 call, since this kernel
has no x32 ABI (ENOSYS either way). `test_compiled_program_*` checks those
in the compiled program itself, with a small classic-BPF interpreter.
"""

from __future__ import annotations

import errno
import platform
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from boltzlabs import RLPool
from boltzlabs.host import seccomp
from boltzlabs.host.policy import load_policy
from boltzlabs.errors import SandboxUnavailable, SeccompPolicyError

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64", reason="syscall numbers and the int 0x80 stub are x86_64's"
)

# The attacks. The env runs ATTACK_CODE and answers {"op": "attack", "name": N}
# with {"errno": e, "ret": r} (errno 0: the call succeeded and returned r).
ATTACK_CODE = r'''
import ctypes
import mmap
import os
import socket
import struct
import sys

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
BAD = ctypes.c_void_p(1)  # an unmapped pointer: EFAULT from any call that gets to read it
U64 = ctypes.c_ulong
HIGH = 1 << 32  # junk in the high half of a 32-bit argument, which the kernel drops
CLONE_THREAD, SIGCHLD = 0x10000, 17

def sys_(nr, *args):
    ctypes.set_errno(0)
    ret = libc.syscall(U64(nr), *(ctypes.c_long(a) if isinstance(a, int) else a for a in args))
    return {"errno": ctypes.get_errno() if ret == -1 else 0, "ret": ret}

def sock(family, kind, proto=0):
    try:
        socket.socket(family, kind, proto).close()
        return {"errno": 0, "ret": 0}
    except OSError as exc:
        return {"errno": exc.errno, "ret": -1}

def in_child(body):
    """Run body() in a forked child (its own session) and return what it returned."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            out = body()
            os.write(w, struct.pack("<iq", out["errno"], out["ret"]))
        finally:
            os._exit(0)
    os.close(w)
    data = os.read(r, 12)
    os.close(r)
    os.waitpid(pid, 0)
    if len(data) != 12:
        return {"errno": -1, "ret": -1}
    e, ret = struct.unpack("<iq", data)
    return {"errno": e, "ret": ret}

def tty_ioctl(request):
    """ioctl(request | HIGH) on a pty that is this session's controlling terminal
    (TIOCSTI is allowed there without the filter)."""
    def body():
        os.setsid()
        master, slave = os.openpty()
        sys_(16, slave, 0x540E, 0)  # TIOCSCTTY
        return sys_(16, slave, U64(request | HIGH), ctypes.byref(ctypes.c_char(b"\x00")))
    return in_child(body)

def int80_getpid():
    """getpid through the 32-bit ABI: int 0x80 with eax = 20. Returns eax."""
    code = bytes.fromhex("b814000000cd80c3")  # mov eax, 20; int 0x80; ret
    buf = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    buf.write(code)
    ret = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(buf)))()
    return {"errno": -ret if ret < 0 else 0, "ret": ret}

ATTACKS = {
    "ptrace_traceme": lambda: in_child(lambda: sys_(101, 0, 0, 0, 0)),
    "ptrace_attach_pid1": lambda: sys_(101, 16, 1, 0, 0),
    "perf_event_open": lambda: sys_(298, 0, 0, -1, -1, 0),
    "keyctl": lambda: sys_(250, 0, -3, 0),  # KEYCTL_GET_KEYRING_ID of the session keyring
    "add_key": lambda: sys_(248, BAD, BAD, BAD, 0, -3),
    "request_key": lambda: sys_(249, BAD, BAD, BAD, -3),
    "mount": lambda: sys_(165, BAD, BAD, BAD, 0, 0),
    "umount2": lambda: sys_(166, BAD, 0),
    "pivot_root": lambda: sys_(155, BAD, BAD),
    "chroot": lambda: sys_(161, BAD),
    "unshare_user": lambda: sys_(272, 0x10000000),
    "unshare_net": lambda: sys_(272, 0x40000000 | 0x80000),  # + CLONE_SETTLS: EINVAL unfiltered
    "setns": lambda: sys_(308, -1, 0),
    # CLONE_THREAD without CLONE_SIGHAND: unfiltered the kernel says EINVAL and makes no child.
    "clone_newnet": lambda: sys_(56, 0x40000000 | CLONE_THREAD | SIGCHLD, 0, 0, 0, 0),
    "clone_newuser": lambda: sys_(56, 0x10000000 | CLONE_THREAD | SIGCHLD, 0, 0, 0, 0),
    "personality_read_implies_exec": lambda: sys_(135, 0x0400000),
    "tiocsti": lambda: tty_ioctl(0x5412),
    "tioclinux": lambda: tty_ioctl(0x541C),
    "clone3": lambda: sys_(435, 0, 0),
    "fsopen": lambda: sys_(430, BAD, 0),
    "open_tree": lambda: sys_(428, -1, BAD, 0),
    "bpf": lambda: sys_(321, 0, BAD, 64),
    "userfaultfd": lambda: sys_(323, 1 | 2),  # UFFD_USER_MODE_ONLY + an unknown flag: EINVAL unfiltered
    "io_uring_setup": lambda: sys_(425, 1, 0),
    "memfd_secret": lambda: sys_(447, 0xFFFF),  # unknown flags: EINVAL unfiltered
    "process_vm_readv": lambda: sys_(310, os.getpid(), 0, 0, 0, 0, 1),
    "kexec_load": lambda: sys_(246, 0, 0, 0, 0),
    "init_module": lambda: sys_(175, 0, 0, BAD),
    "finit_module": lambda: sys_(313, -1, BAD, 0),
    "syslog": lambda: sys_(103, 10, 0, 0),  # SYSLOG_ACTION_SIZE_BUFFER: allowed to anyone unfiltered
    "socket_inet": lambda: sock(socket.AF_INET, socket.SOCK_STREAM),
    "socket_inet6": lambda: sock(socket.AF_INET6, socket.SOCK_DGRAM),
    "socket_netlink": lambda: sock(socket.AF_NETLINK, socket.SOCK_RAW, 0),
    "socket_packet": lambda: sock(socket.AF_PACKET, socket.SOCK_RAW),
    "socket_inet_high_bits": lambda: sys_(41, 2 | HIGH, 2, 0),
    "inotify_init": lambda: sys_(253),
    "inotify_init1": lambda: sys_(294, 0),
    "fanotify_init": lambda: sys_(300, 0x200, 0),  # FAN_CLASS_NOTIF | FAN_REPORT_FID: allowed unprivileged since 5.13
    "fanotify_mark": lambda: sys_(301, -1, 0, 0, -100, BAD),  # no ADD/REMOVE/FLUSH: EINVAL unfiltered
    "int80_getpid": int80_getpid,
    "x32_getpid": lambda: sys_(0x40000000 | 39),
    # Allowed: the filter must not refuse these.
    "socket_unix": lambda: sock(socket.AF_UNIX, socket.SOCK_STREAM),
    "personality_query_linux": lambda: sys_(135, 0),
    "tcgets": lambda: in_child(lambda: (lambda m_s: sys_(16, m_s[1], 0x5401, ctypes.create_string_buffer(64)))(os.openpty())),
}
'''

ENV_SOURCE = (
    ATTACK_CODE
    + r'''
import subprocess
import sys
import threading

from boltzlabs.env import serve

# What import-time code may do: in template mode it runs in the template.
AT_IMPORT = {name: ATTACKS[name]() for name in ("socket_inet", "ptrace_traceme", "clone3", "mount", "bpf")}

def normal_work():
    """What an env may do: fork, threads (clone3 -> ENOSYS -> clone), subprocess."""
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    forked = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    box = []
    t = threading.Thread(target=lambda: box.append(threading.get_native_id()))
    t.start()
    t.join()
    out = subprocess.run([sys.executable, "-S", "-c", "print(6 * 7)"], capture_output=True, text=True, timeout=30)
    with open("/proc/self/status") as f:
        status = dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)
    return {"fork": forked, "thread": bool(box) and box[0] != threading.get_native_id(),
            "subprocess": out.stdout.strip(), "seccomp": status.get("Seccomp"),
            "filters": status.get("Seccomp_filters")}

def reset(seed, options=None):
    return 0

def step(action):
    if not isinstance(action, dict):
        return {"honest": True}, float(action), False, {}
    if action["op"] == "attack":
        out = ATTACKS[action["name"]]()
    elif action["op"] == "import":
        out = AT_IMPORT
    elif action["op"] == "normal":
        out = normal_work()
    return {"out": out}, 0.0, False, {}

serve(reset=reset, step=step)
'''
)

# name -> errno inside an env (0: allowed).
EXPECTED = {
    "ptrace_traceme": errno.EPERM,
    "ptrace_attach_pid1": errno.EPERM,
    "perf_event_open": errno.EPERM,
    "keyctl": errno.EPERM,
    "add_key": errno.EPERM,
    "request_key": errno.EPERM,
    "mount": errno.EPERM,
    "umount2": errno.EPERM,
    "pivot_root": errno.EPERM,
    "chroot": errno.EPERM,
    "unshare_user": errno.EPERM,
    "unshare_net": errno.EPERM,
    "setns": errno.EPERM,
    "clone_newnet": errno.EPERM,
    "clone_newuser": errno.EPERM,
    "personality_read_implies_exec": errno.EPERM,
    "tiocsti": errno.EPERM,
    "tioclinux": errno.EPERM,
    "clone3": errno.ENOSYS,
    "fsopen": errno.ENOSYS,
    "open_tree": errno.ENOSYS,
    "bpf": errno.EPERM,
    "userfaultfd": errno.EPERM,
    "io_uring_setup": errno.EPERM,
    "memfd_secret": errno.EPERM,
    "process_vm_readv": errno.EPERM,
    "kexec_load": errno.EPERM,
    "init_module": errno.EPERM,
    "finit_module": errno.EPERM,
    "syslog": errno.EPERM,
    "socket_inet": errno.EAFNOSUPPORT,
    "socket_inet6": errno.EAFNOSUPPORT,
    "socket_netlink": errno.EAFNOSUPPORT,
    "socket_packet": errno.EAFNOSUPPORT,
    "socket_inet_high_bits": errno.EAFNOSUPPORT,
    "inotify_init": errno.ENOSYS,
    "inotify_init1": errno.ENOSYS,
    "fanotify_init": errno.EPERM,
    "fanotify_mark": errno.EPERM,
    "int80_getpid": errno.ENOSYS,
    "x32_getpid": errno.ENOSYS,
    "socket_unix": 0,
    "personality_query_linux": 0,
    "tcgets": 0,
}


@pytest.fixture(scope="module")
def env_source(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("seccomp_env")
    directory.chmod(0o755)  # mktemp's 0700 would hide it from the sandboxes' account
    (directory / "env.py").write_text(ENV_SOURCE)
    return directory


@pytest.fixture(scope="module")
def pools(env_source):
    """One attack pool per spawn mode for the whole module, remade if a test left it unhealthy."""
    made: dict[str, RLPool] = {}

    def get(spawn: str) -> RLPool:
        pool = made.get(spawn)
        if pool is None or pool.states() != ["idle"] * pool.n:
            if pool is not None:
                pool.close()
            made[spawn] = pool = RLPool(env_source, 2, spawn=spawn, step_timeout=10.0)
            assert pool.spawn == spawn
            pool.reset()  # a pool steps only lanes a reset has reached
        return pool

    yield get
    for pool in made.values():
        pool.close()


def assert_healthy(pool: RLPool) -> None:
    """A normal step on every lane answers reward 1.0 with no error."""
    obs, rewards, dones, infos = pool.step([1] * pool.n)
    assert rewards.tolist() == [1.0] * pool.n
    assert all("error" not in info for info in infos), infos
    assert obs == [{"honest": True}] * pool.n
    assert pool.states() == ["idle"] * pool.n


# -- from inside an env ----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_attack_is_refused_and_the_pool_stays_healthy(pools, spawn, name):
    pool = pools(spawn)
    obs, rewards, dones, infos = pool.step([{"op": "attack", "name": name}, 1])
    assert "error" not in infos[0], infos[0]  # refused with an errno, never killed
    assert obs[1] == {"honest": True} and rewards[1] == 1.0 and "error" not in infos[1]
    got = obs[0]["out"]
    expected = EXPECTED[name]
    assert got["errno"] == expected, (
        f"{name}: expected {errno.errorcode.get(expected, 'success')}, got {errno.errorcode.get(got['errno'], got)}"
    )
    assert_healthy(pool)


def test_the_filter_is_loaded_and_normal_processes_still_work(pools, spawn):
    pool = pools(spawn)
    for out in (o["out"] for o in pool.step([{"op": "normal"}] * 2)[0]):
        assert out["fork"] == 7
        assert out["thread"] is True
        assert out["subprocess"] == "42"
        assert out["seccomp"] == "2"  # SECCOMP_MODE_FILTER
        # Both modes: the set-up's (bwrap's --seccomp, or the template's,
        # inherited) and the env's full one, loaded by the set-up before env code.
        assert out["filters"] == "2"
    assert_healthy(pool)


def test_import_time_code_runs_under_the_envs_full_filter(pools, spawn):
    """env.py's import-time code is refused what every env is refused, in both
    modes: the template never imports env.py (a forked env runs it once it
    is a sandbox, its full filter loaded), so even mount and unshare, which
    the template's own filter allows, are refused."""
    pool = pools(spawn)
    for out in (o["out"] for o in pool.step([{"op": "import"}] * 2)[0]):
        assert out["socket_inet"]["errno"] == errno.EAFNOSUPPORT
        assert out["ptrace_traceme"]["errno"] == errno.EPERM
        assert out["clone3"]["errno"] == errno.ENOSYS
        assert out["bpf"]["errno"] == errno.EPERM
        assert out["mount"]["errno"] == errno.EPERM
    assert_healthy(pool)


def test_numpy_still_works(env_dir, pool_factory):
    pool = pool_factory(
        env_dir("""
        import numpy as np
        from boltzlabs.env import serve

        def reset(seed, options=None):
            return 0

        def step(action):
            a = np.arange(64, dtype=np.float64).reshape(8, 8)
            return float((a @ a.T).trace()), 1.0, False, {}

        serve(reset=reset, step=step)
    """),
        2,
    )
    pool.reset(seed=0)
    obs, rewards, dones, infos = pool.step([0, 0])
    expected = float(sum(i * i for i in range(64)))
    assert obs == [expected, expected], infos
    assert rewards.tolist() == [1.0, 1.0]


# -- the compiled program ---------------------------------------------------------------

AUDIT_ARCH_X86_64, AUDIT_ARCH_I386 = 0xC000003E, 0x40000003
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000


def run_bpf(program: bytes, nr: int, args=(), arch: int = AUDIT_ARCH_X86_64) -> int:
    """Evaluate a classic BPF seccomp program on one struct seccomp_data."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, *(list(args) + [0] * (6 - len(args))))
    insns = [struct.unpack("<HBBI", program[i : i + 8]) for i in range(0, len(program), 8)]
    a = x = 0
    mem = [0] * 16
    pc = 0
    while True:
        code, jt, jf, k = insns[pc]
        pc += 1
        if code == 0x20:  # ld [k]
            a = struct.unpack_from("<I", data, k)[0]
        elif code == 0x00:  # ld #k
            a = k
        elif code == 0x60:  # ld M[k]
            a = mem[k]
        elif code == 0x61:  # ldx M[k]
            x = mem[k]
        elif code == 0x02:  # st M[k]
            mem[k] = a
        elif code == 0x03:  # stx M[k]
            mem[k] = x
        elif code == 0x07:  # tax
            x = a
        elif code == 0x87:  # txa
            a = x
        elif code == 0x54:  # and #k
            a &= k
        elif code == 0x05:  # ja
            pc += k
        elif code in (0x15, 0x25, 0x35, 0x45, 0x1D, 0x2D, 0x3D, 0x4D):
            operand = x if code & 0x08 else k
            test = {0x10: a == operand, 0x20: a > operand, 0x30: a >= operand, 0x40: bool(a & operand)}[code & 0xF0]
            pc += jt if test else jf
        elif code == 0x06:  # ret #k
            return k
        elif code == 0x16:  # ret a
            return a
        else:
            raise AssertionError(f"instruction {code:#x} not handled by this interpreter")


def nr(name: str) -> int:
    import pyseccomp

    return pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, name)


def denied(errno_: int) -> int:
    return SECCOMP_RET_ERRNO | errno_


def test_compiled_program_refuses_every_rule_of_the_policy():
    rules = load_policy().seccomp
    constants = rules["constants"]
    filters = seccomp.compile_rules(load_policy().seccomp)
    allowed_in_template = set(rules["template"]["allow"])
    checked = 0
    for rule in rules["deny"]:
        action = denied(getattr(errno, rule["errno"]))
        when = rule.get("when")
        for name in rule["syscalls"]:
            number = nr(name)
            if number < 0:
                continue  # not on this architecture (umount)
            matching, other = [()], []
            if when is not None:
                arg = when["arg"]
                value = lambda v: constants.get(v, v)  # noqa: E731
                if "any_bit" in when:
                    matching = [tuple(value(b) if i == arg else 0 for i in range(arg + 1)) for b in when["any_bit"]]
                    other = [tuple(17 if i == arg else 0 for i in range(arg + 1))]  # SIGCHLD only
                elif "not_equal" in when:
                    matching = [tuple(value(when["not_equal"]) + 9 if i == arg else 0 for i in range(arg + 1))]
                    other = [tuple(value(when["not_equal"]) if i == arg else 0 for i in range(arg + 1))]
                else:
                    v = value(when["equals"])
                    matching = [tuple(v | (0xABCD << 32) if i == arg else 0 for i in range(arg + 1))]
                    other = [tuple(v + 1 if i == arg else 0 for i in range(arg + 1))]
            for args in matching:
                assert run_bpf(filters.env, number, args) == action, (name, args)
                expected = SECCOMP_RET_ALLOW if name in allowed_in_template else action
                assert run_bpf(filters.template, number, args) == expected, (name, args)
                checked += 1
            for args in other:
                assert run_bpf(filters.env, number, args) == SECCOMP_RET_ALLOW, (name, args)
    assert checked > 40
    # Only what is listed: ordinary calls pass, in both programs.
    for name in ("read", "write", "openat", "mmap", "futex", "getpid", "wait4", "execve", "prctl"):
        assert run_bpf(filters.env, nr(name)) == SECCOMP_RET_ALLOW
        assert run_bpf(filters.template, nr(name)) == SECCOMP_RET_ALLOW


def test_compiled_program_refuses_the_32_bit_abis():
    filters = seccomp.compile_rules(load_policy().seccomp)
    for program in (filters.env, filters.template):
        assert run_bpf(program, 20, arch=AUDIT_ARCH_I386) == denied(errno.ENOSYS)  # int 0x80 getpid
        assert run_bpf(program, 0x40000000 | 39) == denied(errno.ENOSYS)  # x32 getpid
        assert run_bpf(program, 39) == SECCOMP_RET_ALLOW  # getpid


# -- the policy file ---------------------------------------------------------------------


def test_shipped_policy_compiles():
    filters = seccomp.compile_rules(load_policy().seccomp)
    for program in (filters.env, filters.template):
        assert program and len(program) % 8 == 0 and len(program) // 8 <= 4096
    assert filters.env != filters.template


def policy_with(rule: dict) -> dict:
    rules = load_policy().seccomp
    rules["deny"] = rules["deny"] + [rule]
    return rules


@pytest.mark.parametrize(
    "rule, message",
    [
        (
            {"why": "typo", "syscalls": ["ptrace", "no_such_call"], "errno": "EPERM"},
            "knows no system call named 'no_such_call'",
        ),
        ({"why": "empty", "syscalls": [], "errno": "EPERM"}, "`syscalls` must be a non-empty list"),
        ({"why": "none", "errno": "EPERM"}, "`syscalls` must be a non-empty list"),
        ({"why": "errno", "syscalls": ["ptrace"], "errno": "ENOPE"}, "unknown errno 'ENOPE'"),
        (
            {"why": "const", "syscalls": ["ioctl"], "errno": "EPERM", "when": {"arg": 1, "equals": "TIOCNOPE"}},
            "'TIOCNOPE' is not defined in [constants]",
        ),
        ({"why": "arg", "syscalls": ["ioctl"], "errno": "EPERM", "when": {"arg": 7, "equals": 1}}, "arg = 0..5"),
    ],
)
def test_a_bad_policy_gives_a_clear_error(rule, message):
    with pytest.raises(SeccompPolicyError) as info:
        seccomp.compile_filter(policy_with(rule))
    assert message in str(info.value)
    assert f"[[deny]] #{len(load_policy().seccomp['deny']) + 1} ({rule['why']!r})" in str(info.value)


def test_template_allow_must_name_a_denied_call():
    rules = load_policy().seccomp
    rules["template"] = {"allow": ["mount", "mkdir"]}
    with pytest.raises(SeccompPolicyError, match=r"\['mkdir'\]"):
        seccomp.compile_filter(rules, template=True)


def test_a_missing_libseccomp_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyseccomp", None)  # import fails, as without the library
    with pytest.raises(SandboxUnavailable, match="apt-get install -y libseccomp2"):
        seccomp.compile_filter(load_policy().seccomp)


def test_exec_modes_set_up_imports_no_host_half():
    """An exec-mode env runs boltzlabs.runtime.confine before env.py: what it imports
    every env pays for (boltzlabs.host.seccomp, the host half, with dataclasses and
    functools, cost each env ~2 MiB)."""
    code = (
        "import sys; before = set(sys.modules); import boltzlabs.runtime.confine; "
        "print(' '.join(sorted(set(sys.modules) - before)))"
    )
    out = subprocess.run(
        [sys.executable, "-S", "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    assert out.returncode == 0, out.stderr
    new = set(out.stdout.split())
    assert {m for m in new if m.startswith("boltzlabs")} == {
        "boltzlabs",
        "boltzlabs.abi",
        "boltzlabs.runtime",
        "boltzlabs.runtime.confine",
    }
    assert not new & {"dataclasses", "functools", "inspect", "typing", "re", "json"}, new
