"""A Hugging Face ``LlamaForCausalLM`` folder read into a ``TinyDecoder``, without transformers.

The two architectures coincide (pre-norm RMSNorm blocks, rotary embeddings in the rotate-half
layout with the same frequencies, SwiGLU, no biases), so a folder whose ``config.json`` stays
inside that common ground loads exactly: ``q``/``k``/``v`` concatenate into ``wqkv`` and
``gate``/``up`` into ``w_gate_up`` (grouped-query attention included). Every field outside it
(rope scaling, biases, another activation...) raises ``NativeConfigError`` naming the field, so a
folder is never served approximately. ``config.json`` is read as plain JSON and the weights
with this package's own safetensors reader: torch only, as vLLM and SGLang keep their own model
implementations for inference.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch import Tensor

from ._config import ModelConfigError, TinyConfig
from ._model import TinyDecoder
from ._safetensors import load_safetensors

__all__ = [
    "NativeConfigError",
    "NativeModelInfo",
    "load_native_model",
    "native_model_info",
    "tiny_weights_from_llama",
]

_ARCHITECTURES = ("LlamaForCausalLM",)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class NativeConfigError(ModelConfigError):
    """A Hugging Face folder the native implementation cannot represent exactly."""


def _refuse(field: str, value: object, why: str = "is not supported") -> NativeConfigError:
    return NativeConfigError(f"model.impl='native': {field}={value!r} {why}; use model.impl='hf'")


@attrs.frozen
class NativeModelInfo:
    """What ``config.json`` of a folder means for a ``TinyDecoder``: its shape, whether the
    head is tied to the embedding, the weights' dtype, and the raw config (kept for export)."""

    config: TinyConfig
    dtype: torch.dtype
    raw: Mapping[str, Any] = attrs.field(eq=False, repr=False)


