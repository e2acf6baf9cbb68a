"""Speed of the tiny policy model and the RL step on CPU.

Prints one JSON object per line: {"name", "value", "unit"} plus "baseline" and "ratio" when a
baseline is measured in the same run. Every figure is the median of several repeats.

- sample_tokens_per_s: 2-layer d=128 model, batch 64, 32 new tokens per row, with the KV
  cache; baseline: the same sampling recomputing the whole sequence each step (no cache).
- grpo_step_ms: one GRPO update on 64 rollouts (8 prompts x 8) of the addition task:
  logprob forward, advantages, PPO loss, backward, AdamW step.
- grpo_iteration_ms: the same plus generating and scoring the 64 rollouts.
- policy_loss_ms: `policy_loss` alone with TIS + geometric rejection on [256, 512] tensors.

Usage: python benchmarks/bench_rl.py [--repeats N] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from asyncflow_actors.models import (
    CharTokenizer,
    GenerationOutput,
    SamplingParams,
    TinyConfig,
    TinyDecoder,
    generate,
    token_logprobs,
)
from asyncflow_actors.rl import (
    AdditionTask,
    OffPolicyCorrection,
    PPOLossConfig,
    decode_responses,
    encode_prompts,
    grpo_advantages,
    policy_loss,
    score_responses,
)


def _median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _emit(name: str, value: float, unit: str, baseline: float | None = None) -> None:
    record: dict[str, object] = {"name": name, "value": round(value, 3), "unit": unit}
    if baseline is not None:
        record["baseline"] = round(baseline, 3)
        record["ratio"] = round(value / baseline, 3)
    print(json.dumps(record), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    # One thread by default: on small shared machines intra-op threads of tiny kernels spin-wait
    # on each other and run several times slower than a single thread.
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    task = AdditionTask(min_digits=2, max_digits=3)
    tok = CharTokenizer(task.alphabet)
    torch.manual_seed(0)
    model = TinyDecoder(
        TinyConfig(vocab_size=tok.vocab_size, d_model=128, n_layers=2, n_heads=4, max_seq_len=64)
    )

    prompts = encode_prompts(tok, task.sample(64, seed=0))
    params = SamplingParams(max_new_tokens=32)

    def sample(use_cache: bool) -> Callable[[], object]:
        def run() -> object:
            gen = torch.Generator().manual_seed(0)
            return generate(
                model,
                prompts,
                params,
                pad_id=tok.pad_id,
                eos_id=None,
                generator=gen,
                use_kv_cache=use_cache,
            )

        return run

    tokens = 64 * params.max_new_tokens
    cached = tokens / _median_seconds(sample(True), args.repeats)
    uncached = tokens / _median_seconds(sample(False), args.repeats)
    _emit("sample_tokens_per_s", cached, "tokens/s", baseline=uncached)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rollout_params = SamplingParams(max_new_tokens=8)
    group_ids = torch.arange(8).repeat_interleave(8)
    problems = [p for p in task.sample(8, seed=1) for _ in range(8)]
    problem_ids = encode_prompts(tok, problems)

    def rollout() -> tuple[GenerationOutput, torch.Tensor]:
        out = generate(
            model,
            problem_ids,
            rollout_params,
            pad_id=tok.pad_id,
            eos_id=tok.eos_id,
            generator=torch.Generator().manual_seed(1),
        )
        rewards = score_responses(task, problems, decode_responses(tok, out))
        return out, rewards

    fixed_out, fixed_rewards = rollout()

    def update(out: GenerationOutput, rewards: torch.Tensor) -> None:
        batch = out.to_batch()
        adv = grpo_advantages(rewards, group_ids, batch.response_mask).advantages
        logp = token_logprobs(
            model, batch.input_ids, batch.attention_mask, response_length=batch.response_length
        ).logprobs
        loss = policy_loss(logp, logp.detach(), adv, batch.response_mask).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    step = _median_seconds(lambda: update(fixed_out, fixed_rewards), args.repeats * 4, warmup=3)
    _emit("grpo_step_ms", step * 1e3, "ms")
    iteration = _median_seconds(lambda: update(*rollout()), args.repeats * 2, warmup=2)
    _emit("grpo_iteration_ms", iteration * 1e3, "ms")

    gen = torch.Generator().manual_seed(2)
    shape = (256, 512)
    old = -torch.rand(shape, generator=gen) - 0.1
    behaviour = old + 0.05 * torch.randn(shape, generator=gen)
    current = (old + 0.05 * torch.randn(shape, generator=gen)).requires_grad_(True)
    adv = torch.randn(shape, generator=gen)
    mask = torch.rand(shape, generator=gen) < 0.8
    cfg = PPOLossConfig(
        correction=OffPolicyCorrection(
            is_level="token",
            is_threshold=2.0,
            rejection_level="geometric",
            rejection_low=0.9,
            rejection_high=1.1,
        )
    )
    loss_s = _median_seconds(
        lambda: policy_loss(current, old, adv, mask, cfg, behaviour_logprobs=behaviour),
        args.repeats * 4,
        warmup=2,
    )
    _emit("policy_loss_ms", loss_s * 1e3, "ms")


if __name__ == "__main__":
    main()
