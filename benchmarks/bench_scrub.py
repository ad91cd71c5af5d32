"""reset(scrub=True) against reset(hard=True) for every lane of a pool (docs/api.md#scrub-a-clean-soft-reset).

    python benchmarks/bench_scrub.py                 # 1000 lanes, 3 rounds, template mode
    python benchmarks/bench_scrub.py --n 200 --files 100 --spawn exec

Each round, every lane's step leaves what a code action leaves (benchmarks/envs/litter:
--files files in the workspace, one in /dev/shm, a setsid process), then all lanes
are scrubbed; the same again, then all are hard-reset. After each reset every lane's
census (pool.call) must show the sandbox's own processes alone and an empty
workspace, or the run fails. Prints each round's wall times and their ratio
(hard / scrub), and the median; then the median time of one lane's scrub and hard reset
(20 lanes in turn, the others left as they are). Run it alone on the machine.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from boltzlabs import RLPool

LITTER = ROOT / "benchmarks" / "envs" / "litter"


def check(pool, spawn: str, what: str) -> None:
    """Every lane holds nothing of the episode before: SystemExit naming the first that does."""
    alone = [1] if spawn == "template" else [1, 2]
    for i, census in enumerate(pool.call("census")):
        if census["procs"] != alone or census["entries"] != 0:
            sys.exit(f"bench_scrub: after {what}, env {i} still holds {census}")


def litter(pool, lane: int, files: int) -> None:
    """One lane's step leaves its files and process, the others left as they are."""
    pool.send([files], [lane])
    _, _, _, _, infos = pool.recv()
    if "error" in infos[0]:
        sys.exit(f"bench_scrub: env {lane}'s step failed: {infos[0]['error']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--files", type=int, default=20, help="files each lane's step leaves")
    parser.add_argument("--spawn", choices=("template", "exec"), default="template")
    args = parser.parse_args()
    ratios = []
    with RLPool(LITTER, args.n, spawn=args.spawn, progress=False, warmup=False) as pool:
        pool.reset(seed=0)
        for r in range(args.rounds):
            pool.step([args.files] * args.n)
            started = time.monotonic()
            pool.reset(seed=0, scrub=True)
            scrub = time.monotonic() - started
            failed = [i for i, info in enumerate(pool.reset_infos) if "scrubbed" not in info]
            if failed:
                sys.exit(f"bench_scrub: env {failed[0]} was not scrubbed: {pool.reset_infos[failed[0]]}")
            check(pool, args.spawn, "a scrub")
            pool.step([args.files] * args.n)
            started = time.monotonic()
            pool.reset(seed=0, hard=True)
            hard = time.monotonic() - started
            check(pool, args.spawn, "a hard reset")
            ratios.append(hard / scrub)
            print(
                f"round {r}: {args.n} lanes ({args.spawn}), scrub {scrub:.3f} s, hard {hard:.3f} s, "
                f"hard/scrub {hard / scrub:.2f}x",
                flush=True,
            )
        # One lane at a time, the others left as they are (20 lanes in turn).
        one_scrub, one_hard = [], []
        for lane in range(0, args.n, max(1, args.n // 20)):
            litter(pool, lane, args.files)
            started = time.monotonic()
            pool.reset(seed=0, where=[lane], scrub=True)
            one_scrub.append(time.monotonic() - started)
            litter(pool, lane, args.files)
            started = time.monotonic()
            pool.reset(seed=0, where=[lane], hard=True)
            one_hard.append(time.monotonic() - started)
    print(f"median hard/scrub {statistics.median(ratios):.2f}x over {args.rounds} rounds")
    scrub_ms, hard_ms = statistics.median(one_scrub) * 1e3, statistics.median(one_hard) * 1e3
    print(
        f"one lane: scrub {scrub_ms:.2f} ms, hard {hard_ms:.2f} ms (medians of {len(one_scrub)}), hard/scrub {hard_ms / scrub_ms:.2f}x"
    )


if __name__ == "__main__":
    main()
