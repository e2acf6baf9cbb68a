"""Advantage estimators: GRPO, Dr. GRPO, RLOO, REINFORCE++ and GAE.

Groups are given by `group_ids` (int64 [B], arbitrary values, any order, unequal sizes), never
by assuming that group members sit next to each other. Outcome estimators take one scalar
reward per sequence and broadcast its advantage over the sequence's response tokens.
"""

from __future__ import annotations

import attrs
import torch
from torch import Tensor

from ._aggregate import masked_whiten
from ._errors import RLInputError
from ._validate import check_finite, check_float, check_group_ids, check_mask, check_positive

__all__ = [
    "AdvantageOutput",
    "dr_grpo_advantages",
    "gae_advantages",
    "grpo_advantages",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "terminal_rewards",
]


@attrs.frozen
class AdvantageOutput:
    """`advantages` and `returns` [B, T] (0 where `response_mask` is 0) and scalar metrics."""

    advantages: Tensor
    returns: Tensor
    metrics: dict[str, float] = attrs.field(factory=dict)


@attrs.frozen
class _Groups:
    inverse: Tensor  # [B] index of each sample's group in 0..G-1
    counts: Tensor  # [G]
    mean: Tensor  # [G]
    std: Tensor  # [G], Bessel-corrected (0 for singletons)
    pop_std: Tensor  # [G], population std
    constant: Tensor  # [G] bool: all rewards equal (singletons included)


def _group_stats(rewards: Tensor, group_ids: Tensor) -> _Groups:
    r = rewards.double()
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1
    zeros = r.new_zeros(n_groups)
    counts = zeros.scatter_add(0, inverse, torch.ones_like(r))
    mean = zeros.scatter_add(0, inverse, r) / counts
    sq = zeros.scatter_add(0, inverse, (r - mean[inverse]) ** 2)
    gmax = r.new_full((n_groups,), -torch.inf).scatter_reduce(0, inverse, r, "amax")
    gmin = r.new_full((n_groups,), torch.inf).scatter_reduce(0, inverse, r, "amin")
    return _Groups(
        inverse=inverse,
        counts=counts,
        mean=mean,
        std=(sq / (counts - 1).clamp_min(1.0)).sqrt(),
        pop_std=(sq / counts).sqrt(),
        constant=gmax == gmin,
    )


def _check_outcome(rewards: Tensor, response_mask: Tensor) -> Tensor:
    mask = check_mask("response_mask", response_mask)
    if rewards.dim() != 1 or rewards.shape[0] != mask.shape[0]:
        raise RLInputError(
            f"rewards has shape {tuple(rewards.shape)}, expected ({mask.shape[0]},) "
            "(one reward per sequence)"
        )
    check_float("rewards", rewards, (mask.shape[0],))
    check_finite("rewards", rewards)
    return mask


def _broadcast(per_seq: Tensor, mask: Tensor, dtype: torch.dtype) -> Tensor:
    return per_seq.to(dtype)[:, None] * mask.to(dtype)


def _group_metrics(rewards: Tensor, groups: _Groups) -> dict[str, float]:
    return {
        "groups": float(groups.counts.numel()),
        "constant_group_frac": float(groups.constant.double().mean()),
        "singleton_group_frac": float((groups.counts == 1).double().mean()),
        "reward_mean": float(rewards.double().mean()),
    }


def grpo_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    response_mask: Tensor,
    *,
    eps: float = 1e-6,
    normalize_std: bool = True,
    unbiased_std: bool = True,
) -> AdvantageOutput:
    """GRPO: `A_i = (r_i - mean_g) / (std_g + eps)` for sample i of group g.

    `std_g` is Bessel-corrected (`unbiased_std=True`, as `torch.std`) or the population std;
    `eps` is added to the std, outside the square root. A group whose rewards are all equal
    (zero variance, and every singleton group) gets advantage exactly 0, not NaN or
    rounding noise divided by `eps`: it carries no learning signal. `normalize_std=False`
    is Dr. GRPO (`A_i = r_i - mean_g`). Raises `RLInputError` on shape/dtype or non-finite
    rewards.
    """
    mask = _check_outcome(rewards, response_mask)
    ids = check_group_ids(group_ids, rewards.shape[0])
    check_positive("eps", eps, allow_zero=True)
    groups = _group_stats(rewards, ids)
    centred = rewards.double() - groups.mean[groups.inverse]
    if normalize_std:
        std = groups.std if unbiased_std else groups.pop_std
        centred = centred / (std[groups.inverse] + eps)
    per_seq = torch.where(groups.constant[groups.inverse], 0.0, centred)
    adv = _broadcast(per_seq, mask, rewards.dtype)
    return AdvantageOutput(advantages=adv, returns=adv, metrics=_group_metrics(rewards, groups))


def dr_grpo_advantages(
    rewards: Tensor, group_ids: Tensor, response_mask: Tensor
) -> AdvantageOutput:
    """Dr. GRPO: `A_i = r_i - mean_g` (no std division). Pair it with the
    `seq-mean-token-sum-norm` aggregation to drop the length normalisation as well.
    Zero-variance and singleton groups get exactly 0."""
    return grpo_advantages(rewards, group_ids, response_mask, normalize_std=False)


