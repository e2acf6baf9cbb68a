"""Per-request seeded sampling for a batch whose rows belong to different requests.

Each request owns a ``torch.Generator`` and draws exactly one uniform number per generated
token, whatever else shares the batch; the token is picked by inverting the cumulative
distribution at that number. So a seeded sample is reproducible alone or in any batch, and a
partial rollout resumed from its prefix (the generator advanced by the prefix length) picks
the same tokens as an uninterrupted one on the same weights.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ._types import SamplingConfig

__all__ = ["new_generator", "sample_rows"]

_MASK64 = (1 << 63) - 1


def new_generator(seed: int, sample_index: int, skip: int) -> torch.Generator:
    """The CPU generator of sample ``sample_index`` of a request seeded ``seed``, advanced by
    ``skip`` draws (the tokens of a resumed prefix)."""
    mixed = (seed * 0x9E3779B97F4A7C15 + sample_index * 0xBF58476D1CE4E5B9 + 1) & _MASK64
    generator = torch.Generator().manual_seed(mixed)
    if skip:
        torch.rand(skip, generator=generator)
    return generator


def sample_rows(
    logits: Tensor, params: Sequence[SamplingConfig], generators: Sequence[torch.Generator]
) -> tuple[list[int], list[float]]:
    """One token per row of ``logits`` [B, V] under each row's own parameters and generator.

    Returns (tokens, logprobs); a logprob is that of the distribution sampled from:
    softmax(logits / T) restricted to the top-k tokens (ties at the k-th value kept) and then
    to the top-p nucleus, renormalised. Greedy rows report log_softmax(logits) of the argmax.
    """
    logits = logits.float()
    rows = logits.shape[0]
    uniform = torch.stack([torch.rand((), generator=g) for g in generators]).to(logits.device)
    temps = torch.tensor([p.temperature for p in params], device=logits.device)
    greedy = temps == 0
    raw_logp = F.log_softmax(logits, dim=-1)
    scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
    logp = F.log_softmax(scaled, dim=-1)
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        vocab = logits.shape[1]
        ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=logits.device)
        kth = sorted_logp.gather(1, (ks - 1)[:, None])
        drop_sorted = sorted_logp < kth
        kept = sorted_logp.masked_fill(drop_sorted, -math.inf)
        probs = F.softmax(kept, dim=-1)
        ps = torch.tensor(top_p, device=logits.device)[:, None]
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop_sorted |= (probs.cumsum(dim=-1) - probs) >= ps
        drop = drop_sorted.scatter(1, order, drop_sorted)
        logp = F.log_softmax(logp.masked_fill(drop, -math.inf), dim=-1)
    cdf = logp.exp().cumsum(dim=-1)
    target = (uniform * cdf[:, -1])[:, None]
    sampled = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_max(cdf.shape[1] - 1)
    argmax = raw_logp.argmax(dim=-1)
    tokens = torch.where(greedy, argmax, sampled)
    chosen = torch.where(
        greedy,
        raw_logp.gather(1, tokens[:, None]).squeeze(1),
        logp.gather(1, tokens[:, None]).squeeze(1),
    )
    assert tokens.shape[0] == rows
    return [int(t) for t in tokens.tolist()], [float(x) for x in chosen.tolist()]
