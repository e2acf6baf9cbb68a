"""`TinyConfig`: the shape of the tiny decoder-only policy model."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs

__all__ = ["ModelConfigError", "TinyConfig"]


class ModelConfigError(ValueError):
    """A `TinyConfig` field (or a serialized config) is invalid."""


def _positive_int(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelConfigError(f"TinyConfig.{attribute.name} must be a positive int, got {value!r}")


def _positive_float(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ModelConfigError(
            f"TinyConfig.{attribute.name} must be a positive number, got {value!r}"
        )


@attrs.frozen
class TinyConfig:
    """Shape of a `TinyDecoder` (LLaMA-style: RMSNorm, rotary positions, SwiGLU).

    `d_model` must be divisible by `n_heads` and the head size must be even (rotary embeddings
    rotate pairs of channels). `d_ff` defaults to `3 * d_model` (SwiGLU hidden width).
    `tie_embeddings`: the output head shares the embedding matrix (one parameter).
    `n_kv_heads`: grouped-query attention, that many key/value heads (a divisor of `n_heads`;
    query head `i` reads key/value head `i // (n_heads / n_kv_heads)`); `None`: `n_heads`.
    Raises `ModelConfigError` on any invalid field.
    """

    vocab_size: int = attrs.field(validator=_positive_int)
    d_model: int = attrs.field(default=128, validator=_positive_int)
    n_layers: int = attrs.field(default=2, validator=_positive_int)
    n_heads: int = attrs.field(default=4, validator=_positive_int)
    d_ff: int = attrs.field(
        default=attrs.Factory(lambda self: 3 * self.d_model, takes_self=True),
        validator=_positive_int,
    )
    max_seq_len: int = attrs.field(default=256, validator=_positive_int)
    rope_theta: float = attrs.field(default=10000.0, validator=_positive_float)
    norm_eps: float = attrs.field(default=1e-5, validator=_positive_float)
    init_std: float = attrs.field(default=0.02, validator=_positive_float)
    tie_embeddings: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    n_kv_heads: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_positive_int)
    )

    def __attrs_post_init__(self) -> None:
        if self.d_model % self.n_heads != 0:
            raise ModelConfigError(
                f"TinyConfig.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        if self.n_heads % self.kv_heads != 0:
            raise ModelConfigError(
                f"TinyConfig.n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ModelConfigError(
                f"TinyConfig head size d_model/n_heads = {self.head_dim} must be even "
                "(rotary embeddings rotate pairs of channels)"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: `n_kv_heads`, or `n_heads` without grouped-query attention."""
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TinyConfig:
        """Build a config from `to_dict()` output; unknown keys raise `ModelConfigError`."""
        known = {a.name for a in attrs.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ModelConfigError(
                f"unknown TinyConfig keys {unknown}; expected a subset of {sorted(known)}"
            )
        if "vocab_size" not in data:
            raise ModelConfigError("TinyConfig data lacks the required key 'vocab_size'")
        return cls(**dict(data))

    @classmethod
    def from_json(cls, text: str) -> TinyConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ModelConfigError(f"TinyConfig JSON is malformed: {exc}") from exc
        if not isinstance(data, dict):
            raise ModelConfigError(f"TinyConfig JSON must be an object, got {type(data).__name__}")
        return cls.from_dict(data)