def native_model_info(folder: str | os.PathLike[str]) -> NativeModelInfo:
    """Read and check ``folder/config.json``; ``NativeConfigError`` names the first field the
    native model would not reproduce exactly."""
    path = os.path.join(os.fspath(folder), "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as exc:
        raise NativeConfigError(f"model.impl='native': cannot read {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise NativeConfigError(f"model.impl='native': {path} is not a JSON object")
    return NativeModelInfo(_tiny_config(raw), _dtype(raw), raw)


def _tiny_config(raw: Mapping[str, Any]) -> TinyConfig:
    archs = raw.get("architectures")
    if archs is not None and list(archs) != list(_ARCHITECTURES):
        raise _refuse("architectures", archs)
    if raw.get("model_type", "llama") != "llama":
        raise _refuse("model_type", raw.get("model_type"))
    expect: dict[str, Any] = {
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rope_scaling": None,
        "quantization_config": None,
        "pretraining_tp": 1,
    }
    for field, wanted in expect.items():
        if raw.get(field, wanted) != wanted:
            raise _refuse(field, raw[field])
    if float(raw.get("attention_dropout", 0.0)) != 0.0:
        raise _refuse("attention_dropout", raw["attention_dropout"])
    try:
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        vocab, layers = int(raw["vocab_size"]), int(raw["num_hidden_layers"])
        ff = int(raw["intermediate_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise NativeConfigError(f"model.impl='native': config.json lacks {exc}") from exc
    kv_raw = raw.get("num_key_value_heads")
    kv_heads = heads if kv_raw is None else int(kv_raw)
    if kv_heads <= 0 or heads % kv_heads:
        raise _refuse("num_key_value_heads", kv_raw, f"does not divide num_attention_heads={heads}")
    head_dim = raw.get("head_dim")
    if head_dim is not None and hidden % heads == 0 and int(head_dim) != hidden // heads:
        raise _refuse("head_dim", head_dim, f"differs from hidden_size / heads = {hidden // heads}")
    theta = raw.get("rope_theta", 10000.0)
    rope = raw.get("rope_parameters")
    if rope is not None:
        if not isinstance(rope, Mapping) or set(rope) - {"rope_type", "rope_theta"}:
            raise _refuse("rope_parameters", rope)
        if rope.get("rope_type", "default") != "default":
            raise _refuse("rope_parameters.rope_type", rope.get("rope_type"))
        theta = rope.get("rope_theta", theta)
    try:
        return TinyConfig(
            vocab_size=vocab,
            d_model=hidden,
            n_layers=layers,
            n_heads=heads,
            d_ff=ff,
            max_seq_len=int(raw.get("max_position_embeddings", 2048)),
            rope_theta=float(theta),
            norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            init_std=float(raw.get("initializer_range", 0.02)),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            n_kv_heads=None if kv_heads == heads else kv_heads,
        )
    except ModelConfigError as exc:
        raise NativeConfigError(f"model.impl='native': {exc}; use model.impl='hf'") from exc


def _dtype(raw: Mapping[str, Any]) -> torch.dtype:
    name = raw.get("dtype", raw.get("torch_dtype")) or "float32"
    dtype = _DTYPES.get(str(name))
    if dtype is None:
        raise _refuse("dtype", name)
    return dtype


def tiny_weights_from_llama(weights: Mapping[str, Tensor], config: TinyConfig) -> dict[str, Tensor]:
    """``LlamaForCausalLM`` tensors under ``TinyDecoder`` names (the inverse of
    ``rollout.llama_weights_from_tiny``). A tied model's missing ``lm_head.weight`` is the
    embedding. Raises ``NativeConfigError`` for a missing or unexpected tensor."""
    src = dict(weights)
    out: dict[str, Tensor] = {}

    def take(name: str) -> Tensor:
        try:
            return src.pop(name)
        except KeyError:
            raise NativeConfigError(f"model.impl='native': the weights lack {name!r}") from None

    out["embed.weight"] = take("model.embed_tokens.weight")
    out["norm.weight"] = take("model.norm.weight")
    if config.tie_embeddings:
        src.pop("lm_head.weight", None)  # a tied folder may store it: the same tensor
        out["lm_head.weight"] = out["embed.weight"]
    else:
        out["lm_head.weight"] = take("lm_head.weight")
    for i in range(config.n_layers):
        hf, tiny = f"model.layers.{i}.", f"layers.{i}."
        out[tiny + "attn_norm.weight"] = take(hf + "input_layernorm.weight")
        out[tiny + "mlp_norm.weight"] = take(hf + "post_attention_layernorm.weight")
        out[tiny + "attn.wqkv.weight"] = torch.cat(
            [take(hf + f"self_attn.{p}_proj.weight") for p in ("q", "k", "v")]
        )
        out[tiny + "attn.wo.weight"] = take(hf + "self_attn.o_proj.weight")
        out[tiny + "mlp.w_gate_up.weight"] = torch.cat(
            [take(hf + "mlp.gate_proj.weight"), take(hf + "mlp.up_proj.weight")]
        )
        out[tiny + "mlp.w_down.weight"] = take(hf + "mlp.down_proj.weight")
    # rotary tables are buffers HF may have saved in old checkpoints; nothing else may remain
    left = sorted(n for n in src if not n.endswith("rotary_emb.inv_freq"))
    if left:
        raise NativeConfigError(f"model.impl='native': unexpected weights {left[:5]}")
    return out


def _read_weights(folder: str) -> dict[str, Tensor]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    weights: dict[str, Tensor] = {}
    for name in files:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise NativeConfigError(
                f"model.impl='native': no {name} in {folder} (safetensors only)"
            )
        weights.update(load_safetensors(path).tensors)
    return weights


def load_native_model(
    folder: str | os.PathLike[str], *, device: torch.device | str | None = None
) -> TinyDecoder:
    """The ``TinyDecoder`` equal to ``folder``'s ``LlamaForCausalLM`` (same logits), in the
    folder's dtype. Raises ``NativeConfigError`` when the folder is not representable."""
    folder = os.fspath(folder)
    info = native_model_info(folder)
    weights = tiny_weights_from_llama(_read_weights(folder), info.config)
    # built on the CPU and overwritten: a build on ``meta`` would skip the random init, but
    # its ``normal_`` runs torch's Python reference, which imports ``torch._dynamo`` (2.5 s)
    model = TinyDecoder(info.config)
    for name, param in model.state_dict().items():
        if weights[name].shape != param.shape:
            raise NativeConfigError(
                f"model.impl='native': {name} has shape {tuple(weights[name].shape)}, "
                f"config.json implies {tuple(param.shape)}"
            )
    with torch.no_grad():
        model.load_state_dict(weights, strict=True)
    if info.dtype != torch.float32:
        model = model.to(dtype=info.dtype)
    return model.to(device) if device is not None else model
