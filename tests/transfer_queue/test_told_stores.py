"""Puts told to their unit through the controller (shared memory, same host).

A small put through shared memory is committed in one controller request that carries its
``Store``; the controller tells the unit with the rest of its bookkeeping. Readers that map
the segments read at once; whoever must ask the unit (a reader on another host, a writer of
columns) is served only once the unit took the store. Bookkeeping lingers 30 s here, so a test
that passes was not served by the linger running out.
"""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import torch
import trio

import asyncflow_actors as afa
from asyncflow_actors import transfer_queue as tq
from asyncflow_actors.transfer_queue import _messages as tq_messages
from asyncflow_actors.transfer_queue import _shm

from .faults import crash

SPEC = tq.TopicSpec.from_dict(
    {
        "consumers": ["trainer"],
        "columns": {
            "tokens": {"dtype": "int64", "shape": [4096]},
            "reward": {"dtype": "float32", "shape": []},
        },
    },
    name="rollout",
)
FAST = afa.NodeOptions(heartbeat_interval=0.1, heartbeat_timeout=2.0, shutdown_grace=2.0)
CONFIG = tq.TransferQueueConfig(
    topics=(SPEC,), units=1, placement="process", shm_min_bytes=64 * 1024
)
pytestmark = pytest.mark.skipif(not _shm.available(), reason="no writable /dev/shm here")


def tokens(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (8, 4096), generator=gen)  # 256 KiB: shared memory


@asynccontextmanager
async def lingering_queue(
    config: tq.TransferQueueConfig = CONFIG,
) -> AsyncIterator[tq.TransferQueue]:
    """A queue whose bookkeeping lingers 30 s (see the module docstring)."""
    async with (
        afa.open_actor_system() as system,
        tq.open_transfer_queue(system, config, options=FAST) as queue,
    ):
        queue.shared.flush_linger = 30.0
        yield queue


async def unit_stores(client: tq.TransferQueueClient) -> int:
    (unit,) = (await client.statistics()).units.values()
    assert unit is not None
    return unit.stores


async def test_a_reader_that_must_ask_the_unit_is_served_once_the_unit_took_the_put() -> None:
    async with lingering_queue() as queue:
        writer, remote = await queue.client(), await queue.client()
        remote.io.shm_min_bytes = None  # as if on another host: it maps no segment
        data = tokens(1)
        await writer.put("rollout", {"tokens": data, "reward": torch.ones(8)}, version=0)
        remote.incarnations = dict(writer.incarnations)  # it knows the unit all the same
        assert await unit_stores(writer) == 0  # told, not asked: the unit has not heard yet
        with trio.fail_after(10):
            got = await remote.get("rollout", "trainer", ["tokens", "reward"], 8)
        assert got is not None and torch.equal(got["tokens"], data)
        assert remote.io.direct == 0 and await unit_stores(writer) == 1
        await remote.ack(got)


async def test_columns_written_to_a_told_put_reach_the_unit_after_the_put() -> None:
    async with lingering_queue() as queue:
        client, remote = await queue.client(), await queue.client()
        remote.io.shm_min_bytes = None
        data = tokens(2)
        await client.put("rollout", {"tokens": data}, version=0)
        got = await client.get("rollout", "trainer", ["tokens"], 8)  # mapped: no wait
        assert got is not None and client.io.direct == 1
        assert await unit_stores(client) == 0
        with trio.fail_after(10):  # the unit must hold the samples before their new column
            await client.put_columns(got, {"reward": torch.arange(8.0)})
        await client.nack(got)
        again = await remote.get("rollout", "trainer", ["tokens", "reward"], 8)
        assert again is not None
        assert torch.equal(again["tokens"], data)
        assert torch.equal(again["reward"], torch.arange(8.0))
        await remote.ack(again)


async def test_a_told_put_survives_a_controller_restart_before_the_unit_took_it() -> None:
    async with lingering_queue() as queue:
        client = await queue.client()
        data = tokens(3)
        indexes = await client.put("rollout", {"tokens": data}, version=0)
        assert await unit_stores(client) == 0
        await crash(queue.controller)  # its successor delivers the store, then rebuilds
        remote = await queue.client()
        remote.io.shm_min_bytes = None
        with trio.fail_after(10):
            got = await remote.get("rollout", "trainer", ["tokens"], 8)
        assert got is not None and got.indexes == indexes and torch.equal(got["tokens"], data)
        await remote.ack(got)
        await remote.flush()
        (unit,) = (await remote.statistics()).units.values()
        assert unit is not None and (unit.stores, unit.samples) == (1, 0)


