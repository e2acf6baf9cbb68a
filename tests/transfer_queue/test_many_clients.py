"""Many clients at once: 1024 concurrent client tasks (half writing GRPO-style groups with
versions advancing, half reading whole groups), each with its own client.

Every sample put is received exactly once, every reader is served (no one starves while others
are served: waiting claims are answered in arrival order), memory stays bounded by the topic's
capacity, and the units hold nothing at the end. (The tasks share one process: clients in other
processes need refs that travel between nodes, which the runtime does not offer yet.)
"""

from __future__ import annotations

import torch
import trio

import asyncflow_actors as afa
from asyncflow_actors import transfer_queue as tq

SPEC = tq.TopicSpec.from_dict(
    {
        "consumers": ["trainer"],
        "staleness": 1000,
        "capacity": 512,
        "columns": {
            "prompt": {"dtype": "int64", "shape": [16], "shared": True},
            "resp": {"dtype": "int64", "shape": [64]},
        },
    },
    name="rollout",
)
TASKS = 1024
GROUPS = 2  # per writer
SIZE = 4  # members per group


async def test_1024_concurrent_clients_lose_nothing_and_starve_no_one() -> None:
    config = tq.TransferQueueConfig(topics=(SPEC,), units=2)
    writers = readers = TASKS // 2
    received: dict[int, int] = {}
    served = [0] * readers
    peak = 0
    async with afa.open_actor_system() as system, tq.open_transfer_queue(system, config) as q:

        async def writer(w: int) -> None:
            client = await q.client()
            for g in range(GROUPS):
                slot = await client.open_group(
                    "rollout", SIZE, shared={"prompt": torch.full((16,), w)}
                )
                rows = torch.full((SIZE, 64), w * GROUPS + g)
                await client.put(
                    "rollout", {"resp": rows}, version=(w * GROUPS + g) // 128, group=slot
                )

        async def reader(r: int) -> None:
            nonlocal peak
            client = await q.client()
            for _ in range(GROUPS):
                batch = await client.get(
                    "rollout", "trainer", ["resp", "prompt"], SIZE, sampler=tq.WHOLE_GROUPS
                )
                (gid,) = set(batch.group_ids)
                writer_of = int(batch.shared["prompt"][gid][0])
                assert torch.equal(batch["resp"][:, 0] // GROUPS, torch.full((SIZE,), writer_of))
                for index in batch.indexes:
                    received[index] = received.get(index, 0) + 1
                served[r] += 1
                stats = q.shared.state.statistics() if q.shared.state is not None else None
                peak = max(peak, stats.topics[0].occupied if stats is not None else 0)
                await client.ack(batch)

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for w in range(writers):
                    nursery.start_soon(writer, w)
                for r in range(readers):
                    nursery.start_soon(reader, r)
        client = await q.client()
        await client.flush()
        stats = await client.statistics()
    assert len(received) == writers * GROUPS * SIZE  # every sample put was received...
    assert set(received.values()) == {1}  # ...exactly once
    assert served == [GROUPS] * readers  # and every reader was served
    assert peak <= SPEC.capacity  # memory bounded by the capacity
    assert stats.controller.state.topics[0].live == 0
    assert all(
        u is not None and (u.samples, u.groups, u.nbytes) == (0, 0, 0) for u in stats.units.values()
    )
