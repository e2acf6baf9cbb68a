"""``model.impl = "native"``: a Hugging Face Llama folder run as the built-in tiny policy.

The folder (``model.hf``) is read into a ``TinyDecoder`` (``models.load_native_model``: same
logits as transformers' ``LlamaForCausalLM``) and from then on the run is a tiny-policy run:
the stations hold the ``TinyDecoder``, rollout serves it with the built-in engine (continuous
batching), weight syncs carry the tiny names and a checkpoint holds ``policy.safetensors``
(what a resume loads). Beside it, every checkpoint (``final`` included) holds ``policy/``: the
folder again, same ``config.json`` and tokenizer files, the trained weights under the Llama
names, so the user gets back what they gave (``AutoModelForCausalLM`` loads it).

The tokenizer is ``models.NativeTokenizer`` (the ``tokenizers`` package); a folder naming a
model-specific tokenizer class falls back to transformers' tokenizer (``HFTokenizer``).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from ..models import (
    NativeTokenizer,
    NativeTokenizerError,
    TinyDecoder,
    load_model,
    load_native_model,
    save_safetensors,
)
from ._settings import RunSpec

__all__ = [
    "HF_EXPORT_DIR",
    "load_native_policy",
    "native_kv_capacity",
    "native_tokenizer",
    "save_native_export",
]

HF_EXPORT_DIR = "policy"  # a checkpoint's Hugging Face folder, as an ``hf`` run names it
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def native_tokenizer(folder: str) -> Any:
    """``NativeTokenizer`` of ``folder``, or transformers' for a model-specific class."""
    try:
        return NativeTokenizer(folder)
    except NativeTokenizerError as exc:
        if "tokenizer_class" not in str(exc):
            raise
    from transformers import AutoTokenizer

    from ._hf_policy import HFTokenizer

    return HFTokenizer(AutoTokenizer.from_pretrained(folder, local_files_only=True))


def load_native_policy(folder: str, device: str, *, path: str | None = None) -> tuple[Any, Any]:
    """The ``TinyDecoder`` of ``folder`` (or of the checkpoint file ``path``) on ``device``,
    and the folder's tokenizer."""
    model = load_model(path, device=device) if path else load_native_model(folder, device=device)
    return model, native_tokenizer(folder)


def native_kv_capacity(spec: RunSpec, model: TinyDecoder) -> int | None:
    """Columns of the built-in engine's cache for a native run: twice the longest sequence the
    run can make (``task.dataset.max_prompt_length`` + ``rollout.max_new_tokens``) where that
    is below the folder's ``max_position_embeddings``; the engine's default (twice the
    latter, 2 x 131072 columns a row for a recent Llama) otherwise."""
    prompt = spec.task.dataset.max_prompt_length
    if prompt is None:
        return None
    return 2 * min(model.config.max_seq_len, prompt + spec.rollout.max_new_tokens)


def save_native_export(model: TinyDecoder, folder: str, directory: str) -> str:
    """Write ``directory/policy``: ``folder``'s files but its weights, and ``model``'s weights
    under the Llama names (``model.safetensors``; a tied head is stored once, as
    transformers stores it). The path written."""
    from ..rollout._hf_export import llama_weights_from_tiny

    out = os.path.join(directory, HF_EXPORT_DIR)
    os.makedirs(out, exist_ok=True)
    for name in sorted(os.listdir(folder)):
        src = os.path.join(folder, name)
        if os.path.isfile(src) and name not in _WEIGHT_FILES and not name.endswith(".safetensors"):
            shutil.copyfile(src, os.path.join(out, name))
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    weights = llama_weights_from_tiny(state, model.config)
    if model.config.tie_embeddings:
        del weights["lm_head.weight"]
    weights = {k: v.contiguous() for k, v in weights.items()}
    save_safetensors(os.path.join(out, "model.safetensors"), weights, metadata={"format": "pt"})
    return out
