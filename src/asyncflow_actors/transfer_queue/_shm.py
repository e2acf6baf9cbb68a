"""Shared-memory segments: tensor bodies between a client and a storage unit on one host.

A *segment* is a file in ``/dev/shm`` (POSIX shared memory on Linux) whose name starts with the
owning unit's prefix ``afa-<queue>-<unit>-<incarnation>-``. A writer on the unit's host copies a
batch into a new segment once (:func:`write_segment`) and hands its name to the unit in the
``Store``; from then on the unit owns it: it maps it (read-only) and unlinks it when the last row
in it is freed. Readers on the host map it copy-on-write (:func:`map_segment`): their tensors are
views of the unit's pages, and a write to them stays private to the reader.

Safety rules (the unit enforces them, see ``_blocks``):

- a segment is written once, by its writer, before the unit takes it, and never written again:
  it is never reused, so a reader's view can never see other data;
- the unit unlinks a segment only when no live row is in it and every reader that was handed
  it has mapped it (or ``map_grace`` passed); a mapping stays valid after the unlink, until the
  reader drops its tensors (a view is valid at least until the reader acks, and longer);
- names are in the unit's namespace, so the unit can sweep what a writer that died (``kill -9``)
  created but never handed over, what a previous incarnation left, and everything at its stop.

Availability is probed, not assumed: a unit publishes a probe segment holding a random nonce, and a
client uses shared memory with that unit only if it can read the nonce back (same host, same
``/dev/shm``: containers with private ``/dev/shm`` fall back to sockets).
"""

from __future__ import annotations

import errno
import mmap
import os
import time
from collections.abc import Iterable, Sequence

import attrs

SHM_DIR = "/dev/shm"
ALIGN = 16  # byte alignment of every body in a segment (enough for every dtype)


@attrs.frozen
class ShmInfo:
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


def write_segment(name: str, bodies: Sequence[memoryview | Sequence[memoryview]]) -> list[int]:
    """Create segment ``name`` holding ``bodies`` (each at an :data:`ALIGN`-ed offset; a body
    given as several buffers is written as one, back to back); returns the offsets. The file
    is created exclusively and removed again if writing fails."""
    chunked = [[b] if isinstance(b, memoryview) else list(b) for b in bodies]
    offsets, total = layout([sum(c.nbytes for c in chunks) for chunks in chunked])
    fd = os.open(path(name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
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


def map_segment(name: str, *, shared: bool) -> mmap.mmap:
    """Map segment ``name``: ``shared`` (the unit: read-only, MAP_SHARED) or copy-on-write (a
    reader: its writes stay private). Raises ``FileNotFoundError`` if it is gone."""
    fd = os.open(path(name), os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return mmap.mmap(-1, 1)  # mmap refuses empty files; nothing will be read from it
        access = mmap.ACCESS_READ if shared else mmap.ACCESS_COPY
        return mmap.mmap(fd, size, access=access)
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
    those modified less than that many seconds ago); returns how many went."""
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
        try:
            os.unlink(path(name))
            gone += 1
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                raise
    return gone
