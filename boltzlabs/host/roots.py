"""What of an import root an env sees: its packages and modules, never the project's secrets.

    plan._import_roots: a root of the trainer's (pool/imports.py: a $PYTHONPATH entry, a
        directory a .pth adds, an editable finder's package) --narrow()--> Narrowed:
        the host paths to bind read-only (each at its place below import_dir/<k>),
        what was left out, for the pool's note to the trainer

Runs on the host, in the worker. A research project runs its trainer with
`PYTHONPATH=.` or installs itself editable, so a root is often the project's
own directory, beside its `.env` (API keys), `.git` (a remote URL with a
token), data and notes. Bound whole, every env could read them. So a root
shows envs what the trainer imports from it and nothing else:

- at its top: its modules (files named like a module, with a module suffix)
  and its packages (directories named like a module that hold code), never a
  name of [import_roots] hide (sandbox/policy.toml: dotfiles, VCS
  directories, keys and credential files);
- inside those packages, everything (a package's own data comes with it)
  but the names of `hide`: a directory that holds one is bound entry by
  entry instead of whole, so a hidden name is absent, not an empty file.

A symbolic link is recreated as the same link (mounts/*.toml), never
followed to bind what it names. RLPool(expose=[...]) binds more of a root,
whole, by the trainer's own choice.
"""

from __future__ import annotations

import fnmatch
import importlib.machinery
import os
from dataclasses import dataclass, field

_SUFFIXES = tuple(importlib.machinery.all_suffixes())  # .py, .pyc, .cpython-311-x86_64-linux-gnu.so, .abi3.so, .so
_CODE_DEPTH, _CODE_ENTRIES = 4, 2000  # how far a directory is searched for code before it counts as data


def is_module_file(name: str) -> bool:
    """A file name Python imports: an identifier, then a module suffix."""
    return name.endswith(_SUFFIXES) and name.split(".", 1)[0].isidentifier()


@dataclass
class Narrowed:
    """What of one root the sandbox binds, and what it left out."""

    binds: list[str] = field(default_factory=list)  # host paths, each bound read-only at its place
    left_out: list[str] = field(default_factory=list)  # paths relative to the root, for the note
    shown: list[str] = field(default_factory=list)  # top-level names bound, for the note
    unscanned: list[str] = field(default_factory=list)  # bound whole: the scan's budget ran out first


class Scanner:
    """narrow() over one pool's roots, under one budget of directory entries read."""

    def __init__(self, hide: tuple[str, ...], budget: int) -> None:
        self.hide = hide
        self.budget = budget

    def hidden(self, name: str) -> bool:
        return not is_module_file(name) and any(fnmatch.fnmatchcase(name, pattern) for pattern in self.hide)

    def _entries(self, directory: str) -> list[os.DirEntry[str]]:
        try:
            with os.scandir(directory) as found:
                entries = sorted(found, key=lambda entry: entry.name)
        except OSError:
            return []
        self.budget -= len(entries)
        return entries

    def narrow(self, root: str, whole_package: bool = False) -> Narrowed:
        """The parts of `root` (a directory) to bind. `whole_package`: the root
        is a package (an editable finder's), shown whole but for hidden names;
        else only its modules and packages are shown."""
        out = Narrowed()
        if whole_package:
            self._visible(root, "", out)
            return out
        for entry in self._entries(root):
            name = entry.name
            if self.hidden(name):
                out.left_out.append(name)
            elif entry.is_symlink():
                # Shown as the trainer's import would find it; recreated, not followed.
                if is_module_file(name) or (name.isidentifier() and self._holds_code(entry.path)):
                    out.binds.append(entry.path)
                    out.shown.append(name)
                else:
                    out.left_out.append(name)
            elif _is_dir(entry):
                if name.isidentifier() and self._holds_code(entry.path):
                    out.shown.append(name)
                    self._visible(entry.path, name, out)
                else:
                    out.left_out.append(name)
            elif is_module_file(name):
                out.binds.append(entry.path)
                out.shown.append(name)
            else:
                out.left_out.append(name)
        return out

    def _visible(self, directory: str, relative: str, out: Narrowed) -> None:
        """Bind `directory` whole when nothing below it is hidden, else entry by entry."""
        if self.budget <= 0:
            out.binds.append(directory)
            out.unscanned.append(relative or ".")
            return
        if not self._hides_something(directory):
            out.binds.append(directory)
            return
        for entry in self._entries(directory):
            below = os.path.join(relative, entry.name) if relative else entry.name
            if self.hidden(entry.name):
                out.left_out.append(below)
            elif not entry.is_symlink() and _is_dir(entry):
                self._visible(entry.path, below, out)
            else:
                out.binds.append(entry.path)

    def _hides_something(self, directory: str) -> bool:
        """Whether any name below `directory` is hidden (symbolic links not followed)."""
        stack = [directory]
        while stack and self.budget > 0:
            for entry in self._entries(stack.pop()):
                if self.hidden(entry.name):
                    return True
                if not entry.is_symlink() and _is_dir(entry):
                    stack.append(entry.path)
        return self.budget <= 0  # not known: scanned entry by entry, which binds the rest whole

    def _holds_code(self, directory: str) -> bool:
        """Whether a directory is a package: it holds a module, at most a few levels down."""
        level, seen = [directory], 0
        for _ in range(_CODE_DEPTH):
            below = []
            for path in level:
                try:
                    with os.scandir(path) as found:
                        for entry in found:
                            seen += 1
                            if seen > _CODE_ENTRIES:
                                return False
                            if entry.is_file() and is_module_file(entry.name):
                                return True
                            if _is_dir(entry) and not self.hidden(entry.name) and entry.name.isidentifier():
                                below.append(entry.path)
                except OSError:
                    continue
            level = below
        return False


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False
