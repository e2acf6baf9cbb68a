"""The run's curves: matplotlib panels against the step, only those the run has figures for."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from asyncflow_actors.pipeline import StepRecord, plot_run
from asyncflow_actors.pipeline._plot import _panels

pytest.importorskip("matplotlib", reason="the pipeline extra (matplotlib) is not installed")


def record(step: int, **metrics: float) -> StepRecord:
    return StepRecord(step=step, version=step, seconds=step * 0.5, step_seconds=0.5,
                      samples=16, samples_per_s=32.0, tokens_per_s=100.0,
                      reward_mean=step / 10, staleness=(12, 4), offpolicy_samples=4,
                      in_flight_slots=32, reinjected=0, metrics=metrics)  # fmt: skip


def test_panels_follow_the_runs_figures(tmp_path: Path) -> None:
    plain = [record(s, loss=0.1, accuracy=0.5, response_length=7.0) for s in range(1, 6)]
    titles = [t for t, _ in _panels(plain)]
    assert titles == ["reward", "accuracy", "policy loss", "response length (tokens)",
                      "staleness (mean version lag)", "throughput (trained samples/s)"]  # fmt: skip
    rich = [
        record(
            s,
            **{
                "reward/correct": 0.1 * s,
                "reward/format": 1.0,
                "kl": 0.01,
                "eval/pass@4": 0.2 if s % 2 == 0 else math.nan,
            },
        )
        for s in range(1, 6)
    ]
    panels = dict(_panels(rich))
    assert [label for label, _ in panels["reward"]] == ["batch mean", "correct", "format"]
    assert [label for label, _ in panels["evaluation"]] == ["pass@4"]
    assert [label for label, _ in panels["KL"]] == ["kl (reference)"]
    # resumed runs come in two segments: drawn in step order as one run
    path = tmp_path / "curves.png"
    assert plot_run(rich[3:] + rich[:3], path, "async (staleness 1)")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not plot_run([], tmp_path / "none.png", "empty")
    assert not (tmp_path / "none.png").exists()
