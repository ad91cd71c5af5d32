"""The seccomp filter, the in-sandbox half: load precompiled BPF programs.

    template mode: receive_child_filter(CHILD_FILTER_FD) in the template, before env.py;
                   apply_child_filter() in each forked env, after its namespace set-up
                   and before any env code

The programs are compiled on the host (boltzlabs/host/seccomp.py). This
half is standard library only (prctl(2) through boltzlabs.runtime.confine):
nothing in the sandbox needs libseccomp. Fails closed: no program, no env.
"""

from __future__ import annotations

from boltzlabs.runtime import confine

__all__ = ["receive_child_filter", "apply_child_filter", "apply"]

_child_program = None  # a confine.FilterLoader, once received


def receive_child_filter(fd: int) -> None:
    """The template, before env.py runs: read the program every forked env
    will load, and close the fd (no env code ever holds it)."""
    global _child_program
    # Every ctypes object the load needs is made here, once, before the
    # forks: made in each child, they dirtied ~250 KiB of copy-on-write
    # pages per env (ctypes' and libffi's first use), for a one-off call.
    _child_program = confine.read_filter(fd)


def apply_child_filter() -> None:
    """A forked env, its namespaces made: load the full filter. Fails closed:
    no program received means no env."""
    if _child_program is None:
        raise RuntimeError("no seccomp program was handed to the template; refusing to run an unfiltered env")
    _child_program.load()


def apply(program: bytes) -> None:
    """Load a BPF program (struct sock_filter[]) into this thread's filters."""
    confine.FilterLoader(program).load()
