"""``EngineConfig``: how a built-in engine (torch or Hugging Face) schedules and samples."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any, Literal

import attrs

from ._types import EngineError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["EngineConfig"]


class EngineConfigError(EngineError, ValueError):
    """An ``EngineConfig`` field or table is invalid."""


def _positive(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise EngineConfigError(f"EngineConfig.{attribute.name} must be > 0, got {value!r}")


@attrs.frozen
class EngineConfig:
    """Scheduling and sampling settings of a built-in engine.

    - ``max_batch``: requests decoded together (KV-cache rows).
    - ``eos_id``: the end-of-sequence id every request stops at (``None``: only the
      request's ``stop_token_ids``); ``pad_id`` fills unused batch cells.
    - ``batching``: ``"continuous"`` (new requests join between decode steps as others
      finish) or ``"static"`` (a new batch starts only once the whole previous one finished;
      the baseline of the benchmark). The Hugging Face engine always batches statically.
    - ``kv_cache``: decode incrementally (``False`` recomputes every sequence each step: the
      benchmark's baseline). ``kv_capacity``: columns of the cache (default twice the
      model's ``max_seq_len``; it is compacted when full).
    - ``max_resumes``: how often a partial rollout may be resubmitted.
    - ``max_run_seconds``: longest stretch the decode thread runs before the event loop
      hears of its progress (stream deltas, statistics); a finished request, a new request,
      a pause, a cancellation or a weight load end a stretch at the next step anyway.
    - ``seed``: draws the seeds of requests that do not give one.
    - ``version``: the version of the weights the engine starts with.
    """

    max_batch: int = attrs.field(default=64, validator=_positive)
    eos_id: int | None = None
    pad_id: int = 0
    batching: Literal["continuous", "static"] = "continuous"
    kv_cache: bool = True
    kv_capacity: int | None = None
    max_resumes: int = 4
    max_run_seconds: float = attrs.field(default=0.05, validator=_positive)
    seed: int = 0
    version: int = 0

    def __attrs_post_init__(self) -> None:
        if self.batching not in ("continuous", "static"):
            raise EngineConfigError(
                f"EngineConfig.batching must be 'continuous' or 'static', got {self.batching!r}"
            )
        if self.kv_capacity is not None and self.kv_capacity <= 0:
            raise EngineConfigError(f"EngineConfig.kv_capacity must be > 0, got {self.kv_capacity}")
        if self.max_resumes < 0:
            raise EngineConfigError(
                f"EngineConfig.max_resumes must be >= 0, got {self.max_resumes}"
            )

    @classmethod
    def from_dict(cls, table: Mapping[str, Any]) -> EngineConfig:
        """From a parsed TOML table; unknown keys raise ``EngineConfigError``."""
        known = {f.name for f in attrs.fields(cls)}
        extra = sorted(set(table) - known)
        if extra:
            raise EngineConfigError(f"engine config: unknown keys {extra} (known: {sorted(known)})")
        return cls(**dict(table))

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str], *, table: str | None = None) -> EngineConfig:
        """Load from a TOML file (``table``: a dotted key holding the config, else the root)."""
        with open(path, "rb") as f:
            data: Any = tomllib.load(f)
        for key in table.split(".") if table else ():
            data = data[key]
        return cls.from_dict(data)
