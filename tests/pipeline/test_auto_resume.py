"""Automatic resume (issue #27 §4): the Trainer's node process killed mid-run; with
``train.auto_resume`` the run restarts it from the newest checkpoint and finishes, keeping the
samples the queue holds; out of retries, or without auto-resume, the run fails naming it."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import trio

import asyncflow_actors as afa
from asyncflow_actors.pipeline import (
    Pipeline,
    PipelineConfig,
    PipelineResult,
    RunFailed,
    check_samples,
    open_pipeline,
    read_samples,
)

from .kit import tiny

STEPS = 6


def _config(run_dir: Path, **train: Any) -> Any:
    return tiny(
        "async",
        run_dir=str(run_dir),
        train={"steps": STEPS, **train},
        placement={"default": "local", "roles": {"trainer": "tr"}},
    )


def _check_ledger(run_dir: Path, config: PipelineConfig, result: PipelineResult) -> None:
    """The sample ledger: every admitted prompt trained once in a step the final model holds
    (or still in flight at the end), within the staleness bound; the attempts the resume
    lost (and only those) reported lost and injected again."""
    records = read_samples(str(run_dir))
    check = check_samples(
        records, group_size=config.rollout.group_size, staleness=config.effective_staleness
    )
    assert check.ok, check
    assert (
        check.trained
        == config.train.steps * config.train.prompts_per_step * config.rollout.group_size
    )
    lost = [r for r in records if r.kind == "not_trained" and r.reason == "lost"]
    assert len(lost) == sum(r.lost_prompts for r in result.resumes) == result.reinjected
    assert all(r.reinjected for r in lost)


def _kill_trainer_at(run: Pipeline, *versions: int) -> list[int]:
    """SIGKILL the Trainer's node process when the Driver records each of ``versions`` (in its
    step's handling: no later step can be checkpointed first); the pids killed."""
    inner = run.hooks.on_step
    assert inner is not None
    killed: list[int] = []

    async def on_step(msg: Any, report: Any, seconds: float) -> None:
        if msg.version in versions[len(killed) :][:1]:
            pid = run.nodes["tr"].pid
            assert pid is not None and pid not in killed
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        await inner(msg, report, seconds)

    run.hooks.on_step = on_step
    return killed


