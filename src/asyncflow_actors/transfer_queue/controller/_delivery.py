"""How the controller delivers its bookkeeping to the storage units (internal).

The flusher task sends each unit what a rebuild needs (``_outbox.Outbox``): ``flush_linger``
after it is queued, so that what many operations queue travels together (every message to a
unit process costs the data path on the client's host: one per linger, not one per operation),
and at once when someone waits for it: ``flush()``, a put waiting for the slots deletes free,
or a reply held until a unit took the puts told to it (a reader that must ask the unit for
rows it has not heard of yet, a writer of columns to them: see ``_store_waits``).

Deletes also go at once, before any put waits, while a topic is short of capacity: less than
half of it is free for new puts (live samples, reserved group slots and freed samples whose
delete their unit has not taken yet occupy the rest). A freed slot counts as occupied
until its unit took the delete (so that the capacity bounds what the units really hold), and a
writer that streams puts would otherwise fill the topic with freed slots within one linger,
then wait for a flush and the unit's work on it on every put. Sent as soon as the slots are
freed, the deletes reach the units while the writer is still copying its next put. (Which
items are urgent is the controller's call: it knows the puts and the capacity.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sized
from typing import Any

import attrs
import trio

from .. import _unit_messages as U
from .._runtime import ActorContext, Reply
from ..state._state import ControllerState
from ._shared import ControllerShared
from ._store_waits import StoreWaits

_RESERVE = 4096  # ids reserved ahead per watermark update (see Delivery.records)


@attrs.frozen
class Delivered:
    """Self-message from the flusher: a unit took deletions, so waiting puts may fit now, or
    told stores that held replies wait for (sent as each unit takes its batch)."""


class Delivery:
    """Delivers one controller incarnation's bookkeeping to the units (see the module docstring).

    ``puts``: the controller's waiting puts per topic (read only: a delete a unit took may let
    them fit); ``check_units``: called when a unit did not take its items (gone, restarted or
    slow), so that someone looks at the units.
    """

    def __init__(
        self,
        shared: ControllerShared,
        puts: Mapping[str, Sized],
        check_units: Callable[[], None],
    ) -> None:
        self.shared = shared
        self._puts = puts
        self._check_units = check_units
        self.flush_now = trio.Event()
        self.outbox_wake = trio.Event()
        self.flush_waiters: list[Reply] = []  # answered once the outbox is empty
        self.store_waits = StoreWaits()  # replies held until units took told stores

    def send(self, unit: str, item: Any) -> bool:
        """Queue bookkeeping for a unit; the flusher delivers it (kept until taken). Returns
        whether it was queued (not when the unit is down: its loss covers what it described)."""
        if unit not in self.shared.units or self.shared.known.get(unit) is None:
            return False
        self.shared.outbox.put(unit, item)
        self.outbox_wake.set()
        if self.flush_waiters:
            self.flush_now.set()  # someone waits for an empty outbox: no lingering
        return True

    def hurry(self) -> None:
        """Flush without lingering what is queued (deletes that puts wait for, or soon will)."""
        self.flush_now.set()

    def group_infos(self, state: ControllerState, topic: str, gids: Any) -> None:
        """Send explicit groups' records (absolute values) to their units."""
        if not gids:
            return  # implicit groups only (a plain put): they have no record
        for rec in state.group_records(topic, gids):
            self.send(rec.unit, U.GroupInfo(topic, rec.group_id, rec.size, rec.allocated))

    def records(self, state: ControllerState, topic: str) -> None:
        """Tell units the topic's version and id watermarks. Ids are reserved ahead in blocks,
        so allocations only reach the units once per block: a rebuild skips the rest of a block
        but never reuses an id."""
        record = state.topic_record(topic)
        sent = self.shared.watermarks.get(topic)
        if (
            sent is not None
            and sent.latest_version == record.latest_version
            and record.next_index <= sent.next_index
            and record.next_group_id <= sent.next_group_id
        ):
            return
        info = U.TopicInfo(
            topic,
            record.latest_version,
            record.next_index + _RESERVE,
            record.next_group_id + _RESERVE,
        )
        self.shared.watermarks[topic] = info
        for unit in self.shared.units:
            self.send(unit, info)

    def short(self, state: ControllerState | None, topic: str) -> bool:
        """Whether less than half of ``topic``'s capacity is free for new puts, the freed
        samples whose delete units have not taken yet counted as occupied (see the module
        docstring)."""
        capacity = self.shared.specs[topic].capacity
        free = state.free_slots(topic) if state is not None else None
        if capacity is None or free is None:
            return False
        return 2 * (free - self.shared.outbox.deleting.get(topic, 0)) < capacity

    def wake(self) -> None:
        """Flush now, without lingering (someone waits)."""
        self.flush_now.set()
        self.outbox_wake.set()

    def marks(self, units: Iterable[str]) -> dict[str, int]:
        """The told stores to wait for before asking ``units`` (empty: none)."""
        return self.store_waits.marks(self.shared.outbox, units)

    def hold(self, marks: dict[str, int], reply: Reply, value: Any) -> None:
        """Send ``value`` once the units took the told stores ``marks`` names."""
        self.store_waits.add(marks, reply, value)
        self.wake()

    def taken(self) -> list[tuple[Reply, Any]]:
        """The held replies whose units took their stores (or were declared lost): removed
        from the waits, for the caller to send."""
        return self.store_waits.ready(self.shared.outbox)

    def await_empty(self, reply: Reply) -> None:
        """Answer ``reply`` once the outbox is empty."""
        self.flush_waiters.append(reply)
        self.wake()

    async def run(self, ctx: ActorContext[Any]) -> None:
        """The flusher task: deliver bookkeeping to the units (see the module docstring)."""
        shared = self.shared

        def missing() -> bool:
            return bool(shared.outbox.missing)

        async def taken(deleted: bool) -> None:  # a unit took a batch: wake who waits
            puts_wait = any(len(w) for w in self._puts.values())
            if (deleted and puts_wait) or len(self.store_waits) or missing():
                await ctx.self.send(Delivered())

        while True:
            await self.outbox_wake.wait()
            with trio.move_on_after(shared.flush_linger):
                await self.flush_now.wait()
            self.outbox_wake = trio.Event()
            self.flush_now = trio.Event()
            failed = await shared.outbox.flush(
                shared.units, shared.known, shared.unit_timeout, taken
            )
            if len(self.store_waits):  # some may wait for a unit dropped meanwhile
                await ctx.self.send(Delivered())
            if not len(shared.outbox):
                waiters, self.flush_waiters = self.flush_waiters, []
                for reply in waiters:
                    reply.send(None)
            if failed:  # gone, restarted or slow: look at them, and try again in a while
                self._check_units()
                with trio.move_on_after(shared.unit_check_interval):
                    await trio.sleep_forever()
                self.outbox_wake.set()
