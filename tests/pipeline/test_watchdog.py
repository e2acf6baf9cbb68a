"""The watchdog: a planted stall of each kind fails the run with ``RunStalled`` naming it; a
healthy run with the default settings never hears from it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import trio

import asyncflow_actors as afa
from asyncflow_actors.checkpoint import SYNC_MESSAGES
from asyncflow_actors.pipeline import Diagnosis, PipelineConfigError, RunStalled, open_pipeline
from asyncflow_actors.pipeline._watchdog import RoleWaits, format_diagnosis
from asyncflow_actors.roles import ActorForward
from asyncflow_actors.transfer_queue import (
    FlowControlStatistics,
    HolderStatistics,
    TransferQueueClient,
)
from asyncflow_actors.transfer_queue import _messages as M

from .kit import tiny

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

# Small limits: each planted stall fails in seconds. No first-step allowance: the stalls come
# before or at the first step.
QUICK = {"warn_s": 2.0, "fail_s": 5.0, "first_step_s": 0.0}


def stalled(error: BaseException) -> RunStalled:
    """The ``RunStalled`` in ``error`` (trio's groups unwrapped)."""
    if isinstance(error, RunStalled):
        return error
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            try:
                return stalled(inner)
            except AssertionError:
                pass
    raise AssertionError(f"no RunStalled in {error!r}") from error


async def stall(config: Any) -> Diagnosis:
    """Run ``config`` (which stalls): the diagnosis of the ``RunStalled`` it fails with."""
    with trio.fail_after(60):  # no watchdog (a regression): fail, do not hang
        try:
            # a planted stall may leave its actor stuck for good (a handler that never
            # returns): its stop is killed past the grace, here a short one
            async with (
                afa.open_actor_system(shutdown_grace=1.0) as system,
                open_pipeline(system, config) as run,
            ):
                await run.wait()
        except (RunStalled, BaseExceptionGroup) as exc:  # alone, or in the run's group
            error = stalled(exc)
        else:
            raise AssertionError("the run finished: nothing stalled")
    text = str(error)
    assert text.startswith("run stalled: no step for ")
    assert error.diagnosis.text() in text
    return error.diagnosis


async def test_a_consumer_that_never_acks_is_named(monkeypatch: Any) -> None:
    """ActorForward writes its columns but never acks its lease: the diagnosis names the
    lease it holds, by holder and consumer."""
    ack = TransferQueueClient.ack

    async def never_for_forward(self: TransferQueueClient, batch: Any) -> Any:
        if self.holder.startswith("actor_fwd"):
            await trio.sleep_forever()
        return await ack(self, batch)

    monkeypatch.setattr(TransferQueueClient, "ack", never_for_forward)
    d = await stall(tiny("async", watchdog=QUICK))
    held = [h for h in d.holders if h.holder == "actor_fwd-0" and h.topic == "rollout"]
    assert len(held) == 1 and held[0].consumer == "actor_fwd" and held[0].leases == 1
    assert held[0].leased == 8  # train.forward_batch
    assert (
        d.headline()
        == "'actor_fwd-0' holds 8 sample(s) of 'rollout' unacked (consumer 'actor_fwd')"
    )
    assert (
        "actor_fwd-0 (consumer 'actor_fwd'): holds 1 lease(s) of 8 sample(s) not acked" in d.text()
    )
    trainer = next(r for r in d.roles if r.worker == "trainer-0")
    assert trainer.answered and any("claiming" in w for w in trainer.waits)


async def test_a_weight_receiver_that_never_answers_is_named(monkeypatch: Any) -> None:
    """ActorForward never answers the weight sync after the first step: the trainer, still
    answering, names the phase and the receiver it waits for; the receiver itself is named as
    silent; the Driver waits for the sync."""
    handle = ActorForward.handle

    async def silent(self: ActorForward, msg: Any, ctx: Any) -> Any:
        if isinstance(msg, SYNC_MESSAGES):
            await trio.sleep_forever()
        return await handle(self, msg, ctx)

    monkeypatch.setattr(ActorForward, "handle", silent)
    # engines that pause for a sync: the rollout's hold until the sync resumes them
    d = await stall(tiny("async", rollout={"pause_mode": "abort"}, watchdog=QUICK))
    trainer = next(r for r in d.roles if r.worker == "trainer-0")
    assert trainer.answered
    (sync,) = [w for w in trainer.waits if w.startswith("weight sync")]
    assert sync.startswith("weight sync of version 1 in phase broadcast for ")
    assert sync.endswith(" s, waiting for 'actor_fwd-0'")
    assert d.headline() == f"trainer-0: {sync}"
    forward = next(r for r in d.roles if r.worker == "actor_fwd-0")
    assert not forward.answered
    assert "actor_fwd-0: did not answer within 1.0 s" in d.text()
    assert d.driver == "the trainer's answer to the weight sync of version 1"
    rollout = next(r for r in d.roles if r.worker == "rollout-0")
    assert any(w.startswith("paused by weight sync 1-") for w in rollout.waits), rollout


async def test_a_group_never_committed_is_named(monkeypatch: Any) -> None:
    """The rollout allocates its groups' rows but never commits them: the diagnosis names the
    uncommitted samples and their groups by writer, and the groups the Driver opened."""
    ask = TransferQueueClient._ask

    async def no_commit(self: TransferQueueClient, msg: Any) -> Any:
        if isinstance(msg, M.Commit) and msg.topic == "rollout" and self.holder == "rollout-0":
            await trio.sleep_forever()
        return await ask(self, msg)

    monkeypatch.setattr(TransferQueueClient, "_ask", no_commit)
    d = await stall(tiny("async", watchdog=QUICK))
    (writer,) = [h for h in d.holders if h.holder == "rollout-0" and h.topic == "rollout"]
    assert writer.uncommitted >= 4 and writer.uncommitted % 4 == 0  # whole groups of 4
    assert len(writer.group_ids) == writer.uncommitted // 4
    (opener,) = [h for h in d.holders if h.holder == "driver" and h.topic == "rollout"]
    assert set(writer.group_ids) <= set(opener.group_ids)
    assert d.headline() == (
        f"'rollout-0' allocated {writer.uncommitted} sample(s) of 'rollout' and did not commit them"
    )
    assert (
        f"rollout-0: {writer.uncommitted} sample(s) allocated, not committed; groups " in d.text()
    )
    assert d.slots is not None and d.slots.in_flight > 0


async def test_a_healthy_run_with_the_defaults_hears_nothing(tmp_path: Path) -> None:
    config = tiny("async", run_dir=str(tmp_path))
    with trio.fail_after(120):
        async with afa.open_actor_system() as system, open_pipeline(system, config) as run:
            result = await run.wait()
    assert len(result.records) == 3
    assert run.watchdog.warnings == 0
    assert not (tmp_path / "watchdog.log").exists()


def slow_step(monkeypatch: Any, version: int, seconds: float) -> None:
    """The Driver handles the ``StepDone`` of ``version`` ``seconds`` late: that step
    completes (for the watchdog too) that much later. (The trainer's step comes after every
    role started, so after the watchdog did.)"""
    from asyncflow_actors.roles._driver import Driver

    step_done = Driver._step_done

    async def slow(self: Driver, msg: Any) -> Any:
        if msg.version == version:
            await trio.sleep(seconds)
        return await step_done(self, msg)

    monkeypatch.setattr(Driver, "_step_done", slow)


async def test_the_warning_is_logged_and_the_run_goes_on(
    monkeypatch: Any, tmp_path: Path, caplog: Any
) -> None:
    """A step slower than ``warn_s`` but faster than ``fail_s``: one warning with the
    diagnosis (in the log and in run_dir/watchdog.log), and the run finishes."""
    slow_step(monkeypatch, 2, 4.0)
    quick = {"warn_s": 1.5, "fail_s": 60.0, "first_step_s": 0.0}
    config = tiny("async", run_dir=str(tmp_path), watchdog=quick)
    with trio.fail_after(60):
        async with afa.open_actor_system() as system, open_pipeline(system, config) as run:
            result = await run.wait()
    assert len(result.records) == 3
    assert run.watchdog.warnings >= 1
    written = (tmp_path / "watchdog.log").read_text()
    assert " warning: no step for " in written and " after step 1: " in written
    assert any("made no step" in r.getMessage() for r in caplog.records)


async def test_the_first_step_has_its_own_allowance(monkeypatch: Any, tmp_path: Path) -> None:
    """A first step slower than ``warn_s`` but within ``warn_s + first_step_s`` (models warm
    up, caches fill) is not a stall: nothing is logged for it."""
    slow_step(monkeypatch, 1, 4.0)
    allowance = {"warn_s": 1.5, "fail_s": 60.0, "first_step_s": 30.0}
    config = tiny("async", run_dir=str(tmp_path), watchdog=allowance)
    with trio.fail_after(60):
        async with afa.open_actor_system() as system, open_pipeline(system, config) as run:
            result = await run.wait()
    assert len(result.records) == 3
    log = tmp_path / "watchdog.log"
    # (a later step slower than 1.5 s on a loaded machine may warn: not the subject here)
    assert not log.exists() or " after step 0: " not in log.read_text()


def test_the_diagnosis_reads_as_who_waits_on_what() -> None:
    d = Diagnosis(
        stalled_s=12.34,
        step=2,
        answer_s=1.0,
        slots=FlowControlStatistics(32, 32, 0, 1, 4, 40, 8),
        driver="the trainer's answer to the weight sync of version 3",
        holders=(
            HolderStatistics("actor_fwd-0", "rollout", "actor_fwd", leases=1, leased=8),
            HolderStatistics("driver", "rollout", open_groups=20, group_ids=tuple(range(16))),
            HolderStatistics("rollout-0", "rollout", uncommitted=4, group_ids=(7,)),
            HolderStatistics("trainer-0", "rollout", "trainer", claims=1, claimed=16),
        ),
        ready=(("rollout", "trainer", 0), ("rollout", "actor_fwd", 12)),
        roles=(
            RoleWaits("rollout-0", True, 3, 0, (
                "paused by weight sync 3-ab12 (its engines hold)",
            )),
            RoleWaits("actor_fwd-0", False),
            RoleWaits("trainer-0", True, 3, 2, (
                "weight sync of version 3 in phase broadcast for 10.0 s, waiting for 'actor_fwd-0'",
            )),
            RoleWaits("advantage-0", True, None, 2),
        ),
    )  # fmt: skip
    assert format_diagnosis(d) == "\n".join([
        "no step for 12.3 s after step 2: trainer-0: weight sync of version 3 in phase "
        "broadcast for 10.0 s, waiting for 'actor_fwd-0'",
        "  driver: 32 of 32 FlowControl slots in flight, 1 admission(s) waiting for 4 slot(s); "
        "waits for the trainer's answer to the weight sync of version 3",
        "  queue 'rollout':",
        "    actor_fwd-0 (consumer 'actor_fwd'): holds 1 lease(s) of 8 sample(s) not acked",
        "    driver: 20 group(s) opened, not complete; groups 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, "
        "11, 12, 13, 14, 15...",
        "    rollout-0: 4 sample(s) allocated, not committed; groups 7",
        "    trainer-0 (consumer 'trainer'): 1 claim(s) waiting for 16 sample(s)",
        "    ready: 0 for 'trainer', 12 for 'actor_fwd'",
        "  roles:",
        "    rollout-0 (version 3, 0 steps): paused by weight sync 3-ab12 (its engines hold)",
        "    actor_fwd-0: did not answer within 1.0 s",
        "    trainer-0 (version 3, 2 steps): weight sync of version 3 in phase broadcast for "
        "10.0 s, waiting for 'actor_fwd-0'",
        "    advantage-0 (2 steps): no wait reported",
    ])  # fmt: skip
    assert RunStalled(d).diagnosis is d
    assert str(RunStalled(d)).splitlines()[0] == "run stalled: " + d.text().splitlines()[0]


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"warn_s": 10, "fail_s": 10}, "watchdog.fail_s: expected more than warn_s = 10, got 10"),
        ({"warn_s": 0}, "watchdog.warn_s: expected a number > 0, got 0"),
        ({"first_step_s": -1}, "watchdog.first_step_s: expected a number >= 0, got -1"),
        ({"enabled": "yes"}, "watchdog.enabled: expected a bool, got 'yes'"),
    ],
)
def test_watchdog_settings_are_checked(table: dict[str, Any], message: str) -> None:
    with pytest.raises(PipelineConfigError) as info:
        tiny("async", watchdog=table)
    assert str(info.value) == message


