"""The zygote and the sandbox on a real project's layout (issue 41, an outside review's round four).

Research projects are laid out alike: the trainer runs from the project root with
`PYTHONPATH=.` (or the project is installed editable), its envs live in
`envs/<name>/`, and beside them lie a `.env` with API keys and a `.git` whose
config holds a remote URL with a token. Each test is one of the round's
findings, written from its description, in both spawn modes where it applies:

1. env code reached through an import root that holds the env's directory
   never runs in the template (by any path: the file's directory is compared
   by device and inode, not by the path it was reached through);
2. the warm-up imports no program entry point, and runs with a sys.argv that
   names no env path;
3. an import root is bound narrowed: its packages and modules, never its
   dotfiles, VCS directories, credential files or data;
4. a lane's observation slot is cleared between incarnations.
"""

import os
import warnings

import numpy as np
import pytest

from boltzlabs import RLPool
from boltzlabs.pool import imports

SECRET = "sk-boltzlabs-test-SECRET"


@pytest.fixture
def project(tmp_path):
    """A project root as research projects have it; returns its path."""
    root = tmp_path / "proj"
    files = {
        "envs/__init__.py": "",
        "envs/counter/__init__.py": "",
        "lib/__init__.py": "VALUE = 'lib from the project'\n",
        "lib/.env": f"LIB_KEY={SECRET}\n",
        "lib/.git": "gitdir: ../.git/modules/lib\n",
        "lib/certs/server.key": SECRET,
        "lib/assets/table.json": "[1, 2, 3]\n",
        "util.py": "VALUE = 'util from the project'\n",
        "train.py": "print('the trainer')\n",
        ".env": f"OPENAI_API_KEY={SECRET}\n",
        ".netrc": f"machine example.com login me password {SECRET}\n",
        ".git/config": f'[remote "origin"]\n\turl = https://{SECRET}@example.com/proj.git\n',
        ".git/HEAD": "ref: refs/heads/main\n",
        ".ssh/id_ed25519": SECRET,
        "id_rsa": SECRET,
        "server.pem": SECRET,
        "README.md": "# the project\n",
        "data/table.csv": "a,b\n1,2\n",
        "secrets/prod.yaml": f"key: {SECRET}\n",
    }
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    # The sandboxes run as the host account 'nobody' when the trainer is root: the
    # project is as readable as a checkout with 0644 files is.
    for directory in (tmp_path, *[p for p in root.rglob("*") if p.is_dir()], root):
        os.chmod(directory, 0o755)
    return root


def env_in(project, name: str, text: str, **files: str):
    directory = project / "envs" / name
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "__init__.py").write_text("")
    (directory / "env.py").write_text(text)
    for file, body in files.items():
        (directory / file).write_text(body)
    os.chmod(directory, 0o755)
    return directory


# -- 1: env code reached through an import root ------------------------------------------------

PAYLOAD = """
import mmap, os

BORN = os.getpid()
AREA = []


def _share():  # before each fork: one MAP_SHARED page every child would have
    if not AREA:
        AREA.append(mmap.mmap(-1, 4096, flags=mmap.MAP_SHARED))


os.register_at_fork(before=_share)


def area():
    if not AREA:
        AREA.append(mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE))
    return AREA[0]


def write(text):
    area()[:16] = text.encode().ljust(16, b"\\0")


def read():
    return area()[:16].rstrip(b"\\0").decode()
"""

PAYLOAD_ENV = """
import importlib, os
from boltzlabs.env import serve

payload = importlib.import_module("envs.{name}.payload")


def reset(seed):
    return payload.BORN == os.getpid()  # imported by this env itself, not handed down by a template


def step(action):
    if action:
        payload.write(action)
    return payload.read(), 0.0, False, {{}}


serve(reset=reset, step=step, preload=["envs.{name}.payload"])
"""


def test_env_code_reached_through_a_pythonpath_root_never_runs_in_the_template(
    pool_factory, project, monkeypatch, spawn
):
    directory = env_in(project, "counter", PAYLOAD_ENV.format(name="counter"), **{"payload.py": PAYLOAD})
    monkeypatch.setenv("PYTHONPATH", str(project))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the narrowed root's note (point 3)
        pool = pool_factory(directory, 2, preload=["envs.counter.payload", "envs.counter", "envs.counter.env"])
    if spawn == "template":
        report = pool.env_contract["warmup"]
        mine = {"envs.counter", "envs.counter.payload", "envs.counter.env"}
        assert not mine & set(report["imported"]), report
        assert not mine & set(report["modules"]), report
        for name in ("envs.counter", "envs.counter.payload"):
            assert "env's directory" in report["failed"][name], report
    assert pool.reset(seed=0) == [True, True]
    obs, *_ = pool.step(["lane0", None])
    assert obs == ["lane0", ""]
    pool.reset(hard=True, seed=0)
    obs, *_ = pool.step([None, None])
    assert obs == ["", ""]  # no page an at-fork hook mapped in a template reaches a lane


