"""The mutations of one topic's state behind :class:`ControllerState` (internal), vectorized.

:class:`Topic` changes the tables of :class:`TopicTables` (structure, writes, leases, the
version window) and keeps the views of :class:`Candidacy` in step with every change: each
mutation that may change a sample's candidacy goes through ``_changing`` (or counts the change
itself), so a view's counts and hints can never fall out of step.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._candidacy import Candidacy
from ._effects import Effects
from ._table import Index, Ints, distinct, popcount, rows_of, runs, scatter_add
from ._topic_tables import NO_MEMBER
from ._view import View


class Topic(Candidacy):
    """The mutable state of one topic; :class:`ControllerState` validates, this mutates."""

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
