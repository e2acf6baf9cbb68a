from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflow_actors.rl import (
    RLInputError,
    dr_grpo_advantages,
    gae_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    terminal_rewards,
)

# Interleaved, non-consecutive group ids: group 10 = {0, 1, 3}, group 3 = {2, 4}, group 99 = {5}.
REWARDS = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.7])
GROUPS = torch.tensor([10, 10, 3, 10, 3, 99])
MASK = torch.tensor([[1, 1, 0]] * 6, dtype=torch.float32)


def _per_seq(adv: torch.Tensor) -> torch.Tensor:
    return adv[:, 0]


def test_grpo_hand_computed_with_unbiased_std_and_eps() -> None:
    eps = 1e-6
    out = grpo_advantages(REWARDS, GROUPS, MASK, eps=eps)
    s10 = math.sqrt(((1 / 3) ** 2 * 2 + (2 / 3) ** 2) / 2)  # Bessel: / (3 - 1)
    s3 = math.sqrt(2 * 0.25**2 / 1)
    expected = [
        (1 / 3) / (s10 + eps),
        (-2 / 3) / (s10 + eps),
        0.25 / (s3 + eps),
        (1 / 3) / (s10 + eps),
        -0.25 / (s3 + eps),
        0.0,
    ]
    torch.testing.assert_close(_per_seq(out.advantages), torch.tensor(expected))
    assert torch.all(out.advantages[:, 2] == 0)  # padding stays 0
    assert out.metrics["groups"] == 3
    assert out.metrics["singleton_group_frac"] == pytest.approx(1 / 3)


def test_grpo_population_std_variant() -> None:
    out = grpo_advantages(REWARDS, GROUPS, MASK, eps=0.0, unbiased_std=False)
    s10 = math.sqrt(((1 / 3) ** 2 * 2 + (2 / 3) ** 2) / 3)
    assert float(out.advantages[0, 0]) == pytest.approx((1 / 3) / s10)
    assert float(out.advantages[2, 0]) == pytest.approx(1.0)  # 0.25 / 0.25


def test_zero_variance_and_singleton_groups_get_exactly_zero() -> None:
    # 0.1 * 3 / 3 != 0.1 in floating point: without the explicit rule, rounding noise / eps
    # would give a spurious advantage.
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.3, 1.0, 0.0])
    groups = torch.tensor([5, 5, 5, 8, 9, 9])
    mask = torch.ones(6, 2)
    for fn in (grpo_advantages, dr_grpo_advantages, rloo_advantages):
        adv = fn(rewards, groups, mask).advantages
        assert torch.all(adv[:4] == 0), fn.__name__
        assert torch.all(torch.isfinite(adv))
        assert float(adv[4, 0]) > 0 > float(adv[5, 0])
    metrics = grpo_advantages(rewards, groups, mask).metrics
    assert metrics["constant_group_frac"] == pytest.approx(2 / 3)


def test_dr_grpo_and_rloo_hand_computed() -> None:
    dr = _per_seq(dr_grpo_advantages(REWARDS, GROUPS, MASK).advantages)
    torch.testing.assert_close(dr, torch.tensor([1 / 3, -2 / 3, 0.25, 1 / 3, -0.25, 0.0]))
    rloo = _per_seq(rloo_advantages(REWARDS, GROUPS, MASK).advantages)
    # Group 10: 1 - (0 + 1) / 2, 0 - (1 + 1) / 2; group 3: 0.5 - 0, 0 - 0.5; singleton: 0.
    torch.testing.assert_close(rloo, torch.tensor([0.5, -1.0, 0.5, 0.5, -0.5, 0.0]))


group_batches = st.lists(
    st.tuples(st.integers(-(2**40), 2**40), st.floats(0, 1, width=32)), min_size=1, max_size=24
)