def test_a_symlink_into_the_envs_directory_does_not_make_its_code_a_library(project, monkeypatch):
    """A root entry that links into the env's directory reaches the same files by another
    name: they are still the env's, by device and inode."""
    directory = env_in(project, "linked", PAYLOAD_ENV.format(name="linked"), **{"payload.py": PAYLOAD})
    (project / "shortcut").symlink_to("envs/linked")  # relative: it resolves inside the sandbox too
    monkeypatch.setenv("PYTHONPATH", str(project))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        pool = RLPool(directory, 2, spawn="template", preload=["shortcut.payload", "shortcut"])
    with pool:
        report = pool.env_contract["warmup"]
        assert not {"shortcut", "shortcut.payload"} & set(report["imported"]), report
        assert pool.reset(seed=0) == [True, True]


# -- 2: programs are not libraries ----------------------------------------------------------------

# What IPython.__main__ does at import (start_ipython() runs the command line's script).
PROGRAM = """
import runpy, sys
for arg in sys.argv[1:]:
    if arg.endswith(".py"):
        runpy.run_path(arg, run_name="__main__")
"""

RAN_ENV = """
import builtins, os, sys
from boltzlabs.env import serve

builtins.RAN_IN = [*getattr(builtins, "RAN_IN", []), os.getpid()]  # each place env.py ran

import argv_seen


def reset(seed):
    return [builtins.RAN_IN == [os.getpid()], argv_seen.ARGV]


serve(reset=reset, step=lambda action: (0, 0.0, False, {{}}), preload={preload})
"""


@pytest.mark.parametrize("where", ["pool", "boltzlabs.toml", "serve"])
def test_a_programs_entry_point_is_never_imported_by_the_warm_up(project, monkeypatch, where):
    (project / "tool").mkdir()
    (project / "tool" / "__init__.py").write_text("")
    (project / "tool" / "__main__.py").write_text(PROGRAM)
    (project / "argv_seen.py").write_text("import sys\nARGV = list(sys.argv)\n")
    names = ["tool.__main__", "argv_seen", "this", "pytest.__main__"]
    directory = env_in(project, "ran", RAN_ENV.format(preload=names if where == "serve" else []))
    if where == "boltzlabs.toml":
        (directory / "boltzlabs.toml").write_text(f"[boltzlabs]\npreload = {names!r}\n")
    monkeypatch.setenv("PYTHONPATH", str(project))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        pool = RLPool(directory, 2, spawn="template", preload=names if where == "pool" else None)
    with pool:
        report = pool.env_contract["warmup"]
        for name in ("tool.__main__", "this", "pytest.__main__"):
            assert name not in report["imported"], report
            assert "a program, not a library" in report["failed"][name], report
        assert "argv_seen" in report["imported"], report
        for ran_once, argv in pool.reset(seed=0):
            assert ran_once  # env.py ran in this env only, never in the template
            # argv_seen was imported by the template: the sys.argv it saw names no env path
            assert not any("env" in arg for arg in argv), argv


def test_a_boltzlabs_toml_beside_env_py_does_not_hide_the_runtime_from_the_template(env_dir):
    directory = env_dir("""
from boltzlabs.env import serve
serve(reset=lambda seed: 0, step=lambda action: (0, 0.0, False, {}))
""")
    (directory / "boltzlabs.toml").write_text('[boltzlabs]\npreload = ["colorsys"]\n')
    with RLPool(directory, 1, spawn="template") as pool:
        report = pool.env_contract["warmup"]
        assert "boltzlabs.env" in report["imported"], report
        assert "boltzlabs.env" not in report["failed"], report
        assert "colorsys" in report["imported"], report


# -- 3: an import root is bound narrowed ----------------------------------------------------------

