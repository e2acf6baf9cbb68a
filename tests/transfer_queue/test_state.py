"""ControllerState: allocation, placement, capacity, writes, claims, versions (hand-checked)."""

from __future__ import annotations

import pytest

from asyncflow_actors.transfer_queue import (
    CapacityError,
    ControllerState,
    GroupError,
    InvalidArgument,
    SchemaError,
    StaleVersionError,
    UnknownColumn,
    UnknownConsumer,
    UnknownGroup,
    UnknownSample,
    UnknownTopic,
    UnknownUnit,
)

from .kit import ALL, RESP, T, make, put, put_group, topic


def test_small_batches_go_to_one_unit_large_ones_split_in_runs() -> None:
    state = ControllerState([topic()], ("u0", "u1", "u2"), min_block=4)
    small = state.allocate(T, 3, 0)
    assert small.units == ("u0",) * 3  # one Store for a small put
    large = state.allocate(T, 9, 0)  # 9 > 2 blocks of 4: all three units, balancing the load
    assert large.units == ("u0",) * 1 + ("u1",) * 4 + ("u2",) * 4
    assert state.statistics().units == {"u0": 4, "u1": 4, "u2": 4}


def test_indexes_are_monotonic_and_placement_least_loaded() -> None:
    state = ControllerState([topic()], ("u0", "u1", "u2"), min_block=1)
    a = state.allocate(T, 4, 0)
    assert a.indexes == (0, 1, 2, 3)
    assert a.units == ("u0", "u0", "u1", "u2")  # balanced, in contiguous runs per unit
    assert len(set(a.group_ids)) == 4  # each ungrouped sample is an implicit group of one
    assert a.placement() == {"u0": (0, 1), "u1": (2,), "u2": (3,)}
    slot = state.open_group(T, 3)
    assert slot.unit in ("u1", "u2")  # the least-loaded units
    b = state.allocate(T, 2, 0, group=slot.group_id)
    assert b.indexes == (4, 5) and set(b.units) == {slot.unit}
    assert b.group_ids == (slot.group_id, slot.group_id)


def test_group_slots_and_errors() -> None:
    state = make()
    slot = state.open_group(T, 2)
    state.allocate(T, 1, 0, group=slot.group_id)
    with pytest.raises(GroupError, match="has 1 free slots, asked for 2"):
        state.allocate(T, 2, 0, group=slot.group_id)
    with pytest.raises(UnknownGroup, match="group 99 of topic 'rollout' was never opened"):
        state.allocate(T, 1, 0, group=99)
    with pytest.raises(GroupError, match="cannot shrink by 2"):
        state.shrink_group(T, slot.group_id, 2)
    state.shrink_group(T, slot.group_id, 1)
    with pytest.raises(GroupError, match="0 free slots"):
        state.allocate(T, 1, 0, group=slot.group_id)


def test_an_empty_group_given_up_is_freed() -> None:
    state = make()
    slot = state.open_group(T, 3)
    state.commit_shared(T, slot.group_id, {"prompt": 500})
    upd = state.shrink_group(T, slot.group_id, 3)
    (rel,) = upd.releases
    assert rel.group_ids == (slot.group_id,) and rel.indexes == () and rel.nbytes == 500
    with pytest.raises(UnknownGroup, match="no longer live"):
        state.allocate(T, 1, 0, group=slot.group_id)
    assert state.statistics().topics[0].occupied == 0


def test_capacity_counts_live_samples_and_reserved_group_slots() -> None:
    state = make(capacity=4)
    assert state.can_allocate(T, 4) and state.free_slots(T) == 4
    with pytest.raises(CapacityError, match="5 slots can never fit in capacity 4"):
        state.can_allocate(T, 5)
    slot = state.open_group(T, 3)  # reserves 3 at once
    assert state.free_slots(T) == 1
    assert not state.can_allocate(T, 2)
    with pytest.raises(CapacityError, match="do not fit now"):
        state.allocate(T, 2, 0)
    with pytest.raises(CapacityError, match="do not fit now"):
        state.open_group(T, 2)
    state.allocate(T, 3, 0, group=slot.group_id)  # members use the reservation
    put(state, 1)
    assert state.free_slots(T) == 0 and not state.can_allocate(T, 1)
    (lease,) = [state.claim(T, c, RESP, 1, holder="h", now=0) for c in ("fwd",)]
    assert lease is not None
    state.ack(lease.id)
    assert state.free_slots(T) == 0  # one consumer acked: not freed yet
    lease = state.claim(T, "train", RESP, 1, holder="h", now=0)
    assert lease is not None and lease.indexes == (3,)
    upd = state.ack(lease.id)
    assert upd.freed_indexes == (3,)
    assert state.can_allocate(T, 1)


