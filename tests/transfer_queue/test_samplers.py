"""Whole-group, length-balanced and rank-shared claims."""

from __future__ import annotations

import pytest

from asyncflow_actors.transfer_queue import (
    FIFO,
    WHOLE_GROUPS,
    Balanced,
    ControllerState,
    InvalidArgument,
    Lease,
    Sampler,
    ShareMismatch,
    UnknownLease,
    Update,
    WholeGroups,
)
from asyncflow_actors.transfer_queue._samplers import partition_lpt

from .kit import ALL, RESP, T, make, put, put_group


def test_whole_groups_waits_for_every_member() -> None:
    state = make()
    slot = state.open_group(T, 3)
    state.commit_shared(T, slot.group_id, {"prompt": 1})
    a = state.allocate(T, 2, 0, group=slot.group_id)
    state.commit_write(T, a.indexes, {"resp": 1, "lp": 1})
    claim = {"holder": "h", "now": 0.0, "sampler": WHOLE_GROUPS, "min_count": 1}
    assert state.claim(T, "train", ALL, 8, **claim) is None  # type: ignore[arg-type]
    b = state.allocate(T, 1, 0, group=slot.group_id)  # the late member arrives...
    assert state.claim(T, "train", ALL, 8, **claim) is None  # type: ignore[arg-type]
    state.commit_write(T, b.indexes, {"resp": 1, "lp": 1})  # ...and is written
    lease = state.claim(T, "train", ALL, 8, **claim)  # type: ignore[arg-type]
    assert lease is not None and lease.indexes == (*a.indexes, *b.indexes)
    assert lease.group_ids == (slot.group_id,) * 3  # one per sample


def test_whole_groups_first_fit_never_splits() -> None:
    state = make()
    g0, m0 = put_group(state, 3)
    _, m1 = put_group(state, 4)
    g2, m2 = put_group(state, 2)
    lease = state.claim(T, "train", ALL, 5, holder="h", now=0, sampler=WHOLE_GROUPS, min_count=1)
    assert lease is not None
    assert tuple(dict.fromkeys(lease.group_ids)) == (g0, g2)  # g1 does not fit: skipped
    assert lease.indexes == (*m0, *m2)
    assert state.claim(T, "train", ALL, 3, holder="h", now=0, sampler=WHOLE_GROUPS) is None
    lease = state.claim(T, "train", ALL, 4, holder="h", now=0, sampler=WHOLE_GROUPS)
    assert lease is not None and lease.indexes == m1


def test_whole_groups_exact_count_by_default() -> None:
    state = make()
    put_group(state, 4)
    put_group(state, 4)
    assert state.ready_count(T, "train", ALL, sampler=WHOLE_GROUPS) == 8
    assert state.claim(T, "train", ALL, 6, holder="h", now=0, sampler=WHOLE_GROUPS) is None
    lease = state.claim(T, "train", ALL, 6, holder="h", now=0, sampler=WHOLE_GROUPS, min_count=4)
    assert lease is not None and len(lease.indexes) == 4


def test_a_member_held_by_the_same_consumer_blocks_its_group() -> None:
    state = make()
    _, idx = put_group(state, 2)
    single = state.claim(T, "train", ALL, 1, holder="h", now=0, sampler=FIFO)
    assert single is not None and single.indexes == idx[:1]
    assert state.ready_count(T, "train", ALL, sampler=WHOLE_GROUPS) == 0
    assert state.ready_count(T, "fwd", ALL, sampler=WHOLE_GROUPS) == 2  # other consumers unaffected
    state.ack(single.id)
    # What is left of the group for this consumer goes out whole.
    lease = state.claim(T, "train", ALL, 1, holder="h", now=0, sampler=WHOLE_GROUPS)
    assert lease is not None and lease.indexes == idx[1:]


