"""Sampling from a `TinyDecoder`: one-step `sample_next` and batched `generate`."""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor

from ._batch import PackedBatch, left_pad
from ._kv_cache import KVCache
from ._model import TinyDecoder, decode_step

__all__ = ["GenerationOutput", "SamplingError", "SamplingParams", "generate", "sample_next"]


class SamplingError(ValueError):
    """Invalid sampling parameters or inputs."""


def _max_new_tokens(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SamplingError(f"max_new_tokens must be a positive int, got {value!r}")


def _temperature(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not isinstance(value, (int, float)) or not (value >= 0 and math.isfinite(value)):
        raise SamplingError(f"temperature must be a finite number >= 0, got {value!r}")


def _top_p(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise SamplingError(f"top_p must lie in (0, 1], got {value!r}")


@attrs.frozen
class SamplingParams:
    """How to pick tokens: `temperature=0` is greedy; `top_p<1` is nucleus sampling."""

    max_new_tokens: int = attrs.field(validator=_max_new_tokens)
    temperature: float = attrs.field(default=1.0, validator=_temperature)
    top_p: float = attrs.field(default=1.0, validator=_top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample_next(
    logits: Tensor, params: SamplingParams, *, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Pick one token per row of `logits` [B, V]; return (tokens [B] int64, logprobs [B]).

    The logprob is that of the distribution actually sampled from: softmax(logits / T),
    restricted to the top-p nucleus and renormalised. Greedy rows (T = 0) report the logprob
    of the argmax under softmax(logits) (temperature 1), since the degenerate greedy policy
    would always give 0.
    """
    logits = logits.float()
    if params.greedy:
        logp = F.log_softmax(logits, dim=-1)
        tokens = logp.argmax(dim=-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
    scaled = logits / params.temperature if params.temperature != 1.0 else logits
    logp = F.log_softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        sorted_p = sorted_logp.exp()
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass
        # before it already does. The first token is always kept.
        drop_sorted = (sorted_p.cumsum(dim=-1) - sorted_p) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logp = F.log_softmax(logp.masked_fill(drop, -math.inf), dim=-1)
    tokens = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


@attrs.frozen
class GenerationOutput:
    """Result of `generate`, in the `PackedBatch` layout.

    `prompt_ids`/`prompt_mask` [B, P]: prompts left-padded. `response_ids`/`response_mask`
    [B, R]: generated tokens (the `<eos>` included), then padding. `logprobs` [B, R]: logprob
    of each generated token under the sampling distribution (0 at padding). `finished` [B]:
    the row produced `<eos>` (otherwise it stopped at `max_new_tokens`).
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    response_ids: Tensor
    response_mask: Tensor
    logprobs: Tensor
    finished: Tensor

    @property
    def input_ids(self) -> Tensor:
        return torch.cat((self.prompt_ids, self.response_ids), dim=1)

    @property
    def attention_mask(self) -> Tensor:
        return torch.cat((self.prompt_mask, self.response_mask), dim=1)

    @property
    def response_lengths(self) -> Tensor:
        return self.response_mask.sum(dim=1)

    def to_batch(self) -> PackedBatch:
        return PackedBatch(
            input_ids=self.input_ids,
            attention_mask=self.attention_mask,
            response_mask=self.response_mask,
        )

    def responses(self) -> list[list[int]]:
        """Generated ids of each row without padding (the `<eos>` kept where produced)."""
        lengths = self.response_lengths.tolist()
        rows = self.response_ids.tolist()
        return [row[:n] for row, n in zip(rows, lengths, strict=True)]


@torch.no_grad()
def generate(
    model: TinyDecoder,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    pad_id: int,
    eos_id: int | None,
    generator: torch.Generator | None = None,
    use_kv_cache: bool = True,
) -> GenerationOutput:
    """Sample continuations of `prompts` (non-empty id lists) as one batch.

    Each row stops at `eos_id` (kept in the response) or after `params.max_new_tokens`; the
    loop ends early when every row has stopped. With `use_kv_cache=False` the whole sequence
    is recomputed each step (the slow baseline; same distribution). Deterministic for a given
    `generator` state. Raises `SamplingError` when prompt + response exceed `max_seq_len`.
    """
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = left_pad(prompts, pad_id=pad_id, device=device)
    batch, width = prompt_ids.shape
    longest = max(len(p) for p in prompts)
    if longest + params.max_new_tokens > model.config.max_seq_len:
        raise SamplingError(
            f"longest prompt ({longest} tokens) + max_new_tokens ({params.max_new_tokens}) "
            f"exceeds the model's max_seq_len ({model.config.max_seq_len})"
        )
    steps = params.max_new_tokens
    out_ids = torch.full((batch, steps), pad_id, dtype=torch.long, device=device)
    out_logp = torch.zeros((batch, steps), dtype=torch.float32, device=device)
    out_mask = torch.zeros((batch, steps), dtype=torch.bool, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)

    cache: KVCache | None = None
    if use_kv_cache:
        cache = KVCache.allocate(
            model.config, batch, width + steps, dtype=model.embed.weight.dtype, device=device
        )
        logits = model(prompt_ids, attention_mask=prompt_mask, kv_cache=cache)[:, -1]
    else:
        logits = model(prompt_ids, attention_mask=prompt_mask)[:, -1]
    done = 0
    for step in range(steps):
        tokens, logp = sample_next(logits, params, generator=generator)
        active = ~finished
        tokens = torch.where(active, tokens, pad_id)
        out_ids[:, step] = tokens
        out_logp[:, step] = torch.where(active, logp, 0.0)
        out_mask[:, step] = active
        if eos_id is not None:
            finished = finished | (active & (tokens == eos_id))
        done = step + 1
        if done == steps or bool(finished.all()):
            break
        if cache is not None:
            logits = decode_step(model, tokens, active, cache)
        else:
            ids = torch.cat((prompt_ids, out_ids[:, :done]), dim=1)
            mask = torch.cat((prompt_mask, out_mask[:, :done]), dim=1)
            logits = model(ids, attention_mask=mask)[:, -1]
    return GenerationOutput(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=out_ids[:, :done],
        response_mask=out_mask[:, :done],
        logprobs=out_logp[:, :done],
        finished=finished,
    )
