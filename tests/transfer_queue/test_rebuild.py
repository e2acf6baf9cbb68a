"""Controller restart: export the units' inventories, rebuild, get the same answers."""

from __future__ import annotations

import pytest

from asyncflow_actors.transfer_queue import (
    FIFO,
    WHOLE_GROUPS,
    ControllerState,
    GroupRecord,
    Inventory,
    InventoryError,
    SampleRecord,
    UnknownLease,
)

from .kit import ALL, RESP, T, make, put, put_group, topic

COLUMN_SETS = (RESP, ALL, frozenset({"resp", "lp"}))


def answers(state: ControllerState) -> dict[str, object]:
    ts = state.statistics().topics[0]
    return {
        "ready": {
            (c, cols, s): state.ready_count(T, c, cols, sampler=s)
            for c in ("fwd", "train")
            for cols in COLUMN_SETS
            for s in (FIFO, WHOLE_GROUPS)
        },
        "inventory": state.export_inventory(),
        "counts": (ts.live, ts.written, ts.occupied, ts.groups, ts.complete_groups),
        "bytes": (ts.live_bytes, ts.shared_bytes, ts.dedup_bytes_saved),
        "consumed": tuple(c.consumed for c in ts.consumers),
        "window": (ts.latest_version, ts.oldest_fresh_version),
        "units": dict(state.statistics().units),
        "free": state.free_slots(T),
    }


def rebuilt(state: ControllerState, epoch: int = 1) -> ControllerState:
    inventory = Inventory.merge(state.export_inventory(u) for u in state.units)
    new, upd = ControllerState.from_inventory([state.spec(T)], state.units, inventory, epoch=epoch)
    assert upd.releases == () and upd.evictions == ()
    return new


def scenario() -> ControllerState:
    state = make(staleness=1, capacity=64)
    state.set_latest_version(T, 2)
    put_group(state, 3, version=1)
    put_group(state, 2, version=2, columns=frozenset({"resp", "prompt"}))
    put(state, 3, version=2)
    slot = state.open_group(T, 4)  # streaming: 1 of 4 members so far
    a = state.allocate(T, 1, 2, group=slot.group_id, lengths=[17])
    state.commit_write(T, a.indexes, {"resp": 3})
    lease = state.claim(T, "fwd", RESP, 4, holder="h", now=0)
    assert lease is not None
    state.ack(lease.id)
    return state


def test_rebuild_gives_the_same_answers() -> None:
    state = scenario()
    new = rebuilt(state)
    assert answers(new) == answers(state)
    # And it keeps working the same way: the same next claim, the same next indexes.
    assert new.allocate(T, 1, 2).indexes == state.allocate(T, 1, 2).indexes
    assert new.open_group(T, 1).group_id == state.open_group(T, 1).group_id
    l1 = state.claim(T, "train", ALL, 3, holder="h", now=0, sampler=WHOLE_GROUPS)
    l2 = new.claim(T, "train", ALL, 3, holder="h", now=0, sampler=WHOLE_GROUPS)
    assert l1 is not None and l2 is not None and l1.indexes == l2.indexes


def test_outstanding_leases_are_returned_by_a_rebuild() -> None:
    state = scenario()
    lease = state.claim(T, "train", RESP, 2, holder="h", now=0)
    assert lease is not None
    new = rebuilt(state, epoch=1)
    state.nack(lease.id)
    assert answers(new) == answers(state)
    with pytest.raises(UnknownLease):
        new.ack(lease.id)  # issued by the previous incarnation
    fresh = new.claim(T, "train", RESP, 1, holder="h", now=0)
    assert fresh is not None and fresh.id != lease.id


def test_rebuild_evicts_groups_a_lost_lease_kept_alive() -> None:
    state = make(staleness=0)
    gid, idx = put_group(state, 2)
    lease = state.claim(T, "fwd", ALL, 2, holder="h", now=0)
    assert lease is not None
    state.set_latest_version(T, 1)  # stale, but held: pending eviction
    inventory = state.export_inventory()
    new, upd = ControllerState.from_inventory([topic(staleness=0)], state.units, inventory, epoch=1)
    (ev,) = upd.evictions
    assert ev.group_ids == (gid,) and ev.indexes == idx
    assert new.statistics().topics[0].live == 0


def test_rebuild_frees_what_every_consumer_had_acked() -> None:
    state = make()
    put(state, 1)
    inv = state.export_inventory()
    (rec,) = inv.samples
    done = SampleRecord(
        topic=T,
        index=rec.index,
        version=rec.version,
        group_id=rec.group_id,
        unit=rec.unit,
        length=rec.length,
        columns=rec.columns,
        acked={"fwd", "train"},
    )
    _, upd = ControllerState.from_inventory(
        [topic()], state.units, Inventory(inv.topics, inv.groups, (done,)), epoch=1
    )
    assert upd.freed_indexes == (rec.index,) and upd.releases[0].group_ids == (rec.group_id,)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ("duplicate", "sample 0 of topic 'rollout' is recorded twice"),
        ("orphan", "belongs to group 7, which has no record"),
        ("unit", "unknown unit 'u9'"),
        ("column", "no column 'nope'"),
        ("consumer", "no consumer 'ghost'"),
        ("topic", "unknown topic 'other'"),
        ("allocated", r"expected 0 <= allocated \(3\) <= size \(1\)"),
    ],
)
def test_inconsistent_inventories_are_rejected(edit: str, message: str) -> None:
    state = make()
    put(state, 1)
    inv = state.export_inventory()
    (s,) = inv.samples
    (g,) = inv.groups
    samples, groups = [s], [g]
    fields = {
        "topic": s.topic,
        "index": s.index,
        "version": s.version,
        "group_id": s.group_id,
        "unit": s.unit,
        "length": s.length,
        "columns": s.columns,
        "acked": s.acked,
    }
    if edit == "duplicate":
        samples.append(s)
    elif edit == "orphan":
        samples = [SampleRecord(**{**fields, "group_id": 7})]  # type: ignore[arg-type]
    elif edit == "unit":
        groups = [GroupRecord(T, g.group_id, "u9", g.size, g.allocated, g.shared)]
    elif edit == "column":
        samples = [SampleRecord(**{**fields, "columns": {"nope": 1}})]  # type: ignore[arg-type]
    elif edit == "consumer":
        samples = [SampleRecord(**{**fields, "acked": {"ghost"}})]  # type: ignore[arg-type]
    elif edit == "topic":
        samples = [SampleRecord(**{**fields, "topic": "other"})]  # type: ignore[arg-type]
    elif edit == "allocated":
        groups = [GroupRecord(T, g.group_id, g.unit, 1, 3, g.shared)]
    with pytest.raises(InventoryError, match=message):
        ControllerState.from_inventory(
            [topic()], state.units, Inventory(inv.topics, tuple(groups), tuple(samples)), epoch=1
        )


def test_index_watermarks_survive_a_rebuild_of_an_empty_state() -> None:
    state = make(consumers=("train",))
    put(state, 3)
    lease = state.claim(T, "train", RESP, 3, holder="h", now=0)
    assert lease is not None
    state.ack(lease.id)  # everything freed: no sample record is left
    new = rebuilt(state)
    assert new.allocate(T, 1, 0).indexes == (3,)  # never reuses 0..2
