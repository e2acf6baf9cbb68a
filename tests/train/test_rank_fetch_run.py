"""Pipeline runs of 2 trainer ranks that each fetch their rows of a step from the
TransferQueue (a module of its own: one rank group a process, and ``test_rank_fetch``'s lives
for its module)."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncflow_actors.pipeline import check_samples, read_samples, run_pipeline
from tests.pipeline.kit import tiny


@pytest.mark.parametrize(
    ("mode", "roles"),
    [("async", {}), ("sync", {"advantage": "trainer"})],  # streamed pieces; whole batches
)
async def test_a_two_rank_run_whose_ranks_fetch_their_rows_keeps_the_ledger_exact(
    tmp_path: Path, mode: str, roles: dict[str, str]
) -> None:
    """Each step's rows are fetched by the ranks (rank 0 trains on its half of them), every
    admitted prompt is trained once or reported, and the advantages the trainer estimates
    reach the ranks with their rows."""
    config = tiny(mode, train={"ranks": 2}, placement={"roles": roles}, run_dir=str(tmp_path))
    result = await run_pipeline(config)
    assert [r.version for r in result.records] == [1, 2, 3]
    for record in result.records:
        assert 0 < record.metrics["rows_fetched"] <= 16 // 2  # rank 0's half of 4 groups of 4
    records = read_samples(str(tmp_path))
    check = check_samples(records, group_size=4, staleness=config.run_spec().staleness)
    assert check.ok, check
    assert check.trained == result.samples == 3 * 16
