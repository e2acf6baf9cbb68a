"""The TransferQueue as actors: client, controller and storage units working together."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import attrs
import pytest
import torch
import trio
import trio.testing

import asyncflow_actors as afa
from asyncflow_actors import transfer_queue as tq
from asyncflow_actors.transfer_queue import _messages as M
from asyncflow_actors.transfer_queue._unit_messages import Store, UnitBatch
from asyncflow_actors.transfer_queue.controller import ControllerShared

from .faults import Tap

ROLLOUT = tq.TopicSpec.from_dict(
    {
        "consumers": ["actor_fwd", "trainer"],
        "staleness": 1,
        "capacity": 64,
        "lease_ttl": 10.0,
        "columns": {
            "prompt": {"dtype": "int64", "shape": [5], "shared": True},
            "response": {"dtype": "int64", "shape": [None]},
            "tokens": {"dtype": "int64", "shape": [4]},
            "reward": {"dtype": "float32", "shape": []},
            "old_logprob": {"dtype": "float32", "shape": [4]},
        },
    },
    name="rollout",
)
PLAIN = tq.TopicSpec.from_dict(
    {
        "consumers": ["trainer"],
        "staleness": 0,
        "capacity": 8,
        "lease_ttl": 1.0,
        "columns": {"x": {"dtype": "float32", "shape": [3]}},
    },
    name="plain",
)


def batch(n: int, start: int = 0) -> dict[str, Any]:
    base = torch.arange(start, start + n)
    return {
        "tokens": base[:, None] * 10 + torch.arange(4),
        "reward": base.float(),
        "response": [torch.arange(int(i) % 3 + 1) + int(i) for i in base],
    }


@pytest.fixture
async def queue() -> AsyncIterator[tuple[tq.TransferQueue, tq.TransferQueueClient]]:
    async with afa.open_actor_system() as system:
        config = tq.TransferQueueConfig(topics=(ROLLOUT, PLAIN), units=2)
        async with tq.open_transfer_queue(system, config) as queue:
            client = await queue.client("test")
            yield queue, client


async def test_put_get_ack_round_trip(queue: Any) -> None:
    _, client = queue
    data = batch(6)
    indexes = await client.put("rollout", data, version=0)
    assert indexes == tuple(range(6))
    got = await client.get("rollout", "trainer", ["tokens", "reward", "response"], 6)
    assert got.indexes == indexes
    assert torch.equal(got["tokens"], data["tokens"])
    assert torch.equal(got["reward"], data["reward"])
    assert [r.tolist() for r in got["response"]] == [r.tolist() for r in data["response"]]
    assert await client.ack(got) == ()
    # another consumer still sees them; the trainer does not
    assert await client.get("rollout", "trainer", ["tokens"], 1, wait=False) is None
    other = await client.get("rollout", "actor_fwd", ["tokens"], 6)
    assert other.indexes == indexes
    await client.ack(other)
    await client.flush()
    stats = await client.statistics()
    assert stats.controller.state.topics[0].live == 0  # both consumers acked: freed
    assert all(u is not None and u.samples == 0 and u.nbytes == 0 for u in stats.units.values())


async def test_get_waits_until_enough_samples_are_ready(queue: Any) -> None:
    _, client = queue
    got: list[Any] = []
    async with trio.open_nursery() as nursery:

        async def consumer() -> None:
            got.append(await client.get("rollout", "trainer", ["tokens"], 4))

        nursery.start_soon(consumer)
        await client.put("rollout", batch(2), version=0)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []
        await client.put("rollout", batch(2, 2), version=0)
    assert got[0].indexes == (0, 1, 2, 3)


async def test_columns_written_later_make_samples_ready(queue: Any) -> None:
    _, client = queue
    await client.put("rollout", batch(3), version=0)
    assert await client.get("rollout", "trainer", ["old_logprob"], 3, wait=False) is None
    fwd = await client.get("rollout", "actor_fwd", ["tokens"], 3)
    logprob = -fwd["tokens"].float() / 100
    await client.put_columns(fwd, {"old_logprob": logprob})
    await client.ack(fwd)
    train = await client.get("rollout", "trainer", ["old_logprob", "tokens"], 3)
    assert torch.equal(train["old_logprob"], logprob)


async def test_staleness_window_evicts_and_reports(queue: Any) -> None:
    _, client = queue
    old = await client.put("rollout", batch(2), version=0)
    await client.set_version("rollout", 1)
    fresh = await client.put("rollout", batch(2, 2), version=1)
    await client.set_version("rollout", 2)  # staleness 1: version 0 falls out
    events = await client.events()
    assert [e.kind for e in events.events] == ["evicted"]
    assert set(events.events[0].indexes) == set(old)
    got = await client.get("rollout", "trainer", ["tokens"], 2)
    assert got.indexes == fresh
    with pytest.raises(tq.StaleVersionError):
        await client.put("rollout", batch(1), version=0)


async def test_staleness_zero_is_exactly_on_policy(queue: Any) -> None:
    _, client = queue
    await client.put("plain", {"x": torch.zeros(2, 3)}, version=0)
    await client.set_version("plain", 1)
    assert await client.get("plain", "trainer", ["x"], 1, wait=False) is None
    await client.put("plain", {"x": torch.ones(1, 3)}, version=1)
    got = await client.get("plain", "trainer", ["x"], 1)
    assert got.versions == (1,)


async def test_capacity_makes_put_wait(queue: Any) -> None:
    _, client = queue
    await client.put("plain", {"x": torch.zeros(8, 3)}, version=0)
    done: list[tuple[int, ...]] = []
    async with trio.open_nursery() as nursery:

        async def producer() -> None:
            done.append(await client.put("plain", {"x": torch.ones(2, 3)}, version=0))

        nursery.start_soon(producer)
        await trio.testing.wait_all_tasks_blocked()
        assert done == []  # full: the put waits, it does not fail
        got = await client.get("plain", "trainer", ["x"], 4)
        await client.ack(got)
    assert done == [(8, 9)]


async def test_an_expired_lease_returns_its_samples(autojump_clock: trio.testing.MockClock) -> None:
    config = tq.TransferQueueConfig(topics=(PLAIN,))
    async with afa.open_actor_system() as system, tq.open_transfer_queue(system, config) as queue:
        client = await queue.client("a")
        await client.put("plain", {"x": torch.zeros(2, 3)}, version=0)
        first = await client.get("plain", "trainer", ["x"], 2)  # never acked
        t0 = trio.current_time()
        await trio.sleep(1.5)  # lease_ttl 1.0
        again = await client.get("plain", "trainer", ["x"], 2)
        assert again.indexes == first.indexes
        assert trio.current_time() - t0 == 1.5  # on time: it was back when the get came
        with pytest.raises(tq.UnknownLease):
            await client.ack(first)
        await client.ack(again)


async def test_bookkeeping_travels_in_batches_and_arrives_on_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """What units keep for a rebuild (commits, consumption marks, deletes) lingers to travel
    with more, in one message per unit, and reaches them ``flush_linger`` later unasked."""
    spec = attrs.evolve(PLAIN, capacity=None)  # no put waits for the slots deletes free
    config = tq.TransferQueueConfig(topics=(spec,), units=1)
    async with afa.open_actor_system() as system, tq.open_transfer_queue(system, config) as queue:
        client = await queue.client("a")
        t0 = trio.current_time()
        for _ in range(5):
            await client.put("plain", {"x": torch.zeros(2, 3)}, version=0)
            await client.ack(await client.get("plain", "trainer", ["x"], 2))
        linger = attrs.fields(ControllerShared).flush_linger.default
        await trio.sleep(0.9 * linger)
        stats = await client.statistics()
        assert trio.current_time() - t0 == 0.9 * linger  # nothing waited for the units
        assert stats.controller.outbox == 16  # per round committed, consumed, deleted; watermarks
        assert stats.units["unit-0"] is not None and stats.units["unit-0"].samples == 10
        await trio.sleep(0.2 * linger)  # past the linger: delivered, nobody asked
        stats = await client.statistics()
        assert stats.controller.outbox == 0
        assert stats.units["unit-0"] is not None and stats.units["unit-0"].samples == 0


@pytest.mark.parametrize("put", [2, 5])
async def test_deletes_go_at_once_once_the_topic_runs_short_of_capacity(
    put: int, autojump_clock: trio.testing.MockClock
) -> None:
    """A freed slot stays occupied until its unit took the delete; so while less than half the
    capacity (8) is free, deletes do not linger: a streaming writer would soon wait for them."""
    config = tq.TransferQueueConfig(topics=(PLAIN,), units=1)
    async with afa.open_actor_system() as system, tq.open_transfer_queue(system, config) as queue:
        client = await queue.client("a")
        await client.put("plain", {"x": torch.zeros(put, 3)}, version=0)
        await client.ack(await client.get("plain", "trainer", ["x"], put))
        await trio.sleep(0.1 * queue.shared.flush_linger)
        stats = await client.statistics()
        assert stats.units["unit-0"] is not None
        assert stats.units["unit-0"].samples == (put if put == 2 else 0)  # 5 freed: 3 free
        await trio.sleep(queue.shared.flush_linger)
        stats = await client.statistics()
        assert stats.units["unit-0"] is not None and stats.units["unit-0"].samples == 0


async def test_a_put_waiting_for_capacity_does_not_wait_for_a_unit_that_frees_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Units take their bookkeeping concurrently; a put waiting for slots wakes once the unit
    that frees them took its deletes, not once the slowest unit took its own batch."""
    config = tq.TransferQueueConfig(topics=(PLAIN,), units=2)
    async with afa.open_actor_system() as system, tq.open_transfer_queue(system, config) as queue:
        client = await queue.client("a")
        await client.put("plain", {"x": torch.zeros(4, 3)}, version=0)
        await client.put("plain", {"x": torch.ones(4, 3)}, version=0)  # the capacity, 8: full
        first = await client.get("plain", "trainer", ["x"], 4)
        (freeing,) = first.lease.placement
        (slow,) = [u for u in queue.shared.units if u != freeing]

        async def late(msg: Any) -> None:
            if isinstance(msg, UnitBatch):
                await trio.sleep(3.0)  # under the unit timeout: slow, not failed

        queue.shared.units[slow] = Tap(queue.shared.units[slow], late)
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.ack, first)  # frees 4 slots on the other unit
            indexes = await client.put("plain", {"x": torch.full((4, 3), 2.0)}, version=0)
            assert trio.current_time() - t0 < 0.1  # it did not wait for the slow unit (3 s)
        assert len(indexes) == 4


