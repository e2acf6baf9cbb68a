"""Scoring: a group's responses against its answer with the run's task, inline in the Rollout
(the groups that complete together in one worker-thread call) or in a ``Reward`` actor of its
own for expensive rewards."""

from __future__ import annotations

from typing import Any

import attrs
import outcome

from ..actors import Actor, ActorContext
from ._messages import Score, Scored
from ._settings import RunSpec
from ._worker import in_thread, load_compute


@attrs.frozen
class _ToScore:
    prompt: str
    answer: str
    texts: tuple[str, ...]


def _score_groups(task: Any, groups: list[_ToScore]) -> list[outcome.Outcome[list[float]]]:
    """Each group's rewards, or the error scoring it raised (in a worker thread)."""
    results: list[outcome.Outcome[list[float]]] = []
    for g in groups:
        try:
            results.append(outcome.Value(_score_texts(task, g.prompt, g.answer, g.texts)))
        except Exception as exc:  # this group's own error, raised to its submitter only
            results.append(outcome.Error(exc))
    return results


def _score_texts(task: Any, prompt: str, answer: str, texts: tuple[str, ...]) -> list[float]:
    from ..rl import Problem, score_responses

    problem = Problem(prompt=prompt, answer=answer)
    return [float(x) for x in score_responses(task, [problem] * len(texts), list(texts))]


class Reward(Actor[Score]):
    """Scores responses against answers with the run's task, off the event loop."""

    def __init__(self, spec: RunSpec, worker: str = "reward-0") -> None:
        self.spec = spec
        self.worker = worker

    async def on_start(self, ctx: ActorContext[Score]) -> None:
        await load_compute(self.spec.train.torch_threads)
        self.task = await in_thread(self.spec.task.build)

    async def receive(self, msg: Score, ctx: ActorContext[Score]) -> Scored:
        rewards = await in_thread(_score_texts, self.task, msg.prompt, msg.answer, msg.responses)
        return Scored(tuple(rewards))
