"""Automatic resume of the Driver (issue #27 §4): a Driver that raises mid-run is resumed in
its own cell from the state it held; the run finishes with ``train.steps`` steps and the ledger
shows every sample trained once; out of retries the run fails naming the Driver's error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

import asyncflow_actors as afa
from asyncflow_actors.pipeline import (
    PipelineConfig,
    PipelineResult,
    RunFailed,
    check_samples,
    open_pipeline,
    read_samples,
)
from asyncflow_actors.roles import Driver

from .kit import tiny

STEPS = 5


def _check(run_dir: Path, config: PipelineConfig, result: PipelineResult) -> None:
    """``train.steps`` steps reported once each, and a ledger with every admitted prompt
    trained once (or in flight at the end), nothing lost, duplicated or stale."""
    assert result.version == config.train.steps
    assert [r.version for r in result.records] == list(range(1, config.train.steps + 1))
    assert [r.step for r in result.records] == list(range(1, config.train.steps + 1))
    records = read_samples(str(run_dir))
    check = check_samples(
        records, group_size=config.rollout.group_size, staleness=config.effective_staleness
    )
    assert check.ok, check
    assert (
        check.trained
        == config.train.steps * config.train.prompts_per_step * config.rollout.group_size
    )


def _raise_once_in_step(monkeypatch: pytest.MonkeyPatch, version: int, times: int = 1) -> None:
    """The Driver's handling of step ``version``'s ``StepDone`` raises ``times`` times (after
    it released the step's slots and before it synced the weights: the worst place)."""
    sync = Driver._sync_weights
    raised: list[int] = []

    async def failing(self: Driver, trainer: Any, v: int) -> Any:
        if v == version and len(raised) < times:
            raised.append(v)
            raise RuntimeError(f"driver bug at step {v} (test)")
        return await sync(self, trainer, v)

    monkeypatch.setattr(Driver, "_sync_weights", failing)


@pytest.mark.parametrize("placement", ["local", "process"])
async def test_a_driver_that_raises_in_a_step_is_resumed_and_the_run_finishes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, placement: str
) -> None:
    """In this process, and with one process per role (the Trainer asks its ``StepDone``
    again across the wire): the step is handled once, nothing generated again. No checkpoint
    was written (``checkpoint_every = 0``): the Driver resumes from the state it held, which
    no checkpoint is needed for."""
    _raise_once_in_step(monkeypatch, 2)
    config = tiny(
        "async", run_dir=str(tmp_path), train={"steps": STEPS},
        placement={"default": placement},
    )  # fmt: skip
    async with afa.open_actor_system() as system, open_pipeline(system, config) as run:
        with trio.fail_after(120):
            result = await run.wait()
    (resume,) = result.resumes
    assert resume.role == "driver"
    assert resume.attempt == 2
    assert resume.cause == "RuntimeError: driver bug at step 2 (test)"
    assert (resume.lost_steps, resume.lost_prompts, resume.skipped) == (0, 0, 0)
    assert (resume.checkpoint, resume.version) == (0, 2)  # none yet; raised in step 2
    assert result.reinjected == 0  # every group the queue held was trained
    _check(tmp_path, config, result)


