"""What every part of the controller actor shares (internal): its fields, and how the effects
of a state change leave it.

``ControllerBase`` holds the controller's state and bookkeeping (waiting puts and claims,
grants, the timer, delivery, recovery) and turns a state ``Update`` into what follows from it:
deletes and records queued for the storage units (``Delivery``), numbered events in the log.
``Putting`` and ``Claiming`` build on it; ``Controller`` composes them and dispatches messages.
"""

from __future__ import annotations

import logging
from typing import Any

from .. import _messages as M
from .. import _unit_messages as U
from .._results import Loss, Update
from .._runtime import Actor, ActorContext
from ..state._state import ControllerState
from ._claims import ClaimQueues
from ._delivery import Delivered, Delivery
from ._events import EventWaiters
from ._grants import Grants
from ._locations import Locations
from ._puts import PutQueues
from ._recovery import Recovery, UnitSeen, UnitSettled
from ._shared import ControllerShared
from ._timer import Tick, Timer

log = logging.getLogger("asyncflow_actors.transfer_queue")

Ctx = ActorContext[Any]


class ControllerBase(Actor[M.ControllerMessage | Tick | Delivered | UnitSeen | UnitSettled]):
    """The controller's fields and the effects of its state changes (see the module docstring)."""

    def __init__(self, shared: ControllerShared) -> None:
        self.shared = shared
        self.state: ControllerState | None = None
        self.epoch = 0
        self.puts = PutQueues()
        self.claims = ClaimQueues()
        self.grants = Grants()  # claim id <-> lease id, until the lease ends
        self.waiters = EventWaiters(shared.log)
        self.evicted_groups = 0
        self.lost_samples = 0
        self.abandoned_samples = 0
        self.timer = Timer(self._next_deadline)
        self.locations = Locations()  # rows put through shared memory (see ``_locations``)
        self.delivery = Delivery(shared, self.puts.waiting, self._check_units)
        self.recovery = Recovery(shared, self.delivery, self.locations)

    def _check_units(self) -> None:
        self.recovery.check()

    def _incarnations(self, units: Any) -> dict[str, str]:
        return {u: self.shared.known.get(u) or "" for u in units}

    # -- waking waiters (``Controller`` serves puts and claims) ------------------------------------

    def _kick(self, topic: str, *, puts: bool = True) -> None:
        """Serve what waits on ``topic``: its puts (unless ``puts`` is false), then its claims."""
        raise NotImplementedError

    def _kick_all(self) -> None:
        """Serve what waits on any topic."""
        raise NotImplementedError

    def _wake_timer(self, state: ControllerState) -> None:
        deadline = state.next_deadline()
        if deadline is not None:
            self.timer.deadline(deadline)

    # -- the effects of state changes ------------------------------------------------------------

    def _apply(self, update: Update) -> None:
        for release in update.releases:
            self.locations.drop(release.topic, release.indexes)
            self._to_unit(
                release.unit,
                U.Delete(release.topic, list(release.indexes), list(release.group_ids)),
            )
        for eviction in update.evictions:
            self.evicted_groups += len(eviction.group_ids)
            self._event(
                "evicted", eviction.topic, eviction.group_ids, eviction.indexes, eviction.reason
            )
        for gone in update.abandoned:
            self.abandoned_samples += len(gone.indexes)
            self._event("abandoned", gone.topic, gone.group_ids, gone.indexes, "writer gone")
            self._group_infos(gone.topic, gone.group_ids)
        self.grants.ended(update.ended)

    def _report_loss(self, loss: Loss) -> None:
        for lost in loss.lost:
            self.lost_samples += len(lost.indexes)
            self._event("lost", lost.topic, lost.group_ids, lost.indexes, f"unit {loss.unit}")
        if loss.lost:
            log.warning("storage unit %s lost: %s", loss.unit, loss.group_ids)

    def _to_unit(self, unit: str, item: Any) -> None:
        """Queue bookkeeping for a unit (``Delivery``); deletes go at once while puts wait for
        their slots, or soon will (see ``_delivery``)."""
        if not self.delivery.send(unit, item) or self.delivery.flush_waiters:
            return  # the unit is down, or nothing lingers anyway
        if isinstance(item, U.Delete) and (
            self.puts.waits(item.topic) or self.delivery.short(self.state, item.topic)
        ):
            self.delivery.hurry()  # counted once queued: the delete occupies its slots till taken

    def _group_infos(self, topic: str, gids: Any) -> None:
        assert self.state is not None
        self.delivery.group_infos(self.state, topic, gids)

    def _records(self, topic: str) -> None:
        assert self.state is not None
        self.delivery.records(self.state, topic)

    def _event(
        self, kind: str, topic: str, groups: tuple[int, ...], indexes: tuple[int, ...], detail: str
    ) -> None:
        self.shared.log.add(kind, topic, groups, indexes, detail)

    def _write_deadline(self, topic: str, now: float) -> None:
        ttl = self.shared.specs[topic].write_ttl
        if ttl is not None:
            self.timer.deadline(now + ttl)

    def _next_deadline(self) -> float | None:
        return self.state.next_deadline() if self.state is not None else None