async def test_a_cancelled_get_loses_nothing(queue: Any) -> None:
    _, client = queue
    with trio.move_on_after(0.05):
        await client.get("plain", "trainer", ["x"], 2)  # waits, then is cancelled
    await client.put("plain", {"x": torch.zeros(2, 3)}, version=0)
    got = await client.get("plain", "trainer", ["x"], 2)
    assert len(got) == 2


async def test_closing_a_client_returns_its_leases(queue: Any) -> None:
    q, client = queue
    other = await q.client("other")
    await client.put("plain", {"x": torch.zeros(2, 3)}, version=0)
    await other.get("plain", "trainer", ["x"], 2)
    await other.aclose()
    assert len(await client.get("plain", "trainer", ["x"], 2)) == 2


async def test_releasing_a_holder_withdraws_the_claims_and_puts_it_left_waiting(
    queue: Any,
) -> None:
    """A worker killed while its ``get`` (or a ``put`` short of capacity) waited leaves that
    request waiting in the controller: nobody will cancel it. Its restarted successor's
    ``aclose`` (same holder) withdraws them before returning the leases; otherwise the dead
    claim is first in line for the very samples the release returns."""
    q, client = queue
    answers: list[Any] = []

    async def dead(request: Any) -> None:  # asked over a link that then went silent
        try:
            answers.append(await q.controller.ask(request))
        except tq.TransferQueueError as exc:
            answers.append(exc)

    await client.put("plain", {"x": torch.zeros(8, 3)}, version=0)  # the topic is full
    with trio.fail_after(10):  # not withdrawn: they wait for ever
        async with trio.open_nursery() as nursery:
            claim = M.Claim("rollout", "trainer", ("tokens",), 2, "w", 10**9)
            nursery.start_soon(dead, claim)
            nursery.start_soon(dead, M.Allocate("plain", 2, 0, put_id=10**9, holder="w"))
            await trio.testing.wait_all_tasks_blocked()
            stats = await client.statistics()
            assert (stats.controller.waiting_claims, stats.controller.waiting_puts) == (1, 1)
            successor = await q.client("w")
            await successor.aclose()
    assert len(answers) == 2
    assert all("withdrawn" in str(a) for a in answers), answers
    stats = await client.statistics()
    assert (stats.controller.waiting_claims, stats.controller.waiting_puts) == (0, 0)
    # what comes next goes to the living: the dead claim took nothing, the dead put allocated
    # nothing (the 8 samples still fill the topic, no more)
    await client.put("rollout", batch(2), version=0)
    got = await client.get("rollout", "trainer", ["tokens"], 2, wait=False)
    assert got is not None and got.indexes == (0, 1)
    stats = await client.statistics()
    plain = next(t for t in stats.controller.state.topics if t.topic == "plain")
    assert plain.occupied == 8


