"""Actors the node-fault tests place on nodes; this module imports no torch, so that a node
restarted many times starts (and respawns them) in well under a second."""

from __future__ import annotations

from typing import Any

import attrs
import trio

import asyncflow_actors as afa


@attrs.frozen
class Hi(afa.Request[str]):
    text: str


class Hello(afa.Actor[Hi]):
    """Answers ``Hi`` with its name and the text."""

    async def receive(self, msg: Hi, ctx: afa.ActorContext[Hi]) -> str:
        await trio.lowlevel.checkpoint()
        return f"{ctx.name}:{msg.text}"


@attrs.frozen
class Forward(afa.Request[str]):
    """Ask ``target`` a ``Hi`` and reply with its answer (a node reaching another node)."""

    target: afa.ActorRef[Hi]
    text: str


class Forwarder(afa.Actor[Forward]):
    async def receive(self, msg: Forward, ctx: afa.ActorContext[Any]) -> str:
        return await msg.target.ask(Hi(msg.text))


@attrs.frozen
class Watch(afa.Request[None]):
    """Watch ``target``; ``Heard`` then replies with what its ``Terminated`` said."""

    target: afa.ActorRef[Any]


@attrs.frozen
class Heard(afa.Request[str]):
    """Wait for the watched actor's ``Terminated``; reply with its error's type name."""


@attrs.frozen
class Seen(afa.Request[str]):
    """Reply at once with the watched actor's ``Terminated`` error's type name ("" before it:
    ``Heard`` blocks the watcher's loop, so it must come after the ``Terminated``)."""


class Watcher(afa.Actor[Watch | Heard | Seen | afa.Terminated]):
    """Watches one actor; ``Heard`` waits until its ``Terminated`` arrived, ``Seen`` does not."""

    def __init__(self) -> None:
        self.heard = trio.Event()
        self.error = ""

    async def receive(
        self, msg: Watch | Heard | Seen | afa.Terminated, ctx: afa.ActorContext[Any]
    ) -> Any:
        if isinstance(msg, Watch):
            ctx.watch(msg.target)
        elif isinstance(msg, afa.Terminated):
            self.error = type(msg.error).__name__
            self.heard.set()
        elif isinstance(msg, Seen):
            await trio.lowlevel.checkpoint()
            return self.error
        else:
            await self.heard.wait()
            return self.error
        await trio.lowlevel.checkpoint()
        return None


@attrs.frozen
class Poll(afa.Request[str]):
    """Ask ``target`` a ``Hi`` (within ``within`` s); reply with its answer, or the error."""

    target: afa.ActorRef[Hi]
    text: str
    within: float = 2.0


class Poller(afa.Actor[Poll]):
    """Asks another node's actor and survives its failures (they are the answer)."""

    async def receive(self, msg: Poll, ctx: afa.ActorContext[Any]) -> str:
        try:
            with trio.fail_after(msg.within):
                return await msg.target.ask(Hi(msg.text))
        except (afa.ActorCrashed, trio.TooSlowError) as exc:
            return f"error: {exc!r}"
