"""A tiny policy learns reversed-answer addition: SFT warm-up, then asynchronous GRPO on CPU.

    python examples/addition_grpo.py                   # the embedded defaults (nox -s demo)
    python examples/addition_grpo.py --mode sync       # the synchronous baseline
    python examples/addition_grpo.py --staleness 0 --placement local --steps 10

1. Supervised warm-up (``train.sft_warmup_steps``: ``rl.sft_warmup`` in the trainer's process)
   until the policy solves 30% of held-out problems greedily: GRPO learns nothing from groups
   whose rewards are all equal, and a random policy's are all 0.
2. GRPO through the pipeline: Driver, Rollout (the built-in engine), ActorForward, Advantage and
   Trainer as actors, each in its own process by default, talking through the TransferQueue;
   rollout runs up to ``--staleness`` policy versions ahead of training; weights reach the
   engines through the CheckpointEngine after every step. Every 10 steps a rollout engine
   answers 256 problems greedily (``eval``): the curve to watch. ``--lr`` is 1e-4: at 5e-4
   (the library's default) Adam's steps on 128 samples are mostly the policy gradient's noise,
   and the greedy answers barely improved; 120 steps: slower seeds go on learning after 80
   (benchmarks/RESULTS.md, "The demo's curve").
3. The trained policy (the run's last checkpoint) against the warmed-up one, on 512 held-out
   problems: mean reward and exact answers sampled as in training, and greedy exact answers.

It prints one line per step, writes ``steps.jsonl`` and ``curves.png`` (reward, evaluation,
loss...) into the run directory, and ends with what the policy learned.
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
import time

import torch
import trio

from asyncflow_actors.models import CharTokenizer, SamplingParams, TinyDecoder, load_model
from asyncflow_actors.pipeline import PipelineConfig, PlacementConfig, StepRecord, run_pipeline
from asyncflow_actors.rl import AdditionTask, evaluate
from asyncflow_actors.roles import (
    ModelSettings,
    RolloutSettings,
    TaskSettings,
    TrainSettings,
)
from asyncflow_actors.tasks import EvalSettings

TASK = AdditionTask(min_digits=2, max_digits=2)
SEED = 2


def held_out(model: TinyDecoder, temperature: float) -> tuple[float, float, float]:
    """On 512 held-out problems: mean reward and exact answers sampled as in training (at the
    rollout's ``temperature``), and greedy exact answers."""
    tokenizer = CharTokenizer(TASK.alphabet)
    problems = TASK.sample(512, seed=777)
    generator = torch.Generator().manual_seed(123)
    sampling = SamplingParams(5, temperature=temperature)
    sampled = evaluate(model, TASK, tokenizer, problems, sampling, generator=generator)
    greedy = evaluate(model, TASK, tokenizer, problems, SamplingParams(5, temperature=0.0))
    return sampled.mean_reward, sampled.accuracy, greedy.accuracy


def show_eval(record: StepRecord) -> None:
    """The in-training evaluation, when a step has one: the curve a newcomer should watch."""
    exact = record.metrics.get("eval/pass@1")
    if exact is not None:
        print(f"  eval after step {record.step}: greedy exact {exact:.1%} of 256 problems")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="async", help="sync | colocated | one_step_off | async")
    parser.add_argument("--staleness", type=int, default=None, help="async only (default 1)")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--temperature", type=float, default=1.0, help="rollout sampling")
    parser.add_argument("--seed", type=int, default=SEED, help="model, warm-up, prompts, sampling")
    parser.add_argument("--placement", default="process", help="process | local")
    parser.add_argument("--run-dir", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)  # tiny kernels on shared cores: one thread is fastest
    run_dir = args.run_dir or tempfile.mkdtemp(prefix="addition-grpo-")
    config = PipelineConfig(
        mode=args.mode,
        staleness=args.staleness,
        run_dir=run_dir,
        model=ModelSettings(max_seq_len=16, seed=args.seed),
        task=TaskSettings("addition", {"min_digits": 2, "max_digits": 2}, seed=args.seed),
        rollout=RolloutSettings(group_size=8, max_new_tokens=5, temperature=args.temperature),
        train=TrainSettings(
            steps=args.steps,
            prompts_per_step=16,
            lr=args.lr,
            seed=args.seed,
            # the supervised warm-up, in the trainer's process before the first rollout
            sft_warmup_steps=1500,
            sft_warmup_accuracy=0.3,
        ),
        # greedy answers to 256 problems every 10 steps: curves.png's evaluation panel
        eval=EvalSettings(every=10, samples=256, greedy=True),
        placement=PlacementConfig(default=args.placement),
    )
    started = time.perf_counter()
    result = trio.run(functools.partial(run_pipeline, config, on_step=show_eval))
    seconds = time.perf_counter() - started
    assert result.warmup is not None
    before = held_out(
        load_model(result.warmup.path), args.temperature
    )  # the warmed-up policy, as GRPO found it
    trained = load_model(os.path.join(run_dir, "final", "policy.safetensors"))  # always saved
    after = held_out(trained, args.temperature)

    rewards = [r.reward_mean for r in result.records]
    k = max(1, len(rewards) // 4)
    print(
        f"\nGRPO ({result.mode}, staleness {result.staleness}): {result.samples} samples in "
        f"{result.seconds:.0f} s ({result.samples_per_s:.0f} samples/s), "
        f"{result.offpolicy_samples} trained samples one or more versions old; "
        f"{seconds:.0f} s in all, warm-up and start included"
    )
    print(
        f"batch reward: first {k} steps {sum(rewards[:k]) / k:.3f} -> last {k} steps "
        f"{sum(rewards[-k:]) / k:.3f}"
    )
    print(
        f"held-out, 512 problems: sampled reward {before[0]:.3f} -> {after[0]:.3f}, sampled "
        f"exact {before[1]:.1%} -> {after[1]:.1%}, greedy exact {before[2]:.1%} -> {after[2]:.1%}"
    )
    print(f"run directory: {run_dir} (steps.jsonl, curves.png, warmup/, final/)")


if __name__ == "__main__":
    main()
