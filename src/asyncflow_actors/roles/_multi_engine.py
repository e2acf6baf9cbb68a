"""Several engines of one rollout worker as one ``SyncTarget``.

A target switches whole or not at all (``SyncTarget.load_weights``): the engines first check
and convert the weights (``prepare_weights``), all of them, and only then swap
(``load_prepared``): weights one engine refuses change none. An engine without the two halves
(vLLM) loads in the same call; when one of those fails after another loaded, the error says
which engines hold what.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import trio

from ..checkpoint import PauseAck, PauseMode
from ..rollout import WeightLoadError

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
        # every check first: a refusal leaves every engine on its old weights
        prepared = await self._all(
            lambda e: e.prepare_weights(weights) if _two_phase(e) else _none()
        )
        loaded = [False] * len(self.engines)

        async def load(i: int) -> None:
            engine = self.engines[i]
            if _two_phase(engine):
                await engine.load_prepared(prepared[i], version)  # type: ignore[attr-defined]
            else:
                await engine.load_weights(weights, version)
            loaded[i] = True

        try:
            async with trio.open_nursery() as nursery:
                for i in range(len(self.engines)):
                    nursery.start_soon(load, i)
        except Exception as exc:  # a cancellation passes as it is
            if any(loaded):
                held = [e.version for e in self.engines]
                raise WeightLoadError(
                    f"loading version {version} failed after some engines loaded it: the "
                    f"engines hold versions {held}"
                ) from exc
            raise


def _two_phase(engine: Any) -> bool:
    """Whether ``engine`` loads in two halves (check, then swap) that ``load_weights`` joins."""
    return hasattr(engine, "prepare_weights") and hasattr(engine, "load_prepared")


async def _none() -> None:
    await trio.lowlevel.checkpoint()
