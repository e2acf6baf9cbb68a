"""Reward functions' values: checked, weighted into one reward per sample, pass@k.

The contract is TRL's: a reward function returns one value per completion, a number (any
real: negative and unbounded rewards are allowed) or ``None`` (no score for this sample, e.g. a
reward that applies to some prompts only). Pure functions: calling the user's functions is the
business of ``asyncflow_actors.tasks``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ._errors import TaskError

__all__ = ["RewardValueError", "check_reward_values", "pass_at_k", "weighted_rewards"]


class RewardValueError(TaskError):
    """A reward function returned something other than one number or ``None`` per sample."""


def check_reward_values(name: str, values: object, n: int) -> list[float | None]:
    """``values`` as ``n`` floats or ``None``; raises ``RewardValueError`` naming the function
    for a wrong count, a non-number or a NaN/infinite value."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise RewardValueError(
            f"reward {name!r} returned {type(values).__name__}; expected a list of {n} floats"
        )
    if len(values) != n:
        raise RewardValueError(f"reward {name!r} returned {len(values)} values for {n} samples")
    out: list[float | None] = []
    for i, value in enumerate(values):
        if value is None:
            out.append(None)
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            try:
                value = float(value)  # numpy and torch scalars
            except (TypeError, ValueError):
                raise RewardValueError(
                    f"reward {name!r} returned {value!r} for sample {i}; expected a float or None"
                ) from None
        if not math.isfinite(value):
            raise RewardValueError(f"reward {name!r} returned {value!r} for sample {i}")
        out.append(float(value))
    return out


def weighted_rewards(
    parts: Sequence[Sequence[float | None]], weights: Sequence[float]
) -> list[float]:
    """Per sample, ``sum(w_f * r_f)`` over the functions that scored it (TRL's ``nansum``): a
    function's ``None`` adds nothing; a sample no function scored gets 0.0.

    ``parts[f][i]``: function ``f``'s value for sample ``i``."""
    if len(parts) != len(weights):
        raise RewardValueError(f"{len(parts)} reward functions but {len(weights)} weights")
    if not parts:
        return []
    n = len(parts[0])
    totals = [0.0] * n
    for values, weight in zip(parts, weights, strict=True):
        if len(values) != n:
            raise RewardValueError(f"reward parts of {len(values)} and {n} samples")
        for i, value in enumerate(values):
            if value is not None:
                totals[i] += weight * value
    return totals


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The unbiased pass@k estimate from ``n`` samples of which ``correct`` passed:
    ``1 - C(n - c, k) / C(n, k)`` (Chen et al., 2021). Needs ``0 <= correct <= n`` and
    ``1 <= k <= n``."""
    if not (1 <= k <= n and 0 <= correct <= n):
        raise RewardValueError(
            f"pass@k needs 1 <= k <= n and 0 <= c <= n; got {n=} {correct=} {k=}"
        )
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)
