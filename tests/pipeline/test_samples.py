"""The sample ledger (``run_dir/samples.jsonl``): every prompt a run admits is trained exactly
once or reported with a reason, within the staleness bound, and a resume continues the file
from its checkpoint without repeating a sample. ``read_samples`` names a malformed line;
``check_samples`` finds lost, duplicated and stale samples in hand-made ledgers."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from asyncflow_actors.pipeline import (
    SampleRecord,
    SamplesFileError,
    check_samples,
    read_samples,
    run_pipeline,
)

from .kit import tiny

BATCH = 16  # 4 groups of 4
GROUP = 4


def _trained(records: list[SampleRecord]) -> list[SampleRecord]:
    return [r for r in records if r.kind == "trained"]


@pytest.mark.parametrize("staleness", [0, 1])
async def test_a_run_trains_every_admitted_prompt_once_or_says_why_not(
    tmp_path: Path, staleness: int
) -> None:
    config = tiny("async", staleness=staleness, run_dir=str(tmp_path))
    result = await run_pipeline(config)
    records = read_samples(str(tmp_path))
    trained = _trained(records)
    assert len(trained) == result.samples == 3 * BATCH
    assert Counter(r.step for r in trained) == {1: BATCH, 2: BATCH, 3: BATCH}
    assert all(r.trainer_version == r.step - 1 for r in trained)  # type: ignore[operator]
    check = check_samples(records, group_size=GROUP, staleness=staleness)
    assert check.ok, check
    assert check.trained == 3 * BATCH
    per_prompt = Counter(r.prompt_id for r in trained)
    assert set(per_prompt.values()) == {GROUP}
    ended = [r for r in records if r.kind == "not_trained"]
    assert {r.reason for r in ended} <= {"unfinished"}  # nothing evicted or lost here
    assert {r.prompt_id for r in ended}.isdisjoint(per_prompt)
    # the prompts admitted are those the run took: 0 .. n-1, each once
    ids = sorted(int(p) for p in {r.prompt_id for r in records})
    assert ids == list(range(len(ids)))
    if staleness == 0:  # on-policy: every token by the very weights trained
        assert all(r.oldest_version == r.newest_version == r.trainer_version for r in trained)
    else:
        lags = {r.trainer_version - r.oldest_version for r in trained}  # type: ignore[operator]
        assert lags <= {0, 1}


async def test_a_resume_continues_the_ledger_from_its_checkpoint(tmp_path: Path) -> None:
    """Resumed from step 1 of a 3-step run: the interrupted run's records after its step-1
    checkpoint are replaced by the resumed run's; no sample is recorded twice, none lost."""
    config = tiny("async", run_dir=str(tmp_path), train={"steps": 3, "checkpoint_every": 1})
    await run_pipeline(config)
    path = tmp_path / "samples.jsonl"
    before = path.read_text().splitlines()
    mark = json.loads((tmp_path / "checkpoints" / "step-000001" / "ledger.json").read_text())
    kept = before[: mark["records"]]
    assert {json.loads(line)["step"] for line in kept} == {1}  # step 1's samples, nothing more
    resumed = await run_pipeline(config, resume=str(tmp_path / "checkpoints" / "step-000001"))
    assert resumed.samples == 2 * BATCH
    after = path.read_text().splitlines()
    assert after[: len(kept)] == kept, "continued, not rewritten"
    records = read_samples(str(tmp_path))
    trained = _trained(records)
    assert len(trained) == 3 * BATCH
    assert Counter(r.step for r in trained) == {1: BATCH, 2: BATCH, 3: BATCH}
    check = check_samples(records, group_size=GROUP, staleness=config.effective_staleness)
    assert check.ok, check


