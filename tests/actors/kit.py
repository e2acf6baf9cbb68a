"""Small actors shared by the runtime tests."""

from __future__ import annotations

from typing import Any

import attrs
import trio

import asyncflow_actors as afa


@attrs.frozen
class Add:
    n: int


@attrs.frozen
class Get(afa.Request[int]):
    pass


@attrs.frozen
class Crash(afa.Request[None]):
    """Raise inside receive (the actor crashes)."""


@attrs.frozen
class Sleep(afa.Request[str]):
    seconds: float


@attrs.frozen
class Exit:
    """Call ctx.stop_self() (a normal exit)."""


CounterMsg = Add | Get | Crash | Sleep | Exit


class Boom(Exception):
    pass


class Counter(afa.Actor[CounterMsg]):
    """Counts, sleeps, crashes or exits on request; logs its lifecycle into ``log``."""

    def __init__(self, log: list[str] | None = None, tag: str = "") -> None:
        self.n = 0
        self.log = log if log is not None else []
        self.tag = tag

    async def on_start(self, ctx: afa.ActorContext[CounterMsg]) -> None:
        self.log.append(f"start {self.tag or ctx.name}")

    async def receive(self, msg: CounterMsg, ctx: afa.ActorContext[CounterMsg]) -> Any:
        if isinstance(msg, Add):
            self.n += msg.n
        elif isinstance(msg, Get):
            return self.n
        elif isinstance(msg, Crash):
            raise Boom(f"crash requested in {ctx.name}")
        elif isinstance(msg, Sleep):
            await trio.sleep(msg.seconds)
            return "slept"
        elif isinstance(msg, Exit):
            ctx.stop_self()
        return None

    async def on_stop(self, ctx: afa.ActorContext[CounterMsg], error: BaseException | None) -> None:
        self.log.append(f"stop {self.tag or ctx.name}" + (" crashed" if error else ""))
