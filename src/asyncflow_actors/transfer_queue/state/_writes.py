"""Writes in progress, and what a writer that dies or goes silent leaves behind (internal).

A put allocates samples, stores their data, then commits them; an open group waits for its
members. :class:`Writes` keeps, per topic, the allocations not yet committed (those with a
deadline in deadline order: ``now`` never goes back; those of a named writer with none apart,
for its release only) and the open groups' deadlines, so that ``ControllerState``
can give them up at ``write_ttl`` (:meth:`Writes.expire`) or when their writer goes away
(:meth:`Writes.release`): uncommitted samples are discarded, unfilled slots given up, and both
are reported as abandoned.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict

import numpy as np

from ._check import holder_name
from ._effects import Effects
from ._table import Ints
from ._topic import Topic


class _Write:
    """An allocation not yet committed: indexes ``start..stop-1`` by ``holder``."""

    __slots__ = ("deadline", "holder", "start", "stop")

    def __init__(self, start: int, stop: int, holder: str | None, deadline: float) -> None:
        self.start = start
        self.stop = stop
        self.holder = holder
        self.deadline = deadline


class Writes:
    """See the module docstring. Deadlines are ``inf`` where no ``now`` or ``write_ttl`` was
    given: those writes are only given up with their holder (kept in ``_held`` so that they
    never block the deadline order of ``_pending``)."""

    def __init__(self) -> None:
        self._pending: dict[str, OrderedDict[int, _Write]] = {}
        self._held: dict[str, dict[int, _Write]] = {}  # no deadline, a holder: its release
        self._held_mark: dict[str, int] = {}  # size of ``_held`` after its last pruning
        self._groups: list[tuple[float, str, int]] = []  # (deadline, topic, gid), lazily checked
        self._holders: dict[str, int] = {}  # holder name -> id (open groups keep the id)

    def add_topic(self, name: str) -> None:
        self._pending[name] = OrderedDict()
        self._held[name] = {}

    def holder_id(self, holder: str | None) -> int:
        if holder is None:
            return -1
        return self._holders.setdefault(holder_name(holder), len(self._holders))

    def allocated(self, t: Topic, ids: Ints, holder: str | None, deadline: float) -> None:
        start = int(ids[0])
        if deadline != math.inf:
            self._pending[t.name][start] = _Write(start, int(ids[-1]) + 1, holder, deadline)
        elif holder is not None:  # no deadline: only its holder's release gives it up
            held = self._held[t.name]
            if len(held) >= 2 * self._held_mark.get(t.name, 32):  # amortised: drop the writes
                for w in [w for w in held.values() if not _uncommitted(t, w).size]:  # undone
                    del held[w.start]  # (discarded) before their commit, never to be released
                self._held_mark[t.name] = max(len(held), 32)
            held[start] = _Write(start, int(ids[-1]) + 1, holder, deadline)

    def group_deadline(self, topic: str, gid: int, deadline: float) -> None:
        if deadline != math.inf:
            heapq.heappush(self._groups, (deadline, topic, gid))

    def committed(self, t: Topic, first: int, count: int, *, whole: bool) -> None:
        """Samples from index ``first`` were committed (``whole``: exactly one write's run)."""
        for pending in (self._pending[t.name], self._held[t.name]):
            w = pending.get(first) if pending else None
            if w is not None and (
                (whole and w.stop - w.start == count) or not _uncommitted(t, w).size
            ):
                del pending[w.start]

    def rebuilt(self, topic: str, index: int, deadline: float) -> None:
        """An uncommitted sample found at a rebuild: extend the last write or start one."""
        if deadline == math.inf:
            return
        pending = self._pending[topic]
        last = next(reversed(pending.values()), None)
        if last is not None and last.stop == index and last.deadline == deadline:
            last.stop = index + 1
        else:
            pending[index] = _Write(index, index + 1, None, deadline)

    def next_deadline(self, topics: dict[str, Topic]) -> float | None:
        deadlines = [next(iter(p.values())).deadline for p in self._pending.values() if p]
        while self._groups:
            deadline, topic, gid = self._groups[0]
            g = topics[topic].g
            slot = g.slot_of(gid)
            if slot >= 0 and g.deadline[slot] == deadline and g.alloc[slot] < g.size[slot]:
                deadlines.append(deadline)
                break
            heapq.heappop(self._groups)
        return min(deadlines, default=None)

    def expire(self, topics: dict[str, Topic], now: float, fx: Effects) -> None:
        """Give up the writes and open groups whose deadline is ``<= now``."""
        for topic, pending in self._pending.items():
            while pending and next(iter(pending.values())).deadline <= now:
                _abandon_write(topics[topic], pending.popitem(last=False)[1], fx)
        while self._groups and self._groups[0][0] <= now:
            deadline, topic, gid = heapq.heappop(self._groups)
            t = topics[topic]
            slot = t.g.slot_of(gid)
            if slot >= 0 and t.g.deadline[slot] == deadline:
                _abandon_slots(t, np.array([slot], np.int64), fx)

    def release(self, topics: dict[str, Topic], holder: str, fx: Effects) -> None:
        """``holder`` went away: give up its uncommitted writes and its groups' open slots."""
        for writes in (self._pending, self._held):
            for topic, pending in writes.items():
                for w in [w for w in pending.values() if w.holder == holder]:
                    del pending[w.start]
                    _abandon_write(topics[topic], w, fx)
        owner = self._holders.get(holder)
        if owner is not None:
            for t in topics.values():
                g = t.g
                slots = np.flatnonzero(g.live[: g.n] & (g.owner[: g.n] == owner))
                _abandon_slots(t, slots, fx)


def _uncommitted(t: Topic, w: _Write) -> Ints:
    s = t.s
    lo, hi = s.first_at_or_after(w.start), s.first_at_or_after(w.stop)
    return lo + np.flatnonzero(s.live[lo:hi] & ~s.committed[lo:hi])


def _abandon_write(t: Topic, w: _Write, fx: Effects) -> None:
    s = t.s
    rows = _uncommitted(t, w)
    if rows.size:
        fx.abandoned(t.name, s.ids[rows].tolist(), s.gid[rows].tolist())
        t.discard(rows, fx)
        t.changes += 1


def _abandon_slots(t: Topic, gslots: Ints, fx: Effects) -> None:
    g = t.g
    pending = g.size[gslots] - g.alloc[gslots]
    gslots, pending = gslots[pending > 0], pending[pending > 0]
    if gslots.size:
        fx.abandoned(t.name, (), g.ids[gslots].tolist())
        t.shrink(gslots, pending, fx)
        t.changes += 1
