"""The template's warm-up: the env's real work, probed once in a throwaway sandbox,
so the template imports what reset and step import (boltzlabs.worker.spawn.TemplateSpawner._warmup,
then boltzlabs.runtime.template.warm)."""

import re
import warnings
from pathlib import Path

import msgpack
import pytest

from boltzlabs import RLPool

MiB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent

# Reports, at the start of reset (before its own lazy imports), what the
# template had imported: a forked env's sys.modules is the template's.
LAZY = """
import sys
import numpy as np
from boltzlabs.env import serve

rng = None

def reset(seed):
    global rng
    seen = {name: name in sys.modules for name in ("decimal", "numpy.random", "xml.dom.minidom")}
    import decimal
    rng = np.random.default_rng(seed)
    return seen

def step(action):
    return float(rng.random()), 0.0, False, {}

serve(reset=reset, step=step, warmup_actions=[0, 1])
"""


def test_the_probes_imports_reach_the_template_before_the_first_fork(env_dir):
    directory = env_dir(LAZY)
    with RLPool(directory, 2, spawn="template") as pool:
        report = pool.env_contract["warmup"]
        assert report["error"] is None and report["steps"] == 2, report
        assert {"decimal", "numpy.random"} <= set(report["modules"]) <= set(report["imported"]) | set(report["failed"])
        assert report["private_after"] > report["private_birth"] > 0
        seen = pool.reset(seed=1)
        assert all(s["decimal"] and s["numpy.random"] and not s["xml.dom.minidom"] for s in seen), seen
    with RLPool(directory, 2, spawn="template", warmup=False) as pool:
        assert pool.env_contract["warmup"] is None
        seen = pool.reset(seed=1)
        assert not any(s["decimal"] or s["numpy.random"] for s in seen), seen
    with RLPool(directory, 2, spawn="exec") as pool:
        assert pool.env_contract.warmup is None
        assert not any(s["decimal"] or s["numpy.random"] for s in pool.reset(seed=1))


NUMPY_ENV = """
import numpy as np
from boltzlabs.env import serve
{at_import}
rng = None

def reset(seed):
    global rng
    rng = np.random.default_rng(seed)
    return rng.random(4)

def step(action):
    return rng.random(4), 1.0, False, {{}}

serve(reset=reset, step=step, warmup_actions=[0] * 4)
"""


def _mean_memory(directory, n, **kwargs) -> float:
    with RLPool(directory, n, spawn="template", **kwargs) as pool:
        pool.reset(seed=0)
        for _ in range(3):
            pool.step([0] * n)
        memory = pool.memory()
        assert memory.source.startswith("cgroup")
        return memory.mean


def test_a_lazy_numpy_random_costs_an_env_what_a_module_level_one_does(env_dir):
    lazy = env_dir(NUMPY_ENV.format(at_import=""))
    eager = env_dir(NUMPY_ENV.format(at_import="np.random.default_rng(0)"))
    n = 50
    at_import = _mean_memory(eager, n)
    warmed = _mean_memory(lazy, n)
    cold = _mean_memory(lazy, n, warmup=False)
    print(
        f"MiB per env: module-level {at_import / MiB:.2f}, lazy warmed {warmed / MiB:.2f}, lazy cold {cold / MiB:.2f}"
    )
    assert warmed <= 1.25 * at_import + 0.3 * MiB, (warmed / MiB, at_import / MiB)
    assert cold > warmed + 2 * MiB, (cold / MiB, warmed / MiB)  # numpy.random's ~5 MiB, each env's own


# Module state the probe's reset and step would change had they run in the
# template: a counter of resets and a module-level RNG seeded at import.
# Each also imports something lazily, so the warm-up has work to do.
STATEFUL = """
import random
from boltzlabs.env import serve

RESETS = 0
RNG = random.Random(1234)

def reset(seed):
    global RESETS
    import decimal, fractions
    RESETS += 1
    return [RESETS, RNG.random(), str(decimal.Decimal(seed or 0) / 7)]

def step(action):
    import json
    return [RESETS, RNG.random(), json.dumps(action)], RNG.random(), False, {}

serve(reset=reset, step=step, warmup_actions=[1, 2, 3])
"""


def _episodes(pool, hard=False) -> bytes:
    out = [pool.reset(seed=5, hard=hard)]
    for t in range(4):
        obs, rewards, dones, infos = pool.step([t] * pool.n)
        out.append([obs, rewards.tolist()])
    return msgpack.packb(out)


