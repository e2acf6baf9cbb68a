"""Weights to vLLM's workers through shared memory: the segment layout both sides agree on.

The rollout process (``VLLMEngine.load_weights``) packs the tensors into a few segment files
under ``/dev/shm`` (``write_segments``), each with its CRC-32; vLLM's worker maps them
(``map_segment``), verifies them and loads the tensors straight from the mapping. What travels
on vLLM's own channel (``collective_rpc``) is only ``UpdatePlan.to_wire()``: names, dtypes,
shapes, offsets, segment paths and checksums, as plain lists (msgpack, never pickle).

This module imports torch only: the worker side (``_vllm_worker``) and the adapter share it.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch

__all__ = [
    "SEGMENT_DIR",
    "ParamSlot",
    "Segment",
    "SegmentError",
    "UpdatePlan",
    "map_segment",
    "remove_segments",
    "tensors_of",
    "write_segments",
]

SEGMENT_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else os.environ.get("TMPDIR", "/tmp")
_NAME = re.compile(r"^afa-vllm-[0-9a-f]{16}-\d+$")
_ALIGN = 64  # every tensor starts on a cache line (and any dtype's alignment)


class SegmentError(Exception):
    """A segment is missing, of the wrong size, outside the segment folder or corrupt."""


@attrs.frozen
class Segment:
    """One shared-memory file: its path, size in bytes and CRC-32 (0: not checksummed)."""

    path: str
    nbytes: int
    crc: int


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
    """The metadata of one weight update: what ``collective_rpc`` carries."""

    segments: tuple[Segment, ...]
    params: tuple[ParamSlot, ...]

    def to_wire(self) -> dict[str, Any]:
        """Plain lists and numbers (vLLM's msgpack channel carries them without pickle)."""
        return {
            "segments": [[s.path, s.nbytes, s.crc] for s in self.segments],
            "params": [[p.name, p.dtype, list(p.shape), p.segment, p.offset] for p in self.params],
        }

    @classmethod
    def from_wire(cls, segments: Sequence[Any], params: Sequence[Any]) -> UpdatePlan:
        return cls(
            tuple(Segment(str(p), int(n), int(c)) for p, n, c in segments),
            tuple(
                ParamSlot(str(n), str(d), tuple(int(x) for x in s), int(g), int(o))
                for n, d, s, g, o in params
            ),
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


def write_segments(
    weights: Mapping[str, torch.Tensor], *, segment_bytes: int, checksum: bool = True
) -> UpdatePlan:
    """Copy ``weights`` (host or device tensors) into new segment files; the caller removes
    them (``remove_segments``) once the update is over, whatever its outcome.

    A segment holds tensors up to ``segment_bytes`` (a larger tensor gets a segment of its
    own). Blocking: run it in a worker thread.
    """
    groups: list[list[tuple[str, torch.Tensor, int]]] = [[]]
    size = 0
    for name, tensor in weights.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > segment_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, tensor, size))
        size = _round_up(size + nbytes)
    token = secrets.token_hex(8)
    segments: list[Segment] = []
    slots: list[ParamSlot] = []
    try:
        for index, group in enumerate(groups):
            total = max(
                _ALIGN, max((off + t.numel() * t.element_size() for _, t, off in group), default=0)
            )
            path = os.path.join(SEGMENT_DIR, f"afa-vllm-{token}-{index}")
            segments.append(Segment(path, total, 0))
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, total)
                with mmap.mmap(fd, total) as mapped:
                    buf = torch.frombuffer(mapped, dtype=torch.uint8)
                    for name, tensor, off in group:
                        nbytes = tensor.numel() * tensor.element_size()
                        src = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
                        buf[off : off + nbytes].copy_(src)
                        slots.append(
                            ParamSlot(
                                name,
                                str(tensor.dtype).removeprefix("torch."),
                                tuple(tensor.shape),
                                index,
                                off,
                            )
                        )
                    crc = zlib.crc32(mapped) if checksum else 0
                    del buf
            finally:
                os.close(fd)
            segments[-1] = Segment(path, total, crc)
    except BaseException:
        remove_segments(segments)
        raise
    return UpdatePlan(tuple(segments), tuple(slots))


def remove_segments(segments: Sequence[Segment]) -> None:
    """Unlink the segment files (mappings still open stay valid until closed)."""
    for segment in segments:
        try:
            os.unlink(segment.path)
        except FileNotFoundError:
            pass


def map_segment(segment: Segment, *, checksum: bool = True) -> mmap.mmap:
    """Map a segment copy-on-write (nothing is written back) after checking its name, size
    and CRC-32. Raises ``SegmentError``."""
    folder, name = os.path.split(segment.path)
    if os.path.realpath(folder) != os.path.realpath(SEGMENT_DIR) or not _NAME.match(name):
        raise SegmentError(f"{segment.path!r} is not a weight segment under {SEGMENT_DIR}")
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
    if checksum and segment.crc and zlib.crc32(mapped) != segment.crc:
        mapped.close()
        raise SegmentError(f"segment {segment.path!r} fails its CRC-32 check")
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
