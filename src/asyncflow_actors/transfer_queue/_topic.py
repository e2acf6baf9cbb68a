"""Per-topic bookkeeping behind :class:`ControllerState` (internal).

Samples, groups and *views* live here. A view is the incremental answer to "which samples may
consumer c claim for columns C": a sample is a candidate of view (c, C) iff its per-sample columns
of C are present, its group's shared columns of C are present, c has neither acked nor leased it,
and its group is not pending eviction. Each view keeps its candidates in an ordered set, and its
*eligible groups* (complete, with every member c has not acked a candidate) in another, so claims
never scan. Every mutation keeps the views in sync through :meth:`Topic.sync` and
:meth:`Topic.refresh`; freshness needs no per-claim check because stale groups leave every view
the moment the version moves past them (see ``ControllerState.set_latest_version``).

Capacity is counted in *occupied* slots: live samples plus reserved (not yet allocated) slots of
open groups, so a streaming group can always complete once opened.
"""

from __future__ import annotations

from collections.abc import Iterable

from ._errors import UnknownColumn, UnknownConsumer, UnknownGroup
from ._ordered import IndexSet
from ._results import STALE, Eviction, Release, Update
from ._spec import TopicSpec


class Sample:
    __slots__ = (
        "acked",
        "col_bytes",
        "cols",
        "gid",
        "index",
        "leased",
        "length",
        "nbytes",
        "unit",
        "version",
    )

    def __init__(self, index: int, version: int, gid: int, unit: str, length: int) -> None:
        self.index = index
        self.version = version
        self.gid = gid
        self.unit = unit
        self.length = length
        self.cols = 0  # bitmask of per-sample columns present
        self.col_bytes: dict[str, int] = {}
        self.nbytes = 0
        self.acked = 0  # bitmask of consumers that acked
        self.leased = 0  # bitmask of consumers holding it under a lease


class Group:
    __slots__ = (
        "allocated",
        "doomed",
        "gid",
        "held",
        "members",
        "nbytes",
        "shared",
        "shared_bytes",
        "size",
        "unconsumed",
        "unit",
    )

    def __init__(self, gid: int, unit: str, size: int, consumers: int) -> None:
        self.gid = gid
        self.unit = unit
        self.size = size  # expected members (shrinks with discards)
        self.allocated = 0  # members allocated and not discarded (incl. freed ones)
        self.members: list[int] = []  # live member indexes
        self.shared = 0  # bitmask of shared columns present
        self.shared_bytes: dict[str, int] = {}
        self.nbytes = 0
        self.unconsumed = [0] * consumers  # live members not acked, per consumer
        self.held = 0  # (member, consumer) pairs under a lease
        self.doomed = False  # stale but held: evicted when the last lease on it ends

    @property
    def pending(self) -> int:
        return self.size - self.allocated


class View:
    __slots__ = (
        "amount",
        "bit",
        "cand",
        "ci",
        "columns",
        "gmask",
        "groups",
        "ready",
        "smask",
        "total",
    )

    def __init__(self, ci: int, columns: frozenset[str], smask: int, gmask: int) -> None:
        self.ci = ci
        self.bit = 1 << ci
        self.columns = columns
        self.smask = smask
        self.gmask = gmask
        self.ready = IndexSet()  # candidate sample indexes
        self.cand: dict[int, int] = {}  # group id -> candidates in it
        self.groups = IndexSet()  # eligible group ids
        self.amount: dict[int, int] = {}  # eligible group id -> samples it hands out
        self.total = 0  # sum of amount


class Effects:
    """Collects what one mutating call must report, then builds its :class:`Update`."""

    def __init__(self) -> None:
        self._rel: dict[tuple[str, str], tuple[list[int], list[int], list[int]]] = {}
        self._evi: dict[str, tuple[list[int], list[int], list[int]]] = {}
        self.ended: list[int] = []
        self.missing: list[int] = []

    def _entry(self, unit: str, topic: str) -> tuple[list[int], list[int], list[int]]:
        entry = self._rel.get((unit, topic))
        if entry is None:
            entry = self._rel[(unit, topic)] = ([], [], [0])
        return entry

    def free_sample(self, unit: str, topic: str, index: int, nbytes: int) -> None:
        entry = self._entry(unit, topic)
        entry[0].append(index)
        entry[2][0] += nbytes

    def free_group(self, unit: str, topic: str, gid: int, nbytes: int) -> None:
        entry = self._entry(unit, topic)
        entry[1].append(gid)
        entry[2][0] += nbytes

    def evicted(self, topic: str, gid: int, indexes: Iterable[int], nbytes: int) -> None:
        entry = self._evi.setdefault(topic, ([], [], [0]))
        entry[0].append(gid)
        entry[1].extend(indexes)
        entry[2][0] += nbytes

    def update(self) -> Update:
        return Update(
            releases=tuple(
                Release(unit=u, topic=t, indexes=tuple(i), group_ids=tuple(g), nbytes=n[0])
                for (u, t), (i, g, n) in self._rel.items()
            ),
            evictions=tuple(
                Eviction(topic=t, group_ids=tuple(g), indexes=tuple(i), reason=STALE, nbytes=n[0])
                for t, (g, i, n) in self._evi.items()
            ),
            ended=tuple(self.ended),
            missing=tuple(self.missing),
        )


