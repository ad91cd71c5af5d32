"""One attempt, in the process that runs the submitted code: a child of the env's
server (forked, the default) or a fresh interpreter (runner="subprocess", which
runs this file). It finds its files in the attempt's directory, solution.py (the
action) and test_solution.py, runs each `test_*` function, and writes what passed
as JSON to `result_fd`. Its stdout and stderr are the attempt's log.

Nothing here is trusted by the server: the submitted code runs in this process and
can change any of it. It can make its own lane's reward what it likes; what it
cannot reach is another lane (docs/code-rl.md).
"""

import json
import math
import os
import resource
import sys
import time
import traceback
import types


def confine(cpu_limit, mode):
    """Limits that bind this process and every process it starts."""
    if mode == "tests":
        # Below the lane's server, which must get a core to enforce the limits however many
        # processes (a fork bomb's 31) this attempt makes. Not for a timing (mode "speed"), where
        # the gate keeps the pool's other lanes off the cores.
        os.nice(19)
        # SCHED_IDLE as well: the server, woken by its timer on this process's CPU clock, then
        # preempts it at once where it runs, and a core running only idle-policy tasks counts
        # as free when the kernel places the server's wake-up. With RLIMIT_NICE 0 a process at
        # nice 19 cannot leave SCHED_IDLE again (sched(7)), nor can any process it starts.
        resource.setrlimit(resource.RLIMIT_NICE, (0, 0))
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    # A backstop for the server's CPU watch (env.py): RLIMIT_CPU counts whole seconds and
    # cannot be raised again by the code (soft = hard); SIGXCPU at the limit, SIGKILL a second later.
    seconds = math.ceil(cpu_limit) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds + 1))
    try:  # make this process the OOM killer's first choice in the lane, not the server
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass  # spawn="exec" mounts /proc read-only; the balloon is the biggest process anyway


def describe(exc, sources, limit=4):
    """An exception as the log shows it: the last `limit` frames in `sources` (file name ->
    text: solution.py and test_solution.py), each with its line, then the type and message.
    Not the traceback module: its source lookups and caret parsing cost a forked attempt
    ~3 ms of copied pages (measured at 1000 lanes), more than a whole run of passing tests,
    and an attempt that does not import is the common case for a policy early in training."""
    lines = []
    tb = exc.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if name in sources:
            lines.append(f'  File "{name}", line {tb.tb_lineno}, in {tb.tb_frame.f_code.co_name}')
            text = sources[name].splitlines()[tb.tb_lineno - 1 : tb.tb_lineno]
            lines += [f"    {text[0].strip()[:200]}"] if text else []
        tb = tb.tb_next
    lines = lines[-2 * limit :]
    if isinstance(exc, SyntaxError) and exc.filename in sources:
        lines.append(f'  File "{exc.filename}", line {exc.lineno}\n    {(exc.text or "").strip()[:200]}')
    lines.append(f"{type(exc).__name__}: {str(exc)[:500]}")
    return "\n".join(lines)


def run_tests():
    """The names of the test functions that passed; each test's line goes to stdout."""
    namespace = {"__name__": "test_solution", "__file__": "test_solution.py"}
    sources = {}
    try:
        # solution.py is loaded by path: the workspace is never put on sys.path, so no other
        # file the action writes there is imported.
        solution = types.ModuleType("solution")
        solution.__file__ = os.path.abspath("solution.py")
        sys.modules["solution"] = solution
        for name, scope in (("solution.py", solution.__dict__), ("test_solution.py", namespace)):
            with open(name) as f:
                sources[name] = f.read()
            exec(compile(sources[name], name, "exec"), scope)  # solution.py: the action runs here
    except BaseException as exc:
        print("ERROR importing the solution:")
        print(describe(exc, sources))
        return [], namespace
    passed = []
    for name, test in list(namespace.items()):
        if name.startswith("test_") and callable(test):
            try:
                test()
            except BaseException as exc:
                print(f"FAILED {name}: {type(exc).__name__}: {str(exc)[:200]}")
            else:
                passed.append(name)
                print(f"PASSED {name}")
    return passed, namespace


def best_time(timer):
    """CPU seconds per run of the workload: the best of 5 repeats of about 10 ms each. CPU time,
    not wall time: what another process of the node takes while this one waits is not counted
    (what it does to the caches and the clock is: hence serialize_measurement=True)."""
    number = 1
    while (spent := timer.timeit(number)) < 0.01 and number < 1 << 20:
        number = number * 10 if spent < 0.001 else max(number + 1, int(number * 0.012 / max(spent, 1e-9)))
    return min(timer.timeit(number) for _ in range(5)) / number


def measure(task, function):
    """The submitted function's speed against the reference's on the task's workload:
    reference time / submitted time (1.0: as fast, 2.0: twice as fast)."""
    import timeit

    reference = {}
    exec(task["reference"], reference)
    ref = best_time(timeit.Timer(task["workload"], timer=time.process_time, globals=reference))
    sub = best_time(timeit.Timer(task["workload"], timer=time.process_time, globals={function.__name__: function}))
    print(f"speed: reference {ref * 1e6:.1f} us, submitted {sub * 1e6:.1f} us per workload run")
    return ref / sub


def child(result_fd, mode, task_name, cpu_limit):
    """Run the attempt in the current directory and exit; never returns."""
    result = {"passed": []}
    try:
        confine(cpu_limit, mode)
        passed, namespace = run_tests()
        result["passed"] = passed
        if mode == "speed":
            import tasks

            task = tasks.TASKS[task_name]
            if len(passed) == task["tests"].count("\ndef test_"):
                result["speed"] = measure(task, namespace[task_name])
            else:
                print("speed: not measured, the tests do not all pass")
    except BaseException:
        traceback.print_exc(limit=-4, file=sys.stdout)
    finally:
        try:
            sys.stdout.flush()
            os.write(result_fd, json.dumps(result).encode())
        finally:
            os._exit(0)


if __name__ == "__main__":  # runner="subprocess": python harness.py RESULT_FD MODE TASK CPU_LIMIT
    child(int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4]))
