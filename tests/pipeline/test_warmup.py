"""``train.sft_warmup_steps``: a run warms its policy up once, before the first rollout; its RL
steps start from the warmed weights; a resume never warms up again; bad settings fail early."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncflow_actors.models import SamplingParams, load_model
from asyncflow_actors.pipeline import PipelineConfig, PipelineConfigError, run_pipeline
from asyncflow_actors.rl import evaluate
from asyncflow_actors.roles._compute import build_policy

from .kit import tiny

WARMUP = {"sft_warmup_steps": 120, "sft_warmup_lr": 3e-3}


def _config(run_dir: Path, steps: int, **train: Any) -> PipelineConfig:
    """Single-digit sums (a warm-up of 120 steps takes the sampled reward from about 0.02 to
    about 0.4) in batches of 8 groups of 4."""
    return tiny(
        "async",
        run_dir=str(run_dir),
        model={"d_model": 64, "n_layers": 2, "n_heads": 4},
        task={"options": {"min_digits": 1, "max_digits": 1}, "seed": 3},
        train={"steps": steps, "prompts_per_step": 8, **WARMUP, **train},
    )


def _distance(a: torch.nn.Module, b: torch.nn.Module) -> float:
    sb = b.state_dict()
    return sum(float((v - sb[k]).pow(2).sum()) for k, v in a.state_dict().items()) ** 0.5


@pytest.mark.timeout(300)
async def test_a_run_warms_up_first_and_its_rl_steps_start_from_the_warmed_weights(
    tmp_path: Path,
) -> None:
    config = _config(tmp_path, 2)
    result = await run_pipeline(config)
    warm = result.warmup
    assert warm is not None and warm.steps == 120 and not warm.reached_target
    assert warm.path == str(tmp_path / "warmup" / "policy.safetensors")
    record = json.loads((tmp_path / "warmup" / "warmup.json").read_text())
    assert record["steps"] == 120 and record["accuracy"] == warm.accuracy
    assert json.loads((tmp_path / "config.json").read_text())["train"]["sft_warmup_steps"] == 120

    # The first step trained samples the rollout drew from the warmed-up policy: a random
    # policy scores about 0.02 on these sums (1 of 10 digits right, half credit)
    task = config.task.build()
    initial, tokenizer = build_policy(config.model, task)
    problems = [p for p in task.sample(64, 5) for _ in range(4)]
    random_reward = evaluate(
        initial, task, tokenizer, problems, SamplingParams(4),
        generator=torch.Generator().manual_seed(0),
    ).mean_reward  # fmt: skip
    assert random_reward < 0.1
    assert result.records[0].reward_mean > 0.2, (random_reward, result.records[0])

    # The trainer trained the warmed weights: two RL steps moved them a little, the warm-up a lot
    warmed = load_model(warm.path)
    final = load_model(tmp_path / "final" / "policy.safetensors")
    assert _distance(final, warmed) < _distance(warmed, initial) / 10


@pytest.mark.timeout(300)
async def test_a_resume_does_not_warm_up_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncflow_actors.roles import _warmup

    config = _config(tmp_path, 2, checkpoint_every=1)
    first = await run_pipeline(config)
    files = [tmp_path / "warmup" / name for name in ("policy.safetensors", "warmup.json")]
    before = [(f.read_bytes(), os.stat(f).st_mtime_ns) for f in files]

    def boom(*args: Any) -> None:
        raise AssertionError("a resume warmed up again")

    monkeypatch.setattr(_warmup, "warm_up_policy", boom)
    longer = _config(tmp_path, 3, checkpoint_every=1)
    resumed = await run_pipeline(longer, resume=str(tmp_path / "checkpoints" / "step-000001"))
    assert [r.step for r in resumed.records] == [2, 3]
    assert resumed.warmup == first.warmup  # the run's, as recorded
    assert [(f.read_bytes(), os.stat(f).st_mtime_ns) for f in files] == before

    # a resume needs the warm-up of the run it continues (the reference policy is the warmed one)
    for f in files:
        f.unlink()
    with pytest.raises(PipelineConfigError, match=r"^train\.sft_warmup_steps: .* holds no warm-up"):
        await run_pipeline(_config(tmp_path, 4), resume=str(tmp_path))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"train": {"sft_warmup_steps": -1}}, "train.sft_warmup_steps: expected a number >= 0"),
        ({"train": {"sft_warmup_accuracy": 0}}, "train.sft_warmup_accuracy: expected a number"),
        ({"train": {"sft_warmup_lr": 0.0}}, "train.sft_warmup_lr: expected a number > 0"),
        ({"run_dir": None}, "train.sft_warmup_steps: needs a run_dir"),
        (
            {"model": {"hf": "some/folder"}, "rollout": {"engine": "hf"}},
            "train.sft_warmup_steps: the warm-up trains the built-in tiny policy",
        ),
    ],
)
def test_bad_warmup_settings_name_their_key(
    tmp_path: Path, override: dict[str, Any], message: str
) -> None:
    table: dict[str, Any] = {"run_dir": str(tmp_path), "train": {"sft_warmup_steps": 10}}
    for key, value in override.items():
        table[key] = {**table[key], **value} if key == "train" else value
    if table["run_dir"] is None:
        del table["run_dir"]
    with pytest.raises(PipelineConfigError) as info:
        PipelineConfig.from_dict(table)
    assert str(info.value).startswith(message), info.value


async def test_a_failed_warm_up_fails_the_run_naming_its_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncflow_actors.actors import root_error
    from asyncflow_actors.pipeline import RunFailed
    from asyncflow_actors.roles import _warmup

    def fail(*args: Any) -> None:
        raise ValueError("no answers to learn")

    monkeypatch.setattr(_warmup, "warm_up_policy", fail)
    with pytest.raises(BaseException) as info:  # in trio's groups, as any failed run's error
        await run_pipeline(_config(tmp_path, 2))
    error = root_error(info.value)
    assert isinstance(error, RunFailed) and error.role == "warmup", info.value
    assert str(error) == "role 'warmup' terminated: ValueError: no answers to learn"
    assert not (tmp_path / "steps.jsonl").exists()
