"""The remote worker's cache of shipped env directories (host side, root).

    BLOB (tar bytes, SHA-256 checked) --plan()--> [Entry]       tarfile as a parser only
        --_write() in a forked child, as the policy's unprivileged account-->
            <cache>/.staging/<tmp>/...                           O_NOFOLLOW|O_EXCL below a dir fd
        --_adopt() in the listener: walked by fd, compared with the plan byte
            for byte, made root-owned 0644/0755--> rename to <cache>/<sha256>
    EnvCache.evict(): least recently used first, past --cache-size bytes or
        --cache-files inodes; entries walked by fd, links never followed.

Why not tarfile's extraction with its "data" filter: the filter decides
"inside the destination" with os.path.realpath, which (Python 3.11.7, before
the 2025 fixes) stops resolving once a path passes PATH_MAX and reads the
rest lexically, while the kernel keeps following the links: a symlink chain
then leads a hard link, and a write through it, out of the cache
(tests/test_remote.py). Here the archive may hold regular files and
directories only, so there is no link to follow, and every name is created
relative to a directory fd with O_NOFOLLOW, so no path is ever resolved
through something the archive made.

Kernel facts this depends on:
- openat(dirfd, name) checks search permission only below dirfd, so the
  child can write into a directory it owns below the root-only (0700)
  .staging while no other process of its account can reach it by path.
- Changing the effective uid resets the process's dumpable flag to
  fs.suid_dumpable (0 by default; we clear it again): other processes of
  the account (every sandbox runs as it) can neither ptrace the child nor
  open its /proc/<pid>/fd. Sandboxes cannot see host pids or paths anyway.
- Without CAP_MKNOD the child cannot make device nodes; the listener still
  walks the result with lstat first and opens regular files only.
"""

from __future__ import annotations

import errno
import io
import os
import resource
import secrets
import signal
import stat
import tarfile
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from boltzlabs import abi
from boltzlabs.errors import UnpackRefused

if TYPE_CHECKING:
    from os import _ScandirIterator  # typeshed's name for what os.scandir returns: an iterator with close()

__all__ = ["Entry", "plan", "EnvCache"]

MAX_DEPTH = 32  # directories below the env dir
MAX_NAME = 255  # bytes in one component (NAME_MAX)
MAX_PATH = 1024  # bytes in a member's whole name: far below PATH_MAX, whatever the cache's own path
_PAX_KEYS = {"path", "size", "mtime", "atime", "ctime", "uid", "gid", "uname", "gname"}
_UNPACK_SECONDS = 60.0
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class Entry:
    """One member to create: its path components, kind, mode and data (offset, size) in the blob."""

    parts: tuple
    is_dir: bool
    mode: int
    offset: int = 0
    size: int = 0


def plan(blob: bytes, max_files: int) -> list[Entry]:
    """The entries of an uncompressed tar, validated; raises UnpackRefused naming the member.

    Regular files and directories only; names relative, normalised (no "",
    ".", ".." component, no duplicate), each directory declared before what
    it holds; at most `max_files` members, MAX_DEPTH deep, MAX_NAME/MAX_PATH
    long; no PAX keys that rename or reshape a member (sparse files, charset);
    no global PAX header. Modes become 0644, or 0755 when any x bit is set.
    """
    entries: list[Entry] = []
    seen: dict[tuple, bool] = {(): True}  # parts -> is_dir; () is the env dir itself
    try:
        with tarfile.open(fileobj=io.BytesIO(blob), mode="r:") as tar:
            for info in tar:
                name = info.name
                if len(entries) >= max_files:
                    raise UnpackRefused(
                        f"the archive has more than {max_files} members (this worker's "
                        "--max-code-files); ship fewer files, or raise the cap on the worker"
                    )
                if tar.pax_headers:
                    raise UnpackRefused("the archive has a global PAX header (it renames or rewrites members)")
                if info.type not in (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.DIRTYPE) or info.sparse:
                    raise UnpackRefused(
                        f"member {name!r} is a {_KINDS.get(info.type, repr(info.type))}; only "
                        "regular files and directories are accepted"
                    )
                odd = sorted(set(info.pax_headers) - _PAX_KEYS)
                if odd:
                    raise UnpackRefused(f"member {name!r} carries PAX keys {odd}, which rename or reshape it")
                parts = _parts(name, info.isdir())
                if parts in seen:
                    raise UnpackRefused(f"member {name!r} appears twice")
                if not seen.get(parts[:-1]):
                    raise UnpackRefused(
                        f"member {name!r} comes before its directory "
                        f"{'/'.join(parts[:-1])!r} (or that is not a directory)"
                    )
                seen[parts] = info.isdir()
                if info.isdir():
                    entries.append(Entry(parts, True, 0o755))
                else:
                    if info.offset_data + info.size > len(blob):
                        raise UnpackRefused(f"member {name!r} is cut short")
                    mode = 0o755 if info.mode & 0o111 else 0o644
                    entries.append(Entry(parts, False, mode, info.offset_data, info.size))
    except UnpackRefused:
        raise
    except Exception as exc:  # whatever tarfile makes of hostile bytes
        raise UnpackRefused(f"the archive cannot be read as a tar: {type(exc).__name__}: {exc}") from exc
    if seen.get(("env.py",)) is not False:
        raise UnpackRefused("the env directory has no env.py file")
    return entries


