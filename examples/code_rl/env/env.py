"""A code env: the action is Python source, the reward what its tests say of it.

Each step writes the action to the workspace as solution.py, beside the task's
test file, and runs the tests in a child process under a CPU and a wall-time
limit; the reward is the share of the tests that passed (params mode="tests"), or
with mode="speed" the submitted function's speed against a reference solution's
(0 unless every test passes; run it in a pool made with serialize_measurement=True,
so no other lane runs while one is timed). The observation is a str: the task
and the last attempt's outcome and log, at most `log_bytes` of it. An episode is
`attempts` attempts at one task (chosen by the reset's seed); it ends early when
every test passes.

The child is forked from this server (runner="fork", the default: a few ms and
little memory per attempt) or is a fresh interpreter (runner="subprocess").
It runs in a process group of its own, and when the attempt ends every other process of
the lane is killed (reap="lane"), a setsid daemon the code started included;
with reap="group" only the attempt's process group is, and a daemon lives on
until the lane's scrub or hard reset (`pool.reset(where=..., scrub=True)`).
info["strays"] says how many processes an attempt left running. Files stay
until the scrub. census() (pool.call("census")) lists the lane's processes
and files from inside.

    RLPool("examples/code_rl/env", n, params={"attempts": 2, "cpu_limit": 0.02, "time_limit": 20.0}, cpu_share=True, ...)

docs/code-rl.md says what one lane can and cannot do to another, and which
pool limits to set.
"""

import ctypes
import json
import os
import select
import signal
import sys
import time

import harness
import tasks

from boltzlabs.env import params, serve

P = params()
KNOWN = {"mode", "attempts", "cpu_limit", "time_limit", "runner", "reap", "log_bytes", "max_source"}
if set(P) - KNOWN:  # a pool option this boltzlabs does not know would arrive here as a param
    raise ValueError(f"unknown params {sorted(set(P) - KNOWN)}: this env takes {sorted(KNOWN)}")
MODE = P.get("mode", "tests")  # "tests": reward = share of tests passed; "speed": measured speed
ATTEMPTS = int(P.get("attempts", 2))  # attempts per episode
CPU_LIMIT = float(P.get("cpu_limit", 0.02))  # CPU seconds of an attempt: its processes together
TIME_LIMIT = float(P.get("time_limit", 20.0))  # wall seconds of an attempt: for code that blocks or sleeps
RUNNER = P.get("runner", "fork")  # "fork" or "subprocess"
# After an attempt: "lane" kills every process of the lane but this server (a setsid daemon the
# code started included); "group" kills the attempt's process group only, so a daemon lives on
# until the lane's scrub or hard reset.
REAP = P.get("reap", "lane")
LOG_BYTES = int(P.get("log_bytes", 16 << 10))  # the most of an attempt's log the obs carries
MAX_SOURCE = int(P.get("max_source", 64 << 10))  # a longer action is refused, not written
if MODE not in ("tests", "speed") or RUNNER not in ("fork", "subprocess") or REAP not in ("lane", "group"):
    raise ValueError(f"mode, runner or reap not known: {MODE!r}, {RUNNER!r}, {REAP!r}")

# Each env's own directory: with envs_per_sandbox=k the k envs of a sandbox share the workspace.
RUN_DIR = os.path.join(os.getcwd(), f"run-{os.environ.get('BOLTZLABS_ENV_INDEX', '0')}")
HARNESS = os.path.abspath(harness.__file__)
CORES = os.cpu_count() or 1
RESULT_BYTES = 64 << 10

state = {"task": tasks.NAMES[0], "attempt": 0, "total": 1}

# The server's timers on its attempt's processes' CPU clocks (Watch) send it SIGUSR1 once one of
# them has used its part of the budget left; the signal wakes wait_child through this pipe.
TIMER_R, TIMER_W = os.pipe()
os.set_blocking(TIMER_R, False)
os.set_blocking(TIMER_W, False)
signal.signal(signal.SIGUSR1, lambda *_: None)
signal.set_wakeup_fd(TIMER_W)

