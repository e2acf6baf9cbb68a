from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflow_actors.rl import (
    AGG_MODES,
    OffPolicyCorrection,
    PPOLossConfig,
    RLInputError,
    aggregate,
    clipped_surrogate,
    kl_estimate,
    policy_loss,
    value_loss,
)

LN = math.log


def test_clipped_surrogate_hand_computed_with_clip_higher() -> None:
    ratio = torch.tensor([[1.5, 0.5, 1.1, 0.7]])
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]])
    out = clipped_surrogate(ratio.log(), adv, clip_low=0.2, clip_high=0.28)
    # max(-A r, -A clip(r, 0.8, 1.28)) token by token.
    torch.testing.assert_close(out.loss, torch.tensor([[-1.28, 0.8, 1.1, -0.7]]))
    assert out.clipped_high.tolist() == [[True, False, False, False]]
    assert out.clipped_low.tolist() == [[False, True, False, False]]


def test_dual_clip_bounds_negative_advantage_loss() -> None:
    ratio = torch.tensor([[5.0, 5.0, 2.0]])
    adv = torch.tensor([[-1.0, 1.0, -1.0]])
    out = clipped_surrogate(ratio.log(), adv, clip_low=0.2, clip_high=0.2, dual_clip=3.0)
    torch.testing.assert_close(out.loss, torch.tensor([[3.0, -1.2, 2.0]]))
    assert out.dual_clipped.tolist() == [[True, False, False]]


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.tuples(st.floats(-3, 3), st.floats(-5, 5)), min_size=1, max_size=10),
    st.floats(0.05, 0.5),
    st.floats(0.05, 0.5),
    st.floats(1.5, 5.0),
)
def test_clipping_bounds_hold(
    items: list[tuple[float, float]], clip_low: float, clip_high: float, dual: float
) -> None:
    log_ratio = torch.tensor([[lr for lr, _ in items]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[a for _, a in items]], dtype=torch.float64)
    out = clipped_surrogate(log_ratio, adv, clip_low=clip_low, clip_high=clip_high, dual_clip=dual)
    objective = -out.loss.detach()
    pos, neg = adv > 0, adv < 0
    assert torch.all(objective[pos] <= (adv * (1 + clip_high))[pos] + 1e-9)
    assert torch.all(objective[neg] <= (adv * (1 - clip_low))[neg] + 1e-9)
    assert torch.all(out.loss.detach()[neg] <= (-dual * adv)[neg] + 1e-9)
    out.loss.sum().backward()
    assert log_ratio.grad is not None
    inactive = out.clipped_high | out.clipped_low | out.dual_clipped
    assert torch.all(log_ratio.grad[inactive] == 0)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 5), st.sampled_from(AGG_MODES), st.data())
def test_ppo_equals_vanilla_policy_gradient_when_ratios_are_one(
    rows: int, cols: int, agg: str, data: st.DataObject
) -> None:
    n = rows * cols
    floats = st.lists(st.floats(-4, -0.01), min_size=n, max_size=n)
    logp = torch.tensor(data.draw(floats), dtype=torch.float64).reshape(rows, cols)
    adv_values = st.lists(st.floats(-3, 3), min_size=n, max_size=n)
    adv = torch.tensor(data.draw(adv_values), dtype=torch.float64).reshape(rows, cols)
    flags = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    mask = torch.tensor(flags, dtype=torch.float64).reshape(rows, cols)
    ppo_in = logp.clone().requires_grad_(True)
    out = policy_loss(ppo_in, logp, adv, mask, PPOLossConfig(agg=agg))  # type: ignore[arg-type]
    out.loss.backward()
    pg_in = logp.clone().requires_grad_(True)
    aggregate(-adv * pg_in, mask, agg).backward()  # type: ignore[arg-type]
    expected = float(aggregate(-adv, mask, agg))  # type: ignore[arg-type]
    assert float(out.loss.detach()) == pytest.approx(expected, abs=1e-9)
    assert ppo_in.grad is not None and pg_in.grad is not None
    torch.testing.assert_close(ppo_in.grad, pg_in.grad)
    assert out.metrics["clip_frac"] == 0.0