_KINDS = {
    tarfile.SYMTYPE: "symbolic link",
    tarfile.LNKTYPE: "hard link",
    tarfile.CHRTYPE: "character device",
    tarfile.BLKTYPE: "block device",
    tarfile.FIFOTYPE: "fifo",
    tarfile.CONTTYPE: "contiguous file",
    tarfile.GNUTYPE_SPARSE: "sparse file",
}


def _parts(name: str, is_dir: bool) -> tuple:
    parts = name.split("/")
    if is_dir and len(parts) > 1 and parts[-1] == "":
        parts.pop()  # "dir/" as some tars write directories
    if name.startswith("/"):
        raise UnpackRefused(f"member {name!r} is an absolute path")
    for part in parts:
        if part in ("", ".", ".."):
            what = f"a {part!r}" if part else "an empty"
            raise UnpackRefused(f"member {name!r} has {what} component; names must be plainly relative")
        if "\0" in part or len(os.fsencode(part)) > MAX_NAME:
            raise UnpackRefused(f"member {name[:80]!r}... has a component over {MAX_NAME} bytes")
    if len(parts) > MAX_DEPTH + 1 or len(os.fsencode(name)) > MAX_PATH:
        raise UnpackRefused(
            f"member {name[:80]!r}... is deeper than {MAX_DEPTH} directories or longer than {MAX_PATH} bytes"
        )
    return tuple(parts)


# -- writing, in the unprivileged child ------------------------------------------------


def _write(root_fd: int, entries: list[Entry], blob: bytes) -> None:
    """Create `entries` below root_fd. Only the open directories of the current
    path are held (at most MAX_DEPTH fds); nothing is resolved through a link."""
    view = memoryview(blob)
    stack: list[tuple[str, int]] = []  # the open directories of the current path below root_fd
    for entry in entries:
        parent = entry.parts[:-1]
        common = 0
        while common < len(stack) and common < len(parent) and stack[common][0] == parent[common]:
            common += 1
        while len(stack) > common:
            os.close(stack.pop()[1])
        for part in parent[common:]:
            at = stack[-1][1] if stack else root_fd
            stack.append((part, os.open(part, _O_DIR, dir_fd=at)))
        at = stack[-1][1] if stack else root_fd
        name = entry.parts[-1]
        if entry.is_dir:
            os.mkdir(name, 0o700, dir_fd=at)
            continue
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=at)
        try:
            data = view[entry.offset : entry.offset + entry.size]
            while data:
                data = data[os.write(fd, data) :]
        finally:
            os.close(fd)
    for _, fd in stack:
        os.close(fd)