def test_unbounded_capacity() -> None:
    state = make()
    assert state.can_allocate(T, 10**9) and state.free_slots(T) is None


def test_commit_write_validates_everything_before_mutating() -> None:
    state = make()
    (i0, i1) = put(state, 2, columns=frozenset())
    before = state.export_inventory()
    with pytest.raises(UnknownColumn, match="no column 'nope'"):
        state.commit_write(T, [i0], {"resp": 1, "nope": 1})
    with pytest.raises(SchemaError, match=r"\['prompt'\] are group-shared; write them with"):
        state.commit_write(T, [i0], {"prompt": 1})
    with pytest.raises(
        UnknownSample, match=r"samples \[7\] of topic 'rollout' are not live"
    ) as err:
        state.commit_write(T, [i0, 7], {"resp": 1})
    assert err.value.indexes == (7,)
    with pytest.raises(InvalidArgument, match="nbytes of 'resp' must be an int >= 0, got -1"):
        state.commit_write(T, [i0, i1], {"resp": [5, -1]})
    with pytest.raises(InvalidArgument, match="has 1 entries, expected 2"):
        state.commit_write(T, [i0, i1], {"resp": [5]})
    for bad in (-1, True):  # one size for every sample: checked as strictly as a list
        with pytest.raises(
            InvalidArgument, match=f"nbytes of 'resp' must be an int >= 0, got {bad}"
        ):
            state.commit_write(T, [i0, i1], {"resp": bad})
    with pytest.raises(InvalidArgument, match="distinct"):
        state.commit_write(T, [i0, i0], {"resp": 1})
    with pytest.raises(InvalidArgument, match="at least one column"):
        state.commit_write(T, [i0], {})
    with pytest.raises(UnknownTopic, match="no topic 'x'"):
        state.commit_write("x", [i0], {"resp": 1})
    assert state.export_inventory() == before


def test_commit_shared_errors_and_rewrites() -> None:
    state = make()
    slot = state.open_group(T, 2)
    with pytest.raises(
        SchemaError, match=r"\['resp'\] are per-sample; write them with commit_write"
    ):
        state.commit_shared(T, slot.group_id, {"resp": 1})
    with pytest.raises(UnknownGroup):
        state.commit_shared(T, 5, {"prompt": 1})
    state.commit_shared(T, slot.group_id, {"prompt": 100})
    state.commit_shared(T, slot.group_id, {"prompt": 80})  # a rewrite replaces the bytes
    assert state.statistics().topics[0].shared_bytes == 80


def test_rewriting_a_column_replaces_its_bytes() -> None:
    state = make()
    (i,) = put(state, 1, columns=frozenset())
    state.commit_write(T, [i], {"resp": 100, "lp": 7})
    state.commit_write(T, [i], {"resp": 40})
    assert state.statistics().topics[0].live_bytes == 47
    (rec,) = state.export_inventory().samples
    assert dict(rec.columns) == {"resp": 40, "lp": 7}


def test_claim_needs_every_asked_column_including_shared_ones() -> None:
    state = make()
    slot = state.open_group(T, 2)
    a = state.allocate(T, 2, 0, group=slot.group_id)
    state.commit_write(T, a.indexes, {"resp": 10})
    assert state.claim(T, "fwd", ALL, 1, holder="h", now=0) is None
    state.commit_write(T, a.indexes, {"lp": 10})
    assert state.ready_count(T, "fwd", ALL) == 0  # the prompt is still missing
    state.commit_shared(T, slot.group_id, {"prompt": 100})
    assert state.ready_count(T, "fwd", ALL) == 2
    lease = state.claim(T, "fwd", ALL, 2, holder="h", now=5.0)
    assert lease is not None
    assert lease.indexes == a.indexes and lease.versions == (0, 0)
    assert lease.placement == {slot.unit: a.indexes}
    assert lease.shared == {slot.unit: (slot.group_id,)}  # the prompt, fetched once
    assert lease.group_ids == (slot.group_id,) * 2 and lease.deadline == 15.0
    assert lease.partitions == (a.indexes,)


