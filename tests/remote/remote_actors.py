"""Actors the remote tests spawn on nodes (importable by the node processes).

No torch at import: a node spawning these starts in under a second instead of several (torch's
import is most of a node's start-up); a node that receives tensors imports it as it decodes them.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import attrs
import trio

import asyncflow_actors as afa

if TYPE_CHECKING:
    import torch


@attrs.frozen
class Echo(afa.Request[Any]):
    value: Any


@attrs.frozen
class Add:
    n: int


@attrs.frozen
class Total(afa.Request[int]):
    pass


@attrs.frozen
class Pid(afa.Request[int]):
    pass


@attrs.frozen
class Fail(afa.Request[None]):
    message: str


@attrs.frozen
class Reject(afa.Request[None]):
    message: str


@attrs.frozen
class Hold(afa.Request[str]):
    seconds: float


@attrs.frozen
class Exit(afa.Request[None]):
    pass


@attrs.frozen
class Batch:
    tokens: torch.Tensor
    mask: torch.Tensor
    meta: dict[str, int]


@attrs.frozen
class Sum(afa.Request[Batch]):
    batch: Batch


@attrs.frozen
class Config:
    scale: int = 1


WorkerMsg = Echo | Add | Total | Pid | Fail | Reject | Hold | Exit | Sum


class Worker(afa.Actor[WorkerMsg]):
    """Echoes, counts, fails, sleeps, exits its process, or sums tensors on request."""

    def __init__(self, start: int = 0, config: Config | None = None) -> None:
        self.total = start
        self.scale = config.scale if config is not None else 1

    async def receive(self, msg: WorkerMsg, ctx: afa.ActorContext[WorkerMsg]) -> Any:
        if isinstance(msg, Echo):
            return msg.value
        if isinstance(msg, Add):
            self.total += msg.n * self.scale
        elif isinstance(msg, Total):
            return self.total
        elif isinstance(msg, Pid):
            return os.getpid()
        elif isinstance(msg, Fail):
            raise RuntimeError(msg.message)
        elif isinstance(msg, Reject):
            ctx.reply_error(ValueError(msg.message))
        elif isinstance(msg, Hold):
            await trio.sleep(msg.seconds)
            return "held"
        elif isinstance(msg, Exit):
            os._exit(3)
        elif isinstance(msg, Sum):
            b = msg.batch
            return Batch(
                b.tokens.sum(dim=-1, keepdim=True), b.mask.all(dim=-1, keepdim=True), b.meta
            )
        return None


class Slow(afa.Actor[Add | Total]):
    """A small mailbox and a slow receive: for cross-process backpressure."""

    mailbox_size = 2

    def __init__(self) -> None:
        self.total = 0

    async def receive(self, msg: Add | Total, ctx: afa.ActorContext[Add | Total]) -> Any:
        if isinstance(msg, Add):
            await trio.sleep(0.05)
            self.total += msg.n
            return None
        return self.total
