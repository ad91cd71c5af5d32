"""What one worker-env hop costs the kernel, by kind of channel (issue 16).

    python benchmarks/bench_channel.py            # 64 children, 1500 rounds

No boltzlabs and no sandbox: a parent and N forked children that echo one
small frame each. Per round the parent writes one frame to every child, then
waits in epoll and reads every reply, as the worker's step does. Printed per
channel kind (AF_UNIX SOCK_STREAM, today's channel; SOCK_SEQPACKET; a pair of
pipes): the parent's user and system CPU per round trip (getrusage) and round
trips per second. Each kind is measured twice, interleaved.
"""

from __future__ import annotations

import argparse
import os
import resource
import select
import signal
import socket
import time

FRAME = b"\x0b\x00\x00\x00" + b"x" * 11


def _echo(rfd: int, wfd: int) -> None:
    while True:
        data = os.read(rfd, 65536)
        if not data:
            os._exit(0)
        os.write(wfd, data)


def channels(kind: str):
    """(parent read fd, parent write fd, child read fd, child write fd)."""
    if kind in ("stream", "seqpacket"):
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM if kind == "stream" else socket.SOCK_SEQPACKET)
        ours, theirs = a.detach(), b.detach()
        return ours, ours, theirs, theirs
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    return r2, w1, r1, w2


def run(kind: str, n: int, rounds: int) -> str:
    ends, pids = [], []
    for _ in range(n):
        pr, pw, cr, cw = channels(kind)
        pid = os.fork()
        if pid == 0:
            _echo(cr, cw)
        for fd in {cr, cw}:
            os.close(fd)
        ends.append((pr, pw))
        pids.append(pid)
    epoll = select.epoll()
    for pr, _ in ends:
        epoll.register(pr, select.EPOLLIN)

    def loop(count: int) -> None:
        for _ in range(count):
            for _, pw in ends:
                os.write(pw, FRAME)
            left = n
            while left:
                for fd, _ in epoll.poll():
                    os.read(fd, 65536)
                    left -= 1

    loop(100)
    before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    loop(rounds)
    after, elapsed = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - started
    epoll.close()
    for pr, pw in ends:
        for fd in {pr, pw}:
            os.close(fd)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    trips = n * rounds
    return (
        f"| {kind} | {(after.ru_utime - before.ru_utime) * 1e6 / trips:.1f} | "
        f"{(after.ru_stime - before.ru_stime) * 1e6 / trips:.1f} | {trips / elapsed:,.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1500)
    args = parser.parse_args()
    print("| channel | parent user us | parent system us | round trips/s |")
    print("|---|---|---|---|")
    for kind in ("stream", "seqpacket", "pipe") * 2:
        print(run(kind, args.n, args.rounds), flush=True)
    print(f"\n{args.n} children, {args.rounds} rounds; 1-min load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
