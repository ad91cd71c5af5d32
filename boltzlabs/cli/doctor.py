"""`boltzlabs doctor`: can this host run pools, and what to change if not.

    run_checks(n) --> [Finding(name, status, detail, fix), ...] --cli--> text or JSON

Each check looks at one thing the sandbox or the worker depends on and says,
when it is not right, the exact command that fixes it. `run_checks()` returns
plain data (`Finding.to_dict()` is JSON-able), so it can run on a remote
node and be printed elsewhere. It starts real sandboxes and creates (and
removes at once) real cgroups below this process's own: it proves, it does
not guess.

Kernel and bubblewrap facts behind the checks:
- Unprivileged user namespaces are gated by `user.max_user_namespaces` (0
  forbids them), on older Debian kernels by `kernel.unprivileged_userns_clone`,
  and on Ubuntu 23.10+ by AppArmor (`kernel.apparmor_restrict_unprivileged_userns`).
  Root is not affected by the last two.
- A setuid bwrap run by a non-root user refuses `--size` ("not permitted in
  setuid mode"), which the policy uses to cap each workspace tmpfs.
- The worker needs about 3 fds per env (worker._raise_fd_limit); only a
  process with CAP_SYS_RESOURCE may raise its hard limit, up to `fs.nr_open`.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import resource
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

__all__ = ["Finding", "run_checks", "OK", "WARN", "FAIL"]

OK, WARN, FAIL = "ok", "warn", "fail"
MIN_BWRAP = (0, 5, 0)  # --size
_PACKAGES = ("msgpack", "numpy", "psutil", "tqdm")
_OPTIONAL = {
    "gymnasium": "gym:// sources: pip install 'boltzlabs[gym]'",
    "matplotlib": "boltzlabs bench --plot: pip install 'boltzlabs[plot]'",
}
_PROBE_ENV = """\
from boltzlabs.runtime.serve import serve

