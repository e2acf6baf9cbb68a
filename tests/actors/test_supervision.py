"""Supervisors: restart types, strategies, ordering, intensity, backoff, nesting, the root."""

from __future__ import annotations

import sys

import pytest
import trio
import trio.testing

import asyncflow_actors as afa
from tests.actors.kit import Add, Boom, Counter, Crash, Exit, Get

if sys.version_info < (3, 11):
    from exceptiongroup import ExceptionGroup


def spec(log: list[str], name: str, restart: afa.Restart = afa.Restart.PERMANENT) -> afa.ChildSpec:
    return afa.ChildSpec(lambda: Counter(log, name), name, restart=restart)


async def crash(ref: afa.ActorRef[Crash]) -> None:
    with pytest.raises(afa.ActorCrashed):
        await ref.ask(Crash())
    await trio.testing.wait_all_tasks_blocked()


async def start_tree(
    system: afa.ActorSystem, log: list[str], strategy: afa.Strategy, names: str = "abc"
) -> list[afa.ActorRef[object]]:
    await system.spawn(lambda: afa.Supervisor([spec(log, n) for n in names], strategy), name="sup")
    refs = [system.whereis(f"sup/{n}") for n in names]
    assert all(r is not None for r in refs)
    return refs  # type: ignore[return-value]


async def test_children_start_in_order_and_stop_in_reverse() -> None:
    log: list[str] = []
    async with afa.open_actor_system() as system:
        await start_tree(system, log, afa.OneForOne())
        assert log == ["start a", "start b", "start c"]
        log.clear()
    assert log == ["stop c", "stop b", "stop a"]


async def test_one_for_one_restarts_only_the_crashed_child() -> None:
    log: list[str] = []
    async with afa.open_actor_system() as system:
        a, b, c = await start_tree(system, log, afa.OneForOne())
        await a.send(Add(5))  # type: ignore[arg-type]
        await c.send(Add(7))  # type: ignore[arg-type]
        log.clear()
        await crash(b)  # type: ignore[arg-type]
        assert log == ["stop b crashed", "start b"]
        assert await a.ask(Get()) == 5  # type: ignore[arg-type]
        assert await c.ask(Get()) == 7  # type: ignore[arg-type]
        assert await b.ask(Get()) == 0  # same ref, fresh actor  # type: ignore[arg-type]
        assert [r.statistics().restarts for r in (a, b, c)] == [0, 1, 0]


async def test_one_for_all_restarts_everyone_in_order() -> None:
    log: list[str] = []
    async with afa.open_actor_system() as system:
        a, b, c = await start_tree(system, log, afa.OneForAll())
        log.clear()
        await crash(b)  # type: ignore[arg-type]
        assert log == ["stop b crashed", "stop c", "stop a", "start a", "start b", "start c"]
        assert [r.statistics().restarts for r in (a, b, c)] == [1, 1, 1]


async def test_rest_for_one_restarts_the_child_and_those_after_it() -> None:
    log: list[str] = []
    async with afa.open_actor_system() as system:
        a, b, c, d = await start_tree(system, log, afa.RestForOne(), names="abcd")
        log.clear()
        await crash(b)  # type: ignore[arg-type]
        assert log == ["stop b crashed", "stop d", "stop c", "start b", "start c", "start d"]
        assert [r.statistics().restarts for r in (a, b, c, d)] == [0, 1, 1, 1]


@pytest.mark.parametrize(
    ("restart", "crash_restarts", "exit_restarts"),
    [
        (afa.Restart.PERMANENT, True, True),
        (afa.Restart.TRANSIENT, True, False),
        (afa.Restart.TEMPORARY, False, False),
    ],
)
async def test_restart_types(
    restart: afa.Restart, crash_restarts: bool, exit_restarts: bool
) -> None:
    log: list[str] = []
    async with afa.open_actor_system() as system:
        await system.spawn(
            lambda: afa.Supervisor([spec(log, "x", restart), spec(log, "y", restart)]), name="sup"
        )
        x, y = system.whereis("sup/x"), system.whereis("sup/y")
        assert x is not None and y is not None
        await crash(x)
        assert (x.statistics().state is afa.ActorState.RUNNING) is crash_restarts
        await y.send(Exit())
        await trio.testing.wait_all_tasks_blocked()
        assert (y.statistics().state is afa.ActorState.RUNNING) is exit_restarts
        assert (system.whereis("sup/y") is not None) is exit_restarts


