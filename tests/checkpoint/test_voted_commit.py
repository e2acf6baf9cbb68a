"""A yes vote leads to the commit: weights a receiver verified wait for the sender's word even
when its lease runs out first, and a sender never counts a receiver that reports older weights
after the commit as synced (at staleness 0 such a rollout waited forever)."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

import asyncflow_actors as afa
from asyncflow_actors.checkpoint import (
    CheckpointEngine,
    GetReceiverStatistics,
    PauseAck,
    PauseMode,
    PhaseDeadlines,
    Resumed,
    SyncFailed,
    SyncResume,
    WeightReceiver,
)
from tests.checkpoint.doubles import GetState, World, weights_of
from tests.checkpoint.test_protocol import config, spawn


class Relay(afa.Actor[Any]):
    """Passes every message on to ``target``; a ``SyncResume`` arrives ``delay`` seconds late,
    and with ``answer`` set it answers that instead of the target's reply."""

    def __init__(
        self, target: afa.ActorRef[Any], delay: float = 0.0, answer: Resumed | None = None
    ) -> None:
        self.target, self.delay, self.answer = target, delay, answer

    async def receive(self, msg: Any, ctx: afa.ActorContext[Any]) -> Any:
        if isinstance(msg, SyncResume):
            await trio.sleep(self.delay)
            reply = await self.target.ask(msg)
            return self.answer if self.answer is not None else reply
        return await self.target.ask(msg)


async def test_weights_voted_for_wait_for_a_resume_later_than_the_lease(
    autojump_clock: Any,
) -> None:
    deadlines = PhaseDeadlines(
        pause=10, prepare=10, topology=10, broadcast=10, finalize=10, resume=500
    )
    cfg = config(deadlines=deadlines)
    assert cfg.lease == 580
    world = World()
    async with afa.open_actor_system() as system:
        (double,) = await spawn(system, world, n=1)
        relay = await system.spawn(lambda: Relay(double, delay=600), name="relay")
        started = trio.current_time()
        with pytest.raises(SyncFailed) as info:
            await CheckpointEngine((relay,), cfg).sync(1, weights_of(1))
        # every receiver verified and was told to switch; the resume is not confirmed in time
        assert info.value.committed and info.value.phase == "resume"
        await trio.sleep_until(started + 590)  # the lease ran out, the resume not yet in
        assert not world.engines[0].paused, "the lease resumes the target on its old weights"
        stats = await double.ask(GetReceiverStatistics())
        assert stats.leases_expired == 1 and world.engines[0].version == -1
        await trio.sleep_until(started + 640)  # the late resume commits; the next batch loads
        state = await double.ask(GetState())
    assert state.version == 1 and state.loads == (1,) and not state.violations


async def test_a_receiver_reporting_older_weights_after_the_commit_fails_the_sync(
    autojump_clock: Any,
) -> None:
    world = World()
    async with afa.open_actor_system() as system:
        doubles = await spawn(system, world, n=2)
        liar = await system.spawn(lambda: Relay(doubles[1], answer=Resumed(-1, None)), name="liar")
        engine = CheckpointEngine((doubles[0], liar), config())
        with pytest.raises(SyncFailed) as info:
            await engine.sync(1, weights_of(1))
    assert info.value.receiver == "liar" and not info.value.committed
    assert info.value.phase == "resume" and "reports version -1" in str(info.value)
    assert engine.statistics().failed == 1


class TakesAtResume:
    """A lazy target whose host reaches its batch boundary while the sync resumes it: it takes
    the pending weights there and loads them until ``gate`` opens."""

    def __init__(self) -> None:
        self.version = -1
        self.gate = trio.Event()
        self.ctx: afa.ActorContext[Any] | None = None
        self.receiver: WeightReceiver | None = None

    async def pause(self, mode: PauseMode) -> PauseAck:
        await trio.lowlevel.checkpoint()
        return PauseAck(mode, self.version)

    async def resume(self) -> None:
        assert self.ctx is not None and self.receiver is not None
        self.ctx.start_soon(self.receiver.apply_pending)
        await trio.testing.wait_all_tasks_blocked()  # the load under way, at the gate

    async def load_weights(self, weights: Any, version: int) -> None:
        await self.gate.wait()
        self.version = version


class Host(afa.Actor[Any]):
    def __init__(self, target: TakesAtResume) -> None:
        self.target = target

    async def on_start(self, ctx: afa.ActorContext[Any]) -> None:
        self.target.ctx = ctx
        self.target.receiver = WeightReceiver(self.target, load="lazy", pause=False, offload=False)

    async def receive(self, msg: Any, ctx: afa.ActorContext[Any]) -> Any:
        assert self.target.receiver is not None
        return await self.target.receiver.handle(msg, ctx)


async def test_weights_the_host_is_loading_when_the_sync_resumes_count_as_delivered() -> None:
    """The answer to the commit names a load under way (the host took the pending weights at
    its boundary while the target resumed): not a receiver behind."""
    target = TakesAtResume()
    async with afa.open_actor_system() as system:
        host = await system.spawn(lambda: Host(target), name="host")
        with trio.fail_after(30):
            result = await CheckpointEngine((host,), config()).sync(1, weights_of(1))
            assert result.resumed[0].pending == 1 and target.version == -1
            target.gate.set()
            while target.version != 1:
                await trio.lowlevel.checkpoint()
