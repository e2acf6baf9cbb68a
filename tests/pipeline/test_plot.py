"""The run's curves: matplotlib panels against the step, only those the run has figures for."""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import trio

from asyncflow_actors.pipeline import StepRecord, _reports, plot_run
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


async def test_the_plot_is_redrawn_every_plot_every_steps_during_the_run(tmp_path: Path) -> None:
    """Every 2nd step of 4: two drawings while the run runs (each of the records so far)."""
    from asyncflow_actors.actors.remote import open_actor_system
    from asyncflow_actors.pipeline import open_pipeline

    from .kit import tiny

    drawn: list[list[int]] = []

    def spy(records: Sequence[StepRecord], path: str, title: str) -> bool:
        drawn.append([r.step for r in records])
        return plot_run(records, path, title)

    config = tiny(
        run_dir=str(tmp_path / "run"), plot=True, train={"steps": 4}, report={"plot_every": 2}
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_reports, "plot_run", spy)
        async with open_actor_system() as system, open_pipeline(system, config) as run:
            await run.wait()
    assert drawn == [[1, 2], [1, 2, 3, 4]]
    assert (tmp_path / "run" / "curves.png").stat().st_size > 10_000


async def test_a_drawing_never_holds_a_step_and_an_error_warns_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A drawing stuck until the run's last step: the run still gets there; drawings that
    fail warn once and the run goes on."""
    import logging

    from asyncflow_actors.pipeline import run_pipeline

    from .kit import tiny

    release = threading.Event()
    calls: list[int] = []

    def stuck_then_failing(records: Sequence[StepRecord], path: str, title: str) -> bool:
        calls.append(len(records))
        release.wait(60)
        raise RuntimeError("no display fonts")

    def on_step(record: StepRecord) -> None:
        if record.step == 4:
            release.set()

    config = tiny(
        run_dir=str(tmp_path / "run"), plot=True, train={"steps": 4}, report={"plot_every": 1}
    )
    with (
        pytest.MonkeyPatch.context() as patch,
        caplog.at_level(logging.WARNING, logger="asyncflow_actors.pipeline"),
    ):
        patch.setattr(_reports, "plot_run", stuck_then_failing)
        with trio.fail_after(60):
            result = await run_pipeline(config, on_step=on_step)
    assert len(result.records) == 4
    assert calls[0] == 1 and len(calls) >= 2  # step 1's, then the latest asked for meanwhile
    warnings = [r.getMessage() for r in caplog.records if "plot_every" in r.getMessage()]
    assert len(warnings) == 1 and "no display fonts" in warnings[0]
    assert (tmp_path / "run" / "curves.png").exists()  # the final plot is the run's own
