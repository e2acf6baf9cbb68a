"""The controller's timer: one task that sleeps until the state's next deadline (internal)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs
import trio

from .._runtime import ActorContext


@attrs.frozen
class Tick:
    """Self-message from the timer: expire what is due."""


class Timer:
    """Sends ``Tick`` to its actor when ``next_deadline()`` (the state's) is due."""

    def __init__(self, next_deadline: Callable[[], float | None]) -> None:
        self._next_deadline = next_deadline
        self._wake = trio.Event()
        self._at = math.inf  # the deadline the timer sleeps until

    def deadline(self, at: float) -> None:
        """Something new is due at ``at``: wake the timer if it sleeps past that. (Deadlines
        that go away need no wake-up: the timer then wakes early, finds nothing due and
        sleeps again.)"""
        if at < self._at:
            self._wake.set()

    async def run(self, ctx: ActorContext[Any]) -> None:
        while True:
            self._wake = trio.Event()
            deadline = self._next_deadline()
            self._at = deadline if deadline is not None else math.inf
            with trio.move_on_at(self._at):
                await self._wake.wait()
                continue
            await ctx.self.send(Tick())
