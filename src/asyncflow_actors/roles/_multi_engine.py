"""Several engines of one rollout worker as one ``SyncTarget``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import trio

from ..checkpoint import PauseAck, PauseMode

if TYPE_CHECKING:
    import torch

    from ..rollout import GenerationEngine


class MultiEngine:
    """Several engines of one worker as one ``SyncTarget``: paused, loaded and resumed together."""

    def __init__(self, engines: list[GenerationEngine]) -> None:
        self.engines = engines

    @property
    def version(self) -> int:
        return min(e.version for e in self.engines)

    async def _all(self, fn: Any) -> list[Any]:
        results: list[Any] = [None] * len(self.engines)

        async def one(i: int) -> None:
            results[i] = await fn(self.engines[i])

        async with trio.open_nursery() as nursery:
            for i in range(len(self.engines)):
                nursery.start_soon(one, i)
        return results

    async def pause(self, mode: PauseMode) -> PauseAck:
        acks: list[PauseAck] = await self._all(lambda e: e.pause(mode))
        return PauseAck(
            mode, self.version, sum(a.in_flight for a in acks), sum(a.aborted for a in acks)
        )

    async def resume(self) -> None:
        await self._all(lambda e: e.resume())

    async def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        await self._all(lambda e: e.load_weights(weights, version))