def rloo_advantages(rewards: Tensor, group_ids: Tensor, response_mask: Tensor) -> AdvantageOutput:
    """RLOO: `A_i = r_i - (sum_g - r_i) / (n_g - 1)`, the leave-one-out baseline
    (equivalently `n_g / (n_g - 1) * (r_i - mean_g)`). Singleton groups (no other sample to
    form a baseline) and zero-variance groups get exactly 0."""
    mask = _check_outcome(rewards, response_mask)
    ids = check_group_ids(group_ids, rewards.shape[0])
    groups = _group_stats(rewards, ids)
    r = rewards.double()
    n = groups.counts[groups.inverse]
    baseline = (groups.mean[groups.inverse] * n - r) / (n - 1).clamp_min(1.0)
    per_seq = torch.where(groups.constant[groups.inverse], 0.0, r - baseline)
    adv = _broadcast(per_seq, mask, rewards.dtype)
    return AdvantageOutput(advantages=adv, returns=adv, metrics=_group_metrics(rewards, groups))


def terminal_rewards(rewards: Tensor, response_mask: Tensor) -> Tensor:
    """Token rewards [B, T]: each sequence's reward on its last valid token, 0 elsewhere."""
    mask = _check_outcome(rewards, response_mask)
    present = mask > 0
    last = present & (present.long().cumsum(dim=1) == present.long().sum(dim=1, keepdim=True))
    return torch.where(last, rewards[:, None], 0.0).to(rewards.dtype)


def _discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """`G_t = r_t + gamma * G_next` over valid tokens; masked tokens are skipped (0)."""
    returns = torch.zeros_like(token_rewards)
    running = token_rewards.new_zeros(token_rewards.shape[0])
    for t in range(token_rewards.shape[1] - 1, -1, -1):
        valid = mask[:, t] > 0
        running = torch.where(valid, token_rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(valid, running, 0.0)
    return returns


def reinforce_pp_advantages(
    rewards: Tensor,
    response_mask: Tensor,
    *,
    group_ids: Tensor | None = None,
    token_rewards: Tensor | None = None,
    gamma: float = 1.0,
    eps: float = 1e-8,
) -> AdvantageOutput:
    """REINFORCE++: discounted returns normalised over the whole batch.

    Per-token reward: `token_rewards[b, t]` (e.g. `-beta * KL_t`; default 0) plus the outcome
    reward on the last valid token. With `group_ids` (REINFORCE++-baseline) the group mean of
    the outcome reward is subtracted first. Returns `G_t = sum_{k >= t} gamma^(k-t) r_k` over
    valid tokens; advantages are `(G - mean) / (std + eps)` over all valid tokens of the batch
    (Bessel-corrected std; exactly 0 when every valid return is equal).
    """
    mask = _check_outcome(rewards, response_mask)
    if not 0 <= gamma <= 1:
        raise RLInputError(f"gamma must lie in [0, 1], got {gamma!r}")
    outcome = rewards
    metrics: dict[str, float] = {"reward_mean": float(rewards.double().mean())}
    if group_ids is not None:
        groups = _group_stats(rewards, check_group_ids(group_ids, rewards.shape[0]))
        outcome = (rewards.double() - groups.mean[groups.inverse]).to(rewards.dtype)
        metrics = _group_metrics(rewards, groups)
    per_token = terminal_rewards(outcome, mask)
    if token_rewards is not None:
        check_float("token_rewards", token_rewards, mask.shape)
        per_token = per_token + token_rewards.detach() * mask
    returns = _discounted_returns(per_token, mask, gamma)
    adv = masked_whiten(returns, mask, eps=eps)
    return AdvantageOutput(advantages=adv, returns=returns, metrics=metrics)


def gae_advantages(
    token_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    whiten: bool = True,
    eps: float = 1e-8,
) -> AdvantageOutput:
    """Generalised advantage estimation for a value-based PPO setup.

    Over the valid tokens of each row (masked tokens are skipped, so interior masks are
    allowed): `delta_t = r_t + gamma * V_next - V_t` with `V_next = 0` after the last valid
    token, `A_t = delta_t + gamma * lam * A_next`. `returns = A + V` (the value target,
    before whitening); `whiten=True` normalises A over the batch's valid tokens.
    """
    mask = check_mask("response_mask", response_mask)
    check_float("token_rewards", token_rewards, mask.shape)
    check_float("values", values, mask.shape)
    for name, value in (("gamma", gamma), ("lam", lam)):
        if not 0 <= value <= 1:
            raise RLInputError(f"{name} must lie in [0, 1], got {value!r}")
    rewards = token_rewards.detach()
    vals = values.detach()
    adv = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(rewards.shape[0])
    running = rewards.new_zeros(rewards.shape[0])
    for t in range(rewards.shape[1] - 1, -1, -1):
        valid = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - vals[:, t]
        gae = delta + gamma * lam * running
        running = torch.where(valid, gae, running)
        next_value = torch.where(valid, vals[:, t], next_value)
        adv[:, t] = torch.where(valid, gae, 0.0)
    returns = (adv + vals) * mask
    if whiten:
        adv = masked_whiten(adv, mask, eps=eps)
    return AdvantageOutput(advantages=adv, returns=returns)
