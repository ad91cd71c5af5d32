"""A new user's first hour (issue 27): the docs' code runs as written, and the set-up says what it does.

- every ```python block of the README and of docs/gym.md, sb3.md, testing.md and api.md runs:
  a block whose first line names a file (`# my_env/env.py`) is written there, in a fresh
  folder; the other blocks run in order as one script from that folder; a named script
  (`# train.py`) runs with python, a named test file (`# tests/...`) with pytest;
- `from boltzlabs import RLPool` works from the folder that holds the checkout;
- `boltzlabs worker --help` shows its default address once;
- ci/test.sh's progress line and ci/setup.sh's choice of a CPU build of torch.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md", "docs/gym.md", "docs/sb3.md", "docs/testing.md", "docs/api.md"]
FILE_HEADER = re.compile(r"# ([\w./-]+\.py)$")


def python_blocks(doc: Path) -> list[str]:
    return [block for lang, block in re.findall(r"```(\w*)\n(.*?)```", doc.read_text(), re.S) if lang == "python"]


def run(args, cwd, timeout=900) -> str:
    env = dict(os.environ, MUJOCO_GL=os.environ.get("MUJOCO_GL", "egl"))
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, (
        f"{args} in {cwd} exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    )
    return done.stdout


@pytest.mark.parametrize("doc", [pytest.param(d, marks=pytest.mark.slow) if d == "README.md" else d for d in DOCS])
def test_the_docs_code_blocks_run_as_written(doc, tmp_path):
    """README.md's train.py starts 1000 envs: marked slow (one such pool on the host at a time)."""
    os.chmod(tmp_path, 0o755)  # the sandboxes' account reads the env directories written here
    script, runnable = [], []
    for block in python_blocks(ROOT / doc):
        first = block.splitlines()[0].strip()
        match = FILE_HEADER.fullmatch(first)
        if match is None:
            script.append(block)
            continue
        path = tmp_path / match.group(1)
        path.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(path.parent, 0o755)
        path.write_text(block)
        if path.name != "env.py":
            runnable.append(path)
    assert script or runnable or doc == "docs/api.md", f"{doc} has no code to run"
    if script:
        (tmp_path / "doc_script.py").write_text("\n".join(script))
        run([sys.executable, "doc_script.py"], tmp_path)
    for path in runnable:
        if "tests" in path.relative_to(tmp_path).parts:
            run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)], tmp_path)
        else:
            run([sys.executable, str(path.relative_to(tmp_path))], tmp_path)


def test_boltzlabs_imports_from_the_folder_that_holds_the_checkout(tmp_path):
    """That folder's "boltzlabs" is the checkout (no __init__.py): it must not be taken for the package."""
    holder = tmp_path / "holder"
    holder.mkdir()
    (holder / "boltzlabs").symlink_to(ROOT)
    out = run([sys.executable, "-c", "from boltzlabs import RLPool; print(RLPool.__module__)"], holder)
    assert out.strip() == "boltzlabs.pool.client"


def test_worker_help_names_its_default_address_once():
    out = run([sys.executable, "-m", "boltzlabs", "worker", "--help"], ROOT)
    text = " ".join(out.split())
    assert "(default 127.0.0.1:7733;" in text and "127.0.0.1:127.0.0.1" not in text


def test_ci_test_sh_prints_progress_while_stages_run(tmp_path):
    """ci/test.sh's progress() reads each running stage's pytest -q output."""
    source = (ROOT / "ci" / "test.sh").read_text()
    function = re.search(r"^progress\(\) \{.*?^\}", source, re.S | re.M).group(0)
    (tmp_path / "native").write_text("....F.s. [ 10%]\n.....E.. [ 20%]\n..")
    (tmp_path / "pure").write_text("")
    script = (
        textwrap.dedent(f"""
        set -euo pipefail
        logs={tmp_path}; declare -A label_of=([native]="suite, native path" [pure]="suite, pure-Python path")
        pending=(native pure); begun=$(( $(date +%s) - 42 ))
    """)
        + function
        + "\nprogress\n"
    )
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(
        r"ci/test\.sh: 4[23] s: suite, native path 20% \(18 tests, 2 failed so far\); "
        r"suite, pure-Python path 0% \(0 tests\)\n",
        done.stderr,
    ), done.stderr
    assert "progress\n" in source.split("next_progress")[-2]  # called from the waiting loop


def test_ci_setup_sh_prefers_a_cpu_build_of_torch_pip_can_see(tmp_path):
    from pip._vendor.packaging.tags import sys_tags

    tag = next(iter(sys_tags()))
    for version in ("2.0.0", "9.9.0"):
        (tmp_path / f"torch-{version}+cpu-{tag.interpreter}-{tag.abi}-{tag.platform}.whl").write_bytes(b"")
    (tmp_path / "torch-99.0.0-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")  # not a CPU build
    env = dict(os.environ, PIP_CONFIG_FILE=os.devnull, PIP_FIND_LINKS=str(tmp_path))
    out = subprocess.run(
        [sys.executable, str(ROOT / "ci" / "cpu_torch.py")], capture_output=True, text=True, env=env, timeout=120
    ).stdout.strip()
    assert out == str(tmp_path / f"torch-9.9.0+cpu-{tag.interpreter}-{tag.abi}-{tag.platform}.whl")
    env["PIP_FIND_LINKS"] = str(tmp_path / "none")
    assert (
        subprocess.run(
            [sys.executable, str(ROOT / "ci" / "cpu_torch.py")], capture_output=True, text=True, env=env, timeout=120
        ).stdout.strip()
        == ""
    )
    setup = (ROOT / "ci" / "setup.sh").read_text()
    assert "ci/cpu_torch.py" in setup and "--minimal" in (ROOT / "ci" / "demo.sh").read_text()
