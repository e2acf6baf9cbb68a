"""FlowControl: capacity, FIFO grants, checkpoints, cancellation atomicity."""

from __future__ import annotations

import functools

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from asyncflow_actors import testing as aft
from asyncflow_actors.transfer_queue import (
    CapacityError,
    FlowControl,
    FlowControlError,
    FlowControlStatistics,
    InvalidArgument,
)


def test_capacity_is_staleness_plus_one_batches() -> None:
    assert FlowControl(staleness=0, batch_size=8).capacity == 8
    assert FlowControl(staleness=2, batch_size=8).capacity == 24
    with pytest.raises(InvalidArgument, match="staleness must be an int >= 0, got -1"):
        FlowControl(staleness=-1, batch_size=8)
    with pytest.raises(InvalidArgument, match="batch_size must be an int >= 1, got 0"):
        FlowControl(staleness=0, batch_size=0)


def test_nowait_and_release() -> None:
    fc = FlowControl(staleness=0, batch_size=4)
    fc.acquire_nowait(3)
    with pytest.raises(trio.WouldBlock):
        fc.acquire_nowait(2)
    fc.acquire_nowait(1)
    with pytest.raises(FlowControlError, match="cannot release 5 slots: only 4 are in flight"):
        fc.release(5)
    assert fc.in_flight == 4  # unchanged
    fc.release(4)
    with pytest.raises(CapacityError, match="more than the capacity 4"):
        fc.acquire_nowait(5)
    with pytest.raises(InvalidArgument, match="n must be an int >= 1, got 0"):
        fc.acquire_nowait(0)
    with pytest.raises(InvalidArgument):
        fc.release(0)
    assert fc.statistics() == FlowControlStatistics(
        capacity=4,
        in_flight=0,
        available=4,
        waiters=0,
        waiting_slots=0,
        total_acquired=4,
        total_released=4,
    )


async def test_acquire_is_a_checkpoint_even_when_it_does_not_wait() -> None:
    fc = FlowControl(staleness=1, batch_size=2)
    with trio.testing.assert_checkpoints():
        await fc.acquire(2)
    assert fc.in_flight == 2


async def test_acquire_more_than_capacity_fails_at_once() -> None:
    fc = FlowControl(staleness=0, batch_size=2)
    with pytest.raises(CapacityError):
        await fc.acquire(3)
    assert fc.statistics().waiters == 0


async def test_a_cancelled_acquire_holds_nothing(autojump_clock: trio.testing.MockClock) -> None:
    fc = FlowControl(staleness=0, batch_size=2)
    fc.acquire_nowait(2)
    with trio.CancelScope() as scope:
        scope.cancel()
        await fc.acquire(1)  # cancelled before it could even try
    assert fc.in_flight == 2
    with trio.move_on_after(1) as scope:
        await fc.acquire(1)
    assert scope.cancelled_caught and fc.in_flight == 2 and fc.statistics().waiters == 0


async def test_large_requests_are_not_starved_by_small_ones(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fc = FlowControl(staleness=1, batch_size=2)  # capacity 4
    fc.acquire_nowait(3)
    order: list[str] = []

    async def take(name: str, n: int) -> None:
        await fc.acquire(n)
        order.append(name)

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(take, "big", 3)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(take, "small", 1)
            await trio.testing.wait_all_tasks_blocked()
            assert order == []  # 1 slot is free, but "big" is ahead: no barging
            with pytest.raises(trio.WouldBlock):
                fc.acquire_nowait(1)
            fc.release(2)  # 3 free: "big" goes; "small" now waits for a slot
            await trio.testing.wait_all_tasks_blocked()
            assert order == ["big"] and fc.in_flight == 4
            fc.release(1)
    assert order == ["big", "small"] and fc.in_flight == 4


async def test_cancelling_the_head_waiter_lets_the_next_ones_through() -> None:
    fc = FlowControl(staleness=0, batch_size=4)
    fc.acquire_nowait(2)
    got: list[str] = []
    head = trio.CancelScope()

    async def take(name: str, n: int, scope: trio.CancelScope) -> None:
        with scope:
            await fc.acquire(n)
            got.append(name)

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(take, "head", 4, head)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(take, "next", 2, trio.CancelScope())
            await trio.testing.wait_all_tasks_blocked()
            assert got == []  # "next" fits, but waits behind "head"
            head.cancel()
    assert got == ["next"] and fc.in_flight == 4


# A schedule of operations replayed in one trio.run and checked against the kit's strict-FIFO
# model (``aft.FlowControlModel``) after each: grants, in flight, waiters, waiting slots.
@given(staleness=st.integers(0, 2), batch=st.integers(1, 3), ops=aft.flow_control_ops())
@aft.protocol_settings(max_examples=300)
def test_flow_control_schedules(staleness: int, batch: int, ops: list[tuple[str, int]]) -> None:
    make = functools.partial(FlowControl, staleness=staleness, batch_size=batch)
    aft.run_deterministic(aft.check_flow_control_schedule, make, ops)
