"""Code RL at scale: lanes whose actions are Python programs, a share of them hostile.

    python examples/code_rl/run.py                       # 1000 lanes, 10% of the actions hostile
    python examples/code_rl/run.py -n 64 --hostile 0.5  # a quick look
    python examples/code_rl/run.py --groups 4            # 4 envs per sandbox: what a hostile env does to its group

Two passes over the same lanes, tasks and honest actions, each in a pool of its own: a clean
one, where every action is honest, and an attacked one, where a share of the episodes are
hostile (solutions.py: fork bomb, memory balloon, infinite loop, workspace fill, setsid
daemons, reads of /proc/*/root, ../ paths, other lanes' workspaces and the trainer's files,
signals, a forged channel). Both step with send/recv and reset a lane's sandbox between its
episodes (--reset scrub, hard or soft). Then it prints throughput, stragglers, failures by
cause, whether every honest episode got exactly the rewards of the clean pass, whether any
lane saw another lane's or the trainer's secrets, and how long a scrub and a hard reset of
every lane take after an attacked episode (and what either leaves behind). Last, the speed
variant: a pool with serialize_measurement=True whose reward is the measured speed of the
submitted function, with and without hostile neighbours.

Exit status 1 when an honest episode's rewards differ from the clean pass's, a secret leaked,
the trainer's files changed, a scrub left anything behind, or an attack did not end as expected;
with --groups k > 1, honest envs that shared a sandbox with a hostile one are reported, not
counted (their sandbox is their boundary: docs/code-rl.md).
"""

from __future__ import annotations

import argparse
import collections
import inspect
import os
import random
import re
import secrets
import sys
import tempfile
import time
from pathlib import Path

import solutions

from boltzlabs import RLPool

