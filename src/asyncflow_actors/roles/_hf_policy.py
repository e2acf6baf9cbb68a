"""A Hugging Face causal LM as the policy of a run (``model.hf``): loading, log-probs, saving.

With ``model.hf`` set to a local folder (``AutoModelForCausalLM`` + its tokenizer, offline) the
trainer and the forward stations hold that model, and rollout serves it with the ``hf`` or
``vllm`` engine (``rollout.engine``). Weight syncs carry the model's own (Hugging Face) tensor
names, which both engines load. Imports transformers (the ``hf`` extra).
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch

from ..models import PackedBatch, TokenLogprobs


class HFTokenizer:
    """A Hugging Face tokenizer with the ``CharTokenizer`` calls the roles use."""

    def __init__(self, tokenizer: Any) -> None:
        self.inner = tokenizer
        eos = tokenizer.eos_token_id
        self.eos_id = int(eos if eos is not None else 0)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.eos_id)
        self.vocab_size = len(tokenizer)

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = list(self.inner(text, add_special_tokens=add_bos)["input_ids"])
        return [*ids, self.eos_id] if add_eos else ids

    def decode(self, ids: list[int]) -> str:
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return str(self.inner.decode(ids, skip_special_tokens=True))


def load_hf_policy(folder: str, device: str) -> tuple[Any, HFTokenizer]:
    from transformers import AutoTokenizer

    from ..rollout import load_causal_lm

    model: Any = load_causal_lm(folder)
    model = model.to(device)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return model, HFTokenizer(tokenizer)


def hf_logprobs(
    model: Any, batch: PackedBatch, temperature: float, *, with_entropy: bool = False
) -> TokenLogprobs:
    """``[B, R]`` log-probs of the response tokens (left-padded prompts: explicit positions),
    and with ``with_entropy`` the entropy of each token's distribution (same shape)."""
    device = next(model.parameters()).device
    ids = batch.input_ids.to(device)
    mask = batch.attention_mask.to(device)
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    width = batch.response_length
    logits = model(
        input_ids=ids, attention_mask=mask.long(), position_ids=positions,
        **_forward_options(model, width),
    ).logits  # fmt: skip
    logits = logits[:, -width - 1 : -1].float() / temperature
    targets = ids[:, -width:]
    logp_all = torch.log_softmax(logits, dim=-1)
    out = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(dim=-1).cpu() if with_entropy else None
    return TokenLogprobs(logprobs=out.cpu(), entropy=entropy)


def _forward_options(model: Any, width: int) -> dict[str, Any]:
    """No KV cache (a model config's default builds one, unused by a full forward), and the
    logits of the positions that predict the response only (``logits_to_keep``, as TRL asks):
    each where the model's ``forward`` names the argument."""
    names = _forward_names(model)
    options: dict[str, Any] = {}
    if "use_cache" in names:
        options["use_cache"] = False
    if "logits_to_keep" in names:
        options["logits_to_keep"] = width + 1
    return options


_FORWARD_NAMES: dict[type, frozenset[str]] = {}  # per model class


def _forward_names(model: Any) -> frozenset[str]:
    names = _FORWARD_NAMES.get(type(model))
    if names is None:
        names = frozenset(inspect.signature(model.forward).parameters)
        _FORWARD_NAMES[type(model)] = names
    return names


def save_hf_policy(model: Any, tokenizer: HFTokenizer, directory: str) -> None:
    path = os.path.join(directory, "policy")
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.inner.save_pretrained(path)
