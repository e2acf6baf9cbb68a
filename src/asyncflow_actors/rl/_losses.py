"""PPO-family losses: clipped surrogate (clip-higher, dual clip), decoupled PPO with
off-policy corrections, KL and entropy terms, and the clipped value loss."""

from __future__ import annotations

import math
from typing import Literal, get_args

import attrs
import torch
from torch import Tensor

from ._aggregate import AggMode, aggregate, check_agg_mode, masked_mean
from ._corrections import (
    OffPolicyCorrection,
    importance_log_ratio,
    importance_metrics,
    rejection_mask,
    truncated_is_weights,
)
from ._errors import RLInputError
from ._kl import KL_ESTIMATORS, KLEstimator, kl_estimate
from ._validate import check_float, check_mask

__all__ = [
    "ANCHORS",
    "Anchor",
    "ClippedSurrogate",
    "PPOLossConfig",
    "PolicyLossOutput",
    "ValueLossOutput",
    "clipped_surrogate",
    "policy_loss",
    "value_loss",
]

_LOG_RATIO_CLAMP = 20.0

Anchor = Literal["proximal", "behaviour"]
ANCHORS: tuple[str, ...] = get_args(Anchor)


def _non_negative(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise RLInputError(f"{attribute.name} must be a number >= 0, got {value!r}")


def _clip(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    _non_negative(instance, attribute, value)
    if attribute.name == "clip_low" and value >= 1:
        raise RLInputError(f"clip_low must be < 1 (the lower bound is 1 - clip_low), got {value!r}")


def _dual_clip(
    instance: object, attribute: attrs.Attribute[float | None], value: float | None
) -> None:
    if value is not None and (isinstance(value, bool) or not value > 1):
        raise RLInputError(f"dual_clip must be > 1 or None, got {value!r}")


@attrs.frozen
class PPOLossConfig:
    """Settings of `policy_loss`.

    `clip_low`/`clip_high`: the ratio is clipped to `[1 - clip_low, 1 + clip_high]` (DAPO's
    clip-higher uses e.g. 0.2/0.28). `dual_clip`: c > 1 bounds the loss of negative-advantage
    tokens at `-c * A` (None: off). `agg`/`norm_length`: see `aggregate`. `kl_coef` and
    `kl_estimator`: KL penalty against the reference policy (added to the loss, needs
    `ref_logprobs`). `entropy_coef`: entropy bonus (subtracted, needs `entropy`).
    `correction`: how behaviour logprobs correct for stale rollouts (None: not applied, but the
    mismatch metrics are still reported when behaviour logprobs are given). `anchor`: the
    policy the PPO ratio and its clip are taken against: "proximal" (`old_logprobs`; with
    `correction` that is decoupled PPO) or "behaviour" (the rollout engine's logprobs, which
    sampled the tokens: PPO's own ratio, verl's "bypass mode"; the ratio is then the importance
    weight already, so `correction.is_level` must be None; rejection still applies).
    """

    clip_low: float = attrs.field(default=0.2, validator=_clip)
    clip_high: float = attrs.field(default=0.2, validator=_clip)
    dual_clip: float | None = attrs.field(default=None, validator=_dual_clip)
    agg: AggMode = "token-mean"
    norm_length: int | None = None
    kl_coef: float = attrs.field(default=0.0, validator=_non_negative)
    kl_estimator: KLEstimator = "k3"
    entropy_coef: float = attrs.field(default=0.0, validator=_non_negative)
    correction: OffPolicyCorrection | None = None
    anchor: Anchor = "proximal"

    def __attrs_post_init__(self) -> None:
        check_agg_mode(self.agg)
        if self.anchor not in ANCHORS:
            raise RLInputError(f"unknown anchor {self.anchor!r}; expected one of {ANCHORS}")
        if self.anchor == "behaviour" and self.correction and self.correction.is_level:
            raise RLInputError(
                "anchor='behaviour' takes the ratio against the behaviour policy, which is the "
                f"importance weight already; set correction.is_level=None, got "
                f"{self.correction.is_level!r}"
            )
        if self.kl_estimator not in KL_ESTIMATORS:
            raise RLInputError(
                f"unknown kl_estimator {self.kl_estimator!r}; expected one of {KL_ESTIMATORS}"
            )
        if self.norm_length is not None and (
            isinstance(self.norm_length, bool)
            or not isinstance(self.norm_length, int)
            or self.norm_length <= 0
        ):
            raise RLInputError(
                f"norm_length must be a positive int or None, got {self.norm_length!r}"
            )


@attrs.frozen
class ClippedSurrogate:
    """Per-token PPO loss and which branch was active (all [B, T])."""

    loss: Tensor
    ratio: Tensor
    clipped_high: Tensor
    clipped_low: Tensor
    dual_clipped: Tensor


@attrs.frozen
class PolicyLossOutput:
    """`loss`: scalar to minimise. `loss_mask`: the tokens that entered it (response mask
    after rejection). `metrics`: floats, named in docs/algorithms.md."""

    loss: Tensor
    loss_mask: Tensor
    metrics: dict[str, float]


@attrs.frozen
class ValueLossOutput:
    loss: Tensor
    metrics: dict[str, float]


def clipped_surrogate(
    log_ratio: Tensor,
    advantages: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> ClippedSurrogate:
    """Elementwise PPO loss with `ratio = exp(log_ratio)` (log-ratio clamped to +-20):

    `max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))`, and with dual clip c,
    for A < 0, `min(that, -c * A)`. Where the clipped branch is active its gradient is 0.
    """
    ratio = torch.exp(log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    use_clipped = clipped > unclipped
    loss = torch.where(use_clipped, clipped, unclipped)
    dual = torch.zeros_like(use_clipped)
    if dual_clip is not None:
        bound = -dual_clip * advantages
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
    return ClippedSurrogate(
        loss=loss,
        ratio=ratio,
        clipped_high=use_clipped & (advantages > 0),
        clipped_low=use_clipped & (advantages < 0),
        dual_clipped=dual,
    )


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    config: PPOLossConfig | None = None,
    *,
    behaviour_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
) -> PolicyLossOutput:
    """PPO / decoupled-PPO policy loss over [B, T] tensors.

    `logprobs`: current policy (carries the gradient). `old_logprobs`: the proximal policy the
    clipping ratio is taken against (`config.anchor = "behaviour"`: against
    `behaviour_logprobs` instead, which it then requires). `behaviour_logprobs`: the rollout
    engine's logprobs; with `config.correction` they give a per-token coefficient
    `w = pi_old / pi_behaviour` (truncated per `correction`) and optional rejection. Per token:
    `l_t = w_t * clipped_surrogate(logprobs - anchor, A)`; the loss is
    `aggregate(l) + kl_coef * aggregate(kl) - entropy_coef * aggregate(entropy)`, all over the
    surviving mask. Advantages, old, behaviour and reference logprobs are detached.
    """
    cfg = config if config is not None else PPOLossConfig()
    mask = check_mask("response_mask", response_mask)
    check_float("logprobs", logprobs, mask.shape)
    check_float("old_logprobs", old_logprobs, mask.shape)
    check_float("advantages", advantages, mask.shape)
    old = old_logprobs.detach()
    adv = advantages.detach()

    metrics: dict[str, float] = {}
    weights: Tensor | None = None
    keep = mask > 0
    if behaviour_logprobs is not None:
        lw = importance_log_ratio(old, behaviour_logprobs, mask)
        level = cfg.correction.is_level if cfg.correction and cfg.correction.is_level else "token"
        metrics.update(importance_metrics(lw, mask, level=level))
        corr = cfg.correction
        if corr is not None:
            if corr.rejection_level is not None:
                keep = rejection_mask(
                    lw,
                    mask,
                    level=corr.rejection_level,
                    low=corr.rejection_low,
                    high=corr.rejection_high,
                )
                kept = keep.float().sum()
                metrics["rejected_token_frac"] = float(1 - kept / mask.sum().clamp_min(1.0))
                seq_valid = mask.sum(dim=1) > 0
                seq_dropped = seq_valid & ~keep.any(dim=1)
                metrics["rejected_seq_frac"] = float(
                    seq_dropped.float().sum() / seq_valid.float().sum().clamp_min(1.0)
                )
            if corr.is_level is not None:
                weights = truncated_is_weights(
                    lw, mask, level=corr.is_level, threshold=corr.is_threshold
                )
                raw = truncated_is_weights(lw, mask, level=corr.is_level, threshold=None)
                metrics["is_weight_applied_mean"] = float(masked_mean(weights, keep))
                metrics["is_truncated_frac"] = float(masked_mean((raw > weights).float(), keep))
    elif cfg.correction is not None or cfg.anchor == "behaviour":
        what = "config.correction is set" if cfg.correction else "config.anchor is 'behaviour'"
        raise RLInputError(
            f"{what} but behaviour_logprobs is None; it needs the rollout engine's logprobs"
        )
    loss_mask = keep.to(mask.dtype) * mask

    if cfg.anchor == "behaviour":
        assert behaviour_logprobs is not None
        log_ratio = logprobs - behaviour_logprobs.detach()
    else:
        log_ratio = logprobs - old
    surrogate = clipped_surrogate(
        log_ratio, adv, clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip
    )
    token_loss = surrogate.loss if weights is None else surrogate.loss * weights
    pg_loss = aggregate(token_loss, loss_mask, cfg.agg, norm_length=cfg.norm_length)
    loss = pg_loss

    with torch.no_grad():
        lr = log_ratio.detach().clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        clipped = (surrogate.clipped_high | surrogate.clipped_low).float()
        metrics.update(
            pg_loss=float(pg_loss.detach()),
            clip_frac=float(masked_mean(clipped, loss_mask)),
            clip_frac_high=float(masked_mean(surrogate.clipped_high.float(), loss_mask)),
            clip_frac_low=float(masked_mean(surrogate.clipped_low.float(), loss_mask)),
            approx_kl=float(masked_mean(torch.expm1(lr) - lr, loss_mask)),
            ratio_mean=float(masked_mean(surrogate.ratio, loss_mask)),
            valid_tokens=float(loss_mask.sum()),
        )
        if cfg.dual_clip is not None:
            metrics["dual_clip_frac"] = float(
                masked_mean(surrogate.dual_clipped.float(), loss_mask)
            )

    if ref_logprobs is not None:
        check_float("ref_logprobs", ref_logprobs, mask.shape)
        kl = kl_estimate(logprobs, ref_logprobs.detach(), cfg.kl_estimator)
        kl_term = aggregate(kl, loss_mask, cfg.agg, norm_length=cfg.norm_length)
        metrics["kl_ref"] = float(masked_mean(kl.detach(), loss_mask))
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * kl_term
    elif cfg.kl_coef > 0:
        raise RLInputError(f"kl_coef={cfg.kl_coef} needs ref_logprobs, got None")
    if entropy is not None:
        check_float("entropy", entropy, mask.shape)
        ent_term = aggregate(entropy, loss_mask, cfg.agg, norm_length=cfg.norm_length)
        metrics["entropy"] = float(masked_mean(entropy.detach(), loss_mask))
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * ent_term
    elif cfg.entropy_coef > 0:
        raise RLInputError(f"entropy_coef={cfg.entropy_coef} needs entropy, got None")
    metrics["loss"] = float(loss.detach())
    return PolicyLossOutput(loss=loss, loss_mask=loss_mask, metrics=metrics)


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    *,
    clip: float | None = 0.2,
    agg: AggMode = "token-mean",
) -> ValueLossOutput:
    """Clipped value loss: `0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)`
    (`clip=None`: plain `0.5 * (V - R)^2`), aggregated by `agg`."""
    mask = check_mask("response_mask", response_mask)
    for name, tensor in (("values", values), ("old_values", old_values), ("returns", returns)):
        check_float(name, tensor, mask.shape)
    if clip is not None and not (clip > 0 and math.isfinite(clip)):
        raise RLInputError(f"clip must be a finite number > 0 or None, got {clip!r}")
    check_agg_mode(agg)
    target = returns.detach()
    err = (values - target).square()
    if clip is None:
        per_token = 0.5 * err
        clip_frac = values.new_zeros(())
    else:
        old = old_values.detach()
        clipped_values = old + (values - old).clamp(-clip, clip)
        err_clipped = (clipped_values - target).square()
        per_token = 0.5 * torch.maximum(err, err_clipped)
        clip_frac = masked_mean((err_clipped > err).float(), mask)
    loss = aggregate(per_token, mask, agg)
    return ValueLossOutput(
        loss=loss, metrics={"value_loss": float(loss.detach()), "value_clip_frac": float(clip_frac)}
    )
