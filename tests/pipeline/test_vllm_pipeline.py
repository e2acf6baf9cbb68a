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


@pytest.mark.timeout(400)
async def test_a_lora_pipeline_syncs_the_adapters_alone_into_vllm(tmp_path: Path) -> None:
    """``rollout.vllm_lora``: vLLM serves the base model with the adapter, each sync carries the
    adapters alone (ActorForward merges them), and vLLM's log-probs still agree with the
    trainer's forward."""
    from asyncflow_actors.rollout import export_hf

    tokenizer = CharTokenizer("0123456789+=")
    torch.manual_seed(0)
    cfg = TinyConfig(
        vocab_size=tokenizer.vocab_size, d_model=128, n_heads=2, n_layers=1, max_seq_len=32
    )
    model = TinyDecoder(cfg)
    export_hf(tmp_path / "hf", model, tokenizer)
    config = tiny(
        "async",
        staleness=1,
        run_dir=str(tmp_path / "run"),
        model={"hf": str(tmp_path / "hf"), "lora": {"r": 4, "alpha": 8}},
        rollout={
            "engine": "vllm",
            "vllm_lora": True,
            "pause_mode": "keep",
            "vllm_args": {
                "gpu_memory_utilization": 0.1,
                "enforce_eager": True,
                "max_model_len": 32,
                "dtype": "float32",
            },
        },
        train={"steps": 3, "lr": 1e-2},
    )
    result = await run_pipeline(config)
    assert [r.version for r in result.records] == [1, 2, 3]
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    adapters = 4 * 4 * 128 * 2 * 4  # r 4, q/k/v/o, A and B, 128 wide, fp32 (k and v: 128 too)
    print("sync bytes per step:", [r.sync["sync_bytes"] for r in result.records], "of", full)
    # the adapters to each of the two receivers (the rollout's vLLM, ActorForward), no more
    assert all(r.sync["sync_bytes"] == 2 * adapters < full / 10 for r in result.records)
    print(
        "mismatch_kl_k1 per step:", [f"{r.metrics['mismatch_kl_k1']:.1e}" for r in result.records]
    )
    assert all(abs(r.metrics["mismatch_kl_k1"]) < 1e-4 for r in result.records)
