"""The CheckpointEngine's own cost: one in-process sync to a target that does nothing.

The state: 117 MB of float32 (the ``engine_vllm_weight_update_s`` model's layout: an embedding
and head of 1024 x 1021, two layers of 1024 x 1024 attention projections and 1024 x 2816 MLP
projections, norms). The receiver: a ``SyncTargetActor`` in this process whose ``load_weights``
keeps the dict (eager load, so the sync's end includes it). Prints one JSON line:

- ``checkpoint_sync_s`` (s): the median wall time of a whole sync (pause to resume, the default
  ``CheckpointConfig``, or ``--checksum``); baseline: a raw copy of the same bytes into
  preallocated tensors (``copy_``), the two alternated round by round. The ratio is what
  counts on a loaded machine: it packs each bucket, the receiver copies it (the sender's buffer
  is reused) and both sides hash it.

Torch runs on one intra-op thread (as ``bench_engine``): on a loaded machine a copy split
across threads waits for each to be scheduled, and the raw copy would be noise.

Run: ``PYTHONPATH=src:benchmarks python benchmarks/bench_checkpoint.py [rounds] [--checksum
xxh3|crc32|none]`` (the default config's checksum when not given).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Mapping
from typing import Any

import torch
import trio
from common import emit

import asyncflow_actors as afa
from asyncflow_actors.checkpoint import (
    CheckpointConfig,
    CheckpointEngine,
    PauseAck,
    PauseMode,
    SyncTargetActor,
)


def make_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    d, ff, vocab = 1024, 2816, 1021
    shapes: dict[str, tuple[int, ...]] = {"embed": (vocab, d), "head": (vocab, d), "norm": (d,)}
    for layer in range(2):
        for name in ("q", "k", "v", "o"):
            shapes[f"l{layer}.{name}"] = (d, d)
        for name in ("gate", "up"):
            shapes[f"l{layer}.{name}"] = (ff, d)
        shapes[f"l{layer}.down"] = (d, ff)
        shapes[f"l{layer}.norm1"] = (d,)
        shapes[f"l{layer}.norm2"] = (d,)
    return {k: torch.randn(s, generator=gen) for k, s in shapes.items()}


class NoOpTarget:
    """A ``SyncTarget`` that holds the dict it is given."""

    def __init__(self) -> None:
        self.version = -1
        self.weights: Mapping[str, torch.Tensor] = {}

    async def pause(self, mode: PauseMode) -> PauseAck:
        await trio.lowlevel.checkpoint()
        return PauseAck(mode, self.version)

    async def resume(self) -> None:
        await trio.lowlevel.checkpoint()

    async def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        await trio.lowlevel.checkpoint()
        self.weights, self.version = weights, version


class Host(SyncTargetActor):
    async def make_target(self, ctx: Any) -> Any:
        await trio.lowlevel.checkpoint()
        return NoOpTarget()


async def main(rounds: int, checksum: str | None) -> None:
    state = make_state()
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    copies = {k: torch.empty_like(v) for k, v in state.items()}
    config = CheckpointConfig() if checksum is None else CheckpointConfig(checksum=checksum)  # type: ignore[arg-type]
    ours: list[float] = []
    raw: list[float] = []
    async with afa.open_actor_system() as system:
        ref = await system.spawn(Host, name="noop")
        engine = CheckpointEngine([ref], config)
        await engine.sync(0, state)  # warm: plan, buffers, threads
        for version in range(1, rounds + 1):
            started = time.perf_counter()
            await engine.sync(version, state)
            ours.append(time.perf_counter() - started)
            await trio.lowlevel.checkpoint()
            started = time.perf_counter()
            for name, tensor in state.items():
                copies[name].copy_(tensor)
            raw.append(time.perf_counter() - started)
    emit("checkpoint_sync_s", statistics.median(ours), "s", statistics.median(raw))
    ratios = sorted(s / b for s, b in zip(ours, raw, strict=True))
    print(
        f"checkpoint_sync_s: {nbytes / 1e6:.0f} MB, checksum {config.checksum}: sync "
        f"{min(ours):.3f}..{max(ours):.3f} s, raw copy {min(raw):.3f}..{max(raw):.3f} s, "
        f"per-round ratio median {statistics.median(ratios):.1f} over {rounds} rounds",
        file=sys.stderr,
    )


if __name__ == "__main__":
    args = sys.argv[1:]
    checksum = None
    if "--checksum" in args:
        at = args.index("--checksum")
        checksum = args[at + 1]
        del args[at : at + 2]
    torch.set_num_threads(1)
    trio.run(main, int(args[0]) if args else 9, checksum)
