"""Storage units: the TransferQueue's data plane shards.

A ``StorageUnit`` is an actor that holds sample data by (topic, index, column) and group-shared
data by (topic, group, column). It never looks inside tensors: it decodes them as ``RawTensor``
(bytes, dtype, shape) and sends the same bytes back, so a unit in a node process neither imports
torch nor copies a tensor it received, and a fetch of rows that were put together returns a view
of the frame they arrived in. Which unit holds what is the controller's decision; a unit only
keeps the per-sample metadata it needs to report its inventory after a controller restart.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import attrs

from ..actors import Actor, ActorContext, Request
from ..actors.remote import RawTensor
from ._errors import TransferQueueError


@attrs.frozen
class Store(Request[list[int]]):
    """Store samples ``indexes`` of ``topic``; replies with the bytes stored per index.

    ``columns`` maps a column to a batch ``RawTensor`` whose first dimension runs over
    ``indexes``, or to a list with one value per index (variable-length tensors, text...).
    ``versions``, ``group_ids`` and ``lengths`` describe new samples (for the inventory).
    """

    topic: str
    indexes: list[int]
    versions: list[int]
    group_ids: list[int]
    lengths: list[int]
    columns: dict[str, Any]


@attrs.frozen
class StoreShared(Request[int]):
    """Store the group-shared columns of one group (stored once for all its members)."""

    topic: str
    group_id: int
    columns: dict[str, Any]


@attrs.frozen
class Fetched:
    """Reply of ``Fetch``: per column a batch (rows in request order) or a list of values."""

    columns: dict[str, Any]
    shared: dict[int, dict[str, Any]]


@attrs.frozen
class Fetch(Request[Fetched]):
    topic: str
    indexes: list[int]
    columns: list[str]
    shared_groups: list[int]
    shared_columns: list[str]


@attrs.frozen
class Delete:
    """Forget samples and group blobs (the controller freed them)."""

    topic: str
    indexes: list[int]
    group_ids: list[int]


@attrs.frozen
class MarkConsumed:
    """Record that ``consumer`` acked ``indexes`` (kept only for the inventory)."""

    topic: str
    consumer: str
    indexes: list[int]


@attrs.frozen
class TopicInfo:
    """A topic's latest version and id watermarks, as the controller last told this unit."""

    topic: str
    latest_version: int
    next_index: int
    next_group_id: int


@attrs.frozen
class GroupDelta:
    """An explicit group's record changed: ``size`` and ``allocated`` move by these deltas."""

    topic: str
    group_id: int
    size: int
    allocated: int


@attrs.frozen
class Records:
    """Inventory bookkeeping forwarded by the controller (see ``transfer_queue._inventory``)."""

    topics: list[TopicInfo]
    groups: list[GroupDelta]


@attrs.frozen
class UnitBatch:
    """The controller's bookkeeping for one unit, coalesced: applied in order."""

    items: list[Delete | MarkConsumed | Records]


@attrs.frozen
class UnitSample:
    """One sample as a unit reports it in its inventory."""

    index: int
    version: int
    group_id: int
    length: int
    columns: dict[str, int]  # bytes per column
    consumed: list[str]


@attrs.frozen
class UnitGroup:
    group_id: int
    size: int
    allocated: int
    shared: dict[str, int]  # bytes per shared column


@attrs.frozen
class UnitInventory:
    unit: str
    topics: list[TopicInfo]
    samples: dict[str, list[UnitSample]]  # per topic
    groups: dict[str, list[UnitGroup]]  # per topic


@attrs.frozen
class GetInventory(Request[UnitInventory]):
    pass


@attrs.frozen
class StorageStatistics:
    unit: str
    samples: int
    groups: int
    nbytes: int
    shared_nbytes: int
    stores: int
    fetches: int
    zero_copy_fetches: int


@attrs.frozen
class GetStorageStatistics(Request[StorageStatistics]):
    pass


@attrs.frozen
class GetToken(Request[str]):
    """The unit's incarnation token: a new one means its data is gone (it restarted)."""


StorageMessage = (
    Store
    | StoreShared
    | Fetch
    | Delete
    | MarkConsumed
    | Records
    | UnitBatch
    | GetInventory
    | GetStorageStatistics
    | GetToken
)


