"""The trainer's half of the observation slots (wire.py, docs/wire.md "Observations in shared memory").

    RLPool open: READY says the layout --"slots" calls--> each lane's sealed memfd (SCM_RIGHTS)
        --map()--> one read-only mapping per lane (the fd is closed: the mapping is all we keep)
    step / recv / reset: a lane whose obs is a wire.Slot marker --fill()--> its slot copied once,
        after its reply came, into this call's batch (one array per Box of the space)

An env may write its slot at any time, so nothing here reads it twice: the
header (magic, version, the seq of the reply it holds, the size) is copied
out in one slice and checked against the marker, then the data is copied
into the batch. A slot whose header does not say what the marker says fails
that lane only (done, reward 0, obs None, info["error"]), as every other
failure does. The mappings are read-only (PROT_READ) and sealed against
resizing by the worker before any env could use them (checked again here),
so nothing an env does to its memfd can fault the trainer.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import socket

import numpy as np

from boltzlabs import wire

NO_SHM_ENV = "BOLTZLABS_NO_SHM"  # "1": observations by the wire only (also read by the worker)
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
PER_CALL = 250  # memfds per "slots" call (SCM_MAX_FD is 253)


def wanted() -> bool:
    """Whether this trainer asks a local pool for slots (BOLTZLABS_NO_SHM unset)."""
    return os.environ.get(NO_SHM_ENV, "").strip() in ("", "0")


class Slots:
    """Each lane's mapped slot and the layout they share (RLPool._slots)."""

    def __init__(self, layout: dict, n: int):
        self.leaves = [
            (tuple(path), np.dtype(dtype), tuple(shape), offset) for path, dtype, shape, offset in layout["leaves"]
        ]
        self.size = int(layout["size"])
        self.data_size = self.size - wire.SLOT_HEADER_SIZE
        self.maps: list = [None] * n
        self.views: list = [None] * n  # per lane: one read-only array per leaf, over its mapping
        self.box = len(self.leaves) == 1 and self.leaves[0][0] == ()

    def map(self, lane: int, fd: int) -> None:
        """Map lane's memfd read-only, after checking its seals and size; the fd is closed either way."""
        try:
            if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & _SEALS != _SEALS or os.fstat(fd).st_size != self.size:
                raise OSError(f"lane {lane}'s observation slot is not sealed at {self.size} bytes")
            mapping = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        self.maps[lane] = mapping
        self.views[lane] = [
            np.frombuffer(mapping, dtype, _count(shape), offset).reshape(shape)
            for _, dtype, shape, offset in self.leaves
        ]

    def fill(self, lanes, obs: list, rewards, terminated, truncated, infos: list):
        """Replace each wire.Slot in obs (aligned with `lanes`) by its lane's slot, copied
        once into one batch per leaf; a slot inconsistent with its marker fails its lane.
        Returns that batch when the space is a Box and every obs is now its row, else None.
        Hot path: the batch is allocated once per call."""
        marked = [k for k, value in enumerate(obs) if type(value) is wire.Slot]
        if not marked:
            return None
        batches = [np.empty((len(obs), *shape), dtype) for _, dtype, shape, _ in self.leaves]
        header, unpack = wire.SLOT_HEADER.size, wire.SLOT_HEADER.unpack
        for k in marked:
            lane = lanes[k]
            mapping = self.maps[lane]
            if mapping is None:
                self._fail(
                    k,
                    lane,
                    "sent a slot marker, but the trainer has no slot of it",
                    obs,
                    rewards,
                    terminated,
                    truncated,
                    infos,
                )
                continue
            magic, version, seq, size = unpack(mapping[:header])  # one read of the header
            if not self._holds(magic, version, size) or seq != obs[k].seq:
                self._fail(
                    k,
                    lane,
                    f"its observation in shared memory does not match its reply (the slot's header "
                    f"says seq {seq}, {size} bytes, magic {magic:#x}; the reply, seq {obs[k].seq} and "
                    f"{self.data_size} bytes)",
                    obs,
                    rewards,
                    terminated,
                    truncated,
                    infos,
                )
                continue
            for batch, view in zip(batches, self.views[lane]):
                batch[k] = view  # the one copy, after the reply came
        for batch in batches:
            batch.flags.writeable = False  # as an obs from the wire: a read-only array
        whole = self.box and len(marked) == len(obs)
        for k in marked:
            if type(obs[k]) is wire.Slot:
                obs[k] = batches[0][k] if self.box else self._assemble([batch[k] for batch in batches])
            else:  # failed: None
                whole = False
        return batches[0] if whole else None

    def rows(self, lanes: int, seq: int):
        """The obs of lanes 0 to lanes - 1 of a Box space, copied once into one read-only (lanes,
        ...) batch, when each lane's slot holds the obs of reply `seq`; None otherwise (fill then
        fails each lane whose slot does not, saying why). The hot path of a grouped step whose
        every group answered whole (pool/groups.py)."""
        if not self.box or lanes > len(self.maps):
            return None
        _, dtype, shape, _ = self.leaves[0]
        batch = np.empty((lanes, *shape), dtype)
        unpack = wire.SLOT_HEADER.unpack_from
        for lane in range(lanes):
            mapping = self.maps[lane]
            if mapping is None:
                return None
            magic, version, got, size = unpack(mapping)
            if not self._holds(magic, version, size) or got != seq:
                return None
            batch[lane] = self.views[lane][0]
        batch.flags.writeable = False  # as an obs from the wire: a read-only array
        return batch

    def _holds(self, magic: int, version: int, size: int) -> bool:
        """Whether a slot's header is ours: its magic, version 1 and this layout's data size."""
        return magic == wire.SLOT_MAGIC and version == 1 and size == self.data_size

    def _assemble(self, rows: list):
        """A Dict or Tuple obs from its leaves' rows, in the space's order."""
        root: dict = {}
        for (path, _, _, _), row in zip(self.leaves, rows):
            node = root
            for step in path[:-1]:
                node = node.setdefault(step, {})
            node[path[-1]] = row
        return _containers(root)

    @staticmethod
    def _fail(k, lane, why, obs, rewards, terminated, truncated, infos) -> None:
        obs[k] = None
        rewards[k] = 0.0
        terminated[k] = False
        truncated[k] = True
        infos[k] = {"error": f"env {lane} {why}"}

    def close(self) -> None:
        self.views = [None] * len(self.views)
        for i, mapping in enumerate(self.maps):
            if mapping is not None:
                try:
                    mapping.close()
                except BufferError:  # an obs the caller still holds points into it: freed with it
                    pass
            self.maps[i] = None


def _containers(node):
    """{int: ...} levels become tuples, {str: ...} levels dicts (a Tuple's items are indexed by int)."""
    if type(node) is not dict:
        return node
    if node and all(type(key) is int for key in node):
        return tuple(_containers(node[i]) for i in range(len(node)))
    return {key: _containers(value) for key, value in node.items()}


def _count(shape) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def receive(conn: socket.socket, frame: bytes, reader: wire.FrameReader, alive) -> tuple:
    """Send a CALL whose REPLY brings fds ("slots": the memfds; "lend": the lanes' channels) and
    read that REPLY with them: (the REPLY message, the fds in order). `alive()` says whether the
    worker lives."""
    conn.sendall(frame)
    fds: list = []
    space = socket.CMSG_SPACE(4 * PER_CALL)
    while True:
        try:
            data, ancillary, _, _ = conn.recvmsg(1 << 16, space)
        except TimeoutError:
            if not alive():
                raise
            continue
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += np.frombuffer(payload[: len(payload) - len(payload) % 4], np.intc).tolist()
        if not data:
            for fd in fds:
                os.close(fd)
            raise EOFError
        messages = reader.feed(data)
        if messages:
            return messages[0], fds