def _popcount(mask: int) -> int:
    return bin(mask).count("1")


class Topic:
    """The mutable state of one topic; :class:`ControllerState` validates, this mutates."""

    def __init__(self, spec: TopicSpec, load: dict[str, int]) -> None:
        self.spec = spec
        self.name = spec.name
        self.load = load  # shared with the state: occupied slots per unit, all topics
        self.consumer_ix = {c: i for i, c in enumerate(spec.consumers)}
        self.full = (1 << len(spec.consumers)) - 1
        self.col_bit: dict[str, int] = {}
        self.shared_bit: dict[str, int] = {}
        for name, col in spec.columns.items():
            table = self.shared_bit if col.shared else self.col_bit
            table[name] = 1 << len(table)
        self.latest = 0
        self.next_index = 0
        self.next_gid = 0
        self.samples: dict[int, Sample] = {}
        self.groups: dict[int, Group] = {}
        self.views: dict[tuple[int, frozenset[str]], View] = {}
        self.views_of: list[list[View]] = [[] for _ in spec.consumers]
        self.vheap: list[tuple[int, int]] = []  # (member version, group id), lazily checked
        self.shares: dict[tuple[int, object], int] = {}  # (consumer, share key) -> lease id
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

    # -- lookups -------------------------------------------------------------------------------

    @property
    def threshold(self) -> int:
        """Oldest fresh version: a sample is fresh iff ``version >= threshold``."""
        return self.latest - self.spec.staleness

    @property
    def occupied(self) -> int:
        return len(self.samples) + self.reserved

    def consumer(self, name: str) -> int:
        try:
            return self.consumer_ix[name]
        except KeyError:
            raise UnknownConsumer(
                f"topic {self.name!r} has no consumer {name!r} "
                f"(declared: {list(self.spec.consumers)})"
            ) from None

    def group(self, gid: int) -> Group:
        g = self.groups.get(gid)
        if g is None:
            state = (
                "is no longer live (freed, evicted or lost)"
                if 0 <= gid < self.next_gid
                else "was never opened"
            )
            raise UnknownGroup(f"group {gid!r} of topic {self.name!r} {state}")
        return g

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

    # -- views ---------------------------------------------------------------------------------

    def view(self, ci: int, columns: frozenset[str]) -> View:
        """The view of consumer ``ci`` over ``columns``, built on first use (one O(n) scan)."""
        key = (ci, columns)
        v = self.views.get(key)
        if v is None:
            smask, gmask = self.masks(columns)
            v = View(ci, columns, smask, gmask)
            self.views[key] = v
            self.views_of[ci].append(v)
            for g in self.groups.values():
                for index in g.members:
                    s = self.samples[index]
                    if self.is_candidate(s, g, v):
                        v.ready.add(index)
                        v.cand[g.gid] = v.cand.get(g.gid, 0) + 1
                self.refresh(v, g)
        return v

    def is_candidate(self, s: Sample, g: Group, v: View) -> bool:
        return (
            s.cols & v.smask == v.smask
            and g.shared & v.gmask == v.gmask
            and not (s.acked | s.leased) & v.bit
            and not g.doomed
        )

    def sync(self, s: Sample, g: Group, views: Iterable[View]) -> None:
        """Re-evaluate sample ``s`` (of group ``g``) in ``views``."""
        for v in views:
            index = s.index
            if self.is_candidate(s, g, v):
                if index not in v.ready:
                    v.ready.add(index)
                    v.cand[g.gid] = v.cand.get(g.gid, 0) + 1
            elif index in v.ready:
                v.ready.discard(index)
                self.uncand(v, g.gid)
            self.refresh(v, g)

    def unview(self, s: Sample, g: Group, views: Iterable[View]) -> None:
        """Remove sample ``s`` from ``views`` (it was leased, dropped or doomed)."""
        for v in views:
            if s.index in v.ready:
                v.ready.discard(s.index)
                self.uncand(v, g.gid)
                self.refresh(v, g)

    @staticmethod
    def uncand(v: View, gid: int) -> None:
        left = v.cand[gid] - 1
        if left:
            v.cand[gid] = left
        else:
            del v.cand[gid]

    def refresh(self, v: View, g: Group) -> None:
        """Re-evaluate whether group ``g`` is eligible for whole-group claims in view ``v``."""
        cand = v.cand.get(g.gid, 0)
        eligible = cand > 0 and g.pending == 0 and not g.doomed and cand == g.unconsumed[v.ci]
        old = v.amount.get(g.gid)
        if eligible:
            if old is None:
                v.groups.add(g.gid)
                old = 0
            v.amount[g.gid] = cand
            v.total += cand - old
        elif old is not None:
            del v.amount[g.gid]
            v.total -= old
            v.groups.discard(g.gid)

    def refresh_all(self, g: Group, views: Iterable[View] | None = None) -> None:
        for v in self.views.values() if views is None else views:
            self.refresh(v, g)

    def resync_group(self, g: Group) -> None:
        """Re-evaluate every member of ``g`` in every view (a group-level change)."""
        views = list(self.views.values())
        for index in g.members:
            self.sync(self.samples[index], g, views)
        self.refresh_all(g, views)

    # -- structure -----------------------------------------------------------------------------

    def new_group(self, unit: str, size: int) -> Group:
        g = Group(self.next_gid, unit, size, len(self.spec.consumers))
        self.next_gid += 1
        self.groups[g.gid] = g
        self.reserved += size
        self.load[unit] += size
        return g

    def new_sample(self, g: Group, version: int, length: int) -> Sample:
        s = Sample(self.next_index, version, g.gid, g.unit, length)
        self.next_index += 1
        self.samples[s.index] = s
        g.members.append(s.index)
        g.allocated += 1
        self.reserved -= 1  # the reserved slot becomes a live sample: load unchanged
        for ci in range(len(g.unconsumed)):
            g.unconsumed[ci] += 1
        self.allocated_total += 1
        return s

    def drop_sample(self, s: Sample, g: Group, fx: Effects | None) -> None:
        """Remove a live sample from everything; ``fx`` gets its data to delete (if given)."""
        self.unview(s, g, self.views.values())
        g.members.remove(s.index)
        for ci in range(len(g.unconsumed)):
            bit = 1 << ci
            if s.acked & bit:
                self.consumed_count[ci] -= 1
            else:
                g.unconsumed[ci] -= 1
            if s.leased & bit:
                self.leased_count[ci] -= 1
                g.held -= 1
        if s.cols:
            self.written -= 1
        self.live_bytes -= s.nbytes
        self.load[s.unit] -= 1
        del self.samples[s.index]
        if fx is not None:
            fx.free_sample(s.unit, self.name, s.index, s.nbytes)
        self.refresh_all(g)

    def drop_group(self, g: Group, fx: Effects | None) -> None:
        """Remove a group with no live members (its pending slots and shared blobs go too)."""
        assert not g.members, g.members
        for v in self.views.values():
            v.cand.pop(g.gid, None)
            old = v.amount.pop(g.gid, None)
            if old is not None:
                v.total -= old
                v.groups.discard(g.gid)
        self.reserved -= g.pending
        self.load[g.unit] -= g.pending
        self.shared_total -= g.nbytes
        del self.groups[g.gid]
        if fx is not None:
            fx.free_group(g.unit, self.name, g.gid, g.nbytes)

    def settle(self, g: Group, fx: Effects) -> None:
        """After ``g`` lost a member or a lease: evict it if stale and unheld, free it if done."""
        if g.gid not in self.groups:
            return
        if g.doomed and not self.is_stale(g):
            # Its stale members were freed or discarded: the rest is fresh, back in the pool.
            g.doomed = False
            self.resync_group(g)
        if g.doomed and g.held == 0:
            self.evict(g, fx)
        elif not g.members and g.pending == 0:
            self.drop_group(g, fx)

    def evict(self, g: Group, fx: Effects) -> None:
        indexes = list(g.members)
        nbytes = g.nbytes
        for index in indexes:
            s = self.samples[index]
            nbytes += s.nbytes
            self.drop_sample(s, g, fx)
        self.drop_group(g, fx)
        self.evicted_total += len(indexes)
        self.evicted_groups += 1
        fx.evicted(self.name, g.gid, indexes, nbytes)

    def doom(self, g: Group) -> None:
        g.doomed = True
        views = list(self.views.values())
        for index in g.members:
            self.unview(self.samples[index], g, views)
        self.refresh_all(g, views)

    def is_stale(self, g: Group) -> bool:
        threshold = self.threshold
        return any(self.samples[i].version < threshold for i in g.members)
