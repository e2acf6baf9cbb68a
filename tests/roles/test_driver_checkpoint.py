"""A Driver checkpoint names every prompt the cursor passed and no step trained: also those the
Driver took but whose groups it is still opening (it advanced the cursor, then awaited
``open_groups``; a checkpoint written in between lost them for good)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

import asyncflow_actors as afa
from asyncflow_actors.roles import Driver, DriverHooks, topic_specs
from asyncflow_actors.roles import _schema as S
from asyncflow_actors.roles._driver import DriverState
from asyncflow_actors.roles._messages import SaveCheckpoint
from asyncflow_actors.transfer_queue import (
    TransferQueueClient,
    TransferQueueConfig,
    open_transfer_queue,
)

from .test_batching import SPEC


class SavingTrainer(afa.Actor[Any]):
    """Answers ``SaveCheckpoint`` as the Trainer does (here, without writing a model)."""

    async def receive(self, msg: Any, ctx: afa.ActorContext[Any]) -> Any:
        await trio.lowlevel.checkpoint()
        assert isinstance(msg, SaveCheckpoint)
        return msg.directory


@pytest.mark.parametrize("reinjected", [False, True])
async def test_a_checkpoint_keeps_the_prompts_whose_groups_are_being_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reinjected: bool
) -> None:
    spec = attrs.evolve(SPEC, run_dir=str(tmp_path))
    opening, gate = trio.Event(), trio.Event()
    real_open_groups = TransferQueueClient.open_groups
    calls = 0

    async def slow_open_groups(self: TransferQueueClient, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        # the first admission goes through; the one under test waits
        if calls > 1 or not reinjected:
            opening.set()
            await gate.wait()
        return await real_open_groups(self, *args, **kwargs)

    monkeypatch.setattr(TransferQueueClient, "open_groups", slow_open_groups)
    tq = TransferQueueConfig(topics=topic_specs(spec), units=1)
    async with afa.open_actor_system() as system, open_transfer_queue(system, tq) as queue:
        with trio.fail_after(30):
            trainer = await system.spawn(SavingTrainer, name="trainer")
            driver = Driver(spec, queue.controller, DriverHooks(trainer=trainer))
            await system.spawn(lambda: driver, name="driver")
            if reinjected:
                # every admitted prompt is out (its group in flight); one is injected again
                client = await queue.client("rollout-0")
                await client.get(S.PROMPTS, "rollout", [S.GROUP], 16, min_count=16)
                group, index = next(iter(driver.inflight.items()))
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(driver._reinject, group)
                    await opening.wait()
                    state = DriverState.read(await driver.save_checkpoint(trainer))
                    gate.set()
                assert index in state.pending
                assert set(state.pending) == set(range(state.cursor))
            else:
                await opening.wait()
                state = DriverState.read(await driver.save_checkpoint(trainer))
                gate.set()
                # capacity (staleness + 1) x batch = 16 prompts taken, none trained
                assert state.cursor == 16
                assert set(state.pending) == set(range(16))


class StoppedMidSave(afa.Actor[Any]):
    """A Trainer that is stopped (the run's stop) while a ``SaveCheckpoint`` is under way."""

    def __init__(self, received: trio.Event) -> None:
        self.received = received

    def default_shutdown(self) -> float:
        return 0.1  # the save never ends: the stop kills it at once

    async def receive(self, msg: Any, ctx: afa.ActorContext[Any]) -> Any:
        assert isinstance(msg, SaveCheckpoint)
        self.received.set()
        await trio.sleep_forever()


@pytest.mark.parametrize("stopping", [True, False])
async def test_a_checkpoint_the_runs_stop_cuts_short_is_no_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, stopping: bool
) -> None:
    """The run's stop ends the Trainer while the Driver still saves a step it reported after
    the stop began (Ctrl-C between two steps): no checkpoint, and no warning beside the one
    line naming the resume command; a Trainer that dies otherwise is still warned about."""
    spec = attrs.evolve(SPEC, run_dir=str(tmp_path))
    tq = TransferQueueConfig(topics=topic_specs(spec), units=1)
    async with afa.open_actor_system() as system, open_transfer_queue(system, tq) as queue:
        with trio.fail_after(30):
            received = trio.Event()
            trainer = await system.spawn(lambda: StoppedMidSave(received), name="trainer")
            driver = Driver(spec, queue.controller, DriverHooks(trainer=trainer))
            await system.spawn(lambda: driver, name="driver")
            driver.stopping = stopping
            saved: list[str | None] = []

            async def save() -> None:
                saved.append(await driver.save_checkpoint(trainer, final=True))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(save)
                await received.wait()  # the save is under way in the Trainer
                await trainer.stop()
    assert saved == [None]
    warned = [
        r.getMessage()
        for r in caplog.records
        if r.levelname == "WARNING" and "no checkpoint" in r.getMessage()
    ]
    assert bool(warned) is not stopping, warned