ENV = Path(__file__).resolve().parent / "env"
REPO = Path(__file__).resolve().parents[2]
# The library's newer pool features, used where this boltzlabs has them (see reset_options()).
HAS_SCRUB = "scrub" in inspect.signature(RLPool.reset).parameters
HAS_CPU_BUDGET = "cpu_budget" in inspect.signature(RLPool.__init__).parameters
HAS_CPU_SHARE = "cpu_share" in inspect.signature(RLPool.__init__).parameters
HAS_SEND_SCRUB = "scrub" in inspect.signature(RLPool.send).parameters
TASK = re.compile(r"# task: (\w+)")
SECRET = re.compile(r"lane(\d+)-[0-9a-f]{12}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", type=int, default=1000, help="lanes (envs) in each pool (default 1000)")
    p.add_argument("--hostile", type=float, default=None, help="share of the episodes that are hostile")
    p.add_argument(
        "--hostile-actions",
        type=float,
        default=None,
        help="share of the actions that are hostile (0.1 when neither this nor --hostile is given): a hostile "
        "episode runs all its attempts, an honest one fewer (episode_share())",
    )
    p.add_argument("--episodes", type=int, default=2, help="episodes per lane in each pass (2)")
    p.add_argument("--attempts", type=int, default=2, help="steps (attempts at the task) per episode (2)")
    p.add_argument("--attacks", default=",".join(solutions.ATTACKS), help="the attacks to use, comma-separated")
    p.add_argument("--batch", type=int, default=None, help="recv() batch size (default n / 4)")
    p.add_argument("--groups", type=int, default=1, help="envs per sandbox, envs_per_sandbox=k (1)")
    p.add_argument("--reset", choices=("scrub", "hard", "soft"), default="scrub", help="between episodes (scrub)")
    p.add_argument(
        "--blocking-reset",
        action="store_true",
        help="reset between episodes with reset(), which waits for every lane it resets, not in flight with send()",
    )
    p.add_argument("--seed", type=int, default=0)
    # The limits (docs/code-rl.md says why each).
    p.add_argument("--memory-limit", default="64M", help="memory_limit per sandbox (64M)")
    p.add_argument("--workspace-size", default="16M", help="workspace_size per sandbox (16M)")
    p.add_argument("--pids", type=int, default=8, help='limits={"pids": ...} per sandbox (8)')
    p.add_argument("--step-timeout", type=float, default=60.0, help="step_timeout, seconds (60)")
    p.add_argument("--straggler-grace", type=float, default=5.0, help='limits={"straggler_grace": ...} (5)')
    p.add_argument("--cpu-budget", type=float, default=0.5, help="cpu_budget, CPU s per lane and step (0.5)")
    p.add_argument(
        "--no-cpu-share", dest="cpu_share", action="store_false", help="without cpu_share=True (a CPU share per lane)"
    )
    p.add_argument("--cpu-limit", type=float, default=0.02, help="the env's CPU limit per attempt, s (0.02)")
    p.add_argument("--reap", choices=("lane", "group"), default="lane", help="the env's kill after each attempt (lane)")
    p.add_argument("--time-limit", type=float, default=20.0, help="the env's wall limit per attempt, s (20)")
    p.add_argument("--speed-lanes", type=int, default=16, help="lanes of the speed variant's pools (16; 0: skip)")
    p.add_argument("--no-reset-timing", action="store_true", help="skip timing the scrub and hard reset of all lanes")
    args = p.parse_args(argv)
    args.attacks = [a for a in args.attacks.split(",") if a]
    unknown = set(args.attacks) - set(solutions.ATTACKS)
    if unknown:
        p.error(f"unknown attacks {sorted(unknown)}; there are {sorted(solutions.ATTACKS)}")
    if args.batch is None:
        args.batch = max(1, args.n // 4)
    if args.hostile is not None and args.hostile_actions is not None:
        p.error("give --hostile (episodes) or --hostile-actions (actions), not both")
    if args.hostile is None:
        if args.hostile_actions is None:
            args.hostile_actions = 0.1
        if not 0 <= args.hostile_actions < 1:
            p.error("--hostile-actions must be at least 0 and below 1")
        args.hostile = episode_share(args.hostile_actions, args.attempts)
    return args


def episode_share(actions: float, attempts: int) -> float:
    """The share of episodes to make hostile for `actions` of the steps to be hostile: a hostile
    episode runs every one of its `attempts` (no attack passes the tests), an honest one ends at
    its first attempt when that passes (solutions.honest: half the first attempts do) and at its
    second otherwise, the right answer."""
    honest_steps = 1 + solutions.FIRST_ATTEMPT_FAILS * min(1, attempts - 1)
    return actions * honest_steps / (attempts * (1 - actions) + actions * honest_steps)


def reset_options(kind: str) -> dict:
    """What reset() gets between episodes. Scrub (kill the lane's processes but its server, empty
    its workspace, reset the env, no respawn) where this boltzlabs has it, else a hard reset."""
    if kind == "scrub":
        return {"scrub": True} if HAS_SCRUB else {"hard": True}
    return {"hard": True} if kind == "hard" else {}


def make_pool(args, n: int, mode: str = "tests", **options) -> RLPool:
    """A pool of the code env with the limits docs/code-rl.md explains."""
    params = {"mode": mode, "attempts": args.attempts, "cpu_limit": args.cpu_limit, "time_limit": args.time_limit}
    params["reap"] = args.reap
    params.update(options.pop("params", {}))
    if args.cpu_budget and HAS_CPU_BUDGET:  # above the env's own limit, whose outcome keeps the lane
        options["cpu_budget"] = max(args.cpu_budget, 2 * params["cpu_limit"])
    if args.cpu_share and HAS_CPU_SHARE:  # each lane one share of the CPU, however many processes or sessions
        options["cpu_share"] = True
    return RLPool(
        ENV,
        n,
        memory_limit=args.memory_limit,
        workspace_size=args.workspace_size,
        limits={"pids": args.pids, "straggler_grace": args.straggler_grace},
        step_timeout=args.step_timeout,
        envs_per_sandbox=args.groups if mode == "tests" else 1,
        params=params,
        **options,
    )


def plan(n: int, episodes: int, share: float, kinds: list, seed: int) -> list:
    """plan[lane][episode]: the attack that episode runs, or None (honest). Each episode, round(share * n)
    lanes chosen at random; the attacks dealt to them in turn, so with as many hostile lanes as
    attacks every attack appears in every episode."""
    rng = random.Random(seed)
    table: list = [[None] * episodes for _ in range(n)]
    count = min(n, round(share * n)) if kinds else 0
    for e in range(episodes):
        for j, lane in enumerate(sorted(rng.sample(range(n), count))):
            table[lane][e] = kinds[(j + e) % len(kinds)]
    return table


class Trainer:
    """What the trainer holds that no lane may read or change: a file, an environment variable."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="code-rl-trainer-")
        self.secret = "trainer-" + secrets.token_hex(8)
        self.canary = os.path.join(self.dir, "secret.txt")
        with open(self.canary, "w") as f:
            f.write(self.secret + "\n")
        self.planted = os.path.join(self.dir, "planted-by-a-lane")
        os.environ["CODE_RL_TRAINER_SECRET"] = self.secret  # the pool clears the envs' environment

    def context(self, pids: list, lane: int) -> dict:
        """What the attacks are told: the trainer's paths, and a few other lanes' host pids."""
        others = [[int(pids[j]), j] for j in range(len(pids)) if j != lane and pids[j] > 0][:16]
        return {
            "canary": self.canary,
            "repo_file": self.planted,
            "git_config": str(REPO / ".git" / "config"),
            "git_head": str(REPO / ".git" / "HEAD"),
            "others": others,
        }

    def intact(self) -> bool:
        with open(self.canary) as f:
            return f.read() == self.secret + "\n" and not os.path.exists(self.planted)

    def close(self) -> None:
        for name in os.listdir(self.dir):
            os.unlink(os.path.join(self.dir, name))
        os.rmdir(self.dir)


def cause(info: dict | None) -> str | None:
    """What a step came to, when not a plain run of the tests: the pool's failure of the lane first
    (info["error"]), else the env's outcome of the attempt."""
    info = info or {}
    if info.get("cpu_budget"):
        return "lane killed: cpu_budget"
    if info.get("straggler"):
        return "lane: straggler (step_timeout)"
    error = info.get("error")
    if error:
        return "lane: " + re.split(r"[:(\[]", str(error), maxsplit=1)[0].strip()[:60]
    outcome = info.get("outcome")
    if outcome and outcome != "ran":
        return "attempt: " + str(outcome).split(":")[0][:60]
    return None


def run_pass(pool, table: list, attack: bool, args, trainer: Trainer, lane_secrets: list, first_reset=None) -> dict:
    """Every lane through its episodes of `table` with send/recv: each lane (with --groups, each
    sandbox) is sent its next action as soon as its result is in, and its sandbox reset between
    its episodes (`first_reset`: the options of the first reset, of every lane). The lanes are
    left as their last episode left them. Returns what happened at each step, with timings."""
    n, episodes, k = pool.n, len(table[0]), max(1, args.groups)
    units = [list(range(s, min(n, s + k))) for s in range(0, n, k)]  # what one send() must hold
    unit_of = [u for u, lanes in enumerate(units) for _ in lanes]
    seeds = [args.seed * 100_000 + lane * 100 for lane in range(n)]
    episode, attempt, done = [0] * n, [0] * n, [False] * n
    # A scrub or soft reset goes out with send(resets=...) and comes back with recv(), beside the other
    # lanes' steps; reset() would wait for the slowest lane it resets (a hard reset always does).
    in_flight_reset = HAS_SEND_SCRUB and not args.blocking_reset and args.reset != "hard"
    resetting: set = set()  # lanes whose reset was sent and not yet received
    records: dict = {}
    leaks: list = []
    honest_cpu: list = []  # each honest attempt's CPU seconds, its own process (the env's info["cpu"])
    pids: list = []
    reset_kw = reset_options(args.reset)

    def action(lane: int, obs) -> str:
        kind = table[lane][episode[lane]] if attack else None
        if kind is not None:
            if not pids:
                pids.extend(pool.pids())
            return solutions.attack(kind, trainer.context(pids, lane))
        match = TASK.match(obs or "")
        task = match.group(1) if match else "add"
        return solutions.honest(task, lane, episode[lane], attempt[lane], lane_secrets[lane])

    began = time.perf_counter()
    obs = pool.reset(seed=seeds, **(first_reset or {}))
    stragglers = 0
    resets_s = recv_s = 0.0
    pool.send([action(i, obs[i]) for i in range(n)])
    out = [set(lanes) for lanes in units]  # each sandbox's envs sent and not yet received
    waiting = n
    while waiting:
        t = time.perf_counter()
        ids, batch_obs, rewards, dones, infos = pool.recv(min(args.batch, waiting))
        recv_s += time.perf_counter() - t
        waiting -= len(ids)
        stragglers += len(pool.timing.stragglers)
        landed = set()
        for i, o, r, d, info in zip(ids.tolist(), batch_obs, rewards.tolist(), dones.tolist(), infos):
            obs[i] = o
            if i in resetting:  # its reset's result: the episode's first observation, not a step
                resetting.discard(i)
            else:
                records[(i, episode[i], attempt[i])] = (r, cause(info), bool(info and info.get("strays")))
                if not (attack and table[i][episode[i]]) and isinstance((info or {}).get("cpu"), float):
                    honest_cpu.append(info["cpu"])
                for text in (o, str(info)):
                    owners = {int(m) for m in SECRET.findall(text or "")} - {i}
                    if text and trainer.secret in text:
                        owners.add(-1)
                    # (who saw it, its episode and attempt, whose secret: a lane, or -1 the trainer's, same sandbox?)
                    leaks += [(i, episode[i], attempt[i], j, j >= 0 and unit_of[j] == unit_of[i]) for j in owners]
                attempt[i] += 1
                done[i] = bool(d)
            out[unit_of[i]].discard(i)
            if not out[unit_of[i]]:  # a sandbox's envs may land over several recv() calls
                landed.add(unit_of[i])
        to_reset, to_send = [], []
        for u in landed:
            lanes = units[u]
            if all(done[i] for i in lanes):  # the sandbox's episode is over: the next one, if any
                for i in lanes:
                    episode[i] += 1
                    attempt[i] = 0
                    done[i] = False
                    seeds[i] += 1
                if episode[lanes[0]] >= episodes:
                    continue
                to_reset += lanes
                if in_flight_reset:
                    continue  # its actions go once its reset is received
            to_send += [i for i in lanes if not done[i]]
        if to_reset and not in_flight_reset:  # one call for every sandbox of this batch whose episode ended
            t = time.perf_counter()
            reset_obs = pool.reset(where=to_reset, seed=seeds, **reset_kw)
            resets_s += time.perf_counter() - t
            for i in to_reset:
                obs[i] = reset_obs[i]
        resets = to_reset if in_flight_reset else []
        if to_send or resets:
            actions = [action(i, obs[i]) for i in to_send] + [None] * len(resets)
            pool.send(
                actions, env_ids=to_send + resets, **({"resets": resets, "seed": seeds, **reset_kw} if resets else {})
            )
            waiting += len(to_send) + len(resets)
            resetting.update(resets)
            for i in to_send + resets:
                out[unit_of[i]].add(i)
    elapsed = time.perf_counter() - began
    return {
        "records": records,
        "elapsed": elapsed,
        "stragglers": stragglers,
        "leaks": leaks,
        "resets_s": resets_s,
        "recv_s": recv_s,
        "honest_cpu": honest_cpu,
    }


def hostile_steps(result: dict, table: list) -> int:
    """How many of a pass's steps (run_pass()'s records) were of hostile episodes."""
    return sum(1 for lane, e, _ in result["records"] if table[lane][e] is not None)


def honest_check(clean: dict, attacked: dict, table: list, groups: int) -> tuple:
    """Compare each honest episode's rewards (attempt by attempt) between the passes. Returns
    (checked, differing, exposed, exposed_differing): with groups, an honest env whose sandbox held a
    hostile env in that episode is `exposed` and counted apart."""
    n, episodes = len(table), len(table[0])
    checked = differing = exposed = exposed_differing = 0
    bad = []
    for lane in range(n):
        for e in range(episodes):
            if table[lane][e] is not None:
                continue
            first = lane - lane % groups
            shared = any(table[j][e] is not None for j in range(first, min(n, first + groups)))
            mine = [clean["records"].get((lane, e, a)) for a in range(64)]
            theirs = [attacked["records"].get((lane, e, a)) for a in range(64)]
            same = [m and m[0] for m in mine] == [t and t[0] for t in theirs]
            if shared:
                exposed += 1
                exposed_differing += not same
            else:
                checked += 1
                if not same:
                    differing += 1
                    bad.append((lane, e, [m and m[:2] for m in mine if m], [t and t[:2] for t in theirs if t]))
    return checked, differing, exposed, exposed_differing, bad


def attack_check(attacked: dict, table: list, groups: int = 1) -> tuple:
    """Each hostile episode's first step should come to what solutions.EXPECTED says; returns
    ({attack: Counter of causes}, [(lane, episode, attack, cause) that did not]). With groups, an
    attack whose sandbox held another in the same episode may have met that one's work: not checked."""
    by_kind: dict = collections.defaultdict(collections.Counter)
    wrong = []
    for lane, row in enumerate(table):
        first = lane - lane % groups
        for e, kind in enumerate(row):
            if kind is None:
                continue
            record = attacked["records"].get((lane, e, 0))
            what = record[1] if record else "no result"
            by_kind[kind][what or "ran"] += 1
            alone = all(table[j][e] is None for j in range(first, min(len(table), first + groups)) if j != lane)
            if alone and not any(x in (what or "ran") for x in solutions.EXPECTED[kind]):
                wrong.append((lane, e, kind, what))
    return by_kind, wrong


def cpu_summary(seconds: list, limit: float) -> str:
    """The honest attempts' CPU (each attempt's own process), against the env's cpu_limit."""
    if not seconds:
        return "no honest attempt reported its CPU"
    ms = sorted(x * 1000 for x in seconds)
    p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
    return (
        f"honest attempts' CPU: median {ms[len(ms) // 2]:.1f} ms, p99 {p99:.1f}, max {ms[-1]:.1f} "
        f"(cpu_limit {limit * 1000:g} ms)"
    )


def census(pool, lanes: list) -> dict:
    """{lane: (processes, files)} from inside each idle lane (the env's census method)."""
    states = pool.states()
    live = [i for i in lanes if states[i] == "idle"]
    found = pool.call("census", env_ids=live) if live else []
    return {i: (c["processes"], c["files"]) for i, c in zip(live, found)}


def time_resets(pool, args, trainer: Trainer, lane_secrets: list) -> dict:
    """After an attacked episode of every lane: the time a reset of all of them takes, scrub (where
    this boltzlabs has it) then hard, each after an episode of its own, and what each leaves."""
    out = {}
    for kind in ("scrub", "hard"):
        table = plan(pool.n, 1, args.hostile, args.attacks, args.seed + (7 if kind == "scrub" else 8))
        run_pass(pool, table, True, args, trainer, lane_secrets, first_reset=reset_options(args.reset))
        before = census(pool, range(pool.n))
        options = reset_options(kind)
        t = time.perf_counter()
        pool.reset(where=list(range(pool.n)), seed=args.seed, **options)
        seconds = time.perf_counter() - t
        after = census(pool, range(pool.n))
        out[kind] = {
            "seconds": seconds,
            "as": "scrub" if options.get("scrub") else "hard",
            # lanes holding processes, and files, of the episode (every lane that ran an attempt has files)
            "before": (sum(1 for p, f in before.values() if p), sum(1 for p, f in before.values() if f)),
            "left": {i: pf for i, pf in after.items() if pf[0] or pf[1]},
            "censused": len(after),
            "failed": [i for i, info in enumerate(pool.reset_infos) if info.get("error")],
        }
    return out


def speed_pass(args, attack: bool, trainer: Trainer, lane_secrets: list) -> dict:
    """The speed variant: reward = the submitted function's speed against the reference's, timed
    with every other lane frozen (serialize_measurement=True). Even lanes submit the right answer,
    odd ones a slow right answer; with `attack`, every fourth lane runs a spinning daemon instead."""
    n = args.speed_lanes
    with make_pool(args, n, mode="speed", serialize_measurement=True, params={"attempts": 2, "cpu_limit": 2.0}) as pool:
        obs = pool.reset(seed=[args.seed * 100_000 + lane * 100 for lane in range(n)])
        rewards: dict = {}
        for attempt in range(2):
            actions = []
            for i in range(n):
                if attack and i % 4 == 3:
                    actions.append(solutions.attack("background_spinner" if attempt == 0 else "cpu_spin", {}))
                    continue
                task = TASK.match(obs[i] or "").group(1)
                source = solutions.CORRECT[task] if i % 2 == 0 else solutions.SLOW[task]
                actions.append(f"# lane-secret: {lane_secrets[i]}\n{source}")
            pool.send(actions)
            ids, new_obs, r, dones, infos = pool.recv(n)
            for i, o, reward, info in zip(ids.tolist(), new_obs, r.tolist(), infos):
                obs[i] = obs[i] if o is None else o
                rewards[(i, attempt)] = (reward, (info or {}).get("task"), cause(info))
    return rewards


def print_failures(title: str, passes: list, table: list) -> None:
    print(f"failures by cause ({title}), steps:")
    rows: dict = collections.defaultdict(lambda: [0, 0])
    for result, attack in passes:
        for (lane, e, _), (_, what, _) in result["records"].items():
            if what:
                rows[what][1 if attack and table[lane][e] is not None else 0] += 1
    if not rows:
        print("  none")
    for what, (honest, hostile) in sorted(rows.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {what:<58} honest {honest:>6}  hostile {hostile:>6}")


def main(argv=None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    lane_secrets = [f"lane{i}-{rng.getrandbits(48):012x}" for i in range(args.n)]
    table = plan(args.n, args.episodes, args.hostile, args.attacks, args.seed)
    hostile = sum(kind is not None for row in table for kind in row)
    planned = "" if args.hostile_actions is None else f", planned for {args.hostile_actions:.0%} of the actions"
    trainer = Trainer()
    problems = []
    print(
        f"code RL: {args.n} lanes, {args.episodes} episodes of up to {args.attempts} attempts each; "
        f"{hostile} of {args.n * args.episodes} episodes hostile{planned} ({', '.join(args.attacks)}); "
        f"envs_per_sandbox={args.groups}; between episodes: {reset_options(args.reset) or 'soft'}"
        + ("" if HAS_SCRUB or args.reset != "scrub" else " (this boltzlabs has no scrub: hard resets instead)")
    )
    print(
        f"limits: memory_limit={args.memory_limit} workspace_size={args.workspace_size} pids={args.pids} "
        f"step_timeout={args.step_timeout:g} straggler_grace={args.straggler_grace:g} "
        + (f"cpu_budget={args.cpu_budget:g}" if HAS_CPU_BUDGET else "cpu_budget: not in this boltzlabs")
        + (f" cpu_share={args.cpu_share}" if HAS_CPU_SHARE else " cpu_share: not in this boltzlabs")
        + f"; the env's cpu_limit={args.cpu_limit:g} s, time_limit={args.time_limit:g} s, reap={args.reap}"
    )
    try:
        passes = {}
        for name, attack in (("clean", False), ("attacked", True)):
            started = time.perf_counter()
            with make_pool(args, args.n, batch_size=args.batch) as pool:
                ready = time.perf_counter() - started
                passes[name] = run_pass(pool, table, attack, args, trainer, lane_secrets)
                if attack and not args.no_reset_timing:
                    passes["resets"] = time_resets(pool, args, trainer, lane_secrets)
            r = passes[name]
            steps = len(r["records"])
            print(
                f"{name} pass: pool ready in {ready:.1f} s; {steps} env-steps in {r['elapsed']:.1f} s "
                f"({steps / r['elapsed']:.0f} env-steps/s; waiting in recv() {r['recv_s']:.1f} s, in reset() between "
                f"episodes {r['resets_s']:.1f} s); "
                f"stragglers {r['stragglers']}; {cpu_summary(r['honest_cpu'], args.cpu_limit)}"
            )
        clean, attacked = passes["clean"], passes["attacked"]
        ratio = (len(attacked["records"]) / attacked["elapsed"]) / (len(clean["records"]) / clean["elapsed"])
        mine = hostile_steps(attacked, table)
        print(
            f"hostile actions: {mine} of the attacked pass's {len(attacked['records'])} "
            f"({mine / max(1, len(attacked['records'])):.0%})"
        )
        print(f"throughput under attack: {ratio:.0%} of the clean pass's")
        print_failures("attacked pass", [(attacked, True)], table)
        if any(what for _, what, _ in clean["records"].values()):
            print_failures("clean pass", [(clean, False)], table)

        by_kind, wrong = attack_check(attacked, table, args.groups)
        print("each attack's first step, on its own lane:")
        for kind in args.attacks:
            causes = ", ".join(f"{what} x{count}" for what, count in by_kind[kind].most_common())
            print(f"  {kind:<20} {causes or '(not dealt)'}")
        if wrong:
            problems.append(f"{len(wrong)} attacks did not end as expected, e.g. {wrong[:3]}")

        checked, differing, exposed, exposed_differing, bad = honest_check(clean, attacked, table, args.groups)
        print(
            f"honest episodes: {checked} checked, {differing} with rewards unlike the clean pass's"
            + (
                f"; {exposed} more shared a sandbox with a hostile env, {exposed_differing} of them affected"
                if args.groups > 1
                else ""
            )
        )
        if differing:
            problems.append(f"{differing} honest episodes' rewards differ, e.g. {bad[:3]}")

        leaks = attacked["leaks"] + clean["leaks"]
        cross = [leak for leak in leaks if not leak[4]]
        print(
            f"secrets a lane saw that were not its own: {len(cross)} steps"
            + (f"; {len(leaks) - len(cross)} more within a sandbox of {args.groups} envs" if args.groups > 1 else "")
        )
        if cross:
            problems.append(
                f"secrets reached another lane: (lane, episode, attempt, whose) {[x[:4] for x in cross[:5]]}"
            )
        print(f"the trainer's files: {'unchanged' if trainer.intact() else 'CHANGED'}")
        if not trainer.intact():
            problems.append("the trainer's canary file changed, or a lane planted a file beside it")

        if "resets" in passes:
            rs = passes["resets"]
            s, h = rs["scrub"], rs["hard"]
            print(
                f"reset of all {args.n} lanes after an attacked episode: {s['as']} {s['seconds']:.2f} s, hard "
                f"{h['seconds']:.2f} s ({h['seconds'] / s['seconds']:.1f}x the {s['as']}'s time); before the {s['as']}, "
                f"{s['before'][0]} lanes held processes and {s['before'][1]} files of the episode; after it "
                f"{len(s['left'])} of {s['censused']} (after the hard reset {len(h['left'])})"
            )
            for kind in ("scrub", "hard"):
                if rs[kind]["left"] or rs[kind]["failed"]:
                    problems.append(
                        f"after the {rs[kind]['as']}: lanes {list(rs[kind]['left'].items())[:3]} still hold "
                        f"something, lanes {rs[kind]['failed'][:5]} failed their reset"
                    )

        if args.speed_lanes:
            # Twice clean (the noise of the measurement itself, and of whatever else runs on the node), then
            # with a spinning daemon in every fourth lane: the gate freezes it outside its lane's turn.
            first, again, attacked_speed = (speed_pass(args, a, trainer, lane_secrets) for a in (False, False, True))
            right = [r for (i, a), (r, _, _) in first.items() if i % 2 == 0]
            slow = [r for (i, a), (r, _, _) in first.items() if i % 2 == 1]
            print(
                f"speed variant (serialize_measurement=True, {args.speed_lanes} lanes, 2 attempts): right answers "
                f"{_spread(right)}x the reference's speed, slow right answers {_spread(slow)}x; an honest lane's "
                f"reward moved by {_drift(first, again)} between two clean runs, and by {_drift(first, attacked_speed)} "
                f"with a spinning daemon in every fourth lane"
            )
            if not right or not slow or _median(slow) >= _median(right):
                problems.append(f"the speed variant did not tell slow answers from fast ones: {right} {slow}")
    finally:
        trainer.close()
    for problem in problems:
        print("FAILED:", problem)
    print("OK" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


def _median(xs: list) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else 0.0


def _drift(a: dict, b: dict) -> str:
    """How far the honest lanes' speed rewards of run b are from run a's: 'median x% (max y%)'."""
    moved = sorted(abs(b[key][0] / a[key][0] - 1) for key in a if key[0] % 4 != 3 and a[key][0] > 0 and key in b)
    return f"a median {_median(moved):.0%} (max {max(moved, default=0):.0%})"


def _spread(xs: list) -> str:
    xs = sorted(xs)
    return f"{xs[0]:.2f}-{xs[-1]:.2f} (median {_median(xs):.2f})" if xs else "-"


if __name__ == "__main__":
    sys.exit(main())