def test_balanced_partitions_equal_counts_and_balanced_lengths() -> None:
    state = make()
    lengths = [100, 90, 10, 10, 50, 40, 30, 70]
    alloc = state.allocate(T, 8, 0, lengths=lengths)
    state.commit_write(T, alloc.indexes, {"resp": 1})
    lease = state.claim(T, "train", RESP, 8, holder="h", now=0, sampler=Balanced(dp_size=2))
    assert lease is not None
    assert sorted(i for p in lease.partitions for i in p) == list(alloc.indexes)
    sums = [sum(lengths[i] for i in p) for p in lease.partitions]
    assert [len(p) for p in lease.partitions] == [4, 4]
    assert abs(sums[0] - sums[1]) <= 10, sums


def test_balanced_whole_groups_keeps_groups_on_one_rank() -> None:
    state = make()
    groups = [put_group(state, 2, lengths=[n, n]) for n in (50, 40, 30, 20)]
    sampler = Balanced(dp_size=2, whole_groups=True)
    lease = state.claim(T, "train", ALL, 8, holder="h", now=0, sampler=sampler)
    assert lease is not None
    for _, members in groups:
        homes = {r for r, p in enumerate(lease.partitions) if set(members) & set(p)}
        assert len(homes) == 1
    assert [sum(1 for _ in p) for p in lease.partitions] == [4, 4]


def test_partition_lpt() -> None:
    # Heaviest first, each to the lightest bin: 7->A, 5->B, 4->B, 4->A, 3->B.
    bins = partition_lpt([(7, [0]), (5, [1]), (4, [2]), (4, [3]), (3, [4])], 2, equal_count=False)
    assert bins == [[0, 3], [1, 2, 4]]
    bins = partition_lpt([(9, [0]), (1, [1]), (1, [2]), (1, [3])], 2, equal_count=True)
    assert sorted(len(b) for b in bins) == [2, 2]
    assert partition_lpt([], 3, equal_count=True) == [[], [], []]
    with pytest.raises(InvalidArgument, match="dp_size must be an int >= 1"):
        Balanced(dp_size=0)


def test_rank_shared_lease_goes_to_every_rank_and_completes_at_the_last_ack() -> None:
    state = make()
    idx = put(state, 4, columns=ALL)
    kw = {"now": 0.0, "share_key": ("step", 0), "share_count": 2}
    r0 = state.claim(T, "train", ALL, 4, holder="rank0", **kw)  # type: ignore[arg-type]
    r1 = state.claim(T, "train", ALL, 4, holder="rank1", **kw)  # type: ignore[arg-type]
    assert r0 is not None and r1 is not None
    assert r0.id == r1.id and r0.indexes == r1.indexes == idx
    assert (r0.holder, r1.holder) == ("rank0", "rank1")
    assert state.claim(T, "train", ALL, 4, holder="rank0", **kw) == r0  # type: ignore[arg-type]
    with pytest.raises(ShareMismatch, match="one too many"):
        state.claim(T, "train", ALL, 4, holder="rank2", **kw)  # type: ignore[arg-type]
    with pytest.raises(ShareMismatch, match="does not match the lease"):
        state.claim(T, "train", RESP, 4, holder="rank1", **kw)  # type: ignore[arg-type]
    assert state.ack(r0.id, holder="rank0") == Update()  # waits for rank1
    with pytest.raises(UnknownLease, match="'rank0' already acked it"):
        state.ack(r0.id, holder="rank0")
    assert state.statistics().topics[0].consumers[1].consumed == 0
    upd = state.ack(r1.id, holder="rank1")
    assert upd.ended == (r0.id,)
    assert state.statistics().topics[0].consumers[1].consumed == 4
    # The key is free again: the next step's claim makes a new lease.
    put(state, 4, columns=ALL)
    nxt = state.claim(T, "train", ALL, 4, holder="rank0", **kw)  # type: ignore[arg-type]
    assert nxt is not None and nxt.id != r0.id


