"""A Hugging Face policy (``model.hf``) served by the HF engine: the code path of the vLLM
example (``examples/vllm_grpo.py``) except vLLM itself, on a tiny Llama exported offline."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from asyncflow_actors.models import CharTokenizer, TinyConfig, TinyDecoder
from asyncflow_actors.pipeline import run_pipeline

from .kit import tiny

pytest.importorskip("transformers", reason="the hf extra is not installed")


async def test_a_hugging_face_policy_trains_through_the_hf_engine(tmp_path: Path) -> None:
    from asyncflow_actors.rollout import export_hf

    tokenizer = CharTokenizer("0123456789+=")
    torch.manual_seed(0)
    export_hf(
        tmp_path / "hf",
        TinyDecoder(
            TinyConfig(
                vocab_size=tokenizer.vocab_size, d_model=64, n_heads=1, n_layers=1, max_seq_len=32
            )
        ),
        tokenizer,
    )
    config = tiny(
        "sync",
        run_dir=str(tmp_path / "run"),
        model={"hf": str(tmp_path / "hf")},
        rollout={"engine": "hf"},
        train={"steps": 2, "checkpoint_every": 2},
        report={"log_completions_every": 2},
    )
    result = await run_pipeline(config)
    assert [r.version for r in result.records] == [1, 2]
    assert result.records[-1].sync["sync_bytes"] > 0  # HF tensor names, loaded by the engine
    # the engine's and the trainer's log-probs of the same tokens agree
    assert abs(result.records[-1].metrics["mismatch_kl_k1"]) < 1e-3
    # sample completions decoded by the HF tokenizer, as the rewards saw them
    samples = (tmp_path / "run" / "completions.jsonl").read_text().splitlines()
    assert [json.loads(s)["step"] for s in samples] == [2, 2]
    assert all(re.fullmatch(r"\d+\+\d+=", json.loads(s)["prompt"]) for s in samples)
    saved = Path(result.checkpoints[-1]) / "policy"
    assert (saved / "config.json").exists() and (saved / "model.safetensors").exists()