def test_fifo_hands_out_oldest_first_and_each_consumer_independently() -> None:
    state = make()
    idx = put(state, 5)
    first = state.claim(T, "fwd", RESP, 2, holder="h", now=0)
    second = state.claim(T, "fwd", RESP, 2, holder="h", now=0)
    other = state.claim(T, "train", RESP, 3, holder="h", now=0)
    assert first is not None and second is not None and other is not None
    assert first.indexes == idx[:2] and second.indexes == idx[2:4]
    assert other.indexes == idx[:3]
    state.nack(first.id)
    again = state.claim(T, "fwd", RESP, 3, holder="h", now=0)
    assert again is not None and again.indexes == (idx[0], idx[1], idx[4])


def test_claim_is_all_or_nothing_with_min_count() -> None:
    state = make()
    put(state, 3)
    changes = state.changes(T)
    assert state.claim(T, "fwd", RESP, 4, holder="h", now=0) is None
    assert state.changes(T) == changes and state.ready_count(T, "fwd", RESP) == 3
    lease = state.claim(T, "fwd", RESP, 4, min_count=2, holder="h", now=0)
    assert lease is not None and len(lease.indexes) == 3
    assert state.changes(T) > changes


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"consumer": "nobody"}, UnknownConsumer, "no consumer 'nobody'"),
        ({"columns": {"x"}}, UnknownColumn, "no column 'x'"),
        ({"columns": set()}, InvalidArgument, "at least one column"),
        ({"columns": "resp"}, InvalidArgument, "got the string 'resp'"),
        ({"count": 0}, InvalidArgument, "count must be an int >= 1, got 0"),
        ({"count": -3}, InvalidArgument, "count must be an int >= 1, got -3"),
        ({"min_count": 5}, InvalidArgument, "min_count must be <= count=2"),
        ({"holder": ""}, InvalidArgument, "holder must be a non-empty string"),
        ({"now": float("nan")}, InvalidArgument, "now must be a finite number"),
        ({"sampler": "fifo"}, InvalidArgument, "sampler must be"),
        ({"share_count": 0}, InvalidArgument, "share_count must be an int >= 1"),
    ],
)
def test_claim_rejects_bad_arguments(
    kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    state = make()
    put(state, 3)
    args: dict[str, object] = {
        "consumer": "fwd",
        "columns": RESP,
        "count": 2,
        "holder": "h",
        "now": 0.0,
    }
    args.update(kwargs)
    before = state.export_inventory()
    with pytest.raises(error, match=message):
        state.claim(T, **args)  # type: ignore[arg-type]
    assert state.export_inventory() == before and state.leases() == ()


def test_negative_and_zero_counts_are_typed_errors() -> None:
    state = make()
    for bad in (0, -1, True, 1.5):
        with pytest.raises(InvalidArgument):
            state.allocate(T, bad, 0)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument):
            state.open_group(T, bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="version must be an int >= 0, got -1"):
        state.allocate(T, 1, -1)
    with pytest.raises(InvalidArgument, match="lengths has 1 entries, expected n=2"):
        state.allocate(T, 2, 0, lengths=[3])
    assert state.statistics().topics[0].allocated_total == 0


def test_staleness_zero_means_exactly_the_latest_version() -> None:
    state = make(staleness=0)
    old = put(state, 2, version=0)
    assert state.is_fresh(T, 0) and not state.is_fresh(T, -1)
    upd = state.set_latest_version(T, 1)
    (ev,) = upd.evictions
    assert set(ev.indexes) == set(old) and ev.reason == "stale"
    assert not state.is_fresh(T, 0) and state.is_fresh(T, 1)
    with pytest.raises(
        StaleVersionError, match=r"version 0 is outside the window \(oldest fresh version 1"
    ):
        state.allocate(T, 1, 0)
    new = put(state, 1, version=1)
    lease = state.claim(T, "fwd", RESP, 1, holder="h", now=0)
    assert lease is not None and lease.indexes == new


def test_staleness_window_of_two_versions() -> None:
    state = make(staleness=2)
    v0 = put(state, 1, version=0)
    v1 = put(state, 1, version=1)
    assert state.set_latest_version(T, 2).evictions == ()
    upd = state.set_latest_version(T, 3)
    assert upd.evictions[0].indexes == v0
    assert state.ready_count(T, "fwd", RESP) == 1
    lease = state.claim(T, "fwd", RESP, 1, holder="h", now=0)
    assert lease is not None and lease.indexes == v1
    stats = state.statistics().topics[0]
    assert stats.latest_version == 3 and stats.oldest_fresh_version == 1


