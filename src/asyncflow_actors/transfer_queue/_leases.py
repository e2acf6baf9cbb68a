"""Leases: who holds which samples for which consumer, until ack, nack, expiry or holder death.

:class:`LeaseTable` is internal to :class:`ControllerState`, which validates arguments and
documents the public contract; the table selects with the samplers, marks samples leased, and
on every lease ending updates the topic's views, frees what every consumer acked, and evicts
stale groups whose last lease ended.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable

import attrs

from ._errors import ShareMismatch, UnknownLease
from ._results import Lease
from ._samplers import Balanced, Sampler, partition_lpt, select_groups, select_samples, uses_groups
from ._topic import Effects, Group, Topic, View

#: Lease ids of epoch ``e`` are ``e << EPOCH_BITS`` onwards, so ids never repeat across restarts.
EPOCH_BITS = 40


class _LeaseRec:
    __slots__ = ("acked_by", "ci", "holders", "lease", "sampler", "topic")

    def __init__(self, lease: Lease, topic: Topic, ci: int, sampler: Sampler) -> None:
        self.lease = lease
        self.topic = topic
        self.ci = ci
        self.sampler = sampler
        self.holders = {lease.holder}
        self.acked_by: set[str] = set()


class LeaseTable:
    """Outstanding leases, indexed by id, by holder and by deadline."""

    def __init__(self, epoch: int) -> None:
        self._leases: dict[int, _LeaseRec] = {}
        self._next = epoch << EPOCH_BITS
        self._by_holder: dict[str, set[int]] = {}
        self._expiry: list[tuple[float, int]] = []  # (deadline, lease id), lazily checked

    def __len__(self) -> int:
        return len(self._leases)

    def get(self, lease_id: int) -> Lease:
        return self._rec(lease_id).lease

    def all(self) -> tuple[Lease, ...]:
        return tuple(rec.lease for rec in self._leases.values())

    def _rec(self, lease_id: int) -> _LeaseRec:
        rec = self._leases.get(lease_id) if isinstance(lease_id, int) else None
        if rec is None:
            raise UnknownLease(
                f"lease {lease_id!r} is not outstanding (never issued, or already acked, "
                "returned or expired)"
            )
        return rec

    # -- claims --------------------------------------------------------------------------------

    def claim(
        self,
        t: Topic,
        ci: int,
        cols: frozenset[str],
        count: int,
        low: int,
        sampler: Sampler,
        holder: str,
        now: float,
        share_key: Hashable | None,
        share_count: int,
    ) -> Lease | None:
        if share_key is not None:
            lid = t.shares.get((ci, share_key))
            if lid is not None:
                return self._join(self._leases[lid], cols, count, low, sampler, share_count, holder)
        v = t.view(ci, cols)
        if uses_groups(sampler):
            gids = select_groups(v.groups, v.amount.__getitem__, count, low)
            if gids is None:
                return None
            # Eligible: every member this consumer has not acked is a candidate of v.
            chunks = [[i for i in t.groups[gid].members if i in v.ready] for gid in gids]
            for chunk in chunks:
                for index in chunk:
                    v.ready.discard(index)
            picked = [i for chunk in chunks for i in chunk]
        else:
            chosen = select_samples(v.ready, count, low)
            if chosen is None:
                return None
            picked = chosen
            chunks = [[i] for i in picked]
        self._mark_leased(t, v, picked)
        if isinstance(sampler, Balanced):
            items = [(sum(t.samples[i].length for i in c), c) for c in chunks]
            parts = partition_lpt(items, sampler.dp_size, equal_count=not sampler.whole_groups)
            partitions = tuple(tuple(p) for p in parts)
        else:
            partitions = (tuple(picked),)
        lease = self._new_lease(t, ci, holder, v, picked, partitions, now, share_key, share_count)
        rec = _LeaseRec(lease, t, ci, sampler)
        self._leases[lease.id] = rec
        self._by_holder.setdefault(holder, set()).add(lease.id)
        heapq.heappush(self._expiry, (lease.deadline, lease.id))
        if share_key is not None:
            t.shares[(ci, share_key)] = lease.id
        t.leases += 1
        t.changes += 1
        return lease

    def _join(
        self,
        rec: _LeaseRec,
        cols: frozenset[str],
        count: int,
        low: int,
        sampler: Sampler,
        share_count: int,
        holder: str,
    ) -> Lease:
        lease = rec.lease
        mine = (lease.columns, rec.sampler, lease.share_count)
        if (cols, sampler, share_count) != mine or not low <= len(lease.indexes) <= count:
            raise ShareMismatch(
                f"share key {lease.share_key!r} of lease {lease.id}: claim (columns "
                f"{sorted(cols)}, count {count}, {sampler!r}, share_count {share_count}) does not "
                f"match the lease (columns {sorted(lease.columns)}, {len(lease.indexes)} samples, "
                f"{rec.sampler!r}, share_count {lease.share_count})"
            )
        if holder not in rec.holders:
            if len(rec.holders) >= lease.share_count:
                raise ShareMismatch(
                    f"share key {lease.share_key!r} of lease {lease.id} already has "
                    f"{lease.share_count} holders {sorted(rec.holders)}; {holder!r} is one too many"
                )
            rec.holders.add(holder)
            self._by_holder.setdefault(holder, set()).add(lease.id)
        return attrs.evolve(lease, holder=holder)

    @staticmethod
    def _mark_leased(t: Topic, v: View, picked: list[int]) -> None:
        """``picked`` were just taken out of ``v.ready``: lease them to ``v``'s consumer."""
        ci, bit = v.ci, v.bit
        others = [w for w in t.views_of[ci] if w is not v]
        touched: dict[int, Group] = {}
        for index in picked:
            s = t.samples[index]
            g = t.groups[s.gid]
            s.leased |= bit
            g.held += 1
            t.leased_count[ci] += 1
            t.uncand(v, g.gid)
            for w in others:
                if index in w.ready:
                    w.ready.discard(index)
                    t.uncand(w, g.gid)
            touched[g.gid] = g
        for g in touched.values():
            t.refresh_all(g, t.views_of[ci])

    def _new_lease(
        self,
        t: Topic,
        ci: int,
        holder: str,
        v: View,
        picked: list[int],
        partitions: tuple[tuple[int, ...], ...],
        now: float,
        share_key: Hashable | None,
        share_count: int,
    ) -> Lease:
        placement: dict[str, list[int]] = {}
        shared: dict[str, list[int]] = {}
        gids: dict[int, None] = {}
        for index in picked:
            s = t.samples[index]
            placement.setdefault(s.unit, []).append(index)
            if s.gid not in gids:
                gids[s.gid] = None
                if v.gmask:
                    shared.setdefault(s.unit, []).append(s.gid)
        lid = self._next
        self._next += 1
        return Lease(
            id=lid,
            topic=t.name,
            consumer=t.spec.consumers[ci],
            holder=holder,
            columns=v.columns,
            indexes=tuple(picked),
            versions=tuple(t.samples[i].version for i in picked),
            group_ids=tuple(t.samples[i].gid for i in picked),
            placement={u: tuple(x) for u, x in placement.items()},
            shared={u: tuple(x) for u, x in shared.items()},
            partitions=partitions,
            deadline=now + t.spec.lease_ttl,
            share_key=share_key,
            share_count=share_count,
        )

    # -- endings -------------------------------------------------------------------------------

    def ack(self, lease_id: int, holder: str | None, fx: Effects) -> None:
        rec = self._rec(lease_id)
        lease = rec.lease
        if lease.share_count > 1 or holder is not None:
            who = lease.holder if holder is None else holder
            if who not in rec.holders or who in rec.acked_by:
                state = "already acked it" if who in rec.acked_by else "does not hold it"
                raise UnknownLease(f"lease {lease_id}: holder {who!r} {state}")
            if lease.share_count > 1:
                rec.acked_by.add(who)
                if len(rec.acked_by) < lease.share_count:
                    return
        t, ci = rec.topic, rec.ci
        bit = 1 << ci
        touched: dict[int, Group] = {}
        for index in lease.indexes:
            s = t.samples.get(index)
            if s is None:
                fx.missing.append(index)
                continue
            g = t.groups[s.gid]
            s.leased &= ~bit
            g.held -= 1
            t.leased_count[ci] -= 1
            s.acked |= bit
            g.unconsumed[ci] -= 1
            t.consumed_count[ci] += 1
            if s.acked == t.full:
                t.freed_total += 1
                t.drop_sample(s, g, fx)
            touched[g.gid] = g
        for g in touched.values():
            if g.gid in t.groups:
                t.refresh_all(g, t.views_of[ci])
                t.settle(g, fx)
        self._end(rec, fx)

    def nack(self, lease_id: int, fx: Effects) -> None:
        self._return(self._rec(lease_id), fx)

    def renew(self, lease_id: int, now: float) -> Lease:
        rec = self._rec(lease_id)
        rec.lease = attrs.evolve(rec.lease, deadline=now + rec.topic.spec.lease_ttl)
        heapq.heappush(self._expiry, (rec.lease.deadline, lease_id))
        return rec.lease

    def next_deadline(self) -> float | None:
        while self._expiry:
            deadline, lid = self._expiry[0]
            rec = self._leases.get(lid)
            if rec is not None and rec.lease.deadline == deadline:
                return deadline
            heapq.heappop(self._expiry)
        return None

    def expire(self, now: float, fx: Effects) -> None:
        while (deadline := self.next_deadline()) is not None and deadline <= now:
            _, lid = heapq.heappop(self._expiry)
            self._return(self._leases[lid], fx)

    def release_holder(self, holder: str, fx: Effects) -> None:
        for lid in sorted(self._by_holder.get(holder, ())):
            rec = self._leases.get(lid)
            if rec is not None:
                self._return(rec, fx)

    def touching(self, topic: str, indexes: set[int]) -> tuple[int, ...]:
        """Ids of outstanding leases of ``topic`` that include any of ``indexes``."""
        return tuple(
            lid
            for lid, rec in self._leases.items()
            if rec.topic.name == topic and not indexes.isdisjoint(rec.lease.indexes)
        )

    def _return(self, rec: _LeaseRec, fx: Effects) -> None:
        t, ci = rec.topic, rec.ci
        bit = 1 << ci
        views = t.views_of[ci]
        touched: dict[int, Group] = {}
        for index in rec.lease.indexes:
            s = t.samples.get(index)
            if s is None:
                fx.missing.append(index)
                continue
            g = t.groups[s.gid]
            s.leased &= ~bit
            g.held -= 1
            t.leased_count[ci] -= 1
            if not g.doomed:
                t.sync(s, g, views)
            touched[g.gid] = g
        for g in touched.values():
            t.settle(g, fx)
        self._end(rec, fx)

    def _end(self, rec: _LeaseRec, fx: Effects) -> None:
        lease = rec.lease
        del self._leases[lease.id]
        for h in rec.holders:
            held = self._by_holder.get(h)
            if held is not None:
                held.discard(lease.id)
                if not held:
                    del self._by_holder[h]
        if lease.share_key is not None:
            rec.topic.shares.pop((rec.ci, lease.share_key), None)
        rec.topic.leases -= 1
        rec.topic.changes += 1
        fx.ended.append(lease.id)
