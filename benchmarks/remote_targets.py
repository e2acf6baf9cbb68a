"""Actors that benchmarks spawn on node processes (a module the nodes can import)."""

from __future__ import annotations

from typing import Any

import attrs
import torch

import asyncflow_actors as afa


@attrs.frozen
class Ping(afa.Request[bytes]):
    payload: bytes


@attrs.frozen
class Blob:
    tensors: tuple[torch.Tensor, ...]


class Sink(afa.Actor[Ping | Blob]):
    """Answers pings; counts the bytes of blobs it receives."""

    def __init__(self) -> None:
        self.received = 0

    async def receive(self, msg: Ping | Blob, ctx: afa.ActorContext[Ping | Blob]) -> Any:
        if isinstance(msg, Blob):
            self.received += sum(t.numel() * t.element_size() for t in msg.tensors)
            return None
        return msg.payload


@attrs.frozen
class Push(afa.Request[float]):
    """Tell ``n`` blobs of ``mib`` MiB to ``sink`` (then ask it once); reply the seconds taken."""

    sink: afa.ActorRef[Ping | Blob]
    n: int
    mib: int


class Pusher(afa.Actor[Push]):
    """Sends tensors to another node's actor, node to node (the driver only gives the order)."""

    async def receive(self, msg: Push, ctx: afa.ActorContext[Push]) -> float:
        import time

        quarter = msg.mib * (1 << 20) // 16  # float32 values in a quarter of the blob
        blob = Blob(tuple(torch.randn(quarter) for _ in range(4)))
        await msg.sink.send(blob)
        await msg.sink.ask(Ping(b"warm"))
        t0 = time.perf_counter()
        for _ in range(msg.n):
            await msg.sink.send(blob)
        await msg.sink.ask(Ping(b"done"))
        return time.perf_counter() - t0
