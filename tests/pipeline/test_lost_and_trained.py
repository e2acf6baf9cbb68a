"""A group reported lost that the Trainer trained all the same (issue #27 §5: the 30-minute
soak's steady evictions). A storage unit that dies while the Trainer holds a fetched lease makes
the queue report the lease's groups lost; when that event reaches the Driver before the step's
``StepDone``, the Driver has injected the prompt again keeping its slots, and the ``StepDone``
released them once more: one prompt in flight too many for the rest of the run (evicted over and
over) and the prompt trained twice. The race is played here deterministically: the Driver takes
the event for one group of a step just before the Trainer reports that step. It keeps a lost
group in flight until the reports show the Trainer did not train it (``LostGroups``); the net
behind that (``settle_replaced``: the prompt's newer attempt withdrawn, or its slots kept) is
played by injecting the prompt again at once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio

from asyncflow_actors.pipeline import check_samples, run_pipeline
from asyncflow_actors.pipeline import read_samples as read_ledger
from asyncflow_actors.roles._driver import Driver
from asyncflow_actors.roles._driver_replaced import LostGroups
from asyncflow_actors.roles._messages import StepDone, StepTrained
from asyncflow_actors.transfer_queue import GroupError, TransferQueueClient

from .kit import tiny

LOST_AT = (2, 5)  # the steps one of whose groups is reported lost before their StepDone


def lost_before_the_report(monkeypatch: Any, *, at_once: bool = True) -> list[tuple[int, int]]:
    """Before the Trainer's first report of each step of ``LOST_AT`` (``StepTrained`` with
    ``train.auto_resume``, else ``StepDone``), the Driver takes a ``lost`` event for the step's
    first group: as ``_watch_events`` does, or (``at_once``) injecting its prompt again at once
    as it did before ``LostGroups``."""
    real = Driver.receive
    played: list[tuple[int, int]] = []

    async def receive(self: Driver, msg: Any, ctx: Any) -> Any:
        first = isinstance(msg, (StepTrained, StepDone)) and msg.version not in [
            v for v, _ in played
        ]
        if first and msg.version in LOST_AT and msg.groups:
            played.append((msg.version, msg.groups[0]))
            if at_once:
                assert await self._reinject(msg.groups[0], "lost")
            else:
                self.lost.defer(msg.groups[:1], self.version)
        return await real(self, msg, ctx)

    monkeypatch.setattr(Driver, "receive", receive)
    return played


async def test_a_group_reported_lost_stays_in_flight_until_the_trainer_reports(
    monkeypatch: Any, tmp_path: Path
) -> None:
    played = lost_before_the_report(monkeypatch, at_once=False)
    steps = 12
    config = tiny("async", run_dir=str(tmp_path), train={"steps": steps})
    with trio.fail_after(120):
        result = await run_pipeline(config)
    assert [v for v, _ in played] == list(LOST_AT)
    assert [r.samples for r in result.records] == [16] * steps
    records = read_ledger(str(tmp_path))
    check = check_samples(records, group_size=4, staleness=config.effective_staleness)
    assert check.ok, check
    # trained by the step the Trainer was on: never injected again, nothing withdrawn
    reasons = [r.reason for r in records if r.kind == "not_trained"]
    assert set(reasons) <= {"unfinished"}, reasons


def test_lost_groups_are_decided_by_the_report_two_versions_on() -> None:
    lost = LostGroups()
    lost.defer((7, 8, 9), 10)  # reported lost at the Driver's version 10
    inflight = {7: 70, 8: 80, 9: 90}
    del inflight[8]  # trained by step 11
    assert lost.decided(11, inflight) == []
    del inflight[9]  # trained by step 12
    assert lost.decided(12, inflight) == [7]  # not trained by the step after: injected again
    assert lost.decided(12, inflight) == [7]  # (until it is: a Driver may raise before)
    del inflight[7]  # injected again
    assert lost.decided(13, inflight) == []
    assert lost.due == {}


async def test_a_group_reported_lost_and_trained_leaves_no_prompt_in_flight_too_many(
    monkeypatch: Any, tmp_path: Path
) -> None:
    played = lost_before_the_report(monkeypatch)
    steps = 12
    config = tiny("async", run_dir=str(tmp_path), train={"steps": steps})
    with trio.fail_after(120):
        result = await run_pipeline(config)
    assert [v for v, _ in played] == list(LOST_AT)
    assert [r.samples for r in result.records] == [16] * steps
    records = read_ledger(str(tmp_path))
    check = check_samples(records, group_size=4, staleness=config.effective_staleness)
    # the prompt's newer attempt was withdrawn: trained once, and no prompt in flight beyond
    # the slots (each would be evicted again and again)
    assert check.ok, check
    reasons = [r.reason for r in records if r.kind == "not_trained"]
    assert reasons.count("lost") == len(LOST_AT)
    assert reasons.count("withdrawn") == len(LOST_AT)
    assert "evicted" not in reasons


async def test_an_attempt_that_cannot_be_withdrawn_keeps_the_slots(
    monkeypatch: Any, tmp_path: Path
) -> None:
    # the newer attempt's group refuses the withdrawal (as when a member was written already):
    # it is trained too, and the trained group's slots stay with it instead of being released
    played = lost_before_the_report(monkeypatch)
    refused: list[int] = []

    async def shrink_group(self: TransferQueueClient, topic: str, group: Any, slots: int) -> None:
        await trio.lowlevel.checkpoint()
        refused.append(int(group))
        raise GroupError(f"topic {topic!r}: group {group} has a member written (test)")

    monkeypatch.setattr(TransferQueueClient, "shrink_group", shrink_group)
    steps = 12
    config = tiny("async", run_dir=str(tmp_path), train={"steps": steps})
    with trio.fail_after(120):
        result = await run_pipeline(config)
    assert len(played) == len(refused) == len(LOST_AT)
    assert [r.samples for r in result.records] == [16] * steps
    records = read_ledger(str(tmp_path))
    check = check_samples(records, group_size=4, staleness=config.effective_staleness)
    assert not (check.lost or check.duplicated or check.stale)
    assert len(check.retrained) == len(LOST_AT)  # the price of a written attempt
    reasons = [r.reason for r in records if r.kind == "not_trained"]
    assert "evicted" not in reasons and "withdrawn" not in reasons
