"""The TransferQueue client: metadata to the controller, tensor bodies straight to the units.

A ``TransferQueueClient`` is a plain object (not an actor) that any task may use. ``put`` asks
the controller for indexes and placement, sends each unit its slice of the batch (views, not
copies: a contiguous batch goes out zero-copy) and commits; ``get`` claims a lease and fetches
every unit's part in parallel; ``ack``/``nack`` end the lease. A cancelled ``get`` loses
nothing: the claim is withdrawn, or the lease it won is returned at once.
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import AsyncIterator, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import trio

from ..actors import ActorCrashed, ActorRef
from ..actors.remote import RawTensor
from . import _messages as M
from . import _storage as S
from ._errors import SchemaError, TransferQueueError, UnknownColumn
from ._results import GroupSlot, Lease
from ._samplers import FIFO, Sampler
from ._spec import TopicSpec

if TYPE_CHECKING:
    pass


def _is_tensor(value: Any) -> bool:
    # torch loads lazily: a node hosting storage units imports this package without it
    module = sys.modules.get("torch")
    return module is not None and isinstance(value, module.Tensor)


class StorageUnavailable(TransferQueueError):
    """A storage unit did not take or return data (it crashed or its node is down).

    A failed ``put`` stored nothing (its indexes were discarded): put again. A failed ``get``
    returned its lease.
    """


@attrs.frozen
class Batch:
    """What ``get`` returns: the lease, and the data in the lease's sample order.

    ``data`` maps each per-sample column to a tensor ``[n, ...]`` (a fixed-shape column) or a
    list of ``n`` values (variable-length tensors, text). ``shared`` maps each group-shared
    column to ``{group_id: value}``: sent once per group; ``expand(column)`` repeats it per sample.
    """

    lease: Lease
    data: dict[str, Any]
    shared: dict[str, dict[int, Any]]

    @property
    def indexes(self) -> tuple[int, ...]:
        return self.lease.indexes

    @property
    def versions(self) -> tuple[int, ...]:
        return self.lease.versions

    @property
    def group_ids(self) -> tuple[int, ...]:
        return self.lease.group_ids

    def __len__(self) -> int:
        return len(self.lease.indexes)

    def __getitem__(self, column: str) -> Any:
        return self.data[column]

    def partition(self, rank: int) -> dict[str, Any]:
        """The per-sample columns of data-parallel ``rank``'s share (``Balanced`` sampler:
        ``lease.partitions[rank]``), rows in that partition's order. Ack the batch once."""
        wanted = self.lease.partitions[rank]
        where = {index: k for k, index in enumerate(self.lease.indexes)}
        positions = [where[i] for i in wanted]
        return {name: _take(value, positions) for name, value in self.data.items()}

    def expand(self, column: str) -> list[Any]:
        """A shared column repeated for each sample of the batch, in sample order."""
        by_group = self.shared[column]
        return [by_group[g] for g in self.lease.group_ids]


def _materialize(value: Any) -> Any:
    """Tensors for what a unit in this process returns: rows a remote writer sent it are kept
    as ``RawTensor``s (units never import torch); a local reader gets no wire decoding."""
    if isinstance(value, RawTensor):
        return value.to_torch()
    if isinstance(value, list):
        return [_materialize(v) for v in value]
    return value


def _rows(value: Any) -> int:
    return int(value.shape[0]) if _is_tensor(value) and value.dim() > 0 else len(value)


def _row_nbytes(value: Any) -> list[int]:
    if _is_tensor(value):
        per_row = value[0].numel() * value.element_size() if value.shape[0] else 0
        return [int(per_row)] * int(value.shape[0])
    return [_nbytes(v) for v in value]


def _nbytes(value: Any) -> int:
    if _is_tensor(value):
        return int(value.numel() * value.element_size())
    if isinstance(value, (bytes, str)):
        return len(value)
    return 8


def _take(value: Any, positions: Sequence[int]) -> Any:
    """Rows ``positions`` of a batch column: a view for a contiguous run, else a gather."""
    first = positions[0]
    if list(positions) == list(range(first, first + len(positions))):
        return value[first : first + len(positions)]
    if _is_tensor(value):
        import torch

        return value.index_select(0, torch.tensor(positions, dtype=torch.long))
    return [value[p] for p in positions]


_request_ids = itertools.count(((os.getpid() & 0xFFFF) << 40) + 1)


