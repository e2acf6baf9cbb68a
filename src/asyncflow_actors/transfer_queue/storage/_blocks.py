"""What a storage unit holds: rows in blocks, memory accounted by what is really held.

A ``Store`` becomes one :class:`Block`: per column, either a *batch* (one buffer whose first
dimension runs over the block's rows: a frame, a tensor, or a view of a shared-memory segment)
or a list of *row values* (variable-length tensors, text...). A sample points at (block, row)
per column, so a fetch of rows stored together is one slice of one buffer (zero copy).

Accounting is by what is held, not by what is live: a block's buffers stay allocated while any
of its rows is referenced, so a unit reports both ``held`` bytes and ``live`` bytes. When a block
is mostly dead (its live bytes fall under half of what it held live when filled, past
:data:`COMPACT_MIN`), its live rows are copied out into a new, compact block and the old buffers
go: held bytes stay under about twice the live bytes plus one small block's worth. Copies cost
at most the bytes freed.

Shared-memory segments (``.._shm``) are owned here: a segment is unlinked (or kept for reuse,
see ``_pool``) once no row in it is live (the controller frees a row only once no valid lease
holds it, so no reader still needs to map it). A segment handed to a reader in the last ``MAP_GRACE`` seconds is not compacted away
(its rows are still live, and that reader may not have mapped it yet): that waits.
Nothing here imports torch: in a node process values are ``RawTensor`` (bytes, dtype, shape).
"""

from __future__ import annotations

import math
import sys
from typing import Any

from .. import _shm
from .._runtime import RawTensor, itemsize
from .._tensors import is_tensor as is_torch_tensor
from .._unit_messages import ShmBody, UnitError

COMPACT_MIN = 64 * 1024  # blocks holding fewer bytes are never compacted


def _torch() -> Any:
    return sys.modules.get("torch")


def is_tensor(value: Any) -> bool:
    return isinstance(value, RawTensor) or is_torch_tensor(value)


def nbytes(value: Any) -> int:
    """Bytes of a stored value (tensors: their body; text: its length; scalars: 8)."""
    if isinstance(value, RawTensor):
        return value.nbytes
    if is_torch_tensor(value):
        return int(value.numel() * value.element_size())
    if isinstance(value, (bytes, str)):
        return len(value)
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    return 0 if value is None else 8


def row_nbytes(value: Any) -> int:
    """Bytes of one row of a batch."""
    if isinstance(value, RawTensor):
        return value.row_bytes
    return int(math.prod(value.shape[1:]) * value.element_size())


def row_of(value: Any, r: int) -> Any:
    """Row ``r`` of a batch (rank one less, a view)."""
    if isinstance(value, RawTensor):
        size = value.row_bytes
        return RawTensor(value.dtype, tuple(value.shape[1:]), value.data[r * size : (r + 1) * size])
    return value[r]