async def test_a_grouped_put_failing_before_its_commit_gives_its_slots_back(queue: Any) -> None:
    """ "Nothing stored: put again" holds for a put into an open group: its failed allocation
    returns the group's slots (a discard shrank the group for good, and the same put again
    failed with ``GroupError``: the group could never be written)."""
    q, client = queue
    slot = await client.open_group("rollout", 4, shared={"prompt": torch.arange(5)})
    failing = True

    async def refuse(msg: Any) -> None:
        if failing and isinstance(msg, Store):
            raise tq.TransferQueueError("the unit is restarting")

    q.shared.units[slot.unit] = Tap(q.shared.units[slot.unit], refuse)
    writer = await q.client("writer")  # its refs to the units are the tapped ones
    with pytest.raises(tq.TransferQueueError, match="restarting"):
        await writer.put("rollout", batch(4), version=0, group=slot)
    failing = False
    indexes = await writer.put("rollout", batch(4), version=0, group=slot)
    got = await client.get("rollout", "trainer", ["tokens"], 4, sampler=tq.WHOLE_GROUPS)
    assert got.indexes == indexes and set(got.group_ids) == {slot.group_id}
    stats = await client.statistics()
    topic = next(t for t in stats.controller.state.topics if t.topic == "rollout")
    assert (topic.live, topic.discarded_total, topic.occupied) == (4, 4, 4)


