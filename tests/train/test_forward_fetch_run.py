"""Pipeline runs whose ActorForward is 2 ranks that each fetch their rows of a batch from the
TransferQueue (a module of its own: one rank group a process)."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncflow_actors.pipeline import check_samples, read_samples, run_pipeline
from tests.pipeline.kit import tiny


@pytest.mark.parametrize(
    ("mode", "placement"),
    [
        ("async", {}),
        ("sync", {}),
        ("sync", {"roles": {"advantage": "actor_fwd"}}),  # the station fetches the rewards
        ("async", {"tq_placement": "process", "tq_units": 2}),  # units on node processes
    ],
)
async def test_a_run_whose_forward_ranks_fetch_their_rows_keeps_the_ledger_exact(
    tmp_path: Path, mode: str, placement: dict[str, object], caplog: pytest.LogCaptureFixture
) -> None:
    """Every admitted prompt is trained once or reported; the ranks fetched (no fallback to
    the broadcast was logged)."""
    config = tiny(mode, train={"forward_ranks": 2, "collective_timeout": 60},
                  placement=placement, run_dir=str(tmp_path))  # fmt: skip
    with caplog.at_level("INFO", logger="asyncflow_actors.roles.ranks"):
        result = await run_pipeline(config)
    assert not [r for r in caplog.records if "broadcasts its rows" in r.getMessage()]
    assert [r.version for r in result.records] == [1, 2, 3]
    check = check_samples(read_samples(str(tmp_path)), group_size=4,
                          staleness=config.run_spec().staleness)  # fmt: skip
    assert check.ok, check
    assert check.trained == result.samples == 3 * 16


async def test_a_batch_whose_forward_rank_cannot_reach_the_unit_goes_out_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """ActorForward's rank 1 cannot reach the queue's unit for one batch (a test hook: an
    address without an endpoint, which fails at once): the station nacks the lease, nothing
    written, and takes the rows again; every prompt is still trained once."""
    trigger = tmp_path / "unreachable"
    trigger.touch()
    monkeypatch.setenv("AFA_RANK_UNREACHABLE", f"1:unit-0:{trigger}")  # the ranks inherit it
    monkeypatch.setenv("AFA_RANK_UNREACHABLE_AT", "")
    config = tiny("sync", train={"forward_ranks": 2, "steps": 2, "collective_timeout": 60},
                  run_dir=str(tmp_path / "run"))  # fmt: skip
    with caplog.at_level("WARNING", logger="asyncflow_actors.roles"):
        result = await run_pipeline(config)
    assert not trigger.exists()  # the hook acted
    assert any("actor_fwd" in r.getMessage() and "unit-0" in r.getMessage()
               and "go out again" in r.getMessage() for r in caplog.records)  # fmt: skip
    assert [r.version for r in result.records] == [1, 2]
    check = check_samples(read_samples(str(tmp_path / "run")), group_size=4, staleness=0)
    assert check.ok, check
    assert check.trained == result.samples == 2 * 16
