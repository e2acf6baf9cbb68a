from __future__ import annotations

import pytest
import torch

from asyncflow_actors.rl import AGG_MODES, RLInputError, aggregate, masked_mean, masked_whiten

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 10 / 4),  # (1+2+3+4) / 4 tokens
        ("seq-mean-token-sum", (6 + 4) / 2),  # the empty row does not count
        ("seq-mean-token-mean", (2 + 4) / 2),
        ("seq-mean-token-sum-norm", 10 / (3 * 3)),  # B * T, a constant
    ],
)
def test_aggregation_modes_hand_computed(mode: str, expected: float) -> None:
    got = aggregate(VALUES, MASK, mode)  # type: ignore[arg-type]
    assert float(got) == pytest.approx(expected)
    assert float(aggregate(VALUES, MASK.bool(), mode)) == pytest.approx(expected)  # type: ignore[arg-type]


def test_norm_length_is_a_constant_normaliser() -> None:
    got = aggregate(VALUES, MASK, "seq-mean-token-sum-norm", norm_length=10)
    assert float(got) == pytest.approx(10 / (3 * 10))
    with pytest.raises(RLInputError, match="norm_length"):
        aggregate(VALUES, MASK, "seq-mean-token-sum-norm", norm_length=0)


def test_long_sequences_weigh_differently_per_mode() -> None:
    # One long sequence of loss 1 per token and one short one of loss 3 per token.
    values = torch.tensor([[1.0] * 6, [3.0] + [0.0] * 5])
    mask = torch.tensor([[1.0] * 6, [1.0] + [0.0] * 5])
    assert float(aggregate(values, mask, "token-mean")) == pytest.approx(9 / 7)
    assert float(aggregate(values, mask, "seq-mean-token-mean")) == pytest.approx(2.0)
    assert float(aggregate(values, mask, "seq-mean-token-sum")) == pytest.approx(4.5)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_empty_mask_gives_zero_not_nan(mode: str) -> None:
    out = aggregate(VALUES, torch.zeros_like(MASK), mode)  # type: ignore[arg-type]
    assert float(out) == 0.0


def test_aggregate_rejects_bad_inputs() -> None:
    with pytest.raises(RLInputError, match="unknown aggregation mode 'mean'"):
        aggregate(VALUES, MASK, "mean")  # type: ignore[arg-type]
    with pytest.raises(RLInputError, match="shape"):
        aggregate(VALUES, MASK[:, :2], "token-mean")
    with pytest.raises(RLInputError, match="bool or floating"):
        aggregate(VALUES, MASK.long(), "token-mean")


def test_masked_mean_and_whiten() -> None:
    assert float(masked_mean(VALUES, MASK)) == pytest.approx(2.5)
    torch.testing.assert_close(masked_mean(VALUES, MASK, dim=1), torch.tensor([2.0, 4.0, 0.0]))
    white = masked_whiten(VALUES, MASK)
    valid = white[MASK > 0]
    assert float(valid.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(valid.std()) == pytest.approx(1.0, abs=1e-6)
    assert torch.all(white[MASK == 0] == 0)
    constant = masked_whiten(torch.full((2, 2), 0.1), torch.ones(2, 2))
    assert torch.equal(constant, torch.zeros(2, 2))
