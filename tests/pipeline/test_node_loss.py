"""The Trainer's node process killed mid-run (issue #27 §1b): the Trainer is ``TEMPORARY``, so
its node's restart does not bring it back; without ``train.auto_resume`` the run fails naming
it instead of hanging (with it: ``test_auto_resume``)."""

from __future__ import annotations

import os
import signal

import pytest
import trio

import asyncflow_actors as afa
from asyncflow_actors.pipeline import RunFailed, open_pipeline

from .kit import tiny


async def test_killing_the_trainers_process_fails_the_run_naming_the_trainer() -> None:
    config = tiny(
        "async",
        train={"steps": 50, "auto_resume": False},
        placement={"default": "local", "roles": {"trainer": "tr"}},
    )
    async with afa.open_actor_system() as system, open_pipeline(system, config) as run:
        node = run.nodes["tr"]
        killed = node.pid
        assert killed is not None
        with trio.fail_after(60):
            while not run.records:
                await trio.sleep(0.01)
        os.kill(killed, signal.SIGKILL)
        # the watcher hears at once (the process exit), not after a liveness timeout
        with trio.fail_after(afa.NodeOptions().heartbeat_timeout), pytest.raises(RunFailed) as info:
            await run.wait()
    assert "trainer" in str(info.value)
    assert isinstance(info.value.__cause__, afa.NodeLost)
