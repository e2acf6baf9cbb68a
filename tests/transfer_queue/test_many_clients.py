"""Many clients in several processes (issue #12 §4): 1024 concurrent client tasks, a third in
the driver and a third in each of two node processes, half writing GRPO-style groups with
versions advancing, half reading whole groups; the storage unit in its own process.

Every sample put is received exactly once, with the rows its writer put; no reader starves
while others are served (every reader's first batch is granted before any reader's second:
waiting claims are answered in arrival order); memory stays bounded by the topic's capacity
(the unit never holds more rows than the capacity, while 32 times that goes through); and the units hold nothing at the end.
"""

from __future__ import annotations

import trio

import asyncflow_actors as afa
from asyncflow_actors import transfer_queue as tq

from . import swarm

ALLOW = ["tests.transfer_queue", "asyncflow_actors.transfer_queue"]
TASKS = 1024
GROUPS = 2  # per writer (and batches per reader)
SIZE = 4  # members per group
ROW = 64  # int64 values per sample
PROMPT = 16
CAPACITY = 128  # samples: at most 32 groups open at once (4096 samples go through)


async def test_1024_clients_in_three_processes_lose_nothing_and_starve_no_one() -> None:
    config = tq.TransferQueueConfig(
        topics=(swarm.topic(CAPACITY, ROW, PROMPT),), units=1, placement="process"
    )
    writers = readers = TASKS // 2
    async with afa.open_actor_system() as system, tq.open_transfer_queue(system, config) as q:
        swarms: list[afa.ActorRef[object]] = [await system.spawn(swarm.Swarm, name="swarm")]

        async def node_swarm(k: int) -> None:
            node = await system.start_node(f"clients-{k}", allow=ALLOW)
            swarms.append(await node.spawn(swarm.Swarm, name="swarm"))

        async with trio.open_nursery() as nursery:
            for k in range(2):
                nursery.start_soon(node_swarm, k)
        plans = [
            swarm.Plan(q.controller, tuple(range(writers))[k::3], tuple(range(readers))[k::3],
                       GROUPS, SIZE)
            for k in range(3)
        ]  # fmt: skip
        client = await q.client()
        peak_rows = peak_bytes = 0

        async def watch_memory() -> None:
            nonlocal peak_rows, peak_bytes
            while True:
                stats = await client.statistics()
                units = [u for u in stats.units.values() if u is not None]
                peak_rows = max(peak_rows, sum(u.samples for u in units))
                peak_bytes = max(peak_bytes, sum(u.nbytes for u in units))
                await trio.sleep(0.02)

        with trio.fail_after(60):
            for ref, plan in zip(swarms, plans, strict=True):
                await ref.ask(swarm.StartReaders(plan))
            while (await client.statistics()).controller.waiting_claims < readers:
                await trio.sleep(0.01)  # every reader's first claim is queued: no data yet
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch_memory)
                for ref, plan in zip(swarms, plans, strict=True):
                    await ref.ask(swarm.StartWriters(plan))
                reports = [await ref.ask(swarm.Collect()) for ref in swarms]
                nursery.cancel_scope.cancel()
        await client.flush()
        stats = await client.statistics()

    assert [r.errors for r in reports] == [(), (), ()]
    put = [i for r in reports for i in r.put]
    got = [b for r in reports for b in r.got]
    received = sorted(i for b in got for i in b.indexes)
    assert len(put) == writers * GROUPS * SIZE == len(set(put))
    assert received == sorted(put)  # every sample put was received, exactly once
    assert sum(b.bad for b in got) == 0  # with the rows its writer put
    by_reader: dict[int, list[int]] = {}
    for b in got:
        by_reader.setdefault(b.reader, []).append(b.lease)
    assert sorted(by_reader) == list(range(readers))
    assert all(len(leases) == GROUPS for leases in by_reader.values())  # everyone was served
    firsts = [min(leases) for leases in by_reader.values()]
    seconds = [sorted(leases)[1] for leases in by_reader.values()]
    assert max(firsts) < min(seconds)  # no reader got a second batch while one waited for its first
    # bounded memory: a slot stays occupied until its unit took the sample's deletion, so the
    # capacity bounds the rows the unit holds (and each group holds a slot: its prompt too)
    assert peak_rows <= CAPACITY and len(put) == 32 * CAPACITY
    assert peak_bytes <= CAPACITY * (ROW + PROMPT) * 8
    assert stats.controller.state.topics[0].live == 0
    assert all(
        u is not None and (u.samples, u.groups, u.nbytes) == (0, 0, 0) for u in stats.units.values()
    )
