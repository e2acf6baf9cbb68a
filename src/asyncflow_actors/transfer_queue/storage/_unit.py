"""Storage units: the TransferQueue's data plane shards.

A ``StorageUnit`` is an actor that holds sample data by (topic, index, column) and group-shared
data by (topic, group, column) in a :class:`Shelf`. It never looks inside tensors: it decodes
them as ``RawTensor`` (bytes, dtype, shape) and sends the same bytes back, so a unit in a node
process neither imports torch nor copies a tensor it received, and a fetch of rows that were
put together returns a view of the frame (or shared-memory segment) they arrived in.

Each incarnation draws a token; every data message names the incarnation it was meant for, and a
unit that restarted empty refuses the others (:class:`IncarnationMismatch`). With ``shm`` (the
queue's segment namespace) and a ``/dev/shm`` here, same-host clients hand tensor bodies over in
shared-memory segments the unit then owns (see ``_shm``): it unlinks them when their rows go,
sweeps what a dead writer left behind, and removes all of its own when it stops.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import trio

from .. import _shm
from .._errors import TransferQueueError, unexpected
from .._runtime import Actor, ActorContext, Request
from .._unit_messages import (
    Delete,
    Fetch,
    GetInventory,
    GetShm,
    GetStorageStatistics,
    GetToken,
    IncarnationMismatch,
    Reset,
    StorageMessage,
    StorageStatistics,
    Store,
    Stored,
    StoreGroups,
    TopicInfo,
    UnitBatch,
    Unlink,
)
from ._pool import SegmentPool
from ._shelf import Shelf

log = logging.getLogger("asyncflow_actors.transfer_queue")

ORPHAN_AGE = 60.0  # default: a segment not handed over after this long lost its writer
POOL_BYTES = 256 << 20  # default: freed segments kept for reuse (see ``_pool``)
BATCH_HINTS = 64  # free segments named to the controller, which passes them on to writers
# whose stores it tells (one list per bookkeeping flush must last until the next)


class StorageUnit(Actor[StorageMessage]):
    """A data plane shard (see the module docstring). Spawn it locally or on a node.

    ``shm``: the segment namespace of this unit in its queue (``afa-<queue>-<unit>-``); empty:
    no shared memory. ``orphan_age``: seconds after which a segment a writer created but never
    handed over (it died) is removed; the unit sweeps every ``orphan_age / 6`` seconds.
    ``pool_bytes``: freed segments kept for writers to fill again (0: unlink them at once);
    unused ones go after ``orphan_age``.
    """

    raw_tensors = True  # a node decodes this actor's messages as RawTensor: no torch needed
    mailbox_size = 256

    def __init__(
        self,
        name: str = "",
        shm: str = "",
        orphan_age: float = ORPHAN_AGE,
        pool_bytes: int = POOL_BYTES,
    ) -> None:
        self.name = name
        self.orphan_age = orphan_age
        self.pool_bytes = pool_bytes
        self.namespace = shm if shm and _shm.available() else ""
        self.token = ""
        self.shelf = Shelf(name, None, trio.current_time)
        self.shm_info: _shm.ShmInfo | None = None

    def _begin(self) -> None:
        """A fresh, empty incarnation: new token, new segment prefix and probe."""
        self.token = os.urandom(8).hex()
        prefix = f"{self.namespace}{self.token}-" if self.namespace else None
        pool = None
        if prefix is not None and self.pool_bytes > 0:
            pool = SegmentPool(prefix, self.pool_bytes, trio.current_time)
        self.shelf = Shelf(self.name, prefix, trio.current_time, pool)
        if prefix is not None:
            _shm.sweep(self.namespace)  # what earlier incarnations left: their data is gone
            self.shm_info = _shm.create_probe(prefix)

    def _end(self) -> None:
        self.shelf.close()
        if self.shelf.prefix is not None:
            _shm.sweep(self.shelf.prefix)  # the probe, and segments a writer never handed over

    async def on_start(self, ctx: ActorContext[StorageMessage]) -> None:
        self._begin()
        if self.namespace:
            ctx.start_soon(self._sweeper)

    async def on_stop(self, ctx: ActorContext[StorageMessage], error: BaseException | None) -> None:
        self._end()

    async def _sweeper(self) -> None:
        while True:
            await trio.sleep(self.orphan_age / 6)
            shelf = self.shelf
            shelf.compact_deferred()
            keep = [*shelf.segments]
            if shelf.pool is not None:
                shelf.pool.drain()
                shelf.pool.expire(self.orphan_age)
                keep += [*shelf.pool.free, *shelf.pool.draining]
            if shelf.prefix is not None:  # the whole namespace: a segment written for an
                # earlier incarnation (its writer did not know it restarted) is an orphan too
                _shm.sweep(
                    self.namespace,
                    keep=[*keep, shelf.prefix + "probe"],
                    older_than=self.orphan_age,
                )

    async def receive(self, msg: StorageMessage, ctx: ActorContext[StorageMessage]) -> Any:
        try:
            return self._receive(msg)
        except Exception as exc:  # a bad request: answer it, never crash (its samples would go)
            if not isinstance(exc, TransferQueueError):  # one no check foresaw
                log.exception("storage unit %s: %s failed", self.name, type(msg).__name__)
                exc = unexpected(msg, exc)
            if isinstance(msg, Request):
                ctx.reply_error(exc)
            return None

    def _ours(self, segment: str) -> bool:
        return bool(segment and self.namespace and segment.startswith(self.namespace))

    def _check(self, incarnation: str, segment: str = "") -> None:
        if incarnation != self.token:
            if self._ours(segment):
                _shm.unlink(segment)  # meant for an earlier incarnation: nobody will take it
            raise IncarnationMismatch(
                f"unit {self.name!r} is incarnation {self.token}, not {incarnation}: it "
                "restarted empty since"
            )

    def _receive(self, msg: StorageMessage) -> Any:
        shelf = self.shelf
        if isinstance(msg, Fetch):
            self._check(msg.incarnation)
            return shelf.fetch(msg)
        if isinstance(msg, Store):
            self._check(msg.incarnation, msg.segment)
            shelf.store(msg, create=msg.create)
            return Stored(shelf.pool.hints() if shelf.pool is not None else ())
        if isinstance(msg, UnitBatch):
            if msg.incarnation != self.token:
                for item in msg.items:  # watermarks hold for every incarnation
                    if isinstance(item, TopicInfo):
                        shelf.watermark(item)
                    elif isinstance(item, Store) and self._ours(item.segment):
                        _shm.unlink(item.segment)  # told for an earlier incarnation: unlink
                self._check(msg.incarnation)
            missing: dict[str, list[int]] = {}
            for item in msg.items:
                if isinstance(item, Unlink):
                    for name in item.segments:
                        if self._ours(name) and name not in shelf.segments:
                            _shm.unlink(name)
                elif absent := shelf.apply(item):
                    missing.setdefault(item.topic, []).extend(absent)
            if shelf.pool is not None:
                shelf.pool.drain()
                return Stored(shelf.pool.hints(BATCH_HINTS), missing)
            return Stored((), missing)
        elif isinstance(msg, StoreGroups):
            self._check(msg.incarnation)
            for group_id, columns in msg.groups.items():
                shelf.store_shared(msg.topic, group_id, columns)
        elif isinstance(msg, Delete):
            shelf.delete(msg)
        elif isinstance(msg, GetToken):
            return self.token
        elif isinstance(msg, Reset):
            self._end()
            self._begin()
            return self.token
        elif isinstance(msg, GetShm):
            return self.shm_info
        elif isinstance(msg, GetInventory):
            return shelf.inventory(self.token)
        elif isinstance(msg, GetStorageStatistics):
            return self.statistics()
        return None

    def statistics(self) -> StorageStatistics:
        shelf = self.shelf
        return StorageStatistics(
            unit=self.name,
            incarnation=self.token,
            samples=sum(len(t) for t in shelf.samples.values()),
            groups=sum(
                len(set(shelf.blobs.get(t, {})) | set(shelf.groups.get(t, {})))
                for t in set(shelf.blobs) | set(shelf.groups)
            ),
            nbytes=shelf.held,
            live_nbytes=shelf.live,
            shared_nbytes=shelf.shared_nbytes,
            segments=len(shelf.segments),
            stores=shelf.stores,
            fetches=shelf.fetches,
            zero_copy_fetches=shelf.zero_copy,
            shm_stores=shelf.shm_stores,
            shm_fetches=shelf.shm_fetches,
            compactions=shelf.compactions,
            pool_nbytes=shelf.pool.nbytes if shelf.pool is not None else 0,
            recycled=shelf.pool.recycled if shelf.pool is not None else 0,
        )
