"""LoRA adapters on an HF policy, with ``peft``: apply, and the merged weights for receivers
and exports that take the base model's tensors.

``apply_lora`` wraps the policy in a ``PeftModel`` whose only trainable parameters are the
adapters (``lora_A`` / ``lora_B``); their names are PEFT's, which the weight sync's
``lora_only`` filter selects. ``merged_state`` turns a full PEFT state dict into the base
model's names with ``W + alpha / r * B @ A`` folded in, for engines that cannot load adapters
and for a merged export.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from ._rank_settings import LoraSettings
from ._settings import SettingsError

PREFIX = "base_model.model."
_ADAPTER = re.compile(r"\.lora_(A|B)\.[^.]+\.weight$")


def apply_lora(model: nn.Module, lora: LoraSettings) -> nn.Module:
    """``model`` (an HF causal LM) with LoRA adapters; only they require grad."""
    if not hasattr(model, "config") or not hasattr(model, "save_pretrained"):
        raise SettingsError("model.lora needs an HF policy (model.hf)")
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # peft takes a float too
        target_modules=list(lora.target_modules),
        lora_dropout=lora.dropout,
        bias="none",
        task_type="CAUSAL_LM",
    )
    peft_model: nn.Module = get_peft_model(model, config)
    return peft_model


def base_model(model: Any) -> Any:
    """The HF model under a ``PeftModel`` (its ``save_pretrained`` writes base weights)."""
    return model.base_model.model


def is_adapter(name: str) -> bool:
    return _ADAPTER.search(name) is not None


def merged_state(state: Mapping[str, Tensor], lora: LoraSettings) -> dict[str, Tensor]:
    """A full PEFT state dict as the base model's, each adapted weight merged."""
    scale = lora.alpha / lora.r
    out: dict[str, Tensor] = {}
    for name, tensor in state.items():
        if is_adapter(name):
            continue
        base = name.removeprefix(PREFIX)
        if ".base_layer." in base:
            stem = name.rsplit(".base_layer.", 1)[0]
            a = state.get(f"{stem}.lora_A.default.weight")
            b = state.get(f"{stem}.lora_B.default.weight")
            base = base.replace(".base_layer.", ".")
            if a is not None and b is not None and base.endswith(".weight"):
                merged = tensor.float() + scale * (b.float() @ a.float())
                out[base] = merged.to(tensor.dtype)
                continue
        out[base] = tensor
    return out


def adapter_state(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The adapters of a full PEFT state dict."""
    return {name: tensor for name, tensor in state.items() if is_adapter(name)}
