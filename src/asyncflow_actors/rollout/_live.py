"""What the engine core keeps of a request, a weight swap and a stretch of decode steps."""

from __future__ import annotations

import enum

import attrs
import trio

from ._backend import PreparedWeights
from ._sampler import Draws
from ._types import Completion, CompletionDelta, FinishReason, GenerationRequest


class _State(enum.Enum):
    RUNNING = "running"
    PAUSING = "pausing"
    PAUSED = "paused"
    CLOSED = "closed"


@attrs.define(eq=False)
class _Live:
    """A request inside the engine (mutable; see the module docstring for who touches it)."""

    request: GenerationRequest
    stop_ids: frozenset[int]
    seed: int
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    stream: trio.MemorySendChannel[CompletionDelta] | None = None
    done: trio.Event = attrs.Factory(trio.Event)
    slot: int | None = None
    pending: int | None = None
    draws: Draws | None = None
    finish: FinishReason | None = None
    result: Completion | None = None
    error: BaseException | None = None
    published: int = 0
    cancelled: bool = False
    drain: bool = False


@attrs.define(eq=False)
class _Swap:
    weights: PreparedWeights
    version: int
    done: trio.Event = attrs.Factory(trio.Event)
    taken: bool = False
    error: BaseException | None = None


@attrs.frozen
class _Work:
    swap: _Swap | None
    admissions: tuple[_Live, ...]
    running: tuple[_Live, ...]
    version: int


@attrs.frozen
class _Outcome:
    steps: int
    tokens: int
    finished: tuple[_Live, ...]
    error: BaseException | None
