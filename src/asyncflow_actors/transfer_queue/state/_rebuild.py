"""Export a controller state as inventory records, and rebuild a state from them (internal).

The public entry points are ``ControllerState.export_inventory`` and
``ControllerState.from_inventory``; see :mod:`._inventory` for what the records hold and what
the wrapper must forward to the storage units to keep them accurate. These functions work on
the state's parts, given explicitly (:class:`Parts`), so this module never needs the state's
class: the state calls it, never the other way round.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import attrs
import numpy as np

from .._errors import InventoryError, TransferQueueError
from .._results import Loss, LostSamples, Update
from ._check import finite_time
from ._effects import Effects
from ._inventory import GroupRecord, Inventory, SampleRecord, TopicRecord
from ._leases import LeaseTable
from ._table import Ints
from ._topic import Topic
from ._writes import Writes


def _present(names: dict[str, int], mask: int, sizes: list[int]) -> dict[str, int]:
    return {c: sizes[k] for k, c in enumerate(names) if mask >> k & 1}


@attrs.frozen
class Parts:
    """The parts of a controller state these functions read and change (shared, not copied)."""

    topics: Mapping[str, Topic]
    units: Sequence[str]
    unit_ix: Mapping[str, int]
    load: Ints  # occupied slots per unit, all topics
    writes: Writes
    lease_table: LeaseTable


def export_inventory(state: Parts, unit: str | None) -> Inventory:
    """The records of every live sample and group (on ``unit`` only, if given)."""
    topics: list[TopicRecord] = []
    groups: list[GroupRecord] = []
    samples: list[SampleRecord] = []
    for t in state.topics.values():
        topics.append(TopicRecord(t.name, t.latest, t.next_index, t.next_gid))
        consumers = t.spec.consumers
        s, g = t.s, t.g
        gm = g.live[: g.n].copy()
        sm = s.live[: s.n].copy()
        if unit is not None:
            u = state.unit_ix[unit]
            gm &= g.unit[: g.n] == u
            sm &= s.unit[: s.n] == u
        for x in np.flatnonzero(gm).tolist():
            groups.append(
                GroupRecord(
                    t.name,
                    int(g.ids[x]),
                    state.units[int(g.unit[x])],
                    int(g.size[x]),
                    int(g.alloc[x]),
                    _present(t.shared_ix, int(g.shared[x]), g.sbytes[x].tolist()),
                    bool(g.explicit[x]),
                )
            )
        for x in np.flatnonzero(sm).tolist():
            acked = int(s.acked[x])
            samples.append(
                SampleRecord(
                    topic=t.name,
                    index=int(s.ids[x]),
                    version=int(s.version[x]),
                    group_id=int(s.gid[x]),
                    unit=state.units[int(s.unit[x])],
                    length=int(s.length[x]),
                    columns=_present(t.col_ix, int(s.cols[x]), s.cbytes[x].tolist()),
                    acked=frozenset(c for i, c in enumerate(consumers) if acked >> i & 1),
                    committed=bool(s.committed[x]),
                )
            )
    return Inventory(topics=tuple(topics), groups=tuple(groups), samples=tuple(samples))


def _bad(message: str) -> InventoryError:
    return InventoryError(f"inventory: {message}")


def rebuild(state: Parts, inventory: Inventory, *, now: float | None = None) -> Update:
    """Fill a new, empty state's parts so that it is equivalent to the one that wrote
    ``inventory``, with every lease returned.

    Returns what rebuilding did: samples every consumer had acked are freed, groups with nothing
    left are freed, and groups that are stale at the recorded latest version are evicted (no
    lease holds them any more). With ``now``, uncommitted samples and open groups' unfilled
    slots expire ``write_ttl`` from ``now`` (their writers may have died while the controller
    was down).
    """
    fx = Effects()

    def topic_of(name: str) -> Topic:
        t = state.topics.get(name)
        if t is None:
            raise _bad(f"record for unknown topic {name!r} (declared: {sorted(state.topics)})")
        return t

    for trec in inventory.topics:
        t = topic_of(trec.topic)
        for field in ("latest_version", "next_index", "next_group_id"):
            value = getattr(trec, field)
            if not isinstance(value, int) or value < 0:
                raise _bad(f"topic {trec.topic!r} {field} must be an int >= 0, got {value!r}")
        t.latest = max(t.latest, trec.latest_version)
        t.next_index = max(t.next_index, trec.next_index)
        t.next_gid = max(t.next_gid, trec.next_group_id)
    seen: set[tuple[str, int]] = set()
    for grec in sorted(inventory.groups, key=lambda r: (r.topic, r.group_id)):
        _add_group(state, topic_of(grec.topic), grec, seen, now)
    seen.clear()
    for srec in sorted(inventory.samples, key=lambda r: (r.topic, r.index)):
        _add_sample(state, topic_of(srec.topic), srec, seen)
        if not srec.committed:  # it expires ``write_ttl`` from ``now``
            ttl = state.topics[srec.topic].spec.write_ttl
            deadline = math.inf if now is None or ttl is None else finite_time(now) + ttl
            state.writes.rebuilt(srec.topic, srec.index, deadline)
    for t in state.topics.values():
        g, s = t.g, t.s
        over = np.flatnonzero(g.nmem[: g.n] > g.alloc[: g.n])
        if over.size:
            x = int(over[0])
            raise _bad(
                f"group {int(g.ids[x])} of topic {t.name!r} has {int(g.nmem[x])} live members "
                f"but records only {int(g.alloc[x])} allocated"
            )
        done = np.flatnonzero(s.live[: s.n] & (s.acked[: s.n] == t.full))
        t.freed_total += len(done)
        t.drop_samples(done, fx, consumed=True)
        t.settle(np.flatnonzero(g.live[: g.n]), fx)
        t.apply_window(fx)
        t.tidy()
    return fx.update()


def _add_group(
    state: Parts,
    t: Topic,
    rec: GroupRecord,
    seen: set[tuple[str, int]],
    now: float | None,
) -> None:
    where = f"group {rec.group_id!r} of topic {t.name!r}"
    if not isinstance(rec.group_id, int) or rec.group_id < 0:
        raise _bad(f"{where}: group id must be an int >= 0")
    if (t.name, rec.group_id) in seen:
        raise _bad(f"{where} is recorded twice")
    seen.add((t.name, rec.group_id))
    u = state.unit_ix.get(rec.unit)
    if u is None:
        raise _bad(f"{where} is on unknown unit {rec.unit!r} (units: {list(state.units)})")
    if not (isinstance(rec.size, int) and isinstance(rec.allocated, int)):
        raise _bad(f"{where}: size and allocated must be ints")
    if not 0 <= rec.allocated <= rec.size:
        raise _bad(f"{where}: expected 0 <= allocated ({rec.allocated}) <= size ({rec.size})")
    try:
        per_sample, mask = t.masks(rec.shared)
    except TransferQueueError as exc:
        raise _bad(f"{where}: {exc}") from None
    if per_sample:
        raise _bad(f"{where}: shared columns {sorted(rec.shared)} include per-sample columns")
    ttl = t.spec.write_ttl
    pending = rec.size > rec.allocated
    deadline = now + ttl if now is not None and ttl is not None and pending else math.inf
    t.next_gid, gid = rec.group_id, t.next_gid  # new_groups numbers from next_gid
    rows = t.new_groups(np.array([u], np.int64), rec.size, explicit=rec.explicit, deadline=deadline)
    t.next_gid = max(gid, rec.group_id + 1)
    g = t.g
    g.alloc[rows] = rec.allocated
    g.committed[rows] = rec.allocated
    g.shared[rows] = mask
    for col, nbytes in rec.shared.items():
        g.sbytes[rows, t.shared_ix[col]] = nbytes
    g.nbytes[rows] = sum(rec.shared.values())
    t.reserved -= rec.allocated  # only the unfilled slots stay reserved
    state.load[u] -= rec.allocated
    t.shared_total += sum(rec.shared.values())
    state.writes.group_deadline(t.name, rec.group_id, deadline)


def _add_sample(state: Parts, t: Topic, rec: SampleRecord, seen: set[tuple[str, int]]) -> None:
    where = f"sample {rec.index!r} of topic {t.name!r}"
    if not isinstance(rec.index, int) or rec.index < 0:
        raise _bad(f"{where}: index must be an int >= 0")
    if (t.name, rec.index) in seen:
        raise _bad(f"{where} is recorded twice")
    seen.add((t.name, rec.index))
    gslot = t.g.slot_of(rec.group_id) if isinstance(rec.group_id, int) else -1
    if gslot < 0:
        raise _bad(f"{where} belongs to group {rec.group_id!r}, which has no record")
    unit = state.units[int(t.g.unit[gslot])]
    if rec.unit != unit:
        raise _bad(f"{where} is on unit {rec.unit!r} but its group is on {unit!r}")
    if not isinstance(rec.version, int) or rec.version < 0:
        raise _bad(f"{where}: version must be an int >= 0, got {rec.version!r}")
    if not isinstance(rec.length, int) or rec.length < 0:
        raise _bad(f"{where}: length must be an int >= 0, got {rec.length!r}")
    try:
        mask, shared = t.masks(rec.columns)
        acked = 0
        for name in rec.acked:
            acked |= 1 << t.consumer(name)
    except TransferQueueError as exc:
        raise _bad(f"{where}: {exc}") from None
    if shared:
        raise _bad(f"{where}: columns {sorted(rec.columns)} include group-shared columns")
    # new_samples numbers from next_index and takes a reserved slot: put both back after
    next_index, t.next_index = t.next_index, rec.index
    t.reserved += 1
    g = t.g
    alloc, committed = int(g.alloc[gslot]), int(g.committed[gslot])
    rows = t.new_samples(np.array([gslot], np.int64), rec.version, np.array([rec.length]))
    g.alloc[gslot], g.committed[gslot] = alloc, committed - (not rec.committed)
    t.next_index = max(next_index, rec.index + 1)
    s = t.s
    s.cols[rows] = mask
    for col, nbytes in rec.columns.items():
        s.cbytes[rows, t.col_ix[col]] = nbytes
    nbytes = sum(rec.columns.values())
    s.nbytes[rows] = nbytes
    s.acked[rows] = acked
    s.committed[rows] = rec.committed
    consumers = len(t.spec.consumers)
    for ci in range(consumers):
        if acked >> ci & 1:
            t.consumed_count[ci] += 1
            g.unacked[gslot, ci] -= 1
    t.written += bool(mask)
    t.live_bytes += nbytes
    state.load[int(g.unit[gslot])] += 1


def storage_lost(state: Parts, unit: str, u: int) -> Loss:
    """``ControllerState.storage_lost`` on unit number ``u`` (see there)."""
    lost: list[LostSamples] = []
    leases: list[int] = []
    for t in state.topics.values():
        s, g = t.s, t.g
        gslots = np.flatnonzero(g.live[: g.n] & (g.unit[: g.n] == u))
        if not gslots.size:
            continue
        rows = np.flatnonzero(s.live[: s.n] & (s.unit[: s.n] == u))
        indexes = s.ids[rows].copy()
        committed = s.committed[rows]
        reported = g.explicit[gslots].copy()  # explicit groups, and those with committed data
        reported[np.searchsorted(gslots, s.gs[rows][committed])] = True
        gids = tuple(g.ids[gslots][reported].tolist())
        t.drop_samples(rows, None)
        t.drop_groups(gslots, None)
        t.lost_total += int(committed.sum())
        t.discarded_total += int((~committed).sum())
        t.lost_groups += len(gids)
        t.changes += 1
        if gids:
            kept = tuple(indexes[committed].tolist())
            lost.append(LostSamples(topic=t.name, indexes=kept, group_ids=gids))
        leases.extend(state.lease_table.touching(t.name, indexes))
        t.tidy()
    assert state.load[u] == 0, state.load[u]
    return Loss(unit=unit, lost=tuple(lost), leases=tuple(leases))


def group_records(
    units: Sequence[str], t: Topic, group_ids: Iterable[int]
) -> tuple[GroupRecord, ...]:
    """``ControllerState.group_records`` (see there)."""
    g = t.g
    slots, ok = g.find(np.unique(np.fromiter(group_ids, np.int64)))
    slots = slots[ok]
    slots = slots[g.explicit[slots]]
    return tuple(
        GroupRecord(
            t.name,
            int(g.ids[x]),
            units[int(g.unit[x])],
            int(g.size[x]),
            int(g.committed[x]),
            _present(t.shared_ix, int(g.shared[x]), g.sbytes[x].tolist()),
        )
        for x in slots.tolist()
    )
