"""Values that cross the engine boundary: sampling settings, requests, completions, statistics.

All are frozen attrs classes of plain fields (ints, floats, strs, tuples, enums), so they can
travel between processes on our wire (``asyncflow_actors.actors``) without pickle.
"""

from __future__ import annotations

import enum
import math
import uuid
from collections.abc import Iterable

import attrs

from ..checkpoint import PauseMode

__all__ = [
    "Completion",
    "CompletionDelta",
    "EngineClosed",
    "EngineError",
    "EngineStatistics",
    "FinishReason",
    "GenerationRequest",
    "RequestError",
    "ResumeLimitError",
    "SamplingConfig",
    "WeightLoadError",
]


class EngineError(Exception):
    """Base of the errors a generation engine raises."""


class RequestError(EngineError, ValueError):
    """A request is invalid for this engine (empty prompt, token ids, length, budget...)."""


class ResumeLimitError(RequestError):
    """A partial rollout was resubmitted more often than the engine's ``max_resumes``."""


class WeightLoadError(EngineError, ValueError):
    """``load_weights`` got unknown names, wrong shapes or dtypes; nothing was changed."""


class EngineClosed(EngineError):
    """The engine was closed while the request waited or ran."""


_INT = {int}
_FLOAT = {float}


def _tuple_of_int(value: Iterable[int]) -> tuple[int, ...]:
    items = value if type(value) is tuple else tuple(value)
    if set(map(type, items)) <= _INT:  # the common case, checked at C speed: plain ints
        return items
    return tuple(int(v) for v in items)  # numpy or torch integers, bools


def _tuple_of_float(value: Iterable[float]) -> tuple[float, ...]:
    items = value if type(value) is tuple else tuple(value)
    if set(map(type, items)) <= _FLOAT:
        return items
    return tuple(float(v) for v in items)


