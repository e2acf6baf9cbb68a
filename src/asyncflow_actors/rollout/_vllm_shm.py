"""Weights to vLLM's workers through shared memory: the segment layout both sides agree on.

The rollout process (``VLLMEngine.load_weights``) packs the tensors into a few shared-memory
segments (``write_segments``), each with its checksum; vLLM's worker maps them (``map_segment``),
verifies them and loads the tensors straight from the mapping. The checksum is XXH3-64 where
the ``xxhash`` package is importable (the ``vllm`` extra brings it; it reads memory at about
copy speed) and CRC-32 otherwise (about 3x a copy); the plan names which, and each side
streams it over the bytes as they are copied (``write_segments`` hashes each chunk while it is
in cache), so a segment costs one pass over the weights, not two. A segment is a ``memfd``
(Linux, as vLLM): it has no name in any folder, dies with the rollout process (nothing leaks
if it is killed), and the worker opens it as ``/proc/<pid>/fd/<fd>``. A ``SegmentPool`` keeps
its segments from one update to the next: their pages stay mapped and faulted in, so an update
costs one copy into them, not fresh pages every time. What travels
on vLLM's own channel (``collective_rpc``) is only ``UpdatePlan.to_wire()``: names, dtypes,
shapes, offsets, segment paths and checksums, as plain lists (msgpack, never pickle).

This module imports torch (and ``xxhash`` when present) only: the worker side
(``_vllm_worker``) and the adapter share it.
"""

from __future__ import annotations

import mmap
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch

from ..checkpoint._buckets import hasher as checkpoint_hasher
from ..checkpoint._errors import UnknownChecksum

xxhash: Any
try:
    import xxhash
except ImportError:  # pragma: no cover - the vllm extra brings it
    xxhash = None

__all__ = [
    "CHECKSUM",
    "ParamSlot",
    "Segment",
    "SegmentError",
    "SegmentPool",
    "UpdatePlan",
    "map_segment",
    "tensors_of",
    "write_segments",
]

_PATH = re.compile(r"^/proc/\d+/fd/\d+$")
_MEMFD = "afa-vllm-segment"
_ALIGN = 64  # every tensor starts on a cache line (and any dtype's alignment)
# Copied and hashed a chunk at a time: the hash reads the chunk just written, from cache.
_CHUNK = 1 << 20

#: The checksum ``write_segments`` uses: XXH3-64 with ``xxhash``, else zlib's CRC-32.
CHECKSUM = "xxh3_64" if xxhash is not None else "crc32"


class SegmentError(Exception):
    """A segment is missing, of the wrong size, outside the segment folder or corrupt."""


def hasher(name: str) -> Any:
    """A fresh streaming hasher (``update``, ``intdigest``) of checksum ``name``: the
    CheckpointEngine's own (``checkpoint._buckets.hasher``; XXH3-64 is ``xxh3_64`` here)."""
    try:
        return checkpoint_hasher("xxh3" if name == "xxh3_64" else name)
    except UnknownChecksum as exc:
        raise SegmentError(f"checksum {name!r} is not available here") from exc


@attrs.frozen
class Segment:
    """One shared-memory file: its path, size in bytes and checksum (the plan says which)."""

    path: str
    nbytes: int
    digest: int


@attrs.frozen
class ParamSlot:
    """Where one tensor lies: segment index, byte offset, dtype name and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    segment: int
    offset: int

    @property
    def nbytes(self) -> int:
        return _dtype(self.dtype).itemsize * _numel(self.shape)


@attrs.frozen
class UpdatePlan:
    """The metadata of one weight update: what ``collective_rpc`` carries. ``checksum``: the
    algorithm of the segments' digests (``""``: not checksummed)."""

    segments: tuple[Segment, ...]
    params: tuple[ParamSlot, ...]
    checksum: str = ""

    def to_wire(self) -> dict[str, Any]:
        """Plain lists and numbers (vLLM's msgpack channel carries them without pickle)."""
        return {
            "segments": [[s.path, s.nbytes, s.digest] for s in self.segments],
            "params": [[p.name, p.dtype, list(p.shape), p.segment, p.offset] for p in self.params],
            "checksum": self.checksum,
        }

    @classmethod
    def from_wire(
        cls, segments: Sequence[Any], params: Sequence[Any], checksum: str = ""
    ) -> UpdatePlan:
        return cls(
            tuple(Segment(str(p), int(n), int(c)) for p, n, c in segments),
            tuple(
                ParamSlot(str(n), str(d), tuple(int(x) for x in s), int(g), int(o))
                for n, d, s, g, o in params
            ),
            str(checksum),
        )

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for x in shape:
        n *= int(x)
    return n


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise SegmentError(f"unknown dtype {name!r}")
    return dtype


