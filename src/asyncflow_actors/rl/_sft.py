"""`sft_warmup`: supervised training of a tiny model until it reaches a target accuracy.

GRPO learns nothing from groups whose rewards are all equal, so a policy that never succeeds
gives no signal: warm it up first, and stop at a target greedy accuracy, not after a time.
"""

from __future__ import annotations

import random

import attrs
import torch

from ..models import CharTokenizer, SamplingParams, TinyDecoder, pack_batch, token_logprobs
from ._errors import RLInputError, TaskError
from ._evaluate import encode_answers, encode_prompts, evaluate
from ._tasks import Task

__all__ = ["SFTResult", "sft_warmup"]


@attrs.frozen
class SFTResult:
    """Outcome of `sft_warmup`: optimizer `steps` taken, the last greedy `accuracy` measured
    on the held-out set, whether it reached the target, and every `(step, accuracy)` measured."""

    steps: int
    accuracy: float
    reached_target: bool
    history: tuple[tuple[int, float], ...]


def sft_warmup(
    model: TinyDecoder,
    task: Task,
    tokenizer: CharTokenizer,
    *,
    target_accuracy: float,
    max_steps: int,
    batch_size: int = 64,
    lr: float = 1e-3,
    eval_every: int = 20,
    eval_size: int = 128,
    seed: int = 0,
    eval_seed: int = 10_000_019,
    optimizer: torch.optim.Optimizer | None = None,
) -> SFTResult:
    """Train `model` in place on `task`'s reference answers (teacher forcing, mean token NLL
    of answer + `<eos>`) until greedy exact-match accuracy on `eval_size` held-out problems
    (sampled with `eval_seed`, never trained on) reaches `target_accuracy`, or `max_steps`.

    Accuracy is measured before the first step and every `eval_every` steps (and after the
    last), so training stops within `eval_every` steps of reaching the target. Uses AdamW(`lr`)
    unless `optimizer` is given. Deterministic for fixed seeds and torch thread count.
    """
    if not 0 < target_accuracy <= 1:
        raise RLInputError(f"target_accuracy must lie in (0, 1], got {target_accuracy!r}")
    for name, value in (
        ("max_steps", max_steps),
        ("batch_size", batch_size),
        ("eval_every", eval_every),
        ("eval_size", eval_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise RLInputError(f"{name} must be a positive int, got {value!r}")
    held_out = task.sample(eval_size, eval_seed)
    held_prompts = {p.prompt for p in held_out}
    max_answer = max(len(tokenizer.encode(p.answer)) for p in held_out)
    greedy = SamplingParams(max_new_tokens=max_answer + 1, temperature=0.0)
    opt = optimizer or torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)

    def measure() -> float:
        return evaluate(model, task, tokenizer, held_out, greedy).accuracy

    accuracy = measure()
    history = [(0, accuracy)]
    step = 0
    while accuracy < target_accuracy and step < max_steps:
        problems = [
            p for p in task.sample(batch_size, rng.getrandbits(63)) if p.prompt not in held_prompts
        ]
        if not problems:
            raise TaskError(
                f"task {task.name!r} yields only held-out problems; it has too few distinct "
                "problems for a held-out evaluation set"
            )
        batch = pack_batch(
            encode_prompts(tokenizer, problems),
            encode_answers(tokenizer, problems),
            pad_id=tokenizer.pad_id,
        )
        logp = token_logprobs(model, batch).logprobs
        mask = batch.response_mask.float()
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        opt.step()
        step += 1
        if step % eval_every == 0 or step == max_steps:
            accuracy = measure()
            history.append((step, accuracy))
    return SFTResult(
        steps=step,
        accuracy=accuracy,
        reached_target=accuracy >= target_accuracy,
        history=tuple(history),
    )
