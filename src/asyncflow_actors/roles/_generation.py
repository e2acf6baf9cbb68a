"""Generating one group: the request of a prompt's attempt, the engine that takes it, the
generation slot the prompt holds meanwhile, and the group's rows as the rollout writes them.

Every token carries the version of the weights that produced it; the sample's version is its
*oldest* token's.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import trio

from . import _schema as S
from ._settings import RunSpec

if TYPE_CHECKING:
    from ..rollout import Completion, GenerationEngine, GenerationRequest


class _Slot:
    """A prompt's hold on one of the worker's generation slots. It is given back as soon as the
    group is generated (scoring and writing it do not occupy the engines, and slots freed in
    the same decode step go back together, so the next prompts come in one lease), and taken
    again to generate the group anew."""

    def __init__(self, free: trio.Semaphore) -> None:
        self.free = free
        self.held = True  # the caller acquired it

    async def acquire(self) -> None:
        if not self.held:
            await self.free.acquire()
            self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.free.release()


def sample_seed(seed: int, prompt_index: int, attempt: int) -> int:
    """A request's seed: reproducible per (run seed, prompt, attempt)."""
    return ((seed * 1_000_003 + prompt_index) * 131 + attempt) % (1 << 62)


def group_request(
    spec: RunSpec, prompt_ids: Sequence[int], index: int, attempt: int
) -> GenerationRequest:
    """The request for attempt ``attempt`` at the group of prompt ``index`` (``prompt_ids``: as
    the Driver tokenized it): ``group_size`` samples with the run's sampling settings."""
    from ..rollout import GenerationRequest, SamplingConfig

    sampling = SamplingConfig(
        max_new_tokens=spec.rollout.max_new_tokens,
        temperature=spec.rollout.temperature,
        top_p=spec.rollout.top_p,
        top_k=spec.rollout.top_k,
        n=spec.rollout.group_size,
        seed=sample_seed(spec.train.seed, index, attempt),
    )
    return GenerationRequest(tuple(prompt_ids), sampling)


def least_busy(engines: Sequence[GenerationEngine]) -> GenerationEngine:
    """The engine with the fewest running requests (a lone engine is not asked: an engine's
    statistics are not free)."""
    return engines[0] if len(engines) == 1 else min(engines, key=_running)


def _running(engine: GenerationEngine) -> int:
    return engine.statistics().running


def oldest_version(completions: Sequence[Completion], current: int) -> int:
    """The group's version: its oldest token's (``current`` for a completion without tokens)."""
    return min(current if c.oldest_version is None else c.oldest_version for c in completions)


def group_rows(
    completions: Sequence[Completion],
    rewards: list[float],
    parts: Sequence[Sequence[float]] | None = None,
) -> dict[str, Any]:
    """A scored group's rows, as the rollout writes them (``parts``: each reward function's
    value per sample, when the run has reward functions)."""
    import torch

    lengths = [len(c.token_ids) for c in completions]
    extra = {} if parts is None else {S.REWARD_PARTS: torch.tensor(parts, dtype=torch.float32)}
    return {
        **extra,
        S.RESPONSE_IDS: _as_rows([c.token_ids for c in completions], lengths, torch.int64),
        S.BEHAVIOUR: _as_rows([c.logprobs for c in completions], lengths, torch.float32),
        S.TOKEN_VERSIONS: _as_rows([c.versions for c in completions], lengths, torch.int64),
        S.REWARDS: torch.tensor(rewards, dtype=torch.float32),
        S.RESUMES: torch.tensor([c.resumes for c in completions], dtype=torch.int64),
    }


def _as_rows(values: list[Sequence[Any]], lengths: list[int], dtype: Any) -> list[Any]:
    """A group's rows of one column as tensors: one conversion of them all, split into views
    (a conversion per row cost more than a group's bookkeeping)."""
    import torch

    flat = torch.tensor(list(itertools.chain.from_iterable(values)), dtype=dtype)
    return list(flat.split(lengths))  # type: ignore[no-untyped-call]
