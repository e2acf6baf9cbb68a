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


async def test_a_lora_run_syncs_merged_weights_to_the_hf_engine(
    tmp_path: Path, hf_folder: Path
) -> None:
    """LoRA on 2 ranks: the HF engine and the forward station load the merged weights (base
    names), and the engine's log-probs agree with the forward station's."""
    config = tiny(
        "sync",
        run_dir=str(tmp_path / "run"),
        model={"hf": str(hf_folder), "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj"]}},
        rollout={"engine": "hf"},
        train={"steps": 2, "ranks": 2, "checkpoint_every": 2},
    )
    result = await run_pipeline(config)
    assert [r.version for r in result.records] == [1, 2]
    assert result.records[-1].sync["sync_bytes"] > 0
    assert abs(result.records[-1].metrics["mismatch_kl_k1"]) < 1e-3
    saved = Path(result.checkpoints[-1])
    assert (saved / "policy" / "model.safetensors").exists()  # merged, for the other roles
    assert (saved / "ranks" / "dcp").is_dir()


async def test_a_run_of_two_ranks_resumes_on_one(tmp_path: Path) -> None:
    """A checkpoint of 2 trainer ranks resumes with the default one (DCP reshards); the other
    roles load the exported policy."""
    first = tiny(
        "sync", run_dir=str(tmp_path), train={"steps": 2, "ranks": 2, "checkpoint_every": 2}
    )
    result = await run_pipeline(first)
    resumed = await run_pipeline(
        tiny("sync", run_dir=str(tmp_path), train={"steps": 3, "checkpoint_every": 1}),
        resume=result.checkpoints[-1],
    )
    assert [r.version for r in resumed.records] == [3]
    assert os.path.isdir(os.path.join(resumed.checkpoints[-1], "ranks", "dcp"))