async def test_a_lease_held_for_a_told_put_goes_out_when_its_unit_is_lost() -> None:
    config = tq.TransferQueueConfig(
        topics=(SPEC,),
        units=1,
        placement="process",
        shm_min_bytes=64 * 1024,
        unit_check_interval=0.2,
        unit_timeout=1.0,
    )
    async with lingering_queue(config) as queue:
        writer, remote = await queue.client(), await queue.client()
        remote.io.shm_min_bytes = None
        indexes = await writer.put("rollout", {"tokens": tokens(4)}, version=0)
        pid = (await queue.unit_pids())["unit-0"]
        assert pid is not None
        os.kill(pid, signal.SIGKILL)  # the unit never takes the told store
        with trio.fail_after(15):  # the held lease is answered once the loss is known
            try:
                got = await remote.get("rollout", "trainer", ["tokens"], 8, wait=False)
            except tq.StorageUnavailable:
                got = None  # leased before the loss was noticed: its fetch failed
            assert got is None
            lost: set[int] = set()
            cursor = 0
            while not set(indexes) <= lost:  # and the samples are reported lost, exactly
                batch = await writer.events(cursor)
                cursor = batch.cursor
                lost.update(i for e in batch.events if e.kind == "lost" for i in e.indexes)
        assert lost == set(indexes)


def segments(namespace: str) -> set[str]:
    return {n for n in os.listdir(_shm.SHM_DIR) if n.startswith(namespace)}


def stall_commits(client: tq.TransferQueueClient, seconds: float) -> None:
    """Make ``client`` stall between writing a put's segment and committing it (as a writer
    descheduled, or paused in a debugger, for longer than the units' ``shm_orphan_age``)."""
    ask = client._ask

    async def stalled(msg: Any) -> Any:
        if isinstance(msg, tq_messages.Commit):
            await trio.sleep(seconds)
        return await ask(msg)

    client._ask = stalled  # type: ignore[method-assign]


async def lost_samples(client: tq.TransferQueueClient) -> int:
    return (await client.statistics()).controller.lost_samples


# the unit sweeps what looks like a dead writer's segment every 0.05 s once 0.3 s old
ORPHANS = tq.TransferQueueConfig(
    topics=(SPEC,), units=1, placement="process", shm_min_bytes=64 * 1024, shm_orphan_age=0.3
)


@pytest.mark.parametrize("mapped", [True, False], ids=["mapping-reader", "asking-reader"])
async def test_a_writer_stalled_past_the_orphan_age_still_stores_exactly(mapped: bool) -> None:
    """A writer that lives keeps its segment locked until its commit is answered: the unit's
    sweep never takes it for a dead writer's, and the put is stored exactly, however long the
    writer stalled (it used to be committed, then skipped by the unit: a silent hole)."""
    async with lingering_queue(ORPHANS) as queue:
        queue.shared.flush_linger = 0.01  # the unit takes the told store at once
        writer, reader = await queue.client(), await queue.client()
        if not mapped:
            reader.io.shm_min_bytes = None  # as if on another host: it asks the unit
        stall_commits(writer, 1.0)  # more than three sweeps past the orphan age
        data = tokens(5)
        indexes = await writer.put("rollout", {"tokens": data}, version=0)
        await writer.flush()
        await trio.sleep(1.0)  # more sweeps, now that the writer let go of the segment
        with trio.fail_after(10):
            got = await reader.get("rollout", "trainer", ["tokens"], 8, wait=False)
        assert got is not None and got.indexes == indexes and torch.equal(got["tokens"], data)
        assert (reader.io.direct == 1) is mapped
        await reader.ack(got)
        await reader.flush()
        assert await lost_samples(writer) == 0
        (unit,) = (await reader.statistics()).units.values()
        assert unit is not None and (unit.stores, unit.samples, unit.segments) == (1, 0, 0)
        namespace = queue.namespace
    assert not segments(namespace)  # nothing left in /dev/shm


