"""The controller actor: the TransferQueue's control plane around ``ControllerState``.

It owns the state machine and does what the state cannot: it parks puts while a topic is full
and claims until enough samples qualify (deferred replies, so a waiting request never blocks
others), expires leases on time, deletes freed data on the storage units, forwards the records
units keep for a rebuild, watches the units (a unit that dies or restarts empty is reported
lost, with its groups), and rebuilds its own state from the units' inventories when it is
restarted. Everything it must report (evictions, losses) becomes a numbered ``TQEvent``.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Any

import attrs
import trio

from ..actors import Actor, ActorContext, ActorCrashed, ActorRef, Reply, Request
from . import _messages as M
from . import _storage as S
from ._errors import TransferQueueError
from ._inventory import GroupRecord, Inventory, SampleRecord, TopicRecord
from ._results import Lease, Loss, Update
from ._spec import TopicSpec
from ._state import ControllerState

log = logging.getLogger("asyncflow_actors.transfer_queue")


_RESERVE = 4096  # ids reserved ahead per watermark update (see Controller._records)


def _coalesce(items: list[Any]) -> list[Any]:
    """Drop consumption marks of samples deleted in the same batch (they are gone anyway)."""
    deleted = {(m.topic, i) for m in items if isinstance(m, S.Delete) for i in m.indexes}
    if not deleted:
        return items
    out = []
    for m in items:
        if isinstance(m, S.MarkConsumed):
            keep = [i for i in m.indexes if (m.topic, i) not in deleted]
            if not keep:
                continue
            m = S.MarkConsumed(m.topic, m.consumer, keep)
        out.append(m)
    return out


@attrs.define(eq=False)
class ControllerShared:
    """What outlives a controller incarnation: the topics declared, the units, the options."""

    specs: dict[str, TopicSpec]
    units: dict[str, ActorRef[Any]]
    unit_check_interval: float = 0.5
    unit_timeout: float = 5.0
    max_events: int = 10_000
    incarnations: int = 0
    # the event log outlives a controller restart: a reported event stays reported
    events: deque[M.TQEvent] = attrs.Factory(deque)
    seq: int = 0
    # bookkeeping not yet delivered to units, and the watermarks sent: a restarted controller
    # delivers the first before it reads inventories, and never goes below the second
    outbox: dict[str, list[Any]] = attrs.Factory(dict)
    watermarks: dict[str, S.TopicInfo] = attrs.Factory(dict)


@attrs.frozen
class _Tick:
    """Self-message from the lease timer: expire what is due."""


@attrs.frozen
class _UnitSeen:
    """Self-message from the unit watcher: ``token`` is None when the unit did not answer."""

    unit: str
    token: str | None


@attrs.define(eq=False)
class _WaitingPut:
    msg: M.Allocate | M.OpenGroup
    reply: Reply


@attrs.define(eq=False)
class _WaitingClaim:
    msg: M.Claim
    reply: Reply
    seen: int = -1


class Controller(Actor[M.ControllerMessage | _Tick | _UnitSeen]):
    """See the module docstring. Create it with ``Controller(shared)``."""

    mailbox_size = 1024

    def __init__(self, shared: ControllerShared) -> None:
        self.shared = shared
        self.state: ControllerState | None = None
        self.epoch = 0
        self.tokens: dict[str, str | None] = {}
        self.puts: dict[str, deque[_WaitingPut]] = {}
        self.claims: dict[str, list[_WaitingClaim]] = {}
        self.claim_ids: dict[int, _WaitingClaim] = {}
        self.granted: dict[int, int] = {}  # claim id -> lease id, until the lease ends
        self.granted_puts: dict[int, Any] = {}  # put id -> Allocation/GroupSlot, until used
        self.event_waiters: list[tuple[int, Reply]] = []
        self.evicted_groups = 0
        self.lost_samples = 0
        self.timer_wake = trio.Event()
        self.check_now = trio.Event()
        self.outbox_wake = trio.Event()

    # -- lifecycle -------------------------------------------------------------------------------

    async def on_start(self, ctx: ActorContext[Any]) -> None:
        self._ctx = ctx
        self.epoch = self.shared.incarnations
        self.shared.incarnations += 1
        units = list(self.shared.units)
        for unit, ref in self.shared.units.items():
            self.tokens[unit] = await self._token(ref)
        if self.epoch == 0:
            self.state = ControllerState(self.shared.specs.values(), units, epoch=0)
        else:
            await self._rebuild(ctx, units)
        ctx.start_soon(self._lease_timer, ctx)
        ctx.start_soon(self._unit_watcher, ctx)
        ctx.start_soon(self._flusher, ctx)

    async def _rebuild(self, ctx: ActorContext[Any], units: list[str]) -> None:
        await self._flush_outbox()  # what the last incarnation decided reaches the units first
        marks = self.shared.watermarks.values()
        parts: list[Inventory] = [
            Inventory(
                topics=tuple(
                    TopicRecord(m.topic, m.latest_version, m.next_index, m.next_group_id)
                    for m in marks
                )
            )
        ]
        for unit, ref in self.shared.units.items():
            try:
                with trio.fail_after(self.shared.unit_timeout):
                    inv: S.UnitInventory = await ref.ask(S.GetInventory())
            except (ActorCrashed, trio.TooSlowError) as exc:
                log.warning(
                    "controller rebuild: unit %s unavailable (%s); its data is lost", unit, exc
                )
                self.tokens[unit] = None
                continue
            parts.append(_inventory_of(unit, inv))
        state, update = ControllerState.from_inventory(
            self.shared.specs.values(), units, Inventory.merge(parts), epoch=self.epoch
        )
        self.state = state
        self._apply(ctx, update)
        log.info("controller rebuilt (epoch %d) from %d units", self.epoch, len(parts))

    async def _token(self, ref: ActorRef[Any]) -> str | None:
        try:
            with trio.fail_after(self.shared.unit_timeout):
                token: str = await ref.ask(S.GetToken())
                return token
        except (ActorCrashed, trio.TooSlowError):
            return None

    # -- dispatch --------------------------------------------------------------------------------

    async def receive(self, msg: Any, ctx: ActorContext[Any]) -> Any:
        state = self.state
        assert state is not None
        try:
            return self._handle(msg, ctx, state)
        except TransferQueueError as exc:  # bad input: answer it, keep running
            if isinstance(msg, Request):
                ctx.reply_error(exc)
            else:
                log.warning("controller: %r failed: %s", msg, exc)
            return None
        finally:
            if self.event_waiters:  # one batch per message: events of one change arrive together
                self._flush_events()

    def _handle(self, msg: Any, ctx: ActorContext[Any], state: ControllerState) -> Any:
        if isinstance(msg, M.Commit):
            self.granted_puts.pop(msg.put_id, None)
            state.commit_write(msg.topic, msg.indexes, msg.columns)
            self._kick(msg.topic)
            return None
        if isinstance(msg, M.Claim):
            return self._claim(msg, ctx, state)
        if isinstance(msg, M.Ack):
            return self._end_lease(ctx, state, msg.lease_id, msg.holder, ack=True)
        if isinstance(msg, (M.Allocate, M.OpenGroup)):
            waiting = self.puts.setdefault(msg.topic, deque())
            size = (
                msg.n
                if isinstance(msg, M.Allocate) and msg.group is None
                else (msg.size if isinstance(msg, M.OpenGroup) else 0)
            )
            if not waiting and (size == 0 or state.can_allocate(msg.topic, size)):
                return self._granted(msg, self._put(ctx, state, msg))
            if size:
                state.can_allocate(msg.topic, size)  # raises CapacityError if it never fits
            waiting.append(_WaitingPut(msg, ctx.defer_reply()))
            return None
        if isinstance(msg, M.CommitShared):
            state.commit_shared(msg.topic, msg.group_id, msg.columns)
            self._kick(msg.topic)
        elif isinstance(msg, M.CancelClaim):
            self._cancel_claim(ctx, state, msg.claim_id)
        elif isinstance(msg, M.CancelPut):
            self._cancel_put(ctx, state, msg.put_id)
        elif isinstance(msg, M.Nack):
            self._end_lease(ctx, state, msg.lease_id, None, ack=False)
        elif isinstance(msg, M.Renew):
            return state.renew(msg.lease_id, trio.current_time())
        elif isinstance(msg, M.SetVersion):
            update = state.set_latest_version(msg.topic, msg.version)
            self._apply(ctx, update)
            self._records(ctx, msg.topic, self.shared.units)
            self._kick(msg.topic)
        elif isinstance(msg, M.Discard):
            self.granted_puts.pop(msg.put_id, None)
            self._discard(ctx, state, msg)
        elif isinstance(msg, M.ShrinkGroup):
            unit = state.group_unit(msg.topic, msg.group_id)
            self._apply(ctx, state.shrink_group(msg.topic, msg.group_id, msg.slots))
            self._group_delta(ctx, unit, msg.topic, msg.group_id, -msg.slots, 0)
            self._kick(msg.topic)
        elif isinstance(msg, M.ReleaseHolder):
            self._apply(ctx, state.release_holder(msg.holder))
            self._kick_all()
        elif isinstance(msg, _Tick):
            self._apply(ctx, state.expire(trio.current_time()))
            self._kick_all()
        elif isinstance(msg, _UnitSeen):
            self._unit_seen(ctx, state, msg)
        elif isinstance(msg, M.WaitEvents):
            self.event_waiters.append((msg.since, ctx.defer_reply()))
        elif isinstance(msg, M.CreateTopic):
            state.add_topic(msg.spec)
            self.shared.specs[msg.spec.name] = msg.spec
        elif isinstance(msg, M.GetTopology):
            return M.Topology(dict(self.shared.specs), dict(self.shared.units))
        elif isinstance(msg, M.GetControllerStatistics):
            return M.ControllerStatistics(
                state.statistics(),
                sum(len(w) for w in self.puts.values()),
                sum(len(w) for w in self.claims.values()),
                self.evicted_groups,
                self.lost_samples,
                self.shared.seq,
                self.epoch,
                tuple(u for u, t in self.tokens.items() if t is None),
            )
        elif isinstance(msg, M.CheckUnits):
            self.check_now.set()
        return None

    # -- puts --------------------------------------------------------------------------------------

    def _put(
        self, ctx: ActorContext[Any], state: ControllerState, msg: M.Allocate | M.OpenGroup
    ) -> Any:
        if isinstance(msg, M.OpenGroup):
            slot = state.open_group(msg.topic, msg.size)
            self._group_delta(ctx, slot.unit, msg.topic, slot.group_id, msg.size, 0)
            self._records(ctx, msg.topic, self.shared.units)
            return slot
        allocation = state.allocate(
            msg.topic, msg.n, msg.version, group=msg.group, lengths=msg.lengths
        )
        if msg.group is not None:
            self._group_delta(ctx, allocation.units[0], msg.topic, msg.group, 0, msg.n)
        # every unit keeps the watermarks: a rebuild must never reuse an index, even if the
        # unit that held the newest samples is gone
        self._records(ctx, msg.topic, self.shared.units)
        self._kick(msg.topic, puts=False)
        return allocation

    def _granted(self, msg: M.Allocate | M.OpenGroup, result: Any) -> Any:
        if msg.put_id and isinstance(msg, M.Allocate):  # an open group is the writer's to close
            self.granted_puts[msg.put_id] = result
        return result

    def _cancel_put(self, ctx: ActorContext[Any], state: ControllerState, put_id: int) -> None:
        for waiting in self.puts.values():
            for item in waiting:
                if item.msg.put_id == put_id:
                    waiting.remove(item)
                    item.reply.fail(TransferQueueError(f"put {put_id} cancelled by its writer"))
                    return
        allocation = self.granted_puts.pop(put_id, None)
        if allocation is not None:  # allocated, but the writer never saw the indexes
            self._discard(ctx, state, M.Discard(allocation.topic, allocation.indexes))

    def _retry_puts(self, topic: str) -> None:
        state = self.state
        waiting = self.puts.get(topic)
        assert state is not None
        while waiting:
            head = waiting[0]
            msg = head.msg
            size = msg.size if isinstance(msg, M.OpenGroup) else (msg.n if msg.group is None else 0)
            if size and not state.can_allocate(topic, size):
                return  # FIFO: later puts wait behind the head
            waiting.popleft()
            try:
                head.reply.send(self._granted(msg, self._put(self._ctx, state, msg)))
            except TransferQueueError as exc:
                head.reply.fail(exc)

    # -- claims ------------------------------------------------------------------------------------

    def _claim(self, msg: M.Claim, ctx: ActorContext[Any], state: ControllerState) -> Lease | None:
        lease = self._try_claim(state, msg)
        if lease is not None or not msg.wait:
            return lease
        waiting = _WaitingClaim(msg, ctx.defer_reply(), state.changes(msg.topic))
        self.claims.setdefault(msg.topic, []).append(waiting)
        self.claim_ids[msg.claim_id] = waiting
        return None

    def _try_claim(self, state: ControllerState, msg: M.Claim) -> Lease | None:
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
        if lease is not None:
            self.granted[msg.claim_id] = lease.id
            self.timer_wake.set()
        return lease

    def _retry_claims(self, topic: str) -> None:
        state = self.state
        assert state is not None
        for waiting in list(self.claims.get(topic, ())):
            changes = state.changes(topic)
            if waiting.seen == changes:
                continue
            waiting.seen = changes
            try:
                lease = self._try_claim(state, waiting.msg)
            except TransferQueueError as exc:
                lease = None
                self._drop_claim(waiting)
                waiting.reply.fail(exc)
            if lease is not None:
                self._drop_claim(waiting)
                if not waiting.reply.send(lease):  # the claimant is gone: give the samples back
                    self._apply(self._ctx, state.nack(lease.id))

    def _drop_claim(self, waiting: _WaitingClaim) -> None:
        self.claims[waiting.msg.topic].remove(waiting)
        self.claim_ids.pop(waiting.msg.claim_id, None)

    def _cancel_claim(self, ctx: ActorContext[Any], state: ControllerState, claim_id: int) -> None:
        waiting = self.claim_ids.get(claim_id)
        if waiting is not None:
            self._drop_claim(waiting)
            waiting.reply.fail(TransferQueueError(f"claim {claim_id} cancelled by its claimant"))
            return
        lease_id = self.granted.pop(claim_id, None)
        if lease_id is not None:  # granted, but the claimant never saw it
            try:
                self._apply(ctx, state.nack(lease_id))
            except TransferQueueError:
                pass  # it ended already
            self._kick_all()

    def _end_lease(
        self,
        ctx: ActorContext[Any],
        state: ControllerState,
        lease_id: int,
        holder: str | None,
        *,
        ack: bool,
    ) -> tuple[int, ...]:
        lease = state.lease(lease_id)
        update = state.ack(lease_id, holder=holder) if ack else state.nack(lease_id)
        self._apply(ctx, update)
        if ack and lease_id in update.ended:
            for unit, indexes in lease.placement.items():
                self._to_unit(ctx, unit, S.MarkConsumed(lease.topic, lease.consumer, list(indexes)))
        if update.missing:
            self._event("missing", lease.topic, (), update.missing, f"lease {lease_id}")
        self._kick(lease.topic)
        return update.missing

    # -- the rest of the state changes ---------------------------------------------------------------

    def _discard(self, ctx: ActorContext[Any], state: ControllerState, msg: M.Discard) -> None:
        located = state.locate(msg.topic, msg.indexes)
        self._apply(ctx, state.discard(msg.topic, msg.indexes))
        for gid, unit in located.values():  # units ignore deltas of implicit groups
            self._group_delta(ctx, unit, msg.topic, gid, -1, -1)
        self._kick(msg.topic)

    def _unit_seen(self, ctx: ActorContext[Any], state: ControllerState, msg: _UnitSeen) -> None:
        old = self.tokens.get(msg.unit)
        if old == msg.token:
            return
        self.tokens[msg.unit] = msg.token
        if msg.token is not None:  # a fresh, empty incarnation: give it the watermarks again
            for info in self.shared.watermarks.values():
                self._to_unit(ctx, msg.unit, S.Records([info], []))
        if old is None:
            log.info("storage unit %s is back (empty)", msg.unit)
            return
        loss = state.storage_lost(msg.unit)
        self._report_loss(loss)
        self._kick_all()

    def _report_loss(self, loss: Loss) -> None:
        for lost in loss.lost:
            self.lost_samples += len(lost.indexes)
            self._event("lost", lost.topic, lost.group_ids, lost.indexes, f"unit {loss.unit}")
        log.warning("storage unit %s lost: %s", loss.unit, loss.group_ids)

    def _apply(self, ctx: ActorContext[Any], update: Update) -> None:
        for release in update.releases:
            self._to_unit(
                ctx,
                release.unit,
                S.Delete(release.topic, list(release.indexes), list(release.group_ids)),
            )
        for eviction in update.evictions:
            self.evicted_groups += len(eviction.group_ids)
            self._event(
                "evicted", eviction.topic, eviction.group_ids, eviction.indexes, eviction.reason
            )
        for lease_id in update.ended:
            for claim_id in [c for c, lid in self.granted.items() if lid == lease_id]:
                del self.granted[claim_id]
        if update.ended:
            self.timer_wake.set()

    def _to_unit(self, ctx: ActorContext[Any], unit: str, msg: Any) -> None:
        """Queue bookkeeping for a unit; its flusher sends what piled up as one ``UnitBatch``."""
        if unit not in self.shared.units or self.tokens.get(unit) is None:
            return
        self.shared.outbox.setdefault(unit, []).append(msg)
        self.outbox_wake.set()

    async def _flusher(self, ctx: ActorContext[Any]) -> None:
        while True:
            await self.outbox_wake.wait()
            self.outbox_wake = trio.Event()
            await self._flush_outbox()

    async def _flush_outbox(self) -> None:
        boxes, self.shared.outbox = self.shared.outbox, {}
        for unit, items in boxes.items():
            try:
                await self.shared.units[unit].send(S.UnitBatch(_coalesce(items)))
            except ActorCrashed:
                self.check_now.set()

    def _records(self, ctx: ActorContext[Any], topic: str, units: dict[str, ActorRef[Any]]) -> None:
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
        info = S.TopicInfo(
            topic,
            record.latest_version,
            record.next_index + _RESERVE,
            record.next_group_id + _RESERVE,
        )
        self.shared.watermarks[topic] = info
        for unit in units:
            self._to_unit(ctx, unit, S.Records([info], []))

    def _group_delta(
        self, ctx: ActorContext[Any], unit: str, topic: str, gid: int, size: int, allocated: int
    ) -> None:
        if unit:
            self._to_unit(ctx, unit, S.Records([], [S.GroupDelta(topic, gid, size, allocated)]))

    # -- waking waiters ------------------------------------------------------------------------------

    def _kick(self, topic: str, *, puts: bool = True) -> None:
        if puts:
            self._retry_puts(topic)
        self._retry_claims(topic)

    def _kick_all(self) -> None:
        for topic in set(self.puts) | set(self.claims):
            self._kick(topic)

    def _event(
        self, kind: str, topic: str, groups: tuple[int, ...], indexes: tuple[int, ...], detail: str
    ) -> None:
        shared = self.shared
        shared.seq += 1
        shared.events.append(
            M.TQEvent(shared.seq, kind, topic, tuple(groups), tuple(indexes), detail)
        )
        while len(shared.events) > shared.max_events:
            shared.events.popleft()

    def _flush_events(self) -> None:
        keep = []
        for since, reply in self.event_waiters:
            fresh = tuple(e for e in self.shared.events if e.seq > since)
            if fresh:
                reply.send(M.EventBatch(self.shared.seq, fresh))
            elif not reply.done:
                keep.append((since, reply))
        self.event_waiters = keep

    # -- helper tasks ------------------------------------------------------------------------------

    async def _lease_timer(self, ctx: ActorContext[Any]) -> None:
        while True:
            self.timer_wake = trio.Event()
            state = self.state
            deadline = state.next_deadline() if state is not None else None
            with trio.move_on_at(deadline if deadline is not None else math.inf):
                await self.timer_wake.wait()
                continue
            await ctx.self.send(_Tick())

    async def _unit_watcher(self, ctx: ActorContext[Any]) -> None:
        while True:
            with trio.move_on_after(self.shared.unit_check_interval):
                await self.check_now.wait()
            self.check_now = trio.Event()
            for unit, ref in self.shared.units.items():
                token = await self._token(ref)
                if token != self.tokens.get(unit):
                    await ctx.self.send(_UnitSeen(unit, token))


def _inventory_of(unit: str, inv: S.UnitInventory) -> Inventory:
    topics = tuple(
        TopicRecord(t.topic, t.latest_version, t.next_index, t.next_group_id) for t in inv.topics
    )
    groups = tuple(
        GroupRecord(topic, g.group_id, unit, g.size, g.allocated, g.shared)
        for topic, records in inv.groups.items()
        for g in records
    )
    samples = tuple(
        SampleRecord(topic, s.index, s.version, s.group_id, unit, s.length, s.columns, s.consumed)
        for topic, records in inv.samples.items()
        for s in records
    )
    return Inventory(topics, groups, samples)
