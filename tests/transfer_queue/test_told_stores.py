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

import pytest
import torch
import trio

import asyncflow_actors as afa
from asyncflow_actors import transfer_queue as tq
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
