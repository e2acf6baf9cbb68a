"""Failures reported exactly: units restarting behind the controller's back, controller restarts
in the middle of a flush or a get, writes that fail half-way, watchers that give up."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import trio
import trio.testing

import asyncflow_actors as afa
from asyncflow_actors import transfer_queue as tq
from asyncflow_actors.transfer_queue import _messages as M
from asyncflow_actors.transfer_queue import _unit_messages as U

from .faults import Tap, crash

PLAIN = tq.TopicSpec.from_dict(
    {
        "consumers": ["trainer"],
        "lease_ttl": 30.0,
        "columns": {
            "x": {"dtype": "float32", "shape": [3]},
            "prompt": {"dtype": "int64", "shape": [2], "shared": True},
        },
    },
    name="plain",
)
SLOW_WATCH = tq.TransferQueueConfig(topics=(PLAIN,), units=2, unit_check_interval=3600.0)


def rows(n: int, start: int = 0) -> dict[str, torch.Tensor]:
    return {"x": torch.arange(start, start + n).float()[:, None].repeat(1, 3)}


async def unit_of(client: tq.TransferQueueClient, indexes: tuple[int, ...]) -> str:
    """The unit holding ``indexes`` (a small put lands whole on one), seen in a lease."""
    batch = await client.get("plain", "trainer", ["x"], 64, min_count=1, wait=False)
    assert batch is not None
    await client.nack(batch)
    (unit,) = {u for u, held in batch.lease.placement.items() if set(held) & set(indexes)}
    return unit


async def lost_indexes(client: tq.TransferQueueClient) -> set[int]:
    with trio.fail_after(10):
        events = await client.events()
    return {i for e in events.events if e.kind == "lost" for i in e.indexes}


async def test_a_unit_that_restarted_while_the_controller_was_down_is_reported_lost() -> None:
    async with (
        afa.open_actor_system() as system,
        tq.open_transfer_queue(system, SLOW_WATCH) as q,
    ):
        client = await q.client()
        indexes = await client.put("plain", rows(4), version=0)
        unit = await unit_of(client, indexes)
        await crash(q.units[unit])  # the controller's watcher does not look for an hour...
        await crash(q.controller)  # ...and the controller restarts first
        assert await lost_indexes(client) == set(indexes)  # reported, not silently dropped
        assert await client.get("plain", "trainer", ["x"], 1, wait=False) is None
        stats = await client.statistics()
        assert stats.controller.state.topics[0].live == 0


async def test_data_sent_to_a_unit_that_restarted_unnoticed_is_refused_not_orphaned() -> None:
    async with (
        afa.open_actor_system() as system,
        tq.open_transfer_queue(system, SLOW_WATCH) as q,
    ):
        client = await q.client()
        await crash(q.units["unit-0"])  # restarted empty; the controller does not know yet
        with pytest.raises(tq.StorageUnavailable):
            await client.put("plain", rows(2), version=0)  # placed on unit-0: refused
        await trio.testing.wait_all_tasks_blocked()  # the client's report made the controller look
        stats = await client.statistics()
        unit0 = stats.units["unit-0"]
        assert unit0 is not None and stats.controller.incarnations["unit-0"] == unit0.incarnation
        assert all(u is not None and u.samples == 0 for u in stats.units.values())  # no orphan
        assert stats.controller.state.topics[0].live == 0
        assert stats.controller.lost_samples == 0  # nothing stored was lost: no false report
        again = await client.put("plain", rows(2), version=0)
        got = await client.get("plain", "trainer", ["x"], 2)
        assert got.indexes == again and torch.equal(got["x"], rows(2)["x"])


async def test_open_group_leaves_nothing_behind_when_its_commit_fails() -> None:
    config = tq.TransferQueueConfig(topics=(PLAIN,), units=1)
    async with afa.open_actor_system() as system, tq.open_transfer_queue(system, config) as q:
        client = await q.client()

        async def refuse(msg: Any) -> None:
            if isinstance(msg, M.CommitSharedGroups):
                raise tq.TransferQueueError("injected commit failure")

        real = client.controller
        client.controller = Tap(real, refuse)
        with pytest.raises(tq.TransferQueueError, match="injected"):
            await client.open_group("plain", 4, shared={"prompt": torch.tensor([1, 2])})
        client.controller = real
        stats = await client.statistics()
        (unit,) = stats.units.values()
        assert unit is not None and (unit.groups, unit.shared_nbytes, unit.nbytes) == (0, 0, 0)
        topic = stats.controller.state.topics[0]
        assert (topic.groups, topic.occupied) == (0, 0)  # the group is closed again


async def test_get_raises_storage_unavailable_when_a_unit_fails_under_it() -> None:
    async with (
        afa.open_actor_system() as system,
        tq.open_transfer_queue(system, SLOW_WATCH) as q,
    ):
        client = await q.client()
        first = await client.put("plain", rows(2), version=0)
        second = await client.put("plain", rows(2, 2), version=0)
        assert {await unit_of(client, first), await unit_of(client, second)} == set(q.units)
        doomed = await unit_of(client, second)

        class AfterClaim(Tap):
            async def ask(self, request: Any) -> Any:
                reply = await self.ref.ask(request)
                if isinstance(request, M.Claim):  # after the claim, before the fetch...
                    await crash(q.units[doomed])  # ...a unit restarts empty...
                    await crash(q.controller)  # ...and so does the controller
                return reply

        async def nothing(msg: Any) -> None:
            pass

        real = client.controller
        client.controller = AfterClaim(real, nothing)
        with pytest.raises(tq.StorageUnavailable):  # not an ExceptionGroup, not UnknownLease
            await client.get("plain", "trainer", ["x"], 4)
        client.controller = real
        assert await lost_indexes(client) == set(second)
        got = await client.get("plain", "trainer", ["x"], 2)  # the survivors go out again
        assert got.indexes == first


async def test_a_controller_crash_in_the_middle_of_a_flush_loses_no_delete() -> None:
    config = tq.TransferQueueConfig(topics=(PLAIN,), units=2)
    async with afa.open_actor_system() as system, tq.open_transfer_queue(system, config) as q:
        client = await q.client()
        a = await client.put("plain", rows(2), version=0)
        b = await client.put("plain", rows(2, 2), version=0)
        units = {await unit_of(client, a), await unit_of(client, b)}
        assert units == set(q.units)
        await client.flush()  # what the puts queued is delivered
        armed = True

        async def crash_mid_flush(msg: Any) -> None:
            nonlocal armed
            if armed and isinstance(msg, U.UnitBatch):
                armed = False
                q.controller._cell.fail(RuntimeError("crash mid-flush"))  # type: ignore[attr-defined]
                await trio.sleep_forever()  # the flusher dies here, with its controller

        before = q.controller.statistics().restarts
        q.shared.units["unit-1"] = Tap(q.shared.units["unit-1"], crash_mid_flush)
        got = await client.get("plain", "trainer", ["x"], 4)
        await client.ack(got)  # deletes for both units: unit-1's delivery is interrupted
        with trio.fail_after(10):
            while q.controller.statistics().restarts == before:
                await trio.sleep(0.01)
        assert await client.get("plain", "trainer", ["x"], 1, wait=False) is None  # none back
        await client.flush()
        stats = await client.statistics()
        assert all(u is not None and u.samples == 0 for u in stats.units.values())


async def test_event_watchers_that_give_up_leave_no_wait_behind() -> None:
    config = tq.TransferQueueConfig(topics=(PLAIN,), units=1)
    async with afa.open_actor_system() as system, tq.open_transfer_queue(system, config) as q:
        client = await q.client()
        for _ in range(500):
            with trio.move_on_after(0.001):
                await client.events()
        await trio.testing.wait_all_tasks_blocked()
        assert (await client.statistics()).controller.event_waiters == 0


async def test_a_get_cancelled_after_its_lease_was_granted_loses_nothing() -> None:
    config = tq.TransferQueueConfig(topics=(PLAIN,), units=1)
    async with afa.open_actor_system() as system, tq.open_transfer_queue(system, config) as q:
        holder, waiter = await q.client(), await q.client()
        await holder.put("plain", rows(2), version=0)
        held = await holder.get("plain", "trainer", ["x"], 2)
        scope = trio.CancelScope()
        got: list[Any] = []

        async def wait_for_samples() -> None:
            with scope:
                got.append(await waiter.get("plain", "trainer", ["x"], 2))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait_for_samples)
            await trio.testing.wait_all_tasks_blocked()  # the claim waits in the controller
            q.controller.send_nowait(M.Nack(held.lease.id))  # grants the waiting claim...
            scope.cancel()  # ...whose claimant gives up before it sees the lease
        assert got == []
        await trio.testing.wait_all_tasks_blocked()
        stats = await waiter.statistics()
        assert stats.controller.state.leases == 0  # the granted lease was returned
        again = await waiter.get("plain", "trainer", ["x"], 2, wait=False)
        assert again is not None and again.indexes == held.indexes


async def test_put_columns_on_samples_that_left_their_lease_raises_unknown_sample() -> None:
    async with (
        afa.open_actor_system() as system,
        tq.open_transfer_queue(system, SLOW_WATCH) as q,
    ):
        client = await q.client()
        indexes = await client.put("plain", rows(4), version=0)
        batch = await client.get("plain", "trainer", ["x"], 4)
        await client.nack(batch)  # as if it expired: the samples are free to go
        await client.discard("plain", indexes)
        await client.flush()  # the units dropped them
        with pytest.raises(tq.UnknownSample):
            await client.put_columns(batch, rows(4))
        assert (await client.statistics()).controller.state.topics[0].live == 0


async def test_a_restarted_controller_does_not_wait_twice_on_a_dead_unit(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A unit that went silent (its node died) while the controller restarted: its samples are
    reported lost within ``unit_timeout`` and the rest is served then, not after a second wait
    (to reset it: that waits in the background)."""
    async with (
        afa.open_actor_system() as system,
        tq.open_transfer_queue(system, SLOW_WATCH) as q,
    ):
        client = await q.client()
        kept = await client.put("plain", rows(2), version=0)
        gone = await client.put("plain", rows(2, 2), version=0)
        dead = await unit_of(client, gone)
        assert await unit_of(client, kept) != dead

        async def hang(msg: Any) -> None:
            await trio.sleep_forever()

        q.shared.units[dead] = Tap(q.shared.units[dead], hang)
        start = trio.current_time()
        await crash(q.controller)
        assert await lost_indexes(client) == set(gone)
        batch = await client.get("plain", "trainer", ["x"], 2)
        assert batch.indexes == kept
        assert trio.current_time() - start < SLOW_WATCH.unit_timeout + 1.0


