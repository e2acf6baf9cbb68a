"""A user's task through the pipeline: reward functions by import path (a failing one under
each ``on_error``), a dataset with an overlong prompt, evaluation figures in the step record,
and the example run as a user runs it (every role in its own process)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import attrs
import pytest

from asyncflow_actors.pipeline import RunFailed, run_pipeline

from ..pipeline.kit import tiny
from . import rewards

FLAKY = "tests.tasks.rewards:every_fifth_fails"


def leaves(exc: BaseException) -> list[BaseException]:
    """The errors in ``exc``'s exception groups (the run's nurseries wrap them)."""
    inner = getattr(exc, "exceptions", None)
    return [exc] if inner is None else [leaf for e in inner for leaf in leaves(e)]


@pytest.mark.parametrize("on_error", ["raise", "zero", "drop"])
async def test_a_reward_raising_at_20_percent(on_error: str) -> None:
    rewards._calls[0] = 0
    config = tiny(task={"reward": [FLAKY]}, reward={"on_error": on_error})
    if on_error == "raise":
        with pytest.raises(BaseException) as info:
            await run_pipeline(config)
        (error,) = leaves(info.value)
        assert isinstance(error, RunFailed)
        assert "reward 'every_fifth_fails' raised ValueError" in str(error)
        assert "\n" not in str(error)
        return
    result = await run_pipeline(config)
    assert [r.version for r in result.records] == [1, 2, 3]
    assert rewards._calls[0] >= 2, "no call failed"
    last = result.records[-1].metrics
    assert "reward/every_fifth_fails" in last
    if on_error == "drop":
        assert last["reward/dropped_groups"] >= 1
    else:
        assert "reward/dropped_groups" not in last


async def test_a_dataset_with_an_overlong_prompt_and_evaluation(tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    lines = [{"prompt": f"{a}+{a}=", "answer": str(2 * a), "level": a % 3} for a in range(20)]
    lines.append({"prompt": "1" * 40 + "=", "answer": "1", "level": 0})  # over the context
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    config = tiny(
        run_dir=str(tmp_path / "run"),
        task={
            "kind": "dataset",
            "dataset": {"path": str(data)},
            "reward": ["tests.tasks.rewards:exact", "tests.tasks.rewards:columns_seen"],
            "reward_weights": [1.0, 0.5],
        },
        eval={"every": 1, "samples": 4, "greedy": False},
    )
    result = await run_pipeline(config)
    first, last = result.records[0].metrics, result.records[-1].metrics
    assert first["dataset/filtered_prompts"] == 1.0
    assert {"reward/exact", "reward/columns_seen"} <= set(last)
    assert 0.0 <= last["reward/columns_seen"] <= 2.0
    assert {"eval/reward_mean", "eval/pass@1", "eval/pass@4", "eval/reward/exact"} <= set(last)
    written = json.loads((tmp_path / "run" / "config.json").read_text())
    assert written["task"]["reward"] == [
        "tests.tasks.rewards:exact",
        "tests.tasks.rewards:columns_seen",
    ]


async def test_an_overlong_prompt_refused_fails_the_run_before_it_starts(tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "1" * 40 + "=", "answer": "1"}) + "\n")
    config = tiny(task={"kind": "dataset", "dataset": {"path": str(data), "overlong": "error"}})
    with pytest.raises(BaseException) as info:
        await run_pipeline(config)
    assert any("exceeds max_prompt_length 12" in str(e) for e in leaves(info.value))


def test_the_custom_reward_example_in_processes(tmp_path: Path) -> None:
    """Reward functions by import path in node processes, conversational prompts through a
    chat template, evaluation, a run_dir: the example as a user runs it (short)."""
    pytest.importorskip("transformers")
    examples = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
    sys.path.insert(0, os.path.abspath(examples))
    try:
        import custom_reward
    finally:
        sys.path.pop(0)
    summary = custom_reward.main(["--short", "--out", str(tmp_path)])
    assert {"reward/correct", "reward/brevity", "eval/reward_mean", "eval/pass@1"} <= set(summary)
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["task"]["reward"] == ["custom_rewards:correct", "custom_rewards:brevity"]
    assert config["placement"]["default"] == "process"
    steps = (tmp_path / "run" / "steps.jsonl").read_text().splitlines()
    assert len(steps) == 4 and any("eval/pass@1" in line for line in steps)


async def test_reward_functions_in_a_reward_actor_of_their_own() -> None:
    config = tiny(rollout={"reward": "actor"}, reward={"on_error": "drop"})
    # function objects from Python: their import paths
    task = attrs.evolve(config.task, reward=[rewards.exact, rewards.length])
    config = attrs.evolve(config, task=task)
    assert config.task.reward == ("tests.tasks.rewards:exact", "tests.tasks.rewards:length")
    result = await run_pipeline(config)
    last = result.records[-1].metrics
    assert last["reward/length"] < 0 and 0 <= last["reward/exact"] <= 1
    assert last["reward/dropped_groups"] == 0
