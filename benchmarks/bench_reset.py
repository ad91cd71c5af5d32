"""Start-up, hard-reset and memory figures of one template-mode pool (docs/hard-reset.md).

    python benchmarks/bench_reset.py              # 1000 counter envs, 5 hard resets
    python benchmarks/bench_reset.py --n 200 --resets 2
    python benchmarks/bench_reset.py --trust-env  # env.py imported in the template (RLPool(trust_env=True))

Prints one line: wall time of RLPool(...), of each pool.reset(seed=0,
hard=True), of close(), pool.memory().mean in KiB right after the resets
(memory.mean) and again after --steps steps of every env (memory.stepped:
what a training run pays; a child forked a moment ago has not yet copied
the pages its steps will write), and the median wall time of a hard reset
of one lane (`where=[i]`, 20 lanes in turn) while the others stay up.
Run it a few times, interleaved with the build you compare against: on a
2-core machine single runs vary by ~10%.
"""

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from boltzlabs import RLPool


def main() -> None:
    """Measure once and print the line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--resets", type=int, default=5)
    parser.add_argument("--source", default=str(ROOT / "examples" / "counter"))
    parser.add_argument("--steps", type=int, default=100, help="steps of every env before memory.stepped")
    parser.add_argument(
        "--trust-env", action="store_true", help="RLPool(trust_env=True): env.py imported in the template"
    )
    args = parser.parse_args()
    started = time.monotonic()
    pool = RLPool(args.source, args.n, spawn="template", **({"trust_env": True} if args.trust_env else {}))
    start = time.monotonic() - started
    pool.reset(seed=0)
    hard = []
    for _ in range(args.resets):
        started = time.monotonic()
        pool.reset(seed=0, hard=True)
        hard.append(time.monotonic() - started)
    mean = pool.memory().mean
    for _ in range(args.steps):  # action 0: every benchmark env takes it
        pool.step([0] * args.n)
    stepped = pool.memory().mean
    one = []  # one lane at a time, the others left as they are
    for lane in range(0, args.n, max(1, args.n // 20)):
        started = time.monotonic()
        pool.reset(seed=0, where=[lane], hard=True)
        one.append(time.monotonic() - started)
    started = time.monotonic()
    pool.close()
    close = time.monotonic() - started
    print(
        f"n={args.n} start={start:.2f}s hard={' '.join(f'{h:.2f}' for h in hard)}s "
        f"close={close:.2f}s memory.mean={mean / 1024:.0f}KiB "
        f"memory.stepped={stepped / 1024:.0f}KiB "
        f"one-lane hard reset median={sorted(one)[len(one) // 2] * 1000:.1f}ms"
    )


if __name__ == "__main__":
    main()
