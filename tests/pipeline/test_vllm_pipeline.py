"""A pipeline run with vLLM generating (``rollout.engine = "vllm"``), on a tiny Llama exported
offline: weights reach vLLM through ``afa_shm`` at every step, and the trainer's log-probs of
vLLM's tokens agree with vLLM's. Runs where ``vllm`` imports (``nox -s tests_vllm``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncflow_actors.models import CharTokenizer, TinyConfig, TinyDecoder
from asyncflow_actors.pipeline import run_pipeline

from .kit import tiny

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="`vllm` is not importable here: this test runs in `nox -s tests_vllm`",
)

# vLLM on CPU for a tiny model: a tenth of host memory, no compilation, fp32 (the mismatch checks)
VLLM_ARGS = {
    "gpu_memory_utilization": 0.1,
    "enforce_eager": True,
    "max_model_len": 32,
    "dtype": "float32",
}


@pytest.mark.timeout(400)
async def test_a_pipeline_with_vllm_rollout_trains_and_syncs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
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
            "vllm_args": VLLM_ARGS,
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
    # the run's stop left the rollout time to close vLLM (its grace covers vLLM's shutdown)
    assert not [r.getMessage() for r in caplog.records if "was killed" in r.getMessage()]


@pytest.mark.timeout(600)
async def test_a_lora_pipeline_syncs_the_adapters_alone_into_vllm_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``rollout.vllm_lora``: vLLM serves the base model with the adapter, each sync carries the
    adapters alone (ActorForward merges them), and vLLM's log-probs agree with the trainer's
    forward (on-policy, with rewards that move the adapter from the first step). Resumed from its step-2 checkpoint, the run starts vLLM on the base
    with the checkpoint's adapter (the trainer's adapter of version 2, to the bit, loaded
    before anything is generated), trains on, and its ledger holds every sample once."""
    from asyncflow_actors.pipeline import check_samples, read_samples
    from asyncflow_actors.roles._forward import PolicyCopy
    from asyncflow_actors.rollout import export_hf
    from asyncflow_actors.rollout._vllm_engine import VLLMEngine

    loads: list[tuple[str, int, dict[str, torch.Tensor]]] = []

    def recording(cls: Any, kind: str) -> None:
        real = cls.load_weights

        async def load_weights(self: Any, weights: Any, version: int) -> None:
            loads.append((kind, int(version), {k: v.clone() for k, v in weights.items()}))
            await real(self, weights, version)

        monkeypatch.setattr(cls, "load_weights", load_weights)

    recording(VLLMEngine, "vllm")
    recording(PolicyCopy, "forward")
    tokenizer = CharTokenizer("0123456789+=")
    torch.manual_seed(0)
    cfg = TinyConfig(
        vocab_size=tokenizer.vocab_size, d_model=128, n_heads=2, n_layers=1, max_seq_len=32
    )
    model = TinyDecoder(cfg)
    export_hf(tmp_path / "hf", model, tokenizer)
    run_dir = tmp_path / "run"

    def config(steps: int) -> Any:
        return tiny(
            "sync",  # on-policy: the mismatch compares vLLM's adapter with the trainer's
            run_dir=str(run_dir),
            model={"hf": str(tmp_path / "hf"), "lora": {"r": 4, "alpha": 8}},
            # rewards that differ between samples: the adapter moves from the first step
            task={"reward": ["tests.tasks.rewards:digits"]},
            rollout={
                "engine": "vllm",
                "vllm_lora": True,
                "pause_mode": "keep",
                "vllm_args": VLLM_ARGS,
            },
            train={"steps": steps, "lr": 1e-2, "checkpoint_every": 2},
        )

    result = await run_pipeline(config(3))
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
    sent = {(kind, v): w for kind, v, w in loads}
    trained = sent[("vllm", 2)]
    assert any(t.abs().max() > 0 for n, t in trained.items() if ".lora_B." in n)
    loads.clear()

    resumed = await run_pipeline(config(5), resume=str(run_dir / "checkpoints" / "step-000002"))
    assert [r.version for r in resumed.records] == [3, 4, 5]
    # vLLM and ActorForward start on the checkpoint's adapter: the trainer's of version 2
    for kind in ("vllm", "forward"):
        first = next((v, w) for k, v, w in loads if k == kind)
        assert first[0] == 2
        assert sorted(first[1]) == sorted(trained)
        assert all(torch.equal(first[1][n], trained[n]) for n in trained), kind
    assert all(r.sync["sync_bytes"] == 2 * adapters for r in resumed.records)
    print(
        "resumed mismatch_kl_k1:", [f"{r.metrics['mismatch_kl_k1']:.1e}" for r in resumed.records]
    )
    assert all(abs(r.metrics["mismatch_kl_k1"]) < 1e-4 for r in resumed.records)
    check = check_samples(read_samples(str(run_dir)), group_size=4, staleness=0)
    assert check.ok, check
