"""boltzlabs.testing.assert_reproducible and the pytest plugin (the rlpool fixture).

Real pools over real sandboxes. The envs that leak entropy are
tests/envs/entropy (one kind per `leak` param, on the lane with seed 2 from
step 3 on); the plugin is tested through pytester in a subprocess, so the real
pytest11 entry point loads it.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time

import psutil
import pytest

from boltzlabs.testing import (
    ACROSS_POOLS,
    AFTER_HARD_RESET,
    Episode,
    EpisodeFailed,
    NotReproducible,
    assert_reproducible,
    first_difference,
)
from conftest import COUNTER, TESTS

pytest_plugins = ["pytester"]

ENTROPY = TESTS / "envs" / "entropy"
SEEDS = (0, 1, 2, 3)
STEPS = 8
ACTIONS = [[1, 2, 3, 4]] * STEPS
HANG = 120  # seconds: only to catch a hang


def reproducible(leak, spawn, **kwargs):
    kwargs.setdefault("steps", STEPS)
    kwargs.setdefault("actions", ACTIONS)
    assert_reproducible(ENTROPY, seeds=SEEDS, spawn=spawn, step_timeout=10.0, leak=leak, **kwargs)


# -- assert_reproducible ------------------------------------------------------------------------


def test_a_deterministic_env_passes_across_autoresets(spawn):
    # Episodes of 3 steps: lanes autoreset (seed None) at steps 4 and 8, and are compared there too.
    reproducible("none", spawn, length=3)


# (leak, field, path): where each kind of entropy lands in tests/envs/entropy
LEAKS = [
    ("clock", "info", 'info["clock"]'),
    ("urandom", "obs", 'obs["x"][1]'),
    ("random", "reward", "reward"),
    ("random_module", "reward", "reward"),
    ("uuid", "obs", 'obs["id"]'),
]


@pytest.mark.parametrize("leak, field, path", LEAKS, ids=[leak for leak, _, _ in LEAKS])
def test_each_kind_of_leaked_entropy_fails_naming_lane_step_and_field(spawn, leak, field, path):
    with pytest.raises(NotReproducible) as caught:
        reproducible(leak, spawn)
    failure = caught.value
    assert isinstance(failure, AssertionError)
    assert (failure.lane, failure.seed, failure.step, failure.field, failure.path) == (2, 2, 3, field, path)
    assert failure.first != failure.then
    # A random.Random() made at import draws its own seed in each env in both modes (the template
    # never imports env.py): a hard reset shows it. (In a trusted template, RLPool(trust_env=True),
    # it would be forked with the template's state into every env: only a second pool shows it.)
    expected = AFTER_HARD_RESET
    assert failure.comparison == expected
    message = str(failure)
    assert message.startswith(f"not reproducible {expected}: lane 2 (seed 2), ")
    assert f"at step 3 the {field} differs at {path}: first " in message
    assert "An env must take all its randomness from the seed given to reset" in message


def test_a_generator_made_at_import_in_a_trusted_template_is_found_across_pools():
    """In a trusted template (env.py imported there) a random.Random() made at
    import is forked with the template's state into every env and every hard
    reset: only a second, fresh pool shows it."""
    with pytest.raises(NotReproducible) as caught:
        reproducible("random", "template", trust_env=True)
    assert caught.value.comparison == ACROSS_POOLS
    assert str(caught.value).startswith(f"not reproducible {ACROSS_POOLS}: lane 2 (seed 2), ")


def test_entropy_in_an_unseeded_autoreset_is_found_at_that_step(spawn):
    with pytest.raises(NotReproducible) as caught:
        reproducible("reset", spawn, length=4)  # the episode ends at step 4: autoreset at step 5
    failure = caught.value
    assert (failure.lane, failure.step, failure.field, failure.path) == (2, 5, "obs", 'obs["x"][1]')
    assert "at step 5 (an autoreset, seed None, after the episode ended) the reset obs differs" in str(failure)


def test_the_actions_are_part_of_the_episode():
    # Different actions on replay would be a difference: the same ones are replayed. A policy that draws
    # from the clock is asked once per step of the first run; the other runs replay what it returned.
    calls = []

    def policy(step, obs):
        calls.append(step)
        assert len(obs) == len(SEEDS) and all(o["t"] == step - 1 for o in obs)
        return [time.perf_counter_ns() % 7 for _ in obs]

    reproducible("none", "template", actions=policy)
    assert calls == list(range(1, STEPS + 1))


def test_actions_are_sampled_from_the_declared_action_space():
    # CartPole declares Discrete(2); random actions end episodes early, so autoresets happen too.
    assert_reproducible("gym://CartPole-v1", seeds=(0, 1), steps=40)


def test_an_env_that_declares_no_action_space_needs_actions():
    with pytest.raises(ValueError, match="declares no action_space, so actions cannot be sampled: pass actions="):
        assert_reproducible(COUNTER, seeds=(0,), steps=3)


def test_sampling_without_gymnasium_asks_for_actions(env_dir, tmp_path):
    # Gymnasium missing in the trainer (a package that cannot be imported, first on the path); the env
    # itself, in its sandbox, declares Discrete(2) with the real one.
    source = env_dir("""
        from gymnasium.spaces import Discrete
        from boltzlabs.env import serve

        serve(reset=lambda seed: 0, step=lambda action: (0, 0.0, False, {}), action_space=Discrete(2))
    """)
    (tmp_path / "shadow" / "gymnasium").mkdir(parents=True)
    (tmp_path / "shadow" / "gymnasium" / "__init__.py").write_text("raise ImportError('no gymnasium here')\n")
    # On sys.path in the trainer only: a $PYTHONPATH entry would be bound into the sandbox too.
    code = (
        f"import sys; sys.path.insert(0, {str(tmp_path / 'shadow')!r})\n"
        "from boltzlabs.testing import assert_reproducible\n"
        f"assert_reproducible({str(source)!r}, seeds=(0,), steps=2)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG)
    assert out.returncode == 1
    assert (
        "ValueError: sampling actions from the env's action space needs Gymnasium: pip install "
        "-e '.[gym]' in a checkout of boltzlabs, or pass actions="
    ) in out.stderr


@pytest.mark.parametrize(
    "actions, error, words",
    [
        ([[1, 2, 3, 4]] * 3, ValueError, "actions has 3 step(s) of actions but steps=8"),
        ([[1, 2, 3]] * STEPS, ValueError, "the actions for step 1 are 3, but there are 4 lanes"),
        ([None] * STEPS, TypeError, "the actions for step 1 must be a list of 4 actions"),
        (42, TypeError, "actions must be None (sampled from the action space), a list of per-step action lists"),
    ],
)
def test_bad_actions_are_refused_before_a_sandbox_starts(actions, error, words):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(error, match=re.escape(words)):
        assert_reproducible(ENTROPY, seeds=SEEDS, steps=STEPS, actions=actions)
    assert {p.pid for p in psutil.Process().children(recursive=True)} == before


def test_a_callable_that_returns_the_wrong_number_of_actions_is_named():
    with pytest.raises(ValueError, match=re.escape("the actions for step 2 are 1, but there are 4 lanes")):
        reproducible("none", "template", actions=lambda step, obs: [1] * (4 if step == 1 else 1))


@pytest.mark.parametrize("seeds, steps", [((), 5), ((0, True), 5), ((0, 1.5), 5), (SEEDS, 0), (SEEDS, True)])
def test_bad_seeds_and_steps_are_refused(seeds, steps):
    with pytest.raises(ValueError):
        assert_reproducible(ENTROPY, seeds=seeds, steps=steps, actions=ACTIONS)


def test_an_env_that_fails_is_named_not_compared():
    with pytest.raises(EpisodeFailed) as caught:
        reproducible("none", "template", fail_at=2)
    failure = caught.value
    assert (failure.lane, failure.seed, failure.step, failure.run) == (1, 1, 2, "the first run")
    assert "fails at step 2 on purpose" in str(failure) and "Traceback" in str(failure)


# -- hostile values: the walk that names a difference is bounded ------------------------------


def test_a_difference_deep_inside_a_big_obs_is_named_briefly_and_quickly(env_dir):
    # 500 levels of nesting (the wire allows 512), a 1 MB string at each of the lowest ten levels, the
    # entropy at the bottom: the path stops at the walk's depth cap and the message stays short.
    source = env_dir("""
        import os
        from boltzlabs.env import serve

        def deep():
            value = [os.urandom(8).hex()]
            for level in range(500):
                value = ["x" * (1 << 20) if level < 10 else 0, value]
            return value

        serve(reset=lambda seed: {"deep": deep()}, step=lambda action: ({"deep": 0}, 0.0, False, {}))
    """)
    started = time.monotonic()
    with pytest.raises(NotReproducible) as caught:
        assert_reproducible(source, seeds=(0,), steps=1, actions=[[0]], spawn="template")
    assert time.monotonic() - started < HANG
    failure = caught.value
    assert failure.step == 0 and failure.field == "obs"
    assert failure.path == 'obs["deep"]' + "[1]" * 31 + "..."  # 32 levels below obs, then no deeper
    assert len(str(failure)) < 1500


def test_a_long_string_and_an_array_element_are_named(env_dir):
    source = env_dir("""
        import os
        import numpy as np
        from boltzlabs.env import serve

        def obs():
            grid = np.zeros((2, 3), dtype=np.float32)
            grid[1, 2] = int.from_bytes(os.urandom(2), "little") + 1
            return {"same": "y" * 100_000, "grid": grid}

        serve(reset=lambda seed: obs(), step=lambda action: (obs(), 0.0, False, {}))
    """)
    with pytest.raises(NotReproducible) as caught:
        assert_reproducible(source, seeds=(0,), steps=1, actions=[[0]], spawn="template")
    failure = caught.value
    assert failure.path == 'obs["grid"][1][2]' and failure.first != failure.then
    assert isinstance(failure.first, float) and len(str(failure)) < 1500


def test_an_info_that_is_not_a_dict_is_a_failure_named_with_its_step(env_dir):
    source = env_dir("""
        from boltzlabs.env import serve

        serve(reset=lambda seed: seed, step=lambda action: (action, 0.0, False, ["not", "a", "dict"]))
    """)
    with pytest.raises(EpisodeFailed) as caught:
        assert_reproducible(source, seeds=(5,), steps=2, actions=[[0]] * 2)
    assert (caught.value.lane, caught.value.seed, caught.value.step) == (0, 5, 1)
    assert "step() returned info of type list; expected a dict" in str(caught.value)


def test_the_comparison_is_byte_for_byte():
    def reset_with(value):
        episode = Episode(0, 0)
        episode.add_reset({"v": value}, {})
        return episode

    # Equal in Python, not the same bytes on the wire: each is a difference, named.
    nan = float("nan")
    for first, then, path in [
        (1, 1.0, 'obs["v"]'),
        (True, 1, 'obs["v"]'),
        (nan, -nan, 'obs["v"]'),
        ({"a": 1, "b": 2}, {"b": 2, "a": 1}, 'obs["v"] (the same keys, in another order)'),
    ]:
        difference = first_difference(reset_with(first), reset_with(then))
        assert difference is not None and difference.path == path, (first, then)
    # Not equal in Python, the same bytes: the same NaN is no difference.
    assert first_difference(reset_with(nan), reset_with(nan)) is None
    longer = reset_with(0)
    longer.add_step({"v": 1}, 0.0, False, False, {})
    difference = first_difference(longer, reset_with(0))
    assert (difference.kind, difference.step, difference.first, difference.then) == ("length", 1, 1, 0)


# -- boltzlabs check prints the same message ----------------------------------------------------


def test_check_prints_the_message_assert_reproducible_raises():
    with pytest.raises(NotReproducible) as caught:
        assert_reproducible(ENTROPY, seeds=(2,), steps=4, actions=[[1]] * 4, leak="urandom")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "boltzlabs",
            "check",
            str(ENTROPY),
            "--seed",
            "2",
            "--steps",
            "4",
            "--actions",
            "[1]",
            "--param",
            "leak=urandom",
        ],
        capture_output=True,
        text=True,
        timeout=HANG,
    ).stdout
    line = next(line for line in out.splitlines() if line.startswith("FAIL  replay"))
    numbers = re.compile(r"first \d+, then \d+")  # the leaked values themselves differ from run to run
    assert numbers.sub("first N, then N", line.split(None, 2)[2]) == numbers.sub("first N, then N", str(caught.value))


# -- the pytest plugin ----------------------------------------------------------------------------


def plugin_entry_point():
    from importlib.metadata import entry_points

    found = [e for e in entry_points(group="pytest11") if e.value == "boltzlabs.pytest_plugin"]
    assert found, "boltzlabs' pytest11 entry point is not installed: pip install -e . (again) registers it"
    return found[0]


def test_the_plugin_loads_from_its_entry_point(pytester):
    assert plugin_entry_point().name == "boltzlabs"
    result = pytester.runpytest_subprocess("--help")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["*--boltzlabs-spawn={template,exec}*", "*--boltzlabs-keep-logs*"])


def test_the_plugin_imports_nothing_heavy_at_collection():
    plugin_entry_point()
    # What every pytest run pays where boltzlabs is installed: the plugin as pytest loads it.
    code = (
        "import sys, pytest\n"
        "from importlib.metadata import entry_points\n"
        "(plugin,) = [e for e in entry_points(group='pytest11') if e.value == 'boltzlabs.pytest_plugin']\n"
        "plugin.load()\n"
        "print(sorted(m for m in ('numpy', 'psutil', 'boltzlabs.client', 'boltzlabs.worker', 'msgpack')"
        " if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def inner_test(pytester, body: str, record=None):
    """Write an inner test file; `record` is a path it writes what it saw to, as JSON."""
    pytester.makepyfile(
        test_inner=f"""
        import json
        COUNTER = {str(COUNTER)!r}
        ENTROPY = {str(ENTROPY)!r}
        RECORD = {str(record)!r}
        def save(**seen):
            with open(RECORD, "w") as f:
                json.dump(seen, f)
        {body}
    """.replace("\n        ", "\n")
    )


def owned(pool) -> dict:
    return {
        "pids": [pool._proc.pid] + [p.pid for p in psutil.Process(pool._proc.pid).children(recursive=True)],
        "cgroups": list(pool._cgroup or []),
    }


def assert_gone(record: dict) -> None:
    for pid in record["pids"]:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
    for path in record["cgroups"]:
        assert not os.path.isdir(path), path


@pytest.mark.parametrize(
    "option, expected",
    [([], "template"), (["--boltzlabs-spawn=exec"], "exec"), (["--boltzlabs-spawn=template"], "template")],
)
def test_rlpool_makes_pools_in_the_chosen_spawn_mode_and_closes_them(pytester, tmp_path, option, expected):
    record = tmp_path / "seen.json"
    inner_test(
        pytester,
        """
        import psutil
        def test_two_pools(rlpool):
            a = rlpool(COUNTER, 2)
            b = rlpool(COUNTER, 1, spawn="exec")  # a test's own spawn= wins
            a.reset(seed=0)
            a.step([1, 1])
            a.reset(seed=0, hard=True)  # respawned envs: owned too
            pids = [p.pid for pool in (a, b) for p in psutil.Process(pool._proc.pid).children(recursive=True)]
            pids += [a._proc.pid, b._proc.pid]
            save(spawn=[a.spawn, b.spawn], pids=pids, cgroups=list(a._cgroup) + list(b._cgroup))
    """,
        record,
    )
    result = pytester.runpytest_subprocess(*option)
    result.assert_outcomes(passed=1)
    seen = json.loads(record.read_text())
    assert seen["spawn"] == [expected, "exec"]
    assert seen["pids"] and seen["cgroups"]
    assert_gone(seen)


def test_a_pool_that_leaves_processes_and_cgroups_fails_the_test(pytester, tmp_path):
    # close() made to do nothing (its finalizer detached), as a close() with a bug would: the worker,
    # its sandboxes and the pool's cgroups stay. The test passes; its teardown must fail and clean up.
    record = tmp_path / "seen.json"
    inner_test(
        pytester,
        """
        import psutil
        def test_leaky(rlpool):
            pool = rlpool(COUNTER, 2)
            pool.reset(seed=0)
            pool._finalizer.detach()
            pids = [pool._proc.pid] + [p.pid for p in psutil.Process(pool._proc.pid).children(recursive=True)]
            save(pids=pids, cgroups=list(pool._cgroup))
    """,
        record,
    )
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=1, errors=1)
    seen = json.loads(record.read_text())
    output = result.stdout.str()
    assert "ERROR at teardown of test_leaky" in output
    assert "rlpool: after close() and a wait of 5 s these remain:" in output
    assert f"process {seen['pids'][0]} (python" in output  # the worker
    for path in seen["cgroups"]:
        assert f"cgroup {path}" in output
    assert_gone(seen)  # killed and removed by the teardown


def test_the_leftover_check_sees_a_live_process_until_it_ends():
    from boltzlabs.pytest_plugin import descendants, remaining

    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        owned_now = descendants(sleeper.pid)
        assert list(owned_now) == [sleeper.pid]
        left = remaining(owned_now, [], wait=0.2)
        assert len(left) == 1 and left[0].startswith(f"process {sleeper.pid} (sleep, "), left
        # The same pid with another start time is another process: not a leftover.
        assert remaining({sleeper.pid: owned_now[sleeper.pid] - 100.0}, [], wait=0.0) == []
    finally:
        sleeper.kill()
    assert remaining(owned_now, [], wait=5.0) == []  # a zombie has ended (not yet reaped)
    sleeper.wait()
    assert remaining(owned_now, [], wait=0.0) == []


def test_the_leftover_check_holds_when_the_boot_time_moves(tmp_path):
    # /proc/stat's btime is the wall clock less the uptime, in whole seconds: it moves by one when
    # the clock is slewed or stepped (the likely cause of a CI failure). Start times built on it (psutil's create_time())
    # made a live pool's processes look like other ones, so the check missed them. Here the check
    # runs where /proc/stat says the machine booted a second later than it did.
    from boltzlabs.pytest_plugin import descendants

    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    moved = re.sub(r"^btime (\d+)$", lambda m: f"btime {int(m[1]) + 1}", open("/proc/stat").read(), flags=re.M)
    (tmp_path / "stat").write_text(moved)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        owned = descendants(sleeper.pid)
        check = (
            "import json, sys; from boltzlabs.pytest_plugin import remaining; "
            "print(json.dumps(remaining({int(k): v for k, v in json.loads(sys.argv[1]).items()}, [], 0.0)))"
        )
        script = 'mount --bind "$0" /proc/stat && grep -q "^btime $1" /proc/stat && shift && exec "$@"'
        btime = re.search(r"^btime (\d+)$", moved, flags=re.M)[1]
        run = subprocess.run(
            ["unshare", "-m", "sh", "-c", script, str(tmp_path / "stat"), btime, sys.executable, "-c", check]
            + [json.dumps(owned)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 0, run.stderr
        left = json.loads(run.stdout)
        assert len(left) == 1 and left[0].startswith(f"process {sleeper.pid} (sleep, "), left
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_process_name_cannot_mislead_the_start_time():
    # The name (comm) is the env's to set; /proc/<pid>/stat shows it in parentheses, so one
    # with ") R 1 2" in it must not shift the fields read after it.
    from boltzlabs.pytest_plugin import started

    code = (
        "import ctypes, time; ctypes.CDLL(None).prctl(15, b') R 1 2 3 4 5', 0, 0, 0); print(flush=True); time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        child.stdout.readline()
        assert psutil.Process(child.pid).name() == ") R 1 2 3 4 5"
        with open("/proc/uptime") as uptime:
            now = float(uptime.read().split()[0]) * os.sysconf("SC_CLK_TCK")
        # After us (its parent), before now: a field read off by one or more would be a count or a size.
        assert started(os.getpid()) <= started(child.pid) <= now + 1
    finally:
        child.kill()
        child.wait()
    assert started(child.pid) is None


def test_the_leftover_check_sees_a_live_pool(pool_factory):
    from boltzlabs.pytest_plugin import descendants, remaining

    pool = pool_factory(COUNTER, 2)
    processes = descendants(pool._proc.pid)
    left = remaining(processes, list(pool._cgroup), wait=0.0)
    assert len(left) == len(processes) + len(pool._cgroup)
    pool.close()
    assert remaining(processes, list(pool._cgroup), wait=5.0) == []


@pytest.mark.parametrize("keep", [True, False])
def test_keep_logs_attaches_each_env_log_to_a_failing_test(pytester, keep, env_dir):
    source = env_dir("""
        from boltzlabs.env import serve

        def reset(seed):
            print(f"env log line: reset with seed {seed}", flush=True)
            return seed

        serve(reset=reset, step=lambda action: (action, 0.0, False, {}))
    """)
    inner_test(
        pytester,
        f"""
        def test_fails(rlpool):
            pool = rlpool({str(source)!r}, 2)
            pool.reset(seed=40)
            assert False, "the inner test fails"

        def test_passes(rlpool):
            rlpool({str(source)!r}, 1).reset(seed=7)
    """,
    )
    result = pytester.runpytest_subprocess(*(["--boltzlabs-keep-logs"] if keep else []))
    result.assert_outcomes(passed=1, failed=1)
    output = result.stdout.str()
    for lane, seed in ((0, 40), (1, 41)):
        shown = re.search(
            rf"boltzlabs pool 0 \([^\n]*, spawn=template\): env {lane} log -+\n"
            rf"(?:(?!.*boltzlabs pool)[^\n]*\n)*?env log line: reset with seed {seed}\n",
            output,
        )
        assert bool(shown) == keep, output
    assert "reset with seed 7" not in output  # a passing test's logs are not attached


def test_keep_logs_shows_a_bounded_number_of_env_logs(pytester, env_dir):
    from boltzlabs.pytest_plugin import KEEP_LOGS_MAX

    source = env_dir("""
        from boltzlabs.env import serve

        def reset(seed):
            print(f"env log line: reset with seed {seed}", flush=True)
            return seed

        serve(reset=reset, step=lambda action: (action, 0.0, False, {}))
    """)
    n = KEEP_LOGS_MAX + 4
    inner_test(
        pytester,
        f"""
        def test_fails(rlpool):
            rlpool({str(source)!r}, {n}).reset(seed=100)
            assert False, "the inner test fails"
    """,
    )
    result = pytester.runpytest_subprocess("--boltzlabs-keep-logs")
    result.assert_outcomes(failed=1)
    output = result.stdout.str()
    assert f"env {KEEP_LOGS_MAX - 1} log" in output
    assert f"env {KEEP_LOGS_MAX} log" not in output
    assert f"logs of envs {KEEP_LOGS_MAX}..{n - 1} left out" in output
