"""Acks, frees and reference counts; leases ending; eviction; unit loss; discard; statistics."""

from __future__ import annotations

import pytest

from asyncflow_actors.transfer_queue import (
    WHOLE_GROUPS,
    ControllerState,
    StaleVersionError,
    UnknownGroup,
    UnknownLease,
    Update,
)

from .kit import ALL, RESP, T, make, put, put_group


def claim_ack(state: ControllerState, consumer: str, count: int, **kw: object) -> Update:
    lease = state.claim(T, consumer, ALL, count, holder="h", now=0, **kw)  # type: ignore[arg-type]
    assert lease is not None
    return state.ack(lease.id)


def test_a_sample_is_freed_when_every_consumer_acked_and_the_group_with_its_last_member() -> None:
    state = make()
    gid, idx = put_group(state, 2)
    assert claim_ack(state, "fwd", 2) == Update(ended=(0,))
    stats = state.statistics().topics[0]
    assert stats.consumers[0].consumed == 2 and stats.live == 2
    lease = state.claim(T, "train", ALL, 1, holder="h", now=0)
    assert lease is not None
    upd = state.ack(lease.id)
    (rel,) = upd.releases
    assert rel.indexes == (idx[0],) and rel.group_ids == () and rel.nbytes == 20
    stats = state.statistics().topics[0]
    assert stats.shared_bytes == 1000  # still referenced by the other member
    upd = claim_ack(state, "train", 1)
    (rel,) = upd.releases
    assert rel.indexes == (idx[1],) and rel.group_ids == (gid,)
    assert upd.nbytes_freed == 20 + 1000
    stats = state.statistics().topics[0]
    assert (stats.live, stats.groups, stats.shared_bytes, stats.live_bytes) == (0, 0, 0, 0)
    assert stats.freed_total == 2 and stats.allocated_total == 2
    assert state.statistics().units == {"u0": 0, "u1": 0}


def test_a_streamed_group_keeps_its_prompt_while_members_are_still_coming() -> None:
    state = make(consumers=("train",))
    slot = state.open_group(T, 2)
    state.commit_shared(T, slot.group_id, {"prompt": 1000})
    a = state.allocate(T, 1, 0, group=slot.group_id)
    state.commit_write(T, a.indexes, {"resp": 1, "lp": 1})
    upd = claim_ack(state, "train", 1)
    assert upd.freed_indexes == a.indexes and upd.releases[0].group_ids == ()
    b = state.allocate(T, 1, 0, group=slot.group_id)
    state.commit_write(T, b.indexes, {"resp": 1, "lp": 1})
    upd = claim_ack(state, "train", 1)
    assert upd.releases[0].group_ids == (slot.group_id,)


def test_dedup_bytes_saved() -> None:
    state = make()
    put_group(state, 8)
    stats = state.statistics().topics[0]
    assert stats.shared_bytes == 1000 and stats.dedup_bytes_saved == 7000


def test_ack_errors_leave_the_state_unchanged() -> None:
    state = make()
    put(state, 2)
    lease = state.claim(T, "fwd", RESP, 2, holder="h", now=0)
    assert lease is not None
    with pytest.raises(UnknownLease, match="lease 42 is not outstanding"):
        state.ack(42)
    with pytest.raises(UnknownLease, match="holder 'x' does not hold it"):
        state.ack(lease.id, holder="x")
    state.ack(lease.id)
    before = state.export_inventory()
    with pytest.raises(UnknownLease):
        state.ack(lease.id)
    with pytest.raises(UnknownLease):
        state.nack(lease.id)
    with pytest.raises(UnknownLease):
        state.renew(lease.id, 1.0)
    assert state.export_inventory() == before


def test_nack_expiry_and_holder_death_return_samples_to_the_pool() -> None:
    state = make(ttl=10.0)
    idx = put(state, 3)
    a = state.claim(T, "fwd", RESP, 1, holder="alice", now=0)
    b = state.claim(T, "fwd", RESP, 1, holder="bob", now=5)
    c = state.claim(T, "fwd", RESP, 1, holder="bob", now=6)
    assert a is not None and b is not None and c is not None
    assert state.ready_count(T, "fwd", RESP) == 0
    assert state.next_deadline() == 10.0
    assert state.expire(9.99) == Update()
    upd = state.expire(10.0)
    assert upd.ended == (a.id,) and state.ready_count(T, "fwd", RESP) == 1
    upd = state.release_holder("bob")
    assert sorted(upd.ended) == [b.id, c.id] and state.ready_count(T, "fwd", RESP) == 3
    assert state.next_deadline() is None
    # Returned samples go out again, oldest first; nothing was consumed.
    again = state.claim(T, "fwd", RESP, 3, holder="carol", now=20)
    assert again is not None and again.indexes == idx
    assert state.statistics().topics[0].consumers[0].consumed == 0