class _Block:
    """The columns of one ``Store``: batch values (rows are samples) or per-sample lists.

    Samples point at (block, row) instead of holding a value per column, so a put of n samples
    costs n small records, and a fetch of rows stored together is one slice per column.
    """

    __slots__ = ("columns", "live", "row_nbytes")

    def __init__(self, columns: dict[str, Any], rows: int) -> None:
        self.columns = columns
        self.live = rows  # rows some sample still points at
        self.row_nbytes = {
            c: (_nbytes(v) // rows if rows else 0) if _is_batch(v) else -1
            for c, v in columns.items()
        }

    def value(self, column: str, row: int) -> Any:
        v = self.columns[column]
        return _rows(v, row, row + 1) if _is_batch(v) else v[row]

    def nbytes(self, column: str, row: int) -> int:
        size = self.row_nbytes[column]
        return size if size >= 0 else _nbytes(self.columns[column][row])


@attrs.define(eq=False, slots=True)
class _Sample:
    version: int
    group_id: int
    length: int
    parts: list[tuple[_Block, int]] = attrs.Factory(list)  # newest last: it wins per column
    consumed: set[str] = attrs.Factory(set)

    def locate(self, column: str) -> tuple[_Block, int] | None:
        for block, row in reversed(self.parts):
            if column in block.columns:
                return block, row
        return None

    def columns(self) -> dict[str, int]:
        sizes: dict[str, int] = {}
        for block, row in self.parts:
            for column in block.columns:
                sizes[column] = block.nbytes(column, row)
        return sizes

    @property
    def nbytes(self) -> int:
        return sum(self.columns().values())


def _torch_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _is_batch(value: Any) -> bool:
    """A batch column value: its first dimension runs over the samples."""
    return isinstance(value, RawTensor) or (_torch_tensor(value) and value.dim() > 0)


def _rows(batch: Any, start: int, stop: int) -> Any:
    return batch.rows(start, stop) if isinstance(batch, RawTensor) else batch[start:stop]


def _concat(rows: list[Any]) -> Any:
    if isinstance(rows[0], RawTensor):
        return RawTensor.concat_rows(rows)
    return sys.modules["torch"].cat(rows)


def _nbytes(value: Any) -> int:
    if isinstance(value, RawTensor):
        return value.nbytes
    if _torch_tensor(value):
        return int(value.numel() * value.element_size())
    if isinstance(value, (bytes, str)):
        return len(value)
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 8


class StorageUnit(Actor[StorageMessage]):
    """A data plane shard (see the module docstring). Spawn it locally or on a node."""

    raw_tensors = True  # a node decodes this actor's messages as RawTensor: no torch needed
    mailbox_size = 256

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.token = os.urandom(8).hex()
        self.topics: dict[str, dict[int, _Sample]] = {}
        self.shared: dict[str, dict[int, dict[str, Any]]] = {}
        self.topic_info: dict[str, TopicInfo] = {}
        self.groups: dict[str, dict[int, list[int]]] = {}  # explicit groups: [size, allocated]
        self.nbytes = 0
        self.shared_nbytes = 0
        self.stores = 0
        self.fetches = 0
        self.zero_copy = 0

    async def receive(self, msg: StorageMessage, ctx: ActorContext[StorageMessage]) -> Any:
        if isinstance(msg, Fetch):
            try:
                return self._fetch(msg)
            except KeyError as exc:  # bad request: answer it, do not crash
                ctx.reply_error(TransferQueueError(str(exc.args[0])))
                return None
        if isinstance(msg, Store):
            return self._store(msg, ctx)
        if isinstance(msg, StoreShared):
            blobs = self.shared.setdefault(msg.topic, {}).setdefault(msg.group_id, {})
            added = 0
            for column, value in msg.columns.items():
                added += _nbytes(value) - _nbytes(blobs.get(column))
                blobs[column] = value
            self.shared_nbytes += added
            return added
        if isinstance(msg, UnitBatch):
            for item in msg.items:
                self._bookkeeping(item)
        elif isinstance(msg, (Delete, MarkConsumed, Records)):
            self._bookkeeping(msg)
        elif isinstance(msg, GetToken):
            return self.token
        elif isinstance(msg, GetInventory):
            return self._inventory()
        elif isinstance(msg, GetStorageStatistics):
            return StorageStatistics(
                self.name,
                sum(len(t) for t in self.topics.values()),
                sum(len(g) for g in self.shared.values()),
                self.nbytes,
                self.shared_nbytes,
                self.stores,
                self.fetches,
                self.zero_copy,
            )
        return None

    def _bookkeeping(self, msg: Delete | MarkConsumed | Records) -> None:
        if isinstance(msg, Delete):
            self._delete(msg)
        elif isinstance(msg, MarkConsumed):
            samples = self.topics.get(msg.topic, {})
            for index in msg.indexes:
                sample = samples.get(index)
                if sample is not None:
                    sample.consumed.add(msg.consumer)
        else:
            for info in msg.topics:
                self.topic_info[info.topic] = info
            for delta in msg.groups:
                groups = self.groups.setdefault(delta.topic, {})
                record = groups.get(delta.group_id)
                if record is None:
                    if delta.allocated != 0 or delta.size <= 0:
                        continue  # a delta of an implicit group (a sample of its own): no record
                    record = groups[delta.group_id] = [0, 0]  # open_group creates the record
                record[0] += delta.size
                record[1] += delta.allocated

    def _store(self, msg: Store, ctx: ActorContext[StorageMessage]) -> list[int]:
        n = len(msg.indexes)
        if not len(msg.versions) == len(msg.group_ids) == len(msg.lengths) == n:
            ctx.reply_error(ValueError("Store: indexes, versions, group_ids, lengths differ"))
            return []
        for column, value in msg.columns.items():
            rows = value.shape[0] if _is_batch(value) else len(value)
            if rows != n:
                ctx.reply_error(
                    ValueError(f"Store: column {column!r} has {rows} rows for {n} indexes")
                )
                return []
        block = _Block(dict(msg.columns), n)
        samples = self.topics.setdefault(msg.topic, {})
        sizes = [sum(block.nbytes(c, i) for c in block.columns) for i in range(n)]
        added = 0
        for i, index in enumerate(msg.indexes):
            sample = samples.get(index)
            if sample is None:
                sample = _Sample(msg.versions[i], msg.group_ids[i], msg.lengths[i])
                samples[index] = sample
                sample.parts.append((block, i))
                added += sizes[i]
            else:  # new columns for a stored sample (or rewritten ones: the newest part wins)
                before = sample.nbytes
                sample.parts.append((block, i))
                added += sample.nbytes - before
        self.nbytes += added
        self.stores += 1
        return sizes

    def _fetch(self, msg: Fetch) -> Fetched:
        samples = self.topics.get(msg.topic, {})
        try:
            rows = [samples[i] for i in msg.indexes]
        except KeyError:
            missing = [i for i in msg.indexes if i not in samples]
            raise KeyError(
                f"unit {self.name!r} holds no samples {missing[:8]} of {msg.topic!r}"
            ) from None
        columns: dict[str, Any] = {}
        for column in msg.columns:
            cells = [s.locate(column) for s in rows]
            if any(c is None for c in cells):
                absent = [i for i, c in zip(msg.indexes, cells, strict=True) if c is None]
                raise KeyError(f"samples {absent[:8]} of {msg.topic!r} have no column {column!r}")
            columns[column] = self._gather(column, cells)  # type: ignore[arg-type]
        shared: dict[int, dict[str, Any]] = {}
        blobs = self.shared.get(msg.topic, {})
        for group in msg.shared_groups:
            have = blobs.get(group, {})
            shared[group] = {c: have[c] for c in msg.shared_columns if c in have}
        self.fetches += 1
        return Fetched(columns, shared)

    def _gather(self, column: str, cells: Sequence[tuple[_Block, int]]) -> Any:
        block, start = cells[0]
        value = block.columns[column]
        if not _is_batch(value):
            return [b.columns[column][r] for b, r in cells]
        if all(b is block and r == start + k for k, (b, r) in enumerate(cells)):
            self.zero_copy += 1
            return _rows(value, start, start + len(cells))  # a view of the frame it came in
        parts = [b.value(column, r) for b, r in cells]
        shape = tuple(parts[0].shape[1:])
        if all(p.dtype == parts[0].dtype and tuple(p.shape[1:]) == shape for p in parts):
            return _concat(parts)
        return parts

    def _delete(self, msg: Delete) -> None:
        samples = self.topics.get(msg.topic, {})
        for index in msg.indexes:
            sample = samples.pop(index, None)
            if sample is not None:
                self.nbytes -= sample.nbytes
                for block, _ in sample.parts:
                    block.live -= 1  # a block is freed with the last sample pointing at it
        blobs = self.shared.get(msg.topic, {})
        explicit = self.groups.get(msg.topic, {})
        for group in msg.group_ids:  # the group is gone: its blob and its record
            explicit.pop(group, None)
            removed = blobs.pop(group, None)
            if removed is not None:
                self.shared_nbytes -= sum(_nbytes(v) for v in removed.values())

    def _inventory(self) -> UnitInventory:
        samples: dict[str, list[UnitSample]] = {}
        groups: dict[str, list[UnitGroup]] = {}
        for topic in set(self.topics) | set(self.shared) | set(self.groups):
            rows = self.topics.get(topic, {})
            samples[topic] = [
                UnitSample(index, s.version, s.group_id, s.length, s.columns(), sorted(s.consumed))
                for index, s in sorted(rows.items())
            ]
            explicit = self.groups.get(topic, {})
            blobs = self.shared.get(topic, {})
            out = [
                UnitGroup(gid, size, allocated, _sizes(blobs.get(gid, {})))
                for gid, (size, allocated) in sorted(explicit.items())
                if size > 0 or gid in blobs
            ]
            # samples of no explicit group form implicit groups of one
            implicit = sorted({s.group_id for s in rows.values()} - set(explicit))
            out += [UnitGroup(gid, 1, 1, _sizes(blobs.get(gid, {}))) for gid in implicit]
            groups[topic] = out
        return UnitInventory(self.name, list(self.topic_info.values()), samples, groups)


def _sizes(blobs: dict[str, Any]) -> dict[str, int]:
    return {column: _nbytes(value) for column, value in blobs.items()}
