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

1. ``granted`` (claim id -> lease id) and ``granted_by_lease`` (lease id -> claim id) are one
   map read both ways: a granted claim names one lease, and that lease names it back.
2. Every lease in ``granted_by_lease`` is outstanding in the state: a lease that ends (ack,
   nack, expiry, holder released) leaves both maps in the same message (``_apply``).
3. A claim id is either waiting (``claims``) or granted, never both; the waiting claims'
   index and their per-kind queues agree (``ClaimQueues.problems``).
4. Every waiting put (``puts[topic]``) is for that topic, and a put id is either waiting or
   granted (``granted_puts``), never both. ``granted_puts`` and ``shared.done`` stay bounded.
5. ``shared.known`` names every unit, and the state places nothing on exactly the units whose
   incarnation is unknown (``known[unit] is None``: down or not adopted yet).
6. A unit being adopted (``recovery.adopting``) is one of the units, and the fresh incarnation
   it waits for is not the one ``known`` holds.
7. The state's own bookkeeping is consistent (``ControllerState.check_invariants``).
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

import attrs
import trio

from .. import _messages as M
from .. import _unit_messages as U
from .._errors import TransferQueueError, UnknownSample
from .._results import Allocation, GroupSlot, Lease, Loss, Update
from .._runtime import Actor, ActorContext, Reply, Request
from ..state._state import ControllerState
from ._claims import ClaimQueues, WaitingClaim
from ._delivery import Delivered, Delivery
from ._events import EventWaiters
from ._locations import Locations
from ._recovery import Recovery, UnitSeen, unit_tokens
from ._shared import REMEMBERED, ControllerShared

log = logging.getLogger("asyncflow_actors.transfer_queue")

_RESERVE = 4096  # ids reserved ahead per watermark update (see Controller._records)

Handler = Callable[[Any, ActorContext[Any], ControllerState], Any]


@attrs.frozen
class _Tick:
    """Self-message from the timer: expire what is due."""


@attrs.frozen
class _Allocated:
    """An allocation granted to a put (``group``: the open group it joined, if any)."""

    allocation: Allocation
    group: int | tuple[int, ...] | None


@attrs.define(eq=False)
class _WaitingPut:
    msg: M.Allocate | M.OpenGroups
    reply: Reply


