"""What the page-table work of a spawn costs on this machine.

    python benchmarks/bench_faults.py            # 256 MiB, 3 rounds
    python benchmarks/bench_faults.py --mib 64
    python benchmarks/bench_faults.py --mib 4096 --idle 20   # memory the VM gave back to its host

A forked env pays for page tables three ways: the fork copies the
template's page tables, the child copies each template page it writes
(copy on write: ~420 pages for a counter env, docs/scale.md), and its exit
unmaps it all. This prints, per 4 KiB page, the medians over the rounds of:

  first touch  writing a fresh anonymous page (a fault, a zeroed page);
  COW          a forked child writing a page its parent wrote (a fault, a copy);
  fork         the fork of a process with the region mapped and written
               (its page-table copy), per page of the region;
  exit         the child's exit with the region copied, per page.

On bare metal a fault costs well under a microsecond; under a hypervisor
that shadows the guest's page tables (this project's machine runs under
PVM) each costs several, and a pool's start-up is mostly that: compare
this machine's figures with the training node's before reading a start-up
time from one on the other.

--idle S sleeps S seconds before each round. A guest with free page
reporting (virtio-balloon; this machine reports free 8 MiB blocks to its
host after a second) hands memory it freed back to the host, and the next
touch of such a page makes the host back it again: with --idle the rounds
touch memory the host has to back, without it mostly memory the previous
round freed a moment ago. The KiB the guest's kernel reported meanwhile
(/sys/module/page_reporting/parameters/reported_kib) are printed where
that file exists.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time

PAGE = mmap.PAGESIZE
REPORTED = "/sys/module/page_reporting/parameters/reported_kib"


def _touch(region: mmap.mmap, value: int) -> None:
    for offset in range(0, len(region), PAGE):
        region[offset] = value


def round_once(size: int) -> dict[str, float]:
    pages = size // PAGE
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    started = time.perf_counter()
    _touch(region, 1)
    figures = {"first touch": (time.perf_counter() - started) / pages}
    read_end, write_end = os.pipe()
    started = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the child: time its copies and report, then exit
        forked = time.perf_counter()
        _touch(region, 2)
        copied = time.perf_counter()
        os.write(write_end, f"{forked} {copied - forked}".encode())
        os._exit(0)
    os.close(write_end)
    forked_at, cow = (float(x) for x in os.read(read_end, 256).split())
    os.close(read_end)
    reported = time.perf_counter()
    os.waitpid(pid, 0)
    figures["fork"] = (forked_at - started) / pages
    figures["COW"] = cow / pages
    figures["exit"] = (time.perf_counter() - reported) / pages
    region.close()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="the region's size")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--idle", type=float, default=0.0, help="seconds to sleep before each round")
    args = parser.parse_args()
    reported_before = _reported_kib()
    rounds = []
    for _ in range(args.rounds):
        time.sleep(args.idle)
        rounds.append(round_once(args.mib << 20))
    idle = f", each after {args.idle:g} s idle" if args.idle else ""
    print(f"{args.mib} MiB region, {PAGE} B pages, medians of {args.rounds} rounds{idle}:")
    for name in rounds[0]:
        print(f"  {name:<12} {statistics.median(r[name] for r in rounds) * 1e6:7.3f} us/page")
    reported_after = _reported_kib()
    if reported_before is not None and reported_after is not None:
        print(f"free memory the kernel reported to the host meanwhile: {(reported_after - reported_before) >> 10} MiB")


def _reported_kib() -> int | None:
    """The KiB of free memory this guest's kernel has reported to its host (free page reporting), or None."""
    try:
        with open(REPORTED) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


if __name__ == "__main__":
    main()
