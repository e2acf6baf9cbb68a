"""One topic's tables and the lookups on them (internal), the base of :class:`Topic`.

Samples and groups are rows of two :class:`Table`\\ s (one numpy array per field), so a put, a
claim or an ack of n samples is a handful of array operations, not n Python steps. Per-sample
fields: version, group, unit, length, present columns (a bit mask), consumers that acked and
that lease it (bit masks), bytes per column, committed. Per-group fields: unit, size, members
allocated and committed, shared columns present, live members, live members each consumer has
not acked, (member, consumer) pairs under lease, pending-eviction flag, first and last member.

Capacity is counted in *occupied* slots: live samples plus reserved (not yet allocated) slots of
open groups, so a streaming group can always complete once opened.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from .._errors import SchemaError, UnknownColumn, UnknownConsumer, UnknownGroup
from .._spec import TopicSpec
from ._table import Bools, Ints, Table

_MAX_BITS = 63  # masks are int64
NO_MEMBER = int(np.iinfo(np.int64).max)  # ``first`` of a group with no member yet


def _bits(kind: str, topic: str, names: Iterable[str]) -> dict[str, int]:
    table = {name: 1 << k for k, name in enumerate(names)}
    if len(table) > _MAX_BITS:
        raise SchemaError(f"topic {topic!r}: at most {_MAX_BITS} {kind}, got {len(table)}")
    return table


class TopicTables:
    """A topic's tables, counters and lookups; :class:`Topic` adds the mutations."""

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

    # -- compaction ------------------------------------------------------------------------------

    def tidy(self) -> None:
        """Compact the tables once dead rows dominate (call between operations only)."""
        self.s.maybe_compact()
        self.g.maybe_compact()

    def _groups_compacted(self, keep: Bools) -> None:
        s, g = self.s, self.g
        if g.n:
            s.gs[: s.n] = np.minimum(np.searchsorted(g.ids[: g.n], s.gid[: s.n]), g.n - 1)
