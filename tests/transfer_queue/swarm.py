"""Many TransferQueue clients at once, in any process: a swarm of writer and reader tasks.

A :class:`Swarm` actor runs client tasks in the process that hosts it (a node, or the driver):
each task has its own ``TransferQueueClient`` connected to the controller ref it was sent.
Writers open GRPO-style groups (a shared prompt, ``size`` members) with versions advancing;
readers get whole groups and ack them, checking every row against what its writer put. The
reader tasks start first (``StartReaders``), so a test can wait until all their claims are
queued at the controller before any data exists; ``Collect`` answers once every task ended,
with every lease each reader got and every index each writer put. Used by the many-clients
test and by ``benchmarks/bench_tq.py`` (``tq_clients_1024``); nodes import it by name.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

import asyncflow_actors as afa
from asyncflow_actors import transfer_queue as tq


def topic(capacity: int, row: int, prompt: int = 16) -> tq.TopicSpec:
    """The swarm's topic: a shared ``prompt`` per group, a ``resp`` row per sample."""
    return tq.TopicSpec.from_dict(
        {
            "consumers": ["trainer"],
            "staleness": 1_000_000,  # versions advance, nothing goes stale: exact accounting
            "capacity": capacity,
            "columns": {
                "prompt": {"dtype": "int64", "shape": [prompt], "shared": True},
                "resp": {"dtype": "int64", "shape": [row]},
            },
        },
        name="rollout",
    )


@attrs.frozen
class Plan:
    """What a swarm does: ``groups`` groups of ``size`` per writer (and as many whole-group
    batches per reader); group ``g`` of writer ``w`` is serial ``w * groups + g``, written with
    version ``serial // per_version``."""

    controller: afa.ActorRef[Any]
    writers: tuple[int, ...]
    readers: tuple[int, ...]
    groups: int
    size: int
    per_version: int = 64


@attrs.frozen
class Got:
    """One batch a reader got: its lease id (grant order) and indexes; ``bad``: rows that were
    not what their writer put."""

    reader: int
    lease: int
    indexes: tuple[int, ...]
    bad: int


@attrs.frozen
class Report:
    put: tuple[int, ...]
    got: tuple[Got, ...]
    errors: tuple[str, ...]


@attrs.frozen
class StartReaders(afa.Request[None]):
    plan: Plan


@attrs.frozen
class StartWriters(afa.Request[None]):
    plan: Plan


@attrs.frozen
class Collect(afa.Request[Report]):
    """Answered once every task of this swarm ended."""


async def write(client: tq.TransferQueueClient, plan: Plan, w: int, row: int) -> list[int]:
    put: list[int] = []
    for g in range(plan.groups):
        serial = w * plan.groups + g
        spec = client.specs["rollout"].columns["prompt"]
        assert spec.shape is not None
        prompt = torch.full(spec.shape, w, dtype=torch.int64)
        slot = await client.open_group("rollout", plan.size, shared={"prompt": prompt})
        rows = torch.full((plan.size, row), serial, dtype=torch.int64)
        version = serial // plan.per_version
        put += await client.put("rollout", {"resp": rows}, version=version, group=slot)
    return put


async def read(client: tq.TransferQueueClient, plan: Plan, r: int) -> list[Got]:
    got: list[Got] = []
    for _ in range(plan.groups):
        batch = await client.get(
            "rollout", "trainer", ["resp", "prompt"], plan.size, sampler=tq.WHOLE_GROUPS
        )
        assert batch is not None
        bad = 0
        for k, gid in enumerate(batch.group_ids):
            writer = int(batch.shared["prompt"][gid][0])
            serial = int(batch["resp"][k, 0])
            version = serial // plan.per_version
            ok = serial // plan.groups == writer and bool((batch["resp"][k] == serial).all())
            bad += not ok or batch.versions[k] != version
        got.append(Got(r, batch.lease.id, batch.indexes, bad))
        await client.ack(batch)
    return got


class Swarm(afa.Actor[StartReaders | StartWriters | Collect]):
    """Runs a plan's tasks in this process (see the module docstring)."""

    def __init__(self) -> None:
        self.put: list[int] = []
        self.got: list[Got] = []
        self.errors: list[str] = []
        self.running = 0
        self.waiting: list[afa.Reply] = []

    async def _task(self, plan: Plan, writer: int | None, reader: int | None) -> None:
        try:
            client = await tq.TransferQueueClient.connect(plan.controller)
            spec = client.specs["rollout"].columns["resp"]
            assert spec.shape is not None
            if writer is not None:
                self.put += await write(client, plan, writer, int(spec.shape[0]))
            if reader is not None:
                self.got += await read(client, plan, reader)
        except Exception as exc:  # reported, not raised: the test names what went wrong
            self.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            self.running -= 1
            if not self.running:
                self._answer()

    async def receive(
        self, msg: StartReaders | StartWriters | Collect, ctx: afa.ActorContext[Any]
    ) -> Any:
        if isinstance(msg, Collect):
            reply = ctx.defer_reply()
            self.waiting.append(reply)
            if not self.running:
                self._answer()
            return None
        if isinstance(msg, StartReaders):
            tasks = [(None, r) for r in msg.plan.readers]
        else:
            tasks = [(w, None) for w in msg.plan.writers]
        self.running += len(tasks)
        for writer, reader in tasks:
            ctx.start_soon(self._task, msg.plan, writer, reader)
        return None

    def _answer(self) -> None:
        for reply in self.waiting:
            reply.send(Report(tuple(self.put), tuple(self.got), tuple(self.errors)))
        self.waiting.clear()
