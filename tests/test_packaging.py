"""The wheel carries the policy data, and an installed (non-editable) copy uses it."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(300)
def test_wheel_ships_the_policy_and_uses_it_when_installed(tmp_path):
    wheels = tmp_path / "wheels"
    # From a clean copy: a build/ left in the checkout by an earlier build is
    # packed as it is, and would ship modules pyproject no longer lists.
    source = tmp_path / "source"
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(
            "build", "dist", "*.egg-info", ".venv", ".git", "__pycache__", ".pytest_cache", ".hypothesis", "results"
        ),
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(source)],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    (wheel,) = wheels.glob("boltzlabs-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in (
        "boltzlabs/_data/sandbox/policy.toml",
        "boltzlabs/_data/mounts/system.toml",
        "boltzlabs/_data/mounts/interpreter.toml",
        "boltzlabs/_data/mounts/runtime.toml",
        "boltzlabs/_data/mounts/env.toml",
        "boltzlabs/runtime/gym_env/env.py",
        "boltzlabs/runtime/template.py",
        "boltzlabs/env.py",
        "boltzlabs/worker/__main__.py",
    ):
        assert name in names, name
    # pyproject lists the packages by hand (the policy data's package-dir mapping rules out find):
    # a package left off that list would be missing from every installed copy.
    sources = {
        str(path.relative_to(ROOT)) for path in (ROOT / "boltzlabs").rglob("*.py") if "__pycache__" not in path.parts
    }
    assert not sources - names, f"the wheel lacks {sorted(sources - names)}; add their packages to pyproject.toml"
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
    )
    code = (
        "import boltzlabs.host.policy as s; p = s.load_policy(); "
        "print(s._data_dir('sandbox')); print(p.sandbox['workspace']['path'])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=True,
    ).stdout.split()
    assert out[0] == str(site / "boltzlabs" / "_data" / "sandbox")
    assert out[1] == "/workspace"
