"""A yes vote leads to the commit: weights a receiver verified wait for the sender's word even
when its lease runs out first, and a sender never counts a receiver that reports older weights
after the commit as synced (at staleness 0 such a rollout waited forever)."""

from __future__ import annotations

from typing import Any

import pytest
import trio

import asyncflow_actors as afa
from asyncflow_actors.checkpoint import (
    CheckpointEngine,
    GetReceiverStatistics,
    PhaseDeadlines,
    Resumed,
    SyncFailed,
    SyncResume,
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
