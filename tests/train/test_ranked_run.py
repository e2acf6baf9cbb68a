"""Pipeline runs whose trainer is 2 ranks (FSDP2 on gloo): they train every step, sync the
gathered weights to the rollout, checkpoint every rank through DCP, resume on another number of
ranks, and fail naming a rank that died."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import trio

from asyncflow_actors.pipeline import run_pipeline
from asyncflow_actors.roles import RankFailed
from tests.pipeline.kit import tiny

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup


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


def failures(exc: BaseException) -> list[BaseException]:
    """Every exception in a tree of groups and causes."""
    out = [exc]
    for inner in getattr(exc, "exceptions", ()):
        out += failures(inner)
    if exc.__cause__ is not None:
        out += failures(exc.__cause__)
    return out


async def test_a_trainer_rank_killed_mid_backward_fails_the_run_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Trainer (a temporary role) fails with ``RankFailed`` naming rank 1: the run ends
    with it (to resume from its last checkpoint), within the collective timeout. Without
    ``train.auto_resume``: every resumed Trainer's rank 1 would die the same way, and the run
    would start the ranks four times to fail the same (retries: ``test_auto_resume``)."""
    monkeypatch.setenv("AFA_RANK_KILL_IN_BACKWARD", "1")  # rank 1 dies in its first backward
    train = {"ranks": 2, "collective_timeout": 60, "auto_resume": False}
    with trio.fail_after(60), pytest.raises(BaseExceptionGroup) as failure:
        await run_pipeline(tiny("async", train=train))
    ranks = [e for e in failures(failure.value) if isinstance(e, RankFailed)]
    assert ranks and all(e.rank == 1 for e in ranks), failure.value
