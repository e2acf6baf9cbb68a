"""The Hugging Face engine (extra ``hf``): an ``AutoModelForCausalLM`` from a local folder.

Requests are served in waves (static batching): a wave starts with up to ``max_batch`` queued
requests, prefilled together left-padded with explicit positions, then decodes step by step on
the model's own KV cache; a request that finishes leaves its row idle until the whole wave
ends. Pause modes, partial rollout, per-token versions and weight loads are those of the
shared engine core (``docs/engines.md``). Never touches a hub: folders load with
``local_files_only=True``.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import torch
import trio
from torch import Tensor, nn

from ..models import left_pad
from ._backend import PreparedWeights, prepare_module_weights
from ._config import EngineConfig
from ._core import EngineCore

__all__ = ["HFEngine", "open_hf_engine"]


class _HFBackend:
    def __init__(self, model: nn.Module, config: EngineConfig) -> None:
        self.model = model.eval()
        self.pad_id = config.pad_id
        self._max_batch = config.max_batch
        self.device = next(model.parameters()).device
        hf_config: Any = model.config
        self._max_seq_len = int(hf_config.max_position_embeddings)
        self._vocab = int(hf_config.vocab_size)
        # transformers 5 calls the cache argument ``cache``; 4.x called it ``past_key_values``
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._cache: Any = None
        self._mask: Tensor | None = None
        self._positions: Tensor | None = None
        self._alive: set[int] = set()

    @property
    def max_batch(self) -> int:
        return self._max_batch

    @property
    def max_seq_len(self) -> int:
        return self._max_seq_len

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def admission_limit(self, running: int) -> int:
        return self._max_batch if running == 0 else 0

    def _forward(self, ids: Tensor, mask: Tensor, positions: Tensor) -> Tensor:
        kwargs = {self._cache_arg: self._cache} if self._cache is not None else {}
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **kwargs
        )
        self._cache = getattr(out, self._cache_arg)
        logits: Tensor = out.logits[:, -1]
        return logits

    def prefill(self, rows: Sequence[tuple[int, Sequence[int]]]) -> Tensor:
        slots = [slot for slot, _ in rows]
        if self._alive or slots != list(range(len(rows))):
            raise RuntimeError(f"a wave starts in empty slots 0..k-1, got {slots}")
        ids, real = left_pad([r for _, r in rows], pad_id=self.pad_id, device=self.device)
        mask = real.long()
        positions = (mask.cumsum(dim=1) - 1).clamp_min(0)
        self._cache = None
        logits = self._forward(ids, mask, positions)
        self._mask = mask
        self._positions = mask.sum(dim=1)
        self._alive = set(slots)
        return logits

    def decode(self, rows: Sequence[tuple[int, int]]) -> Tensor:
        assert self._mask is not None and self._positions is not None
        width = self._mask.shape[0]
        slots = torch.tensor([slot for slot, _ in rows], device=self.device)
        ids = torch.full((width, 1), self.pad_id, dtype=torch.long, device=self.device)
        ids[slots, 0] = torch.tensor([t for _, t in rows], device=self.device)
        # Idle rows of the wave feed a pad token marked real: their outputs are never read,
        # and no row ever attends to nothing (which could make NaNs).
        self._mask = torch.cat((self._mask, torch.ones_like(self._mask[:, :1])), dim=1)
        logits = self._forward(ids, self._mask, self._positions[:, None])
        self._positions = self._positions + 1
        return logits[slots]

    def release(self, slots: Sequence[int]) -> None:
        self._alive.difference_update(slots)
        if not self._alive:
            self._cache = self._mask = self._positions = None

    def kv_usage(self) -> float:
        return 0.0

    def prepare(self, weights: Mapping[str, Tensor]) -> PreparedWeights:
        return prepare_module_weights(self.model, weights)


class HFEngine(EngineCore):
    """A ``GenerationEngine`` over a Hugging Face causal LM (``model``), static batching.

    ``load_weights`` takes the model's own state-dict names (``model.layers.0...``); use
    ``llama_weights_from_tiny`` to feed it a ``TinyDecoder``'s. ``tokenizer`` is the folder's
    tokenizer when one was found (for the caller's convenience; requests carry token ids).
    """

    def __init__(self, model: nn.Module, config: EngineConfig, tokenizer: Any = None) -> None:
        super().__init__(_HFBackend(model, config), config)
        self.model = model
        self.tokenizer = tokenizer


def _default_config(model: nn.Module) -> EngineConfig:
    hf_config: Any = model.config
    eos = hf_config.eos_token_id
    pad = hf_config.pad_token_id
    return EngineConfig(
        eos_id=eos if isinstance(eos, int) else None, pad_id=pad if isinstance(pad, int) else 0
    )


@asynccontextmanager
async def open_hf_engine(
    model: str | os.PathLike[str] | nn.Module,
    config: EngineConfig | None = None,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> AsyncIterator[HFEngine]:
    """Serve a Hugging Face causal LM until the block exits.

    ``model`` is a local folder (loaded with ``AutoModelForCausalLM`` and, when present,
    ``AutoTokenizer``, offline) or a loaded model. Without ``config`` the engine stops at the
    model config's ``eos_token_id`` and pads with its ``pad_token_id``.
    """
    tokenizer = None
    if isinstance(model, (str, os.PathLike)):
        folder = os.fspath(model)
        module, tokenizer = await trio.to_thread.run_sync(_load_folder, folder, dtype)
    else:
        module = model
    if device is not None:
        module = module.to(device)
    engine = HFEngine(module, config if config is not None else _default_config(module), tokenizer)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine._loop)
        try:
            yield engine
        finally:
            engine.close()


def _load_folder(folder: str, dtype: torch.dtype | None) -> tuple[nn.Module, Any]:
    from transformers import AutoTokenizer

    from ._hf_load import load_causal_lm

    kwargs: dict[str, Any] = {}
    if dtype is not None:
        kwargs["dtype"] = dtype
    module = load_causal_lm(folder, **kwargs)
    tokenizer = None
    if os.path.exists(os.path.join(folder, "tokenizer_config.json")):
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return module, tokenizer
