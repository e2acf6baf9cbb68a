"""The long tail, synchronous against asynchronous: the same pipeline, the same policy, the same
cores; trained samples per second of each and their ratio.

    python examples/longtail_throughput.py [--steps 8] [--staleness 1] [--placement folded]

The task reverses strings whose lengths follow a Pareto law (most short, a few ten times
longer). A short supervised warm-up teaches the policy to answer with those lengths, so its
generations have the task's long tail. In ``sync`` mode every step waits for the longest
generation of its batch, and rollout idles while the trainer updates; in ``async`` mode rollout
keeps generating the next batches (up to ``staleness`` versions ahead) while the tail of the
current one finishes and while the trainer updates.

``--placement folded`` (the default) is the placement ``docs/pipeline.md`` recommends for long
generations on a small model: the trainer computes the old log-probs and advantages, the rollout
has a process of its own. ``process`` puts every role in a process of its own, ``local`` every
role in this one.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import trio

from asyncflow_actors.models import CharTokenizer, TinyConfig, TinyDecoder, save_model
from asyncflow_actors.pipeline import PipelineConfig, PipelineResult, run_pipeline
from asyncflow_actors.rl import LongTailTask, sft_warmup

PLACEMENTS = {
    "folded": {"default": "process", "roles": {"actor_fwd": "trainer", "advantage": "trainer"}},
    "process": {"default": "process"},
    "local": {"default": "local"},
}
TASK = LongTailTask(op="reverse", distribution="pareto", min_length=2, max_length=40)


def warm_up(path: str, steps: int) -> None:
    tokenizer = CharTokenizer(TASK.alphabet)
    torch.manual_seed(0)
    model = TinyDecoder(
        TinyConfig(vocab_size=tokenizer.vocab_size, d_model=64, n_heads=4, max_seq_len=96)
    )
    sft_warmup(model, TASK, tokenizer, target_accuracy=1.0, max_steps=steps, eval_every=steps,
               eval_size=64)  # fmt: skip
    save_model(path, model, tokenizer=tokenizer)


def config(mode: str, init: str, args: argparse.Namespace) -> PipelineConfig:
    return PipelineConfig.from_dict(
        {
            "mode": mode,
            **({"staleness": args.staleness} if mode == "async" else {}),
            "progress": "plain",
            "plot": False,
            "model": {"init": init},
            "task": {
                "kind": "longtail",
                "options": {"op": "reverse", "min_length": 2, "max_length": 40},
            },
            "rollout": {"group_size": 4, "max_new_tokens": 44},
            "train": {"steps": args.steps, "prompts_per_step": 8},
            "placement": PLACEMENTS[args.placement],
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--staleness", type=int, default=1)
    parser.add_argument("--placement", default="folded", choices=sorted(PLACEMENTS))
    parser.add_argument("--warmup-steps", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "longtail.safetensors")
        print(f"warming up the policy on {TASK.name} ({args.warmup_steps} steps) ...")
        warm_up(init, args.warmup_steps)
        results: dict[str, PipelineResult] = {}
        for mode in ("sync", "async"):
            print(f"--- {mode}")
            results[mode] = trio.run(run_pipeline, config(mode, init, args))
    sync, fast = results["sync"], results["async"]
    for name, result in results.items():
        lengths = [r.metrics.get("response_length", 0.0) for r in result.records]
        print(
            f"{name:>5}: {result.samples_per_s:6.1f} samples/s ({result.samples} samples in "
            f"{result.seconds:.1f} s, mean response {sum(lengths) / len(lengths):.1f} tokens)"
        )
    print(f"async / sync: {fast.samples_per_s / sync.samples_per_s:.2f}x")


if __name__ == "__main__":
    main()
