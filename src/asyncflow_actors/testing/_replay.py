"""Deterministic runs and schedule replay.

A schedule is a list of operations generated up front by a hypothesis strategy and replayed in
one ``trio.run``: ``replay`` runs each step, lets the loop settle, checks the invariants, and
names the step in the error when one fails. ``run_deterministic`` runs a whole async function
under virtual time with trio's scheduler seeded, so that a failing example runs again exactly the
same way: same task steps in the same order at the same virtual times (``TaskTrace`` records
them, to compare two runs).

What is deterministic: everything in one process under a ``MockClock`` (local actors, supervision,
the TransferQueue with local units). What is not: real I/O (node processes, sockets) and a
real clock; Python's hash randomization of ``str`` (``PYTHONHASHSEED``) if your code iterates
over sets of strings.
"""

from __future__ import annotations

import inspect
import random
import re
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import attrs
import trio
import trio.testing

from ._time import settle

T = TypeVar("T")
Op = TypeVar("Op")
E = TypeVar("E", bound=BaseException)

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def seed_scheduler(seed: int) -> None:
    """Make trio's task scheduling a function of ``seed`` (for runs started after this call).

    trio shuffles each batch of runnable tasks with a module-level RNG so that code does not come
    to rely on an order; under hypothesis that RNG is seeded per example and the batch is sorted
    first (trio's own hypothesis plugin). This does the same outside hypothesis.
    """
    from trio._core import _run  # private, but the supported way trio's own tests pin it

    if not hasattr(_run, "_r"):  # pragma: no cover - a trio without the scheduler RNG
        raise RuntimeError("this trio version has no scheduler RNG to seed")
    _run._ALLOW_DETERMINISTIC_SCHEDULING = True  # type: ignore[misc]
    _run._r.seed(seed)


@attrs.frozen
class TraceStep:
    time: float
    task: str


class TaskTrace(trio.abc.Instrument):
    """A trio instrument that records every task step: ``(virtual time, task name)``.

    Two runs of the same seeded, virtual-time program give equal ``steps``; the first index
    where they differ is where determinism broke. Memory addresses in task names are erased.
    """

    def __init__(self) -> None:
        self._steps: list[TraceStep] = []

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._steps.append(TraceStep(trio.current_time(), _ADDRESS.sub("", task.name)))

    @property
    def steps(self) -> tuple[TraceStep, ...]:
        return tuple(self._steps)

    def first_difference(self, other: TaskTrace) -> int | None:
        """The index of the first step where the traces differ (``None``: identical)."""
        for k, (mine, theirs) in enumerate(zip(self._steps, other._steps, strict=False)):
            if mine != theirs:
                return k
        if len(self._steps) != len(other._steps):
            return min(len(self._steps), len(other._steps))
        return None


def run_deterministic(
    fn: Callable[..., Awaitable[T]],
    *args: Any,
    seed: int = 0,
    clock: trio.abc.Clock | None = None,
    instruments: Iterable[trio.abc.Instrument] = (),
) -> T:
    """``trio.run(fn, *args)`` under virtual time with the scheduler and ``random`` seeded.

    ``clock`` defaults to a ``MockClock`` that jumps whenever every task is blocked
    (``autojump_threshold=0``): timeouts, backoffs, lease expiries take no real time. The global
    ``random`` module is seeded with ``seed`` for the run and restored afterwards.
    """
    saved = random.getstate()
    seed_scheduler(seed)
    random.seed(seed)
    try:
        chosen = clock if clock is not None else trio.testing.MockClock(autojump_threshold=0)
        return trio.run(fn, *args, clock=chosen, instruments=tuple(instruments))
    finally:
        random.setstate(saved)


def find_exception(error: BaseException, kind: type[E]) -> E | None:
    """The first ``kind`` exception in ``error`` or, depth first, in its exception groups.

    A failure inside an ``open_actor_system`` block (or any nursery) surfaces wrapped in an
    ``ExceptionGroup``; this digs the assertion (or the error you expect) out of it.
    """
    if isinstance(error, kind):
        return error
    for inner in getattr(error, "exceptions", ()):
        if isinstance(inner, BaseException):
            found = find_exception(inner, kind)
            if found is not None:
                return found
    return None


def _note(error: BaseException, text: str) -> None:
    add_note = getattr(error, "add_note", None)  # Python >= 3.11
    if add_note is not None:
        add_note(text)


async def replay(
    schedule: Iterable[Op],
    step: Callable[[Op], Awaitable[object]],
    *,
    check: Callable[[], object] | None = None,
    settle_after: bool = True,
) -> None:
    """Run ``step(op)`` for each operation of ``schedule``, in order, inside the current loop.

    After each step the loop settles (every task blocked) and ``check()`` runs (sync or async):
    put the invariants there. An exception from a step or a check gets a note naming the step,
    e.g. ``replay: step 4 of 9 failed: ('crash', 1)``; hypothesis prints the shrunk schedule.
    """
    ops = list(schedule)
    for k, op in enumerate(ops, start=1):
        where = "step"
        try:
            await step(op)
            if settle_after:
                await settle()
            where = "check after step"
            if check is not None:
                result = check()
                if inspect.isawaitable(result):
                    await result
        except trio.Cancelled:
            raise
        except BaseException as exc:
            _note(exc, f"replay: {where} {k} of {len(ops)} failed: {op!r}")
            raise
