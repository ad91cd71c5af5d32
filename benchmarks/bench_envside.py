"""Where an env's CPU per env-step goes, one sandbox layer at a time (issue 16).

    python benchmarks/bench_envside.py --n 64 512
    python benchmarks/bench_envside.py --n 512 --layers bare seccomp memcg all --sched other batch

No bubblewrap and no worker: this process plays the worker (a STEP frame to
every child, then epoll until every reply is read, the worker's step) and
forks N children that run boltzlabs' real serve loop
(`boltzlabs.runtime.serve._serve_loop`) over the counter env's reset/step on
an AF_UNIX stream socketpair, today's channel. Each child first puts on the
layers asked for, the way a pool's env has them:

    bare     nothing: the serve loop in a forked Python process
    seccomp  the env's seccomp filter (sandbox/seccomp.toml, compiled as the pool does), loaded twice
             (template mode stacks the template's filter and the env's)
    memcg    a memory cgroup of its own (v1, below ours), as each env of a pool has
    ns       unshare(user, mount, net, ipc, uts), as a template's child does (its pid ns excepted)
    all      seccomp + memcg + ns

and the scheduling policy asked for (`--sched other` or `batch`: SCHED_BATCH,
which an unprivileged process may take on itself). Layers and policies take
turns in --rounds chunks, so load from elsewhere hits all alike. `--loops main
worktree` runs both serve loops side by side: main's boltzlabs/runtime/serve.py
(from git) and this checkout's, for a before/after paired in one run. Printed per
(layer, policy): the children's CPU per env-step from the scheduler's own
counter (/proc/PID/sched; /proc/PID/stat's user and system times are
10 ms ticks, too coarse for a child that runs a few ms per chunk), their
voluntary and involuntary context switches per env-step, and env-steps/s.
`perf record -p <children>` beside a run splits the time further
(docs/performance.md).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from boltzlabs import wire
from boltzlabs.runtime import serve as serve_module

_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC, _CLONE_NEWUSER, _CLONE_NEWNET = (
    0x00020000,
    0x04000000,
    0x08000000,
    0x10000000,
    0x40000000,
)


def counter_env() -> tuple:
    """(reset, step) of examples/counter/env.py, taken from its serve() call."""
    import types

    given = {}
    stub = types.ModuleType("boltzlabs.env")
    stub.serve = lambda **kwargs: given.update(kwargs)
    real = sys.modules.get("boltzlabs.env")
    sys.modules["boltzlabs.env"] = stub
    try:
        path = ROOT / "examples" / "counter" / "env.py"
        exec(compile(path.read_text(), str(path), "exec"), {"__name__": "counter_env"})
    finally:
        if real is None:
            del sys.modules["boltzlabs.env"]
        else:
            sys.modules["boltzlabs.env"] = real
    return given["reset"], given["step"]


reset, step = counter_env()


def env_filter() -> bytes:
    """The env's seccomp program, compiled as a pool compiles it."""
    from boltzlabs.host import seccomp
    from boltzlabs.host.policy import load_policy

    return seccomp.compile_rules(load_policy().seccomp).env


