"""How the controller keeps knowing which incarnation of each unit holds what (internal).

A unit that restarted empty, or stopped answering, has lost its data: the controller reports
its samples lost (once) and adopts its next incarnation only after telling it to drop whatever
it still holds (``Reset``), so nothing it reported lost can come back. A restarted controller
first delivers the bookkeeping its last incarnation queued, then reads the inventories of the
units still on the incarnations it knew and rebuilds its state from them; the units that
changed meanwhile are reported lost from the last state it had (kept in ``ControllerShared``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import attrs
import trio

from .. import _unit_messages as U
from .._errors import TransferQueueError, UnknownSample
from .._results import Loss, Update
from .._runtime import ActorContext, ActorCrashed
from ..state._inventory import Inventory, TopicRecord
from ..state._state import ControllerState
from . import _units
from ._locations import Locations

if TYPE_CHECKING:
    from ._controller import ControllerShared

log = logging.getLogger("asyncflow_actors.transfer_queue")


@attrs.frozen
class UnitSeen:
    """Self-message from the unit watcher: ``token`` is None when the unit did not answer."""

    unit: str
    token: str | None


class Recovery:
    """The failure handling part of the controller actor (a mixin of ``Controller``)."""

    shared: ControllerShared
    state: ControllerState | None
    epoch: int
    adopting: dict[str, str]
    flush_now: trio.Event
    outbox_wake: trio.Event
    check_now: trio.Event
    lost_samples: int
    locations: Locations

    def _apply(self, update: Update) -> None: ...
    def _to_unit(self, unit: str, item: Any) -> None: ...
    def _kick_all(self) -> None: ...
    def _kick(self, topic: str, *, puts: bool = True) -> None: ...
    def _group_infos(self, topic: str, gids: Any) -> None: ...
    def _event(
        self, kind: str, topic: str, groups: tuple[int, ...], indexes: tuple[int, ...], detail: str
    ) -> None: ...

    async def _rebuild(self, tokens: dict[str, str | None]) -> None:
        """Deliver what the last incarnation decided, read the inventories of the units still
        on the incarnations it knew, report what the others held as lost, and rebuild."""
        shared = self.shared
        timeout = shared.unit_timeout
        stale = set(await shared.outbox.flush(shared.units, shared.known, timeout))
        lost = [u for u in shared.units if u in stale or tokens[u] != shared.known.get(u)]
        parts = [Inventory(topics=tuple(_record(m) for m in shared.watermarks.values()))]
        for unit in shared.units:
            if unit in lost:
                continue
            try:
                with trio.fail_after(timeout):
                    inv: U.UnitInventory = await shared.units[unit].ask(U.GetInventory())
            except (ActorCrashed, trio.TooSlowError, TransferQueueError):
                lost.append(unit)
                continue
            if inv.incarnation != shared.known.get(unit):
                lost.append(unit)
                continue
            parts.append(_units.inventory_of(unit, inv))
        fresh = {}
        for unit in lost:  # whatever they hold now is not what the state knew: drop it
            fresh[unit] = await self._reset(unit)
        # From here on nothing awaits: a crash cannot split the losses from their report.
        old = shared.state
        losses = [
            old.storage_lost(u) for u in lost if old is not None and shared.known.get(u) is not None
        ]
        state, update = ControllerState.from_inventory(
            shared.specs.values(),
            list(shared.units),
            Inventory.merge(parts),
            epoch=self.epoch,
            now=trio.current_time(),
        )
        self.state = shared.state = state
        for unit in lost:
            self._dropped(unit)
            self._adopt(unit, fresh[unit])
        self._apply(update)
        for loss in losses:
            self._report_loss(loss)
        log.info("controller rebuilt (epoch %d); units lost meanwhile: %s", self.epoch, lost)

    async def _reset(self, unit: str) -> str | None:
        """Have ``unit`` drop everything it holds; its new token (``None``: it did not answer)."""
        try:
            with trio.fail_after(self.shared.unit_timeout):
                token: str = await self.shared.units[unit].ask(U.Reset())
                return token
        except (ActorCrashed, trio.TooSlowError):
            return None

    def _adopt(self, unit: str, token: str | None) -> None:
        """``unit`` is now incarnation ``token`` (empty), or down (``None``)."""
        assert self.state is not None
        self.shared.known[unit] = token
        self.state.set_unit_up(unit, token is not None)
        if token is not None:  # a fresh, empty incarnation: give it the watermarks again
            for info in self.shared.watermarks.values():
                self._to_unit(unit, info)
            orphans = self.shared.outbox.orphans.pop(unit, None)
            if orphans:  # and the segments of told stores its predecessor never took
                self._to_unit(unit, U.Unlink(orphans))

    def _unit_seen(self, state: ControllerState, msg: UnitSeen) -> None:
        known = self.shared.known
        old = known.get(msg.unit)
        if msg.token is not None and self.adopting.get(msg.unit) == msg.token:
            del self.adopting[msg.unit]
        if old == msg.token:
            return
        if old is not None:
            loss = state.storage_lost(msg.unit)
            self._dropped(msg.unit)
            known[msg.unit] = None
            state.set_unit_up(msg.unit, False)
            self._report_loss(loss)
            self._kick_all()
        if msg.token is not None:
            self._adopt(msg.unit, msg.token)
            log.info("storage unit %s is back (empty)", msg.unit)

    def _report_loss(self, loss: Loss) -> None:
        for lost in loss.lost:
            self.lost_samples += len(lost.indexes)
            self._event("lost", lost.topic, lost.group_ids, lost.indexes, f"unit {loss.unit}")
        if loss.lost:
            log.warning("storage unit %s lost: %s", loss.unit, loss.group_ids)

    def _stores_missing(self, state: ControllerState) -> None:
        """Report lost the live samples of told stores their unit could not take (the segment
        went before the store arrived: e.g. the unit swept it after ``shm_orphan_age`` while
        the store waited in the outbox): dropped, never served from a hole."""
        outbox = self.shared.outbox
        while outbox.missing:
            unit, per_topic = outbox.missing.pop(0)
            for topic, indexes in per_topic.items():
                try:
                    where = state.locate(topic, indexes)
                except UnknownSample as exc:  # freed already (a delivery again): not lost
                    gone = set(exc.indexes)
                    where = state.locate(topic, [i for i in indexes if i not in gone])
                except TransferQueueError:
                    continue  # the topic is gone
                lost = tuple(i for i, (_, u) in where.items() if u == unit)
                if not lost:
                    continue
                gids = tuple(sorted({where[i][0] for i in lost}))
                self.locations.drop(topic, lost)
                self._apply(state.lose(topic, lost))
                self._group_infos(topic, gids)
                self.lost_samples += len(lost)
                self._event("lost", topic, gids, lost, f"unit {unit}: its segment was gone")
                log.warning("unit %s lost told stores of %s %s", unit, topic, lost[:8])
                self._kick(topic)

    def _dropped(self, unit: str) -> None:
        """``unit``'s bookkeeping went with its incarnation: wake those who wait for it."""
        self.locations.drop_unit(unit)
        self.shared.outbox.drop(unit)
        self.flush_now.set()
        self.outbox_wake.set()

    async def _unit_watcher(self, ctx: ActorContext[Any]) -> None:
        shared = self.shared
        while True:
            with trio.move_on_after(shared.unit_check_interval):
                await self.check_now.wait()
            self.check_now = trio.Event()
            tokens = await _units.tokens(shared.units, shared.unit_timeout)
            for unit, token in tokens.items():
                if token == shared.known.get(unit) or token == self.adopting.get(unit):
                    continue
                if shared.known.get(unit) is not None:
                    await ctx.self.send(UnitSeen(unit, None))  # its data is gone: report it
                if token is not None:  # back: make sure it holds nothing from before
                    fresh = await self._reset(unit)
                    if fresh is not None:
                        self.adopting[unit] = fresh
                        await ctx.self.send(UnitSeen(unit, fresh))


def _record(info: U.TopicInfo) -> TopicRecord:
    return TopicRecord(info.topic, info.latest_version, info.next_index, info.next_group_id)
