"""A ``TinyDecoder`` as a Hugging Face ``LlamaForCausalLM`` folder (extra ``hf``).

The two architectures coincide (pre-norm RMSNorm blocks, rotary embeddings in the rotate-half
layout with the same frequencies, SwiGLU, untied head), so the weights map one to one: the
fused ``wqkv`` splits into ``q_proj``/``k_proj``/``v_proj`` and ``w_gate_up`` into
``gate_proj``/``up_proj``. A folder written by ``export_hf`` loads with
``AutoModelForCausalLM`` / ``AutoTokenizer`` offline, in the HF engine, and (for a head size
vLLM supports, e.g. 64) in vLLM; ``llama_weights_from_tiny`` converts a trainer's state dict
for ``load_weights`` of those engines.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from ..models import CharTokenizer, TinyConfig, TinyDecoder

__all__ = ["export_hf", "hf_char_tokenizer", "llama_config_from_tiny", "llama_weights_from_tiny"]


def llama_config_from_tiny(config: TinyConfig, *, tokenizer: CharTokenizer | None = None) -> Any:
    """The ``transformers.LlamaConfig`` of a ``TinyDecoder`` of ``config``."""
    from transformers import LlamaConfig

    tok = tokenizer if tokenizer is not None else CharTokenizer()
    return LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        intermediate_size=config.d_ff,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_seq_len,
        rms_norm_eps=config.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(config.rope_theta)},
        tie_word_embeddings=config.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        bos_token_id=tok.bos_id,
        eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
    )


def llama_weights_from_tiny(weights: Mapping[str, Tensor], config: TinyConfig) -> dict[str, Tensor]:
    """``TinyDecoder`` state-dict tensors (all or a subset) under ``LlamaForCausalLM`` names.

    Fused tensors are split (views, no copies). Raises ``KeyError`` for a name the tiny model
    does not have.
    """
    d, ff = config.d_model, config.d_ff
    kv = config.kv_heads * config.head_dim
    cuts = {"q_proj": (0, d), "k_proj": (d, d + kv), "v_proj": (d + kv, d + 2 * kv)}
    out: dict[str, Tensor] = {}
    for name, tensor in weights.items():
        if name == "embed.weight":
            out["model.embed_tokens.weight"] = tensor
        elif name == "norm.weight":
            out["model.norm.weight"] = tensor
        elif name == "lm_head.weight":
            out["lm_head.weight"] = tensor
        elif name.startswith("layers."):
            _, index, rest = name.split(".", 2)
            prefix = f"model.layers.{index}."
            if rest == "attn_norm.weight":
                out[prefix + "input_layernorm.weight"] = tensor
            elif rest == "mlp_norm.weight":
                out[prefix + "post_attention_layernorm.weight"] = tensor
            elif rest == "attn.wqkv.weight":
                for part, (begin, end) in cuts.items():
                    out[prefix + f"self_attn.{part}.weight"] = tensor[begin:end]
            elif rest == "attn.wo.weight":
                out[prefix + "self_attn.o_proj.weight"] = tensor
            elif rest == "mlp.w_gate_up.weight":
                out[prefix + "mlp.gate_proj.weight"] = tensor[:ff]
                out[prefix + "mlp.up_proj.weight"] = tensor[ff:]
            elif rest == "mlp.w_down.weight":
                out[prefix + "mlp.down_proj.weight"] = tensor
            else:
                raise KeyError(f"{name!r} is not a TinyDecoder weight")
        else:
            raise KeyError(f"{name!r} is not a TinyDecoder weight")
    return out


def hf_char_tokenizer(tokenizer: CharTokenizer) -> Any:
    """A ``PreTrainedTokenizerFast`` with the ids of ``tokenizer`` (one token per character);
    with special tokens it prepends BOS as ``CharTokenizer.encode(..., add_bos=True)`` does."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": tokenizer.pad_id, "<bos>": tokenizer.bos_id, "<eos>": tokenizer.eos_id}
    vocab.update({c: tokenizer.encode(c)[0] for c in tokenizer.alphabet})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", tokenizer.bos_id)]
    )
    fast: Any = PreTrainedTokenizerFast  # untyped in some transformers releases
    return fast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


def export_hf(path: str | os.PathLike[str], model: TinyDecoder, tokenizer: CharTokenizer) -> None:
    """Write ``model`` and ``tokenizer`` as a ``LlamaForCausalLM`` folder (safetensors)."""
    import torch
    from transformers import LlamaForCausalLM

    if tokenizer.vocab_size != model.config.vocab_size:
        raise ValueError(
            f"tokenizer vocab_size {tokenizer.vocab_size} != model vocab_size "
            f"{model.config.vocab_size}"
        )
    hf_model = LlamaForCausalLM(llama_config_from_tiny(model.config, tokenizer=tokenizer))
    weights = llama_weights_from_tiny(model.state_dict(), model.config)
    with torch.no_grad():
        hf_model.load_state_dict(weights, strict=True)
    hf_model.save_pretrained(os.fspath(path))
    hf_char_tokenizer(tokenizer).save_pretrained(os.fspath(path))