class TransferQueueClient:
    """A client of one TransferQueue (see the module docstring). ``holder`` names this client in
    leases; ``aclose`` returns every lease it still holds."""

    def __init__(self, controller: ActorRef[Any], topology: M.Topology, *, holder: str) -> None:
        self.controller = controller
        self.specs = dict(topology.specs)
        self.units = dict(topology.units)
        self.holder = holder

    @classmethod
    async def connect(cls, controller: ActorRef[Any], *, holder: str) -> TransferQueueClient:
        topology = await controller.ask(M.GetTopology())
        return cls(controller, topology, holder=holder)

    def _spec(self, topic: str) -> TopicSpec:
        spec = self.specs.get(topic)
        if spec is None:
            raise TransferQueueError(f"unknown topic {topic!r} (known: {sorted(self.specs)})")
        return spec

    def _check(self, spec: TopicSpec, data: Mapping[str, Any], *, shared: bool) -> int:
        if not data:
            raise SchemaError("no columns given")
        n: int | None = None
        for name, value in data.items():
            col = spec.column(name)  # UnknownColumn
            if col.shared != shared:
                kind = "group-shared" if col.shared else "per-sample"
                raise SchemaError(
                    f"column {name!r} of topic {spec.name!r} is {kind}: "
                    + ("write it with open_group(shared=...)" if col.shared else "use put()")
                )
            if shared:
                rows = [value]
            elif _is_tensor(value):
                if value.dim() == 0:
                    raise SchemaError(f"column {name!r}: a batch needs a leading dimension")
                rows = [value[0]] if value.shape[0] else []
            else:
                rows = list(value)
            for row in rows:
                if _is_tensor(row):
                    spec.check_column(name, str(row.dtype).removeprefix("torch."), tuple(row.shape))
                elif col.dtype is not None:
                    raise SchemaError(
                        f"column {name!r} holds {col.dtype} tensors, got {type(row).__name__}"
                    )
            count = 1 if shared else _rows(value)
            if n is not None and count != n:
                raise SchemaError(
                    f"columns disagree on the number of samples: {n} and {count} ({name!r})"
                )
            n = count
        assert n is not None
        return n

    # -- writing ---------------------------------------------------------------------------------

    async def put(
        self,
        topic: str,
        data: Mapping[str, Any],
        *,
        version: int,
        group: int | GroupSlot | None = None,
        lengths: Sequence[int] | None = None,
    ) -> tuple[int, ...]:
        """Store a batch of new samples written by policy ``version``; returns their indexes.

        ``data`` maps per-sample columns to a tensor ``[n, ...]`` or a list of ``n`` values. With
        ``group`` the samples join that open group. Waits while the topic is at capacity.
        Raises ``SchemaError``/``UnknownColumn`` (nothing stored), ``StaleVersionError``,
        ``StorageUnavailable``.
        """
        n = self._check(self._spec(topic), data, shared=False)
        gid = group.group_id if isinstance(group, GroupSlot) else group
        lens = tuple(int(x) for x in lengths) if lengths is not None else None
        put_id = next(_request_ids)
        try:
            allocation = await self.controller.ask(M.Allocate(topic, n, version, gid, lens, put_id))
        except trio.Cancelled:
            self._withdraw(M.CancelPut(put_id))  # waiting for capacity, or allocated meanwhile
            raise
        try:
            await self._store(
                topic,
                allocation.indexes,
                allocation.units,
                [version] * n,
                list(allocation.group_ids),
                list(lens) if lens is not None else [1] * n,
                data,
                put_id=put_id,
            )
        except BaseException:
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await self.controller.ask(M.Discard(topic, allocation.indexes, put_id))
            raise
        return allocation.indexes

    def _withdraw(self, msg: M.CancelPut | M.CancelClaim) -> None:
        try:
            self.controller.send_nowait(msg)
        except (trio.WouldBlock, ActorCrashed):
            pass  # the controller is swamped or gone: leases expire, a restart forgets puts

    async def put_columns(self, batch: Batch | Lease, data: Mapping[str, Any]) -> None:
        """Write computed columns (old_logprob, advantages...) for a leased batch's samples.

        Rows of ``data`` follow the batch's sample order.
        """
        lease = batch.lease if isinstance(batch, Batch) else batch
        n = self._check(self._spec(lease.topic), data, shared=False)
        if n != len(lease.indexes):
            raise SchemaError(f"{n} rows for a lease of {len(lease.indexes)} samples")
        units = [self._unit_of(lease, i) for i in lease.indexes]
        await self._store(
            lease.topic,
            lease.indexes,
            units,
            list(lease.versions),
            list(lease.group_ids),
            [0] * n,
            data,
        )

    def _unit_of(self, lease: Lease, index: int) -> str:
        for unit, indexes in lease.placement.items():
            if index in indexes:
                return unit
        raise TransferQueueError(f"index {index} is not placed in lease {lease.id}")

    async def _store(
        self,
        topic: str,
        indexes: Sequence[int],
        units: Sequence[str],
        versions: list[int],
        group_ids: list[int],
        lengths: list[int],
        data: Mapping[str, Any],
        put_id: int = 0,
    ) -> None:
        by_unit: dict[str, list[int]] = {}
        for position, unit in enumerate(units):
            by_unit.setdefault(unit, []).append(position)

        async def store(unit: str, positions: list[int]) -> None:
            msg = S.Store(
                topic,
                [indexes[p] for p in positions],
                [versions[p] for p in positions],
                [group_ids[p] for p in positions],
                [lengths[p] for p in positions],
                {name: _take(value, positions) for name, value in data.items()},
            )
            await self._unit_ask(unit, msg)

        stored: list[str] = []
        try:
            if len(by_unit) == 1:  # the common small put: no nursery, no task
                ((unit, positions),) = by_unit.items()
                await store(unit, positions)
                stored.append(unit)
            else:
                async with trio.open_nursery() as nursery:
                    for unit, positions in by_unit.items():

                        async def one(unit: str = unit, positions: list[int] = positions) -> None:
                            await store(unit, positions)
                            stored.append(unit)

                        nursery.start_soon(one)
        except BaseException:
            self._forget(topic, indexes, by_unit, stored)
            raise
        sizes = {name: _row_nbytes(v) for name, v in data.items()}
        try:
            await self.controller.ask(M.Commit(topic, tuple(indexes), sizes, put_id))
        except BaseException:
            self._forget(topic, indexes, by_unit, stored)
            raise

    def _forget(
        self, topic: str, indexes: Sequence[int], by_unit: dict[str, list[int]], stored: list[str]
    ) -> None:
        """Delete what a failed put left on units, so no data outlives its sample's record."""
        for unit in stored:
            try:
                self.units[unit].send_nowait(
                    S.Delete(topic, [indexes[p] for p in by_unit[unit]], [])
                )
            except (trio.WouldBlock, ActorCrashed):
                pass

    async def _unit_ask(self, unit: str, msg: Any) -> Any:
        try:
            return await self.units[unit].ask(msg)
        except ActorCrashed as exc:
            self.controller.send_nowait(M.CheckUnits())
            raise StorageUnavailable(f"storage unit {unit!r} failed: {exc}") from exc

    async def open_group(
        self, topic: str, size: int, shared: Mapping[str, Any] | None = None
    ) -> GroupSlot:
        """Open a group of ``size`` members (one prompt, ``size`` responses), storing its
        group-shared columns once. Waits while the topic is at capacity."""
        spec = self._spec(topic)
        if shared:
            self._check(spec, shared, shared=True)
        slot: GroupSlot = await self.controller.ask(M.OpenGroup(topic, size))
        if shared:
            await self._unit_ask(slot.unit, S.StoreShared(topic, slot.group_id, dict(shared)))
            sizes = {name: _nbytes(value) for name, value in shared.items()}
            await self.controller.ask(M.CommitShared(topic, slot.group_id, sizes))
        return slot

    async def shrink_group(self, topic: str, group: int | GroupSlot, slots: int) -> None:
        gid = group.group_id if isinstance(group, GroupSlot) else group
        await self.controller.ask(M.ShrinkGroup(topic, gid, slots))

    async def discard(self, topic: str, indexes: Sequence[int]) -> None:
        await self.controller.ask(M.Discard(topic, tuple(indexes)))

    async def set_version(self, topic: str, version: int) -> None:
        """Publish the latest policy version; samples that fall out of the window are evicted."""
        await self.controller.ask(M.SetVersion(topic, version))

    # -- reading -----------------------------------------------------------------------------------

    async def get(
        self,
        topic: str,
        consumer: str,
        columns: Sequence[str],
        count: int,
        *,
        sampler: Sampler = FIFO,
        min_count: int | None = None,
        share_key: Hashable | None = None,
        share_count: int = 1,
        wait: bool = True,
    ) -> Batch | None:
        """Lease and fetch ``count`` samples ready for ``columns``, unconsumed by ``consumer``,
        fresh. Waits until enough qualify (``wait=False``: returns ``None`` instead); bound the
        wait with ``trio.fail_after``. The batch must be ``ack``ed (or ``nack``ed)."""
        spec = self._spec(topic)
        for name in columns:
            if name not in spec.columns:
                raise UnknownColumn(f"topic {topic!r} has no column {name!r}")
        claim_id = next(_request_ids)
        claim = M.Claim(
            topic, consumer, tuple(columns), count, self.holder, claim_id, sampler,
            min_count, share_key, share_count, wait,
        )  # fmt: skip
        try:
            lease: Lease | None = await self.controller.ask(claim)
        except trio.Cancelled:
            self._withdraw(M.CancelClaim(claim_id))  # or return the lease it won meanwhile
            raise
        if lease is None:
            return None
        try:
            return await self._fetch(spec, lease, columns)
        except BaseException:
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await self.controller.ask(M.Nack(lease.id))
            raise

    async def _fetch(self, spec: TopicSpec, lease: Lease, columns: Sequence[str]) -> Batch:
        import torch

        per_sample = [c for c in columns if not spec.columns[c].shared]
        shared_cols = [c for c in columns if spec.columns[c].shared]
        order = sorted(lease.placement, key=lambda u: min(lease.placement[u], default=0))
        fetched: dict[str, S.Fetched] = {}

        async def fetch(unit: str) -> None:
            groups = list(lease.shared.get(unit, ())) if shared_cols else []
            msg = S.Fetch(lease.topic, list(lease.placement[unit]), per_sample, groups, shared_cols)
            fetched[unit] = await self._unit_ask(unit, msg)

        if len(order) == 1:
            await fetch(order[0])
        else:
            async with trio.open_nursery() as nursery:
                for unit in order:
                    nursery.start_soon(fetch, unit)
        data: dict[str, Any] = {}
        arrived = [i for u in order for i in lease.placement[u]]
        perm = None
        if arrived != list(lease.indexes):
            where = {index: k for k, index in enumerate(arrived)}
            perm = [where[i] for i in lease.indexes]
        for column in per_sample:
            parts = [_materialize(fetched[u].columns[column]) for u in order]
            if all(isinstance(p, torch.Tensor) for p in parts):
                value: Any = parts[0] if len(parts) == 1 else torch.cat(parts)
                if perm is not None:
                    value = value.index_select(0, torch.tensor(perm, dtype=torch.long))
            else:
                flat = [v for p in parts for v in (p if isinstance(p, list) else list(p))]
                value = flat if perm is None else [flat[k] for k in perm]
            data[column] = value
        shared: dict[str, dict[int, Any]] = {c: {} for c in shared_cols}
        for unit in order:
            for gid, blobs in fetched[unit].shared.items():
                for column, value in blobs.items():
                    shared[column][gid] = _materialize(value)
        return Batch(lease, data, shared)

    async def ack(self, batch: Batch | Lease) -> tuple[int, ...]:
        """Complete the lease; returns indexes that had gone missing meanwhile (lost, discarded)."""
        lease = batch.lease if isinstance(batch, Batch) else batch
        missing: tuple[int, ...] = await self.controller.ask(M.Ack(lease.id, self.holder))
        return missing

    async def nack(self, batch: Batch | Lease) -> None:
        """Give the samples back to the pool now (for this consumer)."""
        lease = batch.lease if isinstance(batch, Batch) else batch
        await self.controller.ask(M.Nack(lease.id))

    async def renew(self, batch: Batch | Lease) -> Lease:
        lease = batch.lease if isinstance(batch, Batch) else batch
        renewed: Lease = await self.controller.ask(M.Renew(lease.id))
        return renewed

    async def stream(
        self, topic: str, consumer: str, columns: Sequence[str], count: int, **options: Any
    ) -> AsyncIterator[Batch]:
        """``get`` forever: ``async for batch in client.stream(...)`` (ack each batch)."""
        while True:
            batch = await self.get(topic, consumer, columns, count, **options)
            if batch is not None:
                yield batch

    # -- watching ------------------------------------------------------------------------------------

    async def events(self, since: int = 0) -> M.EventBatch:
        """Evictions and losses after ``since`` (waits for one); re-inject lost prompts."""
        batch: M.EventBatch = await self.controller.ask(M.WaitEvents(since))
        return batch

    async def statistics(self) -> TransferQueueStatistics:
        controller = await self.controller.ask(M.GetControllerStatistics())
        units: dict[str, S.StorageStatistics | None] = {}
        for unit, ref in self.units.items():
            try:
                with trio.move_on_after(5):
                    units[unit] = await ref.ask(S.GetStorageStatistics())
            except ActorCrashed:
                units[unit] = None
        return TransferQueueStatistics(controller, units)

    async def aclose(self) -> None:
        """Return every lease this client holds."""
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            await self.controller.ask(M.ReleaseHolder(self.holder))


@attrs.frozen
class TransferQueueStatistics:
    """The controller's view (samples per state, leases, events) and each unit's bytes."""

    controller: M.ControllerStatistics
    units: dict[str, S.StorageStatistics | None]