def test_the_sweep_spares_a_segment_its_writer_holds_and_touched() -> None:
    name = f"afa-test-{os.urandom(4).hex()}-c0"
    _shm.create(name, 64)
    old = os.stat(_shm.path(name)).st_mtime - 100.0
    os.utime(_shm.path(name), (old, old))  # as if written 100 s ago
    lock = _shm.hold(name)
    try:
        assert _shm.sweep(name, older_than=10.0) == 0  # its writer lives: not an orphan
        assert os.path.exists(_shm.path(name))
        _shm.let_go(lock, touch=True)  # committed: its unit has yet to take it
        assert _shm.sweep(name, older_than=10.0) == 0  # touched: 10 s more to be taken
        os.utime(_shm.path(name), (old, old))
        assert _shm.sweep(name, older_than=10.0) == 1  # never taken: an orphan now
        assert not os.path.exists(_shm.path(name))
    finally:
        _shm.unlink(name)


async def test_a_told_store_whose_segment_went_first_is_reported_lost() -> None:
    """The backstop: a segment can still go before its told store reaches the unit (the store
    waited in the controller's outbox past ``shm_orphan_age``). The unit reports the samples
    it could not take, the controller reports them lost, and nobody is served a hole."""
    async with lingering_queue() as queue:
        writer, reader = await queue.client(), await queue.client()
        indexes = await writer.put("rollout", {"tokens": tokens(6)}, version=0)
        assert await unit_stores(writer) == 0  # the store waits in the outbox
        (name,) = {n for n in segments(queue.namespace) if not n.endswith("probe")}
        os.unlink(_shm.path(name))  # as the sweep would
        with trio.fail_after(10):
            await writer.flush()  # the unit takes its bookkeeping: the store finds no segment
            lost: set[int] = set()
            while lost != set(indexes):
                batch = await writer.events(0)
                lost = {i for e in batch.events if e.kind == "lost" for i in e.indexes}
        assert await lost_samples(writer) == len(indexes)
        assert await reader.get("rollout", "trainer", ["tokens"], 8, wait=False) is None
        await writer.flush()
        (unit,) = (await writer.statistics()).units.values()
        assert unit is not None and (unit.stores, unit.samples, unit.segments) == (0, 0, 0)
        namespace = queue.namespace
    assert not segments(namespace)


async def test_a_reader_asking_for_rows_whose_segment_went_gets_storage_unavailable() -> None:
    async with lingering_queue() as queue:
        writer, reader = await queue.client(), await queue.client()
        indexes = await writer.put("rollout", {"tokens": tokens(7)}, version=0)
        for name in segments(queue.namespace):
            if not name.endswith("probe"):
                os.unlink(_shm.path(name))  # swept before the unit took the store
        with trio.fail_after(10), pytest.raises(tq.StorageUnavailable):
            await reader.get("rollout", "trainer", ["tokens"], 8, wait=False)
        await writer.flush()
        batch = await writer.events(0)
        assert {i for e in batch.events if e.kind == "lost" for i in e.indexes} == set(indexes)


async def test_a_put_failing_on_one_unit_lets_go_of_the_told_segments_of_the_others() -> None:
    config = tq.TransferQueueConfig(
        topics=(SPEC,), units=2, placement="process", shm_min_bytes=64 * 1024
    )
    async with lingering_queue(config) as queue:
        writer = await queue.client()
        first, second = await writer.open_groups("rollout", (12, 12))  # a failed put shrinks
        assert first.unit != second.unit
        rows = [first] * 4 + [second] * 4  # one put, a part on each unit
        await writer.put("rollout", {"tokens": tokens(8)}, version=0, group=rows)
        real = writer.io._to_segment
        calls = 0

        def second_fails(prefix: str, part: dict[str, Any]) -> Any:
            nonlocal calls
            calls += 1
            if calls == 2:
                raise OSError("no space left in /dev/shm")
            return real(prefix, part)

        writer.io._to_segment = second_fails  # type: ignore[method-assign]
        before = segments(queue.namespace)
        with pytest.raises(OSError):
            await writer.put("rollout", {"tokens": tokens(9)}, version=0, group=rows)
        assert calls == 2 and not writer.io._held  # no lock kept: nothing pins a segment
        assert segments(queue.namespace) == before  # the first unit's segment went at once
        writer.io._to_segment = real  # type: ignore[method-assign]
        await writer.put("rollout", {"tokens": tokens(10)}, version=0, group=rows)
        got = await writer.get("rollout", "trainer", ["tokens"], 16, wait=False)
        assert got is not None and sorted(got.indexes) == list(range(8)) + list(range(16, 24))
        await writer.ack(got)
