"""LoRA adapters on an HF policy, with ``peft``: apply, and the merged weights for receivers
and exports that take the base model's tensors.

``apply_lora`` wraps the policy in a ``PeftModel`` whose only trainable parameters are the
adapters (``lora_A`` / ``lora_B``); their names are PEFT's, which the weight sync's
``lora_only`` filter selects. ``merged_state`` turns a full PEFT state dict into the base
model's names with ``W + alpha / r * B @ A`` folded in, for engines that cannot load adapters
and for a merged export; ``AdapterMerger`` does the same on a receiver of an adapters-only sync
(``rollout.vllm_lora``: the forward stations hold plain weights). A LoRA checkpoint holds the
adapter alone too (``ADAPTER_DIR``, PEFT's folder), which ``read_adapter`` reads back under the
trainer's names for a resumed ``rollout.vllm_lora`` run.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from torch import Tensor, nn

from ._rank_settings import LoraSettings
from ._settings import SettingsError

PREFIX = "base_model.model."
#: A LoRA checkpoint's adapter folder (PEFT's ``save_pretrained``: ``adapter_config.json``,
#: ``adapter_model.safetensors``), next to the merged ``policy/``.
ADAPTER_DIR = "adapter"
_ADAPTER = re.compile(r"\.lora_(A|B)\.[^.]+\.weight$")
_FILE = re.compile(r"\.lora_(?P<ab>[AB])\.weight$")  # PEFT's file names: no adapter name
_PARTS = re.compile(r"^(?P<stem>.+)\.lora_(?P<ab>[AB])\.[^.]+\.weight$")


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


class AdapterMerger:
    """Adapters (the trainer's PEFT names) into a plain HF model's weights: each adapted
    weight becomes ``W0 + alpha / r * B @ A`` (the trainer's merge, to the bit), ``W0`` the
    base weight as it was before the first adapter arrived (kept)."""

    def __init__(self, lora: LoraSettings) -> None:
        self.scale = lora.alpha / lora.r
        self.base: dict[str, Tensor] = {}

    def merged(
        self, state: Mapping[str, Tensor], weights: Mapping[str, Tensor]
    ) -> dict[str, Tensor]:
        """``weights`` with each adapter pair replaced by its merged base weight (``state``:
        the model's current state dict); other tensors pass as they are. ``KeyError`` for a
        pair without its other half or a module the model lacks."""
        out: dict[str, Tensor] = {}
        pairs: dict[str, dict[str, Tensor]] = {}
        for name, tensor in weights.items():
            found = _PARTS.match(name)
            if found is None:
                out[name] = tensor
                continue
            pairs.setdefault(found["stem"].removeprefix(PREFIX), {})[found["ab"]] = tensor
        for module, halves in pairs.items():
            if set(halves) != {"A", "B"}:
                raise KeyError(f"{module}: an adapter needs both lora_A and lora_B")
            key = f"{module}.weight"
            if key not in self.base:
                self.base[key] = state[key].detach().clone()
            w = self.base[key]
            a, b = halves["A"], halves["B"]
            out[key] = (w.float() + self.scale * (b.float() @ a.float())).to(w.dtype)
        return out


def adapter_state(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The adapters of a full PEFT state dict."""
    return {name: tensor for name, tensor in state.items() if is_adapter(name)}


def read_adapter(folder: str) -> dict[str, Tensor]:
    """The adapter of a PEFT folder (``ADAPTER_DIR``) under the trainer's names
    (``...q_proj.lora_A.default.weight``: what a sync sends). ``OSError`` if it is missing."""
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(folder, "adapter_model.safetensors"))
    return {
        _FILE.sub(r".lora_\g<ab>.default.weight", name): tensor for name, tensor in tensors.items()
    }


def adapter_config(folder: str) -> dict[str, Any]:
    """The ``adapter_config.json`` of a PEFT folder (``r``, ``lora_alpha``, ``target_modules``,
    ``base_model_name_or_path``)."""
    with open(os.path.join(folder, "adapter_config.json")) as f:
        config: dict[str, Any] = json.load(f)
    return config


@asynccontextmanager
async def open_serving_adapter(
    opened: AbstractAsyncContextManager[Any], folder: str, version: int
) -> AsyncIterator[Any]:
    """The engine ``opened`` (on the base, LoRA on) serving the adapter of ``folder`` as
    ``version`` before anything is generated: a resumed ``rollout.vllm_lora`` run, whose
    adapter loads through the same two-phase sync as the trainer's."""
    from ._worker import in_thread

    async with opened as engine:
        weights = await in_thread(read_adapter, folder)
        await engine.load_weights(weights, version)
        yield engine
