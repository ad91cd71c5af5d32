"""Per-env rlimits, the in-sandbox half: the plan's rlimits text in, setrlimit out.

    host (boltzlabs/host/limits.py): policy [env_limits] --resolve(), encode()--> rlimits= (and the
        template's template_rlimits=) in $BOLTZLABS_CONFINE (boltzlabs/runtime/confine.py)
    in the sandbox, before any env code runs:
        exec mode:     `python -c BOOTSTRAP /env/env.py` (boltzlabs.runtime.confine.main) --apply(), run()
        template mode: the template before it imports env.py, and each child
                       again right after its fork (boltzlabs.runtime.template)

rlimits are per process and inherited by every child; a process may lower
its own hard limit but never raise it without CAP_SYS_RESOURCE, which no env
holds. So setting soft = hard before env.py is imported makes them binding
on the env and everything it starts.

Standard library only: every env pays for what it imports.
"""

from __future__ import annotations

import os
import resource
import sys

from boltzlabs import abi
from boltzlabs.runtime import scrub  # tiny; the template imports it once for every child

TYPE_CHECKING = False  # typing is not imported at run time: every env would pay for it
if TYPE_CHECKING:
    from typing import Any

# Policy key -> resource. Values are bytes (sizes) or counts.
RLIMITS = {
    "open_files": ("NOFILE", resource.RLIMIT_NOFILE),
    "file_size": ("FSIZE", resource.RLIMIT_FSIZE),
    "core_size": ("CORE", resource.RLIMIT_CORE),
    "msgqueue": ("MSGQUEUE", resource.RLIMIT_MSGQUEUE),
}
_BY_NAME = {name: number for name, number in RLIMITS.values()}


def parse(text: str | None) -> list[tuple[int, int]]:
    """[(RLIMIT_* number, value)] from the "name=value,..." text (limits.encode on the host)."""
    parsed = []
    for item in (text or "").split(","):
        if item:
            name, _, value = item.partition("=")
            parsed.append((_BY_NAME[name], resource.RLIM_INFINITY if value == "unlimited" else int(value)))
    return parsed


def apply_parsed(parsed: list[tuple[int, int]]) -> None:
    """setrlimit(soft = hard = value) for each (number, value). Never raises a
    hard limit (the env may have lowered one already; that binds it)."""
    for number, want in parsed:
        _, hard = resource.getrlimit(number)
        if hard != resource.RLIM_INFINITY and (want == resource.RLIM_INFINITY or want > hard):
            want = hard
        resource.setrlimit(number, (want, want))


def apply(text: str | None) -> None:
    """apply_parsed(parse(text))."""
    apply_parsed(parse(text))


def run(path: str, code: Any = None) -> None:
    """Run the env file `path` as __main__ (as `python /env/env.py` would;
    runpy would cost every env ~5 ms of imports). Never returns normally: serve()
    does not return, and an env.py that returns, or exits with status 0, without
    calling it is told so on its stderr (its log) and exits abi.NO_SERVE_EXIT.
    boltzlabs.runtime.confine.main (exec mode) calls it, after the set-up, and
    so does a template's child once it is a sandbox. `code`: env.py already
    compiled (a template child's, from the warm-up probe), else it is compiled here."""
    scrub.workspace = os.getcwd()  # the set-up left us in it, before any env code could move
    if code is None:
        code = compile(read_file(path), path, "exec")
    sys.argv = [path]
    sys.path[0] = os.path.dirname(path)  # -c put the working directory there
    group = os.environ.get(abi.GROUP_VARIABLE)
    if group and not os.environ.get(abi.PROBE_VARIABLE):
        # RLPool(envs_per_sandbox=k): env.py runs once per member (the warm-up probe runs it once).
        from boltzlabs.runtime import group as _group

        _group.run(path, code, group, main_module)
    module = main_module(path)
    try:
        exec(code, module.__dict__)
    except SystemExit as exc:
        if exc.code not in (None, 0) or _served():
            raise
        how = "exited with status 0"
    else:
        how = "returned"
    if _served():
        raise RuntimeError(f"{path}: serve() returned")  # it never does
    sys.stderr.write(
        f"boltzlabs: {path} {how} without calling serve(): an env.py must end with "
        "boltzlabs.env.serve(reset=..., step=...) (or serve_env(env) for a Gymnasium env), which "
        "answers the pool's requests\n"
    )
    sys.stderr.flush()
    os._exit(abi.NO_SERVE_EXIT)


def main_module(path: str) -> Any:
    """A fresh module named __main__ for the env file `path`, made sys.modules["__main__"], as
    `python path` makes it: run() runs env.py in one, runtime/group.py in one per member."""
    module = type(sys)("__main__")
    module.__file__ = path
    module.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = module
    return module


def _served() -> bool:
    """Whether serve() has run in this process (it says so first thing)."""
    return getattr(sys.modules.get("boltzlabs.runtime.serve"), "started", False)


def read_file(path: str) -> bytes:
    """A file's bytes through os.read, not open(): the io stack's objects,
    made in a forked env's first moments, copied ~0.4 MiB of the template's
    pages into every env (measured, counter env); and in the worker, which
    reads several cgroup and proc files at each spawn, io's layers cost more
    than the kernel's side (an open 65 us against ~25, the worker's profile)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks: list[bytes] = []
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    finally:
        os.close(fd)


def stat_fields(pid: int | str) -> list[bytes] | None:
    """The fields of /proc/<pid>/stat after the name: [0] the state (field 3),
    [1] the parent (field 4), [19] the start in clock ticks since boot (field 22);
    None once the process is gone. The name is the process's own to choose and
    may hold spaces or ')', so the split is after the last ')'."""
    try:
        text = read_file(f"/proc/{pid}/stat")
    except OSError:
        return None
    return text[text.rindex(b")") + 2 :].split()
