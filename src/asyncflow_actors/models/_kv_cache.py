"""`KVCache`: per-layer key/value buffers for batched incremental decoding."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ._config import TinyConfig

__all__ = ["KVCache", "KVCacheError"]


class KVCacheError(ValueError):
    """The cache is full, or is used with a batch or model that does not match it."""


class KVCache:
    """Keys and values of every layer for `batch_size` sequences, `capacity` columns each.

    All rows share one write pointer (`length`): a forward over `T` new tokens writes columns
    `[length, length + T)` of every row. Which columns hold real tokens is tracked per row in
    `valid`, so rows of different lengths live in one batch (left padding, finished rows, rows
    reset with `reset_rows` and refilled). Keys are stored already rotated (rotary positions),
    so the column order of cached tokens is irrelevant to attention; `compact` uses that to
    squeeze out columns that no row needs. `num_tokens[b]` counts the valid tokens of row `b`
    and is the next default position of that row.

    For continuous batching, `insert` places a sequence prefilled in another cache into an
    empty row, and `view(n)` gives the first `n` rows as a cache that shares storage and the
    write pointer (decode only the rows in use).
    """

    def __init__(
        self,
        *,
        n_layers: int,
        batch_size: int,
        n_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        if batch_size <= 0 or capacity <= 0:
            raise KVCacheError(
                f"batch_size and capacity must be positive, got {batch_size} and {capacity}"
            )
        shape = (batch_size, n_heads, capacity, head_dim)
        self.keys: list[Tensor] = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)
        ]
        self.values: list[Tensor] = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)
        ]
        self.valid = torch.zeros(batch_size, capacity, dtype=torch.bool, device=device)
        self.num_tokens = torch.zeros(batch_size, dtype=torch.long, device=device)
        # One-element list: views made by `view` share the write pointer with their parent.
        self._pointer = [0]
        self._is_view = False

    @classmethod
    def allocate(
        cls,
        config: TinyConfig,
        batch_size: int,
        capacity: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> KVCache:
        """An empty cache shaped for a model of `config`."""
        return cls(
            n_layers=config.n_layers,
            batch_size=batch_size,
            n_heads=config.kv_heads,
            head_dim=config.head_dim,
            capacity=capacity,
            dtype=dtype,
            device=device,
        )

    @property
    def length(self) -> int:
        """The shared write pointer: columns `[0, length)` are in use by some row."""
        return self._pointer[0]

    @length.setter
    def length(self, value: int) -> None:
        self._pointer[0] = value

    @property
    def batch_size(self) -> int:
        return int(self.valid.shape[0])

    @property
    def capacity(self) -> int:
        return int(self.valid.shape[1])

    @property
    def n_layers(self) -> int:
        return len(self.keys)

    def reserve(self, attention_mask: Tensor) -> int:
        """Claim the next `T` columns for a [B, T] chunk of tokens; returns the first column.

        Called by the model once per forward, before any layer writes. Raises `KVCacheError`
        when the chunk does not fit or the batch size differs.
        """
        batch, steps = attention_mask.shape
        if batch != self.batch_size:
            raise KVCacheError(f"batch of {batch} rows given to a cache of {self.batch_size} rows")
        if self.length + steps > self.capacity:
            raise KVCacheError(
                f"cache full: {self.length} of {self.capacity} columns used, {steps} more needed "
                "(allocate a larger capacity or call compact())"
            )
        start = self.length
        mask = attention_mask.to(torch.bool)
        self.valid[:, start : start + steps] = mask
        self.num_tokens += mask.sum(dim=1)
        self.length = start + steps
        return start

    def write(self, layer: int, start: int, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Store a layer's [B, H, T, D] keys/values at `start`; return all keys/values so far."""
        end = start + key.shape[2]
        self.keys[layer][:, :, start:end] = key
        self.values[layer][:, :, start:end] = value
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def select(self, rows: Tensor) -> KVCache:
        """A new cache holding only `rows` (an index tensor), e.g. to drop finished sequences."""
        new = KVCache.__new__(KVCache)
        new.keys = [k[rows] for k in self.keys]
        new.values = [v[rows] for v in self.values]
        new.valid = self.valid[rows]
        new.num_tokens = self.num_tokens[rows]
        new._pointer = [self.length]
        new._is_view = False
        return new

    def view(self, rows: int) -> KVCache:
        """The first `rows` rows as a cache sharing this one's storage and write pointer.

        A forward through the view writes the same columns of the parent, so the parent stays
        consistent (rows outside the view get nothing at those columns, which stay invalid for
        them). Used to decode only the rows in use when the low rows are the busy ones.
        """
        if not 0 < rows <= self.batch_size:
            raise KVCacheError(f"view of {rows} rows requested from a cache of {self.batch_size}")
        new = KVCache.__new__(KVCache)
        new.keys = [k[:rows] for k in self.keys]
        new.values = [v[:rows] for v in self.values]
        new.valid = self.valid[:rows]
        new.num_tokens = self.num_tokens[:rows]
        new._pointer = self._pointer
        new._is_view = True
        return new

    def _check_source(self, source: KVCache) -> None:
        """``source`` holds keys and values of this cache's layers, heads and head size."""
        src_shape, own_shape = source.keys[0].shape, self.keys[0].shape
        if source.n_layers != self.n_layers or (src_shape[1], src_shape[3]) != (
            own_shape[1],
            own_shape[3],
        ):
            raise KVCacheError(
                f"source cache of {source.n_layers} layers x {tuple(source.keys[0].shape)} does "
                f"not match this cache of {self.n_layers} layers x {tuple(self.keys[0].shape)}"
            )

    def insert(self, row: int, source: KVCache, source_row: int = 0) -> None:
        """Copy the cached tokens of `source_row` of `source` into the empty `row` of this cache.

        The tokens land in columns `[0, n)` of `row` (their order kept; column order is free
        since keys are stored rotated) and `length` grows to `n` if shorter, so a sequence
        prefilled on its own joins a running batch without a forward over the other rows.
        Raises `KVCacheError` when `row` holds tokens (call `reset_rows` first), the shapes of
        the two caches differ, or the tokens do not fit.
        """
        if not 0 <= row < self.batch_size:
            raise KVCacheError(f"row {row} is outside a cache of {self.batch_size} rows")
        if int(self.num_tokens[row]) != 0:
            raise KVCacheError(
                f"row {row} still holds {int(self.num_tokens[row])} tokens; reset_rows first"
            )
        self._check_source(source)
        cols = source.valid[source_row, : source.length].nonzero().squeeze(1)
        count = int(cols.numel())
        if count > self.capacity:
            raise KVCacheError(f"{count} tokens do not fit in a capacity of {self.capacity}")
        for store, other in ((self.keys, source.keys), (self.values, source.values)):
            for layer, tensor in enumerate(store):
                tensor[row, :, :count] = (
                    other[layer][source_row].index_select(1, cols).to(tensor.dtype)
                )
        self.valid[row] = False
        self.valid[row, :count] = True
        self.num_tokens[row] = count
        self.length = max(self.length, count)

    def insert_rows(self, rows: Sequence[int], source: KVCache, source_rows: Sequence[int]) -> None:
        """Copy each ``source_rows[i]`` of ``source`` into the empty ``rows[i]`` of this cache,
        all in one copy per layer (``insert`` row by row costs a copy per row and layer).

        The source's columns ``[0, source.length)`` land in the same columns, padding columns
        included (they stay invalid), so a batch prefilled together joins as it is; a source
        row may go to several rows (a prompt prefilled once for every sample of its group).
        Raises ``KVCacheError`` as ``insert`` does.
        """
        if len(rows) != len(source_rows):
            raise KVCacheError(f"{len(rows)} rows given for {len(source_rows)} source rows")
        if not rows:
            return
        if len(set(rows)) != len(rows) or not all(0 <= r < self.batch_size for r in rows):
            raise KVCacheError(f"rows {list(rows)} are not distinct rows of {self.batch_size}")
        target = torch.tensor(list(rows), dtype=torch.long, device=self.valid.device)
        busy = self.num_tokens[target] != 0
        if bool(busy.any()):
            raise KVCacheError(f"row {int(target[busy][0])} still holds tokens; reset_rows first")
        self._check_source(source)
        width = source.length
        if width > self.capacity:
            raise KVCacheError(f"{width} columns do not fit in a capacity of {self.capacity}")
        origin = torch.tensor(list(source_rows), dtype=torch.long, device=self.valid.device)
        for store, other in ((self.keys, source.keys), (self.values, source.values)):
            for layer, tensor in enumerate(store):
                tensor[target, :, :width] = other[layer][origin, :, :width].to(tensor.dtype)
        self.valid[target] = False
        self.valid[target, :width] = source.valid[origin, :width]
        self.num_tokens[target] = source.num_tokens[origin]
        self.length = max(self.length, width)

    def reset_rows(self, rows: Tensor) -> None:
        """Forget the tokens of `rows` so new sequences can start there (continuous batching)."""
        self.valid[rows] = False
        self.num_tokens[rows] = 0

    def compact(self) -> None:
        """Drop columns that no row needs; each row keeps its valid columns, in order.

        Afterwards `length` is the largest per-row count of valid tokens, so a long-running
        batch whose rows finish and restart does not run out of columns. Not allowed on a
        `view` (rows outside it may need the columns).
        """
        if self._is_view:
            raise KVCacheError("compact() the whole cache, not a view of some of its rows")
        used = self.valid[:, : self.length]
        new_length = int(used.sum(dim=1).max().item()) if self.length else 0
        # A stable sort by validity puts each row's invalid columns first and its valid columns
        # last, in their original order; the last `new_length` columns are the ones to keep.
        order = torch.argsort(used.to(torch.int8), dim=1, stable=True)
        keep = order[:, self.length - new_length :]
        new_valid = torch.gather(used, 1, keep)
        for store in (self.keys, self.values):
            for i, tensor in enumerate(store):
                index = keep[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[3])
                gathered = torch.gather(tensor[:, :, : self.length], 2, index)
                tensor[:, :, :new_length] = gathered
                store[i] = tensor
        self.valid[:, :new_length] = new_valid
        self.valid[:, new_length:] = False
        self.length = new_length
