"""One actor: tell/ask, types, backpressure, start/stop, crashes, replies, helpers, watch."""

from __future__ import annotations

import sys
from typing import Any

import attrs
import pytest
import trio
import trio.testing

import asyncflow_actors as afa
from tests.actors.kit import Add, Boom, Counter, CounterMsg, Crash, Exit, Get, Sleep

if sys.version_info < (3, 11):
    from exceptiongroup import ExceptionGroup


async def test_tell_then_ask_replies_in_order() -> None:
    async with afa.open_actor_system() as system:
        ref = await system.spawn(Counter, name="c")
        for i in range(10):
            await ref.send(Add(i))
        assert await ref.ask(Get()) == 45
        assert ref.statistics().processed == 11


async def test_wrong_message_type_is_refused_at_the_call_site() -> None:
    async with afa.open_actor_system() as system:
        ref: afa.ActorRef[Any] = await system.spawn(Counter, name="c")
        with pytest.raises(afa.MessageTypeError, match=r"accepts Add \| Get .* not str"):
            await ref.send("hello")
        with pytest.raises(afa.MessageTypeError):
            ref.send_nowait(3)
        with pytest.raises(afa.MessageTypeError, match="ask\\(\\) needs a Request"):
            await ref.ask(Add(1))
        assert await ref.ask(Get()) == 0  # nothing was delivered


async def test_duplicate_and_invalid_names() -> None:
    async with afa.open_actor_system() as system:
        await system.spawn(Counter, name="c")
        with pytest.raises(afa.NameTakenError, match="'c'"):
            await system.spawn(Counter, name="c")
        with pytest.raises(ValueError, match="without '/'"):
            await system.spawn(Counter, name="a/b")
        with pytest.raises(afa.NameTakenError):
            afa.Supervisor([afa.ChildSpec(Counter, "x"), afa.ChildSpec(Counter, "x")])


async def test_a_name_is_free_again_after_stop() -> None:
    async with afa.open_actor_system() as system:
        ref = await system.spawn(Counter, name="c")
        await ref.stop()
        assert system.whereis("c") is None
        again = await system.spawn(Counter, name="c")
        assert await again.ask(Get()) == 0


async def test_spawn_returns_after_on_start(autojump_clock: trio.testing.MockClock) -> None:
    class Slow(afa.Actor[Get]):
        ready = False

        async def on_start(self, ctx: afa.ActorContext[Get]) -> None:
            await trio.sleep(3)
            self.ready = True

        async def receive(self, msg: Get, ctx: afa.ActorContext[Get]) -> int:
            return int(self.ready)

    async with afa.open_actor_system() as system:
        t0 = trio.current_time()
        ref = await system.spawn(Slow, name="slow")
        assert trio.current_time() - t0 == pytest.approx(3)
        assert ref.statistics().state is afa.ActorState.RUNNING
        assert await ref.ask(Get()) == 1


async def test_failure_in_on_start_is_raised_by_spawn() -> None:
    class Broken(afa.Actor[Get]):
        async def on_start(self, ctx: afa.ActorContext[Get]) -> None:
            raise Boom("no start")

    async with afa.open_actor_system() as system:
        with pytest.raises(afa.ActorCrashed, match="no start") as info:
            await system.spawn(Broken, name="b")
        assert isinstance(info.value.error, Boom)
        assert info.value.__cause__ is info.value.error
        assert system.whereis("b") is None


async def test_mailbox_backpressure() -> None:
    async with afa.open_actor_system() as system:
        ref = await system.spawn(Counter, name="c", mailbox_size=2)
        gate = trio.Event()

        async def block() -> None:
            await ref.ask(Sleep(0.05))
            gate.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(block)
            await trio.testing.wait_all_tasks_blocked()  # the actor is sleeping in Sleep
            ref.send_nowait(Add(1))
            ref.send_nowait(Add(2))
            with pytest.raises(trio.WouldBlock):
                ref.send_nowait(Add(4))
            assert ref.statistics().mailbox_depth == 2
            with trio.move_on_after(0.01) as scope:
                await ref.send(Add(4))  # parks: the mailbox is full
            assert scope.cancelled_caught
            await ref.send(Add(8))  # waits until the actor frees a slot
        assert await ref.ask(Get()) == 11  # the cancelled send delivered nothing


async def test_send_and_ask_are_checkpoints() -> None:
    async with afa.open_actor_system() as system:
        ref = await system.spawn(Counter, name="c")
        with trio.testing.assert_checkpoints():
            await ref.send(Add(1))
        with trio.testing.assert_checkpoints():
            await ref.ask(Get())