async def test_a_restarted_controller_serves_the_healthy_units_while_a_dead_one_settles(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A unit silent (its node died) while the controller restarted: the restarted controller
    answers puts and claims on the other unit well before ``unit_timeout``, places nothing on
    the silent one, and reports its samples lost within ``unit_timeout`` (issue #27 §1.10)."""
    async with (
        afa.open_actor_system() as system,
        tq.open_transfer_queue(system, SLOW_WATCH) as q,
    ):
        client = await q.client()
        kept = await client.put("plain", rows(2), version=0)
        gone = await client.put("plain", rows(2, 2), version=0)
        dead = await unit_of(client, gone)
        assert await unit_of(client, kept) != dead

        async def hang(msg: Any) -> None:
            await trio.sleep_forever()

        q.shared.units[dead] = Tap(q.shared.units[dead], hang)
        timeout = SLOW_WATCH.unit_timeout
        start = trio.current_time()
        await crash(q.controller)
        batch = await client.get("plain", "trainer", ["x"], 2)
        assert batch.indexes == kept  # served from the healthy unit...
        assert trio.current_time() - start < timeout / 2  # ...long before the dead one settles
        assert torch.equal(batch["x"], rows(2)["x"])
        await client.ack(batch)
        fresh = await client.put("plain", rows(2, 10), version=0)  # placed on the healthy unit
        assert trio.current_time() - start < timeout / 2
        assert await q.controller.ask(M.CheckInvariants()) == ()
        stats = await client.statistics()
        assert stats.controller.units_down == (dead,)  # placed nothing until it settles
        assert await lost_indexes(client) == set(gone)
        assert trio.current_time() - start < timeout + 1.0
        assert await q.controller.ask(M.CheckInvariants()) == ()
        again = await client.get("plain", "trainer", ["x"], 2)
        assert again.indexes == fresh


async def test_a_unit_slow_to_answer_a_restarted_controller_is_kept(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Busy is not dead: a unit that answers the restarted controller after the grace but within
    ``unit_timeout`` keeps its samples (served once it answered) and is placed on again."""
    async with (
        afa.open_actor_system() as system,
        tq.open_transfer_queue(system, SLOW_WATCH) as q,
    ):
        client = await q.client()
        indexes = await client.put("plain", rows(2), version=0)
        busy = await unit_of(client, indexes)
        delay = SLOW_WATCH.unit_timeout / 2  # past the grace, within unit_timeout

        async def late(msg: Any) -> None:
            await trio.sleep(delay)

        q.shared.units[busy] = Tap(q.shared.units[busy], late)
        await crash(q.controller)
        await trio.sleep(2 * SLOW_WATCH.unit_timeout)
        stats = await client.statistics()
        assert (stats.controller.lost_samples, stats.controller.units_down) == (0, ())
        assert await q.controller.ask(M.CheckInvariants()) == ()
        batch = await client.get("plain", "trainer", ["x"], 2)
        assert batch.indexes == indexes
        assert torch.equal(batch["x"], rows(2)["x"])


async def test_a_unit_slow_to_answer_the_watcher_is_not_presumed_lost(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with (
        afa.open_actor_system() as system,
        tq.open_transfer_queue(system, SLOW_WATCH) as q,
    ):
        client = await q.client()
        indexes = await client.put("plain", rows(2), version=0)
        busy = await unit_of(client, indexes)
        slow = True

        async def late(msg: Any) -> None:
            if slow and isinstance(msg, U.GetToken):
                await trio.sleep(2 * SLOW_WATCH.unit_timeout)  # a deep mailbox, say

        q.shared.units[busy] = Tap(q.shared.units[busy], late)
        await q.controller.send(M.CheckUnits())
        await trio.sleep(3 * SLOW_WATCH.unit_timeout)
        slow = False
        await q.controller.send(M.CheckUnits())
        await trio.sleep(1)
        batch = await client.get("plain", "trainer", ["x"], 2, wait=False)
        assert batch is not None and batch.indexes == indexes  # kept, served
        stats = await client.statistics()
        assert (stats.controller.lost_samples, stats.controller.units_down) == (0, ())


async def test_a_discard_retried_after_a_controller_restart_gets_the_first_answer() -> None:
    async with (
        afa.open_actor_system() as system,
        tq.open_transfer_queue(system, SLOW_WATCH) as q,
    ):
        client = await q.client()
        indexes = await client.put("plain", rows(2), version=0)
        discard = M.Discard("plain", indexes, 4242)  # as the client sends it, with its id
        assert await q.controller.ask(discard) == ()
        await crash(q.controller)  # say, before the reply reached the client, which retries
        assert await q.controller.ask(discard) == ()
        with pytest.raises(tq.UnknownSample):  # a new discard of the same samples still fails
            await client.discard("plain", indexes)


class Swamped(Tap):
    """A controller ref whose mailbox is full for tells that must not wait."""

    def send_nowait(self, msg: Any) -> None:
        raise trio.WouldBlock


async def test_a_cancelled_get_or_put_withdraws_its_request_even_when_the_mailbox_is_full() -> None:
    config = tq.TransferQueueConfig(topics=(PLAIN,), units=1)
    async with afa.open_actor_system() as system, tq.open_transfer_queue(system, config) as q:
        client = await q.client()

        async def nothing(msg: Any) -> None:
            pass

        client.controller = Swamped(client.controller, nothing)
        with trio.move_on_after(0.2):
            await client.get("plain", "trainer", ["x"], 1)  # waits: nothing to claim
        stats = (await client.statistics()).controller
        assert (stats.waiting_claims, stats.waiting_puts) == (0, 0)


async def test_aclose_says_what_it_left_when_the_controller_does_not_answer(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    async with (
        afa.open_actor_system() as system,
        tq.open_transfer_queue(system, SLOW_WATCH) as q,
    ):
        client = await q.client("worker-3")

        async def hang(msg: Any) -> None:
            if isinstance(msg, M.ReleaseHolder):
                await trio.sleep_forever()

        client.controller = Tap(client.controller, hang)
        await client.aclose()  # gives up after a while: no hang, no error
        (record,) = [r for r in caplog.records if "worker-3" in r.getMessage()]
        assert record.levelname == "WARNING" and "lease_ttl" in record.getMessage()


async def test_a_group_whose_writer_died_holds_whole_group_claims_back_for_lease_ttl_only(
    autojump_clock: trio.testing.MockClock,
) -> None:
    spec = tq.TopicSpec.from_dict(
        {
            "consumers": ["trainer"],
            "staleness": 1,
            "lease_ttl": 30.0,
            "columns": {"x": {"dtype": "float32", "shape": [3]}},
        },
        name="plain",
    )
    config = tq.TransferQueueConfig(topics=(spec,), units=1, unit_check_interval=3600.0)
    async with afa.open_actor_system() as system, tq.open_transfer_queue(system, config) as q:
        client = await q.client()
        await client.open_group("plain", 2)  # its writer dies: never filled, never released
        await client.set_version("plain", 1)
        later = [
            await client.put("plain", rows(2), version=1, group=await client.open_group("plain", 2))
            for _ in range(2)
        ]
        start = trio.current_time()
        sampler = tq.WholeGroups(wait_expiring=True)
        batch = await client.get("plain", "trainer", ["x"], 4, sampler=sampler, min_count=4)
        assert batch.indexes == (*later[0], *later[1])
        assert trio.current_time() - start == pytest.approx(spec.lease_ttl, abs=0.5)
