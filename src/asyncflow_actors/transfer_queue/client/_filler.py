"""A writer's segment filler: copies put bodies into segments, keeping the mappings of the
segments it refills so that filling one again is one ``memcpy`` (internal).

Filling a segment claimed from a unit's pool (see ``_shm``) with ``pwrite`` costs the kernel a
page-cache lookup per page, and mapping it afresh costs a page fault (or ``MAP_POPULATE``) per
page: each as much as the copy itself or more (16 MiB: ``memcpy`` about 2 ms, ``pwrite`` 4-7 ms,
a fresh mapping and copy 7-15 ms on the reference machine). Segments circulate between a
writer and a unit's pool, so a writer that keeps its mapping of each segment it filled from the
pool finds it again, page tables and all, the next time it claims that file (same inode, a new
name: names are never reused, files are).

Safety. A writer writes into a kept mapping only after it claimed the file again (renamed it to
a name of its own: the unit recycled it, so no reader maps it, see ``_shm``): exactly when it
could ``pwrite`` into it. It maps only files whose pages all exist (a claimed file was written
whole before): a page that does not exist yet is written with ``pwrite``, where a full
``/dev/shm`` is an ``OSError`` (through a mapping, it would be a ``SIGBUS``). A kept mapping
also keeps the file's pages alive after the unit unlinks it, so the filler drops mappings of
unlinked files before each write and when a client closes, and keeps at most ``budget`` bytes
in ``max_kept`` mappings (the least recently filled go first): the memory a writer pins beyond
what the units hold is bounded, and goes at its next put, its ``aclose``, or its exit
(``/dev/shm`` itself never holds more: the names are gone). A new segment (nothing to claim)
is written with ``pwrite``: its pages do not exist yet, and that is the cheapest way to make
them.
"""

from __future__ import annotations

import mmap
import os
import threading
import traceback
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import _shm

BUDGET = 128 << 20  # default: bytes of segment mappings a filler keeps
MAX_KEPT = 16  # default: mappings a filler keeps (each holds a file descriptor)
SPLIT_BYTES = 4 << 20  # fills this big are copied by two threads (with two CPUs or more)
SMALL_FILL = 1 << 20  # smaller fills are copied by ``mmap`` slices (holding the GIL: short)
_CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: set up all page tables in one call


class _Kept:
    """A writable shared mapping of a segment file, and an open descriptor on that file."""

    __slots__ = ("fd", "key", "mapping", "size")

    def __init__(self, fd: int, size: int, key: tuple[int, int]) -> None:
        self.fd = fd
        self.size = size
        self.key = key  # (device, inode): the file, whatever its name
        self.mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)

    def unlinked(self) -> bool:
        return os.fstat(self.fd).st_nlink == 0

    def close(self) -> None:
        self.mapping.close()
        os.close(self.fd)


class Filler:
    """Writes segments (see the module docstring); thread-safe, one per process is enough."""

    def __init__(self, budget: int = BUDGET, max_kept: int = MAX_KEPT) -> None:
        self.budget = budget
        self.max_kept = max_kept
        self.refills = 0  # writes into a kept mapping
        self._kept: OrderedDict[tuple[int, int], _Kept] = OrderedDict()  # (dev, inode) -> it
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return sum(k.size for k in self._kept.values())

    def write(
        self, name: str, bodies: Sequence[memoryview | Sequence[memoryview]], *, claimed: bool
    ) -> list[int]:
        """Fill segment ``name``, which exists (:func:`_shm.create`, or ``claimed`` from a
        unit's pool: then through a kept mapping of the file), as
        :func:`_shm.write_segment` would; returns the offsets."""
        self.prune()
        chunked = [[b] if isinstance(b, memoryview) else list(b) for b in bodies]
        offsets, total = _shm.layout([sum(c.nbytes for c in chunks) for chunks in chunked])
        if not claimed or not 0 < total <= self.budget:
            return _shm.write_segment(name, bodies, reuse=True)
        kept = None
        try:
            kept = self._take(name, total)
            if kept is None:
                return _shm.write_segment(name, bodies, reuse=True)
            _fill(kept.mapping, chunked, offsets)
        except BaseException:
            if kept is not None:
                kept.close()
            _shm.unlink(name)
            raise
        self._keep(kept)
        return offsets

    def _take(self, name: str, total: int) -> _Kept | None:
        """The kept mapping of claimed segment ``name`` (mapped now if none is kept), taken out
        of the cache while it is written; ``None`` if the file is smaller than ``total`` (it
        grows: new pages are written, never mapped, so that a full ``/dev/shm`` is an
        ``OSError``, not a ``SIGBUS``)."""
        st = os.stat(_shm.path(name))
        with self._lock:
            kept = self._kept.pop((st.st_dev, st.st_ino), None)
        if kept is not None and kept.size == st.st_size >= total:
            self.refills += 1
            return kept
        if kept is not None:
            kept.close()
        if st.st_size < total:
            return None
        fd = os.open(_shm.path(name), os.O_RDWR)
        try:
            st = os.fstat(fd)
            return _Kept(fd, st.st_size, (st.st_dev, st.st_ino))
        except BaseException:
            os.close(fd)
            raise

    def _keep(self, kept: _Kept) -> None:
        with self._lock:
            self._kept[kept.key] = kept
            total = self.nbytes
            while total > self.budget or len(self._kept) > self.max_kept:
                _, oldest = self._kept.popitem(last=False)
                total -= oldest.size
                oldest.close()

    def prune(self) -> None:
        """Drop the mappings of files the unit unlinked (they would pin its pages)."""
        with self._lock:
            for key, kept in list(self._kept.items()):
                if kept.unlinked():
                    del self._kept[key]
                    kept.close()


