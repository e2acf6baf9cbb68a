"""Pipeline runs of 2 trainer ranks that each fetch their rows of a step from the
TransferQueue (a module of its own: one rank group a process, and ``test_rank_fetch``'s lives
for its module)."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncflow_actors.pipeline import check_samples, read_samples, run_pipeline
from tests.pipeline.kit import tiny


@pytest.mark.parametrize(
    ("mode", "placement"),
    [
        ("async", {}),  # streamed pieces, the queue in this process
        ("sync", {"roles": {"advantage": "trainer"}}),  # whole batches, advantages by rank 0
        ("async", {"tq_placement": "process", "tq_units": 2}),  # units on node processes
    ],
)
async def test_a_two_rank_run_whose_ranks_fetch_their_rows_keeps_the_ledger_exact(
    tmp_path: Path, mode: str, placement: dict[str, object]
) -> None:
    """Each step's rows are fetched by the ranks (rank 0 trains on its half of them), every
    admitted prompt is trained once or reported, and the advantages the trainer estimates
    reach the ranks with their rows."""
    config = tiny(mode, train={"ranks": 2}, placement=placement, run_dir=str(tmp_path))
    result = await run_pipeline(config)
    assert [r.version for r in result.records] == [1, 2, 3]
    for record in result.records:
        assert 0 < record.metrics["rows_fetched"] <= 16 // 2  # rank 0's half of 4 groups of 4
    records = read_samples(str(tmp_path))
    check = check_samples(records, group_size=4, staleness=config.run_spec().staleness)
    assert check.ok, check
    assert check.trained == result.samples == 3 * 16


async def test_a_step_whose_rank_cannot_reach_the_unit_is_fetched_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Rank 1 cannot reach the queue's unit for one step (a test hook: an address without an
    endpoint, which fails at once; test_rank_fetch waits out the request bound): the Trainer
    nacks the lease and takes the step again on the same group; every prompt is still
    trained once."""
    trigger = tmp_path / "unreachable"
    trigger.touch()
    monkeypatch.setenv("AFA_RANK_UNREACHABLE", f"1:unit-0:{trigger}")  # the ranks inherit it
    monkeypatch.setenv("AFA_RANK_UNREACHABLE_AT", "")
    config = tiny("sync", train={"ranks": 2, "steps": 2}, run_dir=str(tmp_path / "run"))
    with caplog.at_level("WARNING", logger="asyncflow_actors.roles"):
        result = await run_pipeline(config)
    assert not trigger.exists()  # the hook acted
    assert any("unit-0" in r.getMessage() and "go out again" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    assert [r.version for r in result.records] == [1, 2]
    check = check_samples(read_samples(str(tmp_path / "run")), group_size=4, staleness=0)
    assert check.ok, check
    assert check.trained == result.samples == 2 * 16