def test_episodes_with_the_warm_up_equal_exec_modes_byte_for_byte(env_dir):
    directory = env_dir(STATEFUL)
    with RLPool(directory, 3, spawn="exec") as pool:
        expected = _episodes(pool)
    with RLPool(directory, 3, spawn="template") as pool:
        report = pool.env_contract["warmup"]
        assert report["error"] is None and report["steps"] == 3 and "decimal" in report["imported"], report
        assert _episodes(pool) == expected
        assert _episodes(pool, hard=True) == expected  # a fresh fork of the untouched template
        assert _episodes(pool, hard=True) == expected


LEGACY = """
import numpy as np
from boltzlabs.env import serve

def reset(seed):
    import numpy.random
    return float(np.random.random())  # the legacy global state, never seeded

def step(action):
    return 0, 0.0, False, {}

serve(reset=reset, step=step)
"""


def test_numpy_randoms_global_state_differs_per_env_as_in_exec_mode(env_dir):
    """numpy.random seeds its global RandomState from the OS at import: imported
    by the warm-up, each child reseeds it, or every env would draw the same."""
    with RLPool(env_dir(LEGACY), 4, spawn="template") as pool:
        assert "numpy.random" in pool.env_contract["warmup"]["imported"]
        draws = pool.reset()
        assert len(set(draws)) == 4, draws
        draws = pool.reset(hard=True)
        assert len(set(draws)) == 4, draws


# Every probe fault leaves files first (workspace, /tmp, /dev/shm); the probe
# is told apart from the pool's envs by its seed (0) and its actions ("fault").
FAULTY = """
import os, sys, time, ctypes
from boltzlabs.env import serve

MARKS = ("probe_mark", "/tmp/probe_mark", "/dev/shm/probe_mark")

def fault(where):
    if {kind!r} != where:
        return
    for path in MARKS:
        with open(path, "w") as f:
            f.write("probe")
    {fault}

def reset(seed):
    if seed == 0:
        fault("reset")
    return [os.path.exists(path) for path in MARKS]

def step(action):
    if action == "fault":
        fault("step")
    return [os.path.exists(path) for path in MARKS], 0.0, False, {{}}

serve(reset=reset, step=step, warmup_actions=["fault", "fault"])
"""

FAULTS = {
    "raises": ("reset", "raise ValueError('the probe broke')", "ValueError: the probe broke"),
    "exits": ("step", "os._exit(3)", "exited with code 3"),
    "segfaults": ("reset", "ctypes.string_at(0)", "killed by SIGSEGV"),
    "hangs": ("reset", "time.sleep(1000)", "did not finish within 1 s"),
    "writes_files": ("step", "pass", None),
}


@pytest.fixture
def short_warmup(tmp_path, monkeypatch):
    """A copy of sandbox/policy.toml with a 1 s warm-up, for this test's pools."""
    text = (ROOT / "sandbox" / "policy.toml").read_text()
    policy = tmp_path / "policy.toml"
    policy.write_text(re.sub(r"(?m)^warmup_timeout = .*$", "warmup_timeout = 1.0", text))
    monkeypatch.setenv("BOLTZLABS_POLICY", str(policy))


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_failing_probe_leaves_no_trace(env_dir, fault, short_warmup):
    kind, code, error = FAULTS[fault]
    directory = env_dir(FAULTY.format(kind=kind, fault=code))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pool = RLPool(directory, 2, spawn="template", step_timeout=5)
    try:
        assert pool.spawn == "template"
        report = pool.env_contract["warmup"]
        notes = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        if error is None:
            assert report["error"] is None and report["steps"] == 2, report
            assert not notes, notes
        else:
            assert error in report["error"], report
            assert any("probe failed" in note and error in note for note in notes), notes
        # The pool's envs: none sees what the probe wrote, and they work.
        assert pool.reset(seed=1) == [[False, False, False]] * 2
        obs, rewards, dones, infos = pool.step([1, 1])
        assert obs == [[False, False, False]] * 2 and not any(dones)
        assert pool.reset(seed=1, hard=True) == [[False, False, False]] * 2
    finally:
        pool.close()


HOSTILE = """
import importlib.machinery, os, sys, types
from boltzlabs import wire
from boltzlabs.env import serve

def fill(names):
    for name in names:
        module = types.ModuleType(str(name))
        module.__spec__ = importlib.machinery.ModuleSpec(str(name), None)
        sys.modules[name] = module

def reset(seed):
    if seed == 0:
        {attack}
    import decimal
    return [len(sys.modules) < 10000, "decimal" in sys.modules]

def step(action):
    return 0, 0.0, False, {{}}

serve(reset=reset, step=step)
"""