def serve_loop_of(name: str):
    """The serve module to run: this checkout's ("worktree") or a git revision's."""
    if name == "worktree":
        return serve_module
    source = subprocess.run(
        ["git", "show", f"{name}:boltzlabs/runtime/serve.py"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / f"serve_{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"serve_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def own_memcg() -> Path:
    """This process's memory cgroup (v1)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/")
    raise SystemExit("no v1 memory cgroup: the memcg layer needs one")


class Children:
    """N forked children serving on socketpairs, with `layer` and `sched` put on."""

    def __init__(self, n: int, layer: str, sched: str, loop, loader, cgroups: Path | None):
        self.layer, self.sched, self.loop = layer, sched, loop
        self.ends, self.pids, self.groups = [], [], []
        for index in range(n):
            ours, theirs = socket.socketpair()
            group = None
            if layer in ("memcg", "all"):
                group = cgroups / f"{layer}-{sched}-{loop.__name__}-{index}"
                group.mkdir()
                self.groups.append(group)
            pid = os.fork()
            if pid == 0:
                ours.close()
                self._child(theirs.detach(), group, loader)
            theirs.close()
            self.ends.append(ours)
            self.pids.append(pid)
        self.epoll = select.epoll()
        self.fds = [end.fileno() for end in self.ends]
        for fd in self.fds:
            self.epoll.register(fd, select.EPOLLIN)
        for fd in self.fds:  # the HELLO
            self._read_one(fd)
        self.seq = 0
        self.frames = {}

    def _child(self, fd: int, group, loader) -> None:
        code = 1
        try:
            if group is not None:
                (group / "cgroup.procs").write_text(str(os.getpid()))
            if self.layer in ("ns", "all"):
                libc = ctypes.CDLL(None, use_errno=True)
                if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWIPC | _CLONE_NEWUTS):
                    raise OSError(ctypes.get_errno(), "unshare")
            if self.layer in ("seccomp", "all"):
                loader.load()
                loader.load()  # template mode: the template's filter and the env's
            if self.sched == "batch":
                os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
            self.loop._serve_loop(self.loop._Channel(fd, fd), reset, step, None, {})  # a socket: read and written
            code = 0
        finally:
            os._exit(code)

    def _read_one(self, fd: int) -> None:
        reader = wire.FrameReader(wire.Limits(1 << 20))
        while True:
            data = os.read(fd, 1 << 16)
            if not data:
                raise RuntimeError("a child closed its channel before its HELLO: its serve loop failed")
            if reader.feed(data):
                return

    def steps(self, count: int) -> None:
        """`count` batched steps: a STEP to every child, then every reply."""
        fds, n, poll = self.fds, len(self.fds), self.epoll.poll
        for _ in range(count):
            self.seq += 1
            frame = wire.encode([wire.STEP, self.seq, 1, False])
            for fd in fds:
                os.write(fd, frame)
            left = n
            while left:
                for fd, _ in poll():
                    os.read(fd, 1 << 16)  # one small reply per read here
                    left -= 1

    def counters(self) -> tuple:
        """Sum over the children: (CPU s, voluntary cs, involuntary cs)."""
        runtime = vol = invol = 0
        for pid in self.pids:
            for line in Path(f"/proc/{pid}/sched").read_text().splitlines():
                if line.startswith("se.sum_exec_runtime"):
                    runtime += float(line.split(":")[1]) / 1e3  # ms -> s
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches"):
                    vol += int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches"):
                    invol += int(line.split()[1])
        return runtime, vol, invol

    def close(self) -> None:
        """Kill and reap every child, remove its cgroup."""
        self.epoll.close()
        for end in self.ends:
            end.close()
        for pid in self.pids:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        for group in self.groups:
            group.rmdir()


def main() -> None:
    """Run every (loop, layer, policy) at each n, interleaved, and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[64, 512])
    parser.add_argument(
        "--layers",
        nargs="+",
        default=["bare", "seccomp", "memcg", "ns", "all"],
        choices=["bare", "seccomp", "memcg", "ns", "all"],
    )
    parser.add_argument("--sched", nargs="+", default=["other"], choices=["other", "batch"])
    parser.add_argument(
        "--loops",
        nargs="+",
        default=["worktree"],
        help="serve loops: 'worktree' (this checkout) and/or git revisions, e.g. main",
    )
    parser.add_argument("--steps", type=int, default=None, help="steps per chunk (default: ~0.4 s of steps)")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    loader = None
    if any(layer in ("seccomp", "all") for layer in args.layers):
        from boltzlabs.runtime.confine import FilterLoader

        loader = FilterLoader(env_filter())
    cgroups = None
    if any(layer in ("memcg", "all") for layer in args.layers):
        cgroups = own_memcg() / f"bench-envside-{os.getpid()}"
        cgroups.mkdir()
    loops = {name: serve_loop_of(name) for name in args.loops}
    print("| n | loop | layer | sched | env-steps/s | CPU us | voluntary cs | involuntary cs |")
    print("|---|---|---|---|---|---|---|---|")
    load_before = os.getloadavg()[0]
    try:
        for n in args.n:
            kinds = [(loop, layer, sched) for loop in loops for layer in args.layers for sched in args.sched]
            sets = {kind: Children(n, kind[1], kind[2], loops[kind[0]], loader, cgroups) for kind in kinds}
            try:
                steps = args.steps or max(20, int(400_000 / n / 8))
                for children in sets.values():
                    children.steps(20)
                totals = {kind: [0.0] * 4 for kind in kinds}
                for _ in range(args.rounds):
                    for kind, children in sets.items():
                        before = children.counters()
                        started = time.perf_counter()
                        children.steps(steps)
                        elapsed = time.perf_counter() - started
                        after = children.counters()
                        total = totals[kind]
                        total[0] += elapsed
                        for i in range(3):
                            total[i + 1] += after[i] - before[i]
                for kind, total in totals.items():
                    env_steps = n * steps * args.rounds
                    print(
                        f"| {n} | {kind[0]} | {kind[1]} | {kind[2]} | {env_steps / total[0]:,.0f} | "
                        f"{total[1] * 1e6 / env_steps:.1f} | {total[2] / env_steps:.2f} | {total[3] / env_steps:.2f} |",
                        flush=True,
                    )
            finally:
                for children in sets.values():
                    children.close()
    finally:
        if cgroups is not None:
            cgroups.rmdir()
    print(f"\n1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")


if __name__ == "__main__":
    main()
