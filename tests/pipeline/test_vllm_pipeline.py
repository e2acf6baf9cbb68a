"""A pipeline run with vLLM generating (``rollout.engine = "vllm"``), on a tiny Llama exported
offline: weights reach vLLM through ``afa_shm`` at every step, and the trainer's log-probs of
vLLM's tokens agree with vLLM's. Runs where ``vllm`` imports (``nox -s tests_vllm``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from asyncflow_actors.models import CharTokenizer, TinyConfig, TinyDecoder
from asyncflow_actors.pipeline import run_pipeline

from .kit import tiny

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="`vllm` is not importable here: this test runs in `nox -s tests_vllm`",
)


@pytest.mark.timeout(400)
async def test_a_pipeline_with_vllm_rollout_trains_and_syncs(tmp_path: Path) -> None:
    from asyncflow_actors.rollout import export_hf

    tokenizer = CharTokenizer("0123456789+=")
    torch.manual_seed(0)
    cfg = TinyConfig(
        vocab_size=tokenizer.vocab_size, d_model=128, n_heads=2, n_layers=1, max_seq_len=32
    )
    export_hf(tmp_path / "hf", TinyDecoder(cfg), tokenizer)
    config = tiny(
        "async",
        staleness=1,
        run_dir=str(tmp_path / "run"),
        model={"hf": str(tmp_path / "hf")},
        rollout={
            "engine": "vllm",
            "pause_mode": "keep",
            "vllm_args": {
                "gpu_memory_utilization": 0.1,
                "enforce_eager": True,
                "max_model_len": 32,
                "dtype": "float32",
            },
        },
        train={"steps": 3},
    )
    result = await run_pipeline(config)
    assert [r.version for r in result.records] == [1, 2, 3]
    assert all(r.sync["sync_bytes"] > 0 for r in result.records)
    # vLLM's log-probs and the trainer's forward of the same tokens agree (fp32)
    print(
        "mismatch_kl_k1 per step:", [f"{r.metrics['mismatch_kl_k1']:.1e}" for r in result.records]
    )
    assert all(abs(r.metrics["mismatch_kl_k1"]) < 1e-4 for r in result.records)
