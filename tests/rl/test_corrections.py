from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflow_actors.rl import (
    OffPolicyCorrection,
    RLInputError,
    importance_log_ratio,
    importance_metrics,
    rejection_mask,
    truncated_is_weights,
)

LN = math.log
# Row 0: token ratios 2.5, 0.5, 1.0; row 1: 1.2, 1.5, (padding).
LOG_RATIO = torch.tensor([[LN(2.5), LN(0.5), 0.0], [LN(1.2), LN(1.5), 7.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_log_ratio_is_proximal_minus_behaviour_masked() -> None:
    prox = torch.tensor([[-1.0, -2.0]])
    behaviour = torch.tensor([[-1.5, -1.0]])
    got = importance_log_ratio(prox, behaviour, torch.tensor([[1.0, 0.0]]))
    assert got.tolist() == [[0.5, 0.0]]


def test_token_and_sequence_tis_hand_computed() -> None:
    token = truncated_is_weights(LOG_RATIO, MASK, level="token", threshold=2.0)
    torch.testing.assert_close(token, torch.tensor([[2.0, 0.5, 1.0], [1.2, 1.5, 0.0]]))
    seq = truncated_is_weights(LOG_RATIO, MASK, level="sequence", threshold=2.0)
    # Row 0: 2.5 * 0.5 * 1 = 1.25; row 1: 1.2 * 1.5 = 1.8 (padding excluded).
    torch.testing.assert_close(seq, torch.tensor([[1.25] * 3, [1.8, 1.8, 0.0]]))
    capped = truncated_is_weights(LOG_RATIO, MASK, level="sequence", threshold=1.5)
    torch.testing.assert_close(capped, torch.tensor([[1.25] * 3, [1.5, 1.5, 0.0]]))
    raw = truncated_is_weights(LOG_RATIO, MASK, level="token", threshold=None)
    assert float(raw[0, 0]) == pytest.approx(2.5)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.floats(-50, 50, width=32), min_size=1, max_size=12),
    st.floats(1.0, 10.0),
    st.sampled_from(["token", "sequence"]),
)
def test_truncated_weights_never_exceed_threshold(
    values: list[float], threshold: float, level: str
) -> None:
    log_ratio = torch.tensor([values])
    mask = torch.ones_like(log_ratio)
    weights = truncated_is_weights(log_ratio, mask, level=level, threshold=threshold)  # type: ignore[arg-type]
    assert torch.all(weights <= threshold * (1 + 1e-6))
    assert torch.all(weights >= 0)
    assert torch.all(torch.isfinite(weights))


def test_rejection_masks_hand_computed() -> None:
    token = rejection_mask(LOG_RATIO, MASK, level="token", low=0.6, high=2.0)
    assert token.tolist() == [[False, False, True], [True, True, False]]
    seq = rejection_mask(LOG_RATIO, MASK, level="sequence", low=0.6, high=1.5)
    assert seq.tolist() == [[True, True, True], [False, False, False]]  # 1.25 in, 1.8 out
    # Geometric means: row 0 (1.25)^(1/3) = 1.077, row 1 (1.8)^(1/2) = 1.342.
    geo = rejection_mask(LOG_RATIO, MASK, level="geometric", low=0.9, high=1.2)
    assert geo.tolist() == [[True, True, True], [False, False, False]]
    geo_wide = rejection_mask(LOG_RATIO, MASK, level="geometric", low=0.9, high=1.4)
    assert geo_wide.tolist() == [[True, True, True], [True, True, False]]


def test_importance_metrics_hand_computed() -> None:
    metrics = importance_metrics(LOG_RATIO, MASK, level="token")
    w = torch.tensor([2.5, 0.5, 1.0, 1.2, 1.5])
    assert metrics["is_weight_mean"] == pytest.approx(float(w.mean()))
    assert metrics["ess"] == pytest.approx(float(w.sum() ** 2 / (5 * (w**2).sum())))
    lw = w.log()
    assert metrics["mismatch_kl_k1"] == pytest.approx(float(-lw.mean()))
    assert metrics["mismatch_kl_k3"] == pytest.approx(float((w - 1 - lw).mean()))
    seq = importance_metrics(LOG_RATIO, MASK, level="sequence")
    assert seq["is_weight_mean"] == pytest.approx((1.25 + 1.8) / 2)
    assert seq["ess"] == pytest.approx(3.05**2 / (2 * (1.25**2 + 1.8**2)))
    on_policy = importance_metrics(torch.zeros(2, 3), MASK)
    assert on_policy["ess"] == pytest.approx(1.0)
    assert on_policy["mismatch_kl_k3"] == 0.0


def test_correction_config_validation() -> None:
    with pytest.raises(RLInputError, match="is_threshold"):
        OffPolicyCorrection(is_threshold=0.5)
    with pytest.raises(RLInputError, match="low <= 1 <= high"):
        OffPolicyCorrection(rejection_level="token", rejection_low=1.2, rejection_high=2.0)
    with pytest.raises(RLInputError, match="rejection_level"):
        OffPolicyCorrection(rejection_level="tokens")  # type: ignore[arg-type]
    with pytest.raises(RLInputError, match="is_level"):
        OffPolicyCorrection(is_level="seq")  # type: ignore[arg-type]
