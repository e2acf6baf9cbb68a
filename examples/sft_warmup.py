"""Warm up a tiny policy on reversed-answer addition until it solves 30% of held-out problems,
save it as safetensors, load it back and sample a few answers.

    python examples/sft_warmup.py [--out policy.safetensors] [--target 0.3]

GRPO needs a policy that sometimes succeeds (a group with equal rewards has no signal); this is
the checkpoint a CPU GRPO run starts from. Takes a few seconds to a minute on a laptop core.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from asyncflow_actors.models import (
    CharTokenizer,
    SamplingParams,
    TinyConfig,
    TinyDecoder,
    generate,
    load_model,
    load_tokenizer,
    save_model,
)
from asyncflow_actors.rl import AdditionTask, decode_responses, encode_prompts, sft_warmup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="where to save the model")
    parser.add_argument("--target", type=float, default=0.3, help="greedy exact-match accuracy")
    parser.add_argument("--max-steps", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)  # tiny kernels: one thread is fastest on shared cores

    task = AdditionTask(min_digits=2, max_digits=2)
    tokenizer = CharTokenizer(task.alphabet)
    torch.manual_seed(args.seed)
    config = TinyConfig(vocab_size=tokenizer.vocab_size, d_model=64, n_heads=4, max_seq_len=16)
    model = TinyDecoder(config)

    result = sft_warmup(
        model,
        task,
        tokenizer,
        target_accuracy=args.target,
        max_steps=args.max_steps,
        eval_every=10,
        seed=args.seed,
    )
    print(
        f"SFT: {result.steps} steps, held-out accuracy {result.accuracy:.1%}, "
        f"target {'reached' if result.reached_target else 'missed'}"
    )

    with tempfile.TemporaryDirectory() as tmp:
        path = args.out or Path(tmp) / "policy.safetensors"
        save_model(path, model, tokenizer=tokenizer)
        policy, tok = load_model(path), load_tokenizer(path)
        problems = task.sample(5, seed=99)
        out = generate(
            policy,
            encode_prompts(tok, problems),
            SamplingParams(4, temperature=0.0),
            pad_id=tok.pad_id,
            eos_id=tok.eos_id,
        )
        for problem, text in zip(problems, decode_responses(tok, out), strict=True):
            print(
                f"{problem.prompt}{text:<4} expected {problem.answer:<4} "
                f"reward {task.score(problem, text):.2f}"
            )
        print(f"saved to {path}" if args.out else "saved and reloaded from a temporary file")
    if not result.reached_target:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
