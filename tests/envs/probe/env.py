"""A test env that does what its action says: faults, escapes, probes.

A number is a normal step (reward = the number). A dict {"op": ...} runs one
behaviour; probes answer {"ok": value} or {"denied": "ErrorName: text"}.
"""

import ctypes
import os
import random
import socket
import sys
import time

from boltzlabs.env import serve

print("probe env importing", flush=True)  # stray output at import: goes to the log
os.write(1, b"raw write at import\n")

state = {"t": 0, "episodes": 0, "rng": random.Random(0), "hold": []}


def reset(seed, options=None):
    state["t"] = 0
    state["episodes"] += 1
    state["rng"] = random.Random(seed)
    sys.stdout.write("reset called\n")
    if options and options.get("raise"):
        raise RuntimeError("reset failed on purpose")
    return {"t": 0, "episodes": state["episodes"], "seed": seed}, {"reset_info": True}


def probe(fn):
    try:
        return {"ok": fn()}
    except Exception as exc:
        return {"denied": f"{type(exc).__name__}: {exc}"}


def read(path):
    with open(path, "rb") as f:
        return f.read(200).decode("latin-1")


def write(path):
    with open(path, "w") as f:
        f.write("pwned")
    return path


def connect(host, port):
    with socket.create_connection((host, port), timeout=1) as s:
        return s.recv(100).decode()


def abstract(name):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1)
    s.connect("\0" + name)
    return s.recv(100).decode()


def ops(action):
    op = action["op"]
    if op == "sleep":
        time.sleep(action["s"])
        return {"slept": action["s"]}
    if op == "raise":
        raise ValueError("step failed on purpose")
    if op == "exit":
        os._exit(action.get("code", 3))
    if op == "sys_exit":  # SystemExit out of step, hence out of serve(): the interpreter exits with it
        sys.exit(action.get("code", 0))
    if op == "segv":
        ctypes.string_at(0)
    if op == "loop":
        while True:
            pass
    if op == "flood":
        chunk = b"x" * (1 << 20)
        for _ in range(action["mb"]):
            os.write(1, chunk)
        return {"flooded": action["mb"]}
    if op == "garbage":
        os.write(action.get("fd", 3), b"\xc1\xc1garbage that is not a frame" * 4)
        time.sleep(0.2)
        return {"garbage": True}
    if op == "trickle":  # a frame's length, then its body a byte at a time, never all of it
        fd = action.get("fd", 3)
        os.write(fd, (1 << 16).to_bytes(4, "little"))
        for _ in range(action["bytes"]):
            os.write(fd, b"\x90")
            time.sleep(action["every"])
        return {"trickled": action["bytes"]}
    if op == "print":
        print("hello from step")
        sys.stdout.write("more stray output\n")
        os.write(1, b"raw fd 1 write\n")
        os.write(2, b"raw fd 2 write\n")
        return {"printed": True}
    if op == "read":
        return probe(lambda: read(action["path"]))
    if op == "write":
        return probe(lambda: write(action["path"]))
    if op == "listdir":
        return probe(lambda: sorted(os.listdir(action["path"])))
    if op == "environ":
        return dict(os.environ)
    if op == "connect":
        return probe(lambda: connect(action["host"], action["port"]))
    if op == "abstract":
        return probe(lambda: abstract(action["name"]))
    if op == "pids":
        return sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    if op == "alloc":
        block = bytearray(action["mb"] << 20)
        for i in range(0, len(block), 4096):
            block[i] = 1
        state["hold"].append(block)
        return {"held_mb": sum(len(b) for b in state["hold"]) >> 20}
    if op == "interval":
        start = time.monotonic()
        time.sleep(action["s"])
        return {"start": start, "end": time.monotonic()}
    if op == "ws_write":
        with open(action.get("name", "note.txt"), "w") as f:
            f.write(action.get("text", "kept"))
        return {"cwd": os.getcwd()}
    if op == "ws_read":
        return probe(lambda: read(action.get("name", "note.txt")))
    if op == "identity":
        return {
            "uid": os.getuid(),
            "hostname": socket.gethostname(),
            "cwd": os.getcwd(),
            "home": os.environ.get("HOME"),
            "tmpdir": os.environ.get("TMPDIR"),
            "pid": os.getpid(),
        }
    if op == "cpus":
        return sorted(os.sched_getaffinity(0))
    if op == "widen":  # every CPU this process's cpuset allows, whatever it was pinned to
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
        return sorted(os.sched_getaffinity(0))
    if op == "bad_return":
        return "not-a-tuple"
    raise KeyError(op)


def step(action):
    state["t"] += 1
    if isinstance(action, dict):
        out = ops(action)
        if action["op"] == "bad_return":
            return out
        return {"t": state["t"], "out": out}, 0.0, False, {}
    noise = state["rng"].random()
    return (
        {"t": state["t"], "noise": noise, "episodes": state["episodes"]},
        float(action),
        state["t"] >= 100,
        False,
        {"t": state["t"]},
    )


serve(reset=reset, step=step)