def test_gradients_match_finite_differences() -> None:
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(2, 4, generator=gen, dtype=torch.float64) - 0.5
    behaviour = old + 0.3 * torch.randn(2, 4, generator=gen, dtype=torch.float64)
    ref = old + 0.2 * torch.randn(2, 4, generator=gen, dtype=torch.float64)
    adv = torch.randn(2, 4, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    entropy_base = torch.rand(2, 4, generator=gen, dtype=torch.float64)
    cfg = PPOLossConfig(
        clip_low=0.2,
        clip_high=0.28,
        agg="seq-mean-token-mean",
        kl_coef=0.1,
        entropy_coef=0.01,
        correction=OffPolicyCorrection(is_level="token", is_threshold=2.0),
    )
    # Current logprobs near old (ratios well inside the clip range, away from kinks).
    start = old + 0.02 * torch.randn(2, 4, generator=gen, dtype=torch.float64)

    def fn(logp: torch.Tensor) -> torch.Tensor:
        return policy_loss(
            logp,
            old,
            adv,
            mask,
            cfg,
            behaviour_logprobs=behaviour,
            ref_logprobs=ref,
            entropy=entropy_base + logp,
        ).loss

    assert torch.autograd.gradcheck(fn, (start.requires_grad_(True),))


def test_decoupled_ppo_applies_truncated_behaviour_weights() -> None:
    old = torch.tensor([[LN(0.5), LN(0.5)]])
    behaviour = torch.tensor([[LN(0.2), LN(0.4)]])  # w = 2.5 -> truncated to 2, and 1.25
    logp = old.clone().requires_grad_(True)
    adv = torch.tensor([[1.0, -2.0]])
    mask = torch.ones(1, 2)
    cfg = PPOLossConfig(correction=OffPolicyCorrection(is_level="token", is_threshold=2.0))
    out = policy_loss(logp, old, adv, mask, cfg, behaviour_logprobs=behaviour)
    # Ratio current/proximal is 1, so l_t = -w_t * A_t: (-2 * 1 + 1.25 * 2) / 2.
    assert float(out.loss.detach()) == pytest.approx((-2.0 + 2.5) / 2)
    assert out.metrics["is_truncated_frac"] == pytest.approx(0.5)
    assert out.metrics["is_weight_applied_mean"] == pytest.approx((2.0 + 1.25) / 2)
    assert out.metrics["is_weight_mean"] == pytest.approx((2.5 + 1.25) / 2)
    assert out.metrics["mismatch_kl_k1"] == pytest.approx(-(LN(2.5) + LN(1.25)) / 2)
    out.loss.backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, 1.25]]))  # -w A / 2 tokens
    # Without a correction, behaviour logprobs only feed the metrics.
    plain = policy_loss(old, old, adv, mask, behaviour_logprobs=behaviour)
    assert float(plain.loss.detach()) == pytest.approx((-1.0 + 2.0) / 2)
    assert plain.metrics["ess"] < 1.0


def test_decoupled_ratio_clips_against_proximal_not_behaviour() -> None:
    old = torch.tensor([[LN(0.5)]])
    behaviour = torch.tensor([[LN(0.1)]])  # very stale: w = 5, untruncated
    logp = torch.tensor([[LN(0.8)]])  # ratio current/proximal = 1.6 -> clipped at 1.2
    cfg = PPOLossConfig(correction=OffPolicyCorrection(is_level="token", is_threshold=None))
    out = policy_loss(
        logp, old, torch.ones(1, 1), torch.ones(1, 1), cfg, behaviour_logprobs=behaviour
    )
    assert float(out.loss.detach()) == pytest.approx(-5.0 * 1.2)
    assert out.metrics["clip_frac"] == 1.0


def test_the_behaviour_anchor_clips_against_the_policy_that_sampled() -> None:
    """``anchor="behaviour"`` (verl's bypass mode): the ratio is current / behaviour, so a
    token the policy already made more likely than the sampler did (by more than the clip)
    gets no further push, where the proximal anchor (the trainer's own weights, ratio 1) pushes
    it again: at staleness 1 that clip never bound (issue 28)."""
    current = torch.tensor([[LN(0.8), LN(0.45)]])
    behaviour = torch.tensor([[LN(0.5), LN(0.5)]])  # ratios 1.6 (clipped at 1.2) and 0.9
    adv = torch.tensor([[1.0, -1.0]])
    mask = torch.ones(1, 2)
    logp = current.clone().requires_grad_(True)
    cfg = PPOLossConfig(anchor="behaviour")
    out = policy_loss(logp, current, adv, mask, cfg, behaviour_logprobs=behaviour)
    assert float(out.loss.detach()) == pytest.approx((-1.2 + 0.9) / 2)
    assert out.metrics["clip_frac"] == pytest.approx(0.5)
    assert out.metrics["ratio_mean"] == pytest.approx((1.6 + 0.9) / 2)
    # the mismatch metrics still compare the proximal (here: current) policy with the sampler
    assert out.metrics["mismatch_kl_k1"] == pytest.approx(-(LN(1.6) + LN(0.9)) / 2)
    out.loss.backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.45]]))  # -A r / 2 tokens
    # the proximal anchor on the same tokens: ratio 1, nothing clipped, both pushed
    logp = current.clone().requires_grad_(True)
    prox = policy_loss(logp, current, adv, mask, behaviour_logprobs=behaviour)
    assert prox.metrics["clip_frac"] == 0.0
    prox.loss.backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, 0.5]]))


