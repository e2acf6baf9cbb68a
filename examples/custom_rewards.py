"""The reward functions of ``custom_reward.toml``: plain functions with TRL's signature.

``fn(prompts, completions, **columns) -> list[float | None]``: one value per completion; every
column of the dataset arrives by name (here ``answer`` and ``digits``); conversational prompts
come as message lists and completions as ``[{"role": "assistant", "content": ...}]``.
"""

from __future__ import annotations

from typing import Any


def _text(completion: Any) -> str:
    return completion[0]["content"] if isinstance(completion, list) else str(completion)


def correct(
    prompts: list[Any], completions: list[Any], answer: list[str], **columns: Any
) -> list[float | None]:
    """1.0 for the exact answer; at the right length, half a point times the share of right
    digits; else 0."""
    out: list[float | None] = []
    for completion, want in zip(completions, answer, strict=True):
        got = _text(completion).strip()
        if got == want:
            out.append(1.0)
        elif len(got) == len(want):
            out.append(0.5 * sum(a == b for a, b in zip(got, want, strict=True)) / len(want))
        else:
            out.append(0.0)
    return out


async def brevity(completions: list[Any], digits: list[int], **columns: Any) -> list[float | None]:
    """A penalty (negative) for every character past the answer's length; ``None`` (no score)
    for one-digit problems, where it does not apply. An ``async def``: it runs on an asyncio
    loop of its own, as a reward that calls a judge over HTTP would."""
    return [
        None if n == 1 else -0.1 * max(0, len(_text(c).strip()) - (n + 1))
        for c, n in zip(completions, digits, strict=True)
    ]
