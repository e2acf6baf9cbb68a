"""A pipeline run whose trainer is 2 ranks (FSDP2 on gloo): it trains every step, syncs the
gathered weights to the rollout and checkpoints every rank through DCP."""

from __future__ import annotations

import os
from pathlib import Path

from asyncflow_actors.pipeline import run_pipeline
from tests.pipeline.kit import tiny


async def test_a_run_with_two_trainer_ranks_trains_its_steps(tmp_path: Path) -> None:
    config = tiny("async", train={"ranks": 2, "checkpoint_every": 2}, run_dir=str(tmp_path))
    result = await run_pipeline(config)
    assert [r.version for r in result.records] == [1, 2, 3]
    for record in result.records:
        assert "pg_loss" in record.metrics and record.metrics["normaliser"] > 0
    assert all(r.sync["sync_bytes"] > 0 for r in result.records[:-1])  # gathered and sent
    saved = [os.path.join(d, f) for d, _, files in os.walk(tmp_path) for f in files]
    assert any(f.endswith("rng-1.safetensors") for f in saved), saved
