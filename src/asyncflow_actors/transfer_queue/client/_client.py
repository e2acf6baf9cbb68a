"""The TransferQueue client: metadata to the controller, tensor bodies straight to the units.

A ``TransferQueueClient`` is a plain object (not an actor) that any task may use. ``put`` asks
the controller for indexes and placement, sends each unit its slice of the batch (views, not
copies: a contiguous batch goes out zero-copy, or through shared memory to a unit on this host)
and commits; ``get`` claims a lease and fetches every unit's part in parallel; ``ack``/``nack``
end the lease. A cancelled ``get`` loses nothing: the claim is withdrawn, or the lease it won is
returned at once.

The client rides out controller restarts: a request interrupted by one is sent again, and the
requests that are not idempotent (commits, acks, group shrinks) carry an id, so the retry gets
what the first try got. A put whose allocation the restarted controller no longer knows is put
again. Failures of storage units surface as :class:`StorageUnavailable`.
"""

from __future__ import annotations

import itertools
import logging
import operator
import os
import re
from collections.abc import AsyncIterator, Hashable, Mapping, Sequence
from typing import Any

import attrs
import trio

from .. import _messages as M
from .. import _unit_messages as U
from .._errors import (
    ControllerUnavailable,
    GroupError,
    InvalidArgument,
    SchemaError,
    StaleVersionError,
    StorageUnavailable,
    TransferQueueError,
    UnknownColumn,
    UnknownGroup,
    UnknownSample,
)
from .._results import GroupSlot, Lease
from .._runtime import ActorCrashed, ActorRef, ActorState
from .._samplers import FIFO, Sampler
from .._spec import TopicSpec
from ._batch import Batch, assemble, materialize, prepare
from ._unit_io import UnitIO

CLEANUP_S = 5.0  # how long clean-ups (aclose, withdrawing a cancelled request) may wait
_RETRIES = 6  # tries of a controller request interrupted by restarts (backoff 10 ms doubling)
_PUT_TRIES = 3  # puts whose allocation a controller restart forgot, put again

log = logging.getLogger("asyncflow_actors.transfer_queue")

_request_ids = itertools.count(((os.getpid() & 0xFFFF) << 40) + 1)
_client_ids = itertools.count(1)


