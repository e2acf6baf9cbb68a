"""The TransferQueue with its storage units in node processes (real processes, real sockets)."""

from __future__ import annotations

import os
import signal
from collections.abc import Awaitable, Callable

import pytest
import torch
import trio

import asyncflow_actors as afa
from asyncflow_actors import transfer_queue as tq
from asyncflow_actors.transfer_queue import _shm
from asyncflow_actors.transfer_queue import _unit_messages as U
from asyncflow_actors.transfer_queue.client import _unit_io

SPEC = tq.TopicSpec.from_dict(
    {
        "consumers": ["trainer"],
        "columns": {
            "prompt": {"dtype": "int64", "shape": [None], "shared": True},
            "tokens": {"dtype": "int64", "shape": [4096]},
            "logp": {"dtype": "bfloat16", "shape": [4096]},
            "reward": {"dtype": "float32", "shape": []},
        },
    },
    name="rollout",
)
FAST = afa.NodeOptions(heartbeat_interval=0.1, heartbeat_timeout=2.0, shutdown_grace=2.0)


async def test_units_in_node_processes_round_trip_and_survive_kill_9() -> None:
    config = tq.TransferQueueConfig(topics=(SPEC,), units=2, placement="process")
    async with (
        afa.open_actor_system() as system,
        tq.open_transfer_queue(system, config, options=FAST) as queue,
    ):
        client = await queue.client("test")
        gen = torch.Generator().manual_seed(0)
        data = {
            "tokens": torch.randint(0, 50_000, (8, 4096), generator=gen),
            "logp": torch.randn(8, 4096, generator=gen).to(torch.bfloat16),
            "reward": torch.randn(8, generator=gen),
        }
        indexes = await client.put("rollout", data, version=0)
        slot = await client.open_group("rollout", 2, shared={"prompt": torch.arange(7)})
        grouped = await client.put(
            "rollout", {k: v[:2] for k, v in data.items()}, version=0, group=slot
        )
        got = await client.get("rollout", "trainer", ["tokens", "logp", "reward"], 8)
        assert got.indexes == indexes
        for key, value in data.items():
            assert torch.equal(got[key].view(torch.uint8), value.view(torch.uint8))
        await client.ack(got)
        # kill -9 the node process holding the group
        pid = (await queue.unit_pids())[slot.unit]
        assert pid is not None and pid != os.getpid()
        os.kill(pid, signal.SIGKILL)
        with trio.fail_after(30):
            events = await client.events()
        lost = [e for e in events.events if e.kind == "lost"]
        assert {i for e in lost for i in e.indexes} >= set(grouped)
        assert any(slot.group_id in e.group_ids for e in lost)
        # the unit is back on a fresh node process, and the queue works on
        with trio.fail_after(30):
            again = await client.put("rollout", data, version=0)
            back = await client.get("rollout", "trainer", ["tokens"], 8)
        assert back.indexes == again
        assert torch.equal(back["tokens"], data["tokens"])
        await client.ack(back)


def segments(namespace: str) -> set[str]:
    return {n for n in os.listdir(_shm.SHM_DIR) if n.startswith(namespace)}


async def eventually(check: Callable[[], Awaitable[bool]], seconds: float = 10.0) -> None:
    """Wait for a condition another process brings about (polled, with a deadline)."""
    with trio.fail_after(seconds):
        while not await check():
            await trio.sleep(0.02)


