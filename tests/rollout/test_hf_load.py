"""Concurrent loads of one Hugging Face policy in one process each get the whole model."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from asyncflow_actors.rollout import load_causal_lm


def test_concurrent_loads_in_one_process_each_get_every_weight(tmp_path: Path) -> None:
    """Unserialised, 10 threads loading a tied-embedding Llama at once left parameters on the
    ``meta`` device in most of them (a rollout restart overlapping the trainer's load)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    saved = LlamaForCausalLM(config)
    saved.save_pretrained(tmp_path)
    expected = {k: v.clone() for k, v in saved.state_dict().items()}
    threads, start = 10, threading.Barrier(10)
    loaded: list[torch.nn.Module] = []
    errors: list[BaseException] = []

    def load() -> None:
        start.wait()
        try:
            loaded.append(load_causal_lm(str(tmp_path)))
        except BaseException as exc:  # collected and asserted below
            errors.append(exc)

    workers = [threading.Thread(target=load) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert errors == []
    assert len(loaded) == threads
    for model in loaded:
        state = model.state_dict()
        assert not any(t.is_meta for t in state.values())
        assert state.keys() == expected.keys()
        assert all(torch.equal(state[k], expected[k]) for k in expected)
