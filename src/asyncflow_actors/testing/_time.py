"""Waiting in virtual time: settle the loop, advance a ``MockClock``, tell a hang from a result.

Under a ``trio.testing.MockClock`` nothing is random about *when* things happen, so a test can
ask precise questions: has everything that can happen without time passing happened
(``settle``)? What happens over the next ``dt`` seconds, timer by timer (``advance``)? Does this
call finish at all, or does it wait forever (``attempt``)?
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import attrs
import trio
import trio.lowlevel
import trio.testing

T = TypeVar("T")


async def settle() -> None:
    """Wait until every other task of the loop is blocked (nothing can run without time or I/O)."""
    await trio.testing.wait_all_tasks_blocked()


async def advance(clock: trio.testing.MockClock, seconds: float) -> None:
    """Move ``clock`` forward by ``seconds``, stopping at every deadline on the way.

    Each timer fires at its own time, and what it starts runs (the loop settles) before the next
    one: a timer that re-arms itself at ``t + 1`` fires again inside the window, exactly as it
    would in real time. A single ``clock.jump(seconds)`` would fire every expired timer at once,
    at the end.
    """
    if not seconds >= 0:
        raise ValueError(f"advance() takes seconds >= 0, got {seconds!r}")
    target = trio.current_time() + seconds
    while True:
        await settle()
        now = trio.current_time()
        wait = trio.lowlevel.current_statistics().seconds_to_next_deadline
        if math.isinf(wait) or now + wait > target:
            break
        clock.jump(max(wait, 0.0))
        await trio.lowlevel.checkpoint()  # let the expired timer's task run
    remaining = target - trio.current_time()
    if remaining > 0:
        clock.jump(remaining)
    await settle()


@attrs.frozen
class Returned(Generic[T]):
    """``attempt``: the call returned ``value``."""

    value: T


@attrs.frozen
class Raised:
    """``attempt``: the call raised ``error``."""

    error: BaseException


@attrs.frozen
class Blocked:
    """``attempt``: the call was still waiting once the loop had settled (it was cancelled)."""


Attempt = Returned[T] | Raised | Blocked


async def attempt(fn: Callable[..., Awaitable[T]], *args: Any) -> Attempt[T]:
    """Start ``fn(*args)``, let the loop settle, and report how it ended, or that it is stuck.

    A call still waiting once nothing else can run (no task runnable, no time passing) would wait
    forever in this state of the world: it is cancelled and reported as ``Blocked``. Use it for
    promises such as "no asker ever hangs" or "this send waits while the mailbox is full". Under
    an autojump clock time keeps moving, so ``Blocked`` then means "waits on I/O or forever".
    """
    result: list[Attempt[T]] = []

    async def go() -> None:
        try:
            result.append(Returned(await fn(*args)))
        except trio.Cancelled:
            raise
        except Exception as exc:
            result.append(Raised(exc))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(go)
        await settle()
        if not result:
            nursery.cancel_scope.cancel()
    return result[0] if result else Blocked()
