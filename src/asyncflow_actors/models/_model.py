"""`TinyDecoder`: a small LLaMA-style decoder (RMSNorm, rotary positions, SwiGLU) in torch."""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._config import TinyConfig
from ._kv_cache import KVCache, KVCacheError

__all__ = ["ModelInputError", "TinyDecoder", "decode_step"]


class ModelInputError(ValueError):
    """Tokens, positions, masks or a cache given to `TinyDecoder` have the wrong shape or range."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return _rms_norm(x, self)


def _rms_norm(x: Tensor, norm: RMSNorm) -> Tensor:
    """``norm(x)``; ``decode_step`` calls it without the module call."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + norm.eps)
    return normed.type_as(x) * norm.weight


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding on [B, H, T, D] with [B, 1, T, D/2] tables (rotate-half layout)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.kv_heads
        self.head_dim = config.head_dim
        width = (config.n_heads + 2 * config.kv_heads) * config.head_dim
        self.wqkv = nn.Linear(config.d_model, width, bias=False)
        self.wo = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None,
        cache: KVCache | None,
        layer: int,
        start: int,
    ) -> Tensor:
        batch, steps, width = x.shape
        q, k, v = _split_qkv(self.wqkv(x), self.n_heads, self.n_kv_heads, self.head_dim)
        q = _rotate(q, cos, sin)
        k = _rotate(k, cos, sin)
        if cache is not None:
            k, v = cache.write(layer, start, k, v)
        k, v = _repeat_kv(k, v, self.n_heads)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        projected: Tensor = self.wo(out.transpose(1, 2).reshape(batch, steps, width))
        return projected


def _split_qkv(qkv: Tensor, heads: int, kv_heads: int, head_dim: int) -> tuple[Tensor, ...]:
    """[B, T, (H + 2 K) D] projections as q [B, H, T, D], k and v [B, K, T, D]."""
    batch, steps, _ = qkv.shape
    if kv_heads == heads:
        return tuple(qkv.view(batch, steps, 3, heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0))
    q_end, k_end = heads * head_dim, (heads + kv_heads) * head_dim
    q, k, v = qkv[..., :q_end], qkv[..., q_end:k_end], qkv[..., k_end:]
    return (
        q.view(batch, steps, heads, head_dim).transpose(1, 2),
        k.view(batch, steps, kv_heads, head_dim).transpose(1, 2),
        v.view(batch, steps, kv_heads, head_dim).transpose(1, 2),
    )


def _repeat_kv(k: Tensor, v: Tensor, heads: int) -> tuple[Tensor, Tensor]:
    """Grouped-query attention: each key/value head serves ``heads / K`` consecutive query
    heads (transformers' ``repeat_kv``); unchanged without grouping."""
    groups = heads // k.shape[1]
    if groups == 1:
        return k, v
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


class MLP(nn.Module):
    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        self.w_gate_up = nn.Linear(config.d_model, 2 * config.d_ff, bias=False)
        self.w_down = nn.Linear(config.d_ff, config.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        out: Tensor = self.w_down(F.silu(gate) * up)
        return out


class Block(nn.Module):
    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None,
        cache: KVCache | None,
        layer: int,
        start: int,
    ) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, cache, layer, start)
        out: Tensor = x + self.mlp(self.mlp_norm(x))
        return out


