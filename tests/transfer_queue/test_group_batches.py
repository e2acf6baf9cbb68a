"""Batched group operations against the running actors: ``open_groups`` (one request opens many
groups, one store per unit, one commit) and puts of several groups' rows (one allocation, one
commit). Each is all or nothing: a failure or a cancellation at any step leaves no group, no
sample and no shared blob behind, and an error about one group names it (``group_id``)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import trio
import trio.testing

import asyncflow_actors as afa
from asyncflow_actors import transfer_queue as tq
from asyncflow_actors.transfer_queue import _messages as M
from asyncflow_actors.transfer_queue import _unit_messages as U
from asyncflow_actors.transfer_queue.client import _client

from .faults import Tap

SPEC = tq.TopicSpec.from_dict(
    {
        "consumers": ["trainer"],
        "lease_ttl": 30.0,
        "staleness": 0,
        "columns": {
            "x": {"dtype": "float32", "shape": [3]},
            "prompt": {"dtype": "int64", "shape": [2], "shared": True},
        },
    },
    name="g",
)
CAPPED = tq.TopicSpec.from_dict(
    {
        "consumers": ["trainer"],
        "capacity": 8,
        "columns": {
            "x": {"dtype": "float32", "shape": [3]},
            "prompt": {"dtype": "int64", "shape": [2], "shared": True},
        },
    },
    name="capped",
)
CONFIG = tq.TransferQueueConfig(topics=(SPEC, CAPPED), units=2)


def rows(values: list[int]) -> dict[str, torch.Tensor]:
    return {"x": torch.tensor(values).float()[:, None].repeat(1, 3)}


def prompts(k: int) -> list[dict[str, torch.Tensor]]:
    return [{"prompt": torch.tensor([g, 7])} for g in range(k)]


async def assert_empty(client: tq.TransferQueueClient, topic: str) -> None:
    """No group, sample, reserved slot or waiting put in the topic; the units hold nothing."""
    await client.flush()
    stats = await client.statistics()
    (t,) = [t for t in stats.controller.state.topics if t.topic == topic]
    assert (t.groups, t.live, t.occupied) == (0, 0, 0)
    assert stats.controller.waiting_puts == 0
    for unit in stats.units.values():
        assert unit is not None
        assert (unit.groups, unit.samples, unit.shared_nbytes, unit.nbytes) == (0, 0, 0, 0)


class Counting(Tap):
    """A tap that counts the requests asked through it, by type."""

    def __init__(self, ref: afa.ActorRef[Any], counts: Counter[str]) -> None:
        async def hook(msg: Any) -> None:
            pass

        super().__init__(ref, hook)
        self.counts = counts

    async def ask(self, request: Any) -> Any:
        self.counts[type(request).__name__] += 1
        return await self.ref.ask(request)


async def test_open_groups_and_a_multi_group_put_round_trip_in_four_requests() -> None:
    async with afa.open_actor_system() as system, tq.open_transfer_queue(system, CONFIG) as q:
        client = await q.client()
        counts: Counter[str] = Counter()
        client.controller = Counting(client.controller, counts)
        client.io.units = {u: Counting(ref, counts) for u, ref in client.io.units.items()}
        slots = await client.open_groups("g", [2, 3, 2], shared=prompts(3))
        assert [s.size for s in slots] == [2, 3, 2]
        assert {s.unit for s in slots} == set(q.units)  # spread as if opened one by one
        units_used = len({s.unit for s in slots})
        assert counts == Counter(OpenGroups=1, StoreGroups=units_used, CommitSharedGroups=1)
        a, b, c = (s.group_id for s in slots)
        order = [b, a, c, b, a, c, b]  # rows of the groups interleaved
        counts.clear()
        indexes = await client.put("g", rows(list(range(7))), version=0, group=order)
        del counts["GetShm"]  # once per unit incarnation (may shared memory be used?)
        assert counts["Allocate"] == 1 and counts["Commit"] == 1
        assert sum(counts.values()) <= 2 + units_used  # at most one store per unit
        batch = await client.get("g", "trainer", ["x", "prompt"], 7, sampler=tq.WHOLE_GROUPS)
        assert batch is not None
        got = dict(zip(batch.indexes, batch.group_ids, strict=True))
        assert got == dict(zip(indexes, order, strict=True))
        for index, value in zip(batch.indexes, batch["x"][:, 0].tolist(), strict=True):
            assert value == indexes.index(index)  # each row carries the data put for it
        assert {g: p.tolist() for g, p in batch.shared["prompt"].items()} == {
            a: [0, 7],
            b: [1, 7],
            c: [2, 7],
        }
        await client.ack(batch)
        await assert_empty(client, "g")


async def test_a_multi_group_put_is_atomic_and_names_the_group_that_failed() -> None:
    async with afa.open_actor_system() as system, tq.open_transfer_queue(system, CONFIG) as q:
        client = await q.client()
        a, b = await client.open_groups("g", [2, 2])
        with pytest.raises(tq.GroupError) as full:  # b gets 3 rows for 2 slots
            await client.put("g", rows([0, 1, 2, 3, 4]), version=0, group=[a, a, b, b, b])
        assert full.value.group_id == b.group_id
        stats = await client.statistics()
        assert stats.controller.state.topics[0].live == 0  # not even a's rows
        gone = (await client.open_groups("g", [1]))[0]
        await client.shrink_group("g", gone, 1)  # freed: no longer live
        with pytest.raises(tq.UnknownGroup) as unknown:
            await client.put("g", rows([0, 1]), version=0, group=[a, gone])
        assert unknown.value.group_id == gone.group_id
        with pytest.raises(tq.InvalidArgument):  # one group per row
            await client.put("g", rows([0, 1, 2]), version=0, group=[a, b])
        # the caller falls back per group: the groups are intact
        await client.put("g", rows([0, 1]), version=0, group=a)
        await client.put("g", rows([2, 3]), version=0, group=[b, b])
        await client.set_version("g", 1)  # every group evicted (staleness 0)
        with pytest.raises(tq.StaleVersionError) as stale:  # the version, not a group
            await client.put("g", rows([0]), version=0, group=[a])
        assert stale.value.group_id is None
        await assert_empty(client, "g")


async def test_a_multi_group_put_whose_commit_fails_stores_nothing_and_can_be_put_again() -> None:
    async with afa.open_actor_system() as system, tq.open_transfer_queue(system, CONFIG) as q:
        client = await q.client()
        a, b = await client.open_groups("g", [2, 2])

        async def refuse(msg: Any) -> None:
            if isinstance(msg, M.Commit):
                raise tq.TransferQueueError("injected commit failure")

        real = client.controller
        client.controller = Tap(real, refuse)
        with pytest.raises(tq.TransferQueueError, match="injected"):
            await client.put("g", rows([0, 1, 2, 3]), version=0, group=[a, b, a, b])
        client.controller = real
        # as with a put into one group, nothing is stored and the groups get their slots back
        # (a discard would have closed them for good): the same put goes through
        stats = await client.statistics()
        (t,) = [t for t in stats.controller.state.topics if t.topic == "g"]
        assert (t.groups, t.live, t.reserved) == (2, 0, 4)
        await client.put("g", rows([0, 1, 2, 3]), version=0, group=[a, b, a, b])
        got = await client.get("g", "trainer", ["x"], 4, sampler=tq.WHOLE_GROUPS)
        assert sorted(got.group_ids) == sorted([a.group_id, b.group_id] * 2)
        await client.ack(got)
        await assert_empty(client, "g")


async def test_open_groups_leaves_nothing_behind_when_its_commit_fails() -> None:
    async with afa.open_actor_system() as system, tq.open_transfer_queue(system, CONFIG) as q:
        client = await q.client()

        async def refuse(msg: Any) -> None:
            if isinstance(msg, M.CommitSharedGroups):
                raise tq.TransferQueueError("injected commit failure")

        real = client.controller
        client.controller = Tap(real, refuse)
        with pytest.raises(tq.TransferQueueError, match="injected"):
            await client.open_groups("g", [4, 4, 4], shared=prompts(3))
        client.controller = real
        await assert_empty(client, "g")


async def test_open_groups_leaves_nothing_behind_when_a_unit_fails_its_store() -> None:
    async with afa.open_actor_system() as system, tq.open_transfer_queue(system, CONFIG) as q:
        client = await q.client()

        async def fail(msg: Any) -> None:
            if isinstance(msg, U.StoreGroups):
                await trio.sleep(0.01)  # the other unit stores its groups' blobs first
                raise tq.StorageUnavailable("injected unit failure")

        client.io.units["unit-1"] = Tap(client.io.units["unit-1"], fail)
        with pytest.raises(tq.StorageUnavailable, match="injected"):
            await client.open_groups("g", [2, 2, 2, 2], shared=prompts(4))
        await assert_empty(client, "g")


async def test_open_groups_is_admitted_all_or_nothing_and_a_cancelled_one_leaves_nothing() -> None:
    async with afa.open_actor_system() as system, tq.open_transfer_queue(system, CONFIG) as q:
        client = await q.client()
        (big,) = await client.open_groups("capped", [6])  # 2 of 8 slots left
        with pytest.raises(tq.CapacityError):  # could never fit: fails at once
            await client.open_groups("capped", [4, 5])
        for sizes, shared in [([], None), ([2, 0], None), ([2], prompts(2)), ([1.5], None)]:
            with pytest.raises(tq.InvalidArgument):
                await client.open_groups("capped", sizes, shared=shared)  # type: ignore[arg-type]
        opened: list[tuple[tq.GroupSlot, ...]] = []
        async with trio.open_nursery() as nursery:

            async def waiter() -> None:
                opened.append(await client.open_groups("capped", [2, 2], shared=prompts(2)))

            nursery.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()
            stats = await client.statistics()
            topic = stats.controller.state.topics[1]
            assert (stats.controller.waiting_puts, topic.groups, topic.occupied) == (1, 1, 6)
            await client.shrink_group("capped", big, 6)  # frees the slots: both fit now
        (slots,) = opened
        stats = await client.statistics()
        assert (
            stats.controller.state.topics[1].groups,
            stats.controller.state.topics[1].occupied,
        ) == (2, 4)
        for slot in slots:
            await client.shrink_group("capped", slot, 2)
        await assert_empty(client, "capped")

        # cancelled while it waits for capacity
        (big,) = await client.open_groups("capped", [6])
        with trio.move_on_after(1):
            await client.open_groups("capped", [2, 2], shared=prompts(2))
        await client.shrink_group("capped", big, 6)
        await assert_empty(client, "capped")

        # cancelled just as it is admitted: the slots are freed by a shrink queued before the
        # cancel, so the controller grants the groups before it hears that the writer left
        (big,) = await client.open_groups("capped", [6])
        scope = trio.CancelScope()
        late: list[tuple[tq.GroupSlot, ...]] = []
        async with trio.open_nursery() as nursery:

            async def cancelled() -> None:
                with scope:
                    late.append(await client.open_groups("capped", [2, 2], shared=prompts(2)))

            nursery.start_soon(cancelled)
            await trio.testing.wait_all_tasks_blocked()
            client.controller.send_nowait(M.ShrinkGroup("capped", big.group_id, 6))
            scope.cancel()
        assert not late
        await assert_empty(client, "capped")


async def test_open_groups_cancelled_while_storing_leaves_nothing_behind() -> None:
    async with afa.open_actor_system() as system, tq.open_transfer_queue(system, CONFIG) as q:
        client = await q.client()

        async def stall(msg: Any) -> None:
            if isinstance(msg, U.StoreGroups):
                await trio.sleep_forever()

        client.io.units["unit-0"] = Tap(client.io.units["unit-0"], stall)
        with trio.move_on_after(1) as scope:
            await client.open_groups("g", [2, 2, 2], shared=prompts(3))
        assert scope.cancelled_caught
        await assert_empty(client, "g")


def test_an_error_that_crossed_the_wire_still_names_its_group() -> None:
    """Across processes an error arrives as its type and message: the client reads the group
    back from the message."""
    for exc, gid in [
        (tq.GroupError("topic 'g': group 12 has 0 free slots, asked for 1"), 12),
        (tq.UnknownGroup("group 7 of topic 'g' is no longer live (freed, evicted or lost)"), 7),
        (tq.StaleVersionError("topic 'g': group 3 is stale (being evicted)"), 3),
        (tq.StaleVersionError("topic 'g': version 0 is outside the window"), None),
    ]:
        _client._name_group(exc)
        assert exc.group_id == gid
