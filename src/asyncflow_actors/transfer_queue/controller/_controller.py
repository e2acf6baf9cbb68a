"""The controller actor: the TransferQueue's control plane around ``ControllerState``.

It owns the state machine and does what the state cannot: it parks puts while a topic is full
and claims until enough samples qualify (deferred replies, so a waiting request never blocks
others), expires leases and abandoned writes on time, forwards to the storage units what they
keep for a rebuild (kept until each unit has taken it), watches the units, and rebuilds its own
state from their inventories when it is restarted. Everything it must report (evictions,
losses, abandoned writes) becomes a numbered ``TQEvent``.

The controller always knows which incarnation of each unit holds what: data messages name the
incarnation, and that knowledge (with the last state, the event log, the undelivered
bookkeeping and the replies of non-idempotent requests) lives in :class:`ControllerShared`,
which outlives a controller incarnation. So a unit that restarted while the controller was down
is found at the rebuild and its samples are reported lost, never silently dropped; and a client
retrying a request across a controller restart gets the answer the first try got.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict, deque
from typing import Any

import attrs
import trio

from .. import _messages as M
from .. import _unit_messages as U
from .._errors import TransferQueueError, UnknownSample
from .._results import Allocation, GroupSlot, Lease, Update
from .._runtime import Actor, ActorContext, ActorRef, Reply, Request
from .._spec import TopicSpec
from ..state._state import ControllerState
from . import _units
from ._delivery import Delivered, Delivery
from ._locations import Locations
from ._recovery import Recovery, UnitSeen
from ._waiters import ClaimQueues, EventLog, EventWaiters, WaitingClaim

log = logging.getLogger("asyncflow_actors.transfer_queue")

_RESERVE = 4096  # ids reserved ahead per watermark update (see Controller._records)
_REMEMBERED = 65536  # replies of non-idempotent requests kept for retries


@attrs.define(eq=False)
class ControllerShared:
    """What outlives a controller incarnation: topics, units, options, and the knowledge a
    restarted controller needs to stay exact (see the module docstring)."""

    specs: dict[str, TopicSpec]
    units: dict[str, ActorRef[Any]]
    unit_check_interval: float = 0.5
    flush_linger: float = 0.05  # bookkeeping nobody waits for waits this long to travel with more
    unit_timeout: float = 5.0  # the controller's own requests to units
    io_timeout: float = 60.0  # clients' data requests to units
    shm_min_bytes: int | None = 64 << 10
    max_events: int = 10_000
    incarnations: int = 0
    log: EventLog = attrs.Factory(lambda self: EventLog(self.max_events), takes_self=True)
    outbox: _units.Outbox = attrs.Factory(_units.Outbox)
    watermarks: dict[str, U.TopicInfo] = attrs.Factory(dict)
    known: dict[str, str | None] = attrs.Factory(dict)  # unit -> incarnation holding its data
    state: ControllerState | None = None  # the last incarnation's (its losses at a rebuild)
    done: OrderedDict[int, Any] = attrs.Factory(OrderedDict)  # request id -> reply

    def remember(self, request_id: int, reply: Any) -> None:
        if request_id:
            self.done[request_id] = reply
            while len(self.done) > _REMEMBERED:
                self.done.popitem(last=False)


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


# (Delivery before Recovery: Recovery only declares the ``_to_unit`` that Delivery defines)
class Controller(Delivery, Recovery, Actor[M.ControllerMessage | _Tick | Delivered | UnitSeen]):
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
        self.check_now = trio.Event()
        self.outbox_wake = trio.Event()
        self.adopting: dict[str, str] = {}  # unit -> fresh token sent to receive, not yet seen
        self.flush_now = trio.Event()
        self.flush_waiters: list[Reply] = []
        self.store_waits = _units.StoreWaits()  # replies held until units took told stores
        self.locations = Locations()  # rows put through shared memory (see ``_located``)

    # -- lifecycle -------------------------------------------------------------------------------

    async def on_start(self, ctx: ActorContext[Any]) -> None:
        shared = self.shared
        self.epoch = shared.incarnations
        shared.incarnations += 1
        tokens = await _units.tokens(shared.units, shared.unit_timeout)
        if shared.state is None:
            self.state = ControllerState(shared.specs.values(), list(shared.units), epoch=0)
            shared.state = self.state
            shared.known.update(tokens)
            for unit, token in tokens.items():
                self.state.set_unit_up(unit, token is not None)
        else:
            await self._rebuild(tokens)
        ctx.start_soon(self._timer, ctx)
        ctx.start_soon(self._unit_watcher, ctx)
        ctx.start_soon(self._flusher, ctx)

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
            self.waiters.serve()  # one batch per message: events of one change arrive together

    def _handle(self, msg: Any, ctx: ActorContext[Any], state: ControllerState) -> Any:
        if isinstance(msg, M.Commit):
            return self._commit(msg, state)
        if isinstance(msg, M.Claim):
            return self._claim(msg, ctx, state)
        if isinstance(msg, M.Ack):
            if msg.request_id in self.shared.done:
                return self.shared.done[msg.request_id]
            missing = self._end_lease(state, msg.lease_id, msg.holder, ack=True)
            self.shared.remember(msg.request_id, missing)
            return missing
        if isinstance(msg, (M.Allocate, M.OpenGroups)):
            size = _slots(msg)
            if size == 0:  # members of an open group use its reserved slots: never wait
                return self._put(state, msg)
            waiting = self.puts.setdefault(msg.topic, deque())
            if self._fits(state, msg.topic, size) and not waiting:  # CapacityError: never
                return self._put(state, msg)
            waiting.append(_WaitingPut(msg, ctx.defer_reply()))
            if msg.topic in self.shared.outbox.deleting:
                self.flush_now.set()  # the slots it waits for free once units took deletes
            return None
        if isinstance(msg, M.CommitSharedGroups):
            state.commit_shared_groups(msg.topic, msg.columns)
            self._group_infos(msg.topic, tuple(msg.columns))
            self._kick(msg.topic)
        elif isinstance(msg, M.CancelClaim):
            self._cancel_claim(state, msg.claim_id)
        elif isinstance(msg, M.CancelPut):
            self._cancel_put(state, msg.put_id)
        elif isinstance(msg, M.Nack):
            self._end_lease(state, msg.lease_id, None, ack=False)
        elif isinstance(msg, M.Renew):
            return state.renew(msg.lease_id, trio.current_time())
        elif isinstance(msg, M.SetVersion):
            self._apply(state.set_latest_version(msg.topic, msg.version))
            self._records(msg.topic)
            self._kick(msg.topic)
        elif isinstance(msg, M.Discard):
            self.granted_puts.pop(msg.put_id, None)
            return self._discard(state, msg)
        elif isinstance(msg, M.ShrinkGroup):
            if msg.request_id not in self.shared.done:
                self._apply(state.shrink_group(msg.topic, msg.group_id, msg.slots))
                self._group_infos(msg.topic, (msg.group_id,))
                self.shared.remember(msg.request_id, None)
                self._kick(msg.topic)
        elif isinstance(msg, M.ReleaseHolder):
            self._withdraw(msg.holder)
            self._apply(state.release_holder(msg.holder))
            self._kick_all()
        elif isinstance(msg, Delivered):
            self._stores_missing(state)
            self._stores_taken(state)
            for topic in list(self.puts):
                self._retry_puts(topic)
        elif isinstance(msg, _Tick):
            self._apply(state.expire(trio.current_time()))
            self._kick_all()
        elif isinstance(msg, UnitSeen):
            self._unit_seen(state, msg)
        elif isinstance(msg, M.WaitEvents):
            self.waiters.add(msg.wait_id, msg.since, ctx.defer_reply())
        elif isinstance(msg, M.CancelWait):
            self.waiters.cancel(msg.wait_id)
        elif isinstance(msg, M.CreateTopic):
            state.add_topic(msg.spec)
            self.shared.specs[msg.spec.name] = msg.spec
        elif isinstance(msg, M.GetTopology):
            shared = self.shared
            return M.Topology(
                dict(shared.specs), dict(shared.units), shared.shm_min_bytes, shared.io_timeout
            )
        elif isinstance(msg, M.GetControllerStatistics):
            return self._statistics(state)
        elif isinstance(msg, M.CheckUnits):
            self.check_now.set()
        elif isinstance(msg, M.AwaitStores):
            marks = self.store_waits.marks(self.shared.outbox, msg.units)
            if marks:
                self._hold(marks, ctx.defer_reply(), None)
        elif isinstance(msg, M.Flushed) and len(self.shared.outbox):
            self.flush_waiters.append(ctx.defer_reply())  # answered once it is empty
            self.flush_now.set()
            self.outbox_wake.set()
        return None

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

    def _granted(self, put_id: int, result: Any) -> None:
        if put_id:
            self.granted_puts[put_id] = result
            while len(self.granted_puts) > _REMEMBERED:
                self.granted_puts.popitem(last=False)

    def _commit(self, msg: M.Commit, state: ControllerState) -> None:
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
            self._hold(marks, ctx.defer_reply(), leased)
            return None
        if not msg.wait:
            return None
        self.claims.add(WaitingClaim(msg, ctx.defer_reply()), state.changes(msg.topic))
        return None

    def _store_marks(self, msg: M.Claim, leased: M.Leased) -> dict[str, int]:
        """The told stores to wait for before the claimant may ask the units of its lease:
        none for units whose rows it maps from shared memory without asking."""
        units = [u for u in leased.lease.placement if u not in leased.located or u not in msg.maps]
        return self.store_waits.marks(self.shared.outbox, units)

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
                self._hold(marks, waiting.reply, leased)
            elif not waiting.reply.send(leased):  # the claimant is gone: give the samples back
                self._apply(state.nack(leased.lease.id))
            return True

        self.claims.serve(topic, state.changes(topic), attempt)

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

    # -- helper tasks ----------------------------------------------------------------------------

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
