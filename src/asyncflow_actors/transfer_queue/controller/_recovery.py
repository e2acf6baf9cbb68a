"""How the controller keeps knowing which incarnation of each unit holds what (internal).

A unit that restarted empty, or stopped answering, has lost its data: the controller reports
its samples lost (once) and adopts its next incarnation only after telling it to drop whatever
it still holds (``Reset``), so nothing it reported lost can come back. A restarted controller
first delivers the bookkeeping its last incarnation queued, then reads the inventories of the
units still on the incarnations it knew and rebuilds its state from them; the units that
changed meanwhile are reported lost from the last state it had (kept in ``ControllerShared``).

A restarted controller serves at once: a unit that has not answered its token within
``RESTART_GRACE * unit_timeout`` (busy, or its node died) is *unsettled*: rebuilt from the last
state's records of it, placed nothing new, and settled in the background: kept if it answers
its known incarnation within ``unit_timeout`` of the restart, otherwise reported lost then
(``UnitSettled``), as a unit silent for the whole ``unit_timeout`` always was.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs
import trio

from .. import _unit_messages as U
from .._errors import TransferQueueError, UnknownSample
from .._results import Loss, Update
from .._runtime import ActorContext, ActorCrashed, ActorRef
from ..state._inventory import GroupRecord, Inventory, SampleRecord, TopicRecord
from ..state._state import ControllerState
from ._delivery import Delivery
from ._locations import Locations
from ._shared import ControllerShared

log = logging.getLogger("asyncflow_actors.transfer_queue")


@attrs.frozen
class UnitSeen:
    """Self-message from the unit watcher: ``token`` is None when the unit did not answer."""

    unit: str
    token: str | None


@attrs.frozen
class UnitSettled:
    """Self-message from the settle task: an unsettled unit's token within ``unit_timeout`` of
    the restart (None: it crashed or stayed silent)."""

    unit: str
    token: str | None


RESTART_GRACE = 0.2
"""The fraction of ``unit_timeout`` a restarted controller waits for the units' tokens before it
rebuilds from those that answered (the others are settled in the background)."""


@attrs.frozen
class Rebuilt:
    """A rebuilt state, what rebuilding it did, and the losses of the units that changed
    while the controller was down (to report once the state is in place)."""

    state: ControllerState
    update: Update
    losses: tuple[Loss, ...]


@attrs.frozen
class MissingStores:
    """Live samples ``indexes`` (of groups ``group_ids``) of told stores ``unit`` could not take."""

    unit: str
    topic: str
    indexes: tuple[int, ...]
    group_ids: tuple[int, ...]


class Recovery:
    """Unit incarnations of one controller incarnation (see the module docstring).

    It owns the units' side of the failure handling: which fresh incarnation is being adopted,
    the watcher task, the rebuild's reads. What a loss means for the state's clients (events,
    waiting requests) is the controller's: ``Recovery`` returns losses, never reports them.
    """

    def __init__(self, shared: ControllerShared, delivery: Delivery, locations: Locations):
        self.shared = shared
        self.delivery = delivery
        self.locations = locations
        self.adopting: dict[str, str] = {}  # unit -> fresh token sent to receive, not yet seen
        self.silent: dict[str, float] = {}  # unit -> since when it has not answered the watcher
        self.unsettled: set[str] = set()  # units a restarted controller has not heard from yet
        self.settle_by = 0.0  # when their time to answer runs out
        self.check_now = trio.Event()

    def check(self) -> None:
        """Look at the units now, not at the next interval."""
        self.check_now.set()

    async def rebuild(self, epoch: int) -> Rebuilt:
        """Deliver what the last incarnation decided, read the inventories of the units still
        on the incarnations it knew, and rebuild; the others are dropped and adopted afresh,
        and what they held is returned as losses. The units silent past the grace are
        unsettled (the module docstring): ``settle`` decides their fate."""
        shared = self.shared
        timeout = shared.unit_timeout
        self.settle_by = trio.current_time() + timeout
        tokens = await unit_tokens(shared.units, timeout * RESTART_GRACE, silent=SILENT)
        old = shared.state
        unsettled = [
            u
            for u, token in tokens.items()
            if token == SILENT and shared.known.get(u) is not None and old is not None
        ]
        for unit, token in tokens.items():
            if token == SILENT and unit not in unsettled:
                tokens[unit] = None  # down before and still silent: nothing to wait for
        # only the units still on the incarnation the state knew: one that did not answer its
        # token, or changed it, is lost whatever else it says (no second wait on a dead unit)
        same = {u: ref for u, ref in shared.units.items() if tokens[u] == shared.known.get(u)}
        stale = set(await shared.outbox.flush(same, shared.known, timeout))
        lost = [
            u
            for u in shared.units
            if u in stale or (tokens[u] != shared.known.get(u) and u not in unsettled)
        ]
        parts = [Inventory(topics=tuple(_record(m) for m in shared.watermarks.values()))]
        for unit in unsettled:  # as the last state had it: its own report may never come
            assert old is not None
            parts.append(old.export_inventory(unit))
        for unit in shared.units:
            if unit in lost or unit in unsettled or tokens[unit] is None:
                continue  # lost, unsettled, or down before and still silent
            try:
                with trio.fail_after(timeout):
                    inv: U.UnitInventory = await shared.units[unit].ask(U.GetInventory())
            except (ActorCrashed, trio.TooSlowError, TransferQueueError):
                lost.append(unit)
                continue
            if inv.incarnation != shared.known.get(unit):
                lost.append(unit)
                continue
            parts.append(inventory_of(unit, inv))
        # From here on nothing awaits: a crash cannot split the losses from their report.
        losses = tuple(
            old.storage_lost(u) for u in lost if old is not None and shared.known.get(u) is not None
        )
        state, update = ControllerState.from_inventory(
            shared.specs.values(),
            list(shared.units),
            Inventory.merge(parts),
            epoch=epoch,
            now=trio.current_time(),
        )
        shared.state = state
        for unit in lost:  # down until the watcher has reset the unit (whatever it holds now
            self.dropped(unit)  # is not what the state knew) and adopts it: in the background,
            self.adopt(state, unit, None)  # so that a dead unit never delays serving the others
        for unit in unsettled:  # nothing new goes there until it answers
            state.set_unit_up(unit, False)
            self.unsettled.add(unit)
        if lost:
            self.check()
        log.info(
            "controller rebuilt (epoch %d); units lost meanwhile: %s; unsettled: %s",
            epoch,
            lost,
            unsettled,
        )
        return Rebuilt(state, update, losses)

    async def settle(self, ctx: ActorContext[Any]) -> None:
        """The settle task: each unsettled unit's token, awaited until ``settle_by``, sent to
        the controller (``UnitSettled``) to keep the unit or report it lost."""
        units = {u: self.shared.units[u] for u in self.unsettled}
        if not units:
            return
        left = max(self.settle_by - trio.current_time(), 0.0)
        tokens = await unit_tokens(units, left)  # None: crashed, or silent until settle_by
        for unit, token in tokens.items():
            await ctx.self.send(UnitSettled(unit, token))

    def unit_settled(
        self, state: ControllerState, msg: UnitSettled, lost: Callable[[Loss], None]
    ) -> None:
        """An unsettled unit answered its known incarnation in time (kept, placed on again),
        or not: what it held is dropped and ``lost`` is called with it; the watcher then
        resets and adopts it if it is back."""
        if msg.unit not in self.unsettled:
            return  # the watcher saw it change meanwhile: settled there
        self.unsettled.discard(msg.unit)
        if msg.token is not None and msg.token == self.shared.known.get(msg.unit):
            state.set_unit_up(msg.unit, True)
            log.info("storage unit %s answered the restarted controller: kept", msg.unit)
            return
        self.unit_seen(state, UnitSeen(msg.unit, None), lost)
        self.check()

    async def reset(self, unit: str) -> str | None:
        """Have ``unit`` drop everything it holds; its new token (``None``: it did not answer)."""
        try:
            with trio.fail_after(self.shared.unit_timeout):
                token: str = await self.shared.units[unit].ask(U.Reset())
                return token
        except (ActorCrashed, trio.TooSlowError):
            return None

    def adopt(self, state: ControllerState, unit: str, token: str | None) -> None:
        """``unit`` is now incarnation ``token`` (empty), or down (``None``)."""
        self.shared.known[unit] = token
        state.set_unit_up(unit, token is not None)
        if token is not None:  # a fresh, empty incarnation: give it the watermarks again
            for info in self.shared.watermarks.values():
                self.delivery.send(unit, info)
            orphans = self.shared.outbox.orphans.pop(unit, None)
            if orphans:  # and the segments of told stores its predecessor never took
                self.delivery.send(unit, U.Unlink(orphans))

    def dropped(self, unit: str) -> None:
        """``unit``'s bookkeeping went with its incarnation: wake those who wait for it."""
        self.locations.drop_unit(unit)
        self.shared.outbox.drop(unit)
        self.delivery.wake()

    def unit_seen(
        self, state: ControllerState, msg: UnitSeen, lost: Callable[[Loss], None]
    ) -> None:
        """The watcher saw ``msg.unit`` on incarnation ``msg.token``: if the one the controller
        knew is gone, its samples are dropped and ``lost`` is called with them (before the
        fresh incarnation, if any, is adopted)."""
        known = self.shared.known
        old = known.get(msg.unit)
        if msg.token is not None and self.adopting.get(msg.unit) == msg.token:
            del self.adopting[msg.unit]
        if old == msg.token:
            return
        self.unsettled.discard(msg.unit)  # its fate is settled here
        if old is not None:
            loss = state.storage_lost(msg.unit)
            self.dropped(msg.unit)
            known[msg.unit] = None
            state.set_unit_up(msg.unit, False)
            lost(loss)
        if msg.token is not None:
            self.adopt(state, msg.unit, msg.token)
            log.info("storage unit %s is back (empty)", msg.unit)

    def missing_stores(self, state: ControllerState) -> Iterator[MissingStores]:
        """The live samples of told stores their unit could not take (the segment went before
        the store arrived: e.g. the unit swept it after ``shm_orphan_age`` while the store
        waited in the outbox), to drop and report lost, never to serve from a hole. One at a
        time: each is located in the state as the caller left it after the previous one."""
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
                if lost:
                    gids = tuple(sorted({where[i][0] for i in lost}))
                    yield MissingStores(unit, topic, lost, gids)

    def problems(self, state: ControllerState) -> list[str]:
        """What is inconsistent, in words (empty: nothing): ``known`` names every unit, the
        state avoids exactly the units of unknown incarnation and the unsettled ones (whose
        incarnation is known), and a unit being adopted waits for another incarnation than the
        one known."""
        out = []
        known = self.shared.known
        if set(known) != set(self.shared.units):
            out.append(f"5: known units {sorted(known)}, units {sorted(self.shared.units)}")
        unknown = {u for u, token in known.items() if token is None}
        if unknown & self.unsettled:
            out.append(
                f"5: unsettled units of unknown incarnation {sorted(unknown & self.unsettled)}"
            )
        avoided = unknown | self.unsettled
        if state.units_down() != avoided:
            out.append(f"5: units down {sorted(state.units_down())}, avoided {sorted(avoided)}")
        for unit, token in self.adopting.items():
            if unit not in self.shared.units or token == known.get(unit):
                out.append(f"6: unit {unit!r} is adopted as an incarnation it is known as")
        return out

    async def watch(self, ctx: ActorContext[Any]) -> None:
        """The unit watcher task: every ``unit_check_interval`` (or when asked), each unit's
        incarnation; a changed one is reported (``UnitSeen``) and a fresh one reset first."""
        shared = self.shared
        while True:
            with trio.move_on_after(shared.unit_check_interval):
                await self.check_now.wait()
            self.check_now = trio.Event()
            tokens = await unit_tokens(shared.units, shared.unit_timeout, silent=SILENT)
            for unit, token in tokens.items():
                if token == SILENT:  # busy is not dead: lost only on evidence (a crash, a
                    self._silent(unit)  # new token), never on one slow answer
                    continue
                if self.silent.pop(unit, None) is not None:
                    log.info("storage unit %s answers again", unit)
                if token == shared.known.get(unit) or token == self.adopting.get(unit):
                    continue
                if shared.known.get(unit) is not None:
                    await ctx.self.send(UnitSeen(unit, None))  # its data is gone: report it
                if token is not None:  # back: make sure it holds nothing from before
                    fresh = await self.reset(unit)
                    if fresh is not None:
                        self.adopting[unit] = fresh
                        await ctx.self.send(UnitSeen(unit, fresh))

    def _silent(self, unit: str) -> None:
        """``unit`` did not answer its token in ``unit_timeout``: said once per silence."""
        if unit not in self.silent:
            self.silent[unit] = trio.current_time()
            log.warning(
                "storage unit %s did not answer in %.1f s: not presumed lost (it may be busy)",
                unit,
                self.shared.unit_timeout,
            )


SILENT = "?"  # a unit's token in ``unit_tokens`` when it did not answer in time (no token is)


def _record(info: U.TopicInfo) -> TopicRecord:
    return TopicRecord(info.topic, info.latest_version, info.next_index, info.next_group_id)


async def unit_tokens(
    units: Mapping[str, ActorRef[Any]], timeout: float, *, silent: str | None = None
) -> dict[str, str | None]:
    """Every unit's incarnation token, asked concurrently: ``None`` for a unit that is gone
    (crashed, its node lost), ``silent`` for one that did not answer within ``timeout``."""
    out: dict[str, str | None] = dict.fromkeys(units)

    async def one(unit: str, ref: ActorRef[Any]) -> None:
        try:
            with trio.fail_after(timeout):
                out[unit] = await ref.ask(U.GetToken())
        except ActorCrashed:
            out[unit] = None
        except trio.TooSlowError:
            out[unit] = silent

    async with trio.open_nursery() as nursery:
        for unit, ref in units.items():
            nursery.start_soon(one, unit, ref)
    return out


def inventory_of(unit: str, inv: U.UnitInventory) -> Inventory:
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