async def test_explicit_stop_is_never_restarted() -> None:
    log: list[str] = []
    async with afa.open_actor_system() as system:
        a, b, _ = await start_tree(system, log, afa.OneForAll())
        await b.stop()
        assert system.whereis("sup/b") is None
        await trio.testing.wait_all_tasks_blocked()
        assert a.statistics().restarts == 0
        sup = system.whereis("sup")
        assert sup is not None
        assert [i.name for i in await sup.ask(afa.WhichChildren())] == ["a", "c"]
        await sup.ask(afa.StopChild("c"))
        assert [i.name for i in await sup.ask(afa.WhichChildren())] == ["a"]
        with pytest.raises(KeyError):
            await sup.ask(afa.StopChild("nope"))


async def test_intensity_exceeded_fails_the_supervisor_with_chained_errors() -> None:
    log: list[str] = []

    async with afa.open_actor_system() as system:
        watcher_log: list[afa.Terminated] = []

        class Watcher(afa.Actor[afa.Terminated]):
            async def on_start(self, ctx: afa.ActorContext[afa.Terminated]) -> None:
                sup = system.whereis("sup")
                assert sup is not None
                ctx.watch(sup)

            async def receive(
                self, msg: afa.Terminated, ctx: afa.ActorContext[afa.Terminated]
            ) -> None:
                watcher_log.append(msg)

        _, b, _ = await start_tree(system, log, afa.OneForOne(max_restarts=2, within=10))
        await system.spawn(Watcher, name="watcher")
        await crash(b)  # type: ignore[arg-type]
        await crash(b)  # type: ignore[arg-type]
        log.clear()
        await crash(b)  # the third restart within 10 s is one too many  # type: ignore[arg-type]
        assert log == ["stop b crashed", "stop c", "stop a"]
        assert system.whereis("sup") is None
        (terminated,) = watcher_log
        error = terminated.error
        assert isinstance(error, afa.SupervisorFailed)
        assert "more than 2 restarts within 10" in str(error)
        assert len(error.failures) == 3 and all(isinstance(f, Boom) for f in error.failures)
        assert error.__cause__ is error.failures[-1]


