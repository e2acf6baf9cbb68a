"""Per-request seeded sampling for a batch whose rows belong to different requests.

Each request owns a ``torch.Generator`` and draws exactly one uniform number per generated
token, whatever else shares the batch; the token is picked by inverting the cumulative
distribution at that number. So a seeded sample is reproducible alone or in any batch, and a
partial rollout resumed from its prefix (the generator advanced by the prefix length) picks
the same tokens as an uninterrupted one on the same weights.

The engine draws each request's uniforms a chunk at a time (``Draws``: ``torch.rand(n)`` gives
the numbers ``n`` single draws would) and samples every row of a step in one vectorized call;
rows that share their parameters (the common case) skip the per-row parameter tensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ._types import SamplingConfig

__all__ = ["Draws", "new_generator", "sample_from", "sample_rows"]

_MASK64 = (1 << 63) - 1
_CHUNK = 32  # uniforms drawn at once per request (the same numbers as one at a time)


def new_generator(seed: int, sample_index: int, skip: int) -> torch.Generator:
    """The CPU generator of sample ``sample_index`` of a request seeded ``seed``, advanced by
    ``skip`` draws (the tokens of a resumed prefix)."""
    mixed = (seed * 0x9E3779B97F4A7C15 + sample_index * 0xBF58476D1CE4E5B9 + 1) & _MASK64
    generator = torch.Generator().manual_seed(mixed)
    if skip:
        torch.rand(skip, generator=generator)
    return generator


class Draws:
    """The uniform numbers of one request, in order: those of ``new_generator(seed,
    sample_index, skip)``, drawn ``_CHUNK`` at a time (one torch call per chunk, not per
    token)."""

    __slots__ = ("_buffer", "_generator", "_next")

    def __init__(self, seed: int, sample_index: int, skip: int) -> None:
        self._generator = new_generator(seed, sample_index, skip)
        self._buffer: list[float] = []
        self._next = 0

    def take(self) -> float:
        """The next number (a float32 value in [0, 1))."""
        if self._next == len(self._buffer):
            self._buffer = torch.rand(_CHUNK, generator=self._generator).tolist()
            self._next = 0
        value = self._buffer[self._next]
        self._next += 1
        return value


def sample_rows(
    logits: Tensor, params: Sequence[SamplingConfig], generators: Sequence[torch.Generator]
) -> tuple[list[int], list[float]]:
    """``sample_from`` with one number drawn from each row's generator."""
    uniform = [float(torch.rand((), generator=g)) for g in generators]
    return sample_from(logits, params, uniform)


def sample_from(
    logits: Tensor, params: Sequence[SamplingConfig], uniform: Sequence[float]
) -> tuple[list[int], list[float]]:
    """One token per row of ``logits`` [B, V] under each row's own parameters, at the row's
    uniform number ``uniform[i]`` (inverse CDF).

    Returns (tokens, logprobs); a logprob is that of the distribution sampled from:
    softmax(logits / T) restricted to the top-k tokens (ties at the k-th value kept) and then
    to the top-p nucleus, renormalised. Greedy rows report log_softmax(logits) of the argmax.
    """
    if not params:
        return [], []
    logits = logits.float()
    u = torch.tensor(uniform, dtype=torch.float32, device=logits.device)
    first = params[0]
    key = (first.temperature, first.top_k, first.top_p)
    if all((p.temperature, p.top_k, p.top_p) == key for p in params):
        return _sample_alike(logits, first, u)
    return _sample_mixed(logits, params, u)


def _sample_alike(
    logits: Tensor, params: SamplingConfig, u: Tensor
) -> tuple[list[int], list[float]]:
    """Every row under the same parameters: ``_sample_mixed`` with scalars (same numbers)."""
    raw_logp = F.log_softmax(logits, dim=-1)
    if params.temperature == 0:
        tokens = raw_logp.argmax(dim=-1)
        return tokens.tolist(), raw_logp.gather(1, tokens[:, None]).squeeze(1).tolist()
    logp = F.log_softmax(logits / params.temperature, dim=-1)
    vocab = logits.shape[1]
    if params.top_k > 0 or params.top_p < 1.0:
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        k = params.top_k if 0 < params.top_k < vocab else vocab
        drop_sorted = sorted_logp < sorted_logp[:, k - 1 : k]
        probs = F.softmax(sorted_logp.masked_fill(drop_sorted, -math.inf), dim=-1)
        drop_sorted |= (probs.cumsum(dim=-1) - probs) >= params.top_p
        drop = drop_sorted.scatter(1, order, drop_sorted)
        logp = F.log_softmax(logp.masked_fill(drop, -math.inf), dim=-1)
    cdf = logp.exp().cumsum(dim=-1)
    target = (u * cdf[:, -1])[:, None]
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_max(vocab - 1)
    return tokens.tolist(), logp.gather(1, tokens[:, None]).squeeze(1).tolist()


def _sample_mixed(
    logits: Tensor, params: Sequence[SamplingConfig], uniform: Tensor
) -> tuple[list[int], list[float]]:
    """Rows under different parameters (per-row tensors of them)."""
    rows = logits.shape[0]
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
    return tokens.tolist(), chosen.tolist()
