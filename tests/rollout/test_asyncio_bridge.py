"""The asyncio thread vLLM runs on: a call never waits on a loop that has stopped."""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest
import trio

from asyncflow_actors.rollout._asyncio_bridge import AsyncioThread


def test_a_call_the_stopping_loop_never_ran_is_cancelled_not_left_pending() -> None:
    # submitted as the loop stops: its callback is dropped when the loop closes; the future
    # is cancelled then (a shielded trio caller waiting on it hung a run's stop)
    bridge = AsyncioThread()
    bridge.start()
    late: list[concurrent.futures.Future[int]] = []

    async def answer() -> int:
        return 1

    async def stop_then_submit() -> None:
        asyncio.get_running_loop().stop()
        late.append(bridge.submit(answer))

    bridge.submit(stop_then_submit)
    bridge._thread.join(10)
    assert not bridge._thread.is_alive()
    assert len(late) == 1 and late[0].cancelled()
    with pytest.raises(RuntimeError, match="has stopped"):
        bridge.submit(answer)


async def test_a_trio_call_after_the_stop_fails_at_once() -> None:
    bridge = AsyncioThread()
    bridge.start()

    async def answer() -> int:
        return 1

    assert await bridge.call(answer) == 1
    bridge.stop()
    with trio.fail_after(5), pytest.raises(RuntimeError, match="has stopped"):
        await bridge.call(answer)
