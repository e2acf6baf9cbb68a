"""The sample ledger across an automatic resume (``SampleLedger.lose_steps``): the steps no
checkpoint holds are taken back, from the file and from the buffer, and their attempts end
``lost`` and injected again; the ledger then checks exactly-once."""

from __future__ import annotations

from pathlib import Path

from asyncflow_actors.pipeline import check_samples, read_samples
from asyncflow_actors.roles._driver_resume import UnsavedSteps
from asyncflow_actors.roles._ledger import SampleLedger
from asyncflow_actors.roles._messages import StepDone, StepTrained, TrainedSamples

GROUP = 2


def _step(version: int, prompts: list[int], attempt: int = 0) -> StepDone:
    """Step ``version`` trained the whole groups of ``prompts`` (admitted for version 0)."""
    n = len(prompts) * GROUP
    trained = TrainedSamples(
        prompt=tuple(p for p in prompts for _ in range(GROUP)),
        attempt=(attempt,) * n,
        admitted=(0,) * n,
        index=tuple(i for _ in prompts for i in range(GROUP)),
        oldest=(version - 1,) * n,
        newest=(version - 1,) * n,
        reward=(1.0,) * n,
    )
    return StepDone(version, n, n, tuple(prompts), (n,), {}, trained)


async def test_lost_steps_are_taken_back_and_their_prompts_trained_once(tmp_path: Path) -> None:
    ledger = await SampleLedger.open(str(tmp_path), None, 0)
    for prompt in range(6):
        ledger.admitted(prompt, 0, 0)
    ledger.trained(_step(1, [0, 1]))
    checkpoint = tmp_path / "checkpoints" / "step-000001"
    await ledger.save_mark(str(checkpoint), ledger.mark())  # the checkpoint holds step 1
    ledger.trained(_step(2, [2]))
    await ledger.flush()  # step 2 in the file, step 3 buffered: both are lost
    ledger.trained(_step(3, [3]))
    # step 4 (prompt 4) was reported by the Trainer but never to the ledger: still in flight
    await ledger.lose_steps([2, 3], [4], str(checkpoint))
    for prompt in (2, 3, 4):  # injected again: the next attempt, trained after the resume
        ledger.admitted(prompt, ledger.next_attempt(prompt), 1)
    ledger.trained(_step(4, [2, 3, 4], attempt=1))
    ledger.trained(_step(5, [5]))
    await ledger.flush()

    records = read_samples(str(tmp_path))
    check = check_samples(records, group_size=GROUP, staleness=1)
    assert check.ok, check
    assert check.trained == 6 * GROUP
    lost = sorted((r.prompt_id, r.attempt) for r in records if r.kind == "not_trained")
    assert lost == [("2", 0), ("3", 0), ("4", 0)]
    assert all(r.reinjected for r in records if r.kind == "not_trained")
    assert sorted({r.step for r in records if r.kind == "trained"}) == [1, 4, 5]
    assert ledger.mark() == len(records)  # a later checkpoint's mark counts the file


def test_a_step_trained_but_not_reported_keeps_its_prompts_pending() -> None:
    """``StepTrained`` takes a step's groups out of ``inflight`` before its ``StepDone``: a
    stop or checkpoint in between must still count their prompts as not trained (a stopped
    run's ledger once missed them: neither trained nor unfinished)."""
    inflight = {10: 4, 11: 5, 12: 6}  # group id -> prompt index
    unsaved = UnsavedSteps()
    unsaved.trained(StepTrained(2, (10, 11), (0, 1, 2, 3)), inflight)
    assert inflight == {12: 6}
    assert unsaved.unreported() == {4, 5}
    unsaved.released(2)  # its StepDone came: trained, reported
    assert unsaved.unreported() == set()
