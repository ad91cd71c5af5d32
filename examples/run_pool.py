"""The main job: the example env at scale, with timing and envs_per_gb().

python examples/run_pool.py            # 1000 envs, 300 steps
python examples/run_pool.py -n 64 --steps 1000
python examples/run_pool.py -n 100000 --envs-per-sandbox 100   # 1,000 sandboxes of 100 envs (docs/groups.md)
"""

import argparse
import time
from pathlib import Path

import numpy as np

from boltzlabs import RLPool

COUNTER = Path(__file__).resolve().parent / "counter"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=1000, help="number of envs (default 1000)")
    parser.add_argument("--steps", type=int, default=300, help="batched steps to run (default 300)")
    parser.add_argument(
        "--envs-per-sandbox", type=int, default=1, help="envs in each sandbox, stepped in one turn (default 1)"
    )
    args = parser.parse_args()

    started = time.perf_counter()
    with RLPool(COUNTER, args.n, progress=True, envs_per_sandbox=args.envs_per_sandbox) as pool:
        start_s = time.perf_counter() - started
        where = f" ({-(-args.n // args.envs_per_sandbox)} sandboxes)" if args.envs_per_sandbox > 1 else ""
        print(f"{args.n} sandboxed envs ready in {start_s:.1f} s{where}")
        pool.reset(seed=0)
        worker_ms = roundtrip_ms = 0.0
        episodes = 0
        began = time.perf_counter()
        for _ in range(args.steps):
            obs, rewards, dones, infos = pool.step(np.ones(args.n, dtype=np.int64))
            worker_ms += pool.timing.worker_ms
            roundtrip_ms += pool.timing.roundtrip_ms
            if dones.any():
                episodes += int(dones.sum())
                obs = pool.reset(where=dones)
        elapsed = time.perf_counter() - began
        print(f"last step: {pool.timing}")
        print(
            f"{args.steps} steps x {args.n} envs in {elapsed:.2f} s: "
            f"{args.steps * args.n / elapsed:,.0f} env-steps/s, {episodes} episodes finished"
        )
        print(f"mean per step: worker {worker_ms / args.steps:.2f} ms, roundtrip {roundtrip_ms / args.steps:.2f} ms")
        memory = pool.memory()
        print(f"memory per env: {memory.mean / 2**20:.2f} MiB ({memory.source})")
        print(f"envs_per_gb(): {pool.envs_per_gb():.1f}")


if __name__ == "__main__":
    main()