class TinyDecoder(nn.Module):
    """Decoder-only transformer: the policy of the CPU examples and tests.

    `forward(tokens, positions=, attention_mask=, kv_cache=)` serves both training over padded
    batches (no cache) and incremental decoding (with a `KVCache`). Padding may sit anywhere:
    `attention_mask` [B, T] marks real tokens, and positions default to the running count of
    real tokens in each row, so a left-padded row gets the same positions as an unpadded one.
    Outputs at padded positions are finite but meaningless. Parameters are initialised from
    the global torch RNG (seed it for reproducible models).
    """

    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.rope_cos: Tensor
        self.rope_sin: Tensor
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.rebuild_rope()
        self.reset_parameters()

    def rebuild_rope(self) -> None:
        """Compute the rotary tables on the model's device (after ``to_empty``)."""
        config = self.config
        device = self.embed.weight.device
        half = config.head_dim // 2
        steps = torch.arange(half, dtype=torch.float64, device=device)
        inv_freq = 1.0 / (config.rope_theta ** (steps / half))
        positions = torch.arange(config.max_seq_len, dtype=torch.float64, device=device)
        angles = torch.outer(positions, inv_freq)
        self.rope_cos = angles.cos().float()
        self.rope_sin = angles.sin().float()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) weights; residual output projections scaled by 1/sqrt(2 L)."""
        std = self.config.init_std
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(param)
            elif name.endswith(("attn.wo.weight", "mlp.w_down.weight")):
                nn.init.normal_(param, std=std / math.sqrt(2 * self.config.n_layers))
            else:
                nn.init.normal_(param, std=std)

    def forward(
        self,
        tokens: Tensor,
        *,
        positions: Tensor | None = None,
        attention_mask: Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> Tensor:
        """Logits [B, T, vocab] for int64 `tokens` [B, T]; see `hidden_states` for arguments."""
        hidden = self.hidden_states(
            tokens, positions=positions, attention_mask=attention_mask, kv_cache=kv_cache
        )
        logits: Tensor = self.lm_head(hidden)
        return logits

    def hidden_states(
        self,
        tokens: Tensor,
        *,
        positions: Tensor | None = None,
        attention_mask: Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> Tensor:
        """Final-norm hidden states [B, T, d_model].

        `attention_mask` [B, T] (bool or 0/1): real tokens; default all real. `positions`
        [B, T] int64: rotary positions; default the running count of real tokens per row
        (continuing from `kv_cache.num_tokens`). `kv_cache`: when given, the tokens are
        appended to it and attend to everything cached before. Raises `ModelInputError`
        (shapes, token ids, positions >= max_seq_len) or `KVCacheError` (cache full/mismatch).
        """
        if tokens.dim() != 2 or tokens.dtype != torch.long:
            raise ModelInputError(
                f"tokens must be an int64 tensor [B, T], got {tokens.dtype} {tuple(tokens.shape)}"
            )
        steps = tokens.shape[1]
        if steps == 0:
            raise ModelInputError("tokens has zero columns; expected at least one token per row")
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size:
            raise ModelInputError(
                f"token ids must lie in [0, {self.config.vocab_size}), got range "
                f"[{int(tokens.min())}, {int(tokens.max())}]"
            )
        if attention_mask is not None and attention_mask.shape != tokens.shape:
            raise ModelInputError(
                f"attention_mask shape {tuple(attention_mask.shape)} != tokens shape "
                f"{tuple(tokens.shape)}"
            )
        if kv_cache is not None and kv_cache.n_layers != self.config.n_layers:
            raise KVCacheError(
                f"cache has {kv_cache.n_layers} layers, the model {self.config.n_layers}"
            )
        real = (
            attention_mask.to(torch.bool)
            if attention_mask is not None
            else torch.ones_like(tokens, dtype=torch.bool)
        )
        offset = kv_cache.num_tokens[:, None] if kv_cache is not None else 0
        if positions is None:
            positions = (offset + real.long().cumsum(dim=1) - 1).clamp_min(0)
        elif positions.shape != tokens.shape:
            raise ModelInputError(
                f"positions shape {tuple(positions.shape)} != tokens shape {tuple(tokens.shape)}"
            )
        if int(positions.min()) < 0 or int(positions.max()) >= self.config.max_seq_len:
            raise ModelInputError(
                f"positions must lie in [0, max_seq_len={self.config.max_seq_len}), got range "
                f"[{int(positions.min())}, {int(positions.max())}]"
            )

        start = 0
        mask: Tensor | None = None
        if kv_cache is not None:
            start = kv_cache.reserve(real)
            mask = _attention_mask(kv_cache.valid[:, : start + steps], start, steps)
        elif attention_mask is not None:
            mask = _attention_mask(real, 0, steps)
        cos = self.rope_cos[positions][:, None]
        sin = self.rope_sin[positions][:, None]
        x = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, kv_cache, i, start)
        out: Tensor = self.norm(x)
        return out


def decode_step(model: TinyDecoder, tokens: Tensor, real: Tensor, kv_cache: KVCache) -> Tensor:
    """Logits [B, vocab] of one new token per row: the numbers of
    ``model(tokens[:, None], attention_mask=real[:, None], kv_cache=kv_cache)[:, -1]``, by the
    same operations, without the argument checks and module calls around them.

    An engine runs this for every token, and on a small model the Python around the kernels is
    most of its cost. ``tokens`` [B] int64 within the vocabulary and ``real`` [B] bool are the
    caller's to get right (the engine builds them); a position past ``max_seq_len`` and a full
    cache still raise ``ModelInputError`` / ``KVCacheError``.
    """
    batch = tokens.shape[0]
    positions = (kv_cache.num_tokens + real.long() - 1).clamp_min(0)
    if int(positions.max()) >= model.config.max_seq_len:
        raise ModelInputError(
            f"positions must lie in [0, max_seq_len={model.config.max_seq_len}), got "
            f"{int(positions.max())}"
        )
    start = kv_cache.reserve(real[:, None])
    # ``_attention_mask`` for one query at column ``start``: the valid keys, and its own
    mask = kv_cache.valid[:, : start + 1].clone()
    mask[:, start] = True
    mask = mask[:, None, None, :]
    cos = model.rope_cos[positions].view(batch, 1, 1, -1)
    sin = model.rope_sin[positions].view(batch, 1, 1, -1)
    x = F.embedding(tokens, model.embed.weight).view(batch, 1, -1)
    width = x.shape[-1]
    for i, layer in enumerate(model.layers):
        block = cast(Block, layer)
        attn, mlp = block.attn, block.mlp
        h = _rms_norm(x, block.attn_norm)
        qkv = F.linear(h, attn.wqkv.weight)
        q, k, v = _split_qkv(qkv, attn.n_heads, attn.n_kv_heads, attn.head_dim)
        q = _rotate(q, cos, sin)
        k = _rotate(k, cos, sin)
        k, v = kv_cache.write(i, start, k, v)
        k, v = _repeat_kv(k, v, attn.n_heads)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + F.linear(out.transpose(1, 2).reshape(batch, 1, width), attn.wo.weight)
        gate, up = F.linear(_rms_norm(x, block.mlp_norm), mlp.w_gate_up.weight).chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, mlp.w_down.weight)
    logits: Tensor = F.linear(_rms_norm(x, model.norm), model.lm_head.weight)
    return logits[:, -1]


def _attention_mask(key_valid: Tensor, start: int, steps: int) -> Tensor:
    """[B, 1, T, K] bool: query i (column start+i) sees valid keys at columns <= its own.

    Every query also sees its own column, so a padding query has one key and softmax stays
    finite (its output is ignored).
    """
    device = key_valid.device
    q_col = torch.arange(start, start + steps, device=device)[:, None]
    k_col = torch.arange(key_valid.shape[1], device=device)[None, :]
    causal = k_col <= q_col
    return ((key_valid[:, None, :] & causal) | (k_col == q_col))[:, None]