async def test_a_driver_resumes_with_checkpoints_and_the_final_model_is_saved(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With a checkpoint every step, the resume saves the step it handles again, and the run
    ends with its final model and a Driver state at the last version."""
    _raise_once_in_step(monkeypatch, 3)
    config = tiny("async", run_dir=str(tmp_path), train={"steps": STEPS, "checkpoint_every": 1})
    async with afa.open_actor_system() as system, open_pipeline(system, config) as run:
        with trio.fail_after(120):
            result = await run.wait()
    (resume,) = result.resumes
    assert resume.checkpoint == 2  # the newest checkpoint when it raised
    assert (tmp_path / "final" / "driver.json").exists()
    assert (tmp_path / "checkpoints" / "step-000003").exists()
    _check(tmp_path, config, result)


async def test_a_driver_that_raises_while_it_admits_puts_the_prompts_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The prompts put fails after their groups opened: the resumed Driver puts them again
    into those groups (their slots and attempt kept), so none is lost or admitted twice."""
    from asyncflow_actors.roles import PROMPTS
    from asyncflow_actors.transfer_queue import TransferQueueClient

    put = TransferQueueClient.put
    calls: list[int] = []

    async def failing(self: TransferQueueClient, topic: str, *args: Any, **kwargs: Any) -> Any:
        if topic == PROMPTS and self.holder == "driver":
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("prompts put failed (test)")
        return await put(self, topic, *args, **kwargs)

    monkeypatch.setattr(TransferQueueClient, "put", failing)
    config = tiny("async", run_dir=str(tmp_path), train={"steps": STEPS})
    async with afa.open_actor_system() as system, open_pipeline(system, config) as run:
        with trio.fail_after(120):
            result = await run.wait()
    (resume,) = result.resumes
    assert resume.cause == "RuntimeError: prompts put failed (test)"
    records = read_samples(str(tmp_path))
    assert not [r for r in records if r.kind == "not_trained" and r.reason != "unfinished"]
    _check(tmp_path, config, result)


async def test_out_of_retries_the_run_fails_naming_the_driver(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _raise_once_in_step(monkeypatch, 2, times=2)
    config = tiny("async", run_dir=str(tmp_path), train={"steps": STEPS, "auto_resume_retries": 1})
    async with afa.open_actor_system() as system, open_pipeline(system, config) as run:
        with trio.fail_after(120), pytest.raises(RunFailed) as info:
            await run.wait()
    assert info.value.role == "driver"
    assert str(info.value.error) == "driver bug at step 2 (test)"


async def test_without_auto_resume_a_driver_that_raises_fails_the_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _raise_once_in_step(monkeypatch, 2)
    config = tiny("async", run_dir=str(tmp_path), train={"steps": STEPS, "auto_resume": False})
    async with afa.open_actor_system() as system, open_pipeline(system, config) as run:
        with trio.fail_after(120), pytest.raises(RunFailed) as info:
            await run.wait()
    assert info.value.role == "driver"
    assert isinstance(info.value.error, RuntimeError)


def _raise_on_call(monkeypatch: pytest.MonkeyPatch, owner: type, name: str, call: int) -> None:
    """``owner.name`` raises on its ``call``-th call (at entry: nothing of it done)."""
    inner = getattr(owner, name)
    calls: list[int] = []

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == call:
            raise RuntimeError(f"{name} failed (test)")
        return inner(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)


@pytest.mark.parametrize(
    "where",
    [
        "step trained",  # the Trainer's StepTrained: asked again
        "after the sync",  # the step synced, its record not yet reported
        "checkpoint mark",  # the Trainer saved, the Driver's state not yet written
    ],
)
async def test_a_driver_raising_at_each_point_of_a_step_resumes_exactly_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, where: str
) -> None:
    from asyncflow_actors.roles._driver_resume import UnsavedSteps
    from asyncflow_actors.roles._driver_tasks import DriverTasks
    from asyncflow_actors.roles._ledger import SampleLedger

    if where == "step trained":
        _raise_on_call(monkeypatch, UnsavedSteps, "trained", 2)
    elif where == "after the sync":
        _raise_on_call(monkeypatch, DriverTasks, "with_metrics", 2)
    else:
        _raise_on_call(monkeypatch, SampleLedger, "save_mark", 2)
    config = tiny("async", run_dir=str(tmp_path), train={"steps": STEPS, "checkpoint_every": 1})
    async with afa.open_actor_system() as system, open_pipeline(system, config) as run:
        with trio.fail_after(120):
            result = await run.wait()
    (resume,) = result.resumes
    assert resume.role == "driver" and "failed (test)" in resume.cause
    assert result.reinjected == 0
    assert (tmp_path / "checkpoints" / "step-000002" / "driver.json").exists()
    _check(tmp_path, config, result)


async def test_a_resumed_driver_that_raises_again_is_resumed_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The step asked again raises again: a second resume, from the first one's state."""
    _raise_once_in_step(monkeypatch, 2, times=2)
    config = tiny("async", run_dir=str(tmp_path), train={"steps": STEPS})
    async with afa.open_actor_system() as system, open_pipeline(system, config) as run:
        with trio.fail_after(120):
            result = await run.wait()
    assert [(r.role, r.attempt) for r in result.resumes] == [("driver", 2), ("driver", 3)]
    _check(tmp_path, config, result)
