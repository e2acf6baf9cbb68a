"""Reward functions the tests name by import path (``tests.tasks.rewards:...``)."""

from __future__ import annotations

import random
from typing import Any

import trio

_flaky = random.Random(0)


def _text(completion: Any) -> str:
    return completion[0]["content"] if isinstance(completion, list) else str(completion)


def exact(prompts: list[Any], completions: list[Any], answer: list[str], **kw: Any) -> list[float]:
    return [1.0 if _text(c).strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]


def length(completions: list[Any], **kw: Any) -> list[float | None]:
    """Negative and unbounded: minus the length; no score for empty completions."""
    return [-float(len(_text(c))) or None for c in completions]


def digits(completions: list[Any], **kw: Any) -> list[float]:
    """The sum of the completion's digits: it differs between the samples of an untrained
    policy, so its first steps already move the weights (a LoRA B that leaves zero)."""
    return [float(sum(int(ch) for ch in _text(c) if ch.isdigit())) for c in completions]


def flaky(completions: list[Any], **kw: Any) -> list[float]:
    """Raises on one call in five."""
    if _flaky.random() < 0.2:
        raise ValueError("flaky reward failed")
    return [1.0] * len(completions)


async def slow_async(completions: list[Any], **kw: Any) -> list[float]:
    import asyncio

    await asyncio.sleep(0.01)
    return [0.5] * len(completions)


async def hangs(completions: list[Any], **kw: Any) -> list[float]:
    import asyncio

    await asyncio.sleep(3600)
    return []


def columns_seen(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
    """1.0 when every column arrived with one value per sample (a reward of the column
    ``level`` otherwise raises)."""
    assert all(len(v) == len(completions) for v in columns.values()), columns
    return [float(level) for level in columns["level"]]


def trio_free(completions: list[Any], **kw: Any) -> list[float]:
    """Fails if called on a trio event loop's thread (it must run in a worker thread)."""
    try:
        trio.lowlevel.current_trio_token()
    except RuntimeError:
        return [1.0] * len(completions)
    raise AssertionError("a sync reward ran on the event loop")


_calls = [0]


def every_fifth_fails(completions: list[Any], **kw: Any) -> list[float]:
    """Raises on one call in five (20%; the second, seventh...), deterministically."""
    _calls[0] += 1
    if _calls[0] % 5 == 2:
        raise ValueError("every fifth call fails")
    return [float(len(_text(c)) % 2) for c in completions]