async def test_crash_fails_the_current_and_every_queued_ask() -> None:
    async with afa.open_actor_system() as system:
        ref = await system.spawn(Counter, name="c")
        results: list[object] = []

        async def ask(req: afa.Request[Any]) -> None:
            try:
                results.append(await ref.ask(req))
            except afa.ActorCrashed as exc:
                results.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, Sleep(0.01))
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(ask, Crash())
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(ask, Get())
            nursery.start_soon(ask, Get())
        assert results[0] == "slept"
        assert all(isinstance(r, afa.ActorCrashed) for r in results[1:]), results
        assert all(
            isinstance(r.error, Boom) for r in results[1:] if isinstance(r, afa.ActorCrashed)
        )
        assert ref.statistics().state is afa.ActorState.TERMINATED
        with pytest.raises(afa.ActorCrashed, match="crashed: Boom"):
            await ref.send(Add(1))


async def test_stop_is_graceful_and_bypasses_a_full_mailbox() -> None:
    log: list[str] = []
    async with afa.open_actor_system() as system:
        ref = await system.spawn(lambda: Counter(log), name="c", mailbox_size=1)
        outcomes: list[object] = []

        async def ask(req: afa.Request[Any]) -> None:
            try:
                outcomes.append(await ref.ask(req))
            except afa.ActorCrashed as exc:
                outcomes.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, Sleep(0.02))  # in progress when stop arrives
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(ask, Get())  # queued: fills the mailbox
            nursery.start_soon(ask, Get())  # parked sender: mailbox full
            await trio.testing.wait_all_tasks_blocked()
            await ref.stop()
        assert outcomes[0] == "slept"  # the current message finished
        assert len(outcomes) == 3
        for exc in outcomes[1:]:
            assert isinstance(exc, afa.ActorCrashed)
            assert exc.error is None and "stopped" in str(exc)
        assert log == ["start c", "stop c"]


async def test_shutdown_grace_cancels_a_stuck_actor(autojump_clock: trio.testing.MockClock) -> None:
    log: list[str] = []
    async with afa.open_actor_system() as system:
        ref = await system.spawn(lambda: Counter(log), name="c", shutdown=2.0)
        async with trio.open_nursery() as nursery:

            async def stuck() -> None:
                with pytest.raises(afa.ActorCrashed):
                    await ref.ask(Sleep(1000))

            nursery.start_soon(stuck)
            await trio.testing.wait_all_tasks_blocked()
            t0 = trio.current_time()
            await ref.stop()
            assert trio.current_time() - t0 == pytest.approx(2.0)
        assert ref.statistics().state is afa.ActorState.TERMINATED
    # the kill cancelled the stuck message, and on_stop still ran, told it was a kill
    assert log == ["start c", "stop c crashed"]


async def test_deferred_reply_and_reply_error() -> None:
    @attrs.frozen
    class Later(afa.Request[str]):
        pass

    @attrs.frozen
    class Release:
        pass

    @attrs.frozen
    class Bad(afa.Request[int]):
        pass

    class Deferring(afa.Actor[Later | Release | Bad]):
        def __init__(self) -> None:
            self.waiting: list[afa.Reply] = []

        async def receive(self, msg: Later | Release | Bad, ctx: afa.ActorContext[Any]) -> Any:
            if isinstance(msg, Later):
                self.waiting.append(ctx.defer_reply())
            elif isinstance(msg, Release):
                for reply in self.waiting:
                    reply.send("released")
            else:
                ctx.reply_error(ValueError("bad input"))

    async with afa.open_actor_system() as system:
        ref = await system.spawn(Deferring, name="d")
        got: list[str] = []
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(lambda: _append(got, ref.ask(Later())))
            await trio.testing.wait_all_tasks_blocked()
            assert got == []
            assert ref.statistics().replies_outstanding == 3
            await ref.send(Release())
        assert got == ["released"] * 3
        with pytest.raises(ValueError, match="bad input"):
            await ref.ask(Bad())
        assert ref.statistics().state is afa.ActorState.RUNNING  # an error reply is no crash


async def _append(out: list[str], awaitable: Any) -> None:
    out.append(await awaitable)


async def test_deferred_replies_fail_when_the_actor_stops() -> None:
    @attrs.frozen
    class Later(afa.Request[str]):
        pass

    class Forgetful(afa.Actor[Later]):
        async def receive(self, msg: Later, ctx: afa.ActorContext[Later]) -> None:
            ctx.defer_reply()

    async with afa.open_actor_system() as system:
        ref = await system.spawn(Forgetful, name="f")
        async with trio.open_nursery() as nursery:

            async def ask() -> None:
                with pytest.raises(afa.ActorCrashed, match="stopped"):
                    await ref.ask(Later())

            nursery.start_soon(ask)
            await trio.testing.wait_all_tasks_blocked()
            await ref.stop()