def test_renew_pushes_the_deadline() -> None:
    state = make(ttl=10.0)
    put(state, 1)
    lease = state.claim(T, "fwd", RESP, 1, holder="h", now=0)
    assert lease is not None
    renewed = state.renew(lease.id, 8.0)
    assert renewed.deadline == 18.0 and state.lease(lease.id).deadline == 18.0
    assert state.expire(12.0) == Update()
    assert state.expire(18.0).ended == (lease.id,)


def test_stale_groups_are_evicted_from_every_consumer_and_reported_once() -> None:
    state = make(staleness=1)
    gid, idx = put_group(state, 2, version=0)
    claim_ack(state, "fwd", 2)  # fwd consumed it, train did not
    assert state.set_latest_version(T, 1).evictions == ()
    upd = state.set_latest_version(T, 2)
    (ev,) = upd.evictions
    assert ev.group_ids == (gid,) and ev.indexes == idx and ev.nbytes == 1000 + 40
    (rel,) = upd.releases
    assert rel.indexes == idx and rel.group_ids == (gid,)
    stats = state.statistics().topics[0]
    assert stats.evicted_total == 2 and stats.evicted_groups_total == 1 and stats.live == 0
    assert state.set_latest_version(T, 5).evictions == ()  # reported exactly once


def test_a_leased_stale_group_leaves_other_consumers_and_is_evicted_when_the_lease_ends() -> None:
    state = make(staleness=0)
    gid, idx = put_group(state, 2, version=0)
    lease = state.claim(T, "train", ALL, 2, holder="h", now=0, sampler=WHOLE_GROUPS)
    assert lease is not None
    upd = state.set_latest_version(T, 1)
    assert upd == Update()  # held: not evicted yet
    assert state.ready_count(T, "fwd", ALL) == 0  # but nobody else may take it
    assert state.statistics().topics[0].pending_eviction_groups == 1
    with pytest.raises(StaleVersionError, match="is stale"):
        state.allocate(T, 1, 1, group=gid)
    upd = state.ack(lease.id)
    (ev,) = upd.evictions
    assert ev.indexes == idx and upd.freed_indexes == idx
    stats = state.statistics().topics[0]
    assert stats.evicted_total == 2 and stats.freed_total == 0


@pytest.mark.parametrize("ending", ["nack", "expire", "holder"])
def test_a_stale_group_returned_by_its_lease_is_evicted(ending: str) -> None:
    state = make(staleness=0, ttl=5.0)
    gid, _ = put_group(state, 3)
    lease = state.claim(T, "fwd", ALL, 3, holder="h", now=0)
    assert lease is not None
    state.set_latest_version(T, 1)
    if ending == "nack":
        upd = state.nack(lease.id)
    elif ending == "expire":
        upd = state.expire(5.0)
    else:
        upd = state.release_holder("h")
    assert upd.ended == (lease.id,) and upd.evictions[0].group_ids == (gid,)


def test_a_group_whose_stale_member_is_discarded_is_fresh_again() -> None:
    state = make(staleness=0)
    slot = state.open_group(T, 2)
    old = state.allocate(T, 1, 0, group=slot.group_id)
    state.commit_write(T, old.indexes, {"resp": 1})
    lease = state.claim(T, "fwd", RESP, 1, holder="h", now=0)
    assert lease is not None
    state.set_latest_version(T, 1)
    state.discard(T, old.indexes)  # the writer drops the stale member
    new = state.allocate(T, 1, 1, group=slot.group_id)
    state.commit_write(T, new.indexes, {"resp": 1})
    assert state.ready_count(T, "train", RESP, sampler=WHOLE_GROUPS) == 1
    assert state.ack(lease.id).missing == old.indexes


def test_storage_loss_reports_everything_on_the_unit_once() -> None:
    state = make(units=("u0", "u1"))
    g0, m0 = put_group(state, 2)  # on u0
    put_group(state, 2)  # on u1
    lease = state.claim(T, "fwd", ALL, 4, holder="h", now=0)
    assert lease is not None
    open_slot = state.open_group(T, 2)  # on u0 (tie broken by order) or u1
    loss = state.storage_lost("u0")
    lost_groups = {g0} | ({open_slot.group_id} if open_slot.unit == "u0" else set())
    (entry,) = loss.lost
    assert set(entry.group_ids) == lost_groups and entry.indexes == m0
    assert loss.leases == (lease.id,) and loss.group_ids == {T: entry.group_ids}
    assert state.storage_lost("u0").lost == ()  # reported exactly once
    stats = state.statistics()
    assert stats.units["u0"] == 0 and stats.topics[0].lost_total == 2
    # The lease keeps the surviving samples; the lost ones are skipped at ack.
    upd = state.ack(lease.id)
    assert upd.missing == m0
    assert state.statistics().topics[0].consumers[0].consumed == 2
    with pytest.raises(UnknownGroup, match="no longer live"):
        state.allocate(T, 1, 0, group=g0)
    # The unit restarted empty and takes new data.
    assert "u0" in state.allocate(T, 2, 0).units


