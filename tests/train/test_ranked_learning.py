"""The pipeline learns with a trainer of 2 ranks: async GRPO (staleness 1) from the warmed-up
policy of ``tests/pipeline/test_learning.py`` raises its held-out reward, as one trainer does."""

from __future__ import annotations

import os
from pathlib import Path

import attrs
import pytest

from asyncflow_actors.models import load_model
from asyncflow_actors.pipeline import run_pipeline
from tests.pipeline.test_learning import config, held_out_reward, warm_start


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_async_grpo_with_two_trainer_ranks_raises_reward(tmp_path: Path) -> None:
    init = tmp_path / "sft.safetensors"
    before = warm_start(init)  # the one-trainer test's warm-up, run once a session
    base = config(init, tmp_path / "run", shuffle=False)
    ranked = attrs.evolve(base, train=attrs.evolve(base.train, ranks=2))
    result = await run_pipeline(ranked)
    assert result.samples == 40 * 16 * 8
    trained = load_model(os.path.join(result.checkpoints[-1], "policy.safetensors"))
    after = held_out_reward(trained)
    # the bar of the one-trainer test (its runs gained +0.056..+0.070 from 0.293)
    assert after - before >= 0.03, (before, after)
