"""Observation slots: each env's obs in shared memory with the trainer (wire.py, docs/wire.md).

    open: Slots.wanted(request) -- a local pool that asked, room for one more fd per env
    spawn (spawn.slot_fd): fd_for(lane) -- a memfd per lane, made at its first spawn, passed on abi.SLOT_FD
    HELLO (lifecycle.Lifecycle._on_message): on_hello(...) -- lane 0's spec gives the layout; every lane's memfd is
        sized from it and sealed (no shrinking, no growing, no more seals) before its first request
    after READY: the client's "slots" calls -- the sealed memfds, to map read-only

A slot is written by untrusted code at any time, so the trainer maps it
read-only and copies a lane's slot out once, after that lane's reply came
(pool/client.py). The worker never reads it. One memfd per lane: mapped by
that lane's env (each of its spawns: a respawn gets the same one, cleared
first, `clear`) and by the trainer, nobody else; in template mode the template passes it on in the
FORK and closes its copy, as it does the channel's. An env that resizes or
seals its memfd before the worker sizes it is killed: an honest env does not
touch it before its first request.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
from collections.abc import Callable

from boltzlabs import abi, wire
from boltzlabs.worker.config import _fd_room, fds_needed
from boltzlabs.worker.lanes import STARTING, Lane

NO_SHM_ENV = "BOLTZLABS_NO_SHM"  # "1" in the trainer's environment: observations by the wire only
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
MAX_FDS_PER_MESSAGE = 250  # SCM_MAX_FD is 253


class Slots:
    """The observation slots of one local pool (the worker's `slots`, or None without them)."""

    def __init__(self, n: int, max_bytes: int):
        self.fds = [-1] * n
        self.sealed = [False] * n
        self.max_bytes = max_bytes
        self.layout: wire.SlotLayout | None = None
        self.decided = False  # lane 0's HELLO has said whether the space allows slots

    @classmethod
    def wanted(cls, request: dict, remote, n: int, channel: str, max_bytes: int) -> Slots | None:
        """Slots for this pool, if its client asked (a local client: it can map
        them), BOLTZLABS_NO_SHM is not set and the fd limit holds one more per env."""
        if remote or not isinstance(request, dict) or request.get("shared_memory") is not True:
            return None
        if os.environ.get(NO_SHM_ENV, "").strip() not in ("", "0"):
            return None
        if not _fd_room(fds_needed(n, channel) + n):
            return None
        return cls(n, max_bytes)

    @property
    def active(self) -> bool:
        return self.layout is not None

    def fd_for(self, index: int) -> int:
        """The lane's memfd (made at its first spawn), or -1 once the pool is known to have no slots."""
        fd = self.fds[index]
        if (self.decided and self.layout is None) or fd == -2:
            return -1
        if fd < 0:
            fd = self.fds[index] = os.memfd_create(f"boltzlabs-obs-{index}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        return fd

    def clear(self, index: int) -> None:
        """Empty lane `index`'s slot before a new sandbox of the lane gets it (lifecycle._spawn, once
        the last one's tasks are gone): its pages are punched out, so the respawned env, and the
        trainer, read zeros where its predecessor wrote. A memfd's size is sealed, its contents not."""
        fd = self.fds[index]
        if fd < 0:
            return
        try:
            size = os.fstat(fd).st_size
            if size:
                punch = abi.FALLOC_FL_PUNCH_HOLE | abi.FALLOC_FL_KEEP_SIZE
                if abi.libc.fallocate(fd, punch, ctypes.c_long(0), ctypes.c_long(size)) != 0:
                    os.pwrite(fd, bytes(size), 0)  # a kernel without hole punching on shmem
        except OSError:
            # Not to be cleared: the lane goes on without a slot (its obs by the wire).
            os.close(fd)
            self.fds[index] = -2
            self.sealed[index] = False

    def on_hello(
        self,
        hello: dict | None,
        env_limits: wire.Limits,
        lanes: list[Lane],
        kill: Callable[[Lane, str], None],
        lane: Lane,
    ) -> None:
        """Lane `env` said HELLO: decide the layout on lane 0's (`hello`, None until it came), then
        size and seal every lane of `lanes` that has said HELLO (this one included) and is not sealed;
        one that tampered with its memfd is killed (`kill`). A reply may carry a slot marker from then
        on (`env_limits`, how lanes' frames are decoded)."""
        if not self.decided and hello is not None:
            self.decided = True
            self.layout = wire.slot_layout(hello.get("observation_space"), self.max_bytes)
            if self.layout is None:
                # The space allows no slot: each env keeps an empty memfd, sealed at 0 bytes so that
                # it cannot become a file of its own past its workspace's cap.
                for fd in self.fds:
                    if fd >= 0:
                        try:
                            os.ftruncate(fd, 0)
                            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
                        except OSError:
                            pass  # an env that sealed it first has sealed itself out of it
                self.close()
                return
            env_limits.slot_marks[0] = 0  # a reply may now carry a marker
            for other in lanes:
                if other is not lane and other.state is not STARTING and not other.state.dead:
                    self._seal(kill, other)
        if self.layout is not None:
            self._seal(kill, lane)

    def _seal(self, kill: Callable[[Lane, str], None], lane: Lane) -> None:
        index = lane.index
        if self.sealed[index] or self.fds[index] < 0:
            return
        layout = self.layout
        assert layout is not None, "a lane's slot is sealed only once the layout is decided (on_hello)"
        fd, size = self.fds[index], layout.size
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            ok = os.fstat(fd).st_size == size and fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS
        except OSError:
            ok = False
        if not ok:
            # Only the env holds it besides us: it resized or sealed it first. The
            # memfd is spent: the lane goes on without a slot (its obs by the wire).
            os.close(fd)
            self.fds[index] = -2
            kill(
                lane,
                "tampered with its observation slot (resized or sealed the memfd on fd "
                f"{abi.SLOT_FD}) before the worker sized it, and was killed",
            )
            return
        self.sealed[index] = True

    def batch(self, start: int, count: int) -> list[int]:
        """The sealed memfds of lanes start..start+count, -1 for a lane whose slot is spent."""
        end = min(len(self.fds), start + max(0, min(count, MAX_FDS_PER_MESSAGE)))
        return [fd if self.sealed[i] and fd >= 0 else -1 for i, fd in enumerate(self.fds[start:end], start)]

    def close(self) -> None:
        for i, fd in enumerate(self.fds):
            if fd >= 0:
                os.close(fd)
            self.fds[i] = -1
