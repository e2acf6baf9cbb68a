"""Save and load a `TinyDecoder` (weights + config, optionally its tokenizer) as safetensors."""

from __future__ import annotations

import os

import torch

from ._config import TinyConfig
from ._model import TinyDecoder
from ._safetensors import SafetensorsError, load_safetensors, save_safetensors
from ._tokenizer import CharTokenizer

__all__ = ["load_model", "load_tokenizer", "save_model"]

_FORMAT = "asyncflow_actors.tiny_decoder/1"


def save_model(
    path: str | os.PathLike[str],
    model: TinyDecoder,
    *,
    tokenizer: CharTokenizer | None = None,
) -> None:
    """Write the weights of `model` to `path`; its config (and `tokenizer`) go in the
    `__metadata__` map as JSON under the keys `config` (and `tokenizer`)."""
    metadata = {"format": _FORMAT, "config": model.config.to_json()}
    if tokenizer is not None:
        if tokenizer.vocab_size != model.config.vocab_size:
            raise ValueError(
                f"tokenizer vocab_size {tokenizer.vocab_size} != model vocab_size "
                f"{model.config.vocab_size}"
            )
        metadata["tokenizer"] = tokenizer.to_json()
    save_safetensors(path, model.state_dict(), metadata=metadata)


def load_model(
    path: str | os.PathLike[str],
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> TinyDecoder:
    """Rebuild the model saved by `save_model`. Raises `SafetensorsError` when the file is not
    one (no config, or weights that do not match the config's names and shapes)."""
    content = load_safetensors(path)
    if content.metadata.get("format") != _FORMAT or "config" not in content.metadata:
        raise SafetensorsError(
            f"{os.fspath(path)!r} is not a TinyDecoder file: expected metadata format {_FORMAT!r} "
            f"and a config, got keys {sorted(content.metadata)}"
        )
    config = TinyConfig.from_json(content.metadata["config"])
    model = TinyDecoder(config)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(content.tensors))
    unexpected = sorted(set(content.tensors) - set(expected))
    if missing or unexpected:
        raise SafetensorsError(
            f"weights do not match the config: missing {missing}, unexpected {unexpected}"
        )
    for name, tensor in content.tensors.items():
        if tensor.shape != expected[name].shape:
            raise SafetensorsError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, the config expects "
                f"{tuple(expected[name].shape)}"
            )
    model.load_state_dict(content.tensors)
    if dtype is not None:
        model.to(dtype=dtype)
    if device is not None:
        model.to(device=device)
    return model


def load_tokenizer(path: str | os.PathLike[str]) -> CharTokenizer:
    """The tokenizer saved next to the weights by `save_model(..., tokenizer=...)`."""
    content = load_safetensors(path)
    text = content.metadata.get("tokenizer")
    if text is None:
        raise SafetensorsError(f"{os.fspath(path)!r} holds no tokenizer in its metadata")
    return CharTokenizer.from_json(text)
