"""The candidacy bookkeeping of a topic's views (internal), the base of :class:`Topic`.

A *view* (:class:`View`) answers which samples a consumer may claim for a column set; every
mutation that may change it goes through :meth:`Candidacy._changing` or one of the mutation
methods of :class:`Topic` that use it, so its counts and hints can never fall out of step.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import numpy as np

from .._spec import TopicSpec
from ._table import Bools, Index, Ints, scatter_add
from ._topic_tables import TopicTables
from ._view import View

_NONE: Bools = np.zeros((), np.bool_)  # "no candidate before": 0-d, broadcasts against any rows


class Candidacy(TopicTables):
    """A topic's tables with its views: which samples each view counts as candidates."""

    def __init__(self, spec: TopicSpec, units: tuple[str, ...], load: Ints) -> None:
        super().__init__(spec, units, load)
        self.views: dict[tuple[int, frozenset[str]], View] = {}
        self.views_of: list[list[View]] = [[] for _ in spec.consumers]

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
