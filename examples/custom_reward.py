"""Bring your own task: your reward functions, your dataset, a Hugging Face model with a chat
template, evaluation during training; every role in its own process.

    python examples/custom_reward.py                  # builds what it needs into a temp folder
    python examples/custom_reward.py --out runs/custom --steps 60
    python examples/custom_reward.py --short          # the test suite's version (4 steps)

1. A tiny ``LlamaForCausalLM`` (two layers) saved as a local folder, with a character-level
   tokenizer (``tokenizers``) whose ``chat_template`` renders ``u:<question>\\na:``.
2. ``train.jsonl`` and ``test.jsonl``: conversational prompts (``question``: a message list),
   an ``answer`` and an extra column (``digits``) that a reward function uses by name.
3. ``custom_reward.toml`` run as written, with the paths pointed at what step 1 and 2 built:
   two reward functions by import path (``custom_rewards.py``, next to this file: ``correct``
   and the ``async def brevity``), ``reward.on_error = "zero"``, evaluation every few steps
   (``eval/*`` in ``steps.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile

import attrs
import torch
import trio

from asyncflow_actors.models import CharTokenizer, TinyConfig, TinyDecoder
from asyncflow_actors.pipeline import PipelineConfig, run_pipeline

HERE = os.path.dirname(os.path.abspath(__file__))
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)
ALPHABET = "0123456789+=:\nusa"


def build_model(folder: str, seed: int = 0) -> None:
    """A two-layer ``LlamaForCausalLM`` with a character tokenizer and a chat template."""
    from transformers import AutoTokenizer

    from asyncflow_actors.rollout import export_hf

    tokenizer = CharTokenizer(ALPHABET)
    torch.manual_seed(seed)
    config = TinyConfig(
        vocab_size=tokenizer.vocab_size, d_model=64, n_heads=2, n_layers=2, max_seq_len=32
    )
    export_hf(folder, TinyDecoder(config), tokenizer)
    hf = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(folder)


def write_data(path: str, n: int, seed: int) -> None:
    """``n`` records: ``question`` (a conversation), ``answer`` (the sum, digits reversed) and
    ``digits`` (the longest operand's)."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            record = {
                "question": [{"role": "user", "content": f"{a}+{b}="}],
                "answer": str(a + b)[::-1],
                "digits": max(len(str(a)), len(str(b))),
            }
            f.write(json.dumps(record) + "\n")


def configure(out: str, *, short: bool, steps: int | None) -> PipelineConfig:
    """``custom_reward.toml`` with its paths in ``out`` (and the short version's sizes)."""
    config = PipelineConfig.from_toml(os.path.join(HERE, "custom_reward.toml"))
    dataset = attrs.evolve(config.task.dataset, path=os.path.join(out, "train.jsonl"))
    config = attrs.evolve(
        config,
        run_dir=os.path.join(out, "run"),
        model=attrs.evolve(config.model, hf=os.path.join(out, "model")),
        task=attrs.evolve(config.task, dataset=dataset),
        eval=attrs.evolve(config.eval, dataset=os.path.join(out, "test.jsonl")),
    )
    if short:
        config = attrs.evolve(
            config,
            progress="none",
            plot=False,
            train=attrs.evolve(config.train, steps=4, prompts_per_step=4),
            rollout=attrs.evolve(config.rollout, group_size=4),
            eval=attrs.evolve(config.eval, every=2, samples=4),
        )
    if steps is not None:
        config = attrs.evolve(config, train=attrs.evolve(config.train, steps=steps))
    return config


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for the model, data and run")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--short", action="store_true", help="a 4-step run (the tests)")
    args = parser.parse_args(argv)
    out = args.out or tempfile.mkdtemp(prefix="afa-custom-reward-")
    os.makedirs(out, exist_ok=True)
    build_model(os.path.join(out, "model"))
    write_data(os.path.join(out, "train.jsonl"), 512, seed=1)
    write_data(os.path.join(out, "test.jsonl"), 64, seed=2)
    if HERE not in sys.path:  # custom_rewards.py, when this file is imported (the tests)
        sys.path.insert(0, HERE)
    config = configure(out, short=args.short, steps=args.steps)
    result = trio.run(run_pipeline, config)
    last = result.records[-1]
    summary = {k: v for k, v in last.metrics.items() if k.startswith(("reward/", "eval/"))}
    summary["reward_mean"] = last.reward_mean
    print(json.dumps({"run_dir": config.run_dir, "steps": len(result.records), **summary}))
    return summary


if __name__ == "__main__":
    main()
