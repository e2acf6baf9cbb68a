"""Per-holder statistics of the controller state (internal): who holds what, for a diagnosis.

One entry per (holder, topic, consumer) with something outstanding: leases, samples allocated
and not committed, groups opened and not complete, and (given by the controller, which keeps
them) claims and puts waiting. O(leases + writes in progress + groups): built on demand, for
``statistics()``, never on a hot path.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs
import numpy as np

from .._stats import GROUP_IDS, HolderStatistics
from ._leases import LeaseTable
from ._topic import Topic
from ._writes import Writes, _uncommitted

Key = tuple[str, str, str]  # holder, topic, consumer ("" for writes)


@attrs.define
class _Counts:
    leases: int = 0
    leased: int = 0
    claims: int = 0
    claimed: int = 0
    uncommitted: int = 0
    open_groups: int = 0
    group_ids: list[int] = attrs.Factory(list)
    puts: int = 0

    def name(self, gids: Iterable[int]) -> None:
        for gid in gids:
            if len(self.group_ids) >= GROUP_IDS:
                return
            if gid >= 0 and gid not in self.group_ids:
                self.group_ids.append(gid)


def holder_statistics(
    topics: dict[str, Topic],
    leases: LeaseTable,
    writes: Writes,
    claims: Iterable[tuple[str, str, str, int]] = (),
    puts: Iterable[tuple[str | None, str]] = (),
) -> tuple[HolderStatistics, ...]:
    """Every holder's outstanding items. ``claims``: ``(holder, topic, consumer, count)`` of
    the claims waiting; ``puts``: ``(holder, topic)`` of the puts waiting."""
    out: dict[Key, _Counts] = {}

    def at(key: Key) -> _Counts:
        return out.setdefault(key, _Counts())

    for rec in leases._leases.values():  # (the state's own tables: one package)
        lease = rec.lease
        for holder in sorted(rec.holders):
            c = at((holder, lease.topic, lease.consumer))
            c.leases += 1
            c.leased += len(lease.indexes)
    for table in (writes._pending, writes._held):
        for topic, pending in table.items():
            t = topics[topic]
            for w in pending.values():
                if w.holder is None:
                    continue
                rows = _uncommitted(t, w)
                if rows.size:
                    c = at((w.holder, topic, ""))
                    c.uncommitted += int(rows.size)
                    c.name(int(g) for g in t.s.gid[rows].tolist())
    owners = {i: name for name, i in writes._holders.items()}
    for t in topics.values():
        g = t.g
        n = g.n
        open_ = np.flatnonzero(g.live[:n] & (g.committed[:n] < g.size[:n]) & (g.owner[:n] >= 0))
        for slot in open_.tolist():
            owner = owners.get(int(g.owner[slot]))
            if owner is not None:
                c = at((owner, t.name, ""))
                c.open_groups += 1
                c.name([int(g.ids[slot])])
    for holder, topic, consumer, count in claims:
        c = at((holder, topic, consumer))
        c.claims += 1
        c.claimed += count
    for put_holder, topic in puts:
        if put_holder is not None:
            at((put_holder, topic, "")).puts += 1
    return tuple(
        HolderStatistics(
            holder,
            topic,
            consumer,
            c.leases,
            c.leased,
            c.claims,
            c.claimed,
            c.uncommitted,
            c.open_groups,
            tuple(sorted(c.group_ids)),
            c.puts,
        )
        for (holder, topic, consumer), c in sorted(out.items())
    )
