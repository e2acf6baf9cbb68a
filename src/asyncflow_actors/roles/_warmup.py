"""``WarmUp``: the supervised warm-up of a run's policy (``train.sft_warmup_steps``), run in
the trainer's process before any role starts.

GRPO's advantage is a sample's reward relative to its group's: a group whose rewards are all
equal has no advantage and gives no gradient. A random tiny model solves nothing, so a run
from scratch would train on nothing; supervised steps on the task's reference answers
(``rl.sft_warmup``) give it the partial successes GRPO learns from. The pipeline spawns this
actor where the Trainer will run, asks it once (the torch work in a worker thread) and stops
it; every role then starts from the file it saved (``pipeline._warmup``).
"""

from __future__ import annotations

import os
import time
from typing import Any

import attrs

from ..actors import Actor, ActorContext, Request
from ._settings import RunSpec
from ._threads import intra_op_threads

EVAL_EVERY = 10  # steps between held-out measurements when a target accuracy can stop it


@attrs.frozen
class WarmedUp:
    """What a warm-up did: supervised ``steps``, the held-out greedy exact-match ``accuracy``
    it ended at (``reached_target``: ``train.sft_warmup_accuracy``), its ``seconds``, every
    ``(step, accuracy)`` measured, and the ``path`` of the policy it saved."""

    path: str
    steps: int
    accuracy: float
    reached_target: bool
    seconds: float
    history: tuple[tuple[int, float], ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "history": [list(h) for h in self.history]}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> WarmedUp:
        history = tuple((int(s), float(a)) for s, a in raw.get("history", ()))
        return cls(
            path=str(raw["path"]),
            steps=int(raw["steps"]),
            accuracy=float(raw["accuracy"]),
            reached_target=bool(raw["reached_target"]),
            seconds=float(raw["seconds"]),
            history=history,
        )


@attrs.frozen
class WarmUpPolicy(Request[WarmedUp]):
    """Warm the run's initial policy up and save it (with its tokenizer) at ``path``."""

    path: str


class WarmUp(Actor[WarmUpPolicy]):
    """Answers one ``WarmUpPolicy`` (see the module docstring); ``spec``: the run's, with the
    ``[model]`` the warm-up starts from."""

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec

    async def receive(self, msg: WarmUpPolicy, ctx: ActorContext[WarmUpPolicy]) -> WarmedUp:
        from ._worker import in_thread  # the stations' runtime: not for preflight's imports

        result: WarmedUp = await in_thread(warm_up_policy, self.spec, msg.path)
        return result


def warm_up_policy(spec: RunSpec, path: str) -> WarmedUp:
    """The warm-up itself (blocking, imports torch): the initial policy of ``spec`` trained by
    ``rl.sft_warmup`` with the ``train.sft_warmup_*`` settings, saved at ``path`` whole or not
    at all (written beside it, then renamed)."""
    import torch

    from ..models import save_model
    from ..rl import sft_warmup
    from ._compute import build_policy

    torch.set_num_threads(intra_op_threads(spec))
    train = spec.train
    task = spec.task.build()
    model, tokenizer = build_policy(spec.model, task)
    started = time.perf_counter()
    target = train.sft_warmup_accuracy
    # without a target below 1 only the end is measured: each measurement decodes 128 problems
    every = EVAL_EVERY if target < 1 else train.sft_warmup_steps
    with torch.random.fork_rng():
        torch.manual_seed(train.seed)
        result = sft_warmup(
            model, task, tokenizer, target_accuracy=target, max_steps=train.sft_warmup_steps,
            lr=train.sft_warmup_lr, eval_every=every, seed=train.seed,
        )  # fmt: skip
    seconds = time.perf_counter() - started
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    partial = path + ".partial"
    save_model(partial, model, tokenizer=tokenizer)
    os.replace(partial, path)
    return WarmedUp(
        path=path,
        steps=result.steps,
        accuracy=result.accuracy,
        reached_target=result.reached_target,
        seconds=seconds,
        history=result.history,
    )