@attrs.frozen
class SamplingConfig:
    """How one request samples.

    ``max_new_tokens`` is the whole budget of the sample, a resumed prefix included.
    ``temperature=0`` is greedy; ``top_k=0`` and ``top_p=1`` switch those filters off. A
    sample stops after any token of ``stop_token_ids`` (kept in the output) or the engine's
    end-of-sequence id. ``n`` is the number of samples per prompt (``GenerationRequest.expand``
    and ``generate_samples``); ``seed`` makes every sample reproducible whatever else shares
    the batch (sample ``i`` uses a generator derived from ``(seed, i)``).
    Raises ``RequestError`` for an invalid field.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_tuple_of_int)
    n: int = 1
    seed: int | None = None

    def __attrs_post_init__(self) -> None:
        for name in ("max_new_tokens", "top_k", "n"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise RequestError(f"{name} must be an int, got {value!r}")
        if self.max_new_tokens <= 0:
            raise RequestError(
                f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}"
            )
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise RequestError(
                f"temperature must be a finite number >= 0, got {self.temperature!r}"
            )
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must lie in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0 (0: off), got {self.top_k!r}")
        if self.n <= 0:
            raise RequestError(f"n must be a positive int, got {self.n!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise RequestError(f"stop_token_ids must be >= 0, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class FinishReason(enum.Enum):
    """Why a completion ended: a stop token, the budget, or an abort (a partial rollout)."""

    STOP = "stop"
    LENGTH = "length"
    ABORTED = "aborted"


def _new_id() -> str:
    return uuid.uuid4().hex


@attrs.frozen
class GenerationRequest:
    """One sample to generate: ``prompt_ids`` continued under ``sampling``.

    ``sample_index`` says which of the ``sampling.n`` samples of the prompt this is (it picks
    the seed stream). A resumed partial rollout carries what was already generated in
    ``prefix_*`` (tokens, their logprobs and the versions that produced them) and counts
    ``resumes``; the engine continues after the prefix and generates at most
    ``remaining_tokens`` more. Build one with ``continue_from``.
    """

    prompt_ids: tuple[int, ...] = attrs.field(converter=_tuple_of_int)
    sampling: SamplingConfig
    request_id: str = attrs.field(factory=_new_id)
    sample_index: int = 0
    prefix_ids: tuple[int, ...] = attrs.field(default=(), converter=_tuple_of_int)
    prefix_logprobs: tuple[float, ...] = attrs.field(default=(), converter=_tuple_of_float)
    prefix_versions: tuple[int, ...] = attrs.field(default=(), converter=_tuple_of_int)
    resumes: int = 0

    def __attrs_post_init__(self) -> None:
        if not self.prompt_ids:
            raise RequestError(f"request {self.request_id!r} has an empty prompt")
        if not len(self.prefix_ids) == len(self.prefix_logprobs) == len(self.prefix_versions):
            raise RequestError(
                f"request {self.request_id!r}: prefix of {len(self.prefix_ids)} tokens, "
                f"{len(self.prefix_logprobs)} logprobs and {len(self.prefix_versions)} versions"
            )
        if len(self.prefix_ids) >= self.sampling.max_new_tokens:
            raise RequestError(
                f"request {self.request_id!r}: prefix of {len(self.prefix_ids)} tokens leaves "
                f"nothing of max_new_tokens={self.sampling.max_new_tokens}"
            )
        if not 0 <= self.sample_index < self.sampling.n:
            raise RequestError(
                f"sample_index {self.sample_index} is outside [0, n={self.sampling.n})"
            )
        if self.resumes < 0:
            raise RequestError(f"resumes must be >= 0, got {self.resumes}")

    @property
    def remaining_tokens(self) -> int:
        """How many tokens the engine may still generate: the budget less the prefix."""
        return self.sampling.max_new_tokens - len(self.prefix_ids)

    def expand(self) -> tuple[GenerationRequest, ...]:
        """The ``sampling.n`` samples of this prompt, ids ``f"{request_id}/{i}"``."""
        return tuple(
            attrs.evolve(self, request_id=f"{self.request_id}/{i}", sample_index=i)
            for i in range(self.sampling.n)
        )

    def continue_from(self, completion: Completion) -> GenerationRequest:
        """The request that resumes the aborted ``completion`` of this request from its prefix.

        Raises ``RequestError`` unless ``completion`` is an aborted completion of this request.
        """
        if completion.finish_reason is not FinishReason.ABORTED:
            raise RequestError(
                f"only an aborted completion can be continued; {completion.request_id!r} "
                f"finished with {completion.finish_reason.value!r}"
            )
        if completion.request_id != self.request_id:
            raise RequestError(
                f"completion {completion.request_id!r} is not of request {self.request_id!r}"
            )
        return attrs.evolve(
            self,
            prefix_ids=completion.token_ids,
            prefix_logprobs=completion.logprobs,
            prefix_versions=completion.versions,
            resumes=self.resumes + 1,
        )


@attrs.frozen
class Completion:
    """A generated sample: token ids, their logprobs, and the weight version of each token.

    ``logprobs[t]`` is the log-probability of ``token_ids[t]`` under the distribution the engine
    actually sampled from (temperature, top-k and top-p applied; for greedy requests the
    log-softmax of the raw logits). ``versions[t]`` is the version of the weights that produced
    token ``t``: a partial rollout resumed after a weight sync mixes versions, and its
    staleness is measured against the oldest one.
    """

    request_id: str
    prompt_ids: tuple[int, ...] = attrs.field(converter=_tuple_of_int)
    token_ids: tuple[int, ...] = attrs.field(converter=_tuple_of_int)
    logprobs: tuple[float, ...] = attrs.field(converter=_tuple_of_float)
    versions: tuple[int, ...] = attrs.field(converter=_tuple_of_int)
    finish_reason: FinishReason
    sample_index: int = 0
    resumes: int = 0

    @property
    def oldest_version(self) -> int | None:
        """The oldest version among the tokens (``None`` for a completion without tokens)."""
        return min(self.versions) if self.versions else None

    @property
    def newest_version(self) -> int | None:
        return max(self.versions) if self.versions else None

    def staleness(self, current_version: int) -> int:
        """How many versions the oldest token lags behind ``current_version`` (0 if none)."""
        oldest = self.oldest_version
        return 0 if oldest is None else max(0, current_version - oldest)


@attrs.frozen
class CompletionDelta:
    """New tokens of a streamed request; the last delta has ``finish_reason`` set."""

    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    finish_reason: FinishReason | None = None


@attrs.frozen
class EngineStatistics:
    """A snapshot of an engine.

    ``running``: requests holding a batch slot (frozen ones included while paused);
    ``waiting``: queued; ``tokens_per_s``: generated tokens over the last few seconds of wall
    time; ``kv_cache_usage``: fraction of the KV cache holding live tokens (0 where the engine
    does not know). ``pause_mode`` is set while paused or pausing.
    """

    version: int
    paused: bool
    pause_mode: PauseMode | None
    running: int
    waiting: int
    completed: int
    aborted: int
    generated_tokens: int
    tokens_per_s: float
    kv_cache_usage: float
    steps: int
    weight_loads: int
