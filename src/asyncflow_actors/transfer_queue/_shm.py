"""Shared-memory segments: tensor bodies between a client and a storage unit on one host.

A *segment* is a file in ``/dev/shm`` (POSIX shared memory on Linux) whose name starts with the
owning unit's prefix ``afa-<queue>-<unit>-<incarnation>-``. A writer on the unit's host copies a
batch into a segment once (:func:`write_segment`) and hands its name to the unit in the
``Store``; from then on the unit owns it: it maps it (read-only) and, when the last row in it is
freed, unlinks it or keeps it for reuse. Readers on the host map it copy-on-write
(:func:`map_for_reading`): their tensors are views of the unit's pages, and a write to them
stays private to the reader.

Reuse. Writing fresh ``/dev/shm`` pages costs the kernel a page allocation and zeroing per page
(and unlinking them, their release): a segment whose rows are all freed is worth filling again.
The unit renames it to a *free* name (:func:`recycle`) and tells writers; a writer takes it by
renaming it to a name of its own (:func:`claim`, atomic: one writer wins) and writes into the
pages that already exist.

Safety rules:

- a reader holds a shared ``flock`` on every segment it maps, for as long as the mapping lives
  (the lock goes with the mapping's file descriptor, closed when the last tensor on it is
  gone, or when the reader's process dies), and maps a segment only if its name still names
  the file it locked;
- the unit recycles a segment only when no live row is in it, no reader holds a lock on it
  (it takes the exclusive lock, then renames it: a reader that opened it just before finds
  the name gone and never maps it), and no socket reply was ever built from its pages; else
  it unlinks it (mappings stay valid after an unlink) or retries later. So a view never sees
  other data than what was put, for as long as it exists;
- names are never reused, and all are in the unit's namespace, so the unit can sweep what a
  writer that died (``kill -9``) created or claimed but never handed over, what a previous
  incarnation left, and everything at its stop;
- a writer holds a shared lock on its segment from creating (or claiming) it until the unit
  took it or its told store was committed (:func:`hold`, :func:`let_go`), and the sweep of
  orphans takes only segments nobody holds: one whose writer lives is never taken for a dead
  writer's, however long it stalled.

Availability is probed, not assumed: a unit publishes a probe segment holding a random nonce, and a
client uses shared memory with that unit only if it can read the nonce back (same host, same
``/dev/shm``: containers with private ``/dev/shm`` fall back to sockets).
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import time
import weakref
from collections.abc import Iterable, Sequence

import attrs

from ._checks import Checked

SHM_DIR = "/dev/shm"
ALIGN = 16  # byte alignment of every body in a segment (enough for every dtype)


@attrs.frozen
class ShmInfo(Checked):
    """How a unit's segments are named, and how to check that they are reachable from here."""

    prefix: str
    probe: str  # a segment holding ``nonce``
    nonce: bytes
    pid: int


