"""Sample completions: a few of a step's samples as text, so a user sees what the policy writes.

Every ``report.log_completions_every`` steps the Trainer decodes ``report.log_completions_n``
of the samples it trained (one per group first, in batch order) with its policy's tokenizer and
sends them with its ``StepDone``; the pipeline writes them to ``run_dir/completions.jsonl`` and
shows them (progress display, dashboard). A handful of strings per reported step: never the
batch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ._report_settings import ReportSettings


def _floats(value: Mapping[str, float]) -> dict[str, float]:
    return dict(value)


@attrs.frozen
class SampleCompletion:
    """One trained sample as text: the ``step`` that trained it, the policy ``version`` that
    generated it (its oldest token's), its ``group``, the ``prompt`` and ``completion`` as the
    tokenizer decodes them, its ``reward`` and each reward function's (``rewards``, by name;
    empty when the task scores; ``nan``: that function gave no score)."""

    step: int
    version: int
    group: int
    prompt: str
    completion: str
    reward: float
    rewards: Mapping[str, float] = attrs.field(factory=dict, converter=_floats)

    def to_json(self) -> dict[str, Any]:
        """A JSON object (``None`` for a ``nan`` reward: JSON has no nan)."""
        out = attrs.asdict(self)
        out["reward"] = _finite(self.reward)
        out["rewards"] = {k: _finite(v) for k, v in self.rewards.items()}
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> SampleCompletion:
        data = dict(raw)
        data["reward"] = _nan(data["reward"])
        data["rewards"] = {k: _nan(v) for k, v in data.get("rewards", {}).items()}
        return cls(**data)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _nan(value: float | None) -> float:
    return math.nan if value is None else float(value)


def completions_due(report: ReportSettings, step: int) -> bool:
    """Whether ``step`` reports sample completions."""
    every = report.log_completions_every
    return every > 0 and step % every == 0


def picked_rows(groups: Sequence[int], n: int) -> list[int]:
    """``n`` sample positions: the first of each group in order, then the others in order."""
    seen: set[int] = set()
    first: list[int] = []
    rest: list[int] = []
    for row, group in enumerate(groups):
        (rest if group in seen else first).append(row)
        seen.add(group)
    return (first + rest)[:n]


def pick_completions(
    report: ReportSettings,
    tokenizer: Any,
    batches: Sequence[Any],
    step: int,
    names: Sequence[str] = (),
) -> tuple[SampleCompletion, ...]:
    """``report.log_completions_n`` samples of a step's ``batches`` (TQ batches with the
    trainer's columns) decoded with ``tokenizer``; ``names``: the reward functions, in the
    order of the ``reward_parts`` column. Runs in a compute thread (it decodes)."""
    from . import _schema as S  # the queue's modules: not for a CLI that only reads messages

    rows = [(b, k) for b in batches for k in range(len(b))]
    groups = [b.group_ids[k] for b, k in rows]
    out = []
    for row in picked_rows(groups, report.log_completions_n):
        batch, k = rows[row]
        # stored once per group (a shared column): expanded per sample
        prompts = batch.expand(S.PROMPT_IDS) if S.PROMPT_IDS in batch.shared else None
        prompt = (prompts if prompts is not None else batch[S.PROMPT_IDS])[k]
        reward = float(batch[S.REWARDS][k])
        parts: dict[str, float] = {}
        if names:
            values = batch[S.REWARD_PARTS][k]
            parts = {name: float(values[f]) for f, name in enumerate(names)}
        out.append(
            SampleCompletion(
                step=step,
                version=int(batch.versions[k]),
                group=int(batch.group_ids[k]),
                prompt=tokenizer.decode(_ids(prompt)),
                completion=tokenizer.decode(_ids(batch[S.RESPONSE_IDS][k])),
                reward=reward,
                rewards=parts,
            )
        )
    return tuple(out)


def _ids(row: Any) -> list[int]:
    return [int(t) for t in (row.tolist() if hasattr(row, "tolist") else row)]
