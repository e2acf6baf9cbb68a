"""The controller's bookkeeping for its storage units, kept until each unit has taken it.

The controller forwards to each unit what a rebuild will need (deletes, consumption marks,
commits, group records, watermarks). :class:`Outbox` keeps those items until the unit *replied*
that it applied them, so a controller that crashes in the middle of a flush loses nothing: its
next incarnation sends them again (every item is idempotent) before it reads the inventories.
Items are addressed to one unit incarnation; a unit that restarted refuses them, and its items
are dropped with its loss. The outbox counts, per topic, the samples whose deletion a unit has
not taken yet: the controller keeps their slots occupied until then, so a topic's capacity
bounds the rows its units really hold, however far the bookkeeping lags behind. It also
numbers each unit's items, so that a reader who must fetch from a unit can wait until the unit
took the puts told to it through the controller (``Store`` items) before the reader asks it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import trio

from .._errors import TransferQueueError
from .._runtime import ActorCrashed, ActorRef
from .._unit_messages import Delete, FreeSegment, MarkConsumed, Store, UnitBatch

MAX_BATCH = 4096  # bookkeeping items per UnitBatch


def _coalesce(items: list[Any]) -> list[Any]:
    """Drop consumption marks of samples deleted in the same batch (they are gone anyway)."""
    if not any(isinstance(m, MarkConsumed) for m in items):
        return items
    deleted: dict[str, set[int]] = {}
    for m in items:
        if isinstance(m, Delete):
            deleted.setdefault(m.topic, set()).update(m.indexes)
    if not deleted:
        return items
    out = []
    for m in items:
        if isinstance(m, MarkConsumed) and m.topic in deleted:
            gone = deleted[m.topic]
            keep = [i for i in m.indexes if i not in gone]
            if not keep:
                continue
            if len(keep) < len(m.indexes):
                m = MarkConsumed(m.topic, m.consumer, keep)
        out.append(m)
    return out


class Outbox:
    """Bookkeeping per unit, kept until the unit has taken it (see the module docstring)."""

    def __init__(self) -> None:
        self.items: dict[str, list[Any]] = {}
        self.deleting: dict[str, int] = {}  # topic -> samples whose Delete is not taken yet
        self.queued: dict[str, int] = {}  # unit -> items ever queued
        self.taken: dict[str, int] = {}  # unit -> items it took (or that went with it)
        self.last_store: dict[str, int] = {}  # unit -> ``queued`` at its latest told Store
        self.free: dict[str, tuple[FreeSegment, ...]] = {}  # unit -> its free segments, as
        # its last reply named them
        self.orphans: dict[str, list[str]] = {}  # unit -> segments of told stores dropped
        # with its incarnation: its next incarnation unlinks them (see ``Unlink``)
        self.missing: list[tuple[str, dict[str, list[int]]]] = []  # (unit, samples of told
        # stores it could not take, per topic): the controller reports the live ones lost

    def put(self, unit: str, item: Any) -> None:
        self.items.setdefault(unit, []).append(item)
        self._count([item], 1)
        queued = self.queued[unit] = self.queued.get(unit, 0) + 1
        if isinstance(item, Store):
            self.last_store[unit] = queued

    def storing(self, unit: str) -> int | None:
        """The mark to wait for (see :meth:`taken_up_to`) if ``unit`` has not yet taken every
        told ``Store`` queued for it, else ``None``."""
        mark = self.last_store.get(unit, 0)
        return mark if self.taken.get(unit, 0) < mark else None

    def taken_up_to(self, unit: str, mark: int) -> bool:
        return self.taken.get(unit, 0) >= mark

    def drop(self, unit: str) -> None:
        """Forget a unit's items (its incarnation is gone, and so is what they described)."""
        items = self.items.pop(unit, [])
        self._count(items, -1)
        self.taken[unit] = self.queued.get(unit, 0)
        self.free.pop(unit, None)
        segments = [i.segment for i in items if isinstance(i, Store) and i.segment]
        if segments:
            self.orphans.setdefault(unit, []).extend(segments)

    def _count(self, items: list[Any], sign: int) -> None:
        for item in items:
            if isinstance(item, Delete) and item.indexes:
                left = self.deleting.get(item.topic, 0) + sign * len(item.indexes)
                if left:
                    self.deleting[item.topic] = left
                else:
                    del self.deleting[item.topic]

    def __len__(self) -> int:
        return sum(len(v) for v in self.items.values())

    async def flush(
        self,
        units: Mapping[str, ActorRef[Any]],
        known: Mapping[str, str | None],
        timeout: float,
        taken: Callable[[bool], Awaitable[None]] | None = None,
    ) -> list[str]:
        """Deliver every unit's items (concurrently); returns the units that did not take them
        (gone, restarted, or too slow): their items stay queued. ``taken(deleted)`` is awaited
        as each unit takes a batch (``deleted``: it held deletes), so that what waits for one
        unit does not wait for the others."""
        failed: list[str] = []

        async def one(unit: str) -> None:
            while (items := self.items.get(unit)) and known.get(unit) is not None:
                batch = items[:MAX_BATCH]
                try:
                    with trio.fail_after(timeout):
                        stored = await units[unit].ask(
                            UnitBatch(str(known[unit]), _coalesce(batch))
                        )
                except (ActorCrashed, trio.TooSlowError, TransferQueueError):
                    failed.append(unit)
                    return
                if self.items.get(unit) is items:  # not dropped meanwhile
                    self._count(batch, -1)
                    del items[: len(batch)]
                    self.taken[unit] = self.taken.get(unit, 0) + len(batch)
                    self.free[unit] = stored.free
                    if stored.missing:
                        self.missing.append((unit, stored.missing))
                    if taken is not None:
                        await taken(any(isinstance(m, Delete) and m.indexes for m in batch))

        async with trio.open_nursery() as nursery:
            for unit in [u for u, items in self.items.items() if items and u in units]:
                nursery.start_soon(one, unit)
        return failed