def available() -> bool:
    """Whether this host has a writable ``/dev/shm`` (Linux)."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def path(name: str) -> str:
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"bad segment name {name!r}")
    return os.path.join(SHM_DIR, name)


def reachable(info: ShmInfo) -> bool:
    """Whether ``info``'s unit shares this process's ``/dev/shm`` (its probe reads back)."""
    if info.pid == os.getpid():
        return False  # the same process: tensors are handed over by reference anyway
    try:
        with open(path(info.probe), "rb") as f:
            return f.read(len(info.nonce)) == info.nonce
    except (OSError, ValueError):
        return False


def create_probe(prefix: str) -> ShmInfo:
    nonce = os.urandom(16)
    name = prefix + "probe"
    write_segment(name, [memoryview(nonce)])
    return ShmInfo(prefix=prefix, probe=name, nonce=nonce, pid=os.getpid())


def layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Offsets of bodies of ``sizes`` bytes packed at :data:`ALIGN`, and the total size."""
    offsets = []
    end = 0
    for size in sizes:
        offsets.append(end)
        end += -(-size // ALIGN) * ALIGN
    return offsets, end


def create(name: str, size: int) -> None:
    """Create segment ``name`` (exclusively) of ``size`` bytes, to be filled with
    ``write_segment(..., reuse=True)``."""
    fd = os.open(path(name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        unlink(name)
        raise
    finally:
        os.close(fd)


def write_segment(
    name: str, bodies: Sequence[memoryview | Sequence[memoryview]], *, reuse: bool = False
) -> list[int]:
    """Write segment ``name`` holding ``bodies`` (each at an :data:`ALIGN`-ed offset; a body
    given as several buffers is written as one, back to back); returns the offsets. The file
    is created exclusively, or with ``reuse`` it exists (one this writer claimed or
    made with :func:`create`: kept at least its size); it is removed if writing fails."""
    chunked = [[b] if isinstance(b, memoryview) else list(b) for b in bodies]
    offsets, total = layout([sum(c.nbytes for c in chunks) for chunks in chunked])
    flags = os.O_RDWR if reuse else os.O_CREAT | os.O_EXCL | os.O_RDWR
    fd = os.open(path(name), flags, 0o600)
    try:
        if not reuse or os.fstat(fd).st_size < total:
            os.ftruncate(fd, total)
        for chunks, offset in zip(chunked, offsets, strict=True):
            for chunk in chunks:
                view = chunk.cast("B") if chunk.format != "B" or chunk.ndim != 1 else chunk
                done = 0
                while done < view.nbytes:
                    done += os.pwrite(fd, view[done:], offset + done)
                offset += view.nbytes
    except BaseException:
        unlink(name)
        raise
    finally:
        os.close(fd)
    return offsets


class _Lock:
    """A reader's open, shared-locked file descriptor on a segment, and its live mappings."""

    __slots__ = ("fd", "maps", "size")

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size  # a segment's size never changes once it has been handed over
        self.maps = 0


_locks: dict[str, _Lock] = {}  # segment name -> this process's lock on it


def map_for_reading(name: str) -> mmap.mmap:
    """Map segment ``name`` copy-on-write (each call its own private mapping), under a shared
    lock this process holds as long as any of its mappings lives (module docstring). Raises
    ``FileNotFoundError`` if it is gone or being recycled."""
    lock = _locks.get(name)
    if lock is None:
        where = path(name)
        fd = os.open(where, os.O_RDONLY)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                raise FileNotFoundError(errno.ENOENT, "segment is being recycled", name) from None
            st = os.fstat(fd)
            if os.stat(where).st_ino != st.st_ino:  # recycled before our lock
                raise FileNotFoundError(errno.ENOENT, "segment was recycled", name)
            if not st.st_size:  # mmap refuses empty files; nothing will be read
                os.close(fd)
                return mmap.mmap(-1, 1)
        except BaseException:
            os.close(fd)
            raise
        lock = _locks[name] = _Lock(fd, st.st_size)
    mapping = mmap.mmap(lock.fd, lock.size, access=mmap.ACCESS_COPY)
    lock.maps += 1
    weakref.finalize(mapping, _unmapped, name, lock)
    return mapping


def _unmapped(name: str, lock: _Lock) -> None:
    lock.maps -= 1
    if not lock.maps:
        if _locks.get(name) is lock:
            del _locks[name]
        os.close(lock.fd)  # releases the lock: the unit may recycle it now


def hold(name: str) -> int:
    """A shared lock on segment ``name`` while its writer fills it and hands it over (as a
    reader's: the unit does not recycle it meanwhile, nor sweep it as a dead writer's); close
    the returned descriptor to release it (:func:`let_go`). Nobody else locks a segment a
    writer just created or claimed: ``BlockingIOError`` if someone does."""
    fd = os.open(path(name), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd


def let_go(lock: int, *, touch: bool) -> None:
    """Release a writer's lock from :func:`hold`; with ``touch``, set the segment's modification
    time to now first: its unit has not taken it yet (a told store on its way), and the sweep
    must not take it for a dead writer's however long the writer held it."""
    try:
        if touch:
            os.utime(lock)
    except OSError:
        pass  # gone (the unit restarted): nothing to protect
    finally:
        os.close(lock)


def recycle(name: str, free: str) -> bool:
    """Rename segment ``name`` to ``free`` unless a reader holds a lock on it (``False``: try
    again later). Raises ``FileNotFoundError`` if it is gone."""
    fd = os.open(path(name), os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a reader still maps it
        os.rename(path(name), path(free))
        return True
    finally:
        os.close(fd)  # releases our lock


def claim(free: str, name: str) -> bool:
    """Take free segment ``free`` as ``name`` (``False``: another writer was first, or the unit
    dropped it). Its modification time is set to now first: the unit's sweep takes a segment
    that is neither its own nor in its pool for a dead writer's once it is ``older_than``, and
    neither a rename nor a refill through a kept mapping (``client._filler``) updates it."""
    try:
        os.utime(path(free))
        os.rename(path(free), path(name))
    except FileNotFoundError:
        return False
    return True


def map_segment(name: str) -> mmap.mmap:
    """Map segment ``name`` read-only and shared (the unit that owns it). Raises
    ``FileNotFoundError`` if it is gone."""
    fd = os.open(path(name), os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return mmap.mmap(-1, 1)  # mmap refuses empty files; nothing will be read from it
        return mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)


def unlink(name: str) -> None:
    """Remove segment ``name`` (mappings stay valid until dropped); a missing one is fine."""
    try:
        os.unlink(path(name))
    except FileNotFoundError:
        pass


def sweep(prefix: str, *, keep: Iterable[str] = (), older_than: float | None = None) -> int:
    """Unlink segments starting with ``prefix`` except ``keep`` (and, with ``older_than``,
    those modified less than that many seconds ago, and those someone holds a lock on: a
    writer that has not handed its segment over yet, however long it stalled, see
    ``hold``); returns how many went."""
    keep = set(keep)
    now = time.time()
    gone = 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(prefix) or name in keep:
            continue
        if older_than is not None:
            try:
                if now - os.stat(path(name)).st_mtime < older_than:
                    continue
            except OSError:
                continue
            gone += _remove_unheld(name, older_than)
            continue
        try:
            os.unlink(path(name))
            gone += 1
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                raise
    return gone


def _remove_unheld(name: str, older_than: float) -> bool:
    """Unlink segment ``name`` if nobody holds a lock on it and it is still ``older_than``
    seconds old under our exclusive lock (a writer touches its segment before it lets go of
    its own lock, so one that stalled but lives is never taken for a dead one)."""
    try:
        fd = os.open(path(name), os.O_RDONLY)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its writer (or a reader) holds it
        st = os.stat(path(name))
        if st.st_ino != os.fstat(fd).st_ino or time.time() - st.st_mtime < older_than:
            return False  # renamed over (claimed, recycled), or touched before its lock went
        os.unlink(path(name))
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(fd)