@settings(max_examples=60, deadline=None)
@given(group_batches, st.floats(-5, 5, width=32))
def test_grpo_zero_mean_per_group_and_shift_invariant(
    items: list[tuple[int, float]], shift: float
) -> None:
    groups = torch.tensor([g % 5 * 1000 + 7 for g, _ in items])
    # float64: in float32, ``r + shift`` can round two distinct rewards to one value (0 and
    # 6e-8 + 1.0), which turns a varied group into a constant one: not a shift of the rewards
    rewards = torch.tensor([r for _, r in items], dtype=torch.float64)
    mask = torch.ones(len(items), 3)
    for fn in (grpo_advantages, dr_grpo_advantages, rloo_advantages):
        adv = _per_seq(fn(rewards, groups, mask).advantages)
        assert torch.all(torch.isfinite(adv))
        for g in groups.unique():
            members = adv[groups == g]
            assert abs(float(members.sum())) <= 1e-4 * max(1, len(members))
        shifted = _per_seq(fn(rewards + shift, groups, mask).advantages)
        torch.testing.assert_close(shifted, adv, atol=2e-3, rtol=1e-3)


def test_terminal_rewards_and_reinforce_pp_hand_computed() -> None:
    rewards = torch.tensor([1.0, 0.0])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    assert terminal_rewards(rewards, mask).tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
    out = reinforce_pp_advantages(rewards, mask)
    assert out.returns.tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
    std = math.sqrt((2 * 0.6**2 + 3 * 0.4**2) / 4)  # valid returns 1, 1, 0, 0, 0; mean 0.4
    expected = torch.tensor([[0.6 / std, 0.6 / std, 0.0], [-0.4 / std] * 3])
    torch.testing.assert_close(out.advantages, expected)
    discounted = reinforce_pp_advantages(rewards, mask, gamma=0.5)
    torch.testing.assert_close(discounted.returns, torch.tensor([[0.5, 1.0, 0.0], [0.0] * 3]))
    kl = torch.full((2, 3), -0.1)
    with_kl = reinforce_pp_advantages(rewards, mask, token_rewards=kl)
    torch.testing.assert_close(with_kl.returns, torch.tensor([[0.8, 0.9, 0.0], [-0.3, -0.2, -0.1]]))


def test_reinforce_pp_baseline_subtracts_group_mean() -> None:
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    groups = torch.tensor([4, 4, 6, 6])
    out = reinforce_pp_advantages(rewards, torch.ones(4, 1), group_ids=groups)
    assert out.returns[:, 0].tolist() == [0.5, -0.5, 0.0, 0.0]


def test_gae_hand_computed_with_interior_mask() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 5.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [0.5, 9.0, 0.7]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0]])
    out = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.5, whiten=False)
    # Row 0: deltas 0.04, 0.03, 0.3; A2 = 0.3, A1 = 0.03 + 0.45 * 0.3, A0 = 0.04 + 0.45 * A1.
    # Row 1: the masked middle token is skipped: delta0 = 0.9 * 0.7 - 0.5.
    expected = torch.tensor([[0.11425, 0.165, 0.3], [0.13 + 0.45 * 0.3, 0.0, 0.3]])
    torch.testing.assert_close(out.advantages, expected)
    torch.testing.assert_close(out.returns, (expected + values) * mask)
    # gamma = lam = 1: A_t = R - V_t (Monte Carlo).
    mc = gae_advantages(rewards[:1], values[:1], mask[:1], gamma=1.0, lam=1.0, whiten=False)
    torch.testing.assert_close(mc.advantages, torch.tensor([[0.5, 0.4, 0.3]]))
    white = gae_advantages(rewards, values, mask).advantages
    assert float(white[mask > 0].mean()) == pytest.approx(0.0, abs=1e-6)


def test_advantage_inputs_are_validated() -> None:
    with pytest.raises(RLInputError, match="one reward per sequence"):
        grpo_advantages(torch.ones(3), torch.zeros(3, dtype=torch.long), torch.ones(4, 2))
    with pytest.raises(RLInputError, match="group_ids must be an integer"):
        grpo_advantages(torch.ones(2), torch.zeros(2), torch.ones(2, 2))
    with pytest.raises(RLInputError, match="finite"):
        grpo_advantages(
            torch.tensor([1.0, math.nan]), torch.zeros(2, dtype=torch.long), torch.ones(2, 2)
        )
    with pytest.raises(RLInputError, match="gamma"):
        gae_advantages(torch.ones(1, 2), torch.ones(1, 2), torch.ones(1, 2), gamma=1.5)