class Controller(Actor[M.ControllerMessage | _Tick | Delivered | UnitSeen]):
    """See the module docstring. Create it with ``Controller(shared)``."""

    mailbox_size = 1024

    def __init__(self, shared: ControllerShared) -> None:
        self.shared = shared
        self.state: ControllerState | None = None
        self.epoch = 0
        self.puts: dict[str, deque[_WaitingPut]] = {}
        self.claims = ClaimQueues()
        self.granted: dict[int, int] = {}  # claim id -> lease id, until the lease ends
        self.granted_by_lease: dict[int, int] = {}
        self.granted_puts: OrderedDict[int, Any] = OrderedDict()  # put id -> _Allocated | slot
        self.waiters = EventWaiters(shared.log)
        self.evicted_groups = 0
        self.lost_samples = 0
        self.abandoned_samples = 0
        self.timer_wake = trio.Event()
        self.timer_at = math.inf  # the deadline the timer sleeps until
        self.locations = Locations()  # rows put through shared memory (see ``_locations``)
        self.delivery = Delivery(shared, self.puts, self._check_units)
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
            _Tick: self._on_tick,
            UnitSeen: lambda msg, ctx, state: self.recovery.unit_seen(state, msg, self._lost),
        }

    # -- lifecycle -------------------------------------------------------------------------------

    async def on_start(self, ctx: ActorContext[Any]) -> None:
        shared = self.shared
        self.epoch = shared.incarnations
        shared.incarnations += 1
        tokens = await unit_tokens(shared.units, shared.unit_timeout)
        if shared.state is None:
            self.state = ControllerState(shared.specs.values(), list(shared.units), epoch=0)
            shared.state = self.state
            shared.known.update(tokens)
            for unit, token in tokens.items():
                self.state.set_unit_up(unit, token is not None)
        else:
            rebuilt = await self.recovery.rebuild(tokens, self.epoch)
            self.state = rebuilt.state
            self._apply(rebuilt.update)
            for loss in rebuilt.losses:
                self._report_loss(loss)
        ctx.start_soon(self._timer, ctx)
        ctx.start_soon(self.recovery.watch, ctx)
        ctx.start_soon(self.delivery.run, ctx)

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
        finally:
            self.waiters.serve()  # one batch per message: events of one change arrive together

    def _on_ack(self, msg: M.Ack, ctx: ActorContext[Any], state: ControllerState) -> Any:
        if msg.request_id in self.shared.done:
            return self.shared.done[msg.request_id]
        missing = self._end_lease(state, msg.lease_id, msg.holder, ack=True)
        self.shared.remember(msg.request_id, missing)
        return missing

    def _on_nack(self, msg: M.Nack, ctx: ActorContext[Any], state: ControllerState) -> None:
        self._end_lease(state, msg.lease_id, None, ack=False)

    def _on_put(
        self, msg: M.Allocate | M.OpenGroups, ctx: ActorContext[Any], state: ControllerState
    ) -> Any:
        size = _slots(msg)
        if size == 0:  # members of an open group use its reserved slots: never wait
            return self._put(state, msg)
        waiting = self.puts.setdefault(msg.topic, deque())
        if self._fits(state, msg.topic, size) and not waiting:  # CapacityError: never
            return self._put(state, msg)
        waiting.append(_WaitingPut(msg, ctx.defer_reply()))
        if msg.topic in self.shared.outbox.deleting:
            self.delivery.hurry()  # the slots it waits for free once units took deletes
        return None

    def _on_commit_shared_groups(
        self, msg: M.CommitSharedGroups, ctx: ActorContext[Any], state: ControllerState
    ) -> None:
        state.commit_shared_groups(msg.topic, msg.columns)
        self._group_infos(msg.topic, tuple(msg.columns))
        self._kick(msg.topic)

    def _on_set_version(
        self, msg: M.SetVersion, ctx: ActorContext[Any], state: ControllerState
    ) -> None:
        self._apply(state.set_latest_version(msg.topic, msg.version))
        self._records(msg.topic)
        self._kick(msg.topic)

    def _on_discard(self, msg: M.Discard, ctx: ActorContext[Any], state: ControllerState) -> Any:
        self.granted_puts.pop(msg.put_id, None)
        return self._discard(state, msg)

    def _on_shrink_group(
        self, msg: M.ShrinkGroup, ctx: ActorContext[Any], state: ControllerState
    ) -> None:
        if msg.request_id not in self.shared.done:
            self._apply(state.shrink_group(msg.topic, msg.group_id, msg.slots))
            self._group_infos(msg.topic, (msg.group_id,))
            self.shared.remember(msg.request_id, None)
            self._kick(msg.topic)

    def _on_release_holder(
        self, msg: M.ReleaseHolder, ctx: ActorContext[Any], state: ControllerState
    ) -> None:
        self._withdraw(msg.holder)
        self._apply(state.release_holder(msg.holder))
        self._kick_all()

    def _on_delivered(self, msg: Delivered, ctx: ActorContext[Any], state: ControllerState) -> None:
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
        for topic in list(self.puts):
            self._retry_puts(topic)

    def _on_tick(self, msg: _Tick, ctx: ActorContext[Any], state: ControllerState) -> None:
        self._apply(state.expire(trio.current_time()))
        self._kick_all()

    def _on_wait_events(
        self, msg: M.WaitEvents, ctx: ActorContext[Any], state: ControllerState
    ) -> None:
        self.waiters.add(msg.wait_id, msg.since, ctx.defer_reply())

    def _on_create_topic(
        self, msg: M.CreateTopic, ctx: ActorContext[Any], state: ControllerState
    ) -> None:
        state.add_topic(msg.spec)
        self.shared.specs[msg.spec.name] = msg.spec

    def _on_get_topology(
        self, msg: M.GetTopology, ctx: ActorContext[Any], state: ControllerState
    ) -> M.Topology:
        shared = self.shared
        return M.Topology(
            dict(shared.specs), dict(shared.units), shared.shm_min_bytes, shared.io_timeout
        )

    def _on_await_stores(
        self, msg: M.AwaitStores, ctx: ActorContext[Any], state: ControllerState
    ) -> None:
        marks = self.delivery.marks(msg.units)
        if marks:
            self.delivery.hold(marks, ctx.defer_reply(), None)

    def _on_flushed(self, msg: M.Flushed, ctx: ActorContext[Any], state: ControllerState) -> None:
        if len(self.shared.outbox):
            self.delivery.await_empty(ctx.defer_reply())

    def _statistics(self, state: ControllerState) -> M.ControllerStatistics:
        return M.ControllerStatistics(
            state.statistics(),
            sum(len(w) for w in self.puts.values()),
            len(self.claims),
            self.evicted_groups,
            self.lost_samples,
            self.shared.log.seq,
            self.epoch,
            tuple(u for u, t in self.shared.known.items() if t is None),
            event_waiters=len(self.waiters),
            abandoned_samples=self.abandoned_samples,
            outbox=len(self.shared.outbox),
            incarnations=dict(self.shared.known),
        )

    def check_invariants(self) -> list[str]:
        """The module docstring's invariants, checked now: what is violated, in words (empty:
        nothing). For tests (it recounts the whole state)."""
        out: list[str] = []
        shared, state = self.shared, self.state
        if state is None:
            return ["the controller has no state (not started)"]
        if self.granted_by_lease != {lease: claim for claim, lease in self.granted.items()}:
            out.append("1: granted and granted_by_lease are not one map read both ways")
        ended = set(self.granted_by_lease) - {lease.id for lease in state.leases()}
        if ended:
            out.append(f"2: grants name leases that ended: {sorted(ended)}")
        both = self.claims.ids() & set(self.granted)
        if both:
            out.append(f"3: claims both waiting and granted: {sorted(both)}")
        out.extend(f"3: {problem}" for problem in self.claims.problems())
        if any(w.msg.topic != topic for topic, queue in self.puts.items() for w in queue):
            out.append("4: a put waits under another topic than its own")
        waiting = {w.msg.put_id for queue in self.puts.values() for w in queue if w.msg.put_id}
        if waiting & set(self.granted_puts):
            out.append(
                f"4: puts both waiting and granted: {sorted(waiting & set(self.granted_puts))}"
            )
        if len(self.granted_puts) > REMEMBERED or len(shared.done) > REMEMBERED:
            out.append("4: the remembered puts or replies outgrew their bound")
        if set(shared.known) != set(shared.units):
            out.append(f"5: known units {sorted(shared.known)}, units {sorted(shared.units)}")
        unknown = {u for u, token in shared.known.items() if token is None}
        if state.units_down() != unknown:
            out.append(f"5: units down {sorted(state.units_down())}, unknown {sorted(unknown)}")
        for unit, token in self.recovery.adopting.items():
            if unit not in shared.units or token == shared.known.get(unit):
                out.append(f"6: unit {unit!r} is adopted as an incarnation it is known as")
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
            self._granted(msg.put_id, slots)
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
        self._granted(msg.put_id, _Allocated(allocation, msg.group))
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

    def _short(self, topic: str) -> bool:
        """Whether less than half of ``topic``'s capacity is free for new puts, the freed
        samples whose delete units have not taken yet counted as occupied (see ``_delivery``)."""
        capacity = self.shared.specs[topic].capacity
        free = self.state.free_slots(topic) if self.state is not None else None
        if capacity is None or free is None:
            return False
        return 2 * (free - self.shared.outbox.deleting.get(topic, 0)) < capacity

    def _granted(self, put_id: int, result: Any) -> None:
        if put_id:
            self.granted_puts[put_id] = result
            while len(self.granted_puts) > REMEMBERED:
                self.granted_puts.popitem(last=False)

    def _commit(self, msg: M.Commit, ctx: ActorContext[Any], state: ControllerState) -> None:
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
            granted = self.granted_puts.pop(msg.put_id, None)
            if isinstance(granted, _Allocated) and granted.allocation.indexes == msg.indexes:
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
        for waiting in self.puts.values():
            for item in waiting:
                if item.msg.put_id == put_id:
                    waiting.remove(item)
                    item.reply.fail(TransferQueueError(f"put {put_id} cancelled by its writer"))
                    return
        granted = self.granted_puts.pop(put_id, None)
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
        for queue in self.puts.values():
            for item in [w for w in queue if w.msg.holder == holder]:
                queue.remove(item)
                item.reply.fail(
                    TransferQueueError(f"put withdrawn: its holder {holder!r} was released")
                )

    def _retry_puts(self, topic: str) -> None:
        state = self.state
        waiting = self.puts.get(topic)
        assert state is not None
        while waiting:
            head = waiting[0]
            if not self._fits(state, topic, _slots(head.msg)):
                return  # FIFO: later puts wait behind the head
            waiting.popleft()
            try:
                head.reply.send(self._put(state, head.msg))
            except TransferQueueError as exc:
                head.reply.fail(exc)

    # -- claims ----------------------------------------------------------------------------------

    def _claim(self, msg: M.Claim, ctx: ActorContext[Any], state: ControllerState) -> Any:
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
        self.granted[msg.claim_id] = lease.id
        self.granted_by_lease[lease.id] = msg.claim_id
        self._deadline(lease.deadline)
        return M.Leased(lease, self._incarnations(lease.placement), self._located(lease))

    def _located(self, lease: Lease) -> dict[str, Any]:
        """The lease's parts on units whose rows all lie in shared memory (a unit that also
        holds group-shared columns the lease needs is fetched from, as usual)."""
        spec = self.shared.specs[lease.topic]
        per_sample = [c for c in lease.columns if not spec.columns[c].shared]
        shared = len(per_sample) < len(lease.columns)
        out = {}
        for unit, indexes in lease.placement.items():
            if not (shared and lease.shared.get(unit)):
                parts = self.locations.parts(lease.topic, indexes, per_sample)
                if parts is not None:
                    out[unit] = parts
        return out

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
        lease_id = self.granted.pop(claim_id, None)
        if lease_id is not None:  # granted, but the claimant never saw it
            self.granted_by_lease.pop(lease_id, None)
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
        for lease_id in update.ended:
            claim_id = self.granted_by_lease.pop(lease_id, None)
            if claim_id is not None:
                self.granted.pop(claim_id, None)

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
        if isinstance(item, U.Delete) and (self.puts.get(item.topic) or self._short(item.topic)):
            self.delivery.hurry()  # counted once queued: the delete occupies its slots till taken

    def _group_infos(self, topic: str, gids: Any) -> None:
        """Send explicit groups' records (absolute values) to their units."""
        assert self.state is not None
        if not gids:
            return  # implicit groups only (a plain put): they have no record
        for rec in self.state.group_records(topic, gids):
            self._to_unit(rec.unit, U.GroupInfo(topic, rec.group_id, rec.size, rec.allocated))

    def _records(self, topic: str) -> None:
        """Tell units the topic's version and id watermarks. Ids are reserved ahead in blocks,
        so allocations only reach the units once per block: a rebuild skips the rest of a block
        but never reuses an id."""
        state = self.state
        assert state is not None
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
            self._to_unit(unit, info)

    # -- waking waiters --------------------------------------------------------------------------

    def _kick(self, topic: str, *, puts: bool = True) -> None:
        if puts:
            self._retry_puts(topic)
        self._retry_claims(topic)

    def _kick_all(self) -> None:
        for topic in set(self.puts) | set(self.claims.topics()):
            self._kick(topic)

    def _event(
        self, kind: str, topic: str, groups: tuple[int, ...], indexes: tuple[int, ...], detail: str
    ) -> None:
        self.shared.log.add(kind, topic, groups, indexes, detail)

    # -- the timer -------------------------------------------------------------------------------

    def _deadline(self, at: float) -> None:
        """Something new is due at ``at``: wake the timer if it sleeps past that. (Deadlines
        that go away need no wake-up: the timer then wakes early, finds nothing due and
        sleeps again.)"""
        if at < self.timer_at:
            self.timer_wake.set()

    def _write_deadline(self, topic: str, now: float) -> None:
        ttl = self.shared.specs[topic].write_ttl
        if ttl is not None:
            self._deadline(now + ttl)

    async def _timer(self, ctx: ActorContext[Any]) -> None:
        while True:
            self.timer_wake = trio.Event()
            state = self.state
            deadline = state.next_deadline() if state is not None else None
            self.timer_at = deadline if deadline is not None else math.inf
            with trio.move_on_at(self.timer_at):
                await self.timer_wake.wait()
                continue
            await ctx.self.send(_Tick())


def _slots(msg: M.Allocate | M.OpenGroups) -> int:
    """Capacity slots a put needs (0: members of open groups use their reserved slots)."""
    if isinstance(msg, M.OpenGroups):
        return sum(msg.sizes)
    return msg.n if msg.group is None else 0


def _as_tuple(group: int | tuple[int, ...]) -> tuple[int, ...]:
    return group if isinstance(group, tuple) else (group,)
