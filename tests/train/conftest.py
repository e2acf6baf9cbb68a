"""Shared pieces of the rank-group tests: a global batch, run specs, a tiny HF folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from asyncflow_actors.roles._settings import AlgorithmSettings, RunSpec, TrainSettings


def global_batch(n: int = 8, seed: int = 0) -> dict[str, Any]:
    """Rows of uneven prompt and response lengths, advantages of both signs, old log-probs
    off the policy's (some ratios clip), so that every aggregation mode weighs rows apart."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 12, (2 + k % 3,), generator=g) for k in range(n)]
    responses = [torch.randint(3, 12, (1 + (k * 5) % 7,), generator=g) for k in range(n)]
    return {
        "prompt_ids": prompts,
        "response_ids": responses,
        "old_logprobs": [-2.5 + 0.3 * torch.randn(len(r), generator=g) for r in responses],
        "behaviour_logprobs": [-2.5 + 0.3 * torch.randn(len(r), generator=g) for r in responses],
        "advantages": [
            torch.full((len(r),), 1.0 - 2 * (k % 3 == 0)) for k, r in enumerate(responses)
        ],
    }


def run_spec(agg: str = "token-mean", *, hf: str | None = None, **train: Any) -> RunSpec:
    from asyncflow_actors.roles._settings import ModelSettings

    return RunSpec(
        mode="async", staleness=1, stage_barrier=False, colocated=False,
        model=ModelSettings(hf=hf), algorithm=AlgorithmSettings(agg=agg),
        train=TrainSettings(**{"lr": 1e-2, **train}),
    )  # fmt: skip


@pytest.fixture(scope="session")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny LlamaForCausalLM with its tokenizer, saved locally (no hub)."""
    pytest.importorskip("transformers")
    from asyncflow_actors.models import CharTokenizer, TinyConfig, TinyDecoder
    from asyncflow_actors.rollout import export_hf

    tokenizer = CharTokenizer("0123456789+=")
    torch.manual_seed(0)
    config = TinyConfig(vocab_size=tokenizer.vocab_size, d_model=32, n_layers=2, n_heads=2,
                        max_seq_len=64)  # fmt: skip
    folder = tmp_path_factory.mktemp("hf") / "model"
    export_hf(folder, TinyDecoder(config), tokenizer)
    return folder
