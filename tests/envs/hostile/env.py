"""A hostile test env for tests/test_limits.py: each action is an attack on a limit.

A number (or anything that is not a dict) is a normal step that answers with
its own lane and the action, so a test can tell that a lane got its own data.
A dict {"op": ...} runs one attack and answers what it saw.
"""

import os
import resource
import signal
import struct
import time

from boltzlabs.env import serve

MiB = 1 << 20


def lane() -> int:
    return int(os.environ.get("BOLTZLABS_ENV_INDEX", "-1"))


def forever(ignore_signals: bool = True):
    if ignore_signals:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
    while True:
        time.sleep(3600)


def fork_until_refused():
    """Fork sleeping children until the kernel refuses: (count, the refusal)."""
    count = 0
    while True:
        try:
            pid = os.fork()
        except OSError as exc:
            return count, f"{type(exc).__name__}: {exc}"
        if pid == 0:
            forever()
        count += 1


def bomb():
    """Every process forks forever, retrying when refused: the limit stays full."""
    while True:
        try:
            os.fork()
        except OSError:
            time.sleep(0.05)


def rlimits():
    out = {}
    for name in ("NOFILE", "FSIZE", "CORE", "NPROC"):
        out[name] = list(resource.getrlimit(getattr(resource, f"RLIMIT_{name}")))
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard + 1, hard + 1))
        out["raise"] = "allowed"
    except (ValueError, OSError) as exc:
        out["raise"] = f"{type(exc).__name__}: {exc}"
    return out


def open_files():
    held = []
    try:
        while True:
            held.append(os.open("/dev/null", os.O_RDONLY))
    except OSError as exc:
        return {"opened": len(held), "error": f"{type(exc).__name__}: {exc}", "errno": exc.errno}
    finally:
        for fd in held:
            os.close(fd)


def fill(name: str):
    """Write to a file until the kernel says no: how much and why."""
    written = 0
    chunk = b"x" * MiB
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        while True:
            written += os.write(fd, chunk)
    except OSError as exc:
        return {"written": written, "errno": exc.errno, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        os.close(fd)


def abort_child():
    """A child dumps core (SIGABRT) in the workspace: was a core written?"""
    pid = os.fork()
    if pid == 0:
        os.abort()
    _, status = os.waitpid(pid, 0)
    return {"signal": os.WTERMSIG(status), "core_dumped": os.WCOREDUMP(status), "files": sorted(os.listdir("."))}


def emit(chunks, gap):
    """Raw bytes on the channel, chunk by chunk: whatever the worker makes of them."""
    for chunk in chunks:
        os.write(3, chunk)
        if gap:
            time.sleep(gap)


def ops(action):
    op = action["op"]
    if op == "rlimits":
        return rlimits()
    if op == "fork_until_refused":
        count, refusal = fork_until_refused()
        if action.get("then") == "exit":
            os._exit(11)  # as a shell does when fork fails
        return {"forked": count, "refused": refusal}
    if op == "bomb":
        if os.fork() == 0:
            bomb()
        time.sleep(action.get("s", 1.0))  # let it fill the limit
        count, refusal = fork_until_refused()
        return {"forked": count, "refused": refusal}
    if op == "daemons":
        if os.fork() == 0:  # a child that ignores SIGTERM, SIGINT and SIGHUP
            forever()
        if os.fork() == 0:  # a double-forked daemon in its own session
            os.setsid()
            if os.fork() == 0:
                forever()
            os._exit(0)
        time.sleep(0.2)
        return {"daemons": True}
    if op == "open_files":
        return open_files()
    if op == "fill":
        return fill(action.get("name", "fill.bin"))
    if op == "fsize":
        if action.get("signal"):
            signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # as a C program has it
        return fill("big.bin")
    if op == "abort_child":
        return abort_child()
    if op == "alloc":
        block = bytearray(action["mb"] * MiB)
        for i in range(0, len(block), 4096):
            block[i] = 1
        return {"held_mb": action["mb"]}
    if op == "flood":
        chunk = b"x" * MiB
        for _ in range(action["mb"]):
            os.write(1, chunk)
        return {"flooded": action["mb"]}
    if op == "prefix":
        os.write(3, struct.pack("<I", action["length"]) + b"\x93")
        time.sleep(action.get("s", 5))
        return {"prefix": "sent"}
    if op == "emit":
        emit(action["chunks"], action.get("gap", 0))
        if action.get("then") == "exit":
            os._exit(0)
        return {"emitted": True}
    if op == "spin":
        while True:
            pass
    raise KeyError(op)


def reset(seed, options=None):
    return {"lane": lane(), "seed": seed}


def step(action):
    if isinstance(action, dict):
        return {"lane": lane(), "out": ops(action)}, 0.0, False, {}
    return {"lane": lane(), "echo": action}, float(lane()), False, {"lane": lane()}


serve(reset=reset, step=step)
