"""Leases: who holds which samples for which consumer, until ack, nack, expiry or holder death.

:class:`LeaseTable` is internal to :class:`ControllerState`, which validates arguments and
documents the public contract; the table selects (vectorized, from the view's hint onwards),
marks samples leased, and on every lease ending updates the topic's views, frees what every
consumer acked, and evicts stale groups whose last lease ended.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable

import attrs
import numpy as np

from .._errors import ShareMismatch, UnknownLease
from .._results import Lease
from .._samplers import (
    MAX_SKIPPED_GROUPS,
    Balanced,
    Sampler,
    partition_lpt,
    uses_groups,
    waits_expiring,
)
from ._effects import Effects
from ._table import Ints, ascending, groups_of
from ._topic import Topic
from ._view import View

#: Lease ids of epoch ``e`` are ``e << EPOCH_BITS`` onwards, so ids never repeat across restarts.
EPOCH_BITS = 40


class _LeaseRec:
    __slots__ = (
        "acked_by", "ascending", "ci", "compactions", "holders", "ids", "lease", "rows",
        "sampler", "topic",
    )  # fmt: skip

    def __init__(
        self, lease: Lease, ids: Ints, rows: Ints, topic: Topic, ci: int, sampler: Sampler
    ) -> None:
        self.lease = lease
        self.ids = ids  # the lease's indexes as an array
        self.rows = rows  # their slots, valid while the sample table has not compacted since
        self.compactions = topic.s.compactions
        self.ascending = ascending(ids)
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
        chunks: list[Ints] | None = None
        if uses_groups(sampler):
            picked = self._pick_groups(t, v, count, low, waits_expiring(sampler), now)
            if picked is None:
                return None
            rows, chunks = picked
        else:
            fifo = _pick_fifo(t, v, count, low)
            if fifo is None:
                return None
            rows = fifo
        t.lease(v, rows)
        ids = t.s.ids[rows]
        if isinstance(sampler, Balanced):
            lengths = t.s.length[rows]
            if chunks is None:
                items = [(int(x), [int(i)]) for x, i in zip(lengths, ids, strict=True)]
            else:
                items, k = [], 0
                for chunk in chunks:
                    items.append(
                        (int(lengths[k : k + len(chunk)].sum()), ids[k : k + len(chunk)].tolist())
                    )
                    k += len(chunk)
            parts = partition_lpt(items, sampler.dp_size, equal_count=not sampler.whole_groups)
            partitions = tuple(tuple(p) for p in parts)
        else:
            partitions = (tuple(ids.tolist()),)
        lease = self._new_lease(t, ci, holder, v, rows, partitions, now, share_key, share_count)
        rec = _LeaseRec(lease, ids, rows, t, ci, sampler)
        self._leases[lease.id] = rec
        self._by_holder.setdefault(holder, set()).add(lease.id)
        heapq.heappush(self._expiry, (lease.deadline, lease.id))
        if share_key is not None:
            t.shares[(ci, share_key)] = lease.id
        t.leases += 1
        t.changes += 1
        return lease

    @staticmethod
    def _pick_groups(
        t: Topic, v: View, count: int, low: int, wait_expiring: bool = False, now: float = 0.0
    ) -> tuple[Ints, list[Ints]] | None:
        """Oldest eligible groups, first fit up to ``count`` samples: their unacked members,
        group by group (the rows, and each group's rows), or ``None`` below ``low``. With
        ``wait_expiring``, room is kept for the groups about to expire that are not eligible
        yet: the others fill at most ``count`` less their samples (see ``WholeGroups``), for
        ``lease_ttl`` from the first claim held back at this version (``Topic.hold_until``)."""
        g = t.g
        n = g.n
        pos = g.first_at_or_after(v.glo)
        if wait_expiring:
            reserve = _expiring_reserve(t, v)
            if reserve:
                if t.hold_version != t.latest:  # the first claim held back at this version
                    t.hold_version, t.hold_until = t.latest, now + t.spec.lease_ttl
                    t.hold_woken = False
                if now >= t.hold_until:
                    reserve = 0  # waited long enough: the group's writer may be dead
            count -= reserve
            if count < max(low, 1):
                return None
        chosen: list[int] = []
        total = skipped = 0
        first = -1
        step = 256
        while pos < n and total < count and skipped < MAX_SKIPPED_GROUPS:
            end = min(n, pos + step)
            found = pos + np.flatnonzero(t.eligible(v, pos, end))
            if first < 0 and found.size:
                first = int(found[0])
            amounts = g.unacked[found, v.ci].tolist()
            for slot, amount in zip(found.tolist(), amounts, strict=True):
                if total + amount <= count:
                    chosen.append(slot)
                    total += amount
                    if total == count:
                        break
                else:
                    skipped += 1
                    if skipped >= MAX_SKIPPED_GROUPS:
                        break
            pos = end
            step *= 2
        v.glo = int(g.ids[first]) if first >= 0 else (int(g.ids[pos - 1]) + 1 if pos else v.glo)
        if total < low or not chosen:
            return None
        s = t.s
        gslots = np.array(chosen, np.int64)
        rows = t.members_of(gslots)
        rows = rows[(s.acked[rows] & v.bit) == 0]
        order = np.lexsort((rows, s.gs[rows]))  # group by group (oldest first), then by index
        rows = rows[order]
        cuts = np.flatnonzero(np.diff(s.gs[rows])) + 1
        return rows, np.split(rows, cuts)

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

    def _new_lease(
        self,
        t: Topic,
        ci: int,
        holder: str,
        v: View,
        rows: Ints,
        partitions: tuple[tuple[int, ...], ...],
        now: float,
        share_key: Hashable | None,
        share_count: int,
    ) -> Lease:
        s = t.s
        ids = s.ids[rows]
        units = s.unit[rows]
        gids = s.gid[rows]
        placement = {t.units[u]: tuple(ids[mine].tolist()) for u, mine in groups_of(units)}
        shared: dict[str, tuple[int, ...]] = {}
        if v.gmask:
            _, first = np.unique(gids, return_index=True)
            first.sort()
            for u in np.unique(units[first]).tolist():
                shared[t.units[u]] = tuple(gids[first][units[first] == u].tolist())
        lid = self._next
        self._next += 1
        return Lease(
            id=lid,
            topic=t.name,
            consumer=t.spec.consumers[ci],
            holder=holder,
            columns=v.columns,
            indexes=tuple(ids.tolist()),
            versions=tuple(s.version[rows].tolist()),
            group_ids=tuple(gids.tolist()),
            placement=placement,
            shared=shared,
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
        rows = _present(rec, fx)
        if len(rows):
            rec.topic.ack(rows, rec.ci, rec.ascending, fx)
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

    def touching(self, topic: str, indexes: Ints) -> tuple[int, ...]:
        """Ids of outstanding leases of ``topic`` that include any of ``indexes``."""
        return tuple(
            lid
            for lid, rec in self._leases.items()
            if rec.topic.name == topic and bool(np.isin(rec.ids, indexes).any())
        )

    def _return(self, rec: _LeaseRec, fx: Effects) -> None:
        rows = _present(rec, fx)
        if len(rows):
            rec.topic.unlease(rows, rec.ci, rec.ascending, fx)
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
        rec.topic.tidy()
        fx.ended.append(lease.id)


def _expiring_reserve(t: Topic, v: View) -> int:
    """The samples that ``v``'s consumer still needs of the groups that the next version makes
    stale and that it cannot claim yet (incomplete, or members not yet ready for the view's
    columns; none of them leased by the consumer): the room a claim keeps for them."""
    g = t.g
    n = g.n
    limit = t.latest - t.spec.staleness  # born at or below it: stale at the next version
    m = g.live[:n] & ~g.doomed[:n] & (g.born[:n] <= limit)
    m &= (g.alloc[:n] < g.size[:n]) | (g.unacked[:n, v.ci] > 0)
    if not m.any():
        return 0
    m &= ~t.eligible(v, 0, n)
    s = t.s
    reserve = 0
    for slot in np.flatnonzero(m).tolist():
        rows = t.members_of(np.array([slot], np.int64))
        if not (s.leased[rows] & v.bit).any():
            reserve += int(g.unacked[slot, v.ci]) + int(g.size[slot]) - int(g.alloc[slot])
    return reserve


def _pick_fifo(t: Topic, v: View, count: int, low: int) -> Ints | None:
    """The oldest ``min(count, ready)`` candidates of ``v`` (slots), or ``None`` below ``low``."""
    if v.nready < low:
        return None
    s = t.s
    n = s.n
    need = min(count, v.nready)
    pos = s.first_at_or_after(v.lo)
    step = max(2 * need, 512)
    found: list[Ints] = []
    first = -1
    while need > 0 and pos < n:
        end = min(n, pos + step)
        hits = pos + np.flatnonzero(t.cand(v, slice(pos, end)))
        if hits.size:
            if first < 0:
                first = int(hits[0])
            found.append(hits[:need])
            need -= min(need, hits.size)
        pos = end
        step *= 2
    assert first >= 0 and need == 0, "the view's ready count is out of step"
    v.lo = int(s.ids[first])
    return found[0] if len(found) == 1 else np.concatenate(found)


def _present(rec: _LeaseRec, fx: Effects) -> Ints:
    """Slots of the lease's samples still live; the others go to ``fx.missing``."""
    s = rec.topic.s
    if rec.compactions == s.compactions and s.live[rec.rows].all():
        return rec.rows  # no slot moved and none died: no lookup (a dead one is never reused)
    slots, ok = s.find(rec.ids)
    if not ok.all():
        fx.missing.extend(rec.ids[~ok].tolist())
        return slots[ok]
    return slots
