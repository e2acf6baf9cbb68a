"""``FlowControlModel``: strict-FIFO counted admission, and a schedule checker for any limiter.

The model states what ``FlowControl`` promises: requests are granted in arrival order (a large
request is never overtaken by later small ones), ``acquire_nowait`` never barges past waiters,
a cancelled waiter holds nothing and lets the ones behind it through, releasing more than is in
flight is an error that changes nothing. ``check_flow_control_schedule`` replays a schedule
against any object with ``FlowControl``'s interface (a wrapper, a distributed admission actor's
local proxy...) and compares it with the model after every operation.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

import trio
import trio.testing
from hypothesis import strategies as st

from ..transfer_queue import CapacityError, FlowControlError, FlowControlStatistics


class FlowControlLike(Protocol):
    """What the checker drives: ``FlowControl``'s interface."""

    @property
    def capacity(self) -> int: ...

    async def acquire(self, n: int) -> None: ...

    def acquire_nowait(self, n: int) -> None: ...

    def release(self, n: int) -> None: ...

    def statistics(self) -> FlowControlStatistics: ...


class FlowControlModel:
    """The expected state of a strict-FIFO counted limiter of ``capacity`` slots."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_flight = 0
        self.queue: deque[tuple[int, int]] = deque()  # waiting (request id, n), arrival order
        self.granted: set[int] = set()  # request ids granted after waiting

    def _grant_heads(self) -> None:
        while self.queue and self.queue[0][1] <= self.capacity - self.in_flight:
            rid, n = self.queue.popleft()
            self.in_flight += n
            self.granted.add(rid)

    def acquire(self, rid: int, n: int) -> None:
        """Request ``rid`` asks for ``n`` slots (``n <= capacity``): granted now or queued."""
        assert n <= self.capacity
        self.queue.append((rid, n))
        self._grant_heads()

    def acquire_nowait(self, n: int) -> bool:
        """Whether ``acquire_nowait(n)`` succeeds (and then it holds the slots)."""
        if self.queue or n > self.capacity - self.in_flight:
            return False
        self.in_flight += n
        return True

    def cancel(self, rid: int) -> None:
        """Waiting request ``rid`` is cancelled: it holds nothing; the ones behind may go."""
        self.queue.remove(next(w for w in self.queue if w[0] == rid))
        self._grant_heads()

    def release(self, n: int) -> bool:
        """Whether ``release(n)`` is valid (and then it frees the slots)."""
        if n > self.in_flight:
            return False
        self.in_flight -= n
        self._grant_heads()
        return True

    def waiting(self) -> list[int]:
        return [rid for rid, _ in self.queue]

    def check(self, stats: FlowControlStatistics) -> None:
        assert stats.capacity == self.capacity
        assert stats.in_flight == self.in_flight <= self.capacity, (stats, self.in_flight)
        assert stats.waiters == len(self.queue), (stats, list(self.queue))
        assert stats.waiting_slots == sum(n for _, n in self.queue)
        assert stats.total_acquired - stats.total_released == stats.in_flight


Op = tuple[str, int]


def flow_control_ops(max_n: int = 6, max_size: int = 40) -> st.SearchStrategy[list[Op]]:
    """Schedules of ``("acquire" | "nowait" | "release", n)`` and ``("cancel", k)`` operations."""
    return st.lists(
        st.one_of(
            st.tuples(st.just("acquire"), st.integers(1, max_n)),
            st.tuples(st.just("cancel"), st.integers(0, 20)),
            st.tuples(st.just("release"), st.integers(1, max_n)),
            st.tuples(st.just("nowait"), st.integers(1, max_n)),
        ),
        max_size=max_size,
    )


class _Checker:
    def __init__(self, fc: FlowControlLike, nursery: trio.Nursery) -> None:
        self.fc = fc
        self.nursery = nursery
        self.model = FlowControlModel(fc.capacity)
        self.actual: set[int] = set()  # request ids whose acquire returned
        self.scopes: dict[int, trio.CancelScope] = {}

    async def waiter(self, rid: int, n: int, scope: trio.CancelScope) -> None:
        with scope:
            await self.fc.acquire(n)
            self.actual.add(rid)

    async def apply(self, rid: int, op: str, arg: int) -> None:
        fc, model = self.fc, self.model
        if op == "acquire":
            if arg > model.capacity:
                try:
                    await fc.acquire(arg)
                except CapacityError:
                    return
                raise AssertionError(f"acquire({arg}) above capacity {model.capacity} returned")
            self.scopes[rid] = trio.CancelScope()
            self.nursery.start_soon(self.waiter, rid, arg, self.scopes[rid])
            model.acquire(rid, arg)
        elif op == "nowait":
            if arg > model.capacity:
                return
            expected = model.acquire_nowait(arg)
            try:
                fc.acquire_nowait(arg)
            except trio.WouldBlock:
                assert not expected, f"acquire_nowait({arg}) blocked; the model grants it"
            else:
                assert expected, f"acquire_nowait({arg}) barged past waiters or capacity"
        elif op == "cancel":
            waiting = model.waiting()
            if waiting:
                victim = waiting[0] if arg % 2 else waiting[arg % len(waiting)]
                self.scopes[victim].cancel()
                model.cancel(victim)
        elif op == "release":
            valid = model.release(arg)
            try:
                fc.release(arg)
            except FlowControlError:
                assert not valid, f"release({arg}) refused with {model.in_flight} in flight"
            else:
                assert valid, f"release({arg}) accepted with only {model.in_flight} in flight"
        else:
            raise ValueError(f"unknown operation {op!r}")

    def check(self, op: str, arg: int) -> None:
        assert self.actual == self.model.granted, (
            f"after {op} {arg}: granted {sorted(self.actual)}, "
            f"expected {sorted(self.model.granted)}"
        )
        self.model.check(self.fc.statistics())


async def check_flow_control_schedule(
    make: Callable[[], FlowControlLike], ops: Sequence[Op]
) -> None:
    """Replay ``ops`` on ``make()`` in the current loop, checking it against the model.

    ``acquire`` starts a waiter task; ``cancel k`` cancels a waiting request (the head when
    ``k`` is odd: a cancelled head must let the next ones through); errors must be
    ``CapacityError`` (more than the capacity) and ``FlowControlError`` (releasing more than is
    in flight). A broken promise raises ``AssertionError``. Run it under an autojump clock
    (``run_deterministic``).
    """
    failure: AssertionError | None = None
    async with trio.open_nursery() as nursery:
        checker = _Checker(make(), nursery)
        try:
            for rid, (op, arg) in enumerate(ops):
                await checker.apply(rid, op, arg)
                await trio.testing.wait_all_tasks_blocked()
                checker.check(op, arg)
        except AssertionError as exc:  # raised bare, not wrapped in the nursery's group
            failure = exc
        nursery.cancel_scope.cancel()
    if failure is not None:
        raise failure
