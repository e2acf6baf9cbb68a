"""``_Batcher``: what several tasks submit at about the same time, handed to one call.

The rollout scores the groups a decode step completes together in one worker-thread call and
writes them in one queue request; each submitter still gets its own result or error.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Generic, NoReturn, TypeVar

import attrs
import outcome
import trio

T = TypeVar("T")
R = TypeVar("R")


class _Batcher(Generic[T, R]):
    """Hands everything submitted since its last call to one call of ``fn``: the groups a
    decode step completes together are scored in one worker-thread call (one hop instead of
    one per group), and what is submitted while a call runs goes into the next one.

    Woken by a first item, it lets the tasks already runnable submit theirs before it calls:
    it yields to the scheduler until two yields in a row brought nothing new (at most
    ``settle`` yields). The groups of one decode stretch do not reach it in the same scheduler
    batch: a group's task returns from ``generate_many`` after a checkpoint per sample it still
    has to collect, and tasks of one batch run in random order.

    With ``overlap`` a call does not wait for the one before it to return (a call then takes
    what was submitted in one scheduler batch, plus ``settle``): for requests, where one slow
    call must not hold up the next ones.

    ``fn`` gets the items and returns one ``outcome.Outcome`` per item, in order, so that one
    item's failure is raised to its own submitter only. ``serve`` runs it (a task for the life
    of the host); a cancelled submitter abandons its result, nothing else.
    """

    def __init__(
        self,
        fn: Callable[[list[T]], Awaitable[list[outcome.Outcome[R]]]],
        settle: int = 0,
        overlap: bool = False,
    ) -> None:
        self._fn = fn
        self._settle = settle
        self._overlap = overlap
        self._queue: list[tuple[T, _Result[R]]] = []
        self._ready = trio.Event()
        self.calls = 0

    async def submit(self, item: T) -> R:
        """``fn``'s result for ``item`` (or its error), computed with whatever else is ready."""
        result: _Result[R] = _Result()
        self._queue.append((item, result))
        self._ready.set()
        await result.done.wait()
        assert result.value is not None
        return result.value.unwrap()

    async def serve(self) -> NoReturn:
        async with trio.open_nursery() as nursery:
            while True:
                await self._ready.wait()
                seen, quiet = len(self._queue), 0
                for _ in range(self._settle):
                    await trio.lowlevel.checkpoint()
                    quiet = quiet + 1 if len(self._queue) == seen else 0
                    seen = len(self._queue)
                    if quiet == 2:
                        break
                self._ready = trio.Event()
                taken, self._queue = self._queue, []
                self.calls += 1
                if self._overlap:
                    nursery.start_soon(self._call, taken)
                else:
                    await self._call(taken)
        raise AssertionError("unreachable")

    async def _call(self, taken: list[tuple[T, _Result[R]]]) -> None:
        try:
            values = await self._fn([item for item, _ in taken])
            if len(values) != len(taken):
                raise RuntimeError(f"{len(values)} results for {len(taken)} items")
        except Exception as exc:
            values = [outcome.Error(_failed(exc)) for _ in taken]
        for (_, result), value in zip(taken, values, strict=True):
            result.value = value
            result.done.set()


class _BatchFailed(RuntimeError):
    """A batched call failed as a whole (each submitter gets its own error, chained to it)."""


def _failed(exc: Exception) -> _BatchFailed:
    error = _BatchFailed(f"a batched call failed: {exc!r}")
    error.__cause__ = exc
    return error


@attrs.define(eq=False)
class _Result(Generic[R]):
    done: trio.Event = attrs.Factory(trio.Event)
    value: outcome.Outcome[R] | None = None
