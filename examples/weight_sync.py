"""Weight sync: a trainer's model to two inference copies, with the CheckpointEngine.

Two actors each hold a copy of the tiny policy behind a ``SyncTarget``; the trainer takes a few
SGD steps and syncs after each one (pause → prepare → broadcast → finalize → resume), then checks
that both copies now generate exactly what the trained model does. Run it as is:

    python examples/weight_sync.py
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import trio

import asyncflow_actors as afa
from asyncflow_actors.checkpoint import (
    CheckpointConfig,
    CheckpointEngine,
    PauseAck,
    PauseMode,
    SyncTargetActor,
)
from asyncflow_actors.models import SamplingParams, TinyConfig, TinyDecoder, generate

CONFIG = TinyConfig(vocab_size=32, d_model=64, n_layers=2, n_heads=4)


class ModelCopy:
    """An inference copy of the policy: a ``SyncTarget`` (no requests of its own to pause)."""

    def __init__(self) -> None:
        torch.manual_seed(1)  # different initial weights from the trainer's
        self.model = TinyDecoder(CONFIG)
        self.version = -1

    async def pause(self, mode: PauseMode) -> PauseAck:
        await trio.lowlevel.checkpoint()
        return PauseAck(mode, self.version)

    async def resume(self) -> None:
        await trio.lowlevel.checkpoint()

    async def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        await trio.lowlevel.checkpoint()
        self.model.load_state_dict(dict(weights), strict=False)  # all or a named subset
        self.version = version


class Copy(SyncTargetActor):
    def __init__(self, copy: ModelCopy) -> None:
        self.copy = copy

    async def make_target(self, ctx: afa.ActorContext[Any]) -> ModelCopy:
        await trio.lowlevel.checkpoint()
        return self.copy


def sample(model: TinyDecoder) -> torch.Tensor:
    out = generate(model, [[1, 5, 7]], SamplingParams(8, temperature=0.0), pad_id=0, eos_id=2)
    return out.response_ids


async def main() -> None:
    torch.manual_seed(0)
    trainer = TinyDecoder(CONFIG)
    optimizer = torch.optim.SGD(trainer.parameters(), lr=0.5)
    copies = [ModelCopy(), ModelCopy()]
    async with afa.open_actor_system() as system:
        refs = [
            await system.spawn(lambda c=c: Copy(c), name=f"copy-{i}") for i, c in enumerate(copies)
        ]
        engine = CheckpointEngine(refs, CheckpointConfig(bucket_bytes=64 << 10))
        for version in range(3):
            tokens = torch.randint(3, CONFIG.vocab_size, (8, 12))
            loss = torch.nn.functional.cross_entropy(
                trainer(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()
            )
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            result = await engine.sync(version, trainer.state_dict())
            print(
                f"version {version}: {result.payload_bytes / 1e6:.2f} MB in {result.buckets} "
                f"buckets to {result.receivers} copies, {result.total_s * 1e3:.1f} ms "
                f"(broadcast {result.broadcast_s * 1e3:.1f} ms)"
            )
    expected = sample(trainer)
    for copy in copies:
        assert copy.version == 2 and torch.equal(sample(copy.model), expected)
    print("both copies generate what the trainer's model generates:", expected.tolist()[0])


if __name__ == "__main__":
    trio.run(main)
