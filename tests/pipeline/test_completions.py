"""Sample completions: a few of a step's samples as text, every ``log_completions_every``
steps, in ``completions.jsonl`` and on the progress display."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from asyncflow_actors.pipeline import run_pipeline
from asyncflow_actors.pipeline._report import describe_completion
from asyncflow_actors.pipeline._reports import read_completions, trim_completions
from asyncflow_actors.roles._completions import SampleCompletion, picked_rows

from .kit import tiny

REWARDS = ["tests.tasks.rewards:exact", "tests.tasks.rewards:length"]


def test_one_sample_per_group_first_then_the_others_in_order() -> None:
    assert picked_rows([7, 7, 7, 8, 8, 9], 2) == [0, 3]
    assert picked_rows([7, 7, 7, 8, 8, 9], 4) == [0, 3, 5, 1]
    assert picked_rows([7, 7], 5) == [0, 1]


async def test_completions_every_n_steps_hold_what_the_rewards_scored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every 2nd step, 3 samples of 3 different groups: the prompt and completion as text
    (the reward functions' view: ``length`` is minus the completion's length), their rewards
    per function, the version that generated them (within the staleness window)."""
    run_dir = tmp_path / "run"
    config = tiny(
        "async",
        run_dir=str(run_dir),
        progress="plain",
        task={"reward": REWARDS},
        train={"steps": 4},
        report={"log_completions_every": 2, "log_completions_n": 3},
    )
    result = await run_pipeline(config)
    samples = read_completions(run_dir / "completions.jsonl")
    assert [s.step for s in samples] == [2, 2, 2, 4, 4, 4]
    for step in (2, 4):
        assert len({s.group for s in samples if s.step == step}) == 3
    for s in samples:
        assert re.fullmatch(r"\d+\+\d+=", s.prompt), s.prompt
        assert set(s.rewards) == {"exact", "length"}
        if s.completion:
            assert s.rewards["length"] == -len(s.completion)
        else:  # no score for an empty completion
            assert math.isnan(s.rewards["length"])
        assert s.rewards["exact"] in (0.0, 1.0)
        assert s.step - 1 - result.staleness <= s.version <= s.step - 1
    shown = [line for line in capsys.readouterr().out.splitlines() if "sample v" in line]
    assert shown == [describe_completion(s) for s in samples]


async def test_log_completions_every_zero_reports_none(tmp_path: Path) -> None:
    config = tiny(run_dir=str(tmp_path / "run"), report={"log_completions_every": 0})
    await run_pipeline(config)
    assert not (tmp_path / "run" / "completions.jsonl").exists()


def test_json_round_trip_and_a_resume_trims_later_steps(tmp_path: Path) -> None:
    path = tmp_path / "completions.jsonl"
    samples = [SampleCompletion(s, s - 1, s, "1+1=", "2", 1.0, {"f": math.nan}) for s in (1, 2, 3)]
    path.write_text("".join(json.dumps(s.to_json()) + "\n" for s in samples))
    assert json.loads(path.read_text().splitlines()[0])["rewards"] == {"f": None}
    trim_completions(str(path), 2)
    back = read_completions(path)
    assert [s.step for s in back] == [1, 2]
    assert math.isnan(back[0].rewards["f"]) and back[1].completion == "2"


def test_a_display_line_is_short_and_on_one_line() -> None:
    long = SampleCompletion(3, 2, 0, "system\n" + "x" * 200 + "\nWhat is 2+2?", "4\n" * 50, 0.5)
    line = describe_completion(long)
    assert "\n" not in line and len(line) < 160
    assert line.startswith("  sample v2 reward 0.50 | …") and "What is 2+2?" in line


def test_a_step_done_with_its_completions_crosses_the_wire() -> None:
    """The Trainer (a node process) sends them inside its ``StepDone``: msgpack, no pickle."""
    from asyncflow_actors.actors.remote._wire import MessageRegistry, decode, encode
    from asyncflow_actors.roles._messages import StepDone, TrainedSamples

    registry = MessageRegistry()
    registry.register(StepDone)
    registry.register(TrainedSamples)
    registry.register(SampleCompletion)
    sample = SampleCompletion(2, 1, 5, "1+1=", "2⏎", 1.0, {"exact": 1.0, "length": math.nan})
    done = StepDone(2, 16, 40, (4, 5), (12, 4), {"loss": 0.5}, completions=(sample,))
    frames = encode({}, done, registry=registry)
    _, back = decode(frames, registry=registry, max_message_bytes=1 << 20)
    assert isinstance(back, StepDone)
    (got,) = back.completions
    assert isinstance(got, SampleCompletion) and got.prompt == "1+1=" and got.completion == "2⏎"
    assert got.rewards["exact"] == 1.0 and math.isnan(got.rewards["length"])


def test_the_rich_display_prints_them_above_its_bar() -> None:
    import io

    from asyncflow_actors.pipeline._report import Progress

    pytest.importorskip("rich", reason="the pipeline extra")
    out = io.StringIO()
    progress = Progress("rich", 3, out)
    progress.completions([SampleCompletion(1, 0, 0, "1+2=", "3", 1.0)])
    progress.close()
    assert "  sample v0 reward 1.00 | 1+2= → 3" in out.getvalue()
