"""Off-policy corrections for stale or mismatched rollouts: truncated importance sampling,
rejection masks and their diagnostics.

Everything here works on the log importance ratio `log w = logp_proximal - logp_behaviour`
per token: the behaviour policy produced the tokens (the rollout engine's logprobs), the
proximal policy is the one the PPO ratio is taken against (old_logprob recomputed by the
trainer-side forward). Weights never carry gradients.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import attrs
import torch
from torch import Tensor

from ._errors import RLInputError
from ._validate import check_float, check_mask

__all__ = [
    "IS_LEVELS",
    "REJECTION_LEVELS",
    "ISLevel",
    "OffPolicyCorrection",
    "RejectionLevel",
    "importance_log_ratio",
    "importance_metrics",
    "rejection_mask",
    "truncated_is_weights",
]

ISLevel = Literal["token", "sequence"]
RejectionLevel = Literal["token", "sequence", "geometric"]
IS_LEVELS: tuple[str, ...] = get_args(ISLevel)
REJECTION_LEVELS: tuple[str, ...] = get_args(RejectionLevel)

# Log-ratios are clamped to +-20 before exp(): weights stay finite (e^20 ~ 4.9e8).
_LOG_CLAMP = 20.0


def _check_level(value: str | None, allowed: tuple[str, ...], name: str) -> None:
    if value is not None and value not in allowed:
        raise RLInputError(f"{name} must be one of {allowed} or None, got {value!r}")


@attrs.frozen
class OffPolicyCorrection:
    """How the importance weight `w = pi_proximal / pi_behaviour` is applied.

    `is_level`: "token" (w_t) or "sequence" (prod_t w_t on every token of the sequence), or
    None for no weight (w = 1). `is_threshold`: truncation cap C (TIS, w <- min(w, C)); None
    leaves w untruncated (plain decoupled PPO). `rejection_level`: "token", "sequence" (product
    of ratios) or "geometric" (geometric mean of the sequence's ratios), or None; tokens or
    whole sequences whose ratio lies outside `[rejection_low, rejection_high]` are dropped from
    the loss mask. Requires `0 <= rejection_low <= 1 <= rejection_high`.
    """

    is_level: ISLevel | None = "token"
    is_threshold: float | None = 2.0
    rejection_level: RejectionLevel | None = None
    rejection_low: float = 0.5
    rejection_high: float = 2.0

    def __attrs_post_init__(self) -> None:
        _check_level(self.is_level, IS_LEVELS, "is_level")
        _check_level(self.rejection_level, REJECTION_LEVELS, "rejection_level")
        threshold = self.is_threshold
        if threshold is not None and (
            isinstance(threshold, bool) or not 1.0 <= threshold < math.inf
        ):
            raise RLInputError(
                f"is_threshold must be a finite number >= 1 (or None), got {threshold!r}"
            )
        if not 0 <= self.rejection_low <= 1 <= self.rejection_high:
            raise RLInputError(
                "rejection thresholds must satisfy 0 <= low <= 1 <= high (ratio 1, on-policy, "
                f"is always kept), got low={self.rejection_low!r}, high={self.rejection_high!r}"
            )


def importance_log_ratio(
    proximal_logprobs: Tensor, behaviour_logprobs: Tensor, response_mask: Tensor
) -> Tensor:
    """`(logp_proximal - logp_behaviour) * mask`, detached: [B, T]."""
    mask = check_mask("response_mask", response_mask)
    check_float("proximal_logprobs", proximal_logprobs, mask.shape)
    check_float("behaviour_logprobs", behaviour_logprobs, mask.shape)
    return (proximal_logprobs.detach() - behaviour_logprobs.detach()) * mask


def _sequence_log_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    return (log_ratio * mask).sum(dim=1)


def truncated_is_weights(
    log_ratio: Tensor,
    response_mask: Tensor,
    *,
    level: ISLevel = "token",
    threshold: float | None = 2.0,
) -> Tensor:
    """Importance weights [B, T] (0 at padding), truncated at `threshold`.

    token: `w_t = min(exp(log w_t), C)`; sequence: `w_b = min(exp(sum_t log w_t), C)` on every
    valid token of row b. `threshold=None` leaves them untruncated (log-ratios still clamped
    to +-20 so the weights stay finite).
    """
    _check_level(level, IS_LEVELS, "level")
    mask = check_mask("response_mask", response_mask)
    check_float("log_ratio", log_ratio, mask.shape)
    if threshold is not None and not threshold > 0:
        raise RLInputError(f"threshold must be > 0 or None, got {threshold!r}")
    upper = _LOG_CLAMP if threshold is None else min(math.log(threshold), _LOG_CLAMP)
    lr = log_ratio.detach()
    if level == "sequence":
        lr = _sequence_log_ratio(lr, mask)[:, None].expand_as(mask)
    return torch.exp(lr.clamp(-_LOG_CLAMP, upper)) * mask


def rejection_mask(
    log_ratio: Tensor,
    response_mask: Tensor,
    *,
    level: RejectionLevel,
    low: float,
    high: float,
) -> Tensor:
    """Bool [B, T]: the valid tokens that survive rejection.

    token: keep token t when `low <= w_t <= high`. sequence: keep row b when
    `low <= prod_t w_t <= high`. geometric: keep row b when `low <= exp(mean_t log w_t) <= high`
    (length-independent, so long sequences are not rejected just for being long). Comparisons
    are made in log space; `low = 0` never rejects on the low side.
    """
    _check_level(level, REJECTION_LEVELS, "level")
    mask = check_mask("response_mask", response_mask)
    check_float("log_ratio", log_ratio, mask.shape)
    if not 0 <= low <= 1 <= high:
        raise RLInputError(f"need 0 <= low <= 1 <= high, got low={low!r}, high={high!r}")
    log_low = math.log(low) if low > 0 else -math.inf
    log_high = math.log(high)
    lr = log_ratio.detach()
    if level == "token":
        stat = lr
    else:
        stat = _sequence_log_ratio(lr, mask)
        if level == "geometric":
            stat = stat / mask.sum(dim=1).clamp_min(1.0)
        stat = stat[:, None].expand_as(mask)
    return (mask > 0) & (stat >= log_low) & (stat <= log_high)


def importance_metrics(
    log_ratio: Tensor, response_mask: Tensor, *, level: ISLevel = "token"
) -> dict[str, float]:
    """Diagnostics of the raw (untruncated) weights `w = pi_proximal / pi_behaviour`.

    - `is_weight_mean`: mean of w over valid tokens (token level) or non-empty sequences
      (sequence level, w = prod_t w_t).
    - `ess`: normalised effective sample size `(sum w)^2 / (N sum w^2)` in (0, 1] over the same
      N units; 1 means on-policy, small means a few samples dominate.
    - `mismatch_kl_k1`, `mismatch_kl_k3`: KL(behaviour || proximal) per token, estimated on the
      behaviour's samples with k1 = `-log w` and k3 = `w - 1 - log w` (token means).
    """
    _check_level(level, IS_LEVELS, "level")
    mask = check_mask("response_mask", response_mask)
    check_float("log_ratio", log_ratio, mask.shape)
    lr = log_ratio.detach().double().clamp(-_LOG_CLAMP, _LOG_CLAMP)
    valid = mask > 0
    if level == "token":
        units = lr[valid]
    else:
        units = _sequence_log_ratio(lr, mask.double())[valid.any(dim=1)].clamp(
            -_LOG_CLAMP, _LOG_CLAMP
        )
    n_tokens = mask.sum().clamp_min(1.0).double()
    token_lr = lr * mask
    metrics = {
        "mismatch_kl_k1": float((-token_lr).sum() / n_tokens),
        "mismatch_kl_k3": float(((torch.expm1(lr) - lr) * mask).sum() / n_tokens),
    }
    if units.numel() == 0:
        metrics.update(is_weight_mean=1.0, ess=1.0)
        return metrics
    log_n = math.log(units.numel())
    metrics["is_weight_mean"] = float(torch.exp(torch.logsumexp(units, 0) - log_n))
    metrics["ess"] = float(
        torch.exp(2 * torch.logsumexp(units, 0) - torch.logsumexp(2 * units, 0) - log_n)
    )
    return metrics