async def test_group_shared_columns_are_stored_once(queue: Any) -> None:
    _, client = queue
    prompt = torch.arange(5)
    slot = await client.open_group("rollout", 4, shared={"prompt": prompt})
    for k in range(4):  # members stream in one by one
        await client.put("rollout", batch(1, k), version=0, group=slot)
    got = await client.get("rollout", "trainer", ["prompt", "tokens"], 4, sampler=tq.WHOLE_GROUPS)
    assert set(got.group_ids) == {slot.group_id}
    assert list(got.shared["prompt"]) == [slot.group_id]  # sent once
    assert all(torch.equal(p, prompt) for p in got.expand("prompt"))
    stats = await client.statistics()
    topic = stats.controller.state.topics[0]
    assert topic.dedup_bytes_saved == 3 * prompt.numel() * 8
    await client.ack(got)
    other = await client.get("rollout", "actor_fwd", ["tokens"], 4)
    await client.ack(other)
    await client.flush()
    stats = await client.statistics()
    assert all(u is not None and u.nbytes == 0 and u.groups == 0 for u in stats.units.values())


async def test_whole_groups_are_never_split(queue: Any) -> None:
    _, client = queue
    slot = await client.open_group(
        "rollout", 3, shared={"prompt": torch.zeros(5, dtype=torch.int64)}
    )
    await client.put("rollout", batch(2), version=0, group=slot)  # one member still missing
    assert (
        await client.get("rollout", "trainer", ["tokens"], 3, sampler=tq.WHOLE_GROUPS, wait=False)
        is None
    )
    await client.put("rollout", batch(1, 2), version=0, group=slot)
    got = await client.get("rollout", "trainer", ["tokens"], 3, sampler=tq.WHOLE_GROUPS)
    assert len(got) == 3