ATTACKS = {
    "many_names": "fill(f'fake_{i}' for i in range(100_000))",
    "odd_names": (
        "fill(['os; rm -rf /', '../../etc/passwd', 'x' * 100_000, 'a\\nb', 'bad-name', '', '.', "
        "'a..b', 'caf\\u00e9', 'sys\\x00os', 7, ('tuple',)])"
    ),
    "garbage_report": (
        "os.write(3, wire.encode([34, ['decimal'] * 4000, -1, 'x', None, 0, 0]) + b'\\xc1' * 1000); os._exit(0)"
    ),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_a_hostile_probe_report_is_capped_or_refused(env_dir, attack):
    directory = env_dir(HOSTILE.format(attack=ATTACKS[attack]))
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        pool = RLPool(directory, 2, spawn="template", step_timeout=5)
    try:
        report = pool.env_contract["warmup"]
        names = report["modules"] + report["imported"] + list(report["failed"])
        assert len(report["modules"]) <= 2048 and len(report["failed"]) <= 32, len(report["modules"])
        assert all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", name) for name in names), names
        assert not any(name.startswith("fake_") for name in report["imported"])
        if attack == "garbage_report":
            assert "no valid report" in report["error"], report
        else:
            assert report["refused"] > 0 and report["error"] is None, report
            assert "decimal" in report["imported"]
        # The template is unhurt: its children are small and work.
        assert pool.reset(seed=1) == [[True, True]] * 2
        assert pool.step([0, 0])[1].tolist() == [0.0, 0.0]
        assert pool.reset(seed=1, hard=True) == [[True, True]] * 2
    finally:
        pool.close()


PRELOAD = """
import sys
from boltzlabs.env import serve

def reset(seed):
    return ["xml.dom.minidom" in sys.modules, "colorsys" in sys.modules]

def step(action):
    return 0, 0.0, False, {{}}

serve(reset=reset, step=step, preload={preload!r})
"""


def test_preload_imports_named_modules_in_the_template(env_dir):
    directory = env_dir(PRELOAD.format(preload=["xml.dom.minidom", "no_such_module_here", "not a name"]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pool = RLPool(directory, 2, spawn="template")
    with pool:
        report = pool.env_contract["warmup"]
        assert report["preload"] == ["xml.dom.minidom", "no_such_module_here", "not a name"]
        assert "xml.dom.minidom" in report["imported"]
        assert "ModuleNotFoundError" in report["failed"]["no_such_module_here"]
        assert "not a module name" in report["failed"]["not a name"]
        assert report["error"] is None
        notes = " ".join(str(w.message) for w in caught if issubclass(w.category, RuntimeWarning))
        assert "no_such_module_here" in notes
        assert pool.reset(seed=1) == [[True, False]] * 2
    with RLPool(directory, 2, spawn="template", warmup=False) as pool:
        assert pool.env_contract["warmup"] is None
        assert pool.reset(seed=1) == [[False, False]] * 2


def test_a_remote_pool_takes_warmup(env_dir, tmp_path):
    from test_remote import Worker

    directory = env_dir(LAZY)
    (tmp_path / "remote").mkdir()
    worker = Worker(tmp_path / "remote")
    try:
        with worker.pool(directory, 2, spawn="template") as pool:
            assert "numpy.random" in pool.env_contract["warmup"]["imported"]
            assert all(s["numpy.random"] for s in pool.reset(seed=1))
        with worker.pool(directory, 2, spawn="template", warmup=False) as pool:
            assert pool.env_contract["warmup"] is None
            assert not any(s["numpy.random"] for s in pool.reset(seed=1))
    finally:
        worker.stop()


GREEDY = """
from boltzlabs.env import serve

def reset(seed):
    if seed == 0:
        held = bytearray(512 << 20)  # over the env's memory limit: the probe's too
    return 1

def step(action):
    return 0, 0.0, False, {}

serve(reset=reset, step=step)
"""


def test_the_probe_is_held_to_the_envs_memory_limit(env_dir):
    """The probe runs in the template's cgroup, which has no memory limit."""
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        pool = RLPool(env_dir(GREEDY), 2, spawn="template", memory_limit="128M")
    with pool:
        assert "MemoryError" in pool.env_contract["warmup"]["error"], pool.env_contract["warmup"]
        assert pool.reset(seed=1) == [1, 1]