class TransferQueueClient:
    """A client of one TransferQueue (see the module docstring). ``holder`` names this client in
    leases and writes (unique by default); ``aclose`` returns every lease it still holds, drops
    its uncommitted writes and gives up the unfilled slots of the groups it opened."""

    def __init__(
        self, controller: ActorRef[Any], topology: M.Topology, *, holder: str | None = None
    ) -> None:
        self.controller = controller
        self.specs = dict(topology.specs)
        self.units = dict(topology.units)
        self.holder = holder if holder is not None else f"client-{os.getpid()}-{next(_client_ids)}"
        self.io = UnitIO(
            topology.units,
            shm_min_bytes=topology.shm_min_bytes,
            timeout=topology.unit_timeout,
            on_failure=lambda: self._tell(M.CheckUnits()),
        )
        self.incarnations: dict[str, str] = {}  # the latest the controller told us
        self._restarts = 0  # controller requests that had to be retried

    @classmethod
    async def connect(
        cls, controller: ActorRef[Any], *, holder: str | None = None
    ) -> TransferQueueClient:
        topology = await controller.ask(M.GetTopology())
        return cls(controller, topology, holder=holder)

    def _spec(self, topic: str) -> TopicSpec:
        spec = self.specs.get(topic)
        if spec is None:
            raise TransferQueueError(f"unknown topic {topic!r} (known: {sorted(self.specs)})")
        return spec

    def _controller_gone(self) -> bool:
        """The controller terminated for good (no restart will answer): its leases, waits and
        uncommitted writes went with it."""
        return self.controller.statistics().state is ActorState.TERMINATED

    async def _ask(self, msg: Any) -> Any:
        """Ask the controller, again if a restart interrupted the request (not if it
        terminated for good: no restart will answer)."""
        delay = 0.01
        failure: ActorCrashed | None = None
        for _ in range(_RETRIES):
            try:
                return await self.controller.ask(msg)
            except ActorCrashed as exc:
                failure = exc
            if self._controller_gone():
                raise ControllerUnavailable(f"the controller is gone: {failure}") from failure
            self._restarts += 1
            await trio.sleep(delay)
            delay *= 2
        raise ControllerUnavailable(
            f"the controller did not answer {type(msg).__name__} in {_RETRIES} tries: {failure}"
        ) from failure

    def _tell(self, msg: Any) -> None:
        try:
            self.controller.send_nowait(msg)
        except (trio.WouldBlock, ActorCrashed):
            pass  # the controller is swamped or gone: leases expire, a restart forgets waits

    async def _waiting(self, msg: Any, cancel: Any) -> Any:
        """Ask for something that may wait; withdraw it (``cancel``) if this task is cancelled."""
        try:
            return await self._ask(msg)
        except trio.Cancelled:
            await self._withdraw(cancel)  # waiting, or answered meanwhile: the controller undoes it
            raise

    async def _withdraw(self, cancel: Any) -> None:
        """Deliver ``cancel`` (a ``CancelPut``/``CancelClaim``/``CancelWait``), waiting for room
        in a full mailbox (shielded, for at most ``CLEANUP_S``): dropped, it would leave a claim
        granted to nobody until ``lease_ttl``, or a put allocated for nobody until ``write_ttl``.
        """
        try:
            self.controller.send_nowait(cancel)
            return
        except ActorCrashed:
            return  # gone: a restarted controller forgets the requests that were waiting
        except trio.WouldBlock:
            pass
        with trio.CancelScope(shield=True), trio.move_on_after(CLEANUP_S):
            try:
                await self.controller.send(cancel)
            except ActorCrashed:
                pass
            return
        log.warning(
            "TransferQueue client %r: the controller's mailbox stayed full for %.0f s; %r was "
            "not delivered (a lease it won comes back at lease_ttl, an allocation at write_ttl)",
            self.holder,
            CLEANUP_S,
            cancel,
        )

    # -- writing ---------------------------------------------------------------------------------

    async def put(
        self,
        topic: str,
        data: Mapping[str, Any],
        *,
        version: int,
        group: int | GroupSlot | Sequence[int | GroupSlot] | None = None,
        lengths: Sequence[int] | None = None,
    ) -> tuple[int, ...]:
        """Store a batch of new samples written by policy ``version``; returns their indexes.

        ``data`` maps per-sample columns to a tensor ``[n, ...]`` or a list of ``n`` values (see
        ``Batch`` for how each reads back). With ``group`` the samples join that open group; a
        sequence of ``n`` groups (one per row) puts the rows of several open groups at once
        (one allocation, one store per unit, one commit: all rows or none). Waits while the
        topic is at capacity. Raises ``SchemaError``/``UnknownColumn``/``InvalidArgument``
        (nothing stored), ``StaleVersionError``, ``GroupError``/``UnknownGroup`` (a group is
        full or gone; ``exc.group_id`` names it, nothing stored), ``StorageUnavailable``
        (nothing stored: put again), ``ControllerUnavailable``.
        """
        prepared = prepare(self._spec(topic), data, shared=False)
        n = prepared.n
        gid = _group_ids(group, n)
        lens = tuple(int(x) for x in lengths) if lengths is not None else None
        for attempt in range(_PUT_TRIES):
            put_id = next(_request_ids)
            restarts = self._restarts
            alloc = M.Allocate(topic, n, version, gid, lens, put_id, self.holder)
            try:
                placed: M.Placed = await self._waiting(alloc, M.CancelPut(put_id))
            except TransferQueueError as exc:
                _name_group(exc)
                raise
            allocation = placed.allocation
            self.incarnations.update(placed.incarnations)
            self.io.hint(placed.incarnations, placed.free)
            positions: dict[str, list[int]] = {}
            for position, unit in enumerate(allocation.units):
                positions.setdefault(unit, []).append(position)
            try:
                stored = await self.io.store(
                    topic,
                    placed.incarnations,
                    positions,
                    allocation.indexes,
                    prepared.columns,
                    versions=[version] * n,
                    group_ids=allocation.group_ids,
                    lengths=lens if lens is not None else [1] * n,
                    tell=True,
                )
                located = {u: where for u, (where, _) in stored.items() if where is not None}
                told = {u: store for u, (_, store) in stored.items() if store is not None}
                commit = M.Commit(
                    topic, allocation.indexes, prepared.sizes, put_id, new=True,
                    located=located, stores=told,
                )  # fmt: skip
                segments = [store.segment for store in told.values()]
                try:
                    await self._ask(commit)
                except TransferQueueError as exc:
                    if not isinstance(exc, ControllerUnavailable):  # refused: nobody takes them
                        self.io.unlink(segments)
                    raise
                finally:  # held until now: never swept as a dead writer's (see ``_unit_io``)
                    self.io.release(segments)
                return allocation.indexes
            except UnknownSample as exc:
                await self._undo_put(topic, allocation.indexes, put_id, positions)
                if self._restarts == restarts or attempt == _PUT_TRIES - 1:
                    raise StorageUnavailable(
                        f"the samples of this put were dropped before it committed (their "
                        f"storage unit was lost, or they went stale): nothing stored ({exc})"
                    ) from exc
                # a restarted controller rebuilt without this allocation: put again
            except BaseException:
                await self._undo_put(topic, allocation.indexes, put_id, positions)
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def _undo_put(
        self,
        topic: str,
        indexes: Sequence[int],
        put_id: int,
        positions: Mapping[str, list[int]],
    ) -> None:
        """A put failed: drop its samples, giving their slots back to their open groups (the
        writer may put into them again), and delete what may have reached the units (the
        controller deletes what it knows of; a restarted one may not know these)."""
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            try:
                await self._ask(
                    M.Discard(topic, tuple(indexes), put_id, missing_ok=True, undo=True)
                )
            except TransferQueueError:
                pass  # the controller is gone: its restart never learned of these samples
        self.io.forget(topic, {u: [indexes[p] for p in where] for u, where in positions.items()})

    async def put_columns(self, batch: Batch | Lease, data: Mapping[str, Any]) -> None:
        """Write computed columns (old_logprob, advantages...) for a leased batch's samples.

        Rows of ``data`` follow the batch's sample order. Raises ``UnknownSample`` if samples
        of the lease are no longer live (discarded, evicted or lost since it was granted: what
        an ack reports as missing; nothing is committed: nack the lease and its live samples
        go out again), ``StorageUnavailable`` if a unit failed.
        """
        lease = batch.lease if isinstance(batch, Batch) else batch
        prepared = prepare(self._spec(lease.topic), data, shared=False)
        if prepared.n != len(lease.indexes):
            raise SchemaError(f"{prepared.n} rows for a lease of {len(lease.indexes)} samples")
        where = {index: k for k, index in enumerate(lease.indexes)}
        positions = {unit: [where[i] for i in indexes] for unit, indexes in lease.placement.items()}
        await self._ask(M.AwaitStores(tuple(positions)))  # the units heard of these samples
        await self.io.store(
            lease.topic,
            self.incarnations,
            positions,
            lease.indexes,
            prepared.columns,
            create=False,
        )
        await self._ask(M.Commit(lease.topic, lease.indexes, prepared.sizes, next(_request_ids)))

    async def open_group(
        self, topic: str, size: int, shared: Mapping[str, Any] | None = None
    ) -> GroupSlot:
        """Open a group of ``size`` members (one prompt, ``size`` responses), storing its
        group-shared columns once. Waits while the topic is at capacity. If storing the shared
        columns fails, the group is closed again and nothing stays behind. (``open_groups`` of
        one group: the same three requests.)"""
        (slot,) = await self.open_groups(topic, (size,), None if shared is None else (shared,))
        return slot

    async def open_groups(
        self,
        topic: str,
        sizes: Sequence[int],
        shared: Sequence[Mapping[str, Any]] | None = None,
    ) -> tuple[GroupSlot, ...]:
        """Open one group per entry of ``sizes`` (e.g. one per prompt), all or none, with
        ``shared[k]`` the group-shared columns of group ``k``: one controller request opens
        them, one request per storage unit stores their shared columns and one request commits
        those. Slots come back in the order of ``sizes``.

        Waits while the groups do not fit *together* in the topic's capacity (all-or-nothing
        admission, FIFO with the other puts). If anything fails or the call is cancelled, every
        group is closed again and no shared column stays behind. Raises ``CapacityError`` if
        ``sum(sizes)`` exceeds the capacity (it would wait forever), ``InvalidArgument``,
        ``SchemaError``/``UnknownColumn`` (nothing opened), ``StorageUnavailable``,
        ``ControllerUnavailable``.
        """
        spec = self._spec(topic)
        wanted = tuple(_size(size) for size in sizes)
        if not wanted:
            raise InvalidArgument("sizes must name at least one group")
        if shared is not None and len(shared) != len(wanted):
            raise InvalidArgument(f"{len(shared)} shared entries for {len(wanted)} groups")
        blobs = [prepare(spec, cols, shared=True) if cols else None for cols in shared or ()]
        put_id = next(_request_ids)
        opened: M.OpenedGroups = await self._waiting(
            M.OpenGroups(topic, wanted, put_id, self.holder), M.CancelPut(put_id)
        )
        slots = opened.slots
        self.incarnations.update(opened.incarnations)
        if not any(b is not None for b in blobs):
            return slots
        per_unit: dict[str, dict[int, dict[str, Any]]] = {}
        sizes_of: dict[int, dict[str, int]] = {}
        for slot, prepared in zip(slots, blobs, strict=True):
            if prepared is not None:
                per_unit.setdefault(slot.unit, {})[slot.group_id] = prepared.columns
                sizes_of[slot.group_id] = prepared.sizes  # type: ignore[assignment]
        try:
            await self.io.store_groups(topic, opened.incarnations, per_unit)
            await self._ask(M.CommitSharedGroups(topic, sizes_of))
        except BaseException:
            await self._close_groups(topic, slots)
            raise
        return slots

    async def _close_groups(self, topic: str, slots: Sequence[GroupSlot]) -> None:
        """Opening groups failed: give up every slot (no member yet: that frees each group and
        its shared blob), and delete what may have reached the units."""
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            for slot in slots:
                try:
                    await self._ask(
                        M.ShrinkGroup(topic, slot.group_id, slot.size, next(_request_ids))
                    )
                except TransferQueueError:
                    pass  # gone already (or the controller is: its restart never saw them)
        by_unit: dict[str, list[int]] = {}
        for slot in slots:
            by_unit.setdefault(slot.unit, []).append(slot.group_id)
        for unit, gids in by_unit.items():
            self.io.forget(topic, {unit: []}, gids)

    async def shrink_group(self, topic: str, group: int | GroupSlot, slots: int) -> None:
        gid = group.group_id if isinstance(group, GroupSlot) else group
        await self._ask(M.ShrinkGroup(topic, gid, slots, next(_request_ids)))

    async def discard(
        self, topic: str, indexes: Sequence[int], *, missing_ok: bool = False
    ) -> tuple[int, ...]:
        """Drop samples on purpose. ``missing_ok``: skip those no longer live (returned)
        instead of failing with ``UnknownSample``."""
        msg = M.Discard(topic, tuple(indexes), next(_request_ids), missing_ok=missing_ok)
        missing: tuple[int, ...] = await self._ask(msg)
        return missing

    async def set_version(self, topic: str, version: int) -> None:
        """Publish the latest policy version; samples that fall out of the window are evicted."""
        await self._ask(M.SetVersion(topic, version))

    # -- reading ---------------------------------------------------------------------------------

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
        fetch: Sequence[str] | None = None,
    ) -> Batch | None:
        """Lease and fetch ``count`` samples ready for ``columns``, unconsumed by ``consumer``,
        fresh. Waits until enough qualify (``wait=False``: returns ``None`` instead); bound the
        wait with ``trio.fail_after``. The batch must be ``ack``ed (or ``nack``ed). ``fetch``:
        only these of ``columns`` are fetched (the others are read by whoever the lease's
        rows go to: ``fetch_rows``).

        Raises ``StorageUnavailable`` if a unit holding some of the samples fails (the lease is
        returned first), ``ControllerUnavailable``, and the controller's typed errors.
        """
        spec = self._spec(topic)
        for name in columns:
            if name not in spec.columns:
                raise UnknownColumn(f"topic {topic!r} has no column {name!r}")
        if fetch is not None and not set(fetch) <= set(columns):
            raise InvalidArgument(
                f"fetch names columns not claimed: {sorted(set(fetch) - set(columns))}"
            )
        claim_id = next(_request_ids)
        claim = M.Claim(
            topic, consumer, tuple(columns), count, self.holder, claim_id, sampler,
            min_count, share_key, share_count, wait, self.io.mapped(self.incarnations),
        )  # fmt: skip
        leased: M.Leased | None = await self._waiting(claim, M.CancelClaim(claim_id))
        if leased is None:
            return None
        self.incarnations.update(leased.incarnations)
        try:
            return await self._fetch(spec, leased, columns if fetch is None else fetch)
        except BaseException:
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                try:
                    await self._ask(M.Nack(leased.lease.id))
                except TransferQueueError:
                    pass  # it ended already (a controller restart returned it)
            raise

    async def _fetch(self, spec: TopicSpec, leased: M.Leased, columns: Sequence[str]) -> Batch:
        lease = leased.lease
        per_sample = [c for c in columns if not spec.columns[c].shared]
        shared_cols = [c for c in columns if spec.columns[c].shared]
        fetched = await self.io.fetch(
            lease.topic,
            leased.incarnations,
            lease.placement,
            per_sample,
            lease.shared,
            shared_cols,
            leased.located,
        )
        order = sorted(lease.placement, key=lambda u: min(lease.placement[u], default=0))
        arrived = [i for u in order for i in lease.placement[u]]
        perm = None
        if arrived != list(lease.indexes):
            where = {index: k for k, index in enumerate(arrived)}
            perm = [where[i] for i in lease.indexes]
        data = {
            c: assemble(
                spec.columns[c],
                [materialize(p) for u in order for p in fetched[u].columns[c]],
                perm,
            )
            for c in per_sample
        }
        shared: dict[str, dict[int, Any]] = {c: {} for c in shared_cols}
        for unit in order:
            for gid, blobs in fetched[unit].shared.items():
                for column, value in blobs.items():
                    shared[column][gid] = materialize(value)
        return Batch(lease, data, shared, dict(leased.incarnations), dict(leased.located))

    async def ack(self, batch: Batch | Lease) -> tuple[int, ...]:
        """Complete the lease; returns indexes that had gone missing meanwhile (lost, discarded).
        Raises ``UnknownLease`` if the lease ended first (expired, or returned by a controller
        restart: its samples go out again)."""
        lease = batch.lease if isinstance(batch, Batch) else batch
        missing: tuple[int, ...] = await self._ask(M.Ack(lease.id, self.holder, next(_request_ids)))
        return missing

    async def nack(self, batch: Batch | Lease) -> None:
        """Give the samples back to the pool now (for this consumer)."""
        lease = batch.lease if isinstance(batch, Batch) else batch
        await self._ask(M.Nack(lease.id))

    async def renew(self, batch: Batch | Lease) -> Lease:
        lease = batch.lease if isinstance(batch, Batch) else batch
        renewed: Lease = await self._ask(M.Renew(lease.id))
        return renewed

    async def stream(
        self, topic: str, consumer: str, columns: Sequence[str], count: int, **options: Any
    ) -> AsyncIterator[Batch]:
        """``get`` forever: ``async for batch in client.stream(...)`` (ack each batch)."""
        while True:
            batch = await self.get(topic, consumer, columns, count, **options)
            if batch is not None:
                yield batch

    # -- watching --------------------------------------------------------------------------------

    async def events(self, since: int = 0) -> M.EventBatch:
        """Evictions, losses and abandoned writes after ``since`` (waits for one); re-inject
        those prompts. A cancelled call withdraws its wait."""
        wait_id = next(_request_ids)
        batch: M.EventBatch = await self._waiting(
            M.WaitEvents(since, wait_id), M.CancelWait(wait_id)
        )
        return batch

    async def flush(self) -> None:
        """Wait until every unit has applied the bookkeeping queued so far (deletes of freed
        samples, consumption marks): after it, unit statistics reflect every earlier ack."""
        await self._ask(M.Flushed())

    async def statistics(self) -> TransferQueueStatistics:
        controller = await self._ask(M.GetControllerStatistics())
        units: dict[str, U.StorageStatistics | None] = {}
        for unit, ref in self.units.items():
            units[unit] = None
            try:
                with trio.move_on_after(5):
                    units[unit] = await ref.ask(U.GetStorageStatistics())
            except ActorCrashed:
                pass
        return TransferQueueStatistics(controller, units)

    async def aclose(self) -> None:
        """Return every lease this client's holder holds, drop its writes in progress and
        withdraw its claims and puts still waiting (they fail): what a restarted worker with
        the same holder does first, for a predecessor that died holding or waiting.

        It never raises (it runs in clean-ups, where an error would hide the one that led
        there): if the controller does not confirm within ``CLEANUP_S`` seconds (or cannot be
        reached), it logs a warning naming the holder and what is left behind until it times
        out. A controller that terminated for good took all of that with it: nothing to say."""
        self.io.close()
        if self._controller_gone():
            await trio.lowlevel.checkpoint()
            return
        why = f"no answer in {CLEANUP_S:.0f} s"
        with trio.CancelScope(shield=True), trio.move_on_after(CLEANUP_S):
            try:
                await self._ask(M.ReleaseHolder(self.holder))
                return
            except TransferQueueError as exc:
                why = str(exc)
        if self._controller_gone():
            return
        log.warning(
            "TransferQueue client %r: the controller did not release its holder (%s): its "
            "leases come back at lease_ttl, its uncommitted writes and open group slots at "
            "write_ttl (never without one), its waiting claims and puts stay until answered",
            self.holder,
            why,
        )