@pytest.mark.parametrize("every", [1, 2])
async def test_a_killed_trainer_resumes_from_its_checkpoint_and_the_run_finishes(
    tmp_path: Path, every: int
) -> None:
    """Killed after step 3: with a checkpoint every step, at most the step under way is lost;
    every 2 steps, step 3 (sent out, not checkpointed) is lost too: its prompts are trained
    again, and the run ends a version later."""
    config = _config(tmp_path, checkpoint_every=every)
    async with afa.open_actor_system() as system, open_pipeline(system, config) as run:
        killed = _kill_trainer_at(run, 3)
        with trio.fail_after(120):
            result = await run.wait()
    assert len(killed) == 1
    assert len(result.resumes) == 1
    resume = result.resumes[0]
    assert resume.attempt == 2
    assert "NodeLost" in resume.cause
    if every == 2:  # step 3 was sent to the receivers, never checkpointed
        assert resume.checkpoint == 2
        assert resume.skipped >= 1
        assert resume.lost_steps >= 1
    # the final model holds ``steps`` optimizer steps: versions sent out but lost are skipped
    assert result.version == STEPS + resume.skipped
    assert resume.version == resume.checkpoint + resume.skipped
    # step numbers continue over the resume, in the result and in steps.jsonl
    assert [r.step for r in result.records] == list(range(1, len(result.records) + 1))
    lines = (tmp_path / "steps.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, len(lines) + 1))
    # the queue's samples were trained after the restart, not generated again: the only
    # prompts injected again are those of the steps the crash lost
    assert result.reinjected == resume.lost_prompts
    assert resume.lost_prompts == resume.lost_steps * config.train.prompts_per_step
    driver = json.loads((tmp_path / "final" / "driver.json").read_text())
    assert driver["version"] == result.version
    _check_ledger(tmp_path, config, result)


async def test_the_trainers_retries_bound_its_node_not_the_root_supervisor(
    tmp_path: Path,
) -> None:
    """A Trainer kill under a root supervisor that allows no restart: the Trainer's node has
    a supervisor of its own, so ``auto_resume_retries`` alone bound its deaths (the root's
    intensity, 3 in 5 s by default, ended the run with ``SupervisorFailed`` first when the
    Trainer was killed in quick succession)."""
    config = _config(tmp_path, checkpoint_every=1, auto_resume_retries=3)
    strategy = afa.OneForOne(max_restarts=0, within=600.0)
    async with (
        afa.open_actor_system(strategy=strategy) as system,
        open_pipeline(system, config) as run,
    ):
        killed = _kill_trainer_at(run, 2)
        with trio.fail_after(120):
            result = await run.wait()
    assert len(killed) == 1
    assert [r.attempt for r in result.resumes] == [2]
    _check_ledger(tmp_path, config, result)


async def test_out_of_retries_the_run_fails_naming_the_trainer(tmp_path: Path) -> None:
    config = _config(tmp_path, steps=8, checkpoint_every=1, auto_resume_retries=1)
    async with afa.open_actor_system() as system, open_pipeline(system, config) as run:
        killed = _kill_trainer_at(run, 1, 3)
        with trio.fail_after(120), pytest.raises(RunFailed) as info:
            await run.wait()
    assert len(killed) == 2
    assert info.value.role == "trainer-0"
    assert isinstance(info.value.__cause__, afa.NodeLost)


async def test_a_trainer_that_raises_resumes_from_the_start_without_checkpoints(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Every role in this process, no checkpoint: the Trainer's third optimizer step raises once.
    Without a checkpoint the new Trainer starts on the initial model, tagged with the version
    the receivers hold; the two steps before are lost, their prompts trained again."""
    from asyncflow_actors.roles import Trainer

    finish = Trainer._finish
    calls: list[int] = []

    def failing(self: Trainer, step: Any) -> Any:
        calls.append(self.version)
        if len(calls) == 3:
            raise ValueError("the loss is not a number (test)")
        return finish(self, step)

    monkeypatch.setattr(Trainer, "_finish", failing)
    config = tiny("async", run_dir=str(tmp_path), train={"steps": 4})
    async with afa.open_actor_system() as system, open_pipeline(system, config) as run:
        with trio.fail_after(60):
            result = await run.wait()
    (resume,) = result.resumes
    assert resume.cause == "ValueError: the loss is not a number (test)"
    assert (resume.checkpoint, resume.version, resume.skipped) == (0, 2, 2)
    assert (resume.lost_steps, resume.lost_prompts) == (2, 2 * config.train.prompts_per_step)
    assert result.reinjected == resume.lost_prompts
    assert result.version == 4 + 2
    assert [r.step for r in result.records] == list(range(1, len(result.records) + 1))
    assert calls[3] == 2  # the new Trainer trains on from the version it took
    _check_ledger(tmp_path, config, result)


def _kill_while_starting(run: Pipeline, killed: list[int], times: int) -> list[int]:
    """After the first kill, SIGKILL the Trainer's node ``times`` more times while a resumed
    Trainer starts there (0.2 s into each spawn once the node runs a new process, or as the
    spawn returns if sooner: in its ``on_start`` or just after); the pids killed there."""
    assert run.resumer is not None
    place = run.resumer.place
    spawn = place.spawn
    again: list[int] = []

    async def new_pid() -> int:
        while (pid := run.nodes["tr"].pid) is None or pid in killed:
            await trio.sleep(0.05)
        return pid

    async def spawning(cls: Any, *, role: str, **kwargs: Any) -> Any:
        if role != "trainer" or len(again) >= times:
            return await spawn(cls, role=role, **kwargs)
        with trio.fail_after(60):
            pid = await new_pid()

        spawned = trio.Event()

        async def kill() -> None:
            # 0.2 s in, or as the spawn returns if sooner (a Trainer that starts quickly
            # would otherwise have finished the run before the kill): never after it
            with trio.move_on_after(0.2):
                await spawned.wait()
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            again.append(pid)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(kill)
            try:  # raised outside the nursery: the resumer sees the spawn's own error
                return await spawn(cls, role=role, **kwargs)
            except Exception as exc:
                error = exc
            finally:
                spawned.set()
        raise error

    place.spawn = spawning  # type: ignore[method-assign]
    return again


@pytest.mark.heavy
async def test_a_trainer_killed_while_its_resume_starts_is_resumed_again(
    tmp_path: Path,
) -> None:
    """Killed after step 3 (checkpoints every 2 steps: step 3 lost, its weights sent), then its
    successor's node killed while it starts, 5 times: each is one more attempt, and the run
    finishes with every prompt trained once (the rollbacks of the interrupted resumes lose
    only what the dead Trainers reported)."""
    config = _config(tmp_path, checkpoint_every=2, auto_resume_retries=6)
    # six deaths of one node within seconds: auto_resume_retries alone bound them (the root
    # supervisor's intensity, 3 in 5 s, does not count the Trainer's node)
    async with afa.open_actor_system() as system, open_pipeline(system, config) as run:
        killed = _kill_trainer_at(run, 3)
        again = _kill_while_starting(run, killed, 5)
        with trio.fail_after(240):
            result = await run.wait()
    assert len(again) == 5 and len(killed) == 6
    assert [r.attempt for r in result.resumes] == [2, 3, 4, 5, 6, 7]
    assert all("NodeLost" in r.cause for r in result.resumes)
    first = result.resumes[0]
    assert (first.checkpoint, first.lost_steps) == (2, 1) and first.skipped >= 1
    skipped = sum(r.skipped for r in result.resumes)
    assert result.version == STEPS + skipped
    assert [r.step for r in result.records] == list(range(1, len(result.records) + 1))
    lines = (tmp_path / "steps.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, len(lines) + 1))
    assert result.reinjected == sum(r.lost_prompts for r in result.resumes)
    _check_ledger(tmp_path, config, result)


@pytest.mark.heavy
async def test_deaths_while_resuming_spend_the_retries(tmp_path: Path) -> None:
    """Each death of a starting Trainer is an attempt: with 2 retries, the kill at step 1 and
    two kills while its successors start fail the run, naming the trainer."""
    config = _config(tmp_path, checkpoint_every=1, auto_resume_retries=2)
    async with afa.open_actor_system() as system, open_pipeline(system, config) as run:
        killed = _kill_trainer_at(run, 1)
        again = _kill_while_starting(run, killed, 2)
        with trio.fail_after(120), pytest.raises(RunFailed) as info:
            await run.wait()
    assert len(again) == 2
    assert info.value.role == "trainer-0"
    assert isinstance(info.value.__cause__, afa.NodeLost)