def _child(
    parent: int,
    root_fd: int,
    report_fd: int,
    entries: list[Entry],
    blob: bytes,
    uid: int | None,
    gid: int | None,
    max_file: int,
) -> None:
    """The forked child: become the account, write, exit. Never returns.

    Only os calls on data already in memory: the listener has other threads,
    and a lock one of them held at fork time would never be released here."""
    code = 1
    try:
        keep = sorted((root_fd, report_fd))
        os.closerange(3, keep[0])
        os.closerange(keep[0] + 1, keep[1])
        os.closerange(keep[1] + 1, 1 << 20)
        if uid is not None and gid is not None:  # both or neither (_unpack)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
        # After the switch: changing credentials clears both of these.
        abi.libc.prctl(abi.PR_SET_DUMPABLE, 0)
        abi.libc.prctl(abi.PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the listener died before the prctl
            return
        os.umask(0o077)
        limit = max(max_file, 1)  # no file past the largest member, whatever happens
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        _write(root_fd, entries, blob)
        code = 0
    except BaseException as exc:  # reported to the parent, then exit
        try:
            os.write(report_fd, f"{type(exc).__name__}: {exc}".encode(errors="replace")[:1000])
        except BaseException:
            pass
    finally:
        os._exit(code)


# -- the cache ---------------------------------------------------------------------------


def _is_key(name: str) -> bool:
    """Whether `name` is a cache entry's (a SHA-256 in hex)."""
    return len(name) == 64 and all(c in "0123456789abcdef" for c in name)


class EnvCache:
    """Shipped env directories by SHA-256 under `path`; see the module docstring.

    `account`: (name, uid, gid) the unpack runs as when the listener is root;
    None: the listener's own account (it is not root, so nothing to drop).
    """

    def __init__(
        self,
        path,
        *,
        max_bytes: int,
        max_files: int,
        max_code_files: int,
        account: tuple[str, int, int] | None,
        log=None,
    ):
        self.path = os.fspath(path)
        os.makedirs(self.path, mode=0o755, exist_ok=True)
        self.max_bytes, self.max_files, self.max_code_files = max_bytes, max_files, max_code_files
        self.account = account
        self.log = log or (lambda text: None)
        self.fd = os.open(self.path, _O_DIR)
        try:
            os.mkdir(".staging", 0o700, dir_fd=self.fd)
        except FileExistsError:
            pass
        self.staging = os.open(".staging", _O_DIR, dir_fd=self.fd)
        st = os.fstat(self.staging)
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            os.fchown(self.staging, os.geteuid(), os.getegid())
            os.fchmod(self.staging, 0o700)
        for name in os.listdir(self.staging):  # left by a listener that was killed mid-unpack
            _remove(self.staging, name, self.log)
        self._usage: dict[str, tuple[int, int]] = {}  # key -> (bytes, inodes)
        self._evicting = threading.Lock()
        self._sweep()

    def _sweep(self) -> None:
        """Remove entries this unpacking could not have made (left by an older
        version that trusted tarfile: links, devices, fifos, hard links,
        files others may write): they would be served as cached code."""
        for name in os.listdir(self.fd):
            if not _is_key(name):
                continue
            try:
                st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
                plain = stat.S_ISDIR(st.st_mode) and all(
                    event == "leave"
                    or (stat.S_ISDIR(item.st_mode) or (stat.S_ISREG(item.st_mode) and item.st_nlink == 1))
                    and not item.st_mode & 0o7022
                    and len(parts) <= MAX_DEPTH + 1
                    for event, parts, _, _, item in _walk(self.fd, name)
                )
            except OSError:
                plain = False
            if not plain:
                self.log(f"cache: removing {name[:12]}, which holds more than plain files and directories")
                _remove(self.fd, name, self.log)

    def close(self) -> None:
        """Close the cache's directory fds (when no thread uses it any more)."""
        for fd in (self.staging, self.fd):
            os.close(fd)
        self.staging = self.fd = -1

    def has(self, key: str) -> bool:
        """Whether `key` is cached (and mark it most recently used)."""
        try:
            st = os.stat(key, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if not stat.S_ISDIR(st.st_mode):
            return False
        os.utime(key, dir_fd=self.fd, follow_symlinks=False)
        return True

    def add(self, key: str, blob: bytes) -> str:
        """Unpack `blob` (already checked against `key`) into the cache; a
        line for the log. Raises UnpackRefused; on any failure the cache is
        as it was."""
        entries = plan(blob, self.max_code_files)
        if len(entries) + 1 > self.max_files:
            raise UnpackRefused(
                f"the archive has {len(entries)} members, more than the whole cache may hold "
                f"({self.max_files}, --cache-files)"
            )
        name = f"unpack-{secrets.token_hex(8)}"
        os.mkdir(name, 0o700, dir_fd=self.staging)
        try:
            root = os.open(name, _O_DIR, dir_fd=self.staging)
            try:
                uid = self._unpack(root, entries, blob)
                size = self._adopt(root, entries, blob, uid)
            finally:
                os.close(root)
            try:
                os.rename(name, key, src_dir_fd=self.staging, dst_dir_fd=self.fd)
            except OSError as exc:  # another client shipped the same code meanwhile: keep theirs
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not self.has(key):
                    raise
        finally:
            _remove(self.staging, name, self.log)
        with self._evicting:
            self._usage[key] = (size, len(entries) + 1)
        who = self.account[0] if self.account else "the listener's own account"
        return f"{len(entries)} entries, unpacked as uid {uid} ({who})"

    def _unpack(self, root: int, entries: list[Entry], blob: bytes) -> int:
        """Run _write in a child as the account; the uid it ran as."""
        if self.account is not None:
            _, uid, gid = self.account
            os.fchown(root, uid, gid)
            switch: tuple[int | None, int | None] = (uid, gid)
        else:
            uid, switch = os.geteuid(), (None, None)
        largest = max((e.size for e in entries), default=0)
        read_end, write_end = os.pipe2(os.O_CLOEXEC)
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            _child(parent, root, write_end, entries, blob, *switch, largest)
        os.close(write_end)
        try:
            deadline = time.monotonic() + _UNPACK_SECONDS
            ready = False
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    ready = True
                    break
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)  # our unreaped child: its pid cannot have been reused
                    _, status = os.waitpid(pid, 0)
                    break
                time.sleep(0.005)
            why = os.read(read_end, 1000).decode(errors="replace")
        finally:
            os.close(read_end)
        if not ready:
            raise UnpackRefused(f"unpacking took longer than {_UNPACK_SECONDS:g} s")
        if status != 0:
            raise UnpackRefused(f"unpacking failed: {why or os.waitstatus_to_exitcode(status)}")
        return uid

    def _adopt(self, root: int, entries: list[Entry], blob: bytes, uid: int) -> int:
        """Check what the child made against the plan, by fd and byte for
        byte, and make it the listener's, read-only to everyone else. Bytes."""
        want = {e.parts: e for e in entries}
        view = memoryview(blob)
        found = total = 0
        for event, parts, fd, name, st in _walk(root, "."):
            if event == "leave":
                _own(fd, 0o755)
                continue
            entry = want.get(parts)
            if (
                entry is None
                or st.st_uid != uid
                or entry.is_dir != stat.S_ISDIR(st.st_mode)
                or (
                    not entry.is_dir
                    and not (stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_size == entry.size)
                )
            ):
                raise UnpackRefused(f"the unpacked tree does not match the archive at {'/'.join(parts)!r}")
            found += 1
            if entry.is_dir:
                continue
            child = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=fd)
            try:
                if not os.path.samestat(os.fstat(child), st):
                    raise UnpackRefused(f"{'/'.join(parts)!r} changed while it was checked")
                if _read_all(child, entry.size + 1) != view[entry.offset : entry.offset + entry.size]:
                    raise UnpackRefused(f"{'/'.join(parts)!r} does not hold the archive's bytes")
                _own(child, entry.mode)
            finally:
                os.close(child)
            total += entry.size
        if found != len(entries):
            raise UnpackRefused(f"the unpacked tree has {found} of the archive's {len(entries)} entries")
        return total

    # -- eviction ---------------------------------------------------------------------

    def evict(self, lock: threading.Lock, in_use: dict) -> None:
        """Remove least recently used env dirs that no pool uses (`in_use`,
        read under `lock`), until the cache is within --cache-size and --cache-files. Never
        follows a link; an entry that cannot be measured or removed is logged
        and skipped."""
        with self._evicting:
            entries = []
            for name in os.listdir(self.fd):
                if not _is_key(name):
                    continue  # .staging, or not ours: neither counted nor removed
                try:
                    st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
                    if name not in self._usage:
                        self._usage[name] = _usage(self.fd, name, st)
                    entries.append((st.st_mtime, name))
                except OSError as exc:
                    self.log(f"cache: cannot measure {name[:80]}: {exc}")
                    entries.append((0.0, name))  # unmeasurable: the first to go
                    self._usage.setdefault(name, (0, 1))
            names = {name for _, name in entries}
            for gone in set(self._usage) - names:
                del self._usage[gone]
            total = sum(self._usage[n][0] for n in names)
            files = sum(self._usage[n][1] for n in names)
            for _, name in sorted(entries):
                if total <= self.max_bytes and files <= self.max_files:
                    break
                # Renamed away under the lock (atomic): a client that asks for it
                # from now on ships it again; one that counted itself in keeps it.
                moved = f"evicted-{secrets.token_hex(8)}"
                with lock:
                    if in_use.get(name):
                        continue
                    try:
                        os.rename(name, moved, src_dir_fd=self.fd, dst_dir_fd=self.staging)
                    except OSError as exc:
                        self.log(f"cache: cannot evict {name[:80]}: {exc}")
                        continue
                _remove(self.staging, moved, self.log)
                size, count = self._usage.pop(name)
                total -= size
                files -= count
                self.log(f"cache: evicted {name[:12]} ({size} bytes, {count} files)")


