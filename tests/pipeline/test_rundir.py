"""Run directories: a new run never mixes with an earlier one; a resume continues its steps."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from asyncflow_actors.pipeline import PipelineConfigError, StepRecord, run_pipeline

from .kit import tiny


def _steps(run_dir: Path) -> list[tuple[int, int]]:
    lines = (run_dir / "steps.jsonl").read_text().splitlines()
    return [(json.loads(line)["step"], json.loads(line)["version"]) for line in lines]


async def test_a_new_run_refuses_a_run_dir_holding_a_run(tmp_path: Path) -> None:
    config = tiny("sync", run_dir=str(tmp_path), train={"steps": 1})
    await run_pipeline(config)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(PipelineConfigError, match="holds a run already") as info:
        await run_pipeline(config)
    assert str(info.value).startswith(f"run_dir: {tmp_path} holds a run already (config.json")
    assert not (tmp_path / "checkpoints").exists()
    await run_pipeline(config, overwrite=True)
    assert _steps(tmp_path) == [(1, 1)]  # the earlier run's records are gone
    assert (tmp_path / "notes.txt").read_text() == "mine"  # what is not a run's stays


async def test_a_resume_continues_the_steps_and_drops_those_after_its_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Resumed from step 1 of a 3-step run: steps.jsonl holds steps 1, 2, 3 once each (the
    interrupted run's 2 and 3 replaced), numbered on, in time order; the plot covers them."""
    from asyncflow_actors.pipeline import _steps as step_records

    plotted: list[list[int]] = []

    def plot(records: list[StepRecord], path: Any, title: str) -> bool:
        plotted.append([r.step for r in records])
        return True

    monkeypatch.setattr(step_records, "plot_run", plot)
    config = tiny("sync", run_dir=str(tmp_path), plot=True,
                  train={"steps": 3, "checkpoint_every": 1})  # fmt: skip
    await run_pipeline(config)
    assert _steps(tmp_path) == [(1, 1), (2, 2), (3, 3)]
    first = (tmp_path / "steps.jsonl").read_text().splitlines()
    resumed = await run_pipeline(config, resume=str(tmp_path / "checkpoints" / "step-000001"))
    assert [(r.step, r.version) for r in resumed.records] == [(2, 2), (3, 3)]
    lines = (tmp_path / "steps.jsonl").read_text().splitlines()
    assert lines[0] == first[0] and lines[1:] != first[1:]
    assert _steps(tmp_path) == [(1, 1), (2, 2), (3, 3)]
    seconds = [json.loads(line)["seconds"] for line in lines]
    assert seconds == sorted(seconds)
    assert plotted == [[1, 2, 3], [1, 2, 3]]


async def test_a_resume_with_another_model_names_the_differing_keys(tmp_path: Path) -> None:
    config = tiny("sync", run_dir=str(tmp_path), train={"steps": 1})
    await run_pipeline(config)
    other = tiny("sync", run_dir=str(tmp_path), train={"steps": 2},
                 model={"d_model": 64, "n_layers": 2})  # fmt: skip
    with pytest.raises(PipelineConfigError) as info:
        await run_pipeline(other, resume=str(tmp_path))
    assert str(info.value).startswith(
        f"model: differs from the checkpoint's ({tmp_path / 'final'}): d_model = 64 here, 32 "
        "there; n_layers = 2 here, 1 there"
    )
