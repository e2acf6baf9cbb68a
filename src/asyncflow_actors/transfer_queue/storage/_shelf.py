"""A storage unit's contents: samples, blocks, shared blobs, segments, inventory records.

:class:`Shelf` is the unit's sans-I/O core (the ``StorageUnit`` actor wraps it): it stores and
fetches rows exactly as they were put, keeps the per-sample records a rebuild needs, accounts
memory by what is held (see ``_blocks``), compacts mostly-dead blocks, and owns the unit's
shared-memory segments. Bad requests raise :class:`UnitError` and change nothing.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .. import _shm
from .._runtime import RawTensor
from .._unit_messages import (
    Committed,
    Delete,
    Fetch,
    Fetched,
    GroupInfo,
    MarkConsumed,
    MissingSamples,
    ShmBody,
    Store,
    TopicInfo,
    UnitError,
    UnitGroup,
    UnitInventory,
    UnitSample,
)
from ._blocks import COMPACT_MIN, Block, Column, Segment, gather, is_tensor, nbytes
from ._pool import SegmentPool

log = logging.getLogger("asyncflow_actors.transfer_queue")

MAP_GRACE = 30.0  # seconds a reader has to map a segment it was handed (compaction waits)


_NONE: frozenset[str] = frozenset()


class _Sample:
    """A sample's record. Its cells (column -> (block, row)) are kept in one of two forms: the
    usual case (one put) is a *home* row, ``block`` and ``row``, that holds every cell in a block
    with no other column, so that deleting the sample touches the block once, not once per
    column; otherwise (columns rewritten, or put by several stores) ``block`` is ``None`` and
    ``others`` maps each column to its cell. ``consumed``: the consumers that acked it, a set
    shared by every sample with the same marks (see ``Shelf.mark``). So a home sample is one
    object, with no dict, tuple or set of its own: a unit makes one per stored row, and every
    container more would be one more object for the garbage collector to track (its passes
    then pause the unit for milliseconds while puts wait for its bookkeeping)."""

    __slots__ = ("block", "committed", "consumed", "group_id", "length", "others", "row", "version")

    def __init__(self, version: int, group_id: int, length: int, block: Block, row: int) -> None:
        self.version = version
        self.group_id = group_id
        self.length = length
        self.committed = False
        self.consumed: frozenset[str] = _NONE
        self.block: Block | None = block
        self.row = row
        self.others: dict[str, tuple[Block, int]] | None = None

    @property
    def home(self) -> tuple[Block, int] | None:
        return None if self.block is None else (self.block, self.row)

    @property
    def cells(self) -> dict[str, tuple[Block, int]]:
        """Column -> (block, row), a new dict (change cells with :meth:`place`)."""
        if self.block is not None:
            return dict.fromkeys(self.block.columns, (self.block, self.row))
        assert self.others is not None
        return dict(self.others)

    def cell(self, column: str) -> tuple[Block, int] | None:
        if self.block is not None:
            return (self.block, self.row) if column in self.block.columns else None
        assert self.others is not None
        return self.others.get(column)

    def place(self, cells: dict[str, tuple[Block, int]]) -> None:
        """Set every cell (in home form if they are one row of a block with no other column)."""
        first = next(iter(cells.values()))
        if len(cells) == len(first[0].columns) and all(
            b is first[0] and r == first[1] for b, r in cells.values()
        ):
            self.block, self.row, self.others = first[0], first[1], None
        else:
            self.block, self.others = None, cells


class Shelf:
    """What one unit incarnation holds. ``prefix``: its segment namespace (``None``: no shared
    memory); ``clock``: seconds, for the compaction grace of segments just handed out."""

    def __init__(
        self,
        name: str,
        prefix: str | None,
        clock: Callable[[], float],
        pool: SegmentPool | None = None,
    ) -> None:
        self.name = name
        self.prefix = prefix
        self.clock = clock
        self.pool = pool  # freed segments kept for reuse (see ``_pool``)
        self.samples: dict[str, dict[int, _Sample]] = {}
        self.blobs: dict[str, dict[int, dict[str, Any]]] = {}
        self.groups: dict[str, dict[int, tuple[int, int]]] = {}  # explicit: (size, committed)
        self.topic_info: dict[str, TopicInfo] = {}
        self.segments: dict[str, Segment] = {}
        self.deferred: set[Block] = set()  # compactions waiting for a segment's grace
        self._own = itertools.count()
        self._marks: dict[frozenset[str], frozenset[str]] = {}  # the distinct marks, shared
        self.held = 0  # bytes of block buffers and segments
        self.live = 0  # bytes of live cells
        self.shared_nbytes = 0
        self.stores = self.fetches = self.zero_copy = 0
        self.shm_stores = self.shm_fetches = self.compactions = 0

    # -- writing -------------------------------------------------------------------------------

    def store(self, msg: Store, *, create: bool = True) -> None:
        n = len(msg.indexes)
        if create and not len(msg.versions) == len(msg.group_ids) == len(msg.lengths) == n:
            raise UnitError("Store: indexes, versions, group_ids and lengths differ in length")
        samples = self.samples.setdefault(msg.topic, {})
        if len(set(msg.indexes)) != n:
            raise UnitError(f"Store: indexes repeat ({msg.indexes[:8]}...)")
        if not create:
            absent = [i for i in msg.indexes if i not in samples]
            if absent:
                raise MissingSamples(
                    f"unit {self.name!r} holds no samples {absent[:8]} of {msg.topic!r}"
                )
        if self.pool is not None:
            if msg.reused:
                self.pool.taken(msg.reused)
            self.pool.drain()
        segment = self._take(msg.segment) if msg.segment else None
        try:
            columns = {c: self._column(c, v, n, segment) for c, v in msg.columns.items()}
        except BaseException:
            if segment is not None:
                self._unlink(segment)
            raise
        block = Block(columns, [], segment)
        if segment is None:
            self.held += block.held
        owners = block.owners
        versions, group_ids, lengths = msg.versions, msg.group_ids, msg.lengths
        touched: set[Block] = set()
        for r, index in enumerate(msg.indexes):
            sample = samples.get(index)
            if sample is None:  # a new sample (only with ``create``: checked above)
                sample = samples[index] = _Sample(versions[r], group_ids[r], lengths[r], block, r)
            else:
                cells = sample.cells
                for c in columns:
                    old = cells.get(c)
                    if old is not None:
                        self._unref(old[0], c, old[1], touched)
                    cells[c] = (block, r)
                sample.place(cells)
            owners.append(sample)
        for col in columns.values():  # every cell of the new block is live (indexes distinct)
            col.refs += n
            block.live += col.held
        self.live += block.live
        block.initial = block.live
        if not block.refs:
            self._free(block)  # no rows: nothing will ever free it otherwise
        self._settle(touched)
        self.stores += 1
        self.shm_stores += segment is not None

    def _column(self, name: str, value: Any, n: int, segment: Segment | None) -> Column:
        if isinstance(value, list):
            if len(value) != n:
                raise UnitError(f"Store: column {name!r} has {len(value)} rows for {n} indexes")
            if segment is None:
                return Column(value, None)
            rows, where = [], []
            for item in value:
                if isinstance(item, ShmBody):
                    rows.append(segment.body(item))
                    where.append(item.offset)
                else:
                    rows.append(item)
                    where.append(-1)
            return Column(rows, where)
        offsets: list[int] | None = None
        if isinstance(value, ShmBody):
            if segment is None:
                raise UnitError(f"Store: column {name!r} names a segment, but none was handed over")
            value, offsets = segment.body(value), [value.offset]
        elif is_tensor(value):
            pass
        else:
            raise UnitError(f"Store: column {name!r} is neither a batch nor a list of rows")
        if len(value.shape) == 0 or value.shape[0] != n:
            raise UnitError(f"Store: column {name!r} has shape {list(value.shape)} for {n} indexes")
        return Column(value, offsets)

    def _take(self, name: str) -> Segment:
        """Take over a segment a writer handed us (it must be in our namespace)."""
        if self.prefix is None or not name.startswith(self.prefix) or "/" in name:
            raise UnitError(f"unit {self.name!r} does not take segment {name!r}")
        try:
            segment = Segment(name)
        except (OSError, ValueError) as exc:
            _shm.unlink(name)  # ours now, even if unusable
            raise UnitError(f"unit {self.name!r} cannot map segment {name!r}: {exc}") from None
        self.segments[name] = segment
        self.held += segment.size
        return segment

    def store_shared(self, topic: str, group_id: int, columns: Mapping[str, Any]) -> None:
        """Keep the group-shared ``columns`` of a group (replacing those stored before)."""
        blobs = self.blobs.setdefault(topic, {}).setdefault(group_id, {})
        for column, value in columns.items():
            old = blobs.get(column)
            added = nbytes(value) - (nbytes(old) if column in blobs else 0)
            self.shared_nbytes += added
            self.held += added
            self.live += added
            blobs[column] = value

    # -- bookkeeping ---------------------------------------------------------------------------

    def apply(
        self, item: Delete | MarkConsumed | Committed | GroupInfo | TopicInfo | Store
    ) -> list[int]:
        """One item of the controller's bookkeeping (each is idempotent); for a told ``Store``,
        the samples it could not store (see :meth:`store_told`)."""
        if isinstance(item, Store):
            return self.store_told(item)
        if isinstance(item, Delete):
            self.delete(item)
        elif isinstance(item, MarkConsumed):
            self.mark(item)
        elif isinstance(item, Committed):
            samples = self.samples.get(item.topic, {})
            for index in item.indexes:
                sample = samples.get(index)
                if sample is not None:
                    sample.committed = True
        elif isinstance(item, GroupInfo):
            self.groups.setdefault(item.topic, {})[item.group_id] = (item.size, item.committed)
        else:
            self.watermark(item)
        return []

    def mark(self, item: MarkConsumed) -> None:
        """Record that ``item.consumer`` acked samples; samples with the same marks share one
        set of them (a unit holds few distinct ones: subsets of its topics' consumers)."""
        samples = self.samples.get(item.topic, {})
        after: dict[frozenset[str], frozenset[str]] = {}  # marks before -> after, this item
        for index in item.indexes:
            sample = samples.get(index)
            if sample is None:
                continue
            new = after.get(sample.consumed)
            if new is None:
                new = sample.consumed | {item.consumer}
                new = after[sample.consumed] = self._marks.setdefault(new, new)
            sample.consumed = new

    def store_told(self, msg: Store) -> list[int]:
        """A put told through the controller (its segment written and committed before the
        unit heard of it). Delivered again after a controller restart, it finds its segment
        taken already (or, once its rows went, gone): nothing to do then. Returns the samples
        it names that this unit does not hold when it cannot be stored: those still live at
        the controller are lost (their segment went before the store arrived), never a silent
        hole."""
        if msg.segment in self.segments:
            return []
        try:
            self.store(msg)
        except UnitError as exc:  # its segment is gone: stored and freed since, or lost
            held = self.samples.get(msg.topic, {})
            absent = [i for i in msg.indexes if i not in held]
            log.info("unit %s: told store of %s skipped: %s", self.name, msg.indexes[:8], exc)
            return absent
        return []

    def watermark(self, info: TopicInfo) -> None:
        old = self.topic_info.get(info.topic)
        if old is not None:  # merged by maximum: applying an older record changes nothing
            info = TopicInfo(
                info.topic,
                max(old.latest_version, info.latest_version),
                max(old.next_index, info.next_index),
                max(old.next_group_id, info.next_group_id),
            )
        self.topic_info[info.topic] = info

    def delete(self, msg: Delete) -> None:
        samples = self.samples.get(msg.topic, {})
        touched: set[Block] = set()
        homed: dict[Block, int] = {}  # samples whose whole row of a batch block goes
        freed = 0
        for index in msg.indexes:
            sample = samples.pop(index, None)
            if sample is None:
                continue
            home = sample.block
            if home is not None and home.row_bytes >= 0:
                homed[home] = homed.get(home, 0) + 1
                home.owners[sample.row] = None
                continue
            for c, (block, r) in sample.cells.items():  # _unref, inlined: the hot loop
                col = block.columns[c]
                col.refs -= 1
                size = col.row_bytes if col.batch else col.sizes[r]
                block.live -= size
                freed += size
                touched.add(block)
                block.owners[r] = None
        for block, k in homed.items():
            for col in block.columns.values():
                col.refs -= k
            block.live -= k * block.row_bytes
            freed += k * block.row_bytes
            touched.add(block)
        self.live -= freed
        self._settle(touched)
        blobs = self.blobs.get(msg.topic, {})
        groups = self.groups.get(msg.topic, {})
        for group in msg.group_ids:  # the group is gone: its blob and its record
            groups.pop(group, None)
            removed = blobs.pop(group, None)
            if removed is not None:
                size = sum(nbytes(v) for v in removed.values())
                self.shared_nbytes -= size
                self.held -= size
                self.live -= size

    # -- reading -------------------------------------------------------------------------------

    def fetch(self, msg: Fetch) -> Fetched:
        samples = self.samples.get(msg.topic, {})
        rows = [samples.get(i) for i in msg.indexes]
        if None in rows:
            missing = [i for i, s in zip(msg.indexes, rows, strict=True) if s is None]
            raise MissingSamples(
                f"unit {self.name!r} holds no samples {missing[:8]} of {msg.topic!r}"
            )
        columns = {c: self._parts(msg.topic, c, rows, msg.indexes, msg.shm) for c in msg.columns}  # type: ignore[arg-type]
        blobs = self.blobs.get(msg.topic, {})
        shared = {
            g: {c: blobs[g][c] for c in msg.shared_columns if c in blobs.get(g, {})}
            for g in msg.shared_groups
        }
        self.fetches += 1
        if msg.shm:
            named = {p.segment for parts in columns.values() for p in _bodies(parts)}
            now = self.clock()
            for name in named:
                self.segments[name].last_fetch = now
            self.shm_fetches += bool(named)
        return Fetched(columns, shared)

    def _parts(
        self, topic: str, column: str, rows: Sequence[_Sample], indexes: Sequence[int], shm: bool
    ) -> list[Any]:
        """The column's cells of ``rows`` as parts: runs of consecutive batch rows (views) and
        lists of row values, in order."""
        parts: list[Any] = []
        run: tuple[Block, int, int] | None = None  # (block, first row, count)
        for sample, index in zip(rows, indexes, strict=True):
            cell = sample.cell(column)
            if cell is None:
                raise UnitError(f"sample {index} of {topic!r} has no column {column!r}")
            block, r = cell
            if block.columns[column].batch:
                if run is not None and run[0] is block and run[1] + run[2] == r:
                    run = (block, run[1], run[2] + 1)
                    continue
                if run is not None:
                    parts.append(run[0].ref(column, run[1], run[2], shm))
                run = (block, r, 1)
            else:
                if run is not None:
                    parts.append(run[0].ref(column, run[1], run[2], shm))
                    run = None
                if not parts or not isinstance(parts[-1], list):
                    parts.append([])
                parts[-1].append(block.row_ref(column, r, shm))
        if run is not None:
            parts.append(run[0].ref(column, run[1], run[2], shm))
        if len(parts) == 1 and not isinstance(parts[0], list):
            self.zero_copy += 1
        return parts

    def compact_deferred(self) -> None:
        """Compact the blocks whose segment's grace has passed (called now and then)."""
        for block in list(self.deferred):
            self.deferred.discard(block)
            if block.refs:
                self._settle({block})

    # -- cells, blocks and segments ------------------------------------------------------------

    def _ref(self, block: Block, column: str, r: int) -> None:
        col = block.columns[column]
        col.refs += 1
        size = col.cell_nbytes(r)
        block.live += size
        self.live += size

    def _unref(self, block: Block, column: str, r: int, touched: set[Block]) -> None:
        col = block.columns[column]
        col.refs -= 1
        size = col.cell_nbytes(r)
        block.live -= size
        self.live -= size
        touched.add(block)

    def _settle(self, touched: set[Block]) -> None:
        for block in touched:
            if block.refs == 0:
                self._free(block)
            elif block.held >= COMPACT_MIN and 2 * block.live < block.initial:
                # half of what it held live is dead: a copy of the rest (same layout) is half
                segment = block.segment
                if segment is not None and (
                    self.clock() - segment.last_fetch < MAP_GRACE
                    or not all(o is None or o.committed for o in block.owners)
                ):
                    # a reader may still have to map it, or its writer may still be filling it
                    self.deferred.add(block)
                else:
                    self._compact(block)

    def _free(self, block: Block) -> None:
        self.deferred.discard(block)
        if block.segment is None:
            self.held -= block.held
            return
        segment = block.segment
        if self.segments.pop(segment.name, None) is not None:
            self.held -= segment.size
        # a socket reply may still be reading its pages: never refill those
        if (
            self.pool is None
            or segment.socket_read
            or not self.pool.offer(segment.name, segment.size)
        ):
            _shm.unlink(segment.name)

    def _unlink(self, segment: Segment) -> None:
        if self.segments.pop(segment.name, None) is not None:
            self.held -= segment.size
        _shm.unlink(segment.name)

    def _compact(self, block: Block) -> None:
        """Copy the block's live cells into a new block (one copy), then free it."""
        live = block.live_rows()
        owners = [block.owners[r] for r, _ in live]
        plan: dict[str, tuple[bool, list[Any]]] = {}
        for c, col in block.columns.items():
            keep = [c in cols for _, cols in live]
            values = [col.row(r) if k else None for (r, _), k in zip(live, keep, strict=True)]
            plan[c] = (col.batch and all(keep), values)
        segment = None
        if block.segment is not None and self.prefix is not None:
            columns, segment = self._compact_to_segment(plan)
        else:
            columns = {
                c: Column(gather(values) if batch else [_copy(v) for v in values], None)
                for c, (batch, values) in plan.items()
            }
        new = Block(columns, owners, segment)
        if segment is None:
            self.held += new.held
        scratch: set[Block] = set()
        for r_new, ((r_old, cols), owner) in enumerate(zip(live, owners, strict=True)):
            cells = owner.cells
            for c in cols:
                self._unref(block, c, r_old, scratch)
                cells[c] = (new, r_new)
                self._ref(new, c, r_new)
            block.owners[r_old] = None
            owner.place(cells)
        new.initial = new.live
        self._free(block)
        self.compactions += 1

    def _compact_to_segment(
        self, plan: dict[str, tuple[bool, list[Any]]]
    ) -> tuple[dict[str, Column], Segment]:
        """Write the live cells into a new segment of ours (the copy is the write)."""
        assert self.prefix is not None
        bodies: list[list[memoryview]] = []
        for batch, values in plan.values():
            if batch:
                bodies.append([v.data for v in values])
            else:
                bodies.extend([v.data] for v in values if isinstance(v, RawTensor))
        name = f"{self.prefix}k{next(self._own)}"
        offsets = iter(_shm.write_segment(name, bodies))
        segment = self._take(name)
        columns: dict[str, Column] = {}
        for c, (batch, values) in plan.items():
            if batch:
                first = values[0]
                offset = next(offsets)
                body = ShmBody(offset, first.dtype, (len(values), *first.shape))
                columns[c] = Column(segment.body(body), [offset])
                continue
            rows, where = [], []
            for v in values:
                if isinstance(v, RawTensor):
                    offset = next(offsets)
                    rows.append(segment.body(ShmBody(offset, v.dtype, tuple(v.shape))))
                    where.append(offset)
                else:
                    rows.append(v)
                    where.append(-1)
            columns[c] = Column(rows, where)
        return columns, segment

    def close(self) -> None:
        """Unlink every segment (the unit is stopping: its data goes with it)."""
        for segment in list(self.segments.values()):
            self._unlink(segment)

    # -- inventory and statistics ---------------------------------------------------------------

    def inventory(self, incarnation: str) -> UnitInventory:
        samples: dict[str, list[UnitSample]] = {}
        groups: dict[str, list[UnitGroup]] = {}
        for topic in set(self.samples) | set(self.blobs) | set(self.groups):
            rows = self.samples.get(topic, {})
            samples[topic] = [
                UnitSample(
                    index,
                    s.version,
                    s.group_id,
                    s.length,
                    {c: b.columns[c].cell_nbytes(r) for c, (b, r) in s.cells.items()},
                    sorted(s.consumed),
                    s.committed,
                )
                for index, s in sorted(rows.items())
            ]
            explicit = self.groups.get(topic, {})
            blobs = self.blobs.get(topic, {})
            out = [
                UnitGroup(gid, size, committed, _sizes(blobs.get(gid, {})), True)
                for gid, (size, committed) in sorted(explicit.items())
            ]
            implicit: dict[int, int] = {}  # samples of no explicit group: groups of one
            for s in rows.values():
                if s.group_id not in explicit:
                    implicit[s.group_id] = int(s.committed)
            out += [
                UnitGroup(gid, 1, committed, _sizes(blobs.get(gid, {})), False)
                for gid, committed in sorted(implicit.items())
            ]
            groups[topic] = out
        return UnitInventory(
            self.name, incarnation, list(self.topic_info.values()), samples, groups
        )


def _copy(value: Any) -> Any:
    """A copy of a row value that holds no reference to the buffer it came from."""
    if isinstance(value, RawTensor):
        return RawTensor(value.dtype, value.shape, memoryview(bytes(value.data)))
    return value.clone() if is_tensor(value) else value


def _bodies(parts: list[Any]) -> list[ShmBody]:
    out = []
    for part in parts:
        if isinstance(part, ShmBody):
            out.append(part)
        elif isinstance(part, list):
            out.extend(p for p in part if isinstance(p, ShmBody))
    return out


def _sizes(blobs: dict[str, Any]) -> dict[str, int]:
    return {column: nbytes(value) for column, value in blobs.items()}
