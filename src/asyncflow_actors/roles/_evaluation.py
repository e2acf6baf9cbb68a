"""Evaluation during training, on a rollout worker's engines.

The Driver asks one rollout worker (``Evaluate``) every ``eval.every`` steps; the worker runs
the evaluation prompts through its engines next to its training groups (continuous batching:
the evaluation costs the engine time it uses, and the trainer does not wait for it) and
scores them with the run's reward functions. Figures, as ``eval/<name>`` in the step record:
``reward_mean``, ``reward/<function>`` (each function's mean where it scored), ``pass@1`` (the
share of samples whose total reward reaches ``eval.pass_threshold``) and, sampled with ``n``
responses a prompt, ``pass@n`` (the unbiased estimator).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import trio

from ._generation import least_busy, sample_seed
from ._messages import Evaluate, Evaluated
from ._reward import to_score
from ._settings import RunSpec

__all__ = ["eval_metrics", "evaluate"]


async def evaluate(
    spec: RunSpec, engines: Sequence[Any], tokenizer: Any, runner: Any, msg: Evaluate
) -> Evaluated:
    """Generate ``msg.n`` responses to each prompt of ``msg`` (greedy when ``n == 1`` and
    ``eval.greedy``), score them and summarise (``eval_metrics``)."""
    from ..rollout import GenerationRequest, SamplingConfig, generate_samples

    version = min(e.version for e in engines)
    texts: list[tuple[str, ...]] = [()] * len(msg.prompts)
    greedy = msg.n == 1 and spec.eval.greedy

    async def one(i: int) -> None:
        sampling = SamplingConfig(
            max_new_tokens=spec.rollout.max_new_tokens,
            temperature=0.0 if greedy else spec.rollout.temperature,
            top_p=spec.rollout.top_p,
            top_k=spec.rollout.top_k,
            n=msg.n,
            seed=sample_seed(spec.train.seed + 7919, i, version),
        )
        request = GenerationRequest(tokenizer.encode(msg.prompts[i], add_bos=True), sampling)
        completions = await generate_samples(least_busy(engines), request)
        texts[i] = tuple(tokenizer.decode(list(c.token_ids)) for c in completions)

    async with trio.open_nursery() as nursery:
        for i in range(len(msg.prompts)):
            nursery.start_soon(one, i)
    groups = [
        to_score(prompt, "", record, group)
        for prompt, record, group in zip(msg.prompts, msg.records, texts, strict=True)
    ]
    scores = await runner.score(groups)
    rewards = [list(s.rewards) for s in scores if s.dropped is None]
    parts = [list(row) for s in scores if s.dropped is None for row in s.parts]
    names = runner.names if spec.task.reward else ()
    metrics = eval_metrics(rewards, parts, names, msg.threshold)
    metrics["eval_dropped_groups"] = float(sum(1 for s in scores if s.dropped is not None))
    return Evaluated(metrics, version)


def eval_metrics(
    rewards: Sequence[Sequence[float]],
    parts: Sequence[Sequence[float]],
    names: Sequence[str],
    threshold: float,
) -> dict[str, float]:
    """The figures of scored groups (``rewards[g][i]``; ``parts[sample][function]``)."""
    from ..rl import pass_at_k

    flat = [r for group in rewards for r in group]
    out: dict[str, float] = {"eval_samples": float(len(flat))}
    if not flat:
        return out
    out["eval/reward_mean"] = sum(flat) / len(flat)
    out["eval/pass@1"] = sum(1 for r in flat if r >= threshold) / len(flat)
    n = min(len(g) for g in rewards)
    if n > 1:
        estimates = [pass_at_k(len(g), sum(1 for r in g if r >= threshold), n) for g in rewards]
        out[f"eval/pass@{n}"] = sum(estimates) / len(estimates)
    for f, name in enumerate(names):
        scored = [row[f] for row in parts if not math.isnan(row[f])]
        out[f"eval/reward/{name}"] = sum(scored) / len(scored) if scored else math.nan
    return out