async def test_bad_input_gets_typed_errors_and_loses_nothing(queue: Any) -> None:
    _, client = queue
    await client.put("rollout", batch(2), version=0)
    with pytest.raises(tq.TransferQueueError, match="unknown topic"):
        await client.put("nope", batch(1), version=0)
    with pytest.raises(tq.UnknownColumn):
        await client.put("rollout", {"nope": torch.zeros(1)}, version=0)
    with pytest.raises(tq.SchemaError, match="dtype"):
        await client.put("rollout", {"tokens": torch.zeros(1, 4)}, version=0)
    with pytest.raises(tq.SchemaError):
        await client.put("rollout", {"tokens": torch.zeros(1, 5, dtype=torch.int64)}, version=0)
    with pytest.raises(tq.SchemaError, match="disagree"):
        await client.put(
            "rollout",
            {"tokens": torch.zeros(2, 4, dtype=torch.int64), "reward": torch.zeros(3)},
            version=0,
        )
    with pytest.raises(tq.InvalidArgument):
        await client.get("rollout", "trainer", ["tokens"], -1)
    with pytest.raises(tq.UnknownConsumer):
        await client.get("rollout", "nobody", ["tokens"], 1)
    got = await client.get("rollout", "trainer", ["tokens"], 2)
    with pytest.raises(tq.UnknownLease):
        await client.ack(_fake(got))
    assert torch.equal(got["tokens"], batch(2)["tokens"])  # what was stored is intact
    await client.ack(got)


def _fake(got: tq.Batch) -> tq.Lease:
    import attrs

    return attrs.evolve(got.lease, id=987_654)


async def test_a_crashed_storage_unit_is_restarted_and_its_samples_reported_lost(
    queue: Any,
) -> None:
    q, client = queue
    slot = await client.open_group("rollout", 2, shared={"prompt": torch.arange(5)})
    grouped = await client.put("rollout", batch(2), version=0, group=slot)
    loose = await client.put("plain", {"x": torch.zeros(4, 3)}, version=0)
    unit = q.units[slot.unit]
    unit._cell.fail(RuntimeError("disk on fire"))  # fault injection
    with trio.fail_after(10):
        events = await client.events()
    lost = [e for e in events.events if e.kind == "lost"]
    assert lost
    lost_indexes = {(e.topic, i) for e in lost for i in e.indexes}
    assert {("rollout", i) for i in grouped} <= lost_indexes
    assert any(slot.group_id in e.group_ids for e in lost if e.topic == "rollout")
    survivors = [i for i in loose if ("plain", i) not in lost_indexes]
    if survivors:
        got = await client.get("plain", "trainer", ["x"], len(survivors))
        assert set(got.indexes) == set(survivors)
    # the restarted unit takes new data
    again = await client.put("rollout", batch(2), version=0)
    got = await client.get("rollout", "trainer", ["tokens"], 2)
    assert got.indexes == again


async def test_a_restarted_controller_rebuilds_from_the_units(queue: Any) -> None:
    q, client = queue
    await client.put("rollout", batch(4), version=0)
    first = await client.get("rollout", "trainer", ["tokens"], 2)
    await client.ack(first)
    q.controller._cell.fail(RuntimeError("controller bug"))
    with trio.fail_after(10):
        while q.controller.statistics().restarts == 0:
            await trio.sleep(0.01)
    rest = await client.get("rollout", "trainer", ["tokens"], 2)  # not redelivered: the acked two
    assert set(rest.indexes) == {2, 3}
    assert torch.equal(rest["tokens"], batch(4)["tokens"][2:])
    assert await client.ack(rest) == ()
    fwd = await client.get("rollout", "actor_fwd", ["tokens"], 4)
    assert fwd.indexes == (0, 1, 2, 3)
    new = await client.put("rollout", batch(1), version=0)
    assert new[0] > 3  # indexes are never reused (a restart may skip ahead)


async def test_a_cancelled_put_waiting_for_capacity_leaves_nothing_behind(queue: Any) -> None:
    _, client = queue
    await client.put("plain", {"x": torch.zeros(8, 3)}, version=0)
    with trio.move_on_after(0.05):
        await client.put("plain", {"x": torch.ones(2, 3)}, version=0)  # full: waits, cancelled
    got = await client.get("plain", "trainer", ["x"], 8)
    await client.ack(got)  # frees all 8 slots: the cancelled put must not take any of them
    await client.put("plain", {"x": torch.ones(8, 3)}, version=0)
    stats = await client.statistics()
    assert stats.controller.state.topics[1].occupied == 8


