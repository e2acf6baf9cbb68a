"""TrioThread: calls into a loop in a helper thread, virtual time, and teardown after failures."""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import time

import pytest
import trio
import trio.testing

import asyncflow_actors as afa
from asyncflow_actors.testing import (
    Blocked,
    CallTimeout,
    CrashAt,
    FaultPlan,
    HarnessError,
    Raised,
    Returned,
    TaskTrace,
    TrioThread,
    attempt,
)

if sys.version_info < (3, 11):
    from exceptiongroup import ExceptionGroup

import trio.lowlevel

from tests.testing.actors import Add, Counter, FaultyCounter, Hold, Total


async def open_system(stack: contextlib.AsyncExitStack) -> afa.ActorSystem:
    return await stack.enter_async_context(afa.open_actor_system())


def harness_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("trio-")]


def test_run_returns_settles_and_raises() -> None:
    with TrioThread(open_system, clock=trio.testing.MockClock()) as loop:
        system = loop.value
        ref = loop.run(functools.partial(system.spawn, Counter, name="c"))
        loop.run(ref.send, Add(3))  # returns once the loop settled: the tell was handled
        assert ref.statistics().processed == 1
        assert loop.run(ref.ask, Total()) == 3
        with pytest.raises(afa.NameTakenError):
            loop.run(functools.partial(system.spawn, Counter, name="c"))
        assert loop.run(attempt, ref.ask, Total()) == Returned(3)
        hung = loop.run(attempt, ref.ask, Hold(5.0))  # the clock does not move by itself
        assert hung == Blocked()
        crashed = loop.run(attempt, ref.send, "not a message")
        assert isinstance(crashed, Raised) and isinstance(crashed.error, afa.MessageTypeError)
    assert not harness_threads()


def test_advance_fires_each_timer_at_its_own_time() -> None:
    ticks: list[float] = []

    async def ticker(stack: contextlib.AsyncExitStack) -> None:
        nursery = await stack.enter_async_context(trio.open_nursery())

        async def tick() -> None:
            while True:
                await trio.sleep(1.0)
                ticks.append(trio.current_time())

        nursery.start_soon(tick)
        stack.callback(nursery.cancel_scope.cancel)

    with TrioThread(ticker, clock=trio.testing.MockClock()) as loop:
        start = loop.now
        loop.advance(3.5)
        assert [t - start for t in ticks] == [1.0, 2.0, 3.0]
        assert loop.now - start == 3.5
    with TrioThread(clock=None) as loop, pytest.raises(TypeError, match="MockClock"):
        loop.advance(1.0)


def test_a_hung_call_times_out_and_close_still_cleans_up() -> None:
    stopped: list[str] = []

    class Stubborn(afa.Actor[Hold]):
        async def receive(self, msg: Hold, ctx: afa.ActorContext[Hold]) -> str:
            await trio.sleep(msg.seconds)
            return "done"

        async def on_stop(self, ctx: afa.ActorContext[Hold], error: BaseException | None) -> None:
            await trio.sleep(1000)  # longer than its grace: cancelled when the grace runs out
            stopped.append("never")

    clock = trio.testing.MockClock()
    loop = TrioThread(open_system, clock=clock, call_timeout=0.5)
    ref = loop.run(functools.partial(loop.value.spawn, Stubborn, name="s", shutdown=30.0))
    began = time.monotonic()
    with pytest.raises(CallTimeout, match=r"did not finish within 0\.5s"):
        loop.run(ref.ask, Hold(100.0))  # waits on virtual time nobody advances
    assert loop.running
    assert loop.run(attempt, ref.ask, Hold(1.0)) == Blocked()
    loop.close()  # the grace (30 virtual seconds) passes at once, not in 30 real ones
    assert time.monotonic() - began < 25
    assert not loop.running and stopped == [] and not harness_threads()


def test_a_failed_setup_raises_and_leaves_no_thread() -> None:
    async def broken(stack: contextlib.AsyncExitStack) -> None:
        await stack.enter_async_context(afa.open_actor_system())
        raise ValueError("no such resource")

    with pytest.raises(HarnessError, match="setup failed") as info:
        TrioThread(broken)
    cause = info.value.__cause__
    assert isinstance(cause, ExceptionGroup) and cause.subgroup(ValueError) is not None
    assert not harness_threads()


def test_a_loop_that_ends_is_reported_and_its_error_raised_at_close() -> None:
    async def strict_system(stack: contextlib.AsyncExitStack) -> afa.ActorSystem:
        root = afa.OneForOne(max_restarts=0, within=10.0)
        return await stack.enter_async_context(afa.open_actor_system(strategy=root))

    loop = TrioThread(strict_system, clock=trio.testing.MockClock())
    plan = FaultPlan((CrashAt(message=1),))
    spawn = functools.partial(
        loop.value.spawn,
        lambda: FaultyCounter(faults=plan),
        name="c",
        restart=afa.Restart.PERMANENT,
    )
    ref = loop.run(spawn)
    with pytest.raises(HarnessError, match="ended"):
        loop.run(ref.send, Add(1))  # the crash exceeds the root's intensity: the system fails
    assert not loop.running
    with pytest.raises(ExceptionGroup) as info:
        loop.close()
    assert info.group_contains(afa.SupervisorFailed)
    loop.close()  # idempotent
    assert not harness_threads()


def test_a_seeded_loop_schedules_the_same_way_twice() -> None:
    async def race(log: list[int]) -> None:
        async def worker(k: int) -> None:
            for _ in range(3):
                log.append(k)
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            for k in range(4):
                nursery.start_soon(worker, k)

    orders = []
    for _ in range(2):
        trace, log = TaskTrace(), []
        with TrioThread(clock=trio.testing.MockClock(), seed=3, instruments=(trace,)) as loop:
            loop.run(race, log)
        orders.append((log, trace.steps))
    assert orders[0] == orders[1]
