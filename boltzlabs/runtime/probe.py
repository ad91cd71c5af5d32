"""The warm-up probe's side: the env's real work once, in a throwaway sandbox, and its report.

    worker --[FORK, -1, g, True]--> template --clone--> probe child (a sandbox like any env's)
        untrusted template: env.py runs; its serve() finds $BOLTZLABS_PROBE and calls finish()
        trusted template:   finish() with the serve() callables env.py's import gave the template
    probe --[PROBED, module names, ...] on its channel--> worker (checks it, then WARM to the template)

The report names the modules env.py's import and the work brought in, from
outside the env's directory and the workspace, by whatever path they were
reached (runtime/origins.py): the template imports library modules only (boltzlabs/runtime/template.py). It also carries env.py's code,
compiled here and marshalled: the template keeps those bytes unread and each
env it forks unmarshals them instead of compiling env.py itself. Env code
ran here, so the worker trusts nothing of the frame
(boltzlabs/worker/spawn.py), and the bytes are read only by the envs, each a
sandbox of the env's own author.

Standard library only: every env pays for what the template imports.
"""

from __future__ import annotations

import os
import sys

from boltzlabs import wire
from boltzlabs.runtime import origins

TYPE_CHECKING = False  # typing is not imported at run time: every env would pay for it
if TYPE_CHECKING:
    from typing import Any

MAX_NAMES, MAX_NAME_LEN = 2048, 200  # what a report may name (the worker refuses the rest)
# env.py's code, compiled by the probe and marshalled, that the template hands
# its children (unread: only a child, a sandbox of the env's own, unmarshals
# it): compiling env.py in each env copied ~0.5 MiB of the template's pages
# into it, unmarshalling ~0.15 MiB (measured, counter env).
MAX_CODE = 4 << 20


def _private_dirty() -> int:
    """Private_Dirty of this process, in bytes (its own /proc)."""
    try:
        with open("/proc/self/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Private_Dirty:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


class ProbeRun:
    """What a probe child notes at its birth, before any env code: the modules
    it has (the template's), its private memory, and where it reports."""

    def __init__(self, channel: tuple[Any, ...], memory: int, env_dir: str, workspace: str) -> None:
        self.rfd, self.wfd = channel[0], channel[-1]
        self.env_dir, self.workspace = env_dir, workspace
        self.baseline = set(sys.modules)
        self.birth = _private_dirty()
        self.sampling: set[Any] = set()
        self.code = None  # env.py compiled and marshalled, for every env the template forks
        if memory > 0:
            # The probe's cgroup holds the env's memory limit (the worker makes
            # it); RLIMIT_DATA on top makes a big allocation a MemoryError the
            # report can name, where the cgroup's OOM killer leaves a SIGKILL.
            import resource

            with open("/proc/self/status") as status:
                held = next((int(line.split()[1]) * 1024 for line in status if line.startswith("VmData:")), 0)
            resource.setrlimit(resource.RLIMIT_DATA, (held + memory, held + memory))

    def report(self, steps: int, error: str | None, preload: Any) -> None:
        """Write [PROBED, new library module names, how many, Private_Dirty at
        birth, now, steps, error text or None, serve(preload=) names, env.py's
        marshalled code or None] and exit.
        Only modules an import made (with a spec; Cython puts a bookkeeping
        module of its own in sys.modules that nobody can import), from outside
        the env's directory and the workspace. Env code ran here: the worker
        trusts nothing of this frame, and the template imports library modules only."""
        env_files = origins.EnvFiles(self.env_dir, self.workspace)
        names = []
        for name, module in list(sys.modules.items()):
            if type(name) is not str or name in self.baseline or name in self.sampling:
                continue
            spec = getattr(module, "__spec__", None)
            if spec is None or env_files.holds(spec):  # the env's own, by any path (runtime/origins.py)
                continue
            names.append(name)
        wanted = [name[: MAX_NAME_LEN + 1] for name in (preload or ()) if type(name) is str][:MAX_NAMES]
        frame = wire.encode(
            [
                wire.PROBED,
                sorted(name[: MAX_NAME_LEN + 1] for name in names)[:MAX_NAMES],
                len(names),
                self.birth,
                _private_dirty(),
                steps,
                error and error[:2000],
                wanted,
                self.code if self.code is not None and len(self.code) <= MAX_CODE else None,
            ]
        )
        view = memoryview(frame)
        while view:
            view = view[os.write(self.wfd, view) :]
        # Alive until the worker has checked this process from outside and
        # closes the channel (or kills it).
        try:
            while os.read(self.rfd, 4096):
                pass
        except OSError:
            pass
        os._exit(0)


current: ProbeRun | None = None  # set in a probe child (runtime/template.py), read by finish


def finish(probe: Any) -> None:
    """In a probe child: run the env's work (boltzlabs.runtime.serve._Probe:
    `prepare()`, then `run(report)`), report, exit. serve() calls it when it
    finds $BOLTZLABS_PROBE; a trusted template's probe child calls it directly."""
    run = current
    if run is None:
        raise RuntimeError("$BOLTZLABS_PROBE is set, but this process is no probe of a template")
    error, steps = None, {"steps": 0}
    before = set(sys.modules)
    try:
        probe.prepare()  # actions sampled first: what sampling imports is not the env's work
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"
    run.sampling = set(sys.modules) - before
    if error is None:
        try:
            probe.run(steps)
        except BaseException as exc:
            error = f"{type(exc).__name__}: {exc}"
    run.report(int(steps["steps"]), error and f"the probe's reset/step raised {error}", probe.preload)