@pytest.mark.skipif(not _shm.available(), reason="no writable /dev/shm here")
async def test_same_host_bodies_go_through_shared_memory_the_units_own() -> None:
    config = tq.TransferQueueConfig(
        topics=(SPEC,), units=2, placement="process", shm_min_bytes=64 * 1024, shm_orphan_age=0.6
    )
    gen = torch.Generator().manual_seed(1)
    data = {
        "tokens": torch.randint(0, 50_000, (8, 4096), generator=gen)
    }  # 256 KiB: through shared memory
    async with (
        afa.open_actor_system() as system,
        tq.open_transfer_queue(system, config, options=FAST) as queue,
    ):
        ns = queue.namespace
        client = await queue.client()
        probes = segments(ns)
        assert len(probes) == 2  # one probe per unit, nothing else yet
        indexes = await client.put("rollout", data, version=0)
        await client.put("rollout", {"tokens": data["tokens"][:1]}, version=0)  # 32 KiB: socket
        await client.flush()  # the first put was told to its unit through the controller
        stats = await client.statistics()
        assert sum(u.shm_stores for u in stats.units.values() if u) == 1
        assert len(segments(ns) - probes) == 1
        got = await client.get("rollout", "trainer", ["tokens"], 8)
        assert got.indexes == indexes and torch.equal(got["tokens"], data["tokens"])
        got["tokens"][0, 0] = -1  # a reader's write stays its own (copy-on-write)
        await client.nack(got)
        again = await client.get("rollout", "trainer", ["tokens"], 8)
        assert torch.equal(again["tokens"], data["tokens"])
        # the leases named where the rows lie: both reads mapped them without asking the unit
        assert client.io.direct == 2
        assert sum(u.fetches for u in (await client.statistics()).units.values() if u) == 0
        await client.ack(again)

        async def only_probes() -> bool:
            return segments(ns) == probes

        await eventually(only_probes)  # every row consumed: the segment is unlinked
        assert torch.equal(again["tokens"], data["tokens"])  # and views stay valid after that
        # a writer killed between creating a segment and handing it over: swept by the unit
        info = await queue.units["unit-0"].ask(U.GetShm())
        _shm.write_segment(f"{info.prefix}cdead-0", [memoryview(b"x" * 4096)])
        await eventually(only_probes)
        # a unit killed -9 leaves its segments; its next incarnation removes them
        await client.put("rollout", data, version=0)
        (held,) = segments(ns) - probes
        unit = next(u for u in queue.units if held.startswith(f"{ns}{u}-"))
        pid = (await queue.unit_pids())[unit]
        assert pid is not None
        os.kill(pid, signal.SIGKILL)

        async def swept() -> bool:
            return held not in segments(ns) and len(segments(ns)) == 2

        await eventually(swept, 30)
    assert segments(ns) == set()  # the queue is gone: so is every segment of it


@pytest.mark.skipif(not _shm.available(), reason="no writable /dev/shm here")
async def test_a_reader_asks_the_unit_once_rows_are_no_longer_where_they_were_put() -> None:
    """Leases name where rows put through shared memory lie. Rows rewritten since, or moved by
    the unit (a compaction frees the segment they were put in), are fetched from the unit, and
    the reader gets exactly what was written last."""
    config = tq.TransferQueueConfig(
        topics=(SPEC,), units=1, placement="process", shm_min_bytes=64 * 1024
    )
    gen = torch.Generator().manual_seed(3)
    a, b = (torch.randint(0, 50_000, (8, 4096), generator=gen) for _ in range(2))  # 256 KiB
    async with (
        afa.open_actor_system() as system,
        tq.open_transfer_queue(system, config, options=FAST) as queue,
    ):
        ns = queue.namespace
        client = await queue.client()

        async def fetches() -> int:
            (unit,) = (await client.statistics()).units.values()
            assert unit is not None
            return unit.fetches

        await client.put("rollout", {"tokens": a}, version=0)
        got = await client.get("rollout", "trainer", ["tokens"], 8)
        assert torch.equal(got["tokens"], a) and client.io.direct == 1
        await client.put_columns(got, {"tokens": b})  # rewritten: no longer where it was put
        await client.nack(got)
        again = await client.get("rollout", "trainer", ["tokens"], 8)
        assert torch.equal(again["tokens"], b) and (client.io.direct, await fetches()) == (1, 1)
        await client.ack(again)

        probes = segments(ns)
        indexes = await client.put("rollout", {"tokens": a}, version=0)
        (first,) = segments(ns) - probes
        await client.discard("rollout", indexes[:5])
        await client.flush()  # 5 of 8 rows freed: the unit compacts the 3 left into a new segment
        (unit,) = (await client.statistics()).units.values()
        assert unit is not None and unit.compactions == 1
        assert first not in segments(ns)  # the segment the controller knows of is gone
        tail = await client.get("rollout", "trainer", ["tokens"], 3)
        assert torch.equal(tail["tokens"], a[5:])
        assert (client.io.direct, await fetches()) == (1, 2)
        await client.ack(tail)


