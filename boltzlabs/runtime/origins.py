"""Whose code a module is: the env's own, or a library's. Inside the sandbox.

    template.warm() / LibrariesOnly (the template's import hook) --> EnvFiles.holds(module or spec)
    probe.ProbeRun.report (the warm-up probe's module list)      --> EnvFiles.holds(module)

The zygote's rule (runtime/template.py) is that the template never runs
code of the env's author. That code is every file below the env's
directory and the workspace, however it is reached: the env's directory is
bound at /env, but a root of the trainer's $PYTHONPATH (or an editable
install) that holds it, `PYTHONPATH=.` with envs under `envs/<name>/`, is
bound too, and the same files are then importable as `envs.<name>.x` from
/opt/import/<k>. A path's text cannot tell them apart; the directories can:
a bind mount shows the same files, so each directory above a module's file
is compared by device and inode with the env's directory and the workspace.

Standard library only: every env pays for what the template imports.
"""

from __future__ import annotations

import os

_ModuleSpec = type(os.__spec__)  # importlib's ModuleSpec, without importing importlib.machinery
TYPE_CHECKING = False  # typing is not imported at run time: every env would pay for it
if TYPE_CHECKING:
    from typing import Any


class EnvFiles:
    """The env's directory and the workspace, as paths and as (device, inode)."""

    def __init__(self, *directories: str) -> None:
        self.prefixes = tuple(d.rstrip("/") + "/" for d in directories if d)
        self.keys = set()
        for directory in directories:
            try:
                info = os.stat(directory)
            except (OSError, ValueError):
                continue
            self.keys.add((info.st_dev, info.st_ino))

    def holds_path(self, path: Any) -> bool:
        """Whether the file or directory at `path` lies in one of the directories,
        by whatever name it was reached (symbolic links resolved, then every
        directory above it compared by device and inode)."""
        if type(path) is not str or not path.startswith("/"):
            return False  # "built-in", "frozen", None: no file
        if (path + "/").startswith(self.prefixes):
            return True
        try:
            place = os.path.realpath(path)
        except (OSError, ValueError):
            return False
        while True:
            try:
                info = os.stat(place)
            except (OSError, ValueError):
                pass
            else:
                if (info.st_dev, info.st_ino) in self.keys:
                    return True
            parent = os.path.dirname(place)
            if parent == place:
                return False
            place = parent

    def holds(self, module: Any) -> bool:
        """Whether a module (or a module spec) comes from one of the directories:
        its file, its spec's origin or any of a package's search locations."""
        spec = module if isinstance(module, _ModuleSpec) else getattr(module, "__spec__", None)
        places = [
            None if spec is module else getattr(module, "__file__", None),
            getattr(spec, "origin", None),
            *list(getattr(spec, "submodule_search_locations", None) or ()),
        ]
        return any(self.holds_path(place) for place in places)

    def where(self, spec: Any) -> str:
        """The file or directory a spec names, for a message."""
        origin = getattr(spec, "origin", None)
        if type(origin) is str:
            return origin
        locations = list(getattr(spec, "submodule_search_locations", None) or ())
        return str(locations[0]) if locations else "?"