SEEN_ENV = """
import os, sys
from boltzlabs.env import serve

import lib, util


def seen():
    found = []
    for entry in sys.path:
        if entry.startswith("/opt/import"):
            for top, dirs, files in os.walk(entry):
                for name in dirs + files:
                    found.append(os.path.relpath(os.path.join(top, name), entry))
    return sorted(set(found))


def readable(relative):
    for entry in sys.path:
        try:
            with open(os.path.join(entry, relative)) as f:
                return f.read()
        except OSError:
            pass
    return None


def reset(seed):
    return [lib.VALUE, util.VALUE, seen(), readable("data/table.csv"), readable("lib/assets/table.json")]


serve(reset=reset, step=lambda action: (0, 0.0, False, {}))
"""

NEVER_SEEN = [
    ".env",
    ".netrc",
    ".git",
    ".git/config",
    ".ssh",
    "id_rsa",
    "server.pem",
    "README.md",
    "data",
    "secrets",
    "lib/.env",
    "lib/.git",
    "lib/certs/server.key",
]


def _check_narrowed(obs, data_exposed=False):
    value, util_value, found, data, asset = obs
    assert value == "lib from the project" and util_value == "util from the project"
    assert {"lib/__init__.py", "util.py", "train.py", "envs/__init__.py"} <= set(found), found
    leaked = [path for path in NEVER_SEEN if path in found and not (data_exposed and path == "data")]
    assert not leaked, leaked
    assert not any(SECRET in str(part) for part in obs)
    assert asset == "[1, 2, 3]\n"  # a package's own data comes with it
    assert data == ("a,b\n1,2\n" if data_exposed else None)


def test_a_pythonpath_root_shows_envs_its_code_and_nothing_else(pool_factory, project, monkeypatch):
    directory = env_in(project, "seen", SEEN_ENV)
    monkeypatch.setenv("PYTHONPATH", str(project))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pool = pool_factory(directory, 2)
    notes = [str(w.message) for w in caught if str(project) in str(w.message)]
    assert len(notes) == 1, [str(w.message) for w in caught]
    assert "expose=" in notes[0] and ".env" in notes[0], notes[0]
    for obs in pool.reset(seed=0):
        _check_narrowed(obs)


def test_expose_binds_more_of_a_root_and_only_what_it_names(pool_factory, project, monkeypatch):
    directory = env_in(project, "seen", SEEN_ENV)
    monkeypatch.setenv("PYTHONPATH", str(project))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        pool = pool_factory(directory, 1, expose=[str(project / "data")])
    _check_narrowed(pool.reset(seed=0)[0], data_exposed=True)


@pytest.mark.parametrize(
    "paths, error",
    [
        ("/etc", "expose must be a list"),
        (["relative/path"], "absolute path"),
        (["/etc/passwd"], "not below an import root"),
        ("remote", "a remote worker binds none of them"),
    ],
)
def test_expose_is_checked_before_anything_starts(project, monkeypatch, paths, error):
    monkeypatch.setenv("PYTHONPATH", str(project))
    directory = env_in(project, "seen", SEEN_ENV)
    remote = {"worker": "tcp://127.0.0.1:9"} if paths == "remote" else {}
    with pytest.raises((TypeError, ValueError), match=error):
        RLPool(directory, 1, expose=[str(project / "data")] if remote else paths, **remote)


def test_an_editable_install_of_the_project_is_narrowed_alike(pool_factory, project, tmp_path, monkeypatch):
    """pip install -e . of the project: a .pth naming its root, and setuptools' finder mapping a
    package to its directory (whose own dotfiles and keys stay hidden too)."""
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    (site_dir / "__editable__.proj-0.1.pth").write_text(f"{project}\n")
    finder = type(os)("__editable___projlib_0_1_finder")
    finder.MAPPING = {"lib": str(project / "lib")}
    monkeypatch.setitem(__import__("sys").modules, finder.__name__, finder)
    real = imports._site_dirs
    monkeypatch.setattr(imports, "_site_dirs", lambda: [*real(), str(site_dir)])
    monkeypatch.delenv("PYTHONPATH", raising=False)
    assert [str(project), "pth", ""] in imports.roots()
    directory = env_in(project, "seen", SEEN_ENV)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        pool = pool_factory(directory, 1)
    _check_narrowed(pool.reset(seed=0)[0])


SECRETS_ENV = """
import os
from boltzlabs.env import serve

NAMES = ["AWS_SECRET_ACCESS_KEY", "WANDB_API_KEY", "HF_TOKEN", "OPENAI_API_KEY", "GITHUB_TOKEN"]
serve(reset=lambda seed: sorted(n for n in NAMES if n in os.environ) + [str(len(repr(dict(os.environ))))],
      step=lambda action: (0, 0.0, False, {}))
"""