def _read_all(fd: int, limit: int) -> bytes:
    chunks, left = [], limit
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _own(fd: int, mode: int) -> None:
    """The listener's, `mode` (no set-id bits, nothing writable by others)."""
    if os.geteuid() == 0:
        os.fchown(fd, 0, 0)
    os.fchmod(fd, mode)


def _usage(parent: int, name: str, st: os.stat_result) -> tuple[int, int]:
    """(bytes, inodes) of `name` below `parent`, links not followed."""
    if not stat.S_ISDIR(st.st_mode):
        return st.st_size, 1
    size, count = 0, 1
    for event, _, _, _, item in _walk(parent, name):
        if event == "entry":
            count += 1
            if stat.S_ISREG(item.st_mode):
                size += item.st_size
    return size, count


def _walk(parent: int, name: str, remove: bool = False):
    """Everything below directory `name`, by fd, never through a link, at any
    depth (only the fds of the current path are open). Yields
    ("entry", parts, dir_fd, item_name, lstat) for each entry, and
    ("leave", parts, fd_of_that_dir, name_in_parent, None) after a directory's
    contents (the top's included). remove=True removes each entry after it
    is yielded, children first."""
    top = os.open(name, _O_DIR, dir_fd=parent)
    stack: list[tuple[tuple[str, ...], int, _ScandirIterator[str], str]] = [((), top, os.scandir(top), name)]
    try:
        while stack:
            parts, fd, items, own_name = stack[-1]
            item = next(items, None)
            if item is None:
                yield "leave", parts, fd, own_name, None
                items.close()
                os.close(fd)
                stack.pop()
                if remove and stack:
                    os.rmdir(own_name, dir_fd=stack[-1][1])
                continue
            st = os.stat(item.name, dir_fd=fd, follow_symlinks=False)
            path = parts + (item.name,)
            yield "entry", path, fd, item.name, st
            if stat.S_ISDIR(st.st_mode):
                child = os.open(item.name, _O_DIR, dir_fd=fd)
                if not os.path.samestat(os.fstat(child), st):
                    os.close(child)
                    raise OSError(errno.ESTALE, f"{item.name!r} changed while it was walked")
                stack.append((path, child, os.scandir(child), item.name))
            elif remove:
                os.unlink(item.name, dir_fd=fd)
    finally:
        for _, fd, items, _ in stack:
            items.close()
            os.close(fd)


def _remove(parent: int, name: str, log) -> None:
    """Remove `name` below `parent` and all it holds, never through a link; log a failure."""
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            for _ in _walk(parent, name, remove=True):
                pass
            os.rmdir(name, dir_fd=parent)
        else:
            os.unlink(name, dir_fd=parent)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log(f"cache: cannot remove {name[:80]}: {exc}")