serve(reset=lambda seed: 0, step=lambda action: (1, 1.0, False, {}))
"""


@dataclass(frozen=True)
class Finding:
    """One check's outcome. status: "ok", "warn" or "fail"; fix: the exact
    command (or action) that makes it right, "" when nothing is to change."""

    name: str
    status: str
    detail: str
    fix: str = ""

    def to_dict(self) -> dict:
        """The finding as JSON-able data."""
        return asdict(self)


def run_checks(n: int = 1000, timeout: float = 60.0) -> list[Finding]:
    """Every host check, in order; `n` is the pool size the fd check plans for,
    `timeout` the seconds each trial sandbox or pool may take to start and answer."""
    findings = []
    bwrap = shutil.which("bwrap")
    checks = (
        ("bwrap", lambda: _bwrap(bwrap)),
        ("user namespaces", _userns),
        ("seccomp", _seccomp),
        ("sandbox", lambda: _sandbox(bwrap, timeout)),
        ("cgroup version", _cgroup_version),
        ("cgroups", _cgroups),
        ("memory cgroup bookkeeping", lambda: _memory_cgroup_bookkeeping(n)),
        ("fd limit", lambda: _fd_limit(n)),
        ("versions", _versions),
    )
    for name, check in checks:
        try:
            findings.extend(check())
        except Exception as exc:  # a check that cannot run is a finding, never a crash
            findings.append(Finding(name, FAIL, f"the check itself failed: {type(exc).__name__}: {exc}"))
    return findings


# -- bubblewrap ------------------------------------------------------------------------------


def _bwrap(bwrap: str | None) -> list[Finding]:
    if bwrap is None:
        return [
            Finding(
                "bwrap",
                FAIL,
                "bubblewrap (bwrap) is not on PATH; every env runs inside it",
                "sudo apt-get install -y bubblewrap   # Fedora: sudo dnf install bubblewrap",
            )
        ]
    out = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=10)
    match = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", out.stdout)
    version = tuple(int(x or 0) for x in match.groups()) if match else None
    text = ".".join(map(str, version)) if version else f"unknown ({out.stdout.strip() or out.stderr.strip()})"
    findings = []
    if version is None or version < MIN_BWRAP:
        findings.append(
            Finding(
                "bwrap version",
                FAIL,
                f"{bwrap} is version {text}; boltzlabs needs >= 0.5 (--size caps each workspace)",
                "sudo apt-get install -y --only-upgrade bubblewrap",
            )
        )
    else:
        findings.append(Finding("bwrap version", OK, f"{bwrap}: bubblewrap {text}"))
    setuid = bool(os.stat(bwrap).st_mode & stat.S_ISUID)
    if not setuid:
        findings.append(Finding("bwrap mode", OK, "not setuid: sandboxes are built from user namespaces"))
    elif os.geteuid() == 0:
        findings.append(
            Finding(
                "bwrap mode",
                WARN,
                "setuid root; run by root it behaves as unprivileged bwrap, "
                "but any other user gets setuid mode, which refuses --size",
                f"sudo chmod u-s {bwrap}   # once user namespaces are allowed (below)",
            )
        )
    else:
        findings.append(
            Finding(
                "bwrap mode",
                FAIL,
                "setuid root: in setuid mode bwrap refuses --size, which the policy uses to cap each workspace",
                f"sudo chmod u-s {bwrap}   # and allow unprivileged user namespaces (below)",
            )
        )
    return findings


# -- user namespaces -------------------------------------------------------------------------


def _sysctl(name: str) -> str | None:
    try:
        return Path("/proc/sys", name.replace(".", "/")).read_text().strip()
    except OSError:
        return None


def _persist(name: str, value) -> str:
    return f"sudo sysctl -w {name}={value} && echo '{name} = {value}' | sudo tee /etc/sysctl.d/60-boltzlabs.conf"


def _seccomp() -> list[Finding]:
    from boltzlabs.host import seccomp
    from boltzlabs.host.policy import load_policy
    from boltzlabs.errors import SandboxUnavailable

    try:
        filters = seccomp.compile_rules(load_policy().seccomp)
    except SandboxUnavailable as exc:
        return [Finding("seccomp", FAIL, str(exc), "sudo apt-get install -y libseccomp2 && pip install pyseccomp")]
    return [
        Finding(
            "seccomp",
            OK,
            f"sandbox/seccomp.toml compiles: {len(filters.env) // 8} BPF instructions "
            f"for envs, {len(filters.template) // 8} for the template",
        )
    ]


def _userns() -> list[Finding]:
    root = os.geteuid() == 0
    findings = []
    limit = _sysctl("user.max_user_namespaces")
    if limit is None:
        findings.append(
            Finding(
                "user namespaces",
                FAIL,
                "this kernel has no user namespaces (/proc/sys/user/max_user_namespaces is missing)",
                "use a kernel built with CONFIG_USER_NS=y",
            )
        )
    elif int(limit) == 0:
        findings.append(
            Finding(
                "user namespaces",
                FAIL,
                "user.max_user_namespaces is 0: no user namespace can be made, and every sandbox needs one",
                _persist("user.max_user_namespaces", 65536),
            )
        )
    else:
        findings.append(Finding("user namespaces", OK, f"user.max_user_namespaces = {limit}"))
    # Neither of these two gates applies to root; both stop an ordinary user.
    gates = (
        ("kernel.unprivileged_userns_clone", "0", "1", "Debian's switch for unprivileged user namespaces is off"),
        (
            "kernel.apparmor_restrict_unprivileged_userns",
            "1",
            "0",
            "AppArmor (Ubuntu 23.10+) forbids unprivileged user namespaces to programs without a profile",
        ),
    )
    for name, bad, good, why in gates:
        value = _sysctl(name)
        if value is None:
            continue  # this kernel has no such switch: nothing restricts
        if value != bad:
            findings.append(Finding(name, OK, f"{name} = {value}"))
            continue
        fix = _persist(name, good)
        if name.startswith("kernel.apparmor"):
            fix += "   # or give bwrap an AppArmor profile that allows userns"
        findings.append(
            Finding(
                name,
                WARN if root else FAIL,
                f"{name} = {value}: {why}" + ("; root is exempt, other users are not" if root else ""),
                fix,
            )
        )
    return findings


# -- a real sandbox --------------------------------------------------------------------------


def _env_dir(root: Path, name: str, source: str) -> Path:
    directory = root / name
    directory.mkdir()
    (directory / "env.py").write_text(source)
    # Readable by whatever uid the sandbox runs as.
    directory.chmod(0o755)
    (directory / "env.py").chmod(0o644)
    return directory


def _run_alone(argv: list, timeout: float, pass_fds: list) -> subprocess.CompletedProcess:
    """subprocess.run(argv) in a process group of its own, the whole group killed at the timeout.

    Killing bwrap alone is not enough: its child in the new pid namespace sets --die-with-parent's
    death signal only once it runs, so a bwrap killed in its first milliseconds can leave that child
    blocked for ever on the eventfd it waits on for the uid map. It is still in bwrap's group (the
    sandbox's own setsid comes later), so the group's SIGKILL ends it.
    """
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        pass_fds=pass_fds,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)  # bwrap is not reaped yet, so its pid still names the group
        proc.communicate()
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _sandbox(bwrap: str | None, timeout: float = 60.0) -> list[Finding]:
    if bwrap is None:
        return [Finding("sandbox", FAIL, "not tried: bwrap is missing (above)")]
    from boltzlabs import abi
    from boltzlabs.host import seccomp
    from boltzlabs.host.builder import SandboxSpec, load_policy

    marker = f"boltzlabs-doctor-{secrets.token_hex(4)}"
    findings = []
    root = Path(tempfile.mkdtemp(prefix="boltzlabs-doctor-"))
    root.chmod(0o755)
    try:
        # It serves nothing, so it ends itself (an env.py that just returns exits with
        # boltzlabs.abi.NO_SERVE_EXIT, saying it never called serve()).
        bare = _env_dir(root, "bare", f"import os\nprint({marker!r}, flush=True)\nos._exit(0)\n")
        spec = SandboxSpec(load_policy(), bare, 16 << 20)
        argv = spec.argv((3,), 0)
        try:
            with contextlib.ExitStack() as stack:
                # The policy's command line reads its filters from FILTER_FD and
                # CHILD_FILTER_FD; here they are wherever program_fd put them.
                fds = {
                    target: stack.enter_context(seccomp.program_fd(program))
                    for target, program in spec.programs().items()
                }
                argv[argv.index("--seccomp") + 1] = str(fds[abi.FILTER_FD])
                argv[argv.index(abi.CHILD_FILTER_VARIABLE) + 1] = str(fds[abi.CHILD_FILTER_FD])
                out = _run_alone(argv, timeout, pass_fds=list(fds.values()))
            said = (out.stderr.strip() or out.stdout.strip())[-2000:]
            ok = out.returncode == 0 and marker in out.stdout
        except subprocess.TimeoutExpired:
            ok, said, out = False, f"no answer within {timeout:g} s (doctor --timeout)", None
        if ok:
            findings.append(Finding("bwrap sandbox", OK, "bwrap runs Python under boltzlabs' policy"))
        else:
            code = f"exit code {out.returncode}: " if out is not None else ""
            findings.append(
                Finding(
                    "bwrap sandbox",
                    FAIL,
                    f"bwrap could not run Python under boltzlabs' policy ({code}{said or 'no output'})",
                    "fix the user-namespace and bwrap findings above; then run: "
                    + " ".join(argv[:1])
                    + " --unshare-user --ro-bind / / true",
                )
            )
            return findings
        findings.extend(_pool(_env_dir(root, "serving", _PROBE_ENV), timeout))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return findings


def _pool(env_dir: Path, timeout: float = 60.0) -> list[Finding]:
    """A one-env pool per spawn mode: reset and one step, the whole stack."""
    import warnings

    from boltzlabs import RLPool

    findings = []
    for spawn in ("template", "exec"):
        name = f"pool (spawn={spawn})"
        started = time.perf_counter()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with RLPool(env_dir, 1, spawn=spawn, step_timeout=timeout / 2, start_timeout=timeout) as pool:
                    pool.reset(seed=0)
                    _, _, _, infos = pool.step([0])
                    used = pool.spawn
            seconds = time.perf_counter() - started
        except Exception as exc:
            findings.append(
                Finding(
                    name,
                    FAIL,
                    f"a pool of one env failed: {type(exc).__name__}: {exc}",
                    "fix the findings above; the message says what failed",
                )
            )
            continue
        if infos[0].get("error"):
            findings.append(Finding(name, FAIL, f"the env's step failed: {infos[0]['error']}"))
        elif used != spawn:
            why = "; ".join(str(w.message) for w in caught) or "no reason given"
            findings.append(Finding(name, WARN, f"fell back to spawn={used}: {why}"))
        else:
            findings.append(Finding(name, OK, f"one env started, reset and stepped in {seconds:.2f} s"))
    return findings


# -- cgroups ---------------------------------------------------------------------------------


def _cgroup_mounts() -> tuple[list, list]:
    from boltzlabs.host.cgroups import _mounts

    v1 = [(point, options) for point, fstype, options in _mounts() if fstype == "cgroup"]
    v2 = [point for point, fstype, _ in _mounts() if fstype == "cgroup2"]
    return v1, v2


def _cgroup_version() -> list[Finding]:
    from boltzlabs.host.cgroups import _mounts, _own_cgroups, _v2_start, systemd_delegated, version

    v1, v2 = _cgroup_mounts()
    pools = version()
    if v1 and pools != "v2":
        hybrid = f"; cgroup2 is also mounted at {', '.join(v2)} (hybrid)" if v2 else ""
        controllers = sorted(
            {o for _, options in v1 for o in options if o not in ("rw", "ro") and not o.startswith("name=")}
        )
        return [Finding("cgroup version", OK, f"cgroup v1 (controllers: {', '.join(controllers)}){hybrid}")]
    if v2:
        findings = [Finding("cgroup version", OK, f"cgroup v2 (unified, at {v2[0]})")]
        start = _v2_start(_own_cgroups(), _mounts())
        if start is not None and systemd_delegated(start) is False:
            # Not a fault: a pool's worker asks systemd for a delegated scope of its own (the
            # memory cgroup finding below says whether it got one, or why not).
            findings.append(
                Finding(
                    "systemd delegation",
                    OK,
                    f"this process's cgroup {start} is in a unit systemd did not delegate (no "
                    "Delegate=yes): a pool's worker asks systemd for a delegated scope of its own, "
                    "boltzlabs-<worker pid>.scope, and makes its cgroups there",
                )
            )
        return findings
    return [
        Finding(
            "cgroup version",
            WARN,
            "no cgroup filesystem is mounted: no memory accounting or limits",
            "sudo mount -t cgroup2 none /sys/fs/cgroup",
        )
    ]


# The trial env's limits: a few tasks, so that its forks run into pids.max.
_TRIAL_PIDS, _TRIAL_POOL_PIDS, _TRIAL_MEMORY = 4, 16, 64 << 20
# How long the trial child has to join its cgroup, be charged and be refused a fork, and then to
# freeze: the checks end as soon as it has, so a slow node (an emulated guest under load took
# over 10 s to start an interpreter) waits longer only where it must.
_TRIAL_SECONDS = 60
_TRIAL_CHILD = """
import os, sys, time
for procs in sys.argv[1:]:  # join the trial env's cgroups, this process alone
    with open(procs, "w") as f:
        f.write("0")