def test_the_behaviour_anchor_refuses_importance_weights_and_needs_behaviour() -> None:
    with pytest.raises(RLInputError, match="importance weight already"):
        PPOLossConfig(anchor="behaviour", correction=OffPolicyCorrection(is_level="token"))
    with pytest.raises(RLInputError, match="unknown anchor"):
        PPOLossConfig(anchor="rollout")  # type: ignore[arg-type]
    x = torch.zeros(1, 2)
    with pytest.raises(RLInputError, match="anchor is 'behaviour' but behaviour_logprobs"):
        policy_loss(x, x, x, torch.ones(1, 2), PPOLossConfig(anchor="behaviour"))
    # rejection still applies: the tokens outside [low, high] of proximal / behaviour drop out
    cfg = PPOLossConfig(
        anchor="behaviour",
        correction=OffPolicyCorrection(is_level=None, rejection_level="token"),
    )
    old = torch.tensor([[LN(0.5), LN(0.5)]])
    behaviour = torch.tensor([[LN(0.1), LN(0.5)]])  # proximal / behaviour 5 (rejected) and 1
    out = policy_loss(old, old, torch.ones(1, 2), torch.ones(1, 2), cfg,
                      behaviour_logprobs=behaviour)  # fmt: skip
    torch.testing.assert_close(out.loss_mask, torch.tensor([[0.0, 1.0]]))


def test_rejection_drops_tokens_from_the_loss() -> None:
    old = torch.zeros(2, 2)
    behaviour = torch.tensor([[0.0, -LN(3.0)], [0.0, 0.0]])  # token (0, 1) has w = 3
    adv = torch.tensor([[1.0, 10.0], [2.0, 2.0]])
    cfg = PPOLossConfig(
        correction=OffPolicyCorrection(
            is_level=None, rejection_level="token", rejection_low=0.5, rejection_high=2.0
        )
    )
    out = policy_loss(old, old, adv, torch.ones(2, 2), cfg, behaviour_logprobs=behaviour)
    assert out.loss_mask.tolist() == [[1.0, 0.0], [1.0, 1.0]]
    assert float(out.loss.detach()) == pytest.approx(-(1 + 2 + 2) / 3)
    assert out.metrics["rejected_token_frac"] == pytest.approx(0.25)
    assert out.metrics["rejected_seq_frac"] == 0.0
    seq_cfg = PPOLossConfig(
        correction=OffPolicyCorrection(
            is_level=None, rejection_level="sequence", rejection_high=2.0
        )
    )
    seq = policy_loss(old, old, adv, torch.ones(2, 2), seq_cfg, behaviour_logprobs=behaviour)
    assert seq.loss_mask.tolist() == [[0.0, 0.0], [1.0, 1.0]]
    assert seq.metrics["rejected_seq_frac"] == 0.5


def test_kl_and_entropy_terms() -> None:
    logp = torch.tensor([[LN(0.5), LN(0.25)]], requires_grad=True)
    ref = torch.tensor([[LN(0.25), LN(0.25)]])
    entropy = torch.tensor([[1.0, 3.0]])
    adv = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    cfg = PPOLossConfig(kl_coef=0.5, kl_estimator="k3", entropy_coef=0.1)
    out = policy_loss(logp, logp.detach(), adv, mask, cfg, ref_logprobs=ref, entropy=entropy)
    k3 = float(kl_estimate(logp.detach(), ref, "k3").mean())
    assert float(out.loss.detach()) == pytest.approx(0.5 * k3 - 0.1 * 2.0)
    assert out.metrics["kl_ref"] == pytest.approx(k3)
    assert out.metrics["entropy"] == pytest.approx(2.0)


def test_policy_loss_config_and_input_errors() -> None:
    with pytest.raises(RLInputError, match="clip_low must be < 1"):
        PPOLossConfig(clip_low=1.0)
    with pytest.raises(RLInputError, match="dual_clip"):
        PPOLossConfig(dual_clip=0.9)
    with pytest.raises(RLInputError, match="unknown aggregation"):
        PPOLossConfig(agg="sum")  # type: ignore[arg-type]
    x = torch.zeros(1, 2)
    with pytest.raises(RLInputError, match="needs the rollout engine's logprobs"):
        policy_loss(x, x, x, torch.ones(1, 2), PPOLossConfig(correction=OffPolicyCorrection()))
    with pytest.raises(RLInputError, match="needs ref_logprobs"):
        policy_loss(x, x, x, torch.ones(1, 2), PPOLossConfig(kl_coef=0.1))
    with pytest.raises(RLInputError, match=r"advantages has shape \(1, 3\)"):
        policy_loss(x, x, torch.zeros(1, 3), torch.ones(1, 2))


def test_value_loss_hand_computed() -> None:
    values = torch.tensor([[1.0, 0.0]], requires_grad=True)
    old = torch.tensor([[0.5, 0.0]])
    returns = torch.tensor([[2.0, 1.0]])
    out = value_loss(values, old, returns, torch.ones(1, 2), clip=0.2)
    # Token 0: V clipped to 0.5 + 0.2 = 0.7, max((1 - 2)^2, (0.7 - 2)^2) / 2 = 0.845;
    # token 1: (0 - 1)^2 / 2 = 0.5.
    assert float(out.loss.detach()) == pytest.approx((0.845 + 0.5) / 2)
    assert out.metrics["value_clip_frac"] == pytest.approx(0.5)
    plain = value_loss(values, old, returns, torch.ones(1, 2), clip=None)
    assert float(plain.loss.detach()) == pytest.approx(0.5)
