"""How the env runs an attempt, measured: a fork of its server (runner="fork", the default) or
a fresh interpreter (runner="subprocess"), in n lanes.

    python examples/code_rl/runners.py            # n = 100
    python examples/code_rl/runners.py -n 500

For each runner, one pool: the memory of every lane at rest (kernel accounting, pool.memory()),
then while every lane's attempt is running at once (a right answer whose module sleeps 1.5 s
first), and the rate of plain attempts (20 steps of every lane, a right answer each).
"""

import argparse
import time

from run import ENV

from boltzlabs import RLPool

RIGHT = "def add(a, b):\n    return a + b\n"
HOLD = "import time\ntime.sleep(1.5)\n" + RIGHT


def measure(runner: str, n: int) -> str:
    with RLPool(ENV, n, memory_limit="128M", params={"runner": runner, "attempts": 1000, "time_limit": 60}) as pool:
        pool.reset(seed=[2] * n)  # seed 2: the task "add"
        pool.step([RIGHT] * n)
        rest = pool.memory()
        pool.send([HOLD] * n)
        time.sleep(1.0)
        busy = pool.memory()
        _, _, rewards, _, _ = pool.recv(n)
        assert (rewards == 1).all(), rewards
        began = time.perf_counter()
        for _ in range(20):
            _, rewards, _, _ = pool.step([RIGHT] * n)
        wall = time.perf_counter() - began
    return (
        f"{runner:>10}: {n} lanes at rest {rest.total / 2**20:.0f} MiB ({rest.mean / 2**20:.2f} MiB a lane); "
        f"all {n} attempts running {busy.total / 2**20:.0f} MiB (+{(busy.total - rest.total) / n / 2**20:.2f} MiB an "
        f"attempt); {20 * n / wall:.0f} attempts/s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=100)
    args = parser.parse_args()
    for runner in ("fork", "subprocess"):
        print(measure(runner, args.n), flush=True)


if __name__ == "__main__":
    main()
