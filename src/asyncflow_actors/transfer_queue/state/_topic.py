"""Per-topic bookkeeping behind :class:`ControllerState` (internal), vectorized.

Samples and groups are rows of two :class:`Table`\\ s (one numpy array per field), so a put, a
claim or an ack of n samples is a handful of array operations, not n Python steps. Per-sample
fields: version, group, unit, length, present columns (a bit mask), consumers that acked and
that lease it (bit masks), bytes per column, committed. Per-group fields: unit, size, members
allocated and committed, shared columns present, live members, live members each consumer has
not acked, (member, consumer) pairs under lease, pending-eviction flag, first and last member.

A *view* (:class:`View`) answers which samples a consumer may claim for a column set; every
mutation that may change it goes through :meth:`Topic._changing` or one of the mutation methods
that use it, so its counts and hints can never fall out of step.

Capacity is counted in *occupied* slots: live samples plus reserved (not yet allocated) slots of
open groups, so a streaming group can always complete once opened.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from .._errors import SchemaError, UnknownColumn, UnknownConsumer, UnknownGroup
from .._spec import TopicSpec
from ._effects import Effects
from ._table import (
    Bools,
    Index,
    Ints,
    Table,
    distinct,
    popcount,
    rows_of,
    runs,
    scatter_add,
)
from ._view import View

_MAX_BITS = 63  # masks are int64
_NONE: Bools = np.zeros((), np.bool_)  # "no candidate before": 0-d, broadcasts against any rows
NO_MEMBER = int(np.iinfo(np.int64).max)  # ``first`` of a group with no member yet


def _bits(kind: str, topic: str, names: Iterable[str]) -> dict[str, int]:
    table = {name: 1 << k for k, name in enumerate(names)}
    if len(table) > _MAX_BITS:
        raise SchemaError(f"topic {topic!r}: at most {_MAX_BITS} {kind}, got {len(table)}")
    return table


class Topic:
    """The mutable state of one topic; :class:`ControllerState` validates, this mutates."""

    def __init__(self, spec: TopicSpec, units: tuple[str, ...], load: Ints) -> None:
        self.spec = spec
        self.name = spec.name
        self.units = units
        self.load = load  # shared with the state: occupied slots per unit, all topics
        self.consumer_ix = {c: i for i, c in enumerate(spec.consumers)}
        self.full = (1 << len(spec.consumers)) - 1
        self.col_bit = _bits("per-sample columns", spec.name, sorted(spec.sample_columns))
        self.shared_bit = _bits("shared columns", spec.name, sorted(spec.shared_columns))
        _bits("consumers", spec.name, spec.consumers)
        self.col_ix = {c: k for k, c in enumerate(self.col_bit)}
        self.shared_ix = {c: k for k, c in enumerate(self.shared_bit)}
        self.s = s = Table()
        for name in ("version", "gid", "gs", "unit", "length", "cols", "acked", "leased"):
            s.add(name, np.int64)
        s.add("nbytes", np.int64)
        s.add("cbytes", np.int64, max(1, len(self.col_bit)))
        s.add("committed", np.bool_)
        self.g = g = Table()
        for name in ("unit", "size", "alloc", "committed", "shared", "nbytes", "nmem", "held"):
            g.add(name, np.int64)
        g.add("first", np.int64)
        g.add("last", np.int64)
        g.add("owner", np.int64)
        g.add("born", np.int64)  # the topic's latest version when the group opened
        g.add("sbytes", np.int64, max(1, len(self.shared_bit)))
        g.add("unacked", np.int64, len(spec.consumers))
        g.add("doomed", np.bool_)
        g.add("explicit", np.bool_)
        g.add("deadline", np.float64)
        g.on_compact.append(self._groups_compacted)
        self.latest = 0
        self.next_index = 0
        self.next_gid = 0
        self.views: dict[tuple[int, frozenset[str]], View] = {}
        self.views_of: list[list[View]] = [[] for _ in spec.consumers]
        self.shares: dict[tuple[int, object], int] = {}  # (consumer, share key) -> lease id
        self.ndoomed = 0
        self.reserved = 0
        self.written = 0
        self.live_bytes = 0
        self.shared_total = 0
        self.leased_count = [0] * len(spec.consumers)
        self.consumed_count = [0] * len(spec.consumers)
        self.leases = 0
        self.allocated_total = 0
        self.freed_total = 0
        self.evicted_total = 0
        self.evicted_groups = 0
        self.lost_total = 0
        self.lost_groups = 0
        self.discarded_total = 0
        self.changes = 0
        # whole-group claims keep room for groups about to go stale (``WholeGroups``) for
        # ``lease_ttl`` from the first claim held back at the latest version, no longer: a
        # group whose writer died without a release must not stall its consumers till write_ttl
        self.hold_version = -1
        self.hold_until = math.inf
        self.hold_woken = True  # claims held back were told that the hold ended (or none was)

    # -- lookups -------------------------------------------------------------------------------

    @property
    def threshold(self) -> int:
        """Oldest fresh version: a sample is fresh iff ``version >= threshold``."""
        return self.latest - self.spec.staleness

    @property
    def occupied(self) -> int:
        return self.s.nlive + self.reserved

    def consumer(self, name: str) -> int:
        try:
            return self.consumer_ix[name]
        except KeyError:
            raise UnknownConsumer(
                f"topic {self.name!r} has no consumer {name!r} "
                f"(declared: {list(self.spec.consumers)})"
            ) from None

    def group(self, gid: int) -> int:
        """The slot of live group ``gid``; raises :class:`UnknownGroup`."""
        slot = self.g.slot_of(gid) if isinstance(gid, int) and not isinstance(gid, bool) else -1
        if slot < 0:
            state = (
                "is no longer live (freed, evicted or lost)"
                if isinstance(gid, int) and 0 <= gid < self.next_gid
                else "was never opened"
            )
            exc = UnknownGroup(f"group {gid!r} of topic {self.name!r} {state}")
            if isinstance(gid, int):
                exc.group_id = gid
            raise exc
        return slot

    def masks(self, columns: Iterable[str]) -> tuple[int, int]:
        """(per-sample mask, shared mask) of ``columns``; raises :class:`UnknownColumn`."""
        smask = gmask = 0
        for name in columns:
            if name in self.col_bit:
                smask |= self.col_bit[name]
            elif name in self.shared_bit:
                gmask |= self.shared_bit[name]
            else:
                raise UnknownColumn(
                    f"topic {self.name!r} has no column {name!r} "
                    f"(declared: {sorted(self.spec.columns)})"
                )
        return smask, gmask

    def members(self, gslot: int) -> Ints:
        """Slots of the live members of group ``gslot``, ascending."""
        s, g = self.s, self.g
        first = int(g.first[gslot])
        if first == NO_MEMBER:
            return np.zeros(0, np.int64)
        lo = s.first_at_or_after(first)
        hi = s.first_at_or_after(int(g.last[gslot]) + 1)
        return lo + np.flatnonzero(s.live[lo:hi] & (s.gs[lo:hi] == gslot))

    def members_of(self, gslots: Ints) -> Ints:
        """Slots of the live members of several groups, ascending."""
        if len(gslots) == 1:
            return self.members(int(gslots[0]))
        s, g = self.s, self.g
        sel = np.zeros(g.n, np.bool_)
        sel[gslots] = True
        n = s.n
        return np.flatnonzero(s.live[:n] & sel[np.minimum(s.gs[:n], g.n - 1)])

    def is_stale(self, gslot: int) -> bool:
        rows = self.members(gslot)
        return bool(rows.size) and int(self.s.version[rows].min()) < self.threshold

    # -- views ---------------------------------------------------------------------------------

    def view(self, ci: int, columns: frozenset[str]) -> View:
        """The view of consumer ``ci`` over ``columns``, built on first use (one O(n) pass)."""
        key = (ci, columns)
        v = self.views.get(key)
        if v is None:
            smask, gmask = self.masks(columns)
            field = f"cand{len(self.views)}"
            self.g.add(field, np.int64)
            v = View(ci, columns, smask, gmask, field)
            self.views[key] = v
            self.views_of[ci].append(v)
            rows = slice(0, self.s.n)
            c = self.cand(v, rows)
            self._count(v, self.s.gs[rows][c], 1)
        return v

    def cand(self, v: View, rows: Index) -> Bools:
        """Whether each sample of ``rows`` is a candidate of ``v``."""
        s = self.s
        m: Bools = s.live[rows] & ((s.cols[rows] & v.smask) == v.smask)
        m &= ((s.acked[rows] | s.leased[rows]) & v.bit) == 0
        if self.ndoomed or v.gmask:
            g = self.g
            gs = np.minimum(s.gs[rows], g.n - 1)
            if self.ndoomed:
                m &= ~g.doomed[gs]
            if v.gmask:
                m &= (g.shared[gs] & v.gmask) == v.gmask
        return m

    def _count(self, v: View, gslots: Ints, sign: int) -> None:
        if gslots.size:
            scatter_add(getattr(self.g, v.field), gslots, sign)
            v.nready += sign * int(gslots.size)

    @contextmanager
    def _changing(
        self, rows: Index, views: Iterable[View] | None = None, *, fresh: Iterable[View] = ()
    ) -> Iterator[None]:
        """Around a change of ``rows``' candidacy (columns present, acks, leases, doom, group
        shared columns): on exit, the views' counts and hints follow what changed. ``views``:
        those whose candidacy of ``rows`` may change (default: all); ``fresh``: views none of
        ``rows`` was a candidate of (nothing to look at before)."""
        befores = self._before(rows, views)
        yield
        self._after(rows, befores + [(v, _NONE) for v in fresh])

    def _before(self, rows: Index, views: Iterable[View] | None = None) -> list[tuple[View, Bools]]:
        """Candidacy of ``rows`` in ``views`` (default: all), to pass to :meth:`_after`."""
        return [(v, self.cand(v, rows)) for v in (self.views.values() if views is None else views)]

    def _after(self, rows: Index, befores: list[tuple[View, Bools]]) -> None:
        """Apply the candidacy changes of ``rows`` since :meth:`_before` to the views' counts."""
        s = self.s
        for v, was in befores:
            now = self.cand(v, rows)
            if was is _NONE:  # none was a candidate before: only gains (new samples)
                gained = now
            else:
                if np.array_equal(now, was):
                    continue
                gained = now & ~was
                self._count(v, s.gs[rows][was & ~now], -1)
            if gained.any():
                gs = s.gs[rows]
                self._count(v, gs[gained], 1)
                v.lo = min(v.lo, int(s.ids[rows][gained].min()))
                v.glo = min(v.glo, int(s.gid[rows][gained].min()))

    def _lower_group_hints(self, gid: int, views: Iterable[View] | None = None) -> None:
        """A group at or above ``gid`` may have become eligible (members, acks, size)."""
        for v in self.views.values() if views is None else views:
            v.glo = min(v.glo, gid)

    def eligible(self, v: View, lo: int, hi: int) -> Bools:
        """Whether each group of slots ``lo:hi`` is eligible for whole-group claims in ``v``."""
        g = self.g
        un = g.unacked[lo:hi, v.ci]
        m: Bools = g.live[lo:hi] & (g.alloc[lo:hi] == g.size[lo:hi]) & (un > 0)
        m &= getattr(g, v.field)[lo:hi] == un
        return m

    def ready_groups(self, v: View) -> tuple[int, int]:
        """(eligible groups, samples they hand out) for ``v``: one pass over the groups."""
        n = self.g.n
        m = self.eligible(v, 0, n)
        return int(m.sum()), int(self.g.unacked[:n, v.ci][m].sum())

    # -- structure -----------------------------------------------------------------------------

    def new_groups(self, unit_ix: Ints, size: int, *, explicit: bool, deadline: float) -> slice:
        """Open ``len(unit_ix)`` groups of ``size`` slots each (reserved at once)."""
        k = len(unit_ix)
        g = self.g
        rows = g.append(np.arange(self.next_gid, self.next_gid + k, dtype=np.int64))
        self.next_gid += k
        g.unit[rows] = unit_ix
        g.size[rows] = size
        g.first[rows] = NO_MEMBER
        g.last[rows] = -1
        g.owner[rows] = -1
        g.explicit[rows] = explicit
        g.deadline[rows] = deadline
        g.born[rows] = self.latest
        self.reserved += k * size
        scatter_add(self.load, unit_ix, size)
        return rows

    def new_samples(self, gslots: Ints, version: int, lengths: Ints) -> slice:
        """Allocate one sample into each group of ``gslots`` (a slot may repeat)."""
        k = len(gslots)
        s, g = self.s, self.g
        ids = np.arange(self.next_index, self.next_index + k, dtype=np.int64)
        self.next_index += k
        rows = s.append(ids)
        gids = g.ids[gslots]
        # new rows were candidates of no view; a view over shared columns only may count them
        # now, and their groups, fuller, may now be eligible for whole-group claims
        with self._changing(rows, (), fresh=[v for v in self.views.values() if v.smask == 0]):
            s.version[rows] = version
            s.gid[rows] = gids
            s.gs[rows] = gslots
            s.unit[rows] = g.unit[gslots]
            s.length[rows] = lengths
            where = runs(gslots)
            scatter_add(g.alloc, where, 1)
            scatter_add(g.nmem, where, 1)
            scatter_add(g.unacked, where, 1)
            at, _ = where
            if isinstance(at, int):  # members of one group (ids ascending)
                g.first[at] = min(int(g.first[at]), int(ids[0]))
                g.last[at] = max(int(g.last[at]), int(ids[-1]))
            elif isinstance(at, slice):  # one member per group
                np.minimum(g.first[at], ids, out=g.first[at])
                np.maximum(g.last[at], ids, out=g.last[at])
            else:
                np.minimum.at(g.first, gslots, ids)
                np.maximum.at(g.last, gslots, ids)
            self.reserved -= k  # the reserved slots become live samples: load unchanged
            self.allocated_total += k
        self._lower_group_hints(int(gids.min()))
        return rows

    def drop_samples(self, rows: Index, fx: Effects | None, *, consumed: bool = False) -> None:
        """Remove live samples from everything; ``fx`` gets their data to delete (if given).
        ``consumed``: every consumer acked them (so no view counts them as candidates)."""
        s, g = self.s, self.g
        gs = s.gs[rows]
        k = len(gs)
        if not k:
            return
        where = runs(gs)
        scatter_add(g.nmem, where, -1)
        if consumed:  # acked by every consumer, leased by none: no view counts them
            for ci in range(len(self.consumed_count)):
                self.consumed_count[ci] -= k
        else:
            for v in self.views.values():
                self._count(v, gs[self.cand(v, rows)], -1)
            acked = s.acked[rows]
            leased = s.leased[rows]
            ncons = len(self.consumed_count)
            bits = (acked[:, None] >> np.arange(ncons, dtype=np.int64)) & 1
            lbits = (leased[:, None] >> np.arange(ncons, dtype=np.int64)) & 1
            scatter_add(g.unacked, where, bits - 1)
            if leased.any():
                scatter_add(g.held, where, -popcount(leased))
            counts = zip(bits.sum(0).tolist(), lbits.sum(0).tolist(), strict=True)
            for ci, (a, lz) in enumerate(counts):
                self.consumed_count[ci] -= a
                self.leased_count[ci] -= lz
        self.written -= int(np.count_nonzero(s.cols[rows]))
        nbytes = s.nbytes[rows]
        self.live_bytes -= int(nbytes.sum())
        units = s.unit[rows]
        scatter_add(self.load, units, -1)
        s.kill(rows, k)
        if fx is not None:
            fx.free(self.units, self.name, units, s.ids[rows], nbytes, groups=False)

    def drop_groups(self, gslots: Ints, fx: Effects | None) -> None:
        """Remove groups with no live members (their pending slots and shared blobs go too)."""
        if not gslots.size:
            return
        g = self.g
        pending = g.size[gslots] - g.alloc[gslots]
        reserved = int(pending.sum())
        units = g.unit[gslots]
        if reserved:  # (groups freed once complete, the common case, reserve nothing)
            self.reserved -= reserved
            scatter_add(self.load, units, -pending)
        nbytes = g.nbytes[gslots]
        self.shared_total -= int(nbytes.sum())
        if self.ndoomed:
            self.ndoomed -= int(np.count_nonzero(g.doomed[gslots]))
            g.doomed[gslots] = False
        g.kill(gslots, len(gslots))
        if fx is not None:
            fx.free(self.units, self.name, units, g.ids[gslots], nbytes, groups=True)

    def settle(self, gslots: Ints, fx: Effects) -> None:
        """After groups lost members or leases: evict the stale unheld ones, free the done ones."""
        g = self.g
        gslots = distinct(gslots)
        gslots = gslots[g.live[gslots]]
        if self.ndoomed:
            for x in gslots[g.doomed[gslots]].tolist():
                if not self.is_stale(x):
                    self.undoom(x)  # its stale members were freed or discarded: back in the pool
                elif g.held[x] == 0:
                    self.evict(np.array([x], np.int64), fx)
            gslots = gslots[g.live[gslots]]
        done = (g.nmem[gslots] == 0) & (g.alloc[gslots] == g.size[gslots])
        self.drop_groups(gslots[done], fx)

    def evict(self, gslots: Ints, fx: Effects) -> None:
        """Evict whole groups (stale and unheld): members and shared blobs, reported once."""
        s, g = self.s, self.g
        rows = self.members_of(gslots)
        nbytes = int(g.nbytes[gslots].sum()) + int(s.nbytes[rows].sum())
        indexes = s.ids[rows].tolist()
        gids = g.ids[gslots].tolist()
        self.drop_samples(rows, fx)
        self.drop_groups(gslots, fx)
        self.evicted_total += len(indexes)
        self.evicted_groups += len(gids)
        fx.evicted(self.name, gids, indexes, nbytes)

    def write(self, slots: Ints, ascending: bool, sizes: dict[str, Any], mask: int) -> bool:
        """Per-sample columns ``mask`` of live samples ``slots`` are stored now (``sizes``: bytes
        per column, one int or one per sample). Returns whether it committed new samples."""
        s = self.s
        rows = rows_of(slots, ascending=ascending) if ascending else slots
        fresh = not s.cols[rows].any()  # the first write of new samples: the common put
        # a view over per-sample columns counts none of them yet: nothing to compute before
        views = self.views.values()
        with self._changing(
            rows,
            [v for v in views if not fresh or not v.smask],
            fresh=[v for v in views if fresh and v.smask],
        ):
            committing = self._write(rows, len(slots), fresh, sizes, mask)
        self.changes += 1
        return committing

    def _write(self, rows: Index, n: int, fresh: bool, sizes: dict[str, Any], mask: int) -> bool:
        s, g = self.s, self.g
        if fresh and all(isinstance(new, int) for new in sizes.values()):
            # one size per column (the common put): the same sizes for every row, others still 0
            self.written += n
            per_row = np.zeros(s.cbytes.shape[1], np.int64)
            for col, new in sizes.items():
                per_row[self.col_ix[col]] = new
            s.cbytes[rows] = per_row
            total = int(per_row.sum())
            s.nbytes[rows] = total
            self.live_bytes += total * n
        elif fresh:
            self.written += n
            for col, new in sizes.items():
                s.cbytes[rows, self.col_ix[col]] = new
                total = new.sum() if isinstance(new, np.ndarray) else new * n
                self.live_bytes += int(total)
            s.nbytes[rows] = s.cbytes[rows].sum(axis=1)
        else:
            self.written += int(np.count_nonzero(s.cols[rows] == 0))
            for col, new in sizes.items():
                k = self.col_ix[col]
                delta = new - s.cbytes[rows, k]
                s.cbytes[rows, k] = new
                s.nbytes[rows] += delta
                self.live_bytes += int(delta.sum()) if isinstance(delta, np.ndarray) else int(delta)
        s.cols[rows] |= mask
        first = ~s.committed[rows]
        committing = bool(first.any())
        if committing:
            s.committed[rows] = True
            scatter_add(g.committed, s.gs[rows][first], 1)
        return committing

    def write_shared(self, gslot: int, sizes: dict[str, int], mask: int) -> None:
        """Group-shared columns ``mask`` of group ``gslot`` are stored now (bytes each)."""
        g = self.g
        for col, new in sizes.items():
            k = self.shared_ix[col]
            delta = new - int(g.sbytes[gslot, k])
            g.sbytes[gslot, k] = new
            g.nbytes[gslot] += delta
            self.shared_total += delta
        if int(g.shared[gslot]) | mask != int(g.shared[gslot]):
            with self._changing(self.members(gslot)):
                g.shared[gslot] |= mask
        self.changes += 1

    def shrink(self, gslots: Ints, slots: Ints, fx: Effects) -> None:
        """Give up ``slots`` unfilled member slots of each group of ``gslots``."""
        g = self.g
        g.size[gslots] -= slots
        self.reserved -= int(slots.sum())
        scatter_add(self.load, g.unit[gslots], -slots)
        self._lower_group_hints(int(g.ids[gslots].min()))
        self.settle(gslots, fx)

    def discard(self, rows: Ints, fx: Effects, *, keep_slots: bool = False) -> None:
        """Drop live samples on purpose: their groups shrink by as many members, or with
        ``keep_slots`` keep their size and get the slots back (reserved again)."""
        s, g = self.s, self.g
        gs = s.gs[rows]
        where = runs(gs)
        if not keep_slots:
            scatter_add(g.size, where, -1)
        scatter_add(g.alloc, where, -1)
        scatter_add(g.committed, where, -s.committed[rows].astype(np.int64))
        self.drop_samples(rows_of(rows), fx)
        if keep_slots:  # occupied as before: the samples' slots are their groups' again
            self.reserved += len(rows)
            scatter_add(self.load, g.unit[gs], 1)
        self.discarded_total += len(rows)
        self._lower_group_hints(int(s.gid[rows].min()))
        self.settle(gs, fx)

    def unallocate(self, rows: Ints, fx: Effects) -> None:
        """Undo the allocation of live samples (a put that failed before its commit): members
        of open groups that were never committed give their slots back to their groups, which
        keep their size (reserved again: the writer may put into them anew); other rows
        (committed, or an ungrouped sample's own group) are discarded. Counted as discarded."""
        s, g = self.s, self.g
        back = g.explicit[s.gs[rows]] & ~s.committed[rows]
        if not back.all():
            self.discard(rows[~back], fx)
        if back.any():
            self.discard(rows[back], fx, keep_slots=True)

    # -- leases --------------------------------------------------------------------------------

    def lease(self, v: View, rows: Ints) -> None:
        """``rows`` are candidates of ``v``: lease them to its consumer."""
        s = self.s
        # Whole groups come group by group, not always ascending: [0, 1, 4, 3] spans 0..3 from
        # its first to its last row but is not that run (a slice would lease row 2).
        index = rows_of(rows)
        # every row is a candidate of ``v`` (no need to compute it); its other views may differ
        others = [w for w in self.views_of[v.ci] if w is not v]
        befores = self._before(index, others) if others else []
        s.leased[index] |= v.bit
        gs = s.gs[index]
        where = runs(gs)
        scatter_add(self.g.held, where, 1)
        self.leased_count[v.ci] += len(rows)
        for w, was in befores:  # leased: no view of this consumer counts them any more
            self._count(w, gs[was], -1)
        scatter_add(getattr(self.g, v.field), where, -1)  # all were candidates of ``v``
        v.nready -= where[1]

    def unlease(self, rows: Ints, ci: int, ascending: bool, fx: Effects) -> None:
        """Return live samples ``rows`` leased to consumer ``ci`` to its pool."""
        s = self.s
        index = rows_of(rows, ascending=ascending)
        with self._changing(index, self.views_of[ci]):
            s.leased[index] &= ~(1 << ci)
            gs = s.gs[index]
            scatter_add(self.g.held, gs, -1)
            self.leased_count[ci] -= len(rows)
        self.settle(gs, fx)

    def ack(self, rows: Ints, ci: int, ascending: bool, fx: Effects) -> None:
        """Consumer ``ci`` consumed live samples ``rows`` it leased; those every consumer has
        acked are freed."""
        s, g = self.s, self.g
        bit = 1 << ci
        index = rows_of(rows, ascending=ascending)
        gs = s.gs[index]
        s.leased[index] &= ~bit  # leased, then acked: a candidate of no view of ``ci`` either way
        s.acked[index] |= bit
        where = runs(gs)
        scatter_add(g.held, where, -1)
        scatter_add(g.unacked[:, ci], where, -1)
        self.leased_count[ci] -= len(rows)
        self.consumed_count[ci] += len(rows)
        done = rows[s.acked[index] == self.full]
        self.freed_total += len(done)
        self.drop_samples(rows_of(done, ascending=ascending), fx, consumed=True)
        # fewer unacked members: their groups may be eligible for ``ci`` now
        self._lower_group_hints(int(s.gid[index].min()), self.views_of[ci])
        self.settle(gs, fx)

    # -- versions --------------------------------------------------------------------------------

    def apply_window(self, fx: Effects) -> None:
        """Groups with a member below the window: evicted if unheld, else doomed."""
        s, g = self.s, self.g
        n = s.n
        stale = np.flatnonzero(s.live[:n] & (s.version[:n] < self.threshold))
        if not stale.size:
            return
        gslots = np.unique(s.gs[stale])
        gslots = gslots[~g.doomed[gslots]]
        held = g.held[gslots] > 0
        self.doom(gslots[held])
        if not held.all():
            self.evict(gslots[~held], fx)

    def doom(self, gslots: Ints) -> None:
        """Stale but held groups leave every view now; evicted when their last lease ends."""
        with self._changing(self.members_of(gslots)):
            self.g.doomed[gslots] = True
            self.ndoomed += len(gslots)

    def undoom(self, gslot: int) -> None:
        with self._changing(self.members(gslot)):
            self.g.doomed[gslot] = False
            self.ndoomed -= 1
        self._lower_group_hints(int(self.g.ids[gslot]))

    def tidy(self) -> None:
        """Compact the tables once dead rows dominate (call between operations only)."""
        self.s.maybe_compact()
        self.g.maybe_compact()

    def _groups_compacted(self, keep: Bools) -> None:
        s, g = self.s, self.g
        if g.n:
            s.gs[: s.n] = np.minimum(np.searchsorted(g.ids[: g.n], s.gid[: s.n]), g.n - 1)
