"""Faults injected into actors: the same FaultPlan for a local actor and an actor on a node."""

from __future__ import annotations

import itertools
import os
import time

import pytest
import trio
import trio.testing

import asyncflow_actors as afa
from asyncflow_actors.testing import (
    CrashAt,
    CrashOnStart,
    FaultPlan,
    FaultPlanError,
    InjectedCrash,
    KillProcessAt,
    StallAt,
    alive,
    fault_counters,
    faulty,
    wait_node_restarted,
)
from tests.testing.actors import Add, Counter, Echo, FaultyCounter, Total

# A dead node process is noticed at once (its exit); silence never counts here.
PATIENT = afa.NodeOptions(heartbeat_timeout=30.0, shutdown_grace=2.0)


def test_faulty_is_a_subclass_that_nodes_can_import() -> None:
    assert issubclass(FaultyCounter, Counter)
    assert FaultyCounter.__module__ == "tests.testing.actors"
    assert FaultyCounter.__qualname__ == "FaultyCounter"
    assert faulty(Counter, name="Other").__qualname__ == "Other"
    assert FaultyCounter(start=4).total == 4  # the original constructor, faults optional
    with pytest.raises(TypeError, match="FaultPlan"):
        FaultyCounter(faults="crash please")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Actor subclass"):
        faulty(int)  # type: ignore[type-var]
    with pytest.raises(ValueError, match="message"):
        CrashAt(message=0)


async def test_crash_at_the_kth_message_fires_once_across_restarts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    plan = FaultPlan((CrashAt(message=2), CrashAt(message=4, when="after")))
    async with afa.open_actor_system() as system:
        ref = await system.spawn(
            lambda: FaultyCounter(faults=plan), name="c", restart=afa.Restart.PERMANENT
        )
        await ref.send(Add(1))  # message 1
        await ref.send(Add(10))  # message 2: crashes before handling it (lost)
        await trio.testing.wait_all_tasks_blocked()
        assert ref.statistics().restarts == 1
        assert await ref.ask(Total()) == 0  # message 3: a fresh incarnation
        with pytest.raises(afa.ActorCrashed) as info:
            await ref.ask(Echo("x"))  # message 4: handled, then the ack is lost
        assert isinstance(info.value.error, InjectedCrash)
        assert "after handling message #4" in str(info.value.error)
        await ref.send(Add(5))  # message 5... and no more faults: the count went on
        assert await ref.ask(Total()) == 5
        assert ref.statistics().restarts == 2
        assert fault_counters(plan, "c").fired == list(plan.faults)


async def test_crash_on_start(autojump_clock: trio.testing.MockClock) -> None:
    async with afa.open_actor_system() as system:
        with pytest.raises(afa.ActorCrashed) as info:
            await system.spawn(lambda: FaultyCounter(faults=FaultPlan((CrashOnStart(),))), name="a")
        assert isinstance(info.value.error, InjectedCrash)
        # the second start (the first restart) fails; the supervisor tries again, and it holds
        plan = FaultPlan((CrashAt(message=1), CrashOnStart(start=2)))
        tree = afa.Supervisor(
            [afa.ChildSpec(lambda: FaultyCounter(faults=plan), "c")],
            afa.OneForOne(max_restarts=5, within=10.0),
        )
        await system.spawn(lambda: tree, name="sup")
        child = system.whereis("sup/c")
        assert child is not None
        with pytest.raises(afa.ActorCrashed):
            await child.ask(Total())
        await trio.testing.wait_all_tasks_blocked()
        assert await child.ask(Total()) == 0
        assert fault_counters(plan, "sup/c").starts == 3


async def test_a_blocking_stall_stops_the_whole_loop() -> None:
    async with afa.open_actor_system() as system:
        plan = FaultPlan((StallAt(message=1, seconds=0.3),))
        ref = await system.spawn(lambda: FaultyCounter(faults=plan), name="blocking")
        ticks: list[float] = []

        async def ticker() -> None:
            while True:
                ticks.append(time.monotonic())
                await trio.sleep(0.01)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            await trio.sleep(0.05)
            began = time.monotonic()
            assert await ref.ask(Total()) == 0
            assert time.monotonic() - began >= 0.3
            await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
        # no other task ran while the actor blocked the loop: the ticker skipped 0.3 s
        assert max(b - a for a, b in itertools.pairwise(ticks)) >= 0.3


async def test_a_non_blocking_stall_takes_virtual_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with afa.open_actor_system() as system:
        plan = FaultPlan((StallAt(message=2, seconds=30.0, blocking=False),))
        ref = await system.spawn(lambda: FaultyCounter(faults=plan), name="c")
        assert await ref.ask(Total()) == 0
        began = trio.current_time()
        assert await ref.ask(Total()) == 0
        assert trio.current_time() - began == 30.0


async def test_kill_9_is_refused_in_the_process_that_made_the_plan() -> None:
    async with afa.open_actor_system() as system:
        plan = FaultPlan((KillProcessAt(message=1),))
        ref = await system.spawn(lambda: FaultyCounter(faults=plan), name="c")
        with pytest.raises(afa.ActorCrashed) as info:
            await ref.ask(Total())
        assert isinstance(info.value.error, FaultPlanError)
    assert alive(os.getpid())


async def test_the_same_plans_on_a_node() -> None:
    async with afa.open_actor_system() as system:
        node = await system.start_node("n", allow=["tests.testing"], options=PATIENT)
        plan = FaultPlan((CrashAt(message=2), KillProcessAt(message=4)))
        ref = await node.spawn(FaultyCounter, name="c", kwargs={"start": 7, "faults": plan})
        await ref.send(Add(1))  # 1
        with pytest.raises(afa.ActorCrashed) as info:
            await ref.ask(Total())  # 2: crashes on the node; restarted there
        assert isinstance(info.value.error, InjectedCrash)  # rebuilt as its own type
        assert await ref.ask(Total()) == 7  # 3
        old = node.pid
        assert old is not None
        with pytest.raises(afa.ActorCrashed) as info:
            await ref.ask(Total())  # 4: the node process dies right here
        assert isinstance(info.value.error, afa.NodeLost)
        await wait_node_restarted(node, old)
        assert not alive(old)
        with trio.fail_after(30):  # a new process counts afresh: message 1 there
            assert await ref.ask(Total()) == 7
        with pytest.raises(afa.ActorCrashed) as info:
            await node.spawn(
                FaultyCounter, name="d", kwargs={"faults": FaultPlan((CrashOnStart(),))}
            )
        assert isinstance(info.value.error, InjectedCrash)