async def test_helper_tasks_die_with_the_actor() -> None:
    running: list[str] = []

    class WithHelper(afa.Actor[CounterMsg]):
        async def on_start(self, ctx: afa.ActorContext[CounterMsg]) -> None:
            ctx.start_soon(self.helper)

        async def helper(self) -> None:
            running.append("helper")
            try:
                await trio.sleep_forever()
            finally:
                running.remove("helper")

        async def receive(self, msg: CounterMsg, ctx: afa.ActorContext[CounterMsg]) -> None:
            if isinstance(msg, Crash):
                raise Boom

    async with afa.open_actor_system() as system:
        ref = await system.spawn(WithHelper, name="h")
        await trio.testing.wait_all_tasks_blocked()
        assert running == ["helper"]
        await ref.stop()
        assert running == []
        ref = await system.spawn(WithHelper, name="h2")
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(afa.ActorCrashed):
            await ref.ask(Crash())
        await trio.testing.wait_all_tasks_blocked()
        assert running == []


async def test_a_crashing_helper_crashes_the_actor_with_an_exception_group() -> None:
    class Fragile(afa.Actor[Get]):
        async def on_start(self, ctx: afa.ActorContext[Get]) -> None:
            ctx.start_soon(self.helper)

        async def helper(self) -> None:
            await trio.sleep(0.01)
            raise Boom("helper failed")

        async def receive(self, msg: Get, ctx: afa.ActorContext[Get]) -> int:
            await trio.sleep(1)
            return 0

    async with afa.open_actor_system() as system:
        ref = await system.spawn(Fragile, name="f")
        with pytest.raises(afa.ActorCrashed) as info:
            await ref.ask(Get())
        assert isinstance(info.value.error, ExceptionGroup)
        assert info.value.error.subgroup(Boom) is not None


async def test_watch_delivers_terminated() -> None:
    @attrs.frozen
    class Watch:
        ref: afa.ActorRef[Any]

    @attrs.frozen
    class Seen(afa.Request[list[tuple[str, str]]]):
        pass

    class Watcher(afa.Actor[Watch | Seen | afa.Terminated]):
        def __init__(self) -> None:
            self.seen: list[tuple[str, str]] = []

        async def receive(
            self, msg: Watch | Seen | afa.Terminated, ctx: afa.ActorContext[Any]
        ) -> Any:
            if isinstance(msg, Watch):
                ctx.watch(msg.ref)
            elif isinstance(msg, afa.Terminated):
                self.seen.append((msg.ref.name, type(msg.error).__name__))
            else:
                return self.seen

    async with afa.open_actor_system() as system:
        watcher = await system.spawn(Watcher, name="w")
        a = await system.spawn(Counter, name="a")
        b = await system.spawn(Counter, name="b")
        await watcher.send(Watch(a))
        await watcher.send(Watch(b))
        await a.stop()
        with pytest.raises(afa.ActorCrashed):
            await b.ask(Crash())
        await watcher.send(Watch(a))  # already terminated: delivered at once
        await trio.testing.wait_all_tasks_blocked()
        assert await watcher.ask(Seen()) == [("a", "NoneType"), ("b", "Boom"), ("a", "NoneType")]


async def test_stop_self_is_a_normal_exit() -> None:
    async with afa.open_actor_system() as system:
        ref = await system.spawn(Counter, name="c")
        await ref.send(Exit())
        with trio.fail_after(1):
            while ref.statistics().state is not afa.ActorState.TERMINATED:
                await trio.sleep(0.001)
        with pytest.raises(afa.ActorCrashed, match="stopped"):
            await ref.ask(Get())


async def test_awaiting_own_stop_from_receive_is_refused() -> None:
    @attrs.frozen
    class StopMe(afa.Request[str]):
        pass

    class SelfStopper(afa.Actor[StopMe]):
        async def receive(self, msg: StopMe, ctx: afa.ActorContext[StopMe]) -> str:
            try:
                await ctx.self.stop()
            except RuntimeError as exc:
                return str(exc)
            return "no error"

    async with afa.open_actor_system() as system:
        ref = await system.spawn(SelfStopper, name="s")
        assert "deadlock" in await ref.ask(StopMe())


async def test_statistics() -> None:
    async with afa.open_actor_system() as system:
        ref = await system.spawn(Counter, name="c", mailbox_size=7)
        await ref.send(Add(1))
        await ref.ask(Get())
        stats = ref.statistics()
        assert (stats.name, stats.processed, stats.mailbox_capacity, stats.restarts) == (
            "c",
            2,
            7,
            0,
        )
        assert system.statistics().by_name("c") == stats
