"""Fault injection for the TransferQueue actor tests: a tapping ref, and crashing an actor."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio

import asyncflow_actors as afa


class Tap(afa.ActorRef[Any]):
    """A ref that awaits ``hook(msg)`` before passing a message on (fault injection)."""

    def __init__(self, ref: afa.ActorRef[Any], hook: Callable[[Any], Awaitable[None]]) -> None:
        self.ref = ref
        self.hook = hook

    @property
    def name(self) -> str:
        return self.ref.name

    async def send(self, msg: Any) -> None:
        await self.hook(msg)
        await self.ref.send(msg)

    def send_nowait(self, msg: Any) -> None:
        self.ref.send_nowait(msg)

    async def send_tracked(self, msg: Any) -> afa.Tracker:
        await self.hook(msg)
        return await self.ref.send_tracked(msg)

    async def ask(self, request: Any) -> Any:
        await self.hook(request)
        return await self.ref.ask(request)

    async def stop(self) -> None:
        await self.ref.stop()

    def statistics(self) -> Any:
        return self.ref.statistics()

    def _watch(self, watcher: Any) -> None:
        self.ref._watch(watcher)

    def _unwatch(self, watcher: Any) -> None:
        self.ref._unwatch(watcher)


def fail(ref: Any, why: str = "injected") -> int:
    """Crash a local actor at its next message boundary; returns its restart count before."""
    before: int = ref.statistics().restarts
    ref._cell.fail(RuntimeError(why))
    return before


async def restarted(ref: Any, before: int) -> None:
    """Wait until a local actor's supervisor restarted it (past ``before`` restarts)."""
    with trio.fail_after(30):
        while ref.statistics().restarts == before:
            await trio.sleep(0.005)


async def crash(ref: Any) -> None:
    """Crash a local actor and wait until its supervisor restarted it."""
    await restarted(ref, fail(ref))
