"""Heavy compute off the event loop: ``ComputeLane`` runs blocking calls in a worker thread.

The runtime's rule (``docs/actors.md``): a torch step, a decode loop, a weight load — anything
that holds the thread for more than a few milliseconds — never runs on the trio thread of a
process that hosts other actors, their links and their liveness. It runs in a worker thread (here)
or in a node process of its own.

A lane runs one call at a time, in order. A cancelled caller returns at once; its call goes on in
its thread to the end (a thread cannot be interrupted) and its result is dropped, but the lane's
next call starts only after it finished: two calls of one lane never overlap, so a model or an
optimizer used by one lane is never touched by two threads at once.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

import attrs
import trio

if sys.version_info >= (3, 11):
    from typing import TypeVarTuple, Unpack
else:  # pragma: no cover
    from typing_extensions import TypeVarTuple, Unpack

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


@attrs.frozen
class ComputeStatistics:
    """Calls run so far, calls waiting for the lane, and whether one is running now."""

    calls: int
    waiting: int
    busy: bool


class ComputeLane:
    """One worker-thread lane for blocking calls (see the module docstring)."""

    def __init__(self, name: str = "compute") -> None:
        self.name = name
        self._limiter = trio.CapacityLimiter(1)
        self._calls = 0

    async def run(self, fn: Callable[[Unpack[Ts]], T], *args: Unpack[Ts]) -> T:
        """Run ``fn(*args)`` in the lane's thread and return its result (or raise its error)."""
        self._calls += 1
        return await trio.to_thread.run_sync(
            fn, *args, abandon_on_cancel=True, limiter=self._limiter, thread_name=self.name
        )

    def statistics(self) -> ComputeStatistics:
        stats = self._limiter.statistics()
        return ComputeStatistics(self._calls, stats.tasks_waiting, stats.borrowed_tokens > 0)
