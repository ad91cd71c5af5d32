"""`boltzlabs check`'s memory stage: what an env's first reset and steps cost.

Real pools over real sandboxes. The host reads the env process's
Private_Dirty (/proc/<pid>/smaps_rollup) at birth and after reset + steps,
and the extension modules it mapped in between (/proc/<pid>/maps); with the
warm template's probe (issue 14: RLPool(..., warmup=...),
pool.env_contract "warmup") the probe's report names the modules too.
"""

import inspect
import re
import subprocess
import sys

import pytest

from boltzlabs import RLPool
from boltzlabs.cli.check import PRELOAD_HINT, check_env
from boltzlabs.cli.doctor import OK, WARN

HANG = 120  # seconds: only to catch a hang

# numpy 2.x loads numpy.random on first use: here, the first reset.
LAZY = """
import numpy as np
from boltzlabs.env import serve

state = {"rng": None}

def reset(seed):
    state["rng"] = np.random.default_rng(seed)
    return float(state["rng"].uniform())

def step(action):
    return float(state["rng"].uniform()), 1.0, False, {}

serve(reset=reset, step=step)
"""
# The same env with numpy.random loaded at import: its reset imports nothing.
EAGER = LAZY.replace('state = {"rng": None}', 'state = {"rng": np.random.default_rng(0)}')

PROBE_EXISTS = "warmup" in inspect.signature(RLPool.__init__).parameters


def memory_findings(source, spawn="template", warmup=None):
    findings = list(check_env(source, steps=5, spawn=spawn, warmup=warmup))
    assert not [f for f in findings if f.status == "fail"], findings
    return [f for f in findings if f.name == "memory"]


def growth(finding) -> float:
    """The MiB an env's private memory grew by, from the finding's words."""
    found = re.search(r"after reset and \d+ step\(s\) \(([+-][\d.]+) MiB\)", finding.detail)
    assert found, finding.detail
    return float(found.group(1))


def host_side(findings):
    (finding,) = [f for f in findings if f.detail.startswith("env process")]
    return finding


def test_a_lazy_import_in_reset_gets_a_preload_suggestion_and_an_eager_one_none(env_dir):
    # Without the probe (off, or not in this boltzlabs) the host's figures alone must tell them apart.
    warmup = False if PROBE_EXISTS else None
    lazy = host_side(memory_findings(env_dir(LAZY), warmup=warmup))
    eager = host_side(memory_findings(env_dir(EAGER), warmup=warmup))

    assert lazy.status == WARN, lazy
    assert "numpy.random" in lazy.detail
    assert 'preload = ["numpy.random"] under [boltzlabs] in a boltzlabs.toml' in lazy.fix
    assert eager.status == OK and not eager.fix, eager
    assert "numpy.random" not in eager.detail
    # The margin, both measured here: importing numpy.random in a forked env writes MiBs.
    assert growth(lazy) - growth(eager) > PRELOAD_HINT / (1 << 20), (lazy.detail, eager.detail)
    assert growth(eager) < PRELOAD_HINT / (1 << 20), eager.detail


def test_exec_mode_names_the_modules_without_a_suggestion(env_dir):
    # In exec mode every env imports everything itself: preloading would share nothing.
    finding = host_side(memory_findings(env_dir(LAZY), spawn="exec"))
    assert finding.status == OK and not finding.fix, finding
    assert "numpy.random" in finding.detail and "exec mode" in finding.detail


@pytest.mark.skipif(not PROBE_EXISTS, reason="this boltzlabs has no warm-up probe (RLPool(..., warmup=))")
def test_the_probe_s_report_names_the_modules_and_the_template_pays_for_them(env_dir):
    findings = memory_findings(env_dir(LAZY))
    probe = [f for f in findings if f.detail.startswith("the warm-up probe")]
    assert len(probe) == 1, findings
    assert probe[0].status == OK, probe[0]
    assert "numpy.random" in probe[0].detail
    assert "preload = [" in probe[0].fix and '"numpy.random"' in probe[0].fix  # its child wrote MiBs importing it
    # The template imported it before forking: the env itself now writes little.
    lazy = host_side(findings)
    assert lazy.status == OK and growth(lazy) < PRELOAD_HINT / (1 << 20), lazy.detail


def test_the_command_prints_the_suggestion(env_dir):
    source = env_dir(LAZY)
    argv = [sys.executable, "-m", "boltzlabs", "check", str(source), "--steps", "3"]
    if PROBE_EXISTS:
        argv += ["--no-warmup"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=HANG, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stdout + out.stderr  # a warning, not a failure
    assert "WARN  memory" in out.stdout
    assert 'fix: preload = ["numpy.random"] under [boltzlabs]' in out.stdout
