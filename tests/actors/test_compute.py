"""``ComputeLane``: blocking calls off the event loop, one at a time, safe to abandon."""

from __future__ import annotations

import threading
import time

import pytest
import trio

import asyncflow_actors as afa


async def test_the_loop_stays_responsive_while_the_lane_computes() -> None:
    lane = afa.ComputeLane()
    gaps: list[float] = []

    async def ticker(task_status: trio.TaskStatus[None]) -> None:
        task_status.started()
        last = trio.current_time()
        while True:
            await trio.sleep(0.005)
            now = trio.current_time()
            gaps.append(now - last)
            last = now

    async with trio.open_nursery() as nursery:
        await nursery.start(ticker)
        assert await lane.run(time.sleep, 0.3) is None  # a blocking "torch step"
        nursery.cancel_scope.cancel()
    assert len(gaps) > 20  # the loop kept running meanwhile


async def test_an_abandoned_call_finishes_before_the_next_starts() -> None:
    lane = afa.ComputeLane()
    inside = 0
    overlaps = 0
    lock = threading.Lock()

    def step(seconds: float) -> str:
        nonlocal inside, overlaps
        with lock:
            inside += 1
            overlaps += inside > 1
        time.sleep(seconds)
        with lock:
            inside -= 1
        return "done"

    with trio.move_on_after(0.05):
        await lane.run(step, 0.3)  # the caller gives up; the call goes on in its thread
    t0 = trio.current_time()
    assert await lane.run(step, 0.0) == "done"
    assert trio.current_time() - t0 >= 0.2  # it waited for the abandoned call
    assert overlaps == 0
    assert lane.statistics().calls == 2


async def test_errors_come_back_to_the_caller() -> None:
    def boom() -> None:
        raise ValueError("in the thread")

    with pytest.raises(ValueError, match="in the thread"):
        await afa.ComputeLane().run(boom)
