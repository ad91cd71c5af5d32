"""The code RL driver's throughput under attack, as a median over repeated clean/attacked pairs.

    python benchmarks/bench_code_rl_attack.py                 # 1000 lanes, 10% of the actions hostile, 5 pairs
    python benchmarks/bench_code_rl_attack.py --hostile 0.1   # 10% of the episodes (13% of the actions)
    python benchmarks/bench_code_rl_attack.py -n 250 --repeat 3 -- --cpu-limit 0.05

examples/code_rl/run.py runs one clean and one attacked pass and prints their ratio; on a
shared 2-core machine one pair's ratio moves by +-10% from run to run. This runs `--repeat`
pairs, each pass in a pool of its own (the order alternating, so neither pass always runs
first), with the driver's own pool, plan, send/recv loop and checks, and prints each pair's
env-steps/s and ratio, their median, and whether every honest episode had the clean pass's
rewards in every pair. Arguments after `--` go to the driver (its defaults otherwise). Exit
status 1 when an honest episode's rewards differed. Run it alone on the machine.
"""

import argparse
import collections
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples" / "code_rl"))

import run as driver  # examples/code_rl/run.py


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", type=int, default=1000)
    p.add_argument("--hostile", type=float, default=None, help="share of the episodes hostile")
    p.add_argument("--hostile-actions", type=float, default=None, help="share of the actions hostile (0.1)")
    p.add_argument("--repeat", type=int, default=5, help="clean/attacked pairs (5)")
    p.add_argument("driver", nargs="*", help="arguments for examples/code_rl/run.py, after --")
    ours = p.parse_args(argv)
    share = [] if ours.hostile is None else ["--hostile", str(ours.hostile)]
    share += [] if ours.hostile_actions is None else ["--hostile-actions", str(ours.hostile_actions)]
    args = driver.parse_args(["-n", str(ours.n), *share, *ours.driver])
    table = driver.plan(args.n, args.episodes, args.hostile, args.attacks, args.seed)
    secrets = [f"lane{i}-{i:012x}" for i in range(args.n)]
    trainer = driver.Trainer()
    ratios, differing = [], 0
    print(
        f"{args.n} lanes, {args.hostile:.1%} of the episodes hostile"
        + ("" if args.hostile_actions is None else f" ({args.hostile_actions:.0%} of the actions)")
        + f" ({len(args.attacks)} attacks), "
        f"cpu_limit {args.cpu_limit:g} s, cpu_share {args.cpu_share}, {ours.repeat} pairs"
    )
    try:
        for pair in range(ours.repeat):
            rates = {}
            passes = {}
            for attack in (False, True) if pair % 2 == 0 else (True, False):
                with driver.make_pool(args, args.n, batch_size=args.batch) as pool:
                    passes[attack] = driver.run_pass(pool, table, attack, args, trainer, secrets)
                # As run.py counts it: env-steps over the pass's time, its first reset included.
                rates[attack] = len(passes[attack]["records"]) / passes[attack]["elapsed"]
            checked, bad, _, _, _ = driver.honest_check(passes[False], passes[True], table, args.groups)
            differing += bad
            ratios.append(rates[True] / rates[False])
            lanes = collections.Counter(
                what for _, what, _ in passes[True]["records"].values() if what and "lane" in what
            )
            steps = passes[True]["records"]
            hostile = driver.hostile_steps(passes[True], table) / max(1, len(steps))
            print(
                f"  pair {pair + 1}: clean {rates[False]:.0f} env-steps/s, attacked {rates[True]:.0f}: "
                f"{ratios[-1]:.0%} ({hostile:.1%} of its actions hostile); honest episodes {checked}, {bad} "
                "unlike the clean pass's; in reset() "
                f"{passes[False]['resets_s']:.1f} / {passes[True]['resets_s']:.1f} s; lanes failed in the attacked "
                f"pass: {dict(lanes) or 'none'}"
            )
    finally:
        trainer.close()
    print(
        f"throughput under attack: median {statistics.median(ratios):.0%} of the clean pass's "
        f"(min {min(ratios):.0%}, max {max(ratios):.0%}); honest episodes unlike the clean pass's: {differing}"
    )
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