def test_the_cli_names_the_stall_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: Any
) -> None:
    """``asyncflow train`` of a stalled run: one line naming the stall and the file with the
    whole diagnosis, exit 1. (In sync mode the forward's one batch is the whole first step:
    its columns written, step 1 trains; the second step waits for the unacked forward.)"""
    import os
    import re

    from asyncflow_actors import cli

    ack = TransferQueueClient.ack

    async def never_for_forward(self: TransferQueueClient, batch: Any) -> Any:
        if self.holder.startswith("actor_fwd"):
            await trio.sleep_forever()
        return await ack(self, batch)

    monkeypatch.setattr(TransferQueueClient, "ack", never_for_forward)
    (tmp_path / "run.toml").write_text(
        'mode = "sync"\nrun_dir = "run"\nprogress = "none"\nplot = false\n'
        "[model]\nd_model = 32\nn_layers = 1\nn_heads = 2\nmax_seq_len = 16\n"
        "[rollout]\ngroup_size = 4\nmax_new_tokens = 4\n"
        "[train]\nsteps = 2\nprompts_per_step = 2\n"
        '[placement]\ndefault = "local"\n'
        "[watchdog]\nwarn_s = 2.0\nfail_s = 5.0\nfirst_step_s = 0.0\n"
    )
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["train", "run.toml"])
    finally:
        os.chdir(cwd)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 1
    assert len(lines) == 1 and re.fullmatch(
        r"asyncflow train: RunStalled: run stalled: no step for [0-9.]+ s after step 1: "
        r"'actor_fwd-0' holds 8 sample\(s\) of 'rollout' unacked \(consumer 'actor_fwd'\) "
        r"\(the diagnosis: run/watchdog\.log; --debug: the full trace\)",
        lines[0],
    ), lines
    written = (tmp_path / "run" / "watchdog.log").read_text()
    assert " warning: no step for " in written and " failed: no step for " in written