async def test_restarts_outside_the_window_do_not_count(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log: list[str] = []
    async with afa.open_actor_system() as system:
        _, b, _ = await start_tree(system, log, afa.OneForOne(max_restarts=1, within=5))
        for _ in range(4):
            await crash(b)  # type: ignore[arg-type]
            await trio.sleep(5.1)
        assert b.statistics().restarts == 4
        assert system.whereis("sup") is not None


async def test_max_restarts_zero_fails_at_the_first_crash() -> None:
    log: list[str] = []
    async with afa.open_actor_system() as system:
        _, b, _ = await start_tree(system, log, afa.OneForOne(max_restarts=0))
        await crash(b)  # type: ignore[arg-type]
        assert system.whereis("sup") is None


async def test_backoff_delays_restarts(autojump_clock: trio.testing.MockClock) -> None:
    log: list[str] = []
    backoff = afa.Backoff(initial=1.0, factor=2.0, max=3.0)
    async with afa.open_actor_system() as system:
        _, b, _ = await start_tree(
            system, log, afa.OneForOne(max_restarts=10, within=100, backoff=backoff)
        )
        delays = []
        for _ in range(4):
            t0 = trio.current_time()
            with pytest.raises(afa.ActorCrashed):
                await b.ask(Crash())  # type: ignore[arg-type]
            while b.statistics().state is not afa.ActorState.RUNNING:
                await trio.sleep(0.001)
            delays.append(round(trio.current_time() - t0, 2))
        assert delays == [1.0, 2.0, 3.0, 3.0]


async def test_stop_during_backoff_cancels_the_restart(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log: list[str] = []
    backoff = afa.Backoff(initial=50.0)
    async with afa.open_actor_system() as system:
        _, b, _ = await start_tree(system, log, afa.OneForOne(backoff=backoff))
        await crash(b)  # type: ignore[arg-type]
        assert b.statistics().state is afa.ActorState.RESTARTING
        t0 = trio.current_time()
        await b.stop()
        await trio.testing.wait_all_tasks_blocked()
        assert trio.current_time() - t0 < 1
        assert system.whereis("sup/b") is None


async def test_a_queued_message_during_backoff_reaches_the_new_incarnation(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log: list[str] = []
    async with afa.open_actor_system() as system:
        _, b, _ = await start_tree(system, log, afa.OneForOne(backoff=afa.Backoff(initial=1.0)))
        await crash(b)  # type: ignore[arg-type]
        await b.send(Add(3))  # type: ignore[arg-type]
        assert await b.ask(Get()) == 3  # type: ignore[arg-type]


async def test_nested_supervisor_failure_escalates_to_its_parent() -> None:
    log: list[str] = []
    inner = afa.ChildSpec.supervisor(
        "inner", [spec(log, "x"), spec(log, "y")], afa.OneForOne(max_restarts=0)
    )
    async with afa.open_actor_system() as system:
        await system.spawn(
            lambda: afa.Supervisor([spec(log, "a"), inner, spec(log, "b")], afa.RestForOne()),
            name="top",
        )
        x = system.whereis("top/inner/x")
        inner_ref = system.whereis("top/inner")
        assert x is not None and inner_ref is not None
        log.clear()
        await crash(x)
        # inner gives up (stops y), top restarts inner and every child after it (b)
        assert log == ["stop x crashed", "stop y", "stop b", "start x", "start y", "start b"]
        assert inner_ref.statistics().restarts == 1
        new_x = system.whereis("top/inner/x")
        assert new_x is not None and new_x.statistics().restarts == 0  # a new child of a new inner


async def test_failure_of_a_child_at_start_fails_the_supervisor_start() -> None:
    log: list[str] = []

    class NoStart(Counter):
        async def on_start(self, ctx: afa.ActorContext[object]) -> None:  # type: ignore[override]
            raise Boom("cannot start")

    async with afa.open_actor_system() as system:
        with pytest.raises(afa.ActorCrashed) as info:
            await system.spawn(
                lambda: afa.Supervisor(
                    [spec(log, "a"), afa.ChildSpec(lambda: NoStart(log), "bad"), spec(log, "c")]
                ),
                name="sup",
            )
        assert isinstance(info.value.error, afa.SupervisorFailed)
        assert "'bad' failed to start" in str(info.value.error)
        assert log == ["start a", "stop a"]  # the started child was stopped again


async def test_root_failure_surfaces_from_open_actor_system() -> None:
    log: list[str] = []
    body_cancelled = False
    with pytest.raises(ExceptionGroup) as info:
        async with afa.open_actor_system(strategy=afa.OneForOne(max_restarts=0)) as system:
            ref = await system.spawn(lambda: Counter(log), name="c", restart=afa.Restart.PERMANENT)
            try:
                await ref.ask(Crash())
            except afa.ActorCrashed:
                pass
            try:
                await trio.sleep_forever()
            except trio.Cancelled:
                body_cancelled = True
                raise
    assert body_cancelled
    assert info.group_contains(afa.SupervisorFailed)


async def test_temporary_top_level_crash_leaves_the_system_running() -> None:
    log: list[str] = []
    async with afa.open_actor_system() as system:
        a = await system.spawn(lambda: Counter(log, "a"), name="a")
        b = await system.spawn(lambda: Counter(log, "b"), name="b")
        await crash(a)  # type: ignore[arg-type]
        assert system.whereis("a") is None
        assert await b.ask(Get()) == 0
        log.clear()
    assert log == ["stop b"]


async def test_linked_child_crash_crashes_its_parent() -> None:
    log: list[str] = []

    class Parent(Counter):
        async def on_start(self, ctx: afa.ActorContext[object]) -> None:  # type: ignore[override]
            await super().on_start(ctx)  # type: ignore[arg-type]
            await ctx.spawn(lambda: Counter(self.log, "kid1"), name="kid1")
            await ctx.spawn(lambda: Counter(self.log, "kid2"), name="kid2")

    async with afa.open_actor_system() as system:
        parent = await system.spawn(lambda: Parent(log, "parent"), name="p")
        assert log == ["start parent", "start kid1", "start kid2"]
        kid = system.whereis("p/kid2")
        assert kid is not None
        log.clear()
        await crash(kid)
        assert log == ["stop kid2 crashed", "stop kid1", "stop parent crashed"]
        error = parent.statistics()
        assert error.state is afa.ActorState.TERMINATED
        with pytest.raises(afa.ActorCrashed, match="linked child crashed"):
            await parent.ask(Get())  # type: ignore[arg-type]


async def test_cancelling_the_system_from_outside_still_stops_actors_gracefully() -> None:
    log: list[str] = []
    with trio.move_on_after(1) as scope:
        async with afa.open_actor_system() as system:
            await start_tree(system, log, afa.OneForOne())
            log.clear()
            await trio.sleep_forever()
    assert scope.cancelled_caught
    assert log == ["stop c", "stop b", "stop a"]
