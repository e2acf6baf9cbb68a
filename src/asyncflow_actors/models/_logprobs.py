"""Log-probabilities (and entropies) of given token sequences under a `TinyDecoder`."""

from __future__ import annotations

import attrs
import torch.nn.functional as F
from torch import Tensor

from ._batch import PackedBatch
from ._model import ModelInputError, TinyDecoder

__all__ = ["TokenLogprobs", "entropy_from_logits", "token_logprobs"]


@attrs.frozen
class TokenLogprobs:
    """`logprobs[b, t] = log p(token t | tokens < t)`; `entropy` of the same distributions."""

    logprobs: Tensor
    entropy: Tensor | None = None


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy (nats) of the softmax over the last dimension: `-sum p log p`."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def token_logprobs(
    model: TinyDecoder,
    input_ids: Tensor | PackedBatch,
    attention_mask: Tensor | None = None,
    *,
    response_length: int | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> TokenLogprobs:
    """Per-token log-probabilities of `input_ids` [B, L] under `model` (differentiable).

    Given a `PackedBatch` instead (`token_logprobs(model, batch)`), its attention mask and
    response length are used: the result is [B, R], aligned with `batch.response_mask`. With `response_length=R` the result is [B, R] for the last R columns (the layout of
    `PackedBatch` and `generate`); without it, [B, L] with column 0 set to 0 (nothing predicts
    the first token). Logits are divided by `temperature` first, so passing the sampling
    temperature gives the logprobs of the sampling distribution (before any top-p truncation).
    """
    if isinstance(input_ids, PackedBatch):
        batch = input_ids
        if attention_mask is not None or response_length not in (None, batch.response_length):
            raise ModelInputError(
                "a PackedBatch carries its attention mask and response length "
                f"({batch.response_length}); do not pass them again"
            )
        input_ids, attention_mask = batch.input_ids, batch.attention_mask
        response_length = batch.response_length
    if not temperature > 0:
        raise ModelInputError(f"temperature must be > 0, got {temperature!r}")
    length = input_ids.shape[1] if input_ids.dim() == 2 else 0
    if response_length is not None and not 0 < response_length < length:
        raise ModelInputError(
            f"response_length must lie in [1, {length - 1}] for inputs of width {length}, "
            f"got {response_length}"
        )
    hidden = model.hidden_states(input_ids, attention_mask=attention_mask)
    if response_length is None:
        hidden, targets = hidden[:, :-1], input_ids[:, 1:]
    else:
        hidden, targets = hidden[:, -response_length - 1 : -1], input_ids[:, -response_length:]
    logits = model.lm_head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = F.log_softmax(logits, dim=-1)
    logprobs = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(dim=-1) if with_entropy else None
    if response_length is None:
        logprobs = F.pad(logprobs, (1, 0))
        entropy = F.pad(entropy, (1, 0)) if entropy is not None else None
    return TokenLogprobs(logprobs=logprobs, entropy=entropy)