def rows_of(value: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of a batch (a view)."""
    return value.rows(start, stop) if isinstance(value, RawTensor) else value[start:stop]


def _dtype(value: Any) -> str:
    return value.dtype if isinstance(value, RawTensor) else str(value.dtype).removeprefix("torch.")


class Segment:
    """A shared-memory segment this unit owns, mapped read-only."""

    __slots__ = ("buf", "last_fetch", "name", "size", "socket_read")

    def __init__(self, name: str) -> None:
        self.name = name
        mapping = _shm.map_segment(name)
        self.size = len(mapping)
        self.buf = memoryview(mapping)
        self.last_fetch = -math.inf  # when a reader was last handed it
        self.socket_read = False  # a socket reply was built from its pages: never reuse it

    def body(self, ref: ShmBody) -> RawTensor:
        """A view of ``ref``'s bytes; raises :class:`UnitError` for a bad dtype or range."""
        try:
            size = itemsize(ref.dtype) * math.prod(ref.shape)
        except (KeyError, TypeError):
            raise UnitError(f"segment {self.name!r}: bad body {ref!r}") from None
        if ref.offset < 0 or ref.offset + size > self.size or any(d < 0 for d in ref.shape):
            raise UnitError(f"segment {self.name!r} ({self.size} bytes) has no body {ref!r}")
        return RawTensor(ref.dtype, tuple(ref.shape), self.buf[ref.offset : ref.offset + size])


class Column:
    """One column of a block: a batch, or row values; ``offsets``: where it lies in the block's
    segment (a batch: one base offset; rows: one per row, ``-1`` for a value held inline)."""

    __slots__ = ("batch", "held", "offsets", "refs", "row_bytes", "sizes", "value")

    def __init__(self, value: Any, offsets: list[int] | None) -> None:
        self.value = value
        self.batch = not isinstance(value, list)
        self.offsets = offsets
        self.refs = 0  # live cells pointing here
        self.sizes: list[int] = []  # row values: each one's bytes, counted once
        if self.batch:
            self.row_bytes = row_nbytes(value)
            self.held = nbytes(value)
        else:
            self.row_bytes = -1
            self.sizes = [nbytes(v) for v in value]
            self.held = sum(self.sizes)

    def cell_nbytes(self, r: int) -> int:
        return self.row_bytes if self.batch else self.sizes[r]

    def row(self, r: int) -> Any:
        return row_of(self.value, r) if self.batch else self.value[r]


class Block:
    """The columns of one store (or one compaction): ``owners[r]`` is the sample of row r;
    ``row_bytes``: the bytes of one row of all its columns if they are all batches, else -1."""

    __slots__ = ("columns", "held", "initial", "live", "owners", "row_bytes", "segment")

    def __init__(self, columns: dict[str, Column], owners: list[Any], segment: Segment | None):
        self.columns = columns
        self.owners = owners
        self.segment = segment
        self.held = segment.size if segment is not None else sum(c.held for c in columns.values())
        self.live = 0  # bytes of live cells
        self.initial = 0  # bytes of live cells once filled (compaction compares with it)
        batches = all(c.batch for c in columns.values())
        self.row_bytes = sum(c.row_bytes for c in columns.values()) if batches else -1

    @property
    def refs(self) -> int:
        return sum(c.refs for c in self.columns.values())

    def ref(self, column: str, start: int, count: int, whole: bool) -> Any:
        """What a reader gets for rows ``start..start+count`` of a batch ``column``: a view, or
        where it lies in the segment (``whole``: the reader maps segments)."""
        col = self.columns[column]
        if whole and self.segment is not None and col.offsets is not None:
            shape = (count, *col.value.shape[1:])
            offset = col.offsets[0] + start * col.row_bytes
            return ShmBody(offset, _dtype(col.value), tuple(shape), self.segment.name)
        if self.segment is not None and col.offsets is not None:
            self.segment.socket_read = True
        return rows_of(col.value, start, start + count)

    def row_ref(self, column: str, r: int, whole: bool) -> Any:
        col = self.columns[column]
        value = col.row(r)
        if whole and self.segment is not None and col.offsets is not None and is_tensor(value):
            offset = col.offsets[r]
            if offset >= 0:
                return ShmBody(offset, _dtype(value), tuple(value.shape), self.segment.name)
        if self.segment is not None and col.offsets is not None and col.offsets[r] >= 0:
            self.segment.socket_read = True
        return value

    def live_rows(self) -> list[tuple[int, list[str]]]:
        """Rows still referenced, with the columns referenced in each."""
        out = []
        for r, owner in enumerate(self.owners):
            if owner is None:
                continue
            cols = [c for c in self.columns if owner.cell(c) == (self, r)]
            if cols:
                out.append((r, cols))
        return out


def gather(parts: list[Any]) -> Any:
    """Concatenate row buffers into one batch (one copy): ``RawTensor`` rows or torch rows."""
    first = parts[0]
    if isinstance(first, RawTensor):
        data = memoryview(b"".join(p.data for p in parts))
        return RawTensor(first.dtype, (len(parts), *first.shape), data)
    return _torch().stack(parts)
