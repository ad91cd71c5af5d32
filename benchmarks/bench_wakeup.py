"""What one blocking wait costs the waiting process's CPU on this machine.

    python benchmarks/bench_wakeup.py

A client on the first CPU sends 100 bytes over a socketpair and blocks in
recv until a peer on another CPU, which sleeps `--work` us per request (a
worker's step), answers. Printed: the client's CPU time (time.thread_time)
per round trip, and its wall time. The client's own work is one send and
one recv of 100 bytes, a few microseconds; the rest is what the kernel (and
under a hypervisor, the vCPU's halt and wake-up) charges the task that slept.
A sharded pool's client waits once per shard whose reply is not in yet, so
this figure, times the extra waits per step, is what workers=k adds to the
client's CPU beyond its Python work (docs/sharding.md).
"""

from __future__ import annotations

import argparse
import os
import socket
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trips", type=int, default=2000)
    parser.add_argument("--work", type=float, default=300.0, help="the peer's sleep per request, us")
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("bench_wakeup.py needs two CPUs")
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        ours.close()
        os.sched_setaffinity(0, {cpus[1]})
        while data := theirs.recv(4096):
            time.sleep(args.work / 1e6)
            theirs.sendall(data)
        os._exit(0)
    theirs.close()
    os.sched_setaffinity(0, {cpus[0]})
    try:
        cpu, wall = time.thread_time(), time.perf_counter()
        for _ in range(args.trips):
            ours.sendall(b"x" * 100)
            ours.recv(4096)
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    finally:
        ours.close()
        os.waitpid(pid, 0)
    print(
        f"client CPU per blocking round trip: {cpu / args.trips * 1e6:.0f} us "
        f"(wall {wall / args.trips * 1e6:.0f} us; the peer sleeps {args.work:.0f} us)"
    )


if __name__ == "__main__":
    main()
