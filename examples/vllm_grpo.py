"""GRPO of a Hugging Face model with vLLM generating, asynchronously (GPU or Ascend NPU).

    python examples/vllm_grpo.py examples/vllm_grpo.toml [--steps N]

**Not run in this project's CI or on its development machines: they have no GPU.** What runs
here is everything but vLLM: the same pipeline with ``rollout.engine = "hf"`` trains a tiny
Hugging Face Llama on CPU in ``tests/pipeline/test_hf_policy.py`` (weights synced by their
Hugging Face names, log-probs recomputed by the forward station, checkpoints saved with
``save_pretrained``). The vLLM adapter's own tests run where vLLM and a GPU are present.

The config (``examples/vllm_grpo.toml``) names a local model folder (``model.hf``), the
device of the trainer and forward stations, vLLM's engine arguments and the usual pipeline
sections; ``asyncflow train examples/vllm_grpo.toml`` does the same as this script.
"""

from __future__ import annotations

import argparse

import attrs
import trio

from asyncflow_actors.pipeline import PipelineConfig, run_pipeline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a TOML config, e.g. examples/vllm_grpo.toml")
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    config = PipelineConfig.from_toml(args.config)
    if args.steps is not None:
        config = attrs.evolve(config, train=attrs.evolve(config.train, steps=args.steps))
    result = trio.run(run_pipeline, config)
    print(
        f"{len(result.records)} steps, {result.samples} samples at "
        f"{result.samples_per_s:.1f} samples/s; final batch reward "
        f"{result.final_reward():.3f}; checkpoints: {list(result.checkpoints)}"
    )


if __name__ == "__main__":
    main()