def test_read_samples_names_a_malformed_line(tmp_path: Path) -> None:
    good = {"kind": "not_trained", "prompt_id": "0", "attempt": 0, "admitted_version": 0,
            "reason": "unfinished", "reinjected": False}  # fmt: skip
    bad = {**good, "reason": "tired"}
    lines = [json.dumps(good), json.dumps(good), json.dumps(bad)]
    (tmp_path / "samples.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(SamplesFileError, match=r"samples.jsonl, line 3: reason must be one of"):
        read_samples(str(tmp_path))
    (tmp_path / "samples.jsonl").write_text(json.dumps(good) + "\n{not json\n")
    with pytest.raises(SamplesFileError, match=r"line 2: "):
        read_samples(str(tmp_path))
    missing = {k: v for k, v in good.items() if k != "attempt"}
    (tmp_path / "samples.jsonl").write_text(json.dumps(missing) + "\n")
    with pytest.raises(SamplesFileError, match=r"line 1: .*missing keys \['attempt'\]"):
        read_samples(str(tmp_path))
    (tmp_path / "samples.jsonl").write_text(json.dumps(good) + "\n")
    assert read_samples(str(tmp_path / "samples.jsonl")) == [SampleRecord(**good)]  # type: ignore[arg-type]


def trained(
    pid: str, attempt: int = 0, index: int = 0, *, oldest: int = 0, newest: int | None = None,
    version: int = 0, admitted: int = 0,
) -> SampleRecord:  # fmt: skip
    return SampleRecord(
        "trained", pid, attempt, admitted, sample_id=f"{pid}/{attempt}/{index}",
        oldest_version=oldest, newest_version=oldest if newest is None else newest,
        step=version + 1, trainer_version=version, reward=1.0,
    )  # fmt: skip


def ended(pid: str, attempt: int, reason: str, reinjected: bool) -> SampleRecord:
    return SampleRecord(
        "not_trained",
        pid,
        attempt,
        0,
        reason=reason,
        reinjected=reinjected,  # type: ignore[arg-type]
    )


def group(pid: str, attempt: int = 0, **kwargs: int) -> list[SampleRecord]:
    return [trained(pid, attempt, k, **kwargs) for k in range(2)]


def test_check_samples_accepts_a_whole_ledger() -> None:
    records = [
        *group("0"),
        ended("1", 0, "evicted", True),
        *group("1", 1, oldest=1, version=2),  # one version old: within staleness 1
        ended("2", 0, "dropped", False),
        ended("3", 0, "unfinished", False),
    ]
    check = check_samples(records, group_size=2, staleness=1)
    assert check.ok and (check.prompts, check.trained, check.not_trained) == (4, 4, 3)


def test_check_samples_finds_lost_prompts() -> None:
    records = [
        *group("0"),
        ended("1", 0, "evicted", True),  # injected again, never seen again
        ended("3", 0, "lost", True),  # prompt 2: admitted (3 was), never recorded
        *group("3", 2),  # attempt 1 of prompt 3: no record
        trained("4", 0, 0),  # half a group
        ended("5", 0, "unfinished", False),
    ]
    check = check_samples(records, group_size=2, staleness=0)
    assert check.lost == ("1", "2", "3", "4")
    assert not (check.duplicated or check.stale or check.retrained)


def test_check_samples_finds_duplicated_and_retrained_samples() -> None:
    records = [*group("0"), trained("0", 0, 1), *group("1"), ended("1", 0, "lost", True),
               *group("1", 1)]  # fmt: skip
    check = check_samples(records, group_size=2, staleness=0)
    assert check.duplicated == ("0/0/1",)
    assert check.retrained == ("1",)
    assert not check.ok


@pytest.mark.parametrize(
    ("staleness", "sample", "stale"),
    [
        (0, trained("0", oldest=0, version=0), False),
        (0, trained("0", oldest=0, version=1), True),  # one version old at staleness 0
        (1, trained("0", oldest=0, version=1), False),
        (1, trained("0", oldest=0, version=2), True),
        (1, trained("0", oldest=2, version=1), True),  # a token newer than the trainer
        (1, trained("0", oldest=1, newest=2, version=1), True),
        (1, trained("0", oldest=1, version=1, admitted=2), True),  # older than admitted for
    ],
)
def test_check_samples_finds_stale_samples(
    staleness: int, sample: SampleRecord, stale: bool
) -> None:
    version = sample.trainer_version or 0
    records = [sample, trained("0", 0, 1, oldest=version, version=version)]
    check = check_samples(records, group_size=2, staleness=staleness)
    assert check.stale == (("0/0/0",) if stale else ())


async def test_a_stopped_run_and_its_resume_keep_the_ledger_exact(tmp_path: Path) -> None:
    """``Pipeline.stop()`` mid-run: the ledger holds the steps the result reports (flushed at
    the stop), and the prompts still in flight as ``unfinished``; resumed from ``final`` to two
    more steps, those records go (their prompts are admitted again) and the whole is exact."""
    import trio

    import asyncflow_actors as afa
    from asyncflow_actors.pipeline import open_pipeline

    config = tiny("async", run_dir=str(tmp_path), train={"steps": 1000})
    async with afa.open_actor_system() as system, open_pipeline(system, config) as run:
        while not run.records:
            await trio.sleep(0.01)
        run.stop()
        with trio.fail_after(30):
            result = await run.wait()
    records = read_samples(str(tmp_path))
    assert len(_trained(records)) == result.samples == len(result.records) * BATCH
    assert {r.reason for r in records if r.kind == "not_trained"} == {"unfinished"}
    first = check_samples(records, group_size=GROUP, staleness=1)
    assert first.ok, first
    steps = result.version + 2
    more = tiny("async", run_dir=str(tmp_path), train={"steps": steps})
    await run_pipeline(more, resume=str(tmp_path))
    records = read_samples(str(tmp_path))
    assert len(_trained(records)) == steps * BATCH
    check = check_samples(records, group_size=GROUP, staleness=1)
    assert check.ok, check