def test_a_dead_rank_returns_the_shared_lease_for_all() -> None:
    state = make()
    put(state, 2, columns=ALL)
    kw = {"now": 0.0, "share_key": "k", "share_count": 2}
    r0 = state.claim(T, "train", ALL, 2, holder="rank0", **kw)  # type: ignore[arg-type]
    r1 = state.claim(T, "train", ALL, 2, holder="rank1", **kw)  # type: ignore[arg-type]
    assert r0 is not None and r1 is not None
    assert state.release_holder("rank1").ended == (r0.id,)
    with pytest.raises(UnknownLease):
        state.ack(r0.id, holder="rank0")
    assert state.ready_count(T, "train", ALL) == 2


EXPIRING = WholeGroups(wait_expiring=True)


def _claim(state: ControllerState, count: int, sampler: Sampler) -> Lease | None:
    return state.claim(T, "train", ALL, count, holder="h", now=0, sampler=sampler, min_count=count)


def _slow_group_scenario() -> tuple[ControllerState, int, list[tuple[int, ...]]]:
    """Staleness 1: a group opened at version 0 is still being generated at version 1 (it goes
    stale at version 2) while two groups opened at version 1 are written at once."""
    state = make(staleness=1)
    slow = state.open_group(T, 2).group_id
    state.set_latest_version(T, 1)
    later = [put_group(state, 2, version=1)[1] for _ in range(2)]
    return state, slow, later


def _finish(state: ControllerState, group: int, version: int) -> tuple[int, ...]:
    state.commit_shared(T, group, {"prompt": 1000})
    alloc = state.allocate(T, 2, version, group=group)
    state.commit_write(T, alloc.indexes, {"resp": 1, "lp": 1})
    return alloc.indexes


def test_a_plain_whole_group_claim_passes_a_slow_group_which_then_goes_stale() -> None:
    state, slow, later = _slow_group_scenario()
    lease = _claim(state, 4, WHOLE_GROUPS)
    assert lease is not None and lease.indexes == (*later[0], *later[1])
    _finish(state, slow, 0)
    state.ack(lease.id)
    update = state.set_latest_version(T, 2)
    assert [e.group_ids for e in update.evictions] == [(slow,)]  # generated for nothing


def test_wait_expiring_waits_for_a_group_the_next_version_makes_stale() -> None:
    state, slow, later = _slow_group_scenario()
    assert _claim(state, 4, EXPIRING) is None  # it would have to pass the slow group
    state.commit_shared(T, slow, {"prompt": 1000})
    alloc = state.allocate(T, 2, 0, group=slow)
    assert _claim(state, 4, EXPIRING) is None  # allocated, not written yet
    state.commit_write(T, alloc.indexes, {"resp": 1, "lp": 1})
    lease = _claim(state, 4, EXPIRING)
    assert lease is not None and lease.indexes == (*alloc.indexes, *later[0])  # in order
    # the same with length-balanced whole groups for data-parallel ranks
    state, slow, later = _slow_group_scenario()
    balanced = Balanced(dp_size=2, whole_groups=True, wait_expiring=True)
    assert _claim(state, 4, balanced) is None
    written = _finish(state, slow, 0)
    lease = _claim(state, 4, balanced)
    assert lease is not None and set(lease.indexes) == {*written, *later[0]}


def test_wait_expiring_keeps_room_for_the_slow_group_and_takes_fresher_ones_meanwhile() -> None:
    """A claim that may take fewer than it asks (a trainer taking its batch piece by piece)
    takes the fresher groups already written, but never the room the slow group still needs:
    the slow group is trained at this version, not overtaken and evicted."""
    state, slow, later = _slow_group_scenario()
    first = state.claim(T, "train", ALL, 4, holder="h", now=0, sampler=EXPIRING, min_count=2)
    assert first is not None and first.indexes == later[0]  # 2 of 4: 2 kept for the slow group
    assert _claim(state, 2, EXPIRING) is None  # the rest is the slow group's
    written = _finish(state, slow, 0)
    lease = _claim(state, 2, EXPIRING)
    assert lease is not None and lease.indexes == written
    # a claim that has room for every slow group and more is not held back by them
    state, slow, later = _slow_group_scenario()
    lease = state.claim(T, "train", ALL, 6, holder="h", now=0, sampler=EXPIRING, min_count=2)
    assert lease is not None and lease.indexes == (*later[0], *later[1])


