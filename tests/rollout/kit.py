"""Models and helpers shared by the rollout tests."""

from __future__ import annotations

import torch

from asyncflow_actors.models import TinyConfig, TinyDecoder

VOCAB = 24
EOS = 2


def tiny_model(
    seed: int = 0, *, d_model: int = 32, n_layers: int = 2, max_seq_len: int = 96
) -> TinyDecoder:
    torch.manual_seed(seed)
    config = TinyConfig(
        vocab_size=VOCAB, d_model=d_model, n_layers=n_layers, n_heads=2, max_seq_len=max_seq_len
    )
    return TinyDecoder(config)


def version_token(version: int) -> int:
    """The token a `version_model` at `version` emits: it reveals the weights that made it."""
    return 3 + version % (VOCAB - 3)


def version_model(max_seq_len: int = 128) -> TinyDecoder:
    """A decoder whose output ignores its input: every row of the embedding is one vector and
    the blocks add nothing (zero output projections), so the final hidden state is constant,
    and `version_head(v)` makes it emit `version_token(v)` with probability ~1."""
    model = tiny_model(max_seq_len=max_seq_len)
    with torch.no_grad():
        model.embed.weight.copy_(model.embed.weight[5].expand_as(model.embed.weight))
        for layer in model.layers:
            layer.attn.wo.weight.zero_()
            layer.mlp.w_down.weight.zero_()
        model.lm_head.weight.copy_(version_head(model, 0))
    return model


def version_head(model: TinyDecoder, version: int) -> torch.Tensor:
    """The `lm_head.weight` of `version_model` at `version`."""
    with torch.no_grad():
        hidden = model.hidden_states(torch.tensor([[5]]))[0, 0]
        head = torch.zeros_like(model.lm_head.weight)
        head[version_token(version)] = 40.0 * hidden / hidden.norm()
    return head