def test_discard_shrinks_the_group_so_it_can_complete() -> None:
    state = make()
    slot = state.open_group(T, 3)
    a = state.allocate(T, 3, 0, group=slot.group_id)
    state.commit_shared(T, slot.group_id, {"prompt": 1})
    state.commit_write(T, a.indexes[:2], {"resp": 1, "lp": 1})
    assert state.ready_count(T, "train", ALL, sampler=WHOLE_GROUPS) == 0
    upd = state.discard(T, [a.indexes[2]])  # its generation failed
    assert upd.freed_indexes == (a.indexes[2],) and upd.evictions == ()
    assert state.ready_count(T, "train", ALL, sampler=WHOLE_GROUPS) == 2
    stats = state.statistics().topics[0]
    assert stats.discarded_total == 1 and stats.complete_groups == 1
    (grec,) = state.export_inventory().groups
    assert (grec.size, grec.allocated) == (2, 2)


def test_statistics_snapshot() -> None:
    state = make(capacity=10)
    put_group(state, 2)
    put(state, 1, columns=frozenset())
    state.claim(T, "fwd", ALL, 1, holder="h", now=0)
    stats = state.statistics()
    (ts,) = stats.topics
    assert (ts.live, ts.written, ts.occupied, ts.capacity, ts.groups) == (3, 2, 3, 10, 2)
    assert ts.leases == 1 and stats.leases == 1
    assert ts.consumers[0].leased == 1 and ts.consumers[1].leased == 0
    (view,) = ts.views
    assert (view.consumer, view.columns, view.ready) == ("fwd", ALL, 1)
    assert ts.allocated_total == 3


def test_samples_a_writer_never_committed_expire_and_free_their_capacity() -> None:
    state = make(capacity=4, write_ttl=5.0)
    stuck = state.allocate(T, 3, 0, holder="w", now=0.0)  # the writer dies before committing
    done = state.allocate(T, 1, 0, holder="w", now=1.0)
    state.commit_write(T, done.indexes, {"resp": 8})
    assert state.free_slots(T) == 0 and state.next_deadline() == 5.0
    assert state.expire(4.9) == Update()
    upd = state.expire(5.0)
    (abandoned,) = upd.abandoned
    assert abandoned.indexes == stuck.indexes and abandoned.group_ids == stuck.group_ids
    assert sorted(upd.freed_indexes) == list(stuck.indexes)
    stats = state.statistics().topics[0]
    assert (stats.live, stats.discarded_total, state.free_slots(T)) == (1, 3, 3)
    assert state.expire(100.0) == Update()  # committed samples never expire


def test_a_dead_writer_gives_back_its_uncommitted_samples_and_unfilled_group_slots() -> None:
    state = make(capacity=8)
    slot = state.open_group(T, 4, holder="w", now=0.0)
    member = state.allocate(T, 2, 0, group=slot.group_id, holder="w", now=0.0)
    state.commit_write(T, member.indexes[:1], {"resp": 8})
    other = state.allocate(T, 1, 0, holder="x", now=0.0)
    upd = state.release_holder("w")
    (abandoned,) = upd.abandoned
    assert abandoned.indexes == member.indexes[1:] and abandoned.group_ids == (slot.group_id,)
    (rec,) = state.group_records(T, [slot.group_id])
    assert (rec.size, rec.allocated) == (1, 1)  # complete with its one committed member
    assert state.free_slots(T) == 8 - 2 and state.locate(T, other.indexes)
    assert state.ready_count(T, "fwd", RESP, sampler=WHOLE_GROUPS) == 1


def test_an_open_group_waiting_too_long_for_members_gives_up_its_slots() -> None:
    state = make(capacity=8, write_ttl=5.0)
    slot = state.open_group(T, 3, holder="w", now=0.0)
    a = state.allocate(T, 1, 0, group=slot.group_id, holder="w", now=4.0)  # alive: deadline 9
    state.commit_write(T, a.indexes, {"resp": 8})
    assert state.expire(8.0) == Update()
    upd = state.expire(9.0)
    assert upd.abandoned[0].group_ids == (slot.group_id,) and upd.abandoned[0].indexes == ()
    assert state.free_slots(T) == 7
    assert state.ready_count(T, "fwd", RESP, sampler=WHOLE_GROUPS) == 1


def test_releasing_a_holder_drops_its_uncommitted_samples_without_a_write_ttl() -> None:
    state = make(capacity=4, write_ttl=None)  # no deadline: only the release gives them back
    stuck = state.allocate(T, 3, 0, holder="w", now=0.0)
    kept = state.allocate(T, 1, 0, holder="x", now=0.0)
    assert state.free_slots(T) == 0 and state.next_deadline() is None
    (abandoned,) = state.release_holder("w").abandoned
    assert abandoned.indexes == stuck.indexes
    assert state.free_slots(T) == 3 and state.locate(T, kept.indexes)
    state.commit_write(T, kept.indexes, {"resp": 8})
    assert state.release_holder("x") == Update()  # committed: nothing of it to give up