# The attempts are this server's children, as the same user: without this they could open
# /proc/<server>/mem (writable in template mode), rewrite the server and so skip its scrub,
# or read /proc/<server>/environ and fds. A process that is not dumpable is out of their reach.
LIBC = ctypes.CDLL(None, use_errno=True)
if LIBC.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE, 0
    raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0)")


# -- the server's timers on its attempt's processes' CPU clocks (Watch) --------------------------


class _Sigevent(ctypes.Structure):  # struct sigevent (64 bytes): what the timer does when it fires
    _fields_ = [
        ("value", ctypes.c_void_p),
        ("signo", ctypes.c_int),
        ("notify", ctypes.c_int),
        ("pad", ctypes.c_int * 12),
    ]


class _Timespec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("interval", _Timespec), ("value", _Timespec)]


def cpu_timer(clock, signo):
    """A POSIX timer of this server's that sends it `signo` once the CPU clock `clock` (another
    process's: process_clock) has counted what arm_timer() sets; disarmed until then. The
    clock's nanoseconds, looked at by the kernel every tick, so at most a tick late, and the
    process it counts cannot touch it. Not setitimer(ITIMER_PROF), which counts CPU in whole
    ticks charged to whichever process a tick finds running (it ended honest 7 ms attempts at a
    20 ms limit), and only its own process's. Returns the timer (delete_timer)."""
    event, timer = _Sigevent(signo=signo, notify=0), ctypes.c_void_p()  # SIGEV_SIGNAL
    if LIBC.timer_create(clock, ctypes.byref(event), ctypes.byref(timer)) != 0:
        raise OSError(ctypes.get_errno(), "timer_create")
    return timer


def arm_timer(timer, seconds):
    """Set `timer` to fire once its clock has counted `seconds` more (0: disarmed)."""
    spec = _Itimerspec(value=_Timespec(int(seconds), int(seconds % 1 * 1e9)))
    if LIBC.timer_settime(timer, 0, ctypes.byref(spec), None) != 0:
        raise OSError(ctypes.get_errno(), "timer_settime")


def process_clock(pid):
    """The CPU clock of process `pid` (clock_getcpuclockid(3)): every thread of it, in ns."""
    clock = ctypes.c_int()
    err = LIBC.clock_getcpuclockid(pid, ctypes.byref(clock))
    if err:
        raise OSError(err, "clock_getcpuclockid")
    return clock.value


def delete_timer(timer):
    LIBC.timer_delete(timer)


def drain(fd):
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def reap():
    """Collect exited children. In template mode this server is pid 1 of its lane, so
    every orphan of an attempt (a setsid daemon, once killed) ends up its child."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def others():
    """The pids of the lane's live processes but this server and the namespace's init."""
    me, pids = os.getpid(), []
    for p in os.listdir("/proc"):
        if p.isdigit() and int(p) not in (1, me):
            try:
                with open(f"/proc/{p}/stat", "rb") as f:
                    if f.read().rsplit(b")", 1)[1].split()[0] != b"Z":
                        pids.append(int(p))
            except (OSError, IndexError):
                pass  # gone meanwhile
    return pids


def kill_others():
    """SIGKILL every process of the lane but this server, until none is left (a fork bomb may
    still be forking); returns how many there were. kill(-1) reaches exactly the lane's pid
    namespace, less its init: this server in template mode, bubblewrap's in exec mode."""
    left = others()
    count, deadline = len(left), time.monotonic() + 2.0
    while left and time.monotonic() < deadline:
        # A pidfd of each, then the kill: each is waited for by its pidfd (readable once it has
        # exited), not by listing /proc again and again while they die. A process ends in its own
        # context, at its nice 19, so this server sleeps in poll() meanwhile, off the cores they need.
        poller, fds = select.poll(), []
        for pid in left:
            try:
                fds.append(os.pidfd_open(pid))
                poller.register(fds[-1], select.POLLIN)
            except OSError:
                pass  # gone already
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            waiting = len(fds)
            while waiting and time.monotonic() < deadline:
                for fd, _ in poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
                    poller.unregister(fd)
                    waiting -= 1
        finally:
            for fd in fds:
                os.close(fd)
        reap()
        left = others()  # what was forked between the list and the kill
    return count


def statement(task):
    return f"# task: {task}\n{tasks.TASKS[task]['statement']}\n"


