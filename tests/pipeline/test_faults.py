"""Failures: a forward worker's process killed mid-run, a run cancelled, a resumed run."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import trio

import asyncflow_actors as afa
from asyncflow_actors import testing as aft
from asyncflow_actors.pipeline import open_pipeline, run_pipeline
from asyncflow_actors.roles import GetRoleStats

from .kit import tiny

BATCH = 16


async def test_killing_a_forward_worker_process_loses_no_sample() -> None:
    """kill -9 of ActorForward's node after the first step: its supervisor restarts the node and
    the worker, the samples it held go back to the queue, and every step still trains a full
    batch of samples that every station processed."""
    config = tiny(
        "async",
        train={"steps": 5},
        placement={"default": "local", "roles": {"actor_fwd": "fwd"}},
    )
    async with afa.open_actor_system() as system, open_pipeline(system, config) as run:
        node = run.nodes["fwd"]
        killed = node.pid
        assert killed is not None
        while not run.records:
            await trio.sleep(0.01)
        os.kill(killed, signal.SIGKILL)
        result = await run.wait()
        fwd = await run.refs["actor_fwd-0"].ask(GetRoleStats())
    assert node.pid != killed, "the node was restarted in a new process"
    assert [r.samples for r in result.records] == [BATCH] * 5
    assert fwd.samples > 0, "the restarted worker took over"


async def test_a_cancelled_run_stops_every_process(tmp_path: Path) -> None:
    aft.warm_up_zmq()
    before = aft.ResourceSnapshot.take()
    config = tiny(
        "async",
        train={"steps": 1000},
        placement={"default": "local", "roles": {"rollout": "gen"}},
    )
    with trio.move_on_after(60) as scope:
        async with afa.open_actor_system() as system, open_pipeline(system, config) as run:
            while not run.records:
                await trio.sleep(0.01)
            pids = [node.pid for node in run.nodes.values()]
            scope.cancel()
    assert scope.cancelled_caught
    assert len(pids) == 1 and all(pid is not None for pid in pids)
    for pid in pids:
        assert not aft.alive(pid), f"node process {pid} outlived the run"
    aft.check_no_leaks(before, settle=10.0)


async def test_a_run_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    first = tiny("sync", run_dir=str(tmp_path), train={"steps": 2, "checkpoint_every": 1})
    result = await run_pipeline(first)
    assert [Path(c).name for c in result.checkpoints] == ["step-000001", "step-000002"]
    state = json.loads((Path(result.checkpoints[0]) / "driver.json").read_text())
    assert state["version"] == 1 and state["cursor"] >= 4
    resumed = await run_pipeline(
        tiny("sync", run_dir=str(tmp_path), train={"steps": 4, "checkpoint_every": 1}),
        resume=result.checkpoints[-1],
    )
    assert [r.version for r in resumed.records] == [3, 4]
    assert [Path(c).name for c in resumed.checkpoints] == ["step-000003", "step-000004"]
    lines = (tmp_path / "steps.jsonl").read_text().splitlines()
    assert [json.loads(line)["version"] for line in lines] == [1, 2, 3, 4]
