"""Per-token KL estimators k1, k2, k3 (Schulman, "Approximating KL Divergence")."""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

from ._errors import RLInputError

__all__ = ["KL_ESTIMATORS", "KLEstimator", "kl_estimate"]

KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)

# exp() of a log-ratio beyond this overflows float32 soon after; tokens that far apart are
# clamped (the k3 penalty is then linear in the log-ratio there).
_LOG_RATIO_CLAMP = 20.0


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, kind: KLEstimator = "k3") -> Tensor:
    """Per-token estimate of KL(pi || ref) for tokens sampled from pi (elementwise).

    With `log r = ref_logprobs - logprobs`: k1 = `-log r` (unbiased, can be negative),
    k2 = `(log r)^2 / 2` (biased, low variance), k3 = `exp(log r) - 1 - log r` (unbiased,
    non-negative, low variance; `log r` clamped to [-20, 20] first). Gradients flow into
    both arguments as given; detach `ref_logprobs` yourself if it must stay fixed.
    """
    if kind not in KL_ESTIMATORS:
        raise RLInputError(f"unknown KL estimator {kind!r}; expected one of {KL_ESTIMATORS}")
    if logprobs.shape != ref_logprobs.shape:
        raise RLInputError(
            f"ref_logprobs shape {tuple(ref_logprobs.shape)} != logprobs shape "
            f"{tuple(logprobs.shape)}"
        )
    log_ratio = ref_logprobs - logprobs
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    log_ratio = log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return torch.expm1(log_ratio) - log_ratio
