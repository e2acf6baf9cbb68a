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

import logging
from collections.abc import Callable
from typing import Any

import trio

from .. import _messages as M
from .. import _unit_messages as U
from .._errors import TransferQueueError, UnknownSample, unexpected
from .._results import GroupSlot, Loss, Update
from .._runtime import Actor, ActorContext, Request
from ..state._state import ControllerState
from ._claims import ClaimQueues, WaitingClaim
from ._delivery import Delivered, Delivery
from ._events import EventWaiters
from ._grants import Grants
from ._locations import Locations
from ._puts import Allocated, PutQueues, WaitingPut, slots_of
from ._recovery import Recovery, UnitSeen, UnitSettled, unit_tokens
from ._shared import REMEMBERED, ControllerShared
from ._timer import Tick, Timer

log = logging.getLogger("asyncflow_actors.transfer_queue")

Ctx = ActorContext[Any]
Handler = Callable[[Any, Ctx, ControllerState], Any]


class Controller(Actor[M.ControllerMessage | Tick | Delivered | UnitSeen | UnitSettled]):
    """See the module docstring. Create it with ``Controller(shared)``."""

    mailbox_size = 1024

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

    def _check_units(self) -> None:
        self.recovery.check()

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

    # -- puts ------------------------------------------------------------------------------------

    def _incarnations(self, units: Any) -> dict[str, str]:
        return {u: self.shared.known.get(u) or "" for u in units}

    def _put(self, state: ControllerState, msg: M.Allocate | M.OpenGroups) -> Any:
        now = trio.current_time()
        if isinstance(msg, M.OpenGroups):
            slots = state.open_groups(msg.topic, msg.sizes, holder=msg.holder, now=now)
            self._group_infos(msg.topic, tuple(s.group_id for s in slots))
            self._records(msg.topic)
            self.puts.grant(msg.put_id, slots)
            self._write_deadline(msg.topic, now)
            return M.OpenedGroups(slots, self._incarnations({s.unit for s in slots}))
        allocation = state.allocate(
            msg.topic,
            msg.n,
            msg.version,
            group=msg.group,
            lengths=msg.lengths,
            holder=msg.holder,
            now=now,
        )
        # every unit keeps the watermarks: a rebuild must never reuse an index, even if the
        # unit that held the newest samples is gone
        self._records(msg.topic)
        self.puts.grant(msg.put_id, Allocated(allocation, msg.group))
        self._write_deadline(msg.topic, now)
        self._kick(msg.topic, puts=False)
        units = set(allocation.units)
        free = self.shared.outbox.free
        hints = {u: free[u] for u in units if free.get(u)}
        return M.Placed(allocation, self._incarnations(units), hints)

    def _fits(self, state: ControllerState, topic: str, size: int) -> bool:
        """Whether ``size`` slots fit now: the capacity counts live samples, reserved group
        slots, and freed samples whose deletion their unit has not taken yet (so it bounds
        what the units hold). Raises ``CapacityError`` if ``size`` can never fit."""
        if not state.can_allocate(topic, size):
            return False
        free = state.free_slots(topic)
        return free is None or free - self.shared.outbox.deleting.get(topic, 0) >= size

    def _commit(self, msg: M.Commit, ctx: Ctx, state: ControllerState) -> None:
        if msg.put_id and msg.put_id in self.shared.done:
            return  # a retry: the first commit went through
        known = self.shared.known
        for unit, store in msg.stores.items():
            if unit not in self.shared.units or known.get(unit) != store.incarnation:
                raise UnknownSample(msg.topic, store.indexes)  # that incarnation is gone
        state.commit_write(msg.topic, msg.indexes, msg.columns)
        for unit, store in msg.stores.items():  # before its Committed and any Delete
            self._to_unit(unit, store)
        if not msg.new:
            self.locations.drop(msg.topic, msg.indexes)  # rewritten cells lie elsewhere now
        for unit, located in msg.located.items():
            self.locations.add(msg.topic, unit, located)
        if msg.new:
            granted = self.puts.pop_granted(msg.put_id)
            if isinstance(granted, Allocated) and granted.allocation.indexes == msg.indexes:
                # placed as allocated (no lookup); only an explicit group has a record to send
                pairs: Any = zip(msg.indexes, granted.allocation.units, strict=True)
                group = granted.group
                gids: Any = () if group is None else dict.fromkeys(_as_tuple(group))
            else:  # allocated by an earlier incarnation
                where = state.locate(msg.topic, msg.indexes)
                pairs = ((index, unit) for index, (_, unit) in where.items())
                gids = {gid for gid, _ in where.values()}
            placed: dict[str, list[int]] = {}
            for index, unit in pairs:
                placed.setdefault(unit, []).append(index)
            for unit, indexes in placed.items():
                self._to_unit(unit, U.Committed(msg.topic, indexes))
            self._group_infos(msg.topic, gids)
            self.shared.remember(msg.put_id, None)
        self._kick(msg.topic)

    def _cancel_put(self, state: ControllerState, put_id: int) -> None:
        item = self.puts.cancel(put_id)
        if item is not None:
            item.reply.fail(TransferQueueError(f"put {put_id} cancelled by its writer"))
            return
        granted = self.puts.pop_granted(put_id)
        if granted is None:
            return
        if isinstance(granted, tuple):  # groups opened, but the writer never saw them
            slots: tuple[GroupSlot, ...] = granted
            for slot in slots:
                topic, gid = slot.topic, slot.group_id
                try:
                    self._apply(state.shrink_group(topic, gid, slot.size))
                    self._group_infos(topic, (gid,))
                except TransferQueueError:
                    pass  # already used or gone
            self._kick(slots[0].topic)
        else:  # allocated, but the writer never saw the indexes
            allocation = granted.allocation
            self._discard(
                state, M.Discard(allocation.topic, allocation.indexes, missing_ok=True, undo=True)
            )

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

    def _retry_puts(self, topic: str) -> None:
        state = self.state
        waiting = self.puts.waiting.get(topic)
        assert state is not None
        while waiting:
            head = waiting[0]
            if not self._fits(state, topic, slots_of(head.msg)):
                return  # FIFO: later puts wait behind the head
            waiting.popleft()
            try:
                head.reply.send(self._put(state, head.msg))
            except TransferQueueError as exc:
                head.reply.fail(exc)

    # -- claims ----------------------------------------------------------------------------------

    def _claim(self, msg: M.Claim, ctx: Ctx, state: ControllerState) -> Any:
        leased = self._try_claim(state, msg)
        if leased is not None:
            marks = self._store_marks(msg, leased)
            if not marks:
                return leased
            self.delivery.hold(marks, ctx.defer_reply(), leased)
            return None
        if not msg.wait:
            return None
        self.claims.add(WaitingClaim(msg, ctx.defer_reply()), state.changes(msg.topic))
        self._wake_timer(state)  # a claim held back for groups about to go stale: till when
        return None

    def _store_marks(self, msg: M.Claim, leased: M.Leased) -> dict[str, int]:
        """The told stores to wait for before the claimant may ask the units of its lease:
        none for units whose rows it maps from shared memory without asking."""
        units = [u for u in leased.lease.placement if u not in leased.located or u not in msg.maps]
        return self.delivery.marks(units)

    def _try_claim(self, state: ControllerState, msg: M.Claim) -> M.Leased | None:
        lease = state.claim(
            msg.topic,
            msg.consumer,
            msg.columns,
            msg.count,
            holder=msg.holder,
            now=trio.current_time(),
            sampler=msg.sampler,
            min_count=msg.min_count,
            share_key=msg.share_key,
            share_count=msg.share_count,
        )
        if lease is None:
            return None
        self.grants.add(msg.claim_id, lease.id)
        self.timer.deadline(lease.deadline)
        located = self.locations.of_lease(lease, self.shared.specs[lease.topic])
        return M.Leased(lease, self._incarnations(lease.placement), located)

    def _retry_claims(self, topic: str) -> None:
        state = self.state
        assert state is not None

        def attempt(waiting: WaitingClaim) -> bool:
            try:
                leased = self._try_claim(state, waiting.msg)
            except TransferQueueError as exc:
                waiting.reply.fail(exc)
                return True
            if leased is None:
                return False
            marks = self._store_marks(waiting.msg, leased)
            if marks:
                self.delivery.hold(marks, waiting.reply, leased)
            elif not waiting.reply.send(leased):  # the claimant is gone: give the samples back
                self._apply(state.nack(leased.lease.id))
            return True

        self.claims.serve(topic, state.changes(topic), attempt)
        if len(self.claims):
            self._wake_timer(state)

    def _wake_timer(self, state: ControllerState) -> None:
        deadline = state.next_deadline()
        if deadline is not None:
            self.timer.deadline(deadline)

    def _stores_taken(self, state: ControllerState) -> None:
        """Send the held replies whose units took their stores (or were declared lost)."""
        for reply, value in self.delivery.taken():
            if not reply.send(value) and isinstance(value, M.Leased):
                try:  # the claimant is gone: give the samples back
                    self._apply(state.nack(value.lease.id))
                except TransferQueueError:
                    pass  # it ended already (its claim was cancelled)
                self._kick(value.lease.topic)

    def _cancel_claim(self, state: ControllerState, claim_id: int) -> None:
        waiting = self.claims.pop(claim_id)
        if waiting is not None:
            waiting.reply.fail(TransferQueueError(f"claim {claim_id} cancelled by its claimant"))
            return
        lease_id = self.grants.cancel(claim_id)
        if lease_id is not None:  # granted, but the claimant never saw it
            try:
                self._apply(state.nack(lease_id))
            except TransferQueueError:
                pass  # it ended already
            self._kick_all()

    def _end_lease(
        self, state: ControllerState, lease_id: int, holder: str | None, *, ack: bool
    ) -> tuple[int, ...]:
        lease = state.lease(lease_id)
        update = state.ack(lease_id, holder=holder) if ack else state.nack(lease_id)
        self._apply(update)
        if ack and lease_id in update.ended:
            for unit, indexes in lease.placement.items():
                self._to_unit(unit, U.MarkConsumed(lease.topic, lease.consumer, list(indexes)))
        if update.missing:
            self._event("missing", lease.topic, (), update.missing, f"lease {lease_id}")
        self._kick(lease.topic)
        return update.missing

    # -- the rest of the state changes -----------------------------------------------------------

    def _discard(self, state: ControllerState, msg: M.Discard) -> tuple[int, ...]:
        indexes, missing = list(msg.indexes), tuple[int, ...]()
        if msg.missing_ok:
            try:
                state.locate(msg.topic, indexes)
            except UnknownSample as exc:
                missing = exc.indexes
                indexes = [i for i in indexes if i not in set(missing)]
            if not indexes:
                return missing
        located = state.locate(msg.topic, indexes)
        drop = state.unallocate if msg.undo else state.discard
        self._apply(drop(msg.topic, indexes))
        self._group_infos(msg.topic, {gid for gid, _ in located.values()})
        self._kick(msg.topic)
        return missing

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

    def _lost(self, loss: Loss) -> None:
        """A unit lost its data (``Recovery``): report it, and wake who waits."""
        self._report_loss(loss)
        self._kick_all()

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

    # -- waking waiters --------------------------------------------------------------------------

    def _kick(self, topic: str, *, puts: bool = True) -> None:
        if puts:
            self._retry_puts(topic)
        self._retry_claims(topic)

    def _kick_all(self) -> None:
        for topic in set(self.puts.topics()) | set(self.claims.topics()):
            self._kick(topic)

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


def _as_tuple(group: int | tuple[int, ...]) -> tuple[int, ...]:
    return group if isinstance(group, tuple) else (group,)