def test_wait_expiring_passes_groups_that_stay_fresh_and_groups_it_holds() -> None:
    state = make(staleness=1)
    state.set_latest_version(T, 1)
    state.open_group(T, 2)  # opened at 1: still fresh at 2, so it may be passed over
    done = put_group(state, 2, version=1)[1]
    lease = _claim(state, 2, EXPIRING)
    assert lease is not None and lease.indexes == done
    # a group of which this consumer already holds a member (a FIFO lease) does not block
    state = make(staleness=1)
    slow = state.open_group(T, 2).group_id
    state.commit_shared(T, slow, {"prompt": 1000})
    alloc = state.allocate(T, 2, 0, group=slow)
    state.commit_write(T, alloc.indexes[:1], {"resp": 1, "lp": 1})
    held = state.claim(T, "train", ALL, 1, holder="h", now=0, sampler=FIFO)
    assert held is not None and held.indexes == alloc.indexes[:1]
    state.set_latest_version(T, 1)
    _, later = put_group(state, 2, version=1)
    lease = _claim(state, 2, EXPIRING)
    assert lease is not None and lease.indexes == later


def test_a_whole_group_lease_marks_exactly_its_rows_when_groups_are_out_of_index_order() -> None:
    """Groups are taken in group order; when a later group's member has the lower index, the
    rows [0, 1, 4, 3] run from 0 to 3 first to last without being that run: the lease must hold
    rows 0, 1, 3, 4, not row 2 (a sample not yet written) in place of row 4. (Found by the
    controller state machine.)"""
    state = make(staleness=1)
    g0 = state.open_group(T, 1).group_id
    state.commit_shared(T, g0, {"prompt": 1000})
    (i0,) = state.allocate(T, 1, 0, group=g0).indexes
    ungrouped = state.allocate(T, 2, 0).indexes  # two single-sample groups
    g3 = state.open_group(T, 1).group_id
    state.commit_shared(T, g3, {"prompt": 1000})
    (i3,) = state.allocate(T, 1, 0).indexes  # a single-sample group opened after g3
    (i4,) = state.allocate(T, 1, 0, group=g3).indexes
    resp = frozenset({"resp"})
    state.commit_write(T, (i0, ungrouped[0], i3, i4), {"resp": 1})
    lease = state.claim(T, "train", resp, 4, holder="h", now=0, sampler=WHOLE_GROUPS)
    assert lease is not None and sorted(lease.indexes) == sorted((i0, ungrouped[0], i3, i4))
    state.commit_write(T, (ungrouped[1],), {"resp": 1})
    nxt = state.claim(T, "train", resp, 4, holder="h", now=0, sampler=FIFO, min_count=1)
    assert nxt is not None and nxt.indexes == (ungrouped[1],)  # not i4 a second time
    state.ack(lease.id)
    state.ack(nxt.id)
    (topic,) = state.statistics().topics
    assert [c.leased for c in topic.consumers if c.consumer == "train"] == [0]


def test_wait_expiring_waits_for_a_slow_group_at_most_lease_ttl() -> None:
    """A group whose writer died without a release must not stall its consumers until
    ``write_ttl``: past ``lease_ttl`` (10 s here) the claim passes it over."""
    state, _, later = _slow_group_scenario()

    def claim(now: float) -> Lease | None:
        return state.claim(T, "train", ALL, 4, holder="h", now=now, sampler=EXPIRING, min_count=4)

    assert claim(0.0) is None and state.next_deadline() == 10.0
    assert claim(9.0) is None
    changes = state.changes(T)
    state.expire(10.0)
    assert state.changes(T) != changes  # waiting claims are tried again
    lease = claim(10.0)
    assert lease is not None and lease.indexes == (*later[0], *later[1])