def _size(size: Any) -> int:
    try:
        value = operator.index(size)
    except TypeError:
        value = 0
    if value < 1:
        raise InvalidArgument(f"group sizes must be ints >= 1, got {size!r}")
    return value


def _group_ids(
    group: int | GroupSlot | Sequence[int | GroupSlot] | None, n: int
) -> int | tuple[int, ...] | None:
    """A put's ``group`` as the controller takes it: one group id, one per row (rows of
    several groups), or ``None``; rows that all join one group are sent as that group."""
    if group is None or isinstance(group, int):
        return group
    if isinstance(group, GroupSlot):
        return group.group_id
    if isinstance(group, (str, bytes)) or not isinstance(group, Sequence):
        raise InvalidArgument(f"group must be a group id, a GroupSlot or a sequence, got {group!r}")
    gids = tuple(g.group_id if isinstance(g, GroupSlot) else operator.index(g) for g in group)
    if len(gids) != n:
        raise InvalidArgument(f"group names {len(gids)} groups for {n} rows (one per row)")
    return gids[0] if gids and gids.count(gids[0]) == n else gids


_GROUP_IN_MESSAGE = re.compile(r"\bgroups? (\d+)\b")


def _name_group(exc: TransferQueueError) -> None:
    """Set ``exc.group_id`` from its message where it names a group but the attribute did not
    travel (an error raised in another process crosses the wire as its type and message)."""
    if exc.group_id is None and isinstance(exc, (GroupError, UnknownGroup, StaleVersionError)):
        found = _GROUP_IN_MESSAGE.search(str(exc))
        if found is not None:
            exc.group_id = int(found.group(1))


@attrs.frozen
class TransferQueueStatistics:
    """The controller's view (samples per state, leases, events) and each unit's bytes."""

    controller: M.ControllerStatistics
    units: dict[str, U.StorageStatistics | None]