def reset(seed, options=None):
    reap()
    task = tasks.task_for(seed)
    state.update(task=task, attempt=0, total=tasks.TASKS[task]["tests"].count("\ndef test_"))
    return statement(task) + f"(attempt 1 of {ATTEMPTS})\n", {"task": task}


def write_attempt(source):
    os.makedirs(RUN_DIR, exist_ok=True)
    for name, text in (("solution.py", source), ("test_solution.py", tasks.TASKS[state["task"]]["tests"])):
        fd = os.open(
            os.path.join(RUN_DIR, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644
        )
        try:
            data = text.encode()
            while data:
                data = data[os.write(fd, data) :]
        finally:
            os.close(fd)


def cpu_seconds(pid):
    """CPU time of one process so far (all its threads), or None once it is gone: schedstat's
    nanoseconds. stat's clock ticks (10 ms) would count a fork bomb's 31 short lives as nothing."""
    try:
        with open(f"/proc/{pid}/schedstat", "rb") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def lane_cpu():
    """{pid: CPU seconds so far} of the lane's processes but this server."""
    return {pid: cpu for pid in others() if (cpu := cpu_seconds(pid)) is not None}


class Watch:
    """The CPU the lane's processes (but this server) use during one attempt, every process of
    them together. A census lists the lane's processes and opens the schedstat of each new one;
    a look re-reads each through its fd. A process that ends keeps what it used while it was
    known (a fork bomb's short lives would otherwise count as nothing).

    Between looks, a timer of this server's on each known process's CPU clock (SIGUSR1, which
    wakes wait_child) fires once that process alone has used its part of what is left, the
    budget left split evenly over the k processes known (arm()): the k together cannot use what
    is left without one of them using a k-th of it, so the watch hears of it, exactly, however
    long it was waiting for a core and whatever the processes did to timers of their own. Only
    processes born since the last census are not timed; the census catches them."""

    def __init__(self, before, child):
        self.before = before  # {pid: CPU seconds} when the attempt began (lane_cpu())
        self.fds = {}  # pid -> its schedstat, open
        self.timers = {}  # pid -> this server's timer on its CPU clock
        self.seen = {}  # pid -> its CPU seconds at the last look
        self.gone = 0.0  # what processes that ended used during the attempt
        self.add(child)

    def add(self, pid):
        try:
            self.fds[pid] = os.open(f"/proc/{pid}/schedstat", os.O_RDONLY | os.O_CLOEXEC)
            self.timers[pid] = cpu_timer(process_clock(pid), signal.SIGUSR1)
        except OSError:
            pass  # gone already

    def census(self):
        for pid in others():
            if pid not in self.fds:
                self.add(pid)

    def used(self):
        for pid, fd in list(self.fds.items()):
            try:
                self.seen[pid] = int(os.pread(fd, 64, 0).split()[0]) / 1e9
            except (OSError, IndexError, ValueError):  # ended and reaped (its pid may come again)
                self.drop(pid)
                self.gone += self.seen.pop(pid, 0.0) - self.before.get(pid, 0.0)
        return self.gone + sum(cpu - self.before.get(pid, 0.0) for pid, cpu in self.seen.items())

    def arm(self, left):
        """Each known process's timer to fire after its k-th of `left` CPU seconds more."""
        part = max(left, 0.0005) / max(1, len(self.timers))
        for pid, timer in list(self.timers.items()):
            try:
                arm_timer(timer, part)
            except OSError:
                self.drop(pid)

    def drop(self, pid):
        fd, timer = self.fds.pop(pid, None), self.timers.pop(pid, None)
        if fd is not None:
            os.close(fd)
        if timer is not None:
            delete_timer(timer)

    def close(self):
        for pid in list(self.fds):
            self.drop(pid)


def start_child(result_w, log_fd):
    """The attempt's process, in a session of its own, its cwd the attempt's directory."""
    if RUNNER == "subprocess":
        import subprocess

        argv = [sys.executable, "-S", "-B", HARNESS, str(result_w), MODE, state["task"], str(CPU_LIMIT)]
        child = subprocess.Popen(
            argv,
            cwd=RUN_DIR,
            stdin=subprocess.DEVNULL,
            stdout=log_fd,
            stderr=log_fd,
            pass_fds=(result_w,),
            process_group=0,
        )
        child.returncode = 0  # this server waits for it itself (wait_child); Popen must not
        return child.pid
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:  # the child: nothing of the server's but the two fds it is given
        try:
            signal.set_wakeup_fd(-1)  # the server's (its fd is closed below)
            # A process group of its own, in the lane's session, not a session of its own: where the
            # kernel schedules by session (autogroup, on in Debian's and Ubuntu's kernels) a lane's
            # processes then weigh as one, however many a fork bomb makes, and under nice 19 (the
            # harness) they give way to this server, which must wake to enforce the limits.
            os.setpgid(0, 0)
            os.chdir(RUN_DIR)
            os.dup2(log_fd, 1)
            os.dup2(log_fd, 2)
            os.dup2(result_w, 3)
            os.closerange(4, os.sysconf("SC_OPEN_MAX"))  # the pool's channel and slot among them
            harness.child(3, MODE, state["task"], CPU_LIMIT)
        finally:
            os._exit(70)
    return pid


def wait_child(pid, result_r, before):
    """Wait for the attempt within its limits; returns (what it wrote, its outcome or None, the CPU
    seconds its own process used).
    `before`: lane_cpu() when it started, so processes an earlier attempt left are counted
    only for what they use during this one."""
    pidfd = os.pidfd_open(pid)
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    poller.register(result_r, select.POLLIN)
    poller.register(TIMER_R, select.POLLIN)
    drain(TIMER_R)  # a signal of an earlier attempt's timer
    watch = Watch(before, pid)
    watch.arm(CPU_LIMIT)
    data, limit, began, used = bytearray(), None, time.monotonic(), 0.0
    try:
        while True:
            # Look again when the lane could first be at its limit using every core (an honest
            # attempt has ended by then), and no sooner than half the time it has run: with 1,000
            # attempts waiting for 2 cores, a look every few ms per lane is 100,000 wake-ups a
            # second, more than the attempts' own work (measured: honest attempts then passed
            # their 20 s time limit). So a lane that waited for a core and then gets one may pass
            # the limit by up to that half before this looks, but for the Watch's timers, which
            # wake this loop the moment a process has used its part of what is left.
            elapsed = time.monotonic() - began
            wait = min(TIME_LIMIT - elapsed, max(0.01, (CPU_LIMIT - used) / CORES, elapsed / 2))
            events = dict(poller.poll(max(0.0, wait) * 1000))
            if events.get(result_r):
                chunk = os.read(result_r, 1 << 16)
                if chunk and len(data) < RESULT_BYTES:
                    data += chunk
                elif not chunk:
                    poller.unregister(result_r)
            if events.get(pidfd):
                break
            if events.get(TIMER_R):
                drain(TIMER_R)  # a process used its part of what was left (Watch): look now
            now = time.monotonic()
            watch.census()
            used = watch.used()
            if used >= CPU_LIMIT:
                limit = f"CPU limit: killed after {used:.2f} s of CPU (cpu_limit={CPU_LIMIT:g})"
                break
            watch.arm(CPU_LIMIT - used)
            if now - began >= TIME_LIMIT:
                limit = f"time limit: still running after {TIME_LIMIT:g} s (time_limit)"
                break
    finally:
        # The child and its process group; a member that called setsid() escapes this (step()
        # counts it as a stray, and with reap="lane" kills it).
        for kill in (lambda: signal.pidfd_send_signal(pidfd, signal.SIGKILL), lambda: os.killpg(pid, signal.SIGKILL)):
            try:
                kill()
            except OSError:
                pass
        os.close(pidfd)
        watch.close()
    _, status, usage = os.wait4(pid, 0)
    cpu = usage.ru_utime + usage.ru_stime  # the attempt's own process (and the children it waited for)
    os.set_blocking(result_r, False)
    try:
        while len(data) < RESULT_BYTES and (chunk := os.read(result_r, 1 << 16)):
            data += chunk
    except BlockingIOError:
        pass
    reap()
    if limit is None and os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU:
            limit = "CPU limit: killed by SIGXCPU (RLIMIT_CPU)"
        elif sig == signal.SIGKILL:
            limit = "killed by SIGKILL: the lane's memory limit, most likely (the OOM killer)"
        else:
            limit = f"crashed: killed by {signal.Signals(sig).name}"
    return bytes(data), limit, cpu


def read_log():
    """The end of the attempt's log: at most LOG_BYTES, whatever the code left in its place."""
    try:
        fd = os.open(os.path.join(RUN_DIR, "output.log"), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        return f"(no log: {exc})"
    try:
        size = os.fstat(fd).st_size
        return os.pread(fd, LOG_BYTES, max(0, size - LOG_BYTES)).decode("utf-8", "replace")
    except OSError as exc:
        return f"(no log: {exc})"
    finally:
        os.close(fd)


def attempt(source):
    """Run one attempt: (outcome, names of the tests that passed, speed or None, wall ms, log, CPU s)."""
    began = time.monotonic()
    try:
        write_attempt(source)
        log_fd = os.open(
            os.path.join(RUN_DIR, "output.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK
        )
    except OSError as exc:  # its workspace is full, or the code left something in the way
        return f"could not write the attempt: {exc}", [], None, 0.0, "", 0.0
    result_r, result_w = os.pipe()
    before = lane_cpu()
    try:
        pid = start_child(result_w, log_fd)
    except OSError as exc:  # at the pids limit: a fork bomb of an earlier attempt is still there
        os.close(result_r)
        return f"could not start the attempt: {exc}", [], None, 0.0, "", 0.0
    finally:
        os.close(result_w)
        os.close(log_fd)
    try:
        data, limit, cpu = wait_child(pid, result_r, before)
    finally:
        os.close(result_r)
    ms, log = (time.monotonic() - began) * 1000, read_log()
    if limit is not None:
        return limit, [], None, ms, log, cpu
    try:
        result = json.loads(data)
        passed = sorted({str(name) for name in result["passed"]})
        speed = result.get("speed")
        speed = None if speed is None else min(100.0, max(0.0, float(speed)))
    except (ValueError, TypeError, KeyError):
        return "exited without a result", [], None, ms, log, cpu
    return "ran", passed, speed, ms, log, cpu


def step(action):
    state["attempt"] += 1
    if isinstance(action, str) and len(action) <= MAX_SOURCE:
        outcome, passed, speed, ms, log, cpu = attempt(action)
    else:
        outcome, passed, speed, ms, log, cpu = f"refused: not a str of at most {MAX_SOURCE} chars", [], None, 0, "", 0.0
    # What the attempt left running once it ended (a setsid daemon escapes its process group's kill).
    strays = kill_others() if REAP == "lane" else len(others())
    total = state["total"]
    # A test name the code made up does not count; nor more than the file holds.
    count = min(total, sum(1 for name in passed if name.startswith("test_")))
    solved = count == total
    reward = count / total if MODE == "tests" else (speed or 0.0) if solved else 0.0
    over = state["attempt"] >= ATTEMPTS
    obs = (
        statement(state["task"])
        + f"(attempt {state['attempt']} of {ATTEMPTS})\n# last run: {outcome}; {count}/{total} tests passed"
        + ("" if speed is None else f"; speed {speed:.3f}x the reference")
        + f" ({ms:.0f} ms)\n{log}"
    )
    info = {"task": state["task"], "outcome": outcome, "passed": count, "total": total, "strays": strays, "cpu": cpu}
    if speed is not None:
        info["speed"] = speed
    terminated = solved and MODE == "tests"
    return obs, float(reward), terminated, over and not terminated, info


def census():
    """What is in the lane besides this server: its processes and its files (workspace and /dev/shm)."""
    reap()
    procs = []
    for pid in others():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                procs.append([pid, f.read(200).replace(b"\0", b" ").decode("utf-8", "replace").strip()])
        except OSError:
            pass
    files = []
    for top in (os.getcwd(), "/dev/shm"):
        for root, dirs, names in os.walk(top):  # links are listed, never followed
            files += [os.path.join(root, n) for n in dirs + names][: 1000 - len(files)]
            if len(files) >= 1000:
                break
    return {"processes": procs, "files": sorted(files)}


serve(reset=reset, step=step, methods={"census": census})
