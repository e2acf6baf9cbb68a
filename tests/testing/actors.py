"""Actors the kit's tests run locally and on nodes (importable by node processes)."""

from __future__ import annotations

from typing import Any

import attrs
import trio

import asyncflow_actors as afa
from asyncflow_actors.testing import faulty


@attrs.frozen
class Add:
    n: int


@attrs.frozen
class Total(afa.Request[int]):
    pass


@attrs.frozen
class Echo(afa.Request[Any]):
    value: Any


@attrs.frozen
class Hold(afa.Request[str]):
    seconds: float


CounterMsg = Add | Total | Echo | Hold


class Counter(afa.Actor[CounterMsg]):
    """Adds, reports its total, echoes, or sleeps on request; ``start`` is its first total."""

    def __init__(self, start: int = 0) -> None:
        self.total = start

    async def receive(self, msg: CounterMsg, ctx: afa.ActorContext[CounterMsg]) -> Any:
        if isinstance(msg, Add):
            self.total += msg.n
            return None
        if isinstance(msg, Total):
            return self.total
        if isinstance(msg, Hold):
            await trio.sleep(msg.seconds)
            return "held"
        return msg.value


FaultyCounter = faulty(Counter)


# -- a delivery protocol with a planted bug: the receiver must be idempotent --------------------


@attrs.frozen
class Deliver(afa.Request[None]):
    """Store ``item`` under sequence number ``seq`` (retried by the sender until acked)."""

    seq: int
    item: int


class Receiver(afa.Actor[Deliver]):
    """Appends delivered items to a durable ``store`` (it outlives crashes) and acks.

    A crash after storing but before the ack (a lost ack) makes the sender retry: an idempotent
    receiver skips a ``seq`` it already stored. ``idempotent=False`` is the planted bug.
    """

    def __init__(self, store: list[tuple[int, int]], idempotent: bool = True) -> None:
        self.store = store
        self.idempotent = idempotent

    async def receive(self, msg: Deliver, ctx: afa.ActorContext[Deliver]) -> None:
        if self.idempotent and any(seq == msg.seq for seq, _ in self.store):
            return
        self.store.append((msg.seq, msg.item))


FaultyReceiver = faulty(Receiver)


async def deliver(ref: afa.ActorRef[Deliver], seq: int, item: int, *, tries: int = 10) -> None:
    """The sender's side: ask until acked (a crashed receiver is restarted by its supervisor)."""
    for _ in range(tries):
        try:
            await ref.ask(Deliver(seq, item))
            return
        except afa.ActorCrashed:
            continue
    raise AssertionError(f"item {seq} not acked after {tries} tries")


# -- a node-to-node conversation (the link proxy's routing tests) ------------------------------


@attrs.frozen
class AskTotal(afa.Request[int | str]):
    """Ask ``counter`` (an actor elsewhere) for its total; a failure comes back as its name."""

    counter: afa.ActorRef[Any]


class Asker(afa.Actor[AskTotal]):
    async def receive(self, msg: AskTotal, ctx: afa.ActorContext[AskTotal]) -> int | str:
        try:
            return await msg.counter.ask(Total())
        except afa.ActorCrashed as exc:
            return type(exc.error).__name__
