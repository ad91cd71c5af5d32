"""What the trainer imports that a sandbox would not see by itself, and what it sees.

    trainer's sys.path and editable finders --roots()--> [[host path, kind, name], ...]
        --OPEN import_roots--> worker: boltzlabs/host/plan.py binds each read-only at a
        neutral path (mounts/interpreter.toml import_dir/<k>) and puts it on the sandbox's
        PYTHONPATH in the trainer's order
    visible(path)  whether code at `path` is importable inside (env_fns pickle by value what is not)

Runs in the trainer. A sandbox binds the interpreter, its site-packages and
the boltzlabs runtime, and runs `python -S`, so no .pth file is read inside:
what a .pth adds (`pip install -e .` of your own env package: the legacy
and the static kinds add a directory; setuptools' editable finders map a
package name to its directory) and what $PYTHONPATH adds would be invisible
there. roots() names them: kind "path" for an entry of $PYTHONPATH (before
site-packages, as in the trainer), "pth" for one a .pth file added (after),
"package" for a finder's package (`name` is its import name). The script's
own directory (sys.path[0], the current one for `python -c` or a REPL) is not
bound: it is often a home directory; code of env_fns defined there travels
with the thunks instead (boltzlabs/pool/sources.py).
"""

from __future__ import annotations

import os
import site
import sys

__all__ = ["roots", "visible", "exposed"]

_RUNTIME = "boltzlabs"  # bound by mounts/runtime.toml, whatever the finders say


def _is_dir_or_file(path: str) -> bool:
    return os.path.isdir(path) or os.path.isfile(path)


def _site_dirs() -> list[str]:
    dirs = list(site.getsitepackages())
    user = site.getusersitepackages() if site.ENABLE_USER_SITE else None
    if user:
        dirs.append(user)
    return [os.path.realpath(d) for d in dirs if os.path.isdir(d)]


def _below(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _finder_mappings() -> list[tuple[str, str]]:
    """(import name, path) of every package setuptools' editable finders map
    (`__editable___<project>_finder` modules, loaded by their .pth files)."""
    mapped = []
    for name, module in list(sys.modules.items()):
        if name.startswith("__editable___") and name.endswith("_finder"):
            mapping = getattr(module, "MAPPING", None)
            if isinstance(mapping, dict):
                mapped += [(str(k), str(v)) for k, v in mapping.items()]
    return mapped


def _pth_paths() -> list[str]:
    """The directories the site-packages' .pth files add, as site.addpackage
    reads them (a line that is not a comment or an import is a path, relative
    to the site directory), in the order site processes them."""
    paths = []
    for directory in _site_dirs():
        try:
            names = sorted(n for n in os.listdir(directory) if n.endswith(".pth") and not n.startswith("."))
        except OSError:
            continue
        for name in names:
            try:
                with open(os.path.join(directory, name), encoding="utf-8", errors="replace") as f:
                    lines = f.read(1 << 20).splitlines()
            except OSError:
                continue
            for line in lines:
                line = line.strip()
                if line and not line.startswith(("#", "import ", "import\t")):
                    paths.append(os.path.join(directory, line))
    return paths


def roots() -> list[list[str]]:
    """[path, kind, name] for each import root of this interpreter that its
    sandboxes would not see: see the module docstring."""
    out, seen = [], set()

    def add(path: str, kind: str, name: str = "") -> None:
        path = os.path.normpath(os.path.realpath(os.path.abspath(path)))
        if path in seen or path == "/" or not _is_dir_or_file(path) or any(c in path for c in ",:\n\0"):
            return
        seen.add(path)
        out.append([path, kind, name])

    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if entry:
            add(entry, "path")
    if not sys.flags.no_site:  # the trainer's own .pth files ran: so must theirs
        checkout = os.path.dirname(_package_dir())
        for path in _pth_paths():
            if os.path.realpath(path) != checkout:  # boltzlabs' own checkout: the runtime is bound by itself
                add(path, "pth")
        for name, path in _finder_mappings():
            # A dotted name is a subpackage mapped on its own: found through its top-level package's
            # directory when that is mapped (setuptools maps both), not importable by itself.
            if name.split(".")[0] != _RUNTIME and "." not in name:
                add(path, "package", name)
    return out


def _package_dir() -> str:
    return os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # the boltzlabs package


def visible(path: str, extra: list | None = None) -> bool:
    """Whether a module file at `path` is importable in a sandbox of this
    interpreter: below its prefix (the standard library), a site-packages
    directory, the boltzlabs package or one of `extra` (roots())."""
    path = os.path.realpath(path)
    dirs = [os.path.realpath(sys.base_prefix), *_site_dirs(), _package_dir(), *(r[0] for r in (extra or ()))]
    return any(_below(path, d) for d in dirs)


def exposed(expose, roots_: list[list[str]], remote: bool = False) -> list[str]:
    """RLPool(expose=[...]) checked: absolute paths below one of `roots_`
    (roots()), as the worker binds them (host/roots.py narrows each root to
    its packages and modules; these are bound besides, whole)."""
    if expose is None:
        return []
    if isinstance(expose, (str, bytes)) or not isinstance(expose, (list, tuple)):
        raise TypeError(f"expose must be a list of paths below an import root, not {expose!r:.200}")
    if remote and expose:
        raise ValueError("expose names paths of this machine: a remote worker binds none of them")
    out = []
    for path in expose:
        path = os.fspath(path)
        if not isinstance(path, str) or not os.path.isabs(path):
            raise ValueError(f"expose: {path!r:.200} is not an absolute path")
        path = os.path.normpath(os.path.realpath(path))
        if not any(_below(path, root[0]) and path != root[0] for root in roots_):
            places = ", ".join(root[0] for root in roots_) or "none: $PYTHONPATH is empty and no editable install"
            raise ValueError(
                f"expose: {path} is not below an import root of this trainer (its roots: {places}); expose "
                "binds more of what $PYTHONPATH or an editable install names: put other files in the env's directory"
            )
        out.append(path)
    return out
