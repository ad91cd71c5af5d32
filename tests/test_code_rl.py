"""examples/code_rl (issue 44): an env whose action is Python source, and its driver's attacks.

The driver's own functions, at a small n, in both spawn modes: every attack of
examples/code_rl/solutions.py in one episode beside honest lanes; each comes to its expected
cause on its own lane, the honest lanes' rewards are what a pool with no attack gives, and a
scrub leaves no process (counted from outside, by pid namespace, and from inside) and no file
of the episode. The speed variant (serialize_measurement=True) rewards a fast right answer above
a slow one and a wrong one with 0. The whole driver, as a user runs it, is in test_examples.py.
"""

import importlib.util
import sys
from pathlib import Path

import psutil
import pytest
from conftest import run_benchmark, scaled, wait_until

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "code_rl"
# The pool warns once per kind of lane failure, and sums them up at close: here they are the attacks'.
pytestmark = pytest.mark.filterwarnings("ignore:.*examples/code_rl/env.*:RuntimeWarning")


@pytest.fixture(scope="module")
def code_rl():
    """examples/code_rl/run.py as a module (it imports solutions.py beside it)."""
    sys.path.insert(0, str(EXAMPLE))
    try:
        spec = importlib.util.spec_from_file_location("code_rl_run", EXAMPLE / "run.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(EXAMPLE))


@pytest.fixture(scope="module")
def tasks():
    spec = importlib.util.spec_from_file_location("code_rl_tasks", EXAMPLE / "env" / "tasks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def lane_processes(pool, i: int) -> int:
    """Lane i's processes seen from the host: its pid and every descendant (a setsid daemon's
    parent is the sandbox's init once its own parent is gone, so it stays below)."""
    root = psutil.Process(pool.pids()[i])
    return 1 + len(root.children(recursive=True))


@pytest.mark.parametrize("reap", ["lane", "group"])
@pytest.mark.parametrize("spawn", ["template", "exec"])
def test_every_attack_stays_on_its_lane_and_a_scrub_leaves_nothing(code_rl, spawn, reap):
    attacks = list(code_rl.solutions.ATTACKS)
    honest = 3
    n = len(attacks) + honest
    # No cpu_budget here: with reap="group" the spinning daemon must live until the scrub (the
    # budget's own test is below).
    args = code_rl.parse_args(["-n", str(n), "--episodes", "1", "--batch", "4", "--reap", reap, "--cpu-budget", "0"])
    # Lanes 0-2 honest, then one lane per attack; every lane honest in the clean pass.
    table = [[None]] * honest + [[kind] for kind in attacks]
    secrets = [f"lane{i}-{i:012x}" for i in range(n)]
    trainer = code_rl.Trainer()
    try:
        with code_rl.make_pool(args, n, spawn=spawn) as pool:
            clean = code_rl.run_pass(pool, [[None]] * n, False, args, trainer, secrets)
            pool.reset(seed=0, hard=True)
            attacked = code_rl.run_pass(pool, table, True, args, trainer, secrets)
            records = attacked["records"]

            # Each attack's first step ends as expected, on its own lane; honest lanes see no failure.
            by_kind, wrong = code_rl.attack_check(attacked, table)
            assert not wrong, wrong
            assert set(by_kind) == set(attacks)
            for lane in range(honest):
                steps = [records[key] for key in sorted(records) if key[0] == lane]
                assert steps and all(what is None for _, what, _ in steps), steps
            checked, differing, _, _, bad = code_rl.honest_check(clean, attacked, table, 1)
            assert checked == honest and differing == 0, bad
            assert attacked["leaks"] == [] and trainer.intact()
            daemon = honest + attacks.index("background_writer")
            assert any(strays for key, (_, _, strays) in records.items() if key[0] == daemon)

            # What the episode left, seen from outside and inside: the filled workspace; the daemons,
            # unless the env killed every process of the lane after each attempt (reap="lane").
            spinner = honest + attacks.index("background_spinner")
            fill = honest + attacks.index("workspace_fill")
            own = 1 if spawn == "template" else 3  # the server (exec: and bubblewrap's two)
            before = code_rl.census(pool, range(n))
            if reap == "group":
                assert lane_processes(pool, daemon) > own and lane_processes(pool, spinner) > own
                assert before[daemon][0] and before[spinner][0]
            else:
                assert lane_processes(pool, daemon) == own and lane_processes(pool, spinner) == own
                assert not any(processes for processes, _ in before.values()), before
            assert any("fill.bin" in path for path in before[fill][1])

            # In exec mode the server is not its sandbox's pid 1: signal_all's SIGKILL reached it. Its
            # lane alone is dead, and the reset respawns it instead of scrubbing it.
            dead = [i for i, state in enumerate(pool.states()) if state == "dead"]
            assert dead == ([] if spawn == "template" else [honest + attacks.index("signal_all")])
            pool.reset(where=list(range(n)), seed=1, scrub=True)
            assert all(("scrubbed" in info) == (i not in dead) for i, info in enumerate(pool.reset_infos)), (
                pool.reset_infos
            )
            after = code_rl.census(pool, range(n))
            assert len(after) == n and all(p == [] and f == [] for p, f in after.values()), after
            assert [lane_processes(pool, i) for i in range(n)] == [own] * n
    finally:
        trainer.close()


def seed_for(tasks, name: str) -> int:
    return next(seed for seed in range(1000) if tasks.task_for(seed) == name)


def test_the_speed_variant_rewards_a_fast_right_answer_above_a_slow_one(code_rl, tasks):
    solutions = code_rl.solutions
    args = code_rl.parse_args(["-n", "4"])
    cases = [  # (task, source, what the reward must be)
        ("dedupe", solutions.CORRECT["dedupe"], "fast"),
        ("dedupe", solutions.SLOW["dedupe"], "slow"),
        ("is_prime", solutions.CORRECT["is_prime"], "fast"),
        ("is_prime", solutions.PARTLY["is_prime"], "zero"),
    ]
    seeds = [seed_for(tasks, task) for task, _, _ in cases]
    with code_rl.make_pool(
        args, len(cases), mode="speed", serialize_measurement=True, params={"attempts": 1, "cpu_limit": 2.0}
    ) as pool:
        pool.reset(seed=seeds)
        _, rewards, dones, infos = pool.step([source for _, source, _ in cases])
    speed = dict(zip(range(len(cases)), rewards.tolist()))
    assert all(dones) and all("error" not in info for info in infos), infos
    assert 0.3 < speed[0] < 3 and 0.3 < speed[2] < 3, infos  # the reference's own speed, give or take the node
    assert speed[1] < 0.5 * speed[0], infos  # a list scan per item against a dict: far slower
    assert speed[3] == 0.0 and "speed" not in infos[3], infos  # a wrong answer is not timed


def test_an_attempt_that_does_not_import_says_where_and_why_in_its_log(code_rl, tasks):
    """harness.describe: the frames in solution.py and test_solution.py, each with its line, and
    the message, for a syntax error, an exception at import and a missing function."""
    args = code_rl.parse_args(["-n", "3"])
    actions = [
        "def add(a, b):\n    return a +\n",
        "def helper():\n    raise ValueError('boom at import')\nhelper()\n",
        "x = 1\n",
    ]
    with code_rl.make_pool(args, 3, params={"attempts": 1}) as pool:
        pool.reset(seed=[seed_for(tasks, "add")] * 3)
        obs, rewards, _, infos = pool.step(actions)
    assert rewards.tolist() == [0.0, 0.0, 0.0] and all(info["outcome"] == "ran" for info in infos), infos
    assert "ERROR importing the solution" in obs[0] and 'File "solution.py", line 2' in obs[0], obs[0]
    assert "return a +" in obs[0] and "SyntaxError" in obs[0], obs[0]
    assert 'File "solution.py", line 3, in <module>' in obs[1] and "line 2, in helper" in obs[1], obs[1]
    assert "ValueError: boom at import" in obs[1], obs[1]
    assert 'File "test_solution.py", line 2' in obs[2] and "from solution import add" in obs[2], obs[2]
    assert "ImportError: cannot import name 'add'" in obs[2], obs[2]
    assert "harness.py" not in "".join(obs), obs  # the harness's own frames are not the action's


def test_the_driver_plans_its_hostile_share_of_the_actions_or_of_the_episodes(code_rl):
    """The target is a share of the actions: a hostile episode runs both attempts, an honest one
    1.5 on average (half the first attempts pass), so 10% of the actions is 7.7% of the episodes."""
    args = code_rl.parse_args([])
    assert args.hostile_actions == 0.1 and args.hostile == pytest.approx(0.15 / 1.95)
    assert code_rl.parse_args(["--hostile", "0.1"]).hostile == 0.1
    assert code_rl.parse_args(["--attempts", "1", "--hostile-actions", "0.1"]).hostile == pytest.approx(0.1)
    for argv in (["--hostile", "0.1", "--hostile-actions", "0.1"], ["--hostile-actions", "1"]):
        with pytest.raises(SystemExit):
            code_rl.parse_args(argv)


@pytest.mark.parametrize("blocking", [False, True])
def test_the_driver_scrubs_between_episodes_in_flight_or_blocking(code_rl, blocking):
    """run_pass resets a lane between its episodes with send(resets=..., scrub=True), beside the
    other lanes' steps; --blocking-reset with reset(where=..., scrub=True). Either way every lane
    plays its episodes and the attacked lanes' leftovers do not reach an honest episode."""
    argv = ["-n", "6", "--hostile", "0.5", "--episodes", "3", "--attacks", "workspace_fill,background_writer"]
    args = code_rl.parse_args(argv + (["--blocking-reset"] if blocking else []))
    table = code_rl.plan(args.n, args.episodes, args.hostile, args.attacks, args.seed)
    secrets = [f"lane{i}-{i:012x}" for i in range(args.n)]
    trainer = code_rl.Trainer()
    try:
        passes = {}
        for attack in (False, True):
            with code_rl.make_pool(args, args.n, batch_size=2) as pool:
                calls = []
                reset = pool.reset
                pool.reset = lambda *a, **k: calls.append(k) or reset(*a, **k)
                passes[attack] = code_rl.run_pass(pool, table, attack, args, trainer, secrets)
            scrubs = [k for k in calls if k.get("scrub")]
            assert len(calls) == 1 + len(scrubs) and (bool(scrubs) == blocking), calls
        checked, differing, _, _, bad = code_rl.honest_check(passes[False], passes[True], table, 1)
        assert checked > 0 and differing == 0, bad
        episodes = {(lane, e) for lane, e, _ in passes[True]["records"]}
        assert episodes == {(lane, e) for lane in range(args.n) for e in range(args.episodes)}
    finally:
        trainer.close()


def test_a_daemon_left_spinning_between_steps_is_killed_over_the_cpu_budget_on_its_lane(code_rl):
    if not code_rl.HAS_CPU_BUDGET:
        pytest.skip("this boltzlabs has no cpu_budget")
    solutions = code_rl.solutions
    # reap="group": the env leaves a setsid daemon running after the attempt; the pool's budget
    # counts the lane's cgroup from each step's send to the next, so the idle lane is killed.
    # The daemon runs at the attempt's nice 19, SCHED_IDLE: beside a loaded node's other work it
    # may get a few percent of a core, so the budget is the least the driver allows and the wait
    # is long.
    args = code_rl.parse_args(["-n", "3", "--reap", "group", "--cpu-budget", "0.1"])
    with code_rl.make_pool(args, 3) as pool:
        pool.reset(seed=[2, 2, 2])  # the task "add"
        actions = [solutions.attack("background_spinner", {}), solutions.CORRECT["add"], solutions.CORRECT["add"]]
        _, rewards, dones, infos = pool.step(actions)
        assert list(rewards[1:]) == [1.0, 1.0] and "error" not in infos[1] and "error" not in infos[2], infos
        if infos[0].get("cpu_budget") is not True:
            # The usual case: the attempt ended, its daemon lives on, and the idle lane is killed once
            # the daemon passes the budget. (On a loaded machine the daemon may pass it before the
            # step's reply: then the step itself is the lane's failure.)
            assert infos[0]["strays"] >= 1 and rewards[0] == 0.0, infos  # the daemon (and its parent, if not yet gone)
            assert wait_until(lambda: pool.states()[0] == "dead", timeout=120), pool.states()
            _, rewards, _, infos = pool.step([solutions.CORRECT["add"]] * 3)
            assert "error" not in infos[1] and "error" not in infos[2], infos
    assert infos[0].get("cpu_budget") is True and "cpu_budget" in infos[0]["error"], infos


# Spins for `cpu` CPU-seconds of its own, then passes nothing: an attempt within its limit.
BOUNDED_SPIN = """
import time
began = time.process_time()
while time.process_time() - began < {cpu}:
    pass
"""


@pytest.mark.parametrize("spawn", ["template", "exec"])
def test_a_spin_that_waited_for_a_core_is_ended_at_its_cpu_limit_even_with_its_own_timer_deleted(code_rl, spawn):
    # Lanes 0 and 1 spin for ever, lane 1 after deleting its own CPU timer; 40 more lanes each
    # spin for 60% of the limit at the same moment, so the spinners first wait for a core, then
    # get one once those end. A watch that looks now and then (less often the longer an attempt
    # has waited: 1,000 lanes cannot each look every few ms) would let them run on past the limit
    # once they get a core; the server's timer on the attempt's CPU clock ends each at it.
    limit, n = 0.05, 42
    args = code_rl.parse_args(
        ["-n", str(n), "--cpu-limit", str(limit), "--cpu-budget", "0", "--step-timeout", str(scaled(120))]
    )
    with code_rl.make_pool(args, n, spawn=spawn) as pool:
        assert pool.cpu_share is True  # the driver's default
        pool.reset(seed=list(range(n)))
        spins = [code_rl.solutions.attack(kind, {}) for kind in ("cpu_spin", "timer_evasion")]
        _, _, _, infos = pool.step(spins + [BOUNDED_SPIN.format(cpu=0.6 * limit)] * (n - 2))
        for info in infos[:2]:
            assert info["outcome"].startswith("CPU limit: killed"), info
            # A tick (4 ms at HZ=250) and the server's wake-up past the limit: 1-11 ms on an idle
            # or busy host here; once 55 ms in CI (five stages on two cores) before attempts ran
            # SCHED_IDLE. The census alone, without the timers, let it run to 3-8 times the limit.
            assert limit <= info["cpu"] <= limit * 2.5, info
        assert all(info["outcome"] == "ran" for info in infos[2:]), [info["outcome"] for info in infos[2:]]


def test_bench_attack_costs_prices_every_attack_against_an_honest_step():
    """benchmarks/bench_attack_costs.py at a small n: each attack's lane CPU per step, from the
    lanes' cgroups, beside an honest step's; the spinning attacks cost more than an honest step."""
    out = run_benchmark("bench_attack_costs.py", "-n", "30", "--hostile", "0.5", timeout=300)
    rows = {line.split()[0]: line.split() for line in out.splitlines() if " ms " in line}
    assert set(rows) == {"honest", *code_rl_attacks()}, out
    assert float(rows["cpu_spin"][1]) > float(rows["honest"][1]), out
    assert "every attack alike" in out, out


def code_rl_attacks() -> list:
    spec = importlib.util.spec_from_file_location("code_rl_solutions", EXAMPLE / "solutions.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.ATTACKS)


def test_bench_code_rl_attack_gives_a_median_over_pairs_and_checks_honest_rewards():
    """benchmarks/bench_code_rl_attack.py at a small n: pairs of passes, their median ratio, and
    exit status 0 only when every honest episode kept the clean pass's rewards."""
    out = run_benchmark("bench_code_rl_attack.py", "-n", "20", "--hostile", "0.5", "--repeat", "2", timeout=300)
    assert out.count("  pair ") == 2 and "throughput under attack: median" in out, out
    assert "honest episodes unlike the clean pass's: 0" in out, out
    assert "in reset() 0.0 / 0.0 s" in out, out  # resets in flight: no blocking reset() between episodes
    # The driver's blocking resets, for comparison: the same checks hold.
    out = run_benchmark(
        "bench_code_rl_attack.py",
        "-n",
        "20",
        "--hostile",
        "0.5",
        "--repeat",
        "1",
        "--",
        "--blocking-reset",
        timeout=300,
    )
    assert out.count("  pair ") == 1 and "honest episodes unlike the clean pass's: 0" in out, out
