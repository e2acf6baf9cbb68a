"""Glue between tasks and the tiny model: encode problems, decode and score generations."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from ..models import CharTokenizer, GenerationOutput, SamplingParams, TinyDecoder, generate
from ._tasks import Problem, Task, score_responses

__all__ = ["EvalResult", "decode_responses", "encode_answers", "encode_prompts", "evaluate"]


def encode_prompts(tokenizer: CharTokenizer, problems: Sequence[Problem]) -> list[list[int]]:
    """Prompt ids: `<bos>` + the prompt's characters (the convention of every helper here)."""
    return [tokenizer.encode(p.prompt, add_bos=True) for p in problems]


def encode_answers(tokenizer: CharTokenizer, problems: Sequence[Problem]) -> list[list[int]]:
    """Target response ids for supervised training: the answer's characters + `<eos>`."""
    return [tokenizer.encode(p.answer, add_eos=True) for p in problems]


def decode_responses(tokenizer: CharTokenizer, output: GenerationOutput) -> list[str]:
    """Response texts of a generation (up to the first `<eos>`, special tokens dropped)."""
    return [tokenizer.decode(ids) for ids in output.responses()]


@attrs.frozen
class EvalResult:
    """`mean_reward` and `accuracy` (fraction of rewards equal to 1) over `n` problems."""

    mean_reward: float
    accuracy: float
    n: int


def evaluate(
    model: TinyDecoder,
    task: Task,
    tokenizer: CharTokenizer,
    problems: Sequence[Problem],
    params: SamplingParams,
    *,
    generator: torch.Generator | None = None,
    batch_size: int = 512,
) -> EvalResult:
    """Generate one response per problem (in batches) and score it with `task`."""
    rewards = []
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        out = generate(
            model,
            encode_prompts(tokenizer, chunk),
            params,
            pad_id=tokenizer.pad_id,
            eos_id=tokenizer.eos_id,
            generator=generator,
        )
        rewards.append(score_responses(task, chunk, decode_responses(tokenizer, out)))
    if not rewards:
        return EvalResult(mean_reward=0.0, accuracy=0.0, n=0)
    all_rewards = torch.cat(rewards)
    return EvalResult(
        mean_reward=float(all_rewards.mean()),
        accuracy=float((all_rewards == 1.0).float().mean()),
        n=len(problems),
    )