def test_the_trainers_secret_variables_never_reach_an_env(pool_factory, env_dir, monkeypatch):
    for name in ("AWS_SECRET_ACCESS_KEY", "WANDB_API_KEY", "HF_TOKEN", "OPENAI_API_KEY", "GITHUB_TOKEN"):
        monkeypatch.setenv(name, SECRET)
    pool = pool_factory(env_dir(SECRETS_ENV), 1)
    (seen,) = pool.reset(seed=0)
    assert seen[:-1] == [], seen


# -- 4: a lane's slot is cleared between incarnations ----------------------------------------------

SLOT_ENV = """
import os
import numpy as np
from gymnasium import spaces
from boltzlabs import abi
from boltzlabs.env import serve

try:  # at import: what this env's observation slot holds before it ever wrote
    AT_IMPORT = os.pread(abi.SLOT_FD, 16, 0).ljust(16, b"\\0")
except OSError:
    AT_IMPORT = bytes(16)


def reset(seed):
    return np.frombuffer(AT_IMPORT, np.uint8).copy()


def step(action):
    obs = np.zeros(16, np.uint8)
    text = f"SECRET-lane{action}".encode()
    obs[: len(text)] = np.frombuffer(text, np.uint8)
    return obs, 0.0, False, {}


serve(reset=reset, step=step, observation_space=spaces.Box(0, 255, (16,), np.uint8),
      action_space=spaces.Discrete(4))
"""


def test_a_respawned_env_finds_its_observation_slot_empty(pool_factory, env_dir):
    pool = pool_factory(env_dir(SLOT_ENV), 2)
    assert pool.shared_memory
    first = np.asarray(pool.reset(seed=0))
    assert not first.any()
    obs, *_ = pool.step([0, 1])
    assert bytes(obs[0]).startswith(b"SECRET-lane0")
    again = np.asarray(pool.reset(hard=True, seed=0))
    assert not again.any(), [bytes(row) for row in again]
    obs, *_ = pool.step([0, 1])
    pool.reset(where=[True, False], hard=True, seed=0)  # one lane's respawn: it alone is cleared
    obs, *_ = pool.step([2, 3])
    assert bytes(obs[0]).startswith(b"SECRET-lane2") and bytes(obs[1]).startswith(b"SECRET-lane3")


# -- the scan itself, on hostile trees (host/roots.py, no sandbox) ---------------------------------


def _scanner(limit=50000):
    from boltzlabs.host import policy, roots

    hide = policy.load_policy().reader().names("import_roots", "hide")
    return roots.Scanner(hide, limit)


def test_modules_named_like_secrets_stay_importable_and_their_look_alikes_stay_out(tmp_path):
    for name in ("secrets.py", "credentials.py", "id_utils.py", "token.py", "keys.cpython-311-x86_64-linux-gnu.so"):
        (tmp_path / name).write_text("")
    for name in ("secrets.yaml", "credentials", "id_rsa", "token", "tls.key", ".hidden.py", "notes.txt"):
        (tmp_path / name).write_text(SECRET)
    narrowed = _scanner().narrow(str(tmp_path))
    shown = sorted(os.path.basename(path) for path in narrowed.binds)
    assert shown == sorted(
        ["secrets.py", "credentials.py", "id_utils.py", "token.py", "keys.cpython-311-x86_64-linux-gnu.so"]
    )
    assert sorted(narrowed.left_out) == sorted(
        ["secrets.yaml", "credentials", "id_rsa", "token", "tls.key", ".hidden.py", "notes.txt"]
    )


def test_a_link_loop_and_a_tree_past_the_scan_limit_end_the_scan_and_say_so(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "loop").symlink_to(package)  # followed by nothing: recreated as the same link
    (tmp_path / "also").symlink_to("pkg")
    wide = package / "wide"
    wide.mkdir()
    for i in range(300):
        (wide / f"f{i}.txt").write_text("")
    (wide / ".env").write_text(SECRET)
    narrowed = _scanner(limit=100).narrow(str(tmp_path))
    assert str(package / "loop") in narrowed.binds or str(package) in narrowed.binds
    assert narrowed.unscanned, narrowed  # past the limit: bound whole, and the note says which
    full = _scanner().narrow(str(tmp_path))
    assert "pkg/wide/.env" in full.left_out and not full.unscanned
    assert str(tmp_path / "also") in full.binds  # a link to a package: shown, as the link it is
