"""Tiny runs of the pipeline for tests: a 1-layer policy, short answers, small batches."""

from __future__ import annotations

from typing import Any

from asyncflow_actors.pipeline import PipelineConfig


def tiny(mode: str = "async", **overrides: Any) -> PipelineConfig:
    """A run of 3 steps of 4 groups of 4 samples, every role in this process."""
    table: dict[str, Any] = {
        "mode": mode,
        "progress": "none",
        "plot": False,
        "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 16},
        "task": {"kind": "addition", "options": {"min_digits": 1, "max_digits": 2}},
        "rollout": {"group_size": 4, "max_new_tokens": 4, "max_batch": 32},
        "train": {"steps": 3, "prompts_per_step": 4, "forward_batch": 8},
        "placement": {"default": "local"},
    }
    for key, value in overrides.items():
        if isinstance(value, dict):
            table[key] = {**table.get(key, {}), **value}
        else:
            table[key] = value
    return PipelineConfig.from_dict(table)
