"""The built-in engine: continuous batching of a ``TinyDecoder`` on its KV cache.

Each request owns a row (slot) of one ``KVCache``. The requests admitted in one step are
prefilled together in a small cache of their prompts' width, each distinct prompt once (the
samples of a group share it), and the keys and values are copied into their empty rows
(``KVCache.insert_rows``), so joining costs no forward over the other rows; then every decode step
feeds one token to each busy row, through a ``view`` of the rows up to the highest busy one.
Free rows are reused lowest first; when the shared write pointer reaches the capacity the
cache is compacted. ``kv_cache=False`` recomputes every sequence each step instead.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager

import torch
import trio
from torch import Tensor

from ..models import KVCache, TinyDecoder, decode_step, left_pad
from ._backend import PreparedWeights, prepare_module_weights
from ._config import EngineConfig
from ._core import EngineCore

__all__ = ["TorchEngine", "open_torch_engine"]


class _TinyBackend:
    def __init__(self, model: TinyDecoder, config: EngineConfig) -> None:
        self.model = model.eval()
        self.pad_id = config.pad_id
        self._max_batch = config.max_batch
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        self.cache: KVCache | None = None
        if config.kv_cache:
            capacity = config.kv_capacity or 2 * model.config.max_seq_len
            self.cache = KVCache.allocate(
                model.config, config.max_batch, capacity, dtype=self.dtype, device=self.device
            )
        self.history: dict[int, list[int]] = {}

    @property
    def max_batch(self) -> int:
        return self._max_batch

    @property
    def max_seq_len(self) -> int:
        return self.model.config.max_seq_len

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def admission_limit(self, running: int) -> int:
        return self._max_batch - running

    def prefill(self, rows: Sequence[tuple[int, Sequence[int]]]) -> Tensor:
        # The samples of a group share their prompt: each distinct sequence is prefilled once
        # and its keys and values go to every row that starts with it (a prefix cache of the
        # admissions of one step). Each row still samples with its own generator.
        distinct: dict[tuple[int, ...], int] = {}
        which = [distinct.setdefault(tuple(r), len(distinct)) for _, r in rows]
        ids, mask = left_pad(list(distinct), pad_id=self.pad_id, device=self.device)
        index = torch.tensor(which, device=self.device)
        if self.cache is None:
            for slot, row in rows:
                self.history[slot] = list(row)
            full: Tensor = self.model(ids, attention_mask=mask)[:, -1]
            return full[index]
        scratch = KVCache.allocate(
            self.model.config, len(distinct), ids.shape[1], dtype=self.dtype, device=self.device
        )
        logits: Tensor = self.model(ids, attention_mask=mask, kv_cache=scratch)[:, -1]
        self.cache.insert_rows([slot for slot, _ in rows], scratch, which)
        return logits[index]

    def decode(self, rows: Sequence[tuple[int, int]]) -> Tensor:
        if self.cache is None:
            for slot, token in rows:
                self.history[slot].append(token)
            ids, mask = left_pad(
                [self.history[slot] for slot, _ in rows], pad_id=self.pad_id, device=self.device
            )
            recomputed: Tensor = self.model(ids, attention_mask=mask)[:, -1]
            return recomputed
        cache = self.cache
        if cache.length >= cache.capacity:
            cache.compact()
        width = max(slot for slot, _ in rows) + 1
        slots = torch.tensor([slot for slot, _ in rows], device=self.device)
        tokens = torch.full((width,), self.pad_id, dtype=torch.long, device=self.device)
        mask = torch.zeros((width,), dtype=torch.bool, device=self.device)
        tokens[slots] = torch.tensor([t for _, t in rows], device=self.device)
        mask[slots] = True
        logits: Tensor = decode_step(self.model, tokens, mask, cache.view(width))
        return logits[slots]

    def release(self, slots: Sequence[int]) -> None:
        if self.cache is not None:
            self.cache.reset_rows(torch.tensor(list(slots), dtype=torch.long, device=self.device))
        for slot in slots:
            self.history.pop(slot, None)

    def kv_usage(self) -> float:
        if self.cache is None:
            return 0.0
        return float(self.cache.num_tokens.sum()) / (self.cache.capacity * self.cache.batch_size)

    def prepare(self, weights: Mapping[str, Tensor]) -> PreparedWeights:
        return prepare_module_weights(self.model, weights)


class TorchEngine(EngineCore):
    """The built-in engine serving a ``TinyDecoder`` (CPU, or CUDA where the model is).

    Implements ``GenerationEngine``; weights load by the model's state-dict names. The model
    must not be changed by anyone else while the engine runs (load through the engine).
    """

    def __init__(self, model: TinyDecoder, config: EngineConfig | None = None) -> None:
        cfg = config if config is not None else EngineConfig()
        super().__init__(_TinyBackend(model, cfg), cfg)


@asynccontextmanager
async def open_torch_engine(
    model: TinyDecoder, config: EngineConfig | None = None
) -> AsyncIterator[TorchEngine]:
    """Serve ``model`` until the block exits; pending requests then fail with ``EngineClosed``.

    The decode loop runs in a worker thread, so the event loop stays free. Cancelling the
    block stops the decode thread at its next step boundary and waits for it (nothing reads its
    results; a process exiting under a running decode step aborts).
    """
    engine = TorchEngine(model, config)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine._loop)
        try:
            yield engine
        finally:
            engine.close()
