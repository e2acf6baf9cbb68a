"""``CheckpointEngine.statistics()`` says where a sync under way is: its phase and the
receivers that have not answered it (what the pipeline's watchdog reports of a stalled sync)."""

from __future__ import annotations

from typing import Any

import pytest
import trio

import asyncflow_actors as afa
from asyncflow_actors.checkpoint import CheckpointEngine, SyncFailed
from tests.checkpoint.doubles import World, weights_of
from tests.checkpoint.test_fused import config
from tests.checkpoint.test_protocol import spawn


@pytest.mark.parametrize(("fused_bytes", "phase"), [(None, "broadcast"), (0, "pause")])
async def test_a_stalled_sync_names_its_phase_and_the_silent_receiver(
    autojump_clock: Any, fused_bytes: int | None, phase: str
) -> None:
    world = World(slow_pause=100.0, slow_engine=0)  # engine 0 answers its pause 100 s late
    kw = {} if fused_bytes is None else {"fused_bytes": fused_bytes}
    async with afa.open_actor_system() as system:
        refs = await spawn(system, world)
        engine = CheckpointEngine(refs, config(**kw))
        assert engine.statistics().phase is None
        async with trio.open_nursery() as nursery:

            async def sync() -> None:
                with pytest.raises(SyncFailed):
                    await engine.sync(7, weights_of(7))

            nursery.start_soon(sync)
            await trio.sleep(5.0)
            stats = engine.statistics()
            assert stats.syncing and (stats.version, stats.phase) == (7, phase)
            assert stats.waiting_for == (refs[0].name,)  # engine 1 answered at once
            assert 4.0 < stats.phase_s <= 5.0
        after = engine.statistics()
        assert (after.phase, after.version, after.waiting_for) == (None, None, ())