for _ in range(8):
    try:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
    except OSError:
        pass
time.sleep(60)
"""


def _cgroups() -> list[Finding]:
    """The memory, pids and freezer cgroups a pool needs, each tried: a pool
    cgroup made as a worker makes it (on cgroup v2 with the room it needs),
    one trial env cgroup with a memory limit, a pids limit and the pool's cap,
    a process started in it that forks past its pids limit, frozen and thawed;
    then all of it removed. Each finding says what the kernel did."""
    from boltzlabs.errors import CgroupUnavailable
    from boltzlabs.host.cgroups import CgroupPool, PoolView, delegation_fix

    try:
        pool = CgroupPool(_TRIAL_MEMORY, _TRIAL_PIDS, freezer=True, pool_pids=_TRIAL_POOL_PIDS)
    except CgroupUnavailable as exc:
        fix = ("run the worker as root, or " + delegation_fix()) if os.geteuid() != 0 else delegation_fix()
        return [
            Finding(
                "memory cgroup",
                WARN,
                f"no usable memory cgroup ({exc}): envs_per_gb() falls back to PSS and memory_limit is refused",
                fix,
            ),
            Finding(
                "pids cgroup",
                WARN,
                "not tried (no pool cgroup): the per-env pids limit and the pool's "
                "(limits.pids, limits.pool_pids) are not enforced, so a fork bomb is not bounded",
                fix,
            ),
            Finding(
                "freezer cgroup",
                WARN,
                "not tried (no pool cgroup): serialize_measurement cannot freeze envs outside their turn",
                fix,
            ),
        ]
    findings, child = [], None
    deadline = time.monotonic() + _TRIAL_SECONDS
    try:
        view = PoolView(pool.paths)
        where = f"cgroup {pool.version}, pool cgroup {pool.path}" + (
            f"; {pool.backend.note}" if pool.backend.note else ""
        )
        # The child joins the trial env's cgroup(s) itself: moving this process
        # there for the fork would move all its threads (a Ray actor has dozens),
        # past the trial's pids limit, and the fork would fail.
        procs = [str(path) for path in pool.procs_files(0)]
        child = subprocess.Popen(
            [sys.executable, "-S", "-c", _TRIAL_CHILD, *procs],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

        def settled():  # in the trial cgroup, charged, and (with a pids limit) refused a fork
            return child.pid in view.procs(0) and pool.usage(0) > 0 and (not pool.limits_pids or view.pids_refused(0))

        while time.monotonic() < deadline and child.poll() is None and not settled():
            time.sleep(0.02)
        findings.append(_memory_trial(pool, view, where))
        findings.append(_pids_trial(pool, view))
        findings.append(_freezer_trial(pool, deadline))
    finally:
        if child is not None:
            pool.kill(0)
            child.wait()
        removed = pool.close(time.monotonic() + 5)
    if not removed:
        findings.append(
            Finding(
                "memory cgroup",
                WARN,
                f"made trial cgroups under {pool.path} but could not remove them",
                f"sudo rmdir {pool.path}/* {pool.path}",
            )
        )
    return findings


def _memory_trial(pool, view, where: str) -> Finding:
    limit, swap, used = view.memory_limit(0), view.swap_limit(0), pool.usage(0)
    if pool.backend.risk:
        return Finding("memory cgroup", WARN, f"{pool.backend.risk} ({where})", "")
    if limit != _TRIAL_MEMORY or swap != 0 or used <= 0:
        return Finding(
            "memory cgroup",
            WARN,
            f"a trial env cgroup's memory limit reads {limit} (asked "
            f"{_TRIAL_MEMORY}), its swap {swap} (asked 0), its usage {used}: memory_limit or per-env "
            f"accounting is not what the pool asks ({where})",
            "",
        )
    return Finding(
        "memory cgroup",
        OK,
        f"a trial env cgroup took a {_TRIAL_MEMORY >> 20} MiB limit with swap off "
        f"and charged its process {used >> 10} KiB: per-env accounting and memory_limit work ({where})",
    )


def _pids_trial(pool, view) -> Finding:
    fix = (
        "cgroup v2: give the worker's cgroup the pids controller (systemd: Delegate=yes gives it; by hand: "
        "echo +pids > <the cgroup above>/cgroup.subtree_control)"
    )
    if not pool.limits_pids:
        return Finding(
            "pids cgroup",
            WARN,
            "no writable pids controller: the per-env pids limit and the pool's "
            "(limits.pids, limits.pool_pids) are not enforced, so a fork bomb is not bounded",
            fix,
        )
    refused, tasks, cap = view.pids_refused(0), view.pids_current(0), view.pids_limit()
    if not refused or tasks > _TRIAL_PIDS or cap != _TRIAL_POOL_PIDS:
        return Finding(
            "pids cgroup",
            WARN,
            f"a trial env cgroup with pids.max {_TRIAL_PIDS} holds {tasks} tasks "
            f"after {refused} refused fork(s), and the pool's cap reads {cap} (asked {_TRIAL_POOL_PIDS}): "
            "the pids limits are not enforced as the pool asks",
            fix,
        )
    return Finding(
        "pids cgroup",
        OK,
        f"a trial env cgroup with pids.max {_TRIAL_PIDS} refused {refused} fork(s) "
        f"past it, and the pool's cgroup took its cap (limits.pool_pids): fork bombs are bounded per env "
        "and per pool",
    )


def _freezer_trial(pool, deadline: float) -> Finding:
    if not pool.freezes:
        return Finding(
            "freezer cgroup",
            WARN,
            f"no freezer ({pool.freezer_note}): serialize_measurement cannot freeze envs outside their turn",
            "cgroup v1: mount the freezer hierarchy and run the worker "
            "as root; cgroup v2 (kernel 5.2+) has it in every cgroup",
        )
    pool.freeze(0)
    while time.monotonic() < deadline and not pool.frozen(0):
        time.sleep(0.01)
    frozen = pool.frozen(0)
    pool.thaw(0)
    if not frozen:
        return Finding(
            "freezer cgroup",
            WARN,
            f"a trial env cgroup did not freeze before the trial's {_TRIAL_SECONDS} s were up: serialize_measurement "
            "cannot rely on freezing envs outside their turn",
            "",
        )
    return Finding(
        "freezer cgroup",
        OK,
        "froze and thawed a trial env cgroup's processes: serialize_measurement freezes envs outside their turn",
    )


def _unreclaimable_kib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("SUnreclaim:"):
                return int(line.split()[1])
    raise OSError("/proc/meminfo has no SUnreclaim line")


# What the kernel may keep per memory cgroup before it is worth a warning: at
# 1000 envs this much more per env is ~12% of a template env's ~1.5 MiB.
_BOOKKEEPING_WARN_KIB = 192


def _memory_cgroup_bookkeeping(n: int, probes: int = 64) -> list[Finding]:
    """Kernel memory that each new memory cgroup costs on this host and that
    no cgroup is charged for, so that envs_per_gb() cannot show it.

    Linux keeps, per memory cgroup, a table with a slot for every filesystem
    superblock mounted since boot (its shrinker table: 1 KiB per 64). Each
    env's sandbox mounts a tmpfs, a proc and a devpts (and its IPC namespace has an
    mqueue one), so a pool of n envs makes the table ~n/16 KiB for each memory
    cgroup, and the high-water mark stays until reboot. A pool has a memory
    cgroup per env only where it sets a per-env memory limit (cgroup v1;
    always on v2), else three. Measured: the rise in unreclaimable slab while `probes`
    empty memory cgroups are made (median of three rounds)."""
    from boltzlabs.errors import CgroupUnavailable
    from boltzlabs.host.cgroups import CgroupPool

    try:
        pool = CgroupPool(None, per_env_memory=True)  # a memory cgroup per key, as a per-env memory limit makes
    except CgroupUnavailable:
        return []  # the memory cgroup finding above says why
    rounds = []
    try:
        for first in range(0, 3 * probes, probes):
            before = _unreclaimable_kib()
            for key in range(first, first + probes):
                pool.group(key)
            rounds.append(max(0, _unreclaimable_kib() - before) / probes)
    finally:
        pool.close(time.monotonic() + 10)
    per_group = sorted(rounds)[1]
    detail = (
        f"each memory cgroup made now costs ~{per_group:.0f} KiB of kernel memory that no cgroup is "
        f"charged for (the kernel's shrinker table); a pool with a memory cgroup per env (a per-env "
        f"memory limit, or cgroup v2) adds that per env on top of "
        f"envs_per_gb()'s figure (~{per_group * n / 1024:.0f} MiB at n={n}), and it grows with the "
        "number of filesystems mounted since boot (each env's sandbox mounts at least two)"
    )
    if per_group > _BOOKKEEPING_WARN_KIB:
        return [
            Finding(
                "memory cgroup bookkeeping",
                WARN,
                detail + ": a past run with many mounts raised it, and only a reboot lowers it",
                "reboot the host before sizing pools by envs_per_gb()",
            )
        ]
    return [Finding("memory cgroup bookkeeping", OK, detail)]


# -- file descriptors ------------------------------------------------------------------------


def _fd_limit(n: int) -> list[Finding]:
    from boltzlabs.worker.config import FD_SLACK, FDS_PER_ENV, PIPES, SOCKETPAIR, envs_within, fds_needed

    want = fds_needed(n)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    nr_open = int(_sysctl("fs.nr_open") or 0)
    show = lambda v: "unlimited" if v == resource.RLIM_INFINITY else str(v)  # noqa: E731
    most = lambda limit: "any number of" if limit == resource.RLIM_INFINITY else str(envs_within(limit))  # noqa: E731
    detail = (
        f"open files: soft {show(soft)}, hard {show(hard)}; a pool of {n} envs needs ~{want} "
        f"({FDS_PER_ENV[PIPES]} per env + {FD_SLACK}; {FDS_PER_ENV[SOCKETPAIR]} per env on the "
        f"socketpair channel a worker falls back to, ~{fds_needed(n, SOCKETPAIR)})"
    )
    if hard == resource.RLIM_INFINITY or hard >= want:
        return [
            Finding("fd limit", OK, detail + f"; the worker raises its soft limit itself (room for {most(hard)} envs)")
        ]
    if os.geteuid() == 0 and nr_open >= want:
        return [
            Finding(
                "fd limit",
                OK,
                detail + f"; as root the worker raises the hard limit itself "
                f"(fs.nr_open = {nr_open}: room for {most(nr_open)} envs)",
            )
        ]
    if hard != resource.RLIM_INFINITY and fds_needed(n, SOCKETPAIR) <= hard < want:
        return [
            Finding(
                "fd limit",
                OK,
                detail + f"; this hard limit holds them on socketpairs (room for "
                f"{most(hard)} envs), which cost the worker more CPU per step than pipes",
            )
        ]
    fix = (
        f"ulimit -Hn {want} && ulimit -n {want}   # as root; for a service: LimitNOFILE={want}; "
        f"persist in /etc/security/limits.conf: '* hard nofile {want}'"
    )
    if nr_open and want > nr_open:  # no process may have more than fs.nr_open
        fix = f"sudo sysctl -w fs.nr_open={want} && " + fix
    return [Finding("fd limit", FAIL, detail + f"; this hard limit allows {most(hard)} envs", fix)]


# -- versions --------------------------------------------------------------------------------


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _versions() -> list[Finding]:
    import boltzlabs

    python = platform.python_version()
    findings = [
        Finding(
            "python",
            OK if sys.version_info >= (3, 11) else FAIL,
            f"Python {python} ({sys.executable})",
            "" if sys.version_info >= (3, 11) else "install Python >= 3.11",
        ),
        Finding("kernel", OK, f"Linux {platform.release()} ({platform.machine()})"),
    ]
    versions = [f"boltzlabs {boltzlabs.__version__}"]
    missing = []
    for name in _PACKAGES:
        version = _version(name)
        versions.append(f"{name} {version}" if version else f"{name} MISSING")
        if version is None:
            missing.append(name)
    findings.append(
        Finding(
            "packages",
            FAIL if missing else OK,
            ", ".join(versions),
            f"pip install {' '.join(missing)}" if missing else "",
        )
    )
    for name, why in _OPTIONAL.items():
        version = _version(name)
        findings.append(
            Finding(name, OK, f"{name} {version}")
            if version
            else Finding(name, WARN, f"{name} is not installed (optional)", why.split(": ", 1)[1])
        )
    return findings
