"""How the controller delivers its bookkeeping to the storage units (internal).

The flusher task sends each unit what a rebuild needs (``_units.Outbox``): ``flush_linger``
after it is queued, so that what many operations queue travels together (every message to a
unit process costs the data path on the client's host: one per linger, not one per operation),
and at once when someone waits for it: ``flush()``, a put waiting for the slots deletes free,
or a reply held until a unit took the puts told to it (a reader that must ask the unit for
rows it has not heard of yet, a writer of columns to them: see ``_units.StoreWaits``).

Deletes also go at once, before any put waits, while a topic is short of capacity: less than
half of it is free for new puts (live samples, reserved group slots and freed samples whose
delete their unit has not taken yet occupy the rest). A freed slot counts as occupied
until its unit took the delete (so that the capacity bounds what the units really hold), and a
writer that streams puts would otherwise fill the topic with freed slots within one linger,
then wait for a flush and the unit's work on it on every put. Sent as soon as the slots are
freed, the deletes reach the units while the writer is still copying its next put.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

import attrs
import trio

from .. import _messages as M
from .. import _unit_messages as U
from .._errors import TransferQueueError
from .._results import Update
from .._runtime import ActorContext, Reply
from ..state._state import ControllerState
from . import _units

if TYPE_CHECKING:
    from ._controller import ControllerShared


@attrs.frozen
class Delivered:
    """Self-message from the flusher: a unit took deletions, so waiting puts may fit now, or
    told stores that held replies wait for (sent as each unit takes its batch)."""


class Delivery:
    """The delivery part of the controller actor (a mixin of ``Controller``)."""

    shared: ControllerShared
    state: ControllerState | None
    puts: dict[str, deque[Any]]
    flush_now: trio.Event
    outbox_wake: trio.Event
    check_now: trio.Event
    flush_waiters: list[Reply]
    store_waits: _units.StoreWaits

    def _apply(self, update: Update) -> None: ...
    def _kick(self, topic: str, *, puts: bool = True) -> None: ...

    def _to_unit(self, unit: str, item: Any) -> None:
        """Queue bookkeeping for a unit; the flusher delivers it (kept until taken)."""
        if unit not in self.shared.units or self.shared.known.get(unit) is None:
            return  # the unit is down: its loss covers what this item described
        self.shared.outbox.put(unit, item)
        self.outbox_wake.set()
        if self.flush_waiters:
            self.flush_now.set()  # someone waits for an empty outbox: no lingering
        elif isinstance(item, U.Delete) and (self.puts.get(item.topic) or self._short(item.topic)):
            self.flush_now.set()  # puts wait, or soon will, for these slots: no lingering

    def _short(self, topic: str) -> bool:
        """Whether less than half of ``topic``'s capacity is free for new puts, the freed
        samples whose delete units have not taken yet counted as occupied (see the module
        docstring)."""
        capacity = self.shared.specs[topic].capacity
        free = self.state.free_slots(topic) if self.state is not None else None
        if capacity is None or free is None:
            return False
        return 2 * (free - self.shared.outbox.deleting.get(topic, 0)) < capacity

    def _hold(self, marks: dict[str, int], reply: Reply, value: Any) -> None:
        """Send ``value`` once the units took the told stores ``marks`` names."""
        self.store_waits.add(marks, reply, value)
        self.flush_now.set()  # no lingering: someone waits
        self.outbox_wake.set()

    def _stores_taken(self, state: ControllerState) -> None:
        """Send the held replies whose units took their stores (or were declared lost)."""
        for reply, value in self.store_waits.ready(self.shared.outbox):
            if not reply.send(value) and isinstance(value, M.Leased):
                try:  # the claimant is gone: give the samples back
                    self._apply(state.nack(value.lease.id))
                except TransferQueueError:
                    pass  # it ended already (its claim was cancelled)
                self._kick(value.lease.topic)

    async def _flusher(self, ctx: ActorContext[Any]) -> None:
        """Deliver bookkeeping to the units (see the module docstring)."""
        shared = self.shared

        def missing() -> bool:
            return bool(shared.outbox.missing)

        async def taken(deleted: bool) -> None:  # a unit took a batch: wake who waits
            if (deleted and any(self.puts.values())) or len(self.store_waits) or missing():
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
                self.check_now.set()
                with trio.move_on_after(shared.unit_check_interval):
                    await trio.sleep_forever()
                self.outbox_wake.set()
