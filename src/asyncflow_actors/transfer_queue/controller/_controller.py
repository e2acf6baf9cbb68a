"""The controller actor: the TransferQueue's control plane around ``ControllerState``.

It owns the state machine and does what the state cannot: it parks puts while a topic is full
and claims until enough samples qualify (deferred replies, so a waiting request never blocks
others), expires leases and abandoned writes on time, forwards to the storage units what they
keep for a rebuild (``Delivery``: kept until each unit has taken it), watches the units
(``Recovery``), and rebuilds its own state from their inventories when it is restarted
(``ControllerShared`` outlives an incarnation). Everything it must report (evictions, losses,
abandoned writes) becomes a numbered ``TQEvent``. Each message type has one handler, named in
one table (``Controller.handlers``): adding a message means adding its handler there.

Invariants of the bookkeeping maps (hold between any two messages; ``check_invariants``):

1. ``grants`` maps claim ids to lease ids and back as one map read both ways: a granted claim
   names one lease, and that lease names it back (``Grants.problems``).
2. Every granted lease is outstanding in the state: a lease that ends (ack, nack, expiry,
   holder released) leaves ``grants`` in the same message (``_apply``).
3. A claim id is either waiting (``claims``) or granted, never both; the waiting claims'
   index and their per-kind queues agree (``ClaimQueues.problems``).
4. Every waiting put (``puts``) waits under its own topic, and a put id is either waiting or
   granted, never both (``PutQueues.problems``); the granted puts and the remembered replies
   (``shared.done``) stay bounded.
5. ``shared.known`` names every unit, and the units the state places nothing on are exactly
   those whose incarnation is unknown (``known[unit] is None``: down, or not adopted yet) and
   the unsettled ones (known, silent since a restart: ``recovery.unsettled``).
6. A unit being adopted (``recovery.adopting``) is one of the units, and the fresh incarnation
   it waits for is not the one ``known`` holds (5 and 6: ``Recovery.problems``).
7. The state's own bookkeeping is consistent (``ControllerState.check_invariants``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio

from .. import _messages as M
from .._errors import TransferQueueError, unexpected
from .._results import Loss
from .._runtime import ActorContext, Request
from ..state._state import ControllerState
from ._base import Ctx, log
from ._claiming import Claiming
from ._delivery import Delivered
from ._puts import WaitingPut, slots_of
from ._putting import Putting
from ._recovery import UnitSeen, UnitSettled, unit_tokens
from ._shared import REMEMBERED, ControllerShared
from ._timer import Tick

Handler = Callable[[Any, Ctx, ControllerState], Any]


class Controller(Putting, Claiming):
    """See the module docstring. Create it with ``Controller(shared)``."""

    mailbox_size = 1024

    def __init__(self, shared: ControllerShared) -> None:
        super().__init__(shared)
        self.handlers: dict[type, Handler] = {
            M.Commit: self._commit,
            M.Claim: self._claim,
            M.Ack: self._on_ack,
            M.Allocate: self._on_put,
            M.OpenGroups: self._on_put,
            M.CommitSharedGroups: self._on_commit_shared_groups,
            M.CancelClaim: lambda msg, ctx, state: self._cancel_claim(state, msg.claim_id),
            M.CancelPut: lambda msg, ctx, state: self._cancel_put(state, msg.put_id),
            M.Nack: self._on_nack,
            M.Renew: lambda msg, ctx, state: state.renew(msg.lease_id, trio.current_time()),
            M.SetVersion: self._on_set_version,
            M.Discard: self._on_discard,
            M.ShrinkGroup: self._on_shrink_group,
            M.ReleaseHolder: self._on_release_holder,
            M.WaitEvents: self._on_wait_events,
            M.CancelWait: lambda msg, ctx, state: self.waiters.cancel(msg.wait_id),
            M.CreateTopic: self._on_create_topic,
            M.GetTopology: self._on_get_topology,
            M.GetControllerStatistics: lambda msg, ctx, state: self._statistics(state),
            M.CheckUnits: lambda msg, ctx, state: self.recovery.check(),
            M.AwaitStores: self._on_await_stores,
            M.Flushed: self._on_flushed,
            M.CheckInvariants: lambda msg, ctx, state: tuple(self.check_invariants()),
            Delivered: self._on_delivered,
            Tick: self._on_tick,
            UnitSeen: lambda msg, ctx, state: self.recovery.unit_seen(state, msg, self._lost),
            UnitSettled: self._on_unit_settled,
        }

    # -- lifecycle -------------------------------------------------------------------------------

    async def on_start(self, ctx: ActorContext[Any]) -> None:
        shared = self.shared
        self.epoch = shared.incarnations
        shared.incarnations += 1
        if shared.state is None:
            tokens = await unit_tokens(shared.units, shared.unit_timeout)
            self.state = ControllerState(shared.specs.values(), list(shared.units), epoch=0)
            shared.state = self.state
            shared.known.update(tokens)
            for unit, token in tokens.items():
                self.state.set_unit_up(unit, token is not None)
        else:
            rebuilt = await self.recovery.rebuild(self.epoch)  # serves before a silent unit
            self.state = rebuilt.state
            self._apply(rebuilt.update)
            for loss in rebuilt.losses:
                self._report_loss(loss)
        ctx.start_soon(self.timer.run, ctx)
        ctx.start_soon(self.recovery.watch, ctx)
        ctx.start_soon(self.delivery.run, ctx)
        ctx.start_soon(self.recovery.settle, ctx)  # the units silent at the rebuild

    # -- dispatch --------------------------------------------------------------------------------

    async def receive(self, msg: Any, ctx: ActorContext[Any]) -> Any:
        state = self.state
        assert state is not None
        try:
            handler = self.handlers.get(type(msg))
            return None if handler is None else handler(msg, ctx, state)
        except TransferQueueError as exc:  # bad input: answer it, keep running
            if isinstance(msg, Request):
                ctx.reply_error(exc)
            else:
                log.warning("controller: %r failed: %s", msg, exc)
            return None
        except Exception as exc:  # a request no check foresaw: answer it too; a crash would
            # return every lease and stall every client for a rebuild, for one bad message
            log.exception("controller: %s failed", type(msg).__name__)
            if isinstance(msg, Request):
                ctx.reply_error(unexpected(msg, exc))
            return None
        finally:
            self.waiters.serve()  # one batch per message: events of one change arrive together

    def _on_ack(self, msg: M.Ack, ctx: Ctx, state: ControllerState) -> Any:
        if msg.request_id in self.shared.done:
            return self.shared.done[msg.request_id]
        missing = self._end_lease(state, msg.lease_id, msg.holder, ack=True)
        self.shared.remember(msg.request_id, missing)
        return missing

    def _on_nack(self, msg: M.Nack, ctx: Ctx, state: ControllerState) -> None:
        self._end_lease(state, msg.lease_id, None, ack=False)

    def _on_put(self, msg: M.Allocate | M.OpenGroups, ctx: Ctx, state: ControllerState) -> Any:
        size = slots_of(msg)
        if size == 0:  # members of an open group use its reserved slots: never wait
            return self._put(state, msg)
        waiting = self.puts.queue(msg.topic)
        if self._fits(state, msg.topic, size) and not waiting:  # CapacityError: never
            return self._put(state, msg)
        waiting.append(WaitingPut(msg, ctx.defer_reply()))
        if msg.topic in self.shared.outbox.deleting:
            self.delivery.hurry()  # the slots it waits for free once units took deletes
        return None

    def _on_commit_shared_groups(
        self, msg: M.CommitSharedGroups, ctx: Ctx, state: ControllerState
    ) -> None:
        state.commit_shared_groups(msg.topic, msg.columns)
        self._group_infos(msg.topic, tuple(msg.columns))
        self._kick(msg.topic)

    def _on_set_version(self, msg: M.SetVersion, ctx: Ctx, state: ControllerState) -> None:
        self._apply(state.set_latest_version(msg.topic, msg.version))
        self._records(msg.topic)
        self._kick(msg.topic)

    def _on_discard(self, msg: M.Discard, ctx: Ctx, state: ControllerState) -> Any:
        if msg.undo:  # ``put_id`` names the failed put (its commit may be remembered)
            self.puts.pop_granted(msg.put_id)
            return self._discard(state, msg)
        if msg.put_id in self.shared.done:  # a retry (the controller restarted before the
            return self.shared.done[msg.put_id]  # reply): its samples are gone already
        missing = self._discard(state, msg)
        self.shared.remember(msg.put_id, missing)
        return missing

    def _on_shrink_group(self, msg: M.ShrinkGroup, ctx: Ctx, state: ControllerState) -> None:
        if msg.request_id not in self.shared.done:
            self._apply(state.shrink_group(msg.topic, msg.group_id, msg.slots))
            self._group_infos(msg.topic, (msg.group_id,))
            self.shared.remember(msg.request_id, None)
            self._kick(msg.topic)

    def _on_release_holder(self, msg: M.ReleaseHolder, ctx: Ctx, state: ControllerState) -> None:
        self._withdraw(msg.holder)
        self._apply(state.release_holder(msg.holder))
        self._kick_all()

    def _on_delivered(self, msg: Delivered, ctx: Ctx, state: ControllerState) -> None:
        for miss in self.recovery.missing_stores(state):
            self.locations.drop(miss.topic, miss.indexes)
            self._apply(state.lose(miss.topic, miss.indexes))
            self._group_infos(miss.topic, miss.group_ids)
            self.lost_samples += len(miss.indexes)
            detail = f"unit {miss.unit}: its segment was gone"
            self._event("lost", miss.topic, miss.group_ids, miss.indexes, detail)
            log.warning(
                "unit %s lost told stores of %s %s", miss.unit, miss.topic, miss.indexes[:8]
            )
            self._kick(miss.topic)
        self._stores_taken(state)
        for topic in self.puts.topics():
            self._retry_puts(topic)

    def _on_unit_settled(self, msg: UnitSettled, ctx: Ctx, state: ControllerState) -> None:
        self.recovery.unit_settled(state, msg, self._lost)
        self._kick_all()  # kept: puts may be placed there again

    def _on_tick(self, msg: Tick, ctx: Ctx, state: ControllerState) -> None:
        self._apply(state.expire(trio.current_time()))
        self._kick_all()

    def _on_wait_events(self, msg: M.WaitEvents, ctx: Ctx, state: ControllerState) -> None:
        self.waiters.add(msg.wait_id, msg.since, ctx.defer_reply())

    def _on_create_topic(self, msg: M.CreateTopic, ctx: Ctx, state: ControllerState) -> None:
        state.add_topic(msg.spec)
        self.shared.specs[msg.spec.name] = msg.spec

    def _on_get_topology(self, msg: M.GetTopology, ctx: Ctx, state: ControllerState) -> M.Topology:
        shared = self.shared
        return M.Topology(
            dict(shared.specs), dict(shared.units), shared.shm_min_bytes, shared.io_timeout
        )

    def _on_await_stores(self, msg: M.AwaitStores, ctx: Ctx, state: ControllerState) -> None:
        marks = self.delivery.marks(msg.units)
        if marks:
            self.delivery.hold(marks, ctx.defer_reply(), None)

    def _on_flushed(self, msg: M.Flushed, ctx: Ctx, state: ControllerState) -> None:
        if len(self.shared.outbox):
            self.delivery.await_empty(ctx.defer_reply())

    def _statistics(self, state: ControllerState) -> M.ControllerStatistics:
        return M.ControllerStatistics(
            state.statistics(),
            len(self.puts),
            len(self.claims),
            self.evicted_groups,
            self.lost_samples,
            self.shared.log.seq,
            self.epoch,
            tuple(sorted(state.units_down())),  # unknown incarnation, or unsettled
            event_waiters=len(self.waiters),
            abandoned_samples=self.abandoned_samples,
            outbox=len(self.shared.outbox),
            incarnations=dict(self.shared.known),
            holders=state.holders(self.claims.waiting(), self.puts.waiting_holders()),
        )

    def check_invariants(self) -> list[str]:
        """The module docstring's invariants, checked now: what is violated, in words (empty:
        nothing). For tests (it recounts the whole state)."""
        out: list[str] = []
        shared, state = self.shared, self.state
        if state is None:
            return ["the controller has no state (not started)"]
        out.extend(self.grants.problems({lease.id for lease in state.leases()}))
        both = self.claims.ids() & self.grants.claims()
        if both:
            out.append(f"3: claims both waiting and granted: {sorted(both)}")
        out.extend(f"3: {problem}" for problem in self.claims.problems())
        out.extend(f"4: {problem}" for problem in self.puts.problems())
        if len(shared.done) > REMEMBERED:
            out.append("4: the remembered replies outgrew their bound")
        out.extend(self.recovery.problems(state))
        out.extend(f"7: {problem}" for problem in state.check_invariants())
        return out

    # -- holders and losses ----------------------------------------------------------------------

    def _withdraw(self, holder: str) -> None:
        """``holder`` went away: its requests still waiting here go with its leases. A claim a
        killed incarnation left waiting would otherwise be granted the very samples its
        restarted successor's release returns, under a lease nobody acks before ``lease_ttl``;
        a waiting put would allocate for a writer that can never commit."""
        for waiting in self.claims.withdraw(holder):
            waiting.reply.fail(
                TransferQueueError(f"claim withdrawn: its holder {holder!r} was released")
            )
        for item in self.puts.withdraw(holder):
            item.reply.fail(
                TransferQueueError(f"put withdrawn: its holder {holder!r} was released")
            )

    def _lost(self, loss: Loss) -> None:
        """A unit lost its data (``Recovery``): report it, and wake who waits."""
        self._report_loss(loss)
        self._kick_all()

    # -- waking waiters --------------------------------------------------------------------------

    def _kick(self, topic: str, *, puts: bool = True) -> None:
        if puts:
            self._retry_puts(topic)
        self._retry_claims(topic)

    def _kick_all(self) -> None:
        for topic in set(self.puts.topics()) | set(self.claims.topics()):
            self._kick(topic)
