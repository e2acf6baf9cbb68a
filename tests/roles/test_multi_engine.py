"""``MultiEngine``: several engines of one rollout worker switch whole or not at all."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import trio

from asyncflow_actors.checkpoint import PauseAck, PauseMode
from asyncflow_actors.roles import MultiEngine
from asyncflow_actors.rollout import WeightLoadError, open_torch_engine
from tests.rollout.kit import tiny_model


def leaves(exc: BaseException) -> list[BaseException]:
    group = getattr(exc, "exceptions", None)
    return [leaf for sub in group for leaf in leaves(sub)] if group else [exc]


class Watched:
    """An engine that says when a load returned."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.loaded = engine, trio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    async def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        await self.engine.load_weights(weights, version)
        self.loaded.set()

    async def load_prepared(self, prepared: Any, version: int) -> None:
        await self.engine.load_prepared(prepared, version)
        self.loaded.set()


class RefusesLate:
    """An engine whose check of the weights fails once the other engine loaded them (or after
    a second, if it never does): the refusal that came after a sibling's switch."""

    version = 0

    def __init__(self, sibling: Watched) -> None:
        self.sibling = sibling

    async def pause(self, mode: PauseMode) -> PauseAck:
        await trio.lowlevel.checkpoint()
        return PauseAck(mode, self.version)

    async def resume(self) -> None:
        await trio.lowlevel.checkpoint()

    async def prepare_weights(self, weights: Mapping[str, torch.Tensor]) -> Any:
        with trio.move_on_after(1.0):
            await self.sibling.loaded.wait()
        raise WeightLoadError("weights do not match the model")

    async def load_prepared(self, prepared: Any, version: int) -> None:
        raise AssertionError("never prepared")

    async def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        await self.prepare_weights(weights)


async def test_weights_one_engine_refuses_change_none() -> None:
    small, other = tiny_model(1), tiny_model(3)
    new = {k: torch.full_like(v, 0.5) for k, v in small.state_dict().items()}
    before = {k: v.clone() for k, v in small.state_dict().items()}
    async with open_torch_engine(small) as a, open_torch_engine(other) as b:
        watched = Watched(a)
        refused: BaseException | None = None
        try:
            with trio.fail_after(30):
                await MultiEngine([watched, RefusesLate(watched)]).load_weights(new, 1)  # type: ignore[list-item]
        except Exception as exc:
            refused = exc
        assert refused is not None
        assert any(isinstance(leaf, WeightLoadError) for leaf in leaves(refused))
        assert a.version == 0 and not watched.loaded.is_set()
        for name, value in small.state_dict().items():
            assert torch.equal(value, before[name]), name
        # weights every engine accepts switch every engine
        with trio.fail_after(30):
            await MultiEngine([a, b]).load_weights(new, 2)
        assert (a.version, b.version) == (2, 2)
        for model in (small, other):
            assert all(torch.equal(v, new[k]) for k, v in model.state_dict().items())
