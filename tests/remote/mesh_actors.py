"""Actors the mesh tests place on nodes: TQ producers and consumers, relays (importable by nodes).

torch is imported by the actors that handle tensors as they start, not at import: most tests
spawn only the light actors here, and torch's import is most of a node's start-up.
"""

from __future__ import annotations

import os
import time
from typing import Any

import attrs
import trio

import asyncflow_actors as afa
from asyncflow_actors import transfer_queue as tq

ROW = 16 * 1024  # float32 values per sample: 64 KiB


@attrs.frozen
class Produce(afa.Request[tuple[int, ...]]):
    controller: afa.ActorRef[Any]
    n: int
    seed: int


@attrs.frozen
class Consume(afa.Request[dict[int, float]]):
    """Get ``count`` samples; ack them unless ``hold`` (then the lease stays with this actor)."""

    controller: afa.ActorRef[Any]
    count: int
    hold: bool = False


def _import_torch() -> None:
    """Import torch now, not while decoding a batch: a lease's ttl (1 s in the mesh tests)
    would run during the import."""
    import torch  # noqa: F401


class Producer(afa.Actor[Produce]):
    def __init__(self) -> None:
        _import_torch()

    async def receive(self, msg: Produce, ctx: afa.ActorContext[Produce]) -> tuple[int, ...]:
        import torch

        client = await tq.TransferQueueClient.connect(msg.controller, holder=ctx.name)
        gen = torch.Generator().manual_seed(msg.seed)
        data = {"x": torch.randn(msg.n, ROW, generator=gen)}
        indexes = await client.put("t", data, version=0)
        return tuple(indexes)


class Consumer(afa.Actor[Consume]):
    def __init__(self) -> None:
        _import_torch()

    async def receive(self, msg: Consume, ctx: afa.ActorContext[Consume]) -> dict[int, float]:
        client = await tq.TransferQueueClient.connect(msg.controller, holder=ctx.name)
        batch = await client.get("t", "c", ["x"], msg.count)
        sums = {i: float(row.sum()) for i, row in zip(batch.indexes, batch["x"], strict=True)}
        if not msg.hold:
            await client.ack(batch)
        return sums


@attrs.frozen
class Ping(afa.Request[str]):
    text: str


@attrs.frozen
class Note:
    text: str


@attrs.frozen
class Notes(afa.Request[tuple[str, ...]]):
    pass


class Echo(afa.Actor[Ping | Note | Notes]):
    """Answers pings, collects notes."""

    def __init__(self) -> None:
        self.notes: list[str] = []

    async def receive(self, msg: Ping | Note | Notes, ctx: afa.ActorContext[Any]) -> Any:
        if isinstance(msg, Ping):
            return f"{ctx.name}:{msg.text}"
        if isinstance(msg, Note):
            self.notes.append(msg.text)
            return None
        return tuple(self.notes)


@attrs.frozen
class Relay(afa.Request[str]):
    """Ask ``target`` a ``Ping`` and tell ``notify`` a ``Note`` with the answer."""

    target: afa.ActorRef[Ping]
    notify: afa.ActorRef[Note]
    text: str


@attrs.frozen
class WhoAmI(afa.Request[afa.ActorRef[Any]]):
    """Reply with this actor's own ref (a ref travelling in a reply)."""


class Relayer(afa.Actor[Relay | WhoAmI]):
    async def receive(self, msg: Relay | WhoAmI, ctx: afa.ActorContext[Any]) -> Any:
        if isinstance(msg, WhoAmI):
            return ctx.self
        answer = await msg.target.ask(Ping(msg.text))
        await msg.notify.send(Note(answer))
        return answer


@attrs.frozen
class Block(afa.Request[int]):
    """Block this process's whole event loop (a torch step, a checkpoint load) for a while."""

    seconds: float


@attrs.frozen
class Count(afa.Request[int]):
    pass


@attrs.frozen
class Nap(afa.Request[int]):
    """Take a while without blocking the loop (an actor busy with one message)."""

    seconds: float


@attrs.frozen
class Gate(afa.Request[int]):
    """Hold the actor until the file ``path`` exists (the test opens the gate)."""

    path: str


class Busy(afa.Actor[Block | Count | Nap | Gate]):
    """Counts messages; naps or blocks its loop on request. Its state dies with its process."""

    def __init__(self) -> None:
        self.n = 0

    async def receive(self, msg: Block | Count | Nap | Gate, ctx: afa.ActorContext[Any]) -> int:
        self.n += 1
        if isinstance(msg, Block):
            time.sleep(msg.seconds)  # noqa: ASYNC251 (deliberately blocking: the loop stalls)
        elif isinstance(msg, Nap):
            await trio.sleep(msg.seconds)
        elif isinstance(msg, Gate):
            while not os.path.exists(msg.path):
                await trio.sleep(0.01)
        return self.n


class SlowStart(afa.Actor[Count]):
    """An actor whose start takes a while (an engine loading)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    async def on_start(self, ctx: afa.ActorContext[Count]) -> None:
        await trio.sleep(self.seconds)

    async def receive(self, msg: Count, ctx: afa.ActorContext[Count]) -> int:
        return 0


class Sink(afa.Actor[Any]):
    """Accepts anything; a mailbox of one (so every message needs its credit back)."""

    mailbox_size = 1

    def __init__(self) -> None:
        self.n = 0

    async def receive(self, msg: Any, ctx: afa.ActorContext[Any]) -> Any:
        self.n += 1
        if isinstance(msg, Count):
            return self.n
        return None