def _round_up(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class SegmentPool:
    """The sender's segments, kept across updates (``close`` frees them; so does exiting)."""

    def __init__(self) -> None:
        self._segments: list[tuple[int, mmap.mmap]] = []

    def segment(self, index: int, nbytes: int) -> tuple[str, mmap.mmap]:
        """The ``/proc`` path and a writable mapping of segment ``index``, of ``nbytes``."""
        while len(self._segments) <= index:
            fd = os.memfd_create(_MEMFD, os.MFD_CLOEXEC)
            self._segments.append((fd, mmap.mmap(-1, 1)))  # placeholder, resized below
        fd, mapped = self._segments[index]
        if len(mapped) != nbytes:
            mapped.close()
            os.ftruncate(fd, nbytes)
            mapped = mmap.mmap(fd, nbytes)
            self._segments[index] = (fd, mapped)
        return f"/proc/{os.getpid()}/fd/{fd}", mapped

    def close(self) -> None:
        segments, self._segments = self._segments, []
        for fd, mapped in segments:
            try:
                mapped.close()
            except BufferError:
                pass  # a view still exists: the mapping goes with it
            os.close(fd)


def write_segments(
    weights: Mapping[str, torch.Tensor],
    *,
    pool: SegmentPool,
    segment_bytes: int,
    checksum: bool = True,
) -> UpdatePlan:
    """Copy ``weights`` (host or device tensors) into ``pool``'s segments, checksumming each
    chunk as it is written (``CHECKSUM``). A segment holds tensors up to ``segment_bytes`` (a
    larger tensor gets a segment of its own). The segments must not be written again until the
    receivers have dropped their mappings (the update is over). Blocking: run it in a worker
    thread."""
    groups: list[list[tuple[str, torch.Tensor, int]]] = [[]]
    size = 0
    for name, tensor in weights.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > segment_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, tensor, size))
        size = _round_up(size + nbytes)
    algorithm = CHECKSUM if checksum else ""
    segments: list[Segment] = []
    slots: list[ParamSlot] = []
    for index, group in enumerate(groups):
        total = max(
            _ALIGN, max((off + t.numel() * t.element_size() for _, t, off in group), default=0)
        )
        path, mapped = pool.segment(index, total)
        digest = hasher(algorithm) if algorithm else None
        buf = torch.frombuffer(mapped, dtype=torch.uint8)
        view = memoryview(mapped)
        try:
            end = 0
            for name, tensor, off in group:
                _pad(buf, view, end, off, digest)  # a segment's bytes depend on the weights alone
                nbytes = tensor.numel() * tensor.element_size()
                src = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
                _copy(buf, view, off, src, digest)
                end = off + nbytes
                slots.append(
                    ParamSlot(
                        name,
                        str(tensor.dtype).removeprefix("torch."),
                        tuple(tensor.shape),
                        index,
                        off,
                    )
                )
            _pad(buf, view, end, total, digest)
        finally:
            view.release()
            del buf
        segments.append(Segment(path, total, digest.intdigest() if digest is not None else 0))
    return UpdatePlan(tuple(segments), tuple(slots), algorithm)


def _pad(buf: torch.Tensor, view: memoryview, start: int, end: int, digest: Any) -> None:
    """Zero ``buf[start:end]`` (padding) and feed it to ``digest``."""
    if end > start:
        buf[start:end].zero_()
        if digest is not None:
            digest.update(view[start:end])


def _copy(buf: torch.Tensor, view: memoryview, off: int, src: torch.Tensor, digest: Any) -> None:
    """Copy the flat bytes ``src`` to ``buf[off:]``, a chunk at a time, each chunk hashed while
    it is in cache (a device tensor comes over whole, then is hashed)."""
    n = src.numel()
    if src.device.type != "cpu":
        buf[off : off + n].copy_(src)
        if digest is not None:
            for i in range(0, n, _CHUNK):
                digest.update(view[off + i : off + min(n, i + _CHUNK)])
        return
    if n == 0:
        return
    dst_np, src_np = buf.numpy(), src.numpy()  # numpy: one plain memcpy a chunk
    for i in range(0, n, _CHUNK):
        j = min(n, i + _CHUNK)
        dst_np[off + i : off + j] = src_np[i:j]
        if digest is not None:
            digest.update(view[off + i : off + j])


def map_segment(segment: Segment, *, checksum: str = CHECKSUM) -> mmap.mmap:
    """Map a segment copy-on-write (nothing is written back) after checking that it is one
    of our memfds, its size and (``checksum`` names the algorithm; ``""``: none) its digest.
    Raises ``SegmentError``."""
    try:
        is_ours = bool(_PATH.match(segment.path)) and os.readlink(segment.path).startswith(
            f"/memfd:{_MEMFD}"
        )
    except OSError:
        is_ours = False
    if not is_ours:
        raise SegmentError(f"{segment.path!r} is not a weight segment")
    try:
        fd = os.open(segment.path, os.O_RDONLY)
    except OSError as exc:
        raise SegmentError(f"cannot open segment {segment.path!r}: {exc}") from exc
    try:
        actual = os.fstat(fd).st_size
        if actual != segment.nbytes:
            raise SegmentError(
                f"segment {segment.path!r} has {actual} bytes, expected {segment.nbytes}"
            )
        mapped = mmap.mmap(fd, segment.nbytes, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    if checksum:
        try:
            digest = hasher(checksum)
            digest.update(mapped)
            good = digest.intdigest() == segment.digest
        except BaseException:
            mapped.close()
            raise
        if not good:
            mapped.close()
            raise SegmentError(f"segment {segment.path!r} fails its {checksum} check")
    return mapped


def tensors_of(
    plan: UpdatePlan, mappings: Sequence[mmap.mmap]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views into the mapped segments (no copies)."""
    for p in plan.params:
        mapped = mappings[p.segment]
        if p.offset < 0 or p.offset + p.nbytes > len(mapped):
            raise SegmentError(f"{p.name!r} lies outside segment {p.segment}")
        if p.nbytes == 0:
            yield p.name, torch.empty(p.shape, dtype=_dtype(p.dtype))
            continue
        flat = torch.frombuffer(mapped, dtype=torch.uint8, count=p.nbytes, offset=p.offset)
        yield p.name, flat.view(_dtype(p.dtype)).view(p.shape)
