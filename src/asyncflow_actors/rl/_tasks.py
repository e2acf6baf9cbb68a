"""Tasks with verifiable rewards: the `Task` protocol, reversed-answer addition and a
long-tail length task for throughput experiments."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Literal, Protocol, runtime_checkable

import attrs
import torch
from torch import Tensor

from ._errors import TaskError

__all__ = [
    "AdditionTask",
    "LongTailTask",
    "Problem",
    "Task",
    "position_match_score",
    "score_responses",
]


@attrs.frozen
class Problem:
    """One prompt with its reference answer. `metadata` is task-specific (e.g. operands) and
    not part of equality or hashing, so problems can be compared and put in sets."""

    prompt: str
    answer: str
    metadata: dict[str, object] = attrs.field(factory=dict, eq=False)


@runtime_checkable
class Task(Protocol):
    """A source of prompts with a verifier.

    `sample(n, seed)` is deterministic in `seed`. `score(problem, response)` returns a reward
    in [0, 1] for the decoded response text (special tokens removed). `alphabet` lists every
    character that prompts and answers use, to build a `CharTokenizer`.
    """

    @property
    def name(self) -> str: ...

    @property
    def alphabet(self) -> str: ...

    def sample(self, n: int, seed: int) -> list[Problem]: ...

    def score(self, problem: Problem, response: str) -> float: ...


def position_match_score(answer: str, response: str, *, partial_credit: float) -> float:
    """1.0 for an exact match (surrounding whitespace ignored); for a response of the right
    length, `partial_credit * (matching positions / length)`; otherwise 0.0."""
    got = response.strip()
    if got == answer:
        return 1.0
    if len(got) != len(answer) or not answer:
        return 0.0
    matches = sum(a == b for a, b in zip(answer, got, strict=True))
    return partial_credit * matches / len(answer)


def score_responses(task: Task, problems: Sequence[Problem], responses: Sequence[str]) -> Tensor:
    """Rewards [B] float32 of `responses` to `problems`; raises `TaskError` when the counts
    differ or the task returns a reward outside [0, 1] (or NaN)."""
    if len(problems) != len(responses):
        raise TaskError(f"got {len(problems)} problems and {len(responses)} responses")
    rewards = [task.score(p, r) for p, r in zip(problems, responses, strict=True)]
    for i, value in enumerate(rewards):
        if not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
            raise TaskError(
                f"task {task.name!r} scored response {i} ({responses[i]!r}) as {value!r}; "
                "expected a float in [0, 1]"
            )
    return torch.tensor(rewards, dtype=torch.float32)


def _check_count(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise TaskError(f"n must be an int >= 0, got {n!r}")


def _partial(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0 <= value < 1:
        raise TaskError(f"{attribute.name} must lie in [0, 1), got {value!r}")


def _positive_int(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise TaskError(f"{attribute.name} must be a positive int, got {value!r}")


@attrs.frozen
class AdditionTask:
    """`a+b=` with the sum written reversed (least significant digit first), e.g.
    `"57+68="` -> `"521"`. Operands have `min_digits..max_digits` digits (no leading zeros).

    Reversed answers are learnable left to right: each digit depends on the operand digits and
    one carry. Reward: 1 for exact; at the right length, `partial_credit * fraction of correct
    digits`; otherwise 0.
    """

    min_digits: int = attrs.field(default=1, validator=_positive_int)
    max_digits: int = attrs.field(default=3, validator=_positive_int)
    partial_credit: float = attrs.field(default=0.5, validator=_partial)

    def __attrs_post_init__(self) -> None:
        if self.max_digits < self.min_digits:
            raise TaskError(
                f"max_digits ({self.max_digits}) must be >= min_digits ({self.min_digits})"
            )

    @property
    def name(self) -> str:
        return f"addition-{self.min_digits}-{self.max_digits}"

    @property
    def alphabet(self) -> str:
        return "0123456789+="

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(self.min_digits, self.max_digits)
        low = 0 if digits == 1 else 10 ** (digits - 1)
        return rng.randint(low, 10**digits - 1)

    def sample(self, n: int, seed: int) -> list[Problem]:
        _check_count(n)
        rng = random.Random(seed)
        problems = []
        for _ in range(n):
            a, b = self._operand(rng), self._operand(rng)
            problems.append(
                Problem(prompt=f"{a}+{b}=", answer=str(a + b)[::-1], metadata={"a": a, "b": b})
            )
        return problems

    def score(self, problem: Problem, response: str) -> float:
        return position_match_score(problem.answer, response, partial_credit=self.partial_credit)


LengthDistribution = Literal["lognormal", "pareto"]


@attrs.frozen
class LongTailTask:
    """Reverse (`op="reverse"`) or sort (`op="sort"`) a string of `symbols` whose length has a
    heavy-tailed distribution, truncated to `[min_length, max_length]` by clipping (so the
    tail piles up at `max_length`, like generations that hit their token budget).

    `pareto`: `L = floor(min_length * U^(-1/shape))`; `lognormal`:
    `L = round(median * exp(sigma * Z))`. Prompt `"r:<s>="` or `"s:<s>="`; reward as in
    `AdditionTask` (exact 1, position-wise partial credit at the right length).
    """

    op: Literal["reverse", "sort"] = "reverse"
    distribution: LengthDistribution = "pareto"
    symbols: str = "abcdefghij"
    min_length: int = attrs.field(default=1, validator=_positive_int)
    max_length: int = attrs.field(default=64, validator=_positive_int)
    shape: float = 1.2
    median: float = 6.0
    sigma: float = 1.0
    partial_credit: float = attrs.field(default=0.5, validator=_partial)

    def __attrs_post_init__(self) -> None:
        if self.op not in ("reverse", "sort"):
            raise TaskError(f"op must be 'reverse' or 'sort', got {self.op!r}")
        if self.distribution not in ("lognormal", "pareto"):
            raise TaskError(
                f"distribution must be 'lognormal' or 'pareto', got {self.distribution!r}"
            )
        if not self.symbols or len(set(self.symbols)) != len(self.symbols):
            raise TaskError(f"symbols must be non-empty and distinct, got {self.symbols!r}")
        if set(self.symbols) & set(":="):
            raise TaskError(f"symbols must not contain ':' or '=', got {self.symbols!r}")
        if self.max_length < self.min_length:
            raise TaskError(
                f"max_length ({self.max_length}) must be >= min_length ({self.min_length})"
            )
        for name in ("shape", "median", "sigma"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise TaskError(f"{name} must be a finite number > 0, got {value!r}")

    @property
    def name(self) -> str:
        return f"longtail-{self.op}-{self.distribution}"

    @property
    def alphabet(self) -> str:
        return "".join(sorted(set(self.symbols) | set("rs:=")))

    def _length(self, rng: random.Random) -> int:
        if self.distribution == "pareto":
            u = 1.0 - rng.random()  # in (0, 1]
            raw = self.min_length * u ** (-1.0 / self.shape)
            length = int(raw) if raw < self.max_length else self.max_length
        else:
            length = round(self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0)))
        return min(max(length, self.min_length), self.max_length)

    def sample_lengths(self, n: int, seed: int) -> list[int]:
        """The string lengths `sample(n, seed)` uses (answers have the same lengths)."""
        _check_count(n)
        rng = random.Random(seed)
        return [self._length(rng) for _ in range(n)]

    def sample(self, n: int, seed: int) -> list[Problem]:
        # Lengths and symbols come from separate streams, so `sample_lengths` matches.
        rng = random.Random(f"{seed}:symbols")
        problems = []
        for length in self.sample_lengths(n, seed):
            text = "".join(rng.choice(self.symbols) for _ in range(length))
            answer = text[::-1] if self.op == "reverse" else "".join(sorted(text))
            problems.append(
                Problem(prompt=f"{self.op[0]}:{text}=", answer=answer, metadata={"length": length})
            )
        return problems

    def score(self, problem: Problem, response: str) -> float:
        return position_match_score(problem.answer, response, partial_credit=self.partial_credit)
