"""The ``GenerationEngine`` protocol and helpers that work with any engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from typing import Protocol, runtime_checkable

import trio

from ..checkpoint import SyncTarget
from ._types import Completion, CompletionDelta, EngineStatistics, FinishReason, GenerationRequest

__all__ = ["CompletionStreamLike", "GenerationEngine", "generate_samples", "generate_with_resume"]


class CompletionStreamLike(Protocol):
    """What ``open_stream`` yields: ``async for delta in stream``, then ``stream.completion``."""

    def __aiter__(self) -> AsyncIterator[CompletionDelta]: ...

    @property
    def completion(self) -> Completion: ...


@runtime_checkable
class GenerationEngine(SyncTarget, Protocol):
    """A rollout engine: generates samples and is a weight-sync target.

    ``generate`` serves one sample (``request.sample_index`` of ``request.sampling.n``) and
    waits while the engine is paused; cancelling it drops the request. ``open_stream`` yields
    its deltas. ``pause``/``resume``/``load_weights``/``version`` follow ``SyncTarget``: under
    ``ABORT`` the requests in flight come back ``FinishReason.ABORTED`` with their prefix, to
    be resubmitted with ``request.continue_from(completion)``; under ``KEEP`` they continue
    after ``resume`` under the new weights. Every token records the version that produced it.
    """

    async def generate(self, request: GenerationRequest) -> Completion: ...

    def open_stream(
        self, request: GenerationRequest
    ) -> AbstractAsyncContextManager[CompletionStreamLike]: ...

    def statistics(self) -> EngineStatistics: ...


async def generate_with_resume(engine: GenerationEngine, request: GenerationRequest) -> Completion:
    """Generate, resubmitting an aborted partial rollout from its prefix until it finishes.

    Each resubmission continues with the budget left (``remaining_tokens``); past the engine's
    ``max_resumes`` the engine raises ``ResumeLimitError``.
    """
    completion = await engine.generate(request)
    while completion.finish_reason is FinishReason.ABORTED:
        request = request.continue_from(completion)
        completion = await engine.generate(request)
    return completion


async def generate_samples(
    engine: GenerationEngine, request: GenerationRequest, *, resume: bool = True
) -> tuple[Completion, ...]:
    """The ``request.sampling.n`` samples of a prompt, generated concurrently, in order.

    With ``resume`` (the default) aborted samples are resubmitted (``generate_with_resume``).
    An engine with a ``generate_many(requests)`` method (the built-in ones) gets the samples in
    one call instead of a task each.
    """
    samples = request.expand()
    results: list[Completion | None] = [None] * len(samples)
    todo = list(enumerate(samples))
    many = getattr(engine, "generate_many", None)
    if many is not None:
        # The built-in engines take the whole group at once, without a task per sample; the
        # samples an abort returned (``PauseMode.ABORT``) are resumed below.
        results = list(await many(samples))
        todo = [
            (i, samples[i].continue_from(c))
            for i, c in enumerate(results)
            if resume and c is not None and c.finish_reason is FinishReason.ABORTED
        ]

    async def one(i: int, sample: GenerationRequest) -> None:
        if resume:
            results[i] = await generate_with_resume(engine, sample)
        else:
            results[i] = await engine.generate(sample)

    if todo:
        async with trio.open_nursery() as nursery:
            for i, sample in todo:
                nursery.start_soon(one, i, sample)
    return tuple(r for r in results if r is not None)