def test_versions_only_move_forward() -> None:
    state = make()
    state.set_latest_version(T, 3)
    assert state.set_latest_version(T, 3).evictions == ()  # same version: a no-op
    with pytest.raises(StaleVersionError, match="got 2, latest is 3"):
        state.set_latest_version(T, 2)
    assert state.latest_version(T) == 3
    put(state, 1, version=7)  # newer than latest is fresh
    assert state.ready_count(T, "fwd", RESP) == 1


def test_constructor_and_topic_errors() -> None:
    with pytest.raises(InvalidArgument, match="unique"):
        ControllerState([topic()], ["u", "u"])
    with pytest.raises(InvalidArgument, match="at least one"):
        ControllerState([topic()], [])
    state = make()
    with pytest.raises(SchemaError, match="already declared"):
        state.add_topic(topic())
    with pytest.raises(UnknownUnit, match="no storage unit 'u9'"):
        state.storage_lost("u9")
    assert state.topics == (T,) and state.units == ("u0", "u1")
    assert state.spec(T) == topic()


def test_whole_groups_and_ungrouped_share_a_topic() -> None:
    state = make()
    gid, members = put_group(state, 2)
    (single,) = put(state, 1, columns=ALL)
    lease = state.claim(T, "train", ALL, 3, holder="h", now=0)
    assert lease is not None and lease.indexes == (*members, single)
    assert set(lease.group_ids) == {gid, state.export_inventory().samples[-1].group_id}