async def test_without_shared_memory_bodies_take_the_socket() -> None:
    config = tq.TransferQueueConfig(topics=(SPEC,), units=1, placement="process", shm=False)
    data = {"tokens": torch.arange(8 * 4096).reshape(8, 4096)}
    async with (
        afa.open_actor_system() as system,
        tq.open_transfer_queue(system, config, options=FAST) as queue,
    ):
        client = await queue.client()
        await client.put("rollout", data, version=0)
        got = await client.get("rollout", "trainer", ["tokens"], 8)
        assert torch.equal(got["tokens"], data["tokens"])
        (unit,) = (await client.statistics()).units.values()
        assert unit is not None and (unit.shm_stores, unit.shm_fetches, unit.segments) == (0, 0, 0)


@pytest.mark.skipif(not _shm.available(), reason="no writable /dev/shm here")
async def test_freed_segments_are_filled_again_only_once_no_reader_maps_them() -> None:
    config = tq.TransferQueueConfig(
        topics=(SPEC,), units=1, placement="process", shm_min_bytes=64 * 1024
    )

    def batch(seed: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {"tokens": torch.randint(0, 50_000, (8, 4096), generator=gen)}  # 256 KiB

    async with (
        afa.open_actor_system() as system,
        tq.open_transfer_queue(system, config, options=FAST) as queue,
    ):
        ns = queue.namespace
        client = await queue.client()

        async def put(data: dict[str, torch.Tensor]) -> int:
            """Put; the inode of the segment the put handed over."""
            before = segments(ns)
            await client.put("rollout", data, version=0)
            (new,) = {n for n in segments(ns) - before if not n.rsplit("-", 1)[1].startswith("f")}
            return os.stat(_shm.path(new)).st_ino

        async def unit_stats() -> U.StorageStatistics:
            (unit,) = (await client.statistics()).units.values()
            assert unit is not None
            return unit

        a, b = batch(1), batch(2)
        first = await put(a)
        held = await client.get("rollout", "trainer", ["tokens"], 8)
        await client.ack(held)
        await client.flush()  # its rows are freed at the unit, but our view still maps it
        assert (await unit_stats()).recycled == 0
        second = await put(b)
        assert second != first  # not refilled under our view...
        assert torch.equal(held["tokens"], a["tokens"])  # ...which still shows what was put
        got = await client.get("rollout", "trainer", ["tokens"], 8)
        assert torch.equal(got["tokens"], b["tokens"])
        await client.ack(got)
        del held, got  # no view left: the unit may refill both segments now
        await client.flush()
        stats = await unit_stats()
        assert stats.recycled == 2 and stats.pool_nbytes > 0
        # the pages of the freed segments, refilled (the controller took the unit's list of
        # free segments with the flush, and passes it on with the placements)
        assert {await put(a), await put(b)} == {first, second}
        got = await client.get("rollout", "trainer", ["tokens"], 16)
        assert torch.equal(got["tokens"], torch.cat([a["tokens"], b["tokens"]]))
        await client.ack(got)
        del got
        await client.flush()
        # the writer kept its mapping of the segment it refilled: the next refill of that file
        # is a copy into the pages it mapped, and reads back exactly (the flush passed the
        # unit's two free segments on: the first two puts refill them, the third writes anew)
        refills = _unit_io.filler.refills
        more = [batch(seed) for seed in (3, 4, 5)]
        for data in more:
            await put(data)
        assert _unit_io.filler.refills == refills + 2
        got = await client.get("rollout", "trainer", ["tokens"], 24)
        assert torch.equal(got["tokens"], torch.cat([m["tokens"] for m in more]))
        await client.ack(got)
    assert segments(ns) == set()  # the pool goes with the queue
    _unit_io.filler.prune()
    assert _unit_io.filler.nbytes == 0  # nothing of it stays mapped


@pytest.mark.skipif(not _shm.available(), reason="no writable /dev/shm here")
async def test_big_puts_are_stored_while_their_segment_is_filled_and_read_back_exactly() -> None:
    """From 1 MiB a put's segment is filled from a worker thread while its ``Store`` travels
    (``put_columns`` fills first): every row reads back as written, mixed dtypes included."""
    config = tq.TransferQueueConfig(
        topics=(SPEC,), units=2, placement="process", shm_min_bytes=64 * 1024
    )
    gen = torch.Generator().manual_seed(7)
    n = 64  # 2 MiB of tokens, 0.5 MiB of bfloat16, and the rewards
    data = {
        "tokens": torch.randint(0, 50_000, (n, 4096), generator=gen),
        "reward": torch.randn(n, generator=gen),
    }
    logp = torch.randn(n, 4096, generator=gen).to(torch.bfloat16)
    tokens = torch.randint(0, 50_000, (n, 4096), generator=gen)  # rewritten: 2.5 MiB in all
    async with (
        afa.open_actor_system() as system,
        tq.open_transfer_queue(system, config, options=FAST) as queue,
    ):
        client = await queue.client()
        for _ in range(3):  # the later rounds refill segments the first ones freed
            await client.put("rollout", data, version=0)
            got = await client.get("rollout", "trainer", ["tokens", "reward"], n)
            assert torch.equal(got["tokens"], data["tokens"])
            assert torch.equal(got["reward"], data["reward"])
            await client.put_columns(got, {"logp": logp, "tokens": tokens})
            await client.nack(got)
            again = await client.get("rollout", "trainer", ["tokens", "logp", "reward"], n)
            assert torch.equal(again["logp"], logp) and torch.equal(again["tokens"], tokens)
            await client.ack(again)
            del got, again
            await client.flush()
        stats = await client.statistics()
        assert sum(u.shm_stores for u in stats.units.values() if u) == 6  # 64 rows: one unit


async def test_batched_group_writes_reach_units_in_node_processes() -> None:
    """``open_groups`` stores the shared columns of each unit's groups in one request over its
    socket, and a put of several groups' rows lands on both units (their parts by group)."""
    config = tq.TransferQueueConfig(topics=(SPEC,), units=2, placement="process")
    async with (
        afa.open_actor_system() as system,
        tq.open_transfer_queue(system, config, options=FAST) as queue,
    ):
        client = await queue.client()
        shared = [{"prompt": torch.arange(k + 3)} for k in range(4)]
        slots = await client.open_groups("rollout", [2, 2, 2, 2], shared=shared)
        assert {s.unit for s in slots} == set(queue.units)
        owners = [s.group_id for s in reversed(slots) for _ in range(2)]
        tokens = torch.arange(8 * 4096).reshape(8, 4096)
        data = {"tokens": tokens, "logp": tokens.to(torch.bfloat16), "reward": torch.arange(8.0)}
        indexes = await client.put("rollout", data, version=0, group=owners)
        got = await client.get(
            "rollout", "trainer", ["tokens", "prompt"], 8, sampler=tq.WHOLE_GROUPS
        )
        assert got is not None
        row = {index: k for k, index in enumerate(indexes)}
        for index, gid, value in zip(got.indexes, got.group_ids, got["tokens"], strict=True):
            assert gid == owners[row[index]] and torch.equal(value, tokens[row[index]])
        for k, slot in enumerate(slots):
            assert torch.equal(got.shared["prompt"][slot.group_id], shared[k]["prompt"])
        await client.ack(got)
        await client.flush()
        stats = await client.statistics()
        for unit in stats.units.values():
            assert unit is not None and (unit.samples, unit.groups, unit.nbytes) == (0, 0, 0)
