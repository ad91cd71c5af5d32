"""The contract between the host and the sandbox: fd numbers, variable names, Linux constants, libc.

    host (host/builder.py, worker/spawn.py)          sandbox (runtime/confine, template, serve, env_fns)
      puts the channel on CHANNEL_FD, the filters  ==>    finds them there, reads the variables,
      on FILTER_FD / CHILD_FILTER_FD, the slot on         makes its mounts and namespaces with the
      SLOT_FD, bwrap's options on ARGS_FD; sets           constants below through `libc`, each call
      the *_VARIABLE names                                checked by `check`

Both sides import this one module, so a number or a name cannot drift
between them. It is imported inside every sandbox: standard library only, no
work at import beyond one `ctypes.CDLL(None)` (every sandboxed process loads
ctypes anyway: confine and the template make their system calls with it).
Where this sits in the layout: a leaf, like errors (tests/test_layout.py).
"""

from __future__ import annotations

import ctypes
import os

# --- fds a sandboxed process finds open --------------------------------------
CHANNEL_FD = 3  # the channel: a socket, or the pipe the env writes (then CHANNEL_FD + 1: the one it reads)
FILTER_FD = 5  # where bubblewrap reads the seccomp program it loads (--seccomp)
CHILD_FILTER_FD = 6  # where the template (or confine) reads the program each env loads
SLOT_FD = 7  # an env's shared-memory observation slot (a sealed memfd), when it has one
ARGS_FD = 9  # where bwrap reads its own options (--args), NUL-separated

# --- variables the host sets for the sandbox ---------------------------------
FD_VARIABLE = "BOLTZLABS_FD"  # the channel's fd numbers: "3", or "4,3" (read, write)
ENV_INDEX_VARIABLE = "BOLTZLABS_ENV_INDEX"  # the env's lane
PARAMS_VARIABLE = "BOLTZLABS_PARAMS"  # the env's params (RLPool(params=..., **params)), JSON
CHILD_FILTER_VARIABLE = "BOLTZLABS_CHILD_FILTER_FD"  # CHILD_FILTER_FD's number
CONFINE_VARIABLE = "BOLTZLABS_CONFINE"  # the set-up plan (runtime/confine.encode)
ENV_FNS_VARIABLE = "BOLTZLABS_ENV_FNS"  # the pool's env_fns file, inside the sandbox
PROBE_VARIABLE = "BOLTZLABS_PROBE"  # "1" in the warm-up probe: serve() reports instead of serving
GROUP_VARIABLE = "BOLTZLABS_GROUP"  # RLPool(envs_per_sandbox=k): "k,envs,max_frame" (runtime/group.py)
# The pool's max_str_len in bytes: the longest str an env's decoder takes in a request, and its
# serve() sends in a reply (runtime/serve.py); unset: only the frame caps apply.
MAX_STR_VARIABLE = "BOLTZLABS_MAX_STR_LEN"
# "1": RLPool(eager_reset=True), an env whose episode ended resets while the trainer works (runtime/serve.py)
EAGER_RESET_VARIABLE = "BOLTZLABS_EAGER_RESET"

# --- exit codes of a sandboxed process ---------------------------------------
# The worker's description of a lane's death names each (describe_exit). Not 0,
# which says nothing, nor 1 (an uncaught exception), nor above 128 (a signal, as
# bwrap reports one).
NO_SERVE_EXIT = 87  # env.py returned (or exited with 0) without calling serve()
SET_UP_EXIT = 88  # the sandbox's own set-up (confine, the template) failed before any env code ran
REFUSED_EXIT = 89  # serve() refused a request from the worker (a str over the pool's max_str_len): its log says why

# --- Linux constants (include/uapi/linux/sched.h, mount.h, prctl.h, seccomp.h, if.h, sockios.h, falloc.h)
CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS = 0x00020000, 0x02000000, 0x04000000
CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x08000000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
MS_REC, MS_SLAVE = 16384, 1 << 19
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NAME = 1, 4, 15
PR_SET_SECCOMP, PR_CAPBSET_DROP, PR_SET_CHILD_SUBREAPER = 22, 24, 36
PR_SET_NO_NEW_PRIVS, PR_GET_NO_NEW_PRIVS = 38, 39
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
SECCOMP_MODE_FILTER = 2
BPF_INSTRUCTION = 8  # bytes of one struct sock_filter
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP, IFF_RUNNING = 0x8913, 0x8914, 0x1, 0x40
SYS_CLONE = {"x86_64": 56, "aarch64": 220}.get(os.uname().machine)
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02  # include/uapi/linux/falloc.h
CLOCK_MONOTONIC, TFD_NONBLOCK, TFD_CLOEXEC = 1, os.O_NONBLOCK, os.O_CLOEXEC  # timerfd_create(2)

# The process's one handle on libc; errno is kept for `check`.
libc = ctypes.CDLL(None, use_errno=True)


def check(result: int, what: str) -> None:
    """Raise OSError(errno, "what: strerror") when a libc call returned nonzero."""
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
