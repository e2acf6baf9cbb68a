from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflow_actors.rl import RLInputError, kl_estimate


def test_k1_k2_k3_hand_computed() -> None:
    logp = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])
    log_r = math.log(0.5)  # ref - logp
    assert float(kl_estimate(logp, ref, "k1")) == pytest.approx(-log_r)
    assert float(kl_estimate(logp, ref, "k2")) == pytest.approx(0.5 * log_r**2)
    assert float(kl_estimate(logp, ref, "k3")) == pytest.approx(0.5 - 1 - log_r)


def test_k1_and_k3_are_unbiased_estimates_of_kl() -> None:
    # KL(q || p) for categorical q, p, estimated from samples of q.
    q = torch.tensor([0.6, 0.3, 0.1])
    p = torch.tensor([0.2, 0.5, 0.3])
    exact = float((q * (q / p).log()).sum())
    samples = torch.multinomial(
        q, 200_000, replacement=True, generator=torch.Generator().manual_seed(0)
    )
    logq, logp = q.log()[samples], p.log()[samples]
    for kind in ("k1", "k3"):
        est = float(kl_estimate(logq, logp, kind).mean())
        assert est == pytest.approx(exact, abs=0.01), kind
    k2 = float(kl_estimate(logq, logp, "k2").mean())
    assert abs(k2 - exact) > 0.02  # k2 is biased for distributions this far apart


@settings(max_examples=100, deadline=None)
@given(st.floats(-30, 0, width=32), st.floats(-30, 0, width=32))
def test_k2_k3_are_non_negative_and_zero_on_policy(a: float, b: float) -> None:
    logp, ref = torch.tensor([a]), torch.tensor([b])
    for kind in ("k2", "k3"):
        assert float(kl_estimate(logp, ref, kind)) >= 0
        assert float(kl_estimate(logp, logp, kind)) == 0
    assert torch.isfinite(kl_estimate(logp, ref, "k3")).all()


def test_kl_rejects_bad_arguments() -> None:
    with pytest.raises(RLInputError, match="unknown KL estimator 'k4'"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "k4")  # type: ignore[arg-type]
    with pytest.raises(RLInputError, match="shape"):
        kl_estimate(torch.zeros(2), torch.zeros(3))
