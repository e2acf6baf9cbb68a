"""The TransferQueue with its storage units in node processes (real processes, real sockets)."""

from __future__ import annotations

import os
import signal

import torch
import trio

import asyncflow_actors as afa
from asyncflow_actors import transfer_queue as tq

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
        node_ref = system.whereis(f"tq/node-{slot.unit}")
        assert node_ref is not None
        node = await node_ref.ask(afa.actors.remote.GetNode())
        assert node.pid is not None and node.pid != os.getpid()
        os.kill(node.pid, signal.SIGKILL)
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
