"""Scoring: a group's responses with the run's reward functions (``task.reward``) or, without
any, its task's ``score``; inline in the Rollout (the groups that complete together in one
call of each function) or in a ``Reward`` actor of its own for expensive rewards.

The functions run off the event loop under ``reward.concurrency``/``reward.timeout``
(``tasks.RewardRunner``); what a failing one does is ``reward.on_error``'s: a failure never
crashes the worker.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import outcome

from ..actors import Actor, ActorContext
from ..tasks._functions import function_name
from ._messages import Score, Scored
from ._settings import RunSpec
from ._threads import intra_op_threads
from ._worker import in_thread, load_compute

__all__ = ["Reward", "reward_names", "reward_part_metrics", "score_groups", "to_score"]


def reward_runner(spec: RunSpec, task: Any) -> Any:
    """The run's ``RewardRunner`` in this process (imports the reward functions)."""
    from ..tasks import RewardRunner

    return RewardRunner(spec.task.reward, spec.task.reward_weights, spec.reward, task=task)


def reward_names(spec: RunSpec) -> tuple[str, ...]:
    """The names of the run's reward functions in metrics (``reward/<name>``); empty when the
    task scores."""
    return tuple(function_name(path) for path in spec.task.reward)


def record_json(problem: Any) -> str:
    """A prompt's record as the Driver sends it: the problem's columns, its prompt and answer."""
    record = dict(problem.metadata)
    record.setdefault("prompt", problem.prompt)
    if problem.answer != "" or "answer" in record:
        record.setdefault("answer", problem.answer)
    return json.dumps(record, default=str)


def to_score(prompt: str, answer: str, record: str, texts: Sequence[str]) -> Any:
    """A group to score (``tasks.ToScore``) from what the prompts topic carries."""
    from ..tasks import ToScore

    columns = json.loads(record) if record else {}
    columns.setdefault("prompt", prompt)
    if answer and "answer" not in columns:
        columns["answer"] = answer
    return ToScore(prompt, columns, tuple(texts))


async def score_groups(runner: Any, groups: list[Any]) -> list[outcome.Outcome[Any]]:
    """Every group's ``GroupScore``; under ``on_error = "raise"`` each group's outcome is the
    ``RewardFailed`` of their call."""
    from ..tasks import RewardFailed

    try:
        scores = await runner.score(groups)
    except RewardFailed as exc:
        return [outcome.Error(exc) for _ in groups]
    return [outcome.Value(s) for s in scores]


def reward_part_metrics(names: Sequence[str], parts: Any) -> dict[str, float]:
    """``reward/<name>``: each function's mean over the samples it scored (``parts`` [B, F],
    ``nan`` where it gave no score)."""
    import torch

    out: dict[str, float] = {}
    for f, name in enumerate(names):
        values = parts[:, f]
        scored = values[~torch.isnan(values)]
        out[f"reward/{name}"] = float(scored.mean()) if len(scored) else math.nan
    return out


class Reward(Actor[Score]):
    """Scores groups with the run's reward functions (or task), off the event loop."""

    def __init__(self, spec: RunSpec, worker: str = "reward-0") -> None:
        self.spec = spec
        self.worker = worker

    async def on_start(self, ctx: ActorContext[Score]) -> None:
        await load_compute(intra_op_threads(self.spec))
        self.task = await in_thread(self.spec.task.build)
        self.runner = await in_thread(reward_runner, self.spec, self.task)

    async def on_stop(self, ctx: ActorContext[Score], error: BaseException | None) -> None:
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.close()
        await super().on_stop(ctx, error)

    async def receive(self, msg: Score, ctx: ActorContext[Score]) -> Scored:
        group = to_score(msg.prompt, msg.answer, msg.record, msg.responses)
        (result,) = await score_groups(self.runner, [group])
        if isinstance(result, outcome.Error):
            return Scored((), failed=str(result.error))
        score = result.unwrap()
        return Scored(score.rewards, score.parts, dropped=score.dropped)
