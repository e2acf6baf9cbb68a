"""The controller's side of its storage units: bookkeeping delivery, incarnations, inventories.

The controller forwards to each unit what a rebuild will need (deletes, consumption marks,
commits, group records, watermarks). :class:`Outbox` keeps those items until the unit *replied*
that it applied them, so a controller that crashes in the middle of a flush loses nothing: its
next incarnation sends them again (every item is idempotent) before it reads the inventories.
Items are addressed to one unit incarnation; a unit that restarted refuses them, and its items
are dropped with its loss. The outbox counts, per topic, the samples whose deletion a unit has
not taken yet: the controller keeps their slots occupied until then, so a topic's capacity
bounds the rows its units really hold, however far the bookkeeping lags behind.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import trio

from ._errors import TransferQueueError
from ._inventory import GroupRecord, Inventory, SampleRecord, TopicRecord
from ._runtime import ActorCrashed, ActorRef
from ._unit_messages import Delete, GetToken, MarkConsumed, UnitBatch, UnitInventory

MAX_BATCH = 4096  # bookkeeping items per UnitBatch


def _coalesce(items: list[Any]) -> list[Any]:
    """Drop consumption marks of samples deleted in the same batch (they are gone anyway)."""
    deleted = {(m.topic, i) for m in items if isinstance(m, Delete) for i in m.indexes}
    if not deleted:
        return items
    out = []
    for m in items:
        if isinstance(m, MarkConsumed):
            keep = [i for i in m.indexes if (m.topic, i) not in deleted]
            if not keep:
                continue
            m = MarkConsumed(m.topic, m.consumer, keep)
        out.append(m)
    return out


class Outbox:
    """Bookkeeping per unit, kept until the unit has taken it (see the module docstring)."""

    def __init__(self) -> None:
        self.items: dict[str, list[Any]] = {}
        self.deleting: dict[str, int] = {}  # topic -> samples whose Delete is not taken yet

    def put(self, unit: str, item: Any) -> None:
        self.items.setdefault(unit, []).append(item)
        self._count([item], 1)

    def drop(self, unit: str) -> None:
        """Forget a unit's items (its incarnation is gone, and so is what they described)."""
        self._count(self.items.pop(unit, []), -1)

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
        self, units: Mapping[str, ActorRef[Any]], known: Mapping[str, str | None], timeout: float
    ) -> list[str]:
        """Deliver every unit's items (concurrently); returns the units that did not take them
        (gone, restarted, or too slow): their items stay queued."""
        failed: list[str] = []

        async def one(unit: str) -> None:
            while (items := self.items.get(unit)) and known.get(unit) is not None:
                batch = items[:MAX_BATCH]
                try:
                    with trio.fail_after(timeout):
                        await units[unit].ask(UnitBatch(str(known[unit]), _coalesce(batch)))
                except (ActorCrashed, trio.TooSlowError, TransferQueueError):
                    failed.append(unit)
                    return
                if self.items.get(unit) is items:  # not dropped meanwhile
                    self._count(batch, -1)
                    del items[: len(batch)]

        async with trio.open_nursery() as nursery:
            for unit in [u for u, items in self.items.items() if items and u in units]:
                nursery.start_soon(one, unit)
        return failed


async def tokens(units: Mapping[str, ActorRef[Any]], timeout: float) -> dict[str, str | None]:
    """Every unit's incarnation token, asked concurrently (``None``: it did not answer)."""
    out: dict[str, str | None] = dict.fromkeys(units)

    async def one(unit: str, ref: ActorRef[Any]) -> None:
        try:
            with trio.fail_after(timeout):
                out[unit] = await ref.ask(GetToken())
        except (ActorCrashed, trio.TooSlowError):
            out[unit] = None

    async with trio.open_nursery() as nursery:
        for unit, ref in units.items():
            nursery.start_soon(one, unit, ref)
    return out


def inventory_of(unit: str, inv: UnitInventory) -> Inventory:
    """A unit's report as inventory records. A group counts as allocated its committed members
    and the uncommitted ones the unit holds (a member never stored goes back to its writer)."""
    topics = tuple(
        TopicRecord(t.topic, t.latest_version, t.next_index, t.next_group_id) for t in inv.topics
    )
    stored: dict[tuple[str, int], int] = {}
    for topic, records in inv.samples.items():
        for s in records:
            if not s.committed:
                stored[(topic, s.group_id)] = stored.get((topic, s.group_id), 0) + 1
    groups = tuple(
        GroupRecord(
            topic,
            g.group_id,
            unit,
            g.size,
            g.committed + stored.get((topic, g.group_id), 0),
            g.shared,
            g.explicit,
        )
        for topic, records in inv.groups.items()
        for g in records
    )
    samples = tuple(
        SampleRecord(
            topic,
            s.index,
            s.version,
            s.group_id,
            unit,
            s.length,
            s.columns,
            s.consumed,
            s.committed,
        )
        for topic, records in inv.samples.items()
        for s in records
    )
    return Inventory(topics, groups, samples)
