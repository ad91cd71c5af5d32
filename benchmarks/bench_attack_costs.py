"""What each attack of examples/code_rl costs the pool, per step, against an honest step.

    python benchmarks/bench_attack_costs.py                  # 250 lanes, 30% of the episodes hostile
    python benchmarks/bench_attack_costs.py -n 100 --hostile 0.5 --cpu-limit 0.05 -- --pids 8

One attacked pass of the code RL driver (examples/code_rl/run.py: its pool, its plan, its
send/recv loop, one episode per lane), each lane holding either honest episodes or one attack.
The cost of a step is its lane's CPU as the kernel counts it: every process of the lane's
sandbox (the env's server, the attempt, whatever the attempt forked), from the lane's cgroup
(cpuacct.usage on v1, cpu.stat on v2), divided by the lane's steps. The worker's and trainer's
own CPU is printed apart. The throughput under attack follows from these: with a share h of the
steps hostile at k times an honest step's cost, about 1 / (1 - h + h k) of the clean rate
(docs/code-rl.md). Run it alone on the machine: the costs of the spinning attacks grow with what
else runs.
"""

import argparse
import collections
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples" / "code_rl"))

import run as driver  # examples/code_rl/run.py

from boltzlabs.host.cgroups import PoolView


def lane_cpu(pool) -> list:
    """Each lane's CPU seconds so far, every process of its sandbox (its cgroup's count)."""
    view = PoolView(pool._cgroup)
    backend = view.backend  # the worker's own reader of the file (cpuacct.usage on v1, cpu.stat on v2)
    return [
        backend.cpu_seconds((view.group(lane, "cpuacct") / backend.cpu_file).read_bytes()) for lane in range(pool.n)
    ]


def busy() -> float:
    """CPU seconds the whole machine has been busy (/proc/stat)."""
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", type=int, default=250)
    p.add_argument("--hostile", type=float, default=0.3)
    p.add_argument("--cpu-limit", default="0.02")
    p.add_argument("--no-cpu-share", action="store_true")
    p.add_argument("driver", nargs="*", help="more arguments for examples/code_rl/run.py, after --")
    ours = p.parse_args(argv)
    # The driver's own defaults, one episode per lane, and a budget (so each lane's CPU is counted).
    argv = ["-n", str(ours.n), "--hostile", str(ours.hostile), "--episodes", "1", "--cpu-limit", ours.cpu_limit]
    argv += ["--cpu-budget", "5", *(["--no-cpu-share"] if ours.no_cpu_share else []), *ours.driver]
    args = driver.parse_args(argv)
    table = driver.plan(args.n, 1, args.hostile, args.attacks, args.seed)
    secrets = [f"lane{i}-{i:012x}" for i in range(args.n)]
    trainer = driver.Trainer()
    try:
        with driver.make_pool(args, args.n, batch_size=args.batch) as pool:
            pool.reset(seed=0)
            before, machine = lane_cpu(pool), busy()
            result = driver.run_pass(pool, table, True, args, trainer, secrets)
            after, machine = lane_cpu(pool), busy() - machine
    finally:
        trainer.close()
    steps, cpu = collections.Counter(), collections.Counter()
    for lane, _, _ in result["records"]:
        steps[table[lane][0] or "honest"] += 1
    for lane in range(args.n):
        cpu[table[lane][0] or "honest"] += after[lane] - before[lane]
    lanes = sum(after) - sum(before)
    print(
        f"{args.n} lanes, {sum(steps.values())} steps in {result['elapsed']:.1f} s; cpu_limit {args.cpu_limit:g} s, "
        f"cpu_share {args.cpu_share}; the machine's CPU {machine:.2f} s: the lanes' {lanes:.2f} s, the rest "
        f"(trainer, worker, other work) {machine - lanes:.2f} s"
    )
    honest = cpu["honest"] / max(1, steps["honest"])
    print(f"{'':22}{'lane CPU per step':>18}{'x honest':>10}{'steps':>8}")
    for kind in ["honest"] + sorted(k for k in steps if k != "honest"):
        each = cpu[kind] / steps[kind]
        print(f"  {kind:<20}{each * 1000:>15.1f} ms{each / honest:>10.1f}{steps[kind]:>8}")
    hostile = [k for k in steps if k != "honest"]
    if hostile:
        mean = sum(cpu[k] / steps[k] for k in hostile) / len(hostile) / honest
        print(f"  every attack alike: {mean:.1f}x an honest step; at 10% of the steps, ~{1 / (0.9 + 0.1 * mean):.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
