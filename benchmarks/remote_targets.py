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