async def test_balanced_sampler_splits_by_length_across_ranks(queue: Any) -> None:
    _, client = queue
    lengths = [10, 1, 1, 1, 9, 2, 2, 6]
    await client.put("rollout", batch(8), version=0, lengths=lengths)
    got = await client.get("rollout", "trainer", ["tokens"], 8, sampler=tq.Balanced(2))
    assert len(got.lease.partitions) == 2
    totals = [sum(lengths[i] for i in part) for part in got.lease.partitions]
    assert abs(totals[0] - totals[1]) <= 2  # 16 each is the balanced split
    for rank, part in enumerate(got.lease.partitions):
        rows = got.partition(rank)["tokens"]
        assert torch.equal(rows, batch(8)["tokens"][list(part)])
    await client.ack(got)


async def test_ranks_of_one_dp_group_share_a_lease(queue: Any) -> None:
    q, client = queue
    ranks = [await q.client(f"tp-{r}") for r in range(2)]
    await client.put("rollout", batch(4), version=0)
    leases = [
        await c.get("rollout", "trainer", ["tokens"], 4, share_key=("step", 0), share_count=2)
        for c in ranks
    ]
    assert leases[0].lease.id == leases[1].lease.id
    assert torch.equal(leases[0]["tokens"], leases[1]["tokens"])
    await ranks[0].ack(leases[0])
    assert await client.get("rollout", "trainer", ["tokens"], 1, wait=False) is None  # held
    await ranks[1].ack(leases[1])  # the k-th ack consumes it
    stats = await client.statistics()
    assert stats.controller.state.topics[0].consumers[1].consumed == 4


@pytest.mark.parametrize("units", [1, 2])
async def test_rows_of_a_variable_column_come_back_exactly_whatever_the_puts(units: int) -> None:
    short, long = torch.arange(6).reshape(2, 3), torch.arange(10).reshape(2, 5) + 100
    listed = [torch.arange(7) + 200, torch.arange(1) + 300]
    config = tq.TransferQueueConfig(topics=(ROLLOUT,), units=units)
    async with afa.open_actor_system() as system, tq.open_transfer_queue(system, config) as q:
        client = await q.client()
        await client.put("rollout", {"response": short}, version=0)  # batch [2, 3]
        await client.put("rollout", {"response": long}, version=0)  # batch [2, 5]
        await client.put("rollout", {"response": listed}, version=0)  # a list of rows
        got = await client.get("rollout", "trainer", ["response"], 6)
        want = [*short, *long, *listed]
        assert isinstance(got["response"], list) and len(got["response"]) == 6
        for row, expected in zip(got["response"], want, strict=True):
            assert row.shape == expected.shape and torch.equal(row, expected)
        await client.ack(got)


async def test_a_fixed_column_reads_as_one_tensor_whatever_the_puts(queue: Any) -> None:
    _, client = queue
    first = batch(2)
    await client.put("rollout", first, version=0)
    rows = [torch.arange(4) + 50, torch.arange(4) + 60]  # the same column put as a list of rows
    await client.put(
        "rollout",
        {"tokens": rows, "reward": torch.zeros(2), "response": [torch.arange(1)] * 2},
        version=0,
    )
    got = await client.get("rollout", "trainer", ["tokens", "reward"], 4)
    assert torch.equal(got["tokens"], torch.cat([first["tokens"], torch.stack(rows)]))
    assert got["reward"].shape == (4,)
    await client.ack(got)


async def test_members_of_an_open_group_never_wait_behind_groups_that_do_not_fit() -> None:
    config = tq.TransferQueueConfig(topics=(PLAIN,), units=1)
    async with afa.open_actor_system() as system, tq.open_transfer_queue(system, config) as q:
        a, b = await q.client(), await q.client()
        slot = await a.open_group("plain", 8)  # the whole capacity, reserved
        async with trio.open_nursery() as nursery:
            nursery.start_soon(b.open_group, "plain", 2)  # waits for room
            await trio.testing.wait_all_tasks_blocked()
            with trio.fail_after(5):  # the open group's own members use its reserved slots
                await a.put("plain", {"x": torch.zeros(8, 3)}, version=0, group=slot)
            got = await a.get("plain", "trainer", ["x"], 8)
            await a.ack(got)  # room again: the waiting group opens
