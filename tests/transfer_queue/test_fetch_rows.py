"""``fetch_rows``: a reader that did not claim a lease reads some of its rows (a trainer rank):
mapped from where the lease says they lie, or asked of their unit with their groups' shared
columns; the rows come back in the order asked, as ``get`` assembles them."""

from __future__ import annotations

import pytest
import torch

import asyncflow_actors as afa
from asyncflow_actors import transfer_queue as tq
from asyncflow_actors.transfer_queue import _shm
from asyncflow_actors.transfer_queue.client import LeaseView, fetch_rows

SPEC = tq.TopicSpec.from_dict(
    {
        "consumers": ["trainer"],
        "columns": {
            "prompt": {"dtype": "int64", "shape": [None], "shared": True},
            "tokens": {"dtype": "int64", "shape": [4096]},
            "response": {"dtype": "int64", "shape": [None]},
        },
    },
    name="rollout",
)
FAST = afa.NodeOptions(heartbeat_interval=0.1, heartbeat_timeout=2.0, shutdown_grace=2.0)


def view_of(batch: tq.Batch) -> LeaseView:
    lease = batch.lease
    return LeaseView(lease.topic, lease.indexes, lease.group_ids, lease.placement, lease.shared,
                     batch.incarnations, batch.located)  # fmt: skip


@pytest.mark.skipif(not _shm.available(), reason="no writable /dev/shm here")
async def test_rows_of_a_lease_are_mapped_where_located_else_asked_with_their_groups() -> None:
    config = tq.TransferQueueConfig(topics=(SPEC,), units=2, placement="process",
                                    shm_min_bytes=1024)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 50_000, (8, 4096), generator=gen)
    responses = [torch.arange(k + 1) for k in range(8)]
    async with (
        afa.open_actor_system() as system,
        tq.open_transfer_queue(system, config, options=FAST) as queue,
    ):
        client = await queue.client()
        put = await client.put("rollout", {"tokens": tokens, "response": responses}, version=0)
        await client.flush()
        with pytest.raises(tq.InvalidArgument, match="not claimed"):
            await client.get("rollout", "trainer", ["tokens"], 8, fetch=["response"])
        batch = await client.get("rollout", "trainer", ["tokens", "response"], 8, fetch=[])
        assert batch.data == {} and set(batch.located) == set(batch.lease.placement)
        positions = [5, 1, 6]
        data, shared = await fetch_rows(client.io, SPEC, view_of(batch), positions,
                                        ["tokens", "response"])  # fmt: skip
        rows = [put.index(batch.indexes[p]) for p in positions]
        assert torch.equal(data["tokens"], tokens[rows]) and shared == {}
        assert all(
            torch.equal(a, responses[r]) for a, r in zip(data["response"], rows, strict=True)
        )
        units = (await client.statistics()).units.values()
        assert client.io.direct >= 1 and sum(u.fetches for u in units if u) == 0  # mapped
        await client.ack(batch)

        slot = await client.open_group("rollout", 2, shared={"prompt": torch.arange(7)})
        await client.put("rollout", {"tokens": tokens[:2], "response": responses[:2]},
                         version=0, group=slot)  # fmt: skip
        batch = await client.get("rollout", "trainer", ["prompt", "tokens"], 2, fetch=[])
        assert batch.located == {}  # its unit holds the group's prompt: asked, as ``get`` does
        data, shared = await fetch_rows(client.io, SPEC, view_of(batch), [1], ["tokens"],
                                        ["prompt"])  # fmt: skip
        assert torch.equal(data["tokens"], tokens[1:2])
        assert torch.equal(shared["prompt"][slot.group_id], torch.arange(7))
        await client.ack(batch)
