"""Stop always wins: leaving the system is bounded whatever an actor is stuck in (issue #8 §3)."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import trio
import trio.testing

import asyncflow_actors as afa


class StuckStart(afa.Actor[Any]):
    """``on_start`` never returns (waiting for an engine, an NCCL init...)."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    async def on_start(self, ctx: afa.ActorContext[Any]) -> None:
        self.log.append("start entered")
        try:
            await trio.sleep_forever()
        finally:
            self.log.append("start cancelled")


class StuckReceive(afa.Actor[Any]):
    def __init__(self, log: list[str]) -> None:
        self.log = log

    async def receive(self, msg: Any, ctx: afa.ActorContext[Any]) -> None:
        await trio.sleep_forever()

    async def on_stop(self, ctx: afa.ActorContext[Any], error: BaseException | None) -> None:
        self.log.append(f"stop receive {type(error).__name__}")


class StuckStop(afa.Actor[Any]):
    def __init__(self, log: list[str]) -> None:
        self.log = log

    async def on_stop(self, ctx: afa.ActorContext[Any], error: BaseException | None) -> None:
        self.log.append("stop entered")
        await trio.sleep_forever()


@attrs.frozen
class Poke:
    pass


async def test_outer_cancel_reaches_an_actor_stuck_in_on_start(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log: list[str] = []
    t0 = trio.current_time()
    with trio.move_on_after(1.0) as scope:
        async with afa.open_actor_system(shutdown_grace=2.0) as system:
            await system.spawn(lambda: StuckStart(log), name="engine")
    assert scope.cancelled_caught
    # the outer cancel stopped the start at once: no grace is spent on a start that never ran
    assert trio.current_time() - t0 == pytest.approx(1.0)
    assert log == ["start entered", "start cancelled"]


async def test_a_supervisor_stuck_starting_its_children_still_stops(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log: list[str] = []
    specs = [afa.ChildSpec(lambda: StuckStart(log), "engine")]
    t0 = trio.current_time()
    with trio.move_on_after(1.0):
        async with afa.open_actor_system(shutdown_grace=2.0) as system:
            await system.spawn(lambda: afa.Supervisor(specs), name="sup")
    assert trio.current_time() - t0 == pytest.approx(1.0)
    assert log == ["start entered", "start cancelled"]
    assert system.statistics().actors == ()


async def test_leaving_with_every_kind_of_stuck_actor_is_bounded_by_the_graces(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log: list[str] = []
    async with afa.open_actor_system(shutdown_grace=2.0, kill_grace=0.5) as system:
        await system.spawn(lambda: StuckStop(log), name="stop", shutdown=3.0)
        receive = await system.spawn(lambda: StuckReceive(log), name="receive", shutdown=1.0)
        nested = [afa.ChildSpec(lambda: StuckStop(log), "inner", shutdown=1.0)]
        await system.spawn(lambda: afa.Supervisor(nested), name="sup")
        await receive.send(Poke())
        await trio.testing.wait_all_tasks_blocked()
        t0 = trio.current_time()
    elapsed = trio.current_time() - t0
    # reverse order: sup/inner 1 s (its on_stop is cut at the grace), receive 1 s + its on_stop,
    # stop 3 s; nothing waits forever and the total is within the sum of the graces
    assert elapsed == pytest.approx(1.0 + 1.0 + 3.0)
    assert log == ["stop entered", "stop receive ActorKilled", "stop entered"]


async def test_a_kill_is_reported_to_watchers(autojump_clock: trio.testing.MockClock) -> None:
    seen: list[BaseException | None] = []

    class Watcher(afa.Actor[afa.Terminated]):
        def __init__(self, target: afa.ActorRef[Any]) -> None:
            self.target = target

        async def on_start(self, ctx: afa.ActorContext[afa.Terminated]) -> None:
            ctx.watch(self.target)

        async def receive(self, msg: afa.Terminated, ctx: afa.ActorContext[afa.Terminated]) -> None:
            seen.append(msg.error)

    log: list[str] = []
    async with afa.open_actor_system() as system:
        stuck = await system.spawn(lambda: StuckReceive(log), name="stuck", shutdown=1.0)
        watcher = await system.spawn(lambda: Watcher(stuck), name="watcher")
        await stuck.send(Poke())
        t0 = trio.current_time()
        await stuck.stop()
        assert trio.current_time() - t0 == pytest.approx(1.0)
        await trio.testing.wait_all_tasks_blocked()
        assert watcher.statistics().processed == 1
    assert len(seen) == 1 and isinstance(seen[0], afa.ActorKilled)
    assert seen[0].grace == 1.0


class SpawnsInStart(afa.Actor[Any]):
    """``on_start`` spawns a sibling through the system and a child of its own."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    async def on_start(self, ctx: afa.ActorContext[Any]) -> None:
        await ctx.system.spawn(lambda: Leaf(self.log, "sibling"), name="sibling")
        await ctx.spawn(lambda: Leaf(self.log, "child"), name="child")
        self.log.append("parent started")


class Leaf(afa.Actor[Any]):
    def __init__(self, log: list[str], tag: str) -> None:
        self.log = log
        self.tag = tag

    async def on_start(self, ctx: afa.ActorContext[Any]) -> None:
        self.log.append(f"{self.tag} started")

    async def on_stop(self, ctx: afa.ActorContext[Any], error: BaseException | None) -> None:
        self.log.append(f"{self.tag} stopped")


async def test_on_start_may_spawn_siblings_and_children() -> None:
    log: list[str] = []
    with trio.fail_after(5):
        async with afa.open_actor_system() as system:
            await system.spawn(lambda: SpawnsInStart(log), name="parent")
            assert system.whereis("sibling") is not None
            assert system.whereis("parent/child") is not None
    assert log[:3] == ["sibling started", "child started", "parent started"]
    assert sorted(log[3:]) == ["child stopped", "sibling stopped"]


async def test_a_restarted_child_may_spawn_siblings_from_on_start() -> None:
    log: list[str] = []
    starts = 0

    class Restarting(afa.Actor[Any]):
        async def on_start(self, ctx: afa.ActorContext[Any]) -> None:
            nonlocal starts
            starts += 1
            await ctx.system.spawn(lambda: Leaf(log, f"s{starts}"), name=f"s{starts}")

        async def receive(self, msg: Any, ctx: afa.ActorContext[Any]) -> None:
            raise RuntimeError("crash")

    with trio.fail_after(5):
        async with afa.open_actor_system() as system:
            ref = await system.spawn(Restarting, name="r", restart=afa.Restart.PERMANENT)
            await ref.send(Poke())
            while starts < 2:
                await trio.sleep(0.01)
            await trio.testing.wait_all_tasks_blocked()
            assert system.whereis("s2") is not None


async def test_a_crashing_helper_stops_the_children_through_the_normal_path() -> None:
    log: list[str] = []

    class Parent(afa.Actor[Any]):
        async def on_start(self, ctx: afa.ActorContext[Any]) -> None:
            await ctx.spawn(lambda: Leaf(log, "child"), name="child")

            async def helper() -> None:
                await trio.sleep(0.01)
                raise RuntimeError("helper failed")

            ctx.start_soon(helper)

        async def on_stop(self, ctx: afa.ActorContext[Any], error: BaseException | None) -> None:
            log.append(f"parent stopped {type(error).__name__}")

    with trio.fail_after(5):
        async with afa.open_actor_system() as system:
            ref = await system.spawn(Parent, name="parent")
            while ref.statistics().state is not afa.ActorState.TERMINATED:
                await trio.sleep(0.01)
    # the child's on_stop ran (a graceful stop), before the parent's own
    assert log == ["child started", "child stopped", "parent stopped ExceptionGroup"]


class Escape(BaseException):
    """Not an ``Exception``: what an actor's code never catches (like ``KeyboardInterrupt``)."""


class EscapingStop(afa.Actor[Any]):
    """A child whose ``on_stop`` lets a ``BaseException`` out of its incarnation."""

    async def on_stop(self, ctx: afa.ActorContext[Any], error: BaseException | None) -> None:
        await trio.lowlevel.checkpoint()
        raise Escape("out of on_stop")


class Parent(afa.Actor[Any]):
    async def on_start(self, ctx: afa.ActorContext[Any]) -> None:
        await ctx.spawn(EscapingStop, name="child")


async def test_a_base_exception_escaping_an_incarnation_surfaces_and_the_stop_ends() -> None:
    """A ``BaseException`` out of a child's incarnation ends its parent's incarnation too; the
    system's shielded stop of the root must still end (it waited for an exit nobody signalled:
    a run hung at its stop) and the exception surfaces from the block."""
    with trio.fail_after(10), pytest.RaisesGroup(Escape, flatten_subgroups=True):
        async with afa.open_actor_system(shutdown_grace=2.0) as system:
            await system.spawn(Parent, name="parent")


class FailsWhenKilled(afa.Actor[Any]):
    """Stuck in ``receive``; its helper task fails as the kill cancels it: the helpers' group
    holds the kill's ``Cancelled`` and a ``ValueError``."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    async def on_start(self, ctx: afa.ActorContext[Any]) -> None:
        ctx.start_soon(self.helper)

    async def helper(self) -> None:
        try:
            await trio.sleep_forever()
        finally:
            raise ValueError("failed as it was killed")

    async def receive(self, msg: Any, ctx: afa.ActorContext[Any]) -> None:
        await trio.sleep_forever()

    async def on_stop(self, ctx: afa.ActorContext[Any], error: BaseException | None) -> None:
        self.log.append(f"stop {type(error).__name__}")


async def test_a_helper_failing_as_the_kill_cancels_it_is_the_incarnations_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """What a kill's scope leaves of the helpers' group (their errors, its ``Cancelled`` taken)
    is the incarnation's error, as any helper's failure is: it never escapes the cell to fail
    its supervisor (the vLLM rollout's engine error as its stop's grace ran out did)."""
    log: list[str] = []
    async with afa.open_actor_system(shutdown_grace=1.0) as system:
        ref = await system.spawn(lambda: FailsWhenKilled(log), name="stuck")
        await ref.send(Poke())
        await trio.sleep(0.1)
        with trio.fail_after(10):
            await ref.stop()
    assert log == ["stop ExceptionGroup"]
