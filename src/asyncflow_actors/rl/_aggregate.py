"""Masked reductions and the loss aggregation modes."""

from __future__ import annotations

from typing import Literal, get_args

from torch import Tensor

from ._errors import RLInputError
from ._validate import check_float, check_mask

__all__ = ["AGG_MODES", "AggMode", "aggregate", "masked_mean", "masked_sum", "masked_whiten"]

AggMode = Literal[
    "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]
#: The valid `AggMode` strings.
AGG_MODES: tuple[str, ...] = get_args(AggMode)


def check_agg_mode(mode: str) -> None:
    if mode not in AGG_MODES:
        raise RLInputError(f"unknown aggregation mode {mode!r}; expected one of {AGG_MODES}")


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `values * mask` (over `dim`, or everything)."""
    m = check_mask("mask", mask, values.dim())
    return (values * m).sum() if dim is None else (values * m).sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `values` where `mask` is set; 0 where the mask is empty (never NaN)."""
    m = check_mask("mask", mask, values.dim())
    if dim is None:
        return (values * m).sum() / m.sum().clamp_min(1.0)
    return (values * m).sum(dim=dim) / m.sum(dim=dim).clamp_min(1.0)


def masked_whiten(values: Tensor, mask: Tensor, *, eps: float = 1e-8) -> Tensor:
    """`(x - mean) / (std + eps)` over the masked entries (Bessel-corrected std), 0 elsewhere.

    When the masked entries are all equal (or fewer than two), the result is exactly 0 there.
    """
    m = check_mask("mask", mask, values.dim())
    count = m.sum()
    mean = (values * m).sum() / count.clamp_min(1.0)
    var = (((values - mean) * m) ** 2).sum() / (count - 1).clamp_min(1.0)
    selected = values[m > 0]
    constant = selected.numel() < 2 or bool(selected.max() == selected.min())
    if constant:
        return values.new_zeros(values.shape)
    return (values - mean) / (var.sqrt() + eps) * m


def aggregate(
    values: Tensor, mask: Tensor, mode: AggMode, *, norm_length: int | None = None
) -> Tensor:
    """Reduce per-token `values` [B, T] under `mask` [B, T] to a scalar, by `mode`.

    - `token-mean`: sum over all valid tokens / number of valid tokens.
    - `seq-mean-token-sum`: mean over non-empty sequences of each sequence's token sum.
    - `seq-mean-token-mean`: mean over non-empty sequences of each sequence's token mean.
    - `seq-mean-token-sum-norm` (Dr. GRPO): sum over all valid tokens / (B * norm_length);
      a constant normaliser (`norm_length` defaults to T, the padded width).

    An empty mask gives 0, never NaN.
    """
    check_agg_mode(mode)
    if values.dim() != 2:
        raise RLInputError(f"values must be [B, T], got shape {tuple(values.shape)}")
    m = check_mask("mask", mask)
    check_float("mask", m, values.shape)
    if mode == "token-mean":
        return (values * m).sum() / m.sum().clamp_min(1.0)
    if mode == "seq-mean-token-sum-norm":
        length = values.shape[1] if norm_length is None else norm_length
        if isinstance(length, bool) or not isinstance(length, int) or length <= 0:
            raise RLInputError(f"norm_length must be a positive int, got {norm_length!r}")
        return (values * m).sum() / (values.shape[0] * length)
    token_count = m.sum(dim=1)
    seq_sum = (values * m).sum(dim=1)
    per_seq = seq_sum if mode == "seq-mean-token-sum" else seq_sum / token_count.clamp_min(1.0)
    nonempty = (token_count > 0).to(values.dtype)
    return (per_seq * nonempty).sum() / nonempty.sum().clamp_min(1.0)