def _fill(mapping: mmap.mmap, chunked: list[list[memoryview]], offsets: list[int]) -> None:
    """Copy the bodies into the mapping at their offsets: below :data:`SMALL_FILL` by slice
    assignments of the mapping, else with numpy (the GIL is released). From
    :data:`SPLIT_BYTES` on, with a second CPU, a helper thread copies the second half of the
    bytes meanwhile (one ``memcpy`` does not saturate the memory bus: two take about 60% of
    its time for 16.8 MB); it is joined before this returns."""
    if sum(c.nbytes for chunks in chunked for c in chunks) < min(SMALL_FILL, SPLIT_BYTES):
        for chunks, offset in zip(chunked, offsets, strict=True):
            for chunk in chunks:  # a memcpy each, no array made (their fixed cost dominates)
                mapping[offset : offset + chunk.nbytes] = chunk
                offset += chunk.nbytes
        return
    target = np.frombuffer(mapping, np.uint8)  # an export: the mapping stays open meanwhile
    try:
        jobs = _jobs(chunked, offsets)
        total = sum(source.size for _, source in jobs)
        if total < SPLIT_BYTES or _CPUS < 2:
            _copy(target, jobs)
            return
        first, second = _halves(jobs, total // 2)
        failed: list[BaseException] = []

        def copy_second(into: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
            try:
                _copy(into, second)
            except BaseException as exc:  # raised below, in the caller's thread
                failed.append(exc)

        helper = threading.Thread(
            target=copy_second, args=(target,), name="afa-tq-fill", daemon=True
        )
        helper.start()
        try:
            _copy(target, first)
        finally:
            helper.join()
        if failed:
            raise failed[0]
    except BaseException as exc:
        traceback.clear_frames(exc.__traceback__)  # their locals would keep the export alive
        raise
    finally:
        del target  # no export may outlive this call: the mapping must stay closable


_Job = tuple[int, "np.ndarray[Any, np.dtype[np.uint8]]"]  # (offset in the segment, bytes)


def _jobs(chunked: list[list[memoryview]], offsets: list[int]) -> list[_Job]:
    """Each non-empty buffer and where it goes (a body's buffers back to back)."""
    jobs = []
    for chunks, offset in zip(chunked, offsets, strict=True):
        for chunk in chunks:
            if chunk.nbytes:
                jobs.append((offset, np.frombuffer(chunk, np.uint8)))
                offset += chunk.nbytes
    return jobs


def _copy(target: np.ndarray[Any, np.dtype[np.uint8]], jobs: list[_Job]) -> None:
    for offset, source in jobs:
        target[offset : offset + source.size] = source


def _halves(jobs: list[_Job], half: int) -> tuple[list[_Job], list[_Job]]:
    """``jobs`` cut after ``half`` bytes (a body straddling the cut is split in two)."""
    first: list[_Job] = []
    done = 0
    for k, (offset, source) in enumerate(jobs):
        if done + source.size >= half:
            cut = half - done
            first.append((offset, source[:cut]))
            return first, [(offset + cut, source[cut:]), *jobs[k + 1 :]]
        first.append((offset, source))
        done += source.size
    return first, []