def test_new_groups_fill_the_least_loaded_units_one_sample_at_a_time() -> None:
    import heapq
    import random

    from asyncflow_actors.transfer_queue.state._placement import least_loaded

    def naive(loads: list[int], down: set[int], n: int, min_block: int) -> list[int]:
        up = [r for r in range(len(loads)) if r not in down] or list(range(len(loads)))
        k = max(1, min(len(up), -(-n // min_block)))
        heap = sorted((loads[r], r) for r in up)[:k]
        heapq.heapify(heap)
        picks = []
        for _ in range(n):  # the lowest load takes the next sample (ties: lowest rank)
            load, rank = heapq.heappop(heap)
            picks.append(rank)
            heapq.heappush(heap, (load + 1, rank))
        return sorted(picks)

    rng = random.Random(0)
    for _ in range(2000):
        units = rng.randint(1, 6)
        loads = [rng.randint(0, 10) for _ in range(units)]
        down = {r for r in range(units) if rng.random() < 0.2}
        n, block = rng.randint(1, 40), rng.choice([1, 2, 3, 1024])
        assert least_loaded(loads, down, n, block).tolist() == naive(loads, down, n, block)


@pytest.mark.parametrize("small", [0, 32], ids=["numpy", "lists"])
def test_ascending_and_distinct_agree_with_python_on_both_sides_of_small(
    small: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import random

    import numpy as np

    from asyncflow_actors.transfer_queue.state import _table

    monkeypatch.setattr(_table, "SMALL", small)
    rng = random.Random(7)
    for _ in range(300):
        v = [rng.randint(0, 12) for _ in range(rng.randint(0, 40))]
        if rng.random() < 0.5:
            v = sorted(set(v))
        a = np.array(v, np.int64)
        assert _table.ascending(a) == all(v[k] < v[k + 1] for k in range(len(v) - 1))
        assert _table.distinct(a).tolist() == sorted(set(v))


def test_tables_compact_as_samples_die_and_keep_every_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # hundreds of samples and groups go through while some linger (never ready for "train": no
    # "lp"), so the sample and group tables compact many times around live rows
    from asyncflow_actors.transfer_queue.state import _table

    monkeypatch.setattr(_table, "_COMPACT_AT", 16)
    state = make(consumers=("fwd", "train"))
    lingering = []
    for k in range(400):
        slot = state.open_group(T, 3)
        members = state.allocate(T, 3, 0, group=slot.group_id).indexes
        loose = put(state, 2, columns=ALL)  # two groups of one, consumed at once
        state.commit_shared(T, slot.group_id, {"prompt": 8})
        state.commit_write(T, members, {"resp": 8})
        ready = members if k % 2 else members[:2]  # every other group keeps a member back
        state.commit_write(T, ready, {"lp": 8})
        for consumer, columns in (("fwd", RESP), ("train", ALL)):
            want = members + loose if consumer == "fwd" else ready + loose
            lease = state.claim(T, consumer, columns, 5, holder="h", now=0, min_count=1)
            assert lease is not None and sorted(lease.indexes) == sorted(want)  # only these
            state.ack(lease.id)
        lingering += [] if k % 2 else [members[2]]
    stats = state.statistics().topics[0]
    assert (stats.live, stats.groups, stats.freed_total) == (200, 200, 1800)
    t = state._topics[T]
    assert t.s.n < 2 * 200 + 16 + 5 and t.g.n < 2 * 200 + 16 + 5  # compacted around live rows
    state.commit_write(T, lingering, {"lp": 8})
    assert state.ready_count(T, "train", ALL) == 200
    lease = state.claim(T, "train", ALL, 500, holder="h", now=0, min_count=1)
    assert lease is not None and list(lease.indexes) == lingering  # oldest first
    state.ack(lease.id)
    stats = state.statistics().topics[0]
    assert (stats.live, stats.groups, stats.occupied, stats.live_bytes) == (0, 0, 0, 0)
    assert stats.freed_total == 2000


@pytest.mark.parametrize("ending", ["ack", "nack"])
@pytest.mark.parametrize("compact", [True, False], ids=["compacted", "in-place"])
def test_a_lease_ends_exactly_after_its_rows_moved_or_died(
    monkeypatch: pytest.MonkeyPatch, ending: str, compact: bool
) -> None:
    # a lease keeps its samples' slots to skip the lookup at its end: valid only until the
    # sample table compacts (slots move) and while none of its samples died
    from asyncflow_actors.transfer_queue.state import _table

    monkeypatch.setattr(_table, "_COMPACT_AT", 16 if compact else 1 << 20)
    state = make(consumers=("train",))
    put(state, 40, columns=ALL)  # 40 dead rows ahead of the leased ones once consumed
    held = put(state, 6, columns=ALL)
    drained = state.claim(T, "train", ALL, 40, holder="h", now=0)
    lease = state.claim(T, "train", ALL, 6, holder="h", now=0)
    gone = state.claim(T, "train", ALL, 4, holder="h", now=0)  # none left
    assert drained is not None and lease is not None and gone is None
    assert lease.indexes == held
    t = state._topics[T]
    before = t.s.compactions
    state.ack(drained.id)  # frees the 40: the table compacts, the leased rows move
    assert (t.s.compactions > before, t.s.n) == ((True, 6) if compact else (False, 46))
    state.discard(T, held[:1])  # and one of the lease's samples dies
    if ending == "ack":
        update = state.ack(lease.id)
        assert update.missing == held[:1]
        released = sorted(i for r in update.releases for i in r.indexes)
        assert released == sorted(held[1:]) and state.statistics().topics[0].live == 0
    else:
        update = state.nack(lease.id)
        assert update.missing == held[:1]
        again = state.claim(T, "train", ALL, 10, holder="h", now=0, min_count=1)
        assert again is not None and again.indexes == held[1:]


def test_holders_say_who_holds_and_waits_for_what() -> None:
    """``holders()``: leases per holder and consumer, samples allocated and not committed,
    groups opened and not complete, the claims and puts the controller says are waiting."""
    from asyncflow_actors.transfer_queue import HolderStatistics

    state = make()
    assert state.holders() == ()
    a = state.open_group(T, 2, holder="driver", now=0.0)
    b = state.open_group(T, 2, holder="driver", now=0.0)
    state.allocate(T, 2, 0, group=a.group_id, holder="gen-0", now=0.0)  # never committed
    done = state.allocate(T, 2, 0, group=b.group_id, holder="gen-0", now=0.0)
    state.commit_write(T, done.indexes, {"resp": 10})
    lease = state.claim(T, "fwd", RESP, 2, holder="fwd-0", now=0.0)
    assert lease is not None and lease.indexes == done.indexes
    got = state.holders(claims=[("train-0", T, "train", 4)], puts=[("gen-1", T), (None, T)])
    assert got == (
        HolderStatistics("driver", T, open_groups=1, group_ids=(a.group_id,)),
        HolderStatistics("fwd-0", T, "fwd", leases=1, leased=2),
        HolderStatistics("gen-0", T, uncommitted=2, group_ids=(a.group_id,)),
        HolderStatistics("gen-1", T, puts=1),
        HolderStatistics("train-0", T, "train", claims=1, claimed=4),
    )
