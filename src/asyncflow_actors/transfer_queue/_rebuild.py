"""Export a controller state as inventory records, and rebuild a state from them (internal).

The public entry points are ``ControllerState.export_inventory`` and
``ControllerState.from_inventory``; see :mod:`._inventory` for what the records hold and what
the wrapper must forward to the storage units to keep them accurate.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ._errors import InventoryError, TransferQueueError
from ._inventory import GroupRecord, Inventory, SampleRecord, TopicRecord
from ._results import Update
from ._spec import TopicSpec
from ._topic import Effects, Group, Sample, Topic

if TYPE_CHECKING:
    from ._state import ControllerState


def export_inventory(state: ControllerState, unit: str | None) -> Inventory:
    """The records of every live sample and group (on ``unit`` only, if given)."""
    topics: list[TopicRecord] = []
    groups: list[GroupRecord] = []
    samples: list[SampleRecord] = []
    for t in state._topics.values():
        topics.append(TopicRecord(t.name, t.latest, t.next_index, t.next_gid))
        consumers = t.spec.consumers
        for g in t.groups.values():
            if unit is not None and g.unit != unit:
                continue
            groups.append(GroupRecord(t.name, g.gid, g.unit, g.size, g.allocated, g.shared_bytes))
            for index in g.members:
                s = t.samples[index]
                acked = frozenset(c for i, c in enumerate(consumers) if s.acked >> i & 1)
                samples.append(
                    SampleRecord(
                        topic=t.name,
                        index=s.index,
                        version=s.version,
                        group_id=s.gid,
                        unit=s.unit,
                        length=s.length,
                        columns=s.col_bytes,
                        acked=acked,
                    )
                )
    return Inventory(topics=tuple(topics), groups=tuple(groups), samples=tuple(samples))


def _bad(message: str) -> InventoryError:
    return InventoryError(f"inventory: {message}")


def rebuild(
    specs: Iterable[TopicSpec], units: Iterable[str], inventory: Inventory, *, epoch: int
) -> tuple[ControllerState, Update]:
    """A state equivalent to the one that wrote ``inventory``, with every lease returned.

    Returns the state and what rebuilding did: samples every consumer had acked are freed, groups
    with nothing left are freed, and groups that are stale at the recorded latest version are
    evicted (no lease holds them any more).
    """
    from ._state import ControllerState

    state = ControllerState(specs, units, epoch=epoch)
    fx = Effects()

    def topic_of(name: str) -> Topic:
        t = state._topics.get(name)
        if t is None:
            raise _bad(f"record for unknown topic {name!r} (declared: {sorted(state._topics)})")
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
    for grec in sorted(inventory.groups, key=lambda r: (r.topic, r.group_id)):
        t = topic_of(grec.topic)
        _add_group(state, t, grec)
    for srec in sorted(inventory.samples, key=lambda r: (r.topic, r.index)):
        t = topic_of(srec.topic)
        _add_sample(state, t, srec)
    for t in state._topics.values():
        for g in t.groups.values():
            if len(g.members) > g.allocated:
                raise _bad(
                    f"group {g.gid} of topic {t.name!r} has {len(g.members)} live members but "
                    f"records only {g.allocated} allocated"
                )
        for s in [s for s in t.samples.values() if s.acked == t.full]:
            t.freed_total += 1
            t.drop_sample(s, t.groups[s.gid], fx)
        for g in list(t.groups.values()):
            t.settle(g, fx)
        state._apply_window(t, fx)
    return state, fx.update()


def _add_group(state: ControllerState, t: Topic, rec: GroupRecord) -> None:
    where = f"group {rec.group_id!r} of topic {t.name!r}"
    if not isinstance(rec.group_id, int) or rec.group_id < 0:
        raise _bad(f"{where}: group id must be an int >= 0")
    if rec.group_id in t.groups:
        raise _bad(f"{where} is recorded twice")
    if rec.unit not in state._load:
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
    g = Group(rec.group_id, rec.unit, rec.size, len(t.spec.consumers))
    g.allocated = rec.allocated
    g.shared = mask
    g.shared_bytes = dict(rec.shared)
    g.nbytes = sum(rec.shared.values())
    t.groups[g.gid] = g
    t.next_gid = max(t.next_gid, g.gid + 1)
    t.reserved += g.pending
    state._load[g.unit] += g.pending
    t.shared_total += g.nbytes


def _add_sample(state: ControllerState, t: Topic, rec: SampleRecord) -> None:
    where = f"sample {rec.index!r} of topic {t.name!r}"
    if not isinstance(rec.index, int) or rec.index < 0:
        raise _bad(f"{where}: index must be an int >= 0")
    if rec.index in t.samples:
        raise _bad(f"{where} is recorded twice")
    g = t.groups.get(rec.group_id)
    if g is None:
        raise _bad(f"{where} belongs to group {rec.group_id!r}, which has no record")
    if rec.unit != g.unit:
        raise _bad(f"{where} is on unit {rec.unit!r} but its group is on {g.unit!r}")
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
    s = Sample(rec.index, rec.version, g.gid, g.unit, rec.length)
    s.cols = mask
    s.col_bytes = dict(rec.columns)
    s.nbytes = sum(rec.columns.values())
    s.acked = acked
    t.samples[s.index] = s
    t.next_index = max(t.next_index, s.index + 1)
    g.members.append(s.index)
    for ci in range(len(t.spec.consumers)):
        if acked >> ci & 1:
            t.consumed_count[ci] += 1
        else:
            g.unconsumed[ci] += 1
    t.written += bool(mask)
    t.live_bytes += s.nbytes
    t.allocated_total += 1
    state._load[g.unit] += 1
    heapq.heappush(t.vheap, (s.version, g.gid))
