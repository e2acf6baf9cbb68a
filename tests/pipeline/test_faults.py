"""Failures: a forward worker's or the rollout's process killed mid-run, a run cancelled, a
resumed run."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

import asyncflow_actors as afa
from asyncflow_actors import testing as aft
from asyncflow_actors.pipeline import check_samples, open_pipeline, read_samples, run_pipeline
from asyncflow_actors.roles import GetRoleStats

from .kit import tiny

if sys.version_info < (3, 11):
    from exceptiongroup import ExceptionGroup

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
    result, fwd = await kill_mid_run(config, "fwd", "actor_fwd-0", after_steps=1)
    assert [r.samples for r in result.records] == [BATCH] * 5
    assert fwd.samples > 0, "the restarted worker took over"


async def kill_mid_run(
    config: Any, node_name: str, worker: str, *, after_steps: int
) -> tuple[Any, Any]:
    """Run ``config``, ``kill -9`` node ``node_name`` once ``after_steps`` steps are done, wait
    for the run; its result and ``worker``'s statistics at the end. The node came back in a
    new process."""
    async with afa.open_actor_system() as system, open_pipeline(system, config) as run:
        node = run.nodes[node_name]
        killed = node.pid
        assert killed is not None
        while len(run.records) < after_steps:
            await trio.sleep(0.01)
        os.kill(killed, signal.SIGKILL)
        result = await run.wait()
        stats = await run.refs[worker].ask(GetRoleStats())
    assert node.pid != killed, "the node was restarted in a new process"
    return result, stats


async def test_killing_the_rollout_process_loses_no_group_and_the_run_finishes(
    tmp_path: Path,
) -> None:
    """kill -9 of the Rollout's node mid-run. What its incarnation left behind must not outlive
    it: prompts it had leased go back to the queue, groups whose rows it had allocated but not
    committed are re-injected by the Driver, a claim it left waiting in the queue is withdrawn
    (it would take the prompts its successor needs, under a lease nobody acks), and the
    restarted worker, holding the initial weights, gets the current ones. Each of these
    stalled the run before it was fixed. The sample ledger says so: every prompt trained once
    or reported (``lost`` and injected again, ``unfinished``)."""
    config = tiny(
        "async",
        run_dir=str(tmp_path),
        train={"steps": 6},
        placement={"default": "local", "roles": {"rollout": "gen"}},
    )
    with trio.fail_after(90):
        result, rollout = await kill_mid_run(config, "gen", "rollout-0", after_steps=2)
    assert [r.samples for r in result.records] == [BATCH] * 6
    assert rollout.samples > 0, "the restarted worker took over"
    check = check_samples(read_samples(str(tmp_path)), group_size=4, staleness=1)
    assert check.ok and check.trained == 6 * BATCH, check


async def test_killing_the_reward_process_mid_run_and_the_run_finishes() -> None:
    """kill -9 of the Reward actor's node mid-run, the rollout on a node of its own: the
    rollout's ``Score`` asks in flight fail with the node, and those made while it restarts
    wait for it; the rollout asks again (``roles._ask_again``) instead of crashing. It
    crash-looped until its supervisor gave up, failing the run (6 of 7 kills, #27 §1b)."""
    config = tiny(
        "async",
        train={"steps": 5},
        rollout={"reward": "actor"},
        placement={"default": "local", "roles": {"reward": "rw", "rollout": "gen"}},
    )
    with trio.fail_after(120):
        result, rollout = await kill_mid_run(config, "rw", "rollout-0", after_steps=1)
    assert [r.samples for r in result.records] == [BATCH] * 5
    assert rollout.samples > 0


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
    """Every run with a run_dir ends with its model in ``final`` (the last step saves no
    intermediate checkpoint besides it); a resume from there continues the run, and
    ``keep_last`` removes the older intermediate checkpoints."""
    first = tiny("sync", run_dir=str(tmp_path), train={"steps": 2, "checkpoint_every": 1})
    result = await run_pipeline(first)
    assert [Path(c).name for c in result.checkpoints] == ["step-000001", "final"]
    state = json.loads((Path(result.checkpoints[0]) / "driver.json").read_text())
    assert state["version"] == 1 and state["cursor"] >= 4
    final = tmp_path / "final"
    assert json.loads((final / "driver.json").read_text())["version"] == 2
    assert (final / "policy.safetensors").is_file() and (final / "optimizer.safetensors").is_file()
    resumed = await run_pipeline(
        tiny("sync", run_dir=str(tmp_path), train={"steps": 4, "checkpoint_every": 1,
                                                     "keep_last": 1}),
        resume=str(final),
    )  # fmt: skip
    assert [r.version for r in resumed.records] == [3, 4]
    assert [Path(c).name for c in resumed.checkpoints] == ["step-000003", "final"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000003"]
    assert json.loads((final / "driver.json").read_text())["version"] == 4
    lines = (tmp_path / "steps.jsonl").read_text().splitlines()
    assert [json.loads(line)["version"] for line in lines] == [1, 2, 3, 4]
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]


async def test_a_stopped_run_saves_the_step_it_reports(tmp_path: Path) -> None:
    """``Pipeline.stop()`` mid-run: the result says stopped, its last record is the step
    saved in ``final`` (the model and the Driver's state of one version), and a stop of a run
    whose newest checkpoint holds its last step saves nothing again."""
    config = tiny("async", run_dir=str(tmp_path), train={"steps": 1000})
    async with afa.open_actor_system() as system, open_pipeline(system, config) as run:
        while not run.records:
            await trio.sleep(0.01)
        run.stop()
        with trio.fail_after(30):
            result = await run.wait()
    assert result.stopped and result.latest_checkpoint == str(tmp_path / "final")
    assert result.checkpoints == (str(tmp_path / "final"),)
    state = json.loads((tmp_path / "final" / "driver.json").read_text())
    assert state["version"] == result.version == result.records[-1].version
    saved = (tmp_path / "final" / "policy.safetensors").stat().st_mtime_ns
    async with afa.open_actor_system() as system:
        resumed = tiny("async", run_dir=str(tmp_path), train={"steps": 1000})
        async with open_pipeline(system, resumed, resume=str(tmp_path)) as run:
            run.stop()  # before its first step: the checkpoint it resumed holds its state
            result = await run.wait()
    assert result.stopped and result.latest_checkpoint == str(tmp_path / "final")
    assert (tmp_path / "final" / "policy.safetensors").stat().st_mtime_ns == saved


def fail_syncs(monkeypatch: Any, version: int, times: int) -> list[int]:
    """The first ``times`` syncs of ``version`` fail before any receiver commits (once the
    rollout has had time to lease the prompts admitted for ``version`` and wait for them)."""
    from asyncflow_actors.checkpoint import CheckpointEngine, SyncFailed

    sync = CheckpointEngine.sync
    failed: list[int] = []

    async def failing(self: CheckpointEngine, v: int, weights: Any, *args: Any, **kw: Any) -> Any:
        if v == version and len(failed) < times:
            await trio.sleep(0.05)  # the next prompts are admitted and leased meanwhile
            failed.append(v)
            raise SyncFailed(f"sync of {v} refused (test)", phase="prepare", version=v)
        return await sync(self, v, weights, *args, **kw)

    monkeypatch.setattr(CheckpointEngine, "sync", failing)
    return failed


async def test_a_retried_sync_keeps_staleness_zero_on_policy(monkeypatch: Any) -> None:
    """The prompts of version 2 are admitted while its sync runs; the sync fails once and is
    retried: the rollout waits for the retry, and no sample trains off-policy."""
    failed = fail_syncs(monkeypatch, 2, times=1)
    with trio.fail_after(60):
        result = await run_pipeline(tiny("async", staleness=0, train={"steps": 4}))
    assert failed == [2]
    assert [r.sync.get("sync_retries") for r in result.records[:3]] == [0.0, 1.0, 0.0]
    assert result.offpolicy_samples == 0
    assert [r.staleness for r in result.records] == [(BATCH,)] * 4


async def test_a_sync_that_fails_for_good_fails_the_run(monkeypatch: Any) -> None:
    """Groups admitted for a version whose sync never succeeds wait for it; the run fails
    (``RunFailed``) and stops instead of hanging on them (without ``train.auto_resume``: a
    resumed Trainer would sync again, and here succeed)."""
    from asyncflow_actors.pipeline import RunFailed
    from asyncflow_actors.roles import _trainer

    monkeypatch.setattr(_trainer, "SYNC_ATTEMPTS", 2)
    failed = fail_syncs(monkeypatch, 2, times=2)
    with trio.fail_after(60), pytest.raises(ExceptionGroup) as info:
        await run_pipeline(tiny("async", staleness=0, train={"steps": 4, "auto_resume": False}))
    assert info.group_contains(RunFailed)
    assert failed == [2, 2]
