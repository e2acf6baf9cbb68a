"""The sync's checksum algorithm: named by the sender, verified with it by every receiver.

XXH3-64 and CRC-32 both deliver bit-exact and refuse a corrupted bucket (the old weights kept),
in the five-phase sync and the fused one; a receiver refuses an algorithm it cannot compute
(``UnknownChecksum``, at prepare) and its target keeps its weights.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import asyncflow_actors as afa
from asyncflow_actors.checkpoint import (
    CheckpointConfig,
    CheckpointEngine,
    ChecksumMismatch,
    PauseMode,
    SyncFailed,
    SyncFused,
    UnknownChecksum,
    plan_buckets,
)
from asyncflow_actors.checkpoint._buckets import PROCESS_TOKEN, checksum
from asyncflow_actors.checkpoint._manifest import spec_of
from asyncflow_actors.checkpoint._transport import SyncSession
from tests.checkpoint.doubles import GetWeights, World, weights_of
from tests.checkpoint.test_protocol import FAST, check_engines, same_bytes, settle, spawn


def _same(got: dict[str, torch.Tensor], sent: dict[str, torch.Tensor]) -> bool:
    return got.keys() == sent.keys() and all(same_bytes(got[k], v) for k, v in sent.items())


def config(fused: bool, **kw: Any) -> CheckpointConfig:
    kw.setdefault("bucket_bytes", 4096 if fused else 256)
    kw.setdefault("fused_bytes", 4096 if fused else 0)
    return CheckpointConfig(deadlines=FAST, offload=False, **kw)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("algorithm", ["xxh3", "crc32"])
async def test_each_algorithm_delivers_bit_exact_and_refuses_a_flipped_byte(
    algorithm: str, fused: bool, autojump_clock: Any
) -> None:
    world = World()
    async with afa.open_actor_system() as system:
        refs = await spawn(system, world, tick=0, load="eager")
        engine = CheckpointEngine(refs, config(fused, checksum=algorithm))
        result = await engine.sync(0, weights_of(0))
        assert result.fused == fused
        for ref in refs:
            assert _same(await ref.ask(GetWeights()), weights_of(0))
        world.corrupt_engine, world.corrupt_bucket = 1, 0
        with pytest.raises(SyncFailed) as info:
            await engine.sync(1, weights_of(1))
        assert info.value.phase == "finalize" and not info.value.committed
        assert isinstance(info.value.__cause__, ChecksumMismatch)
        assert ("XXH3-64" if algorithm == "xxh3" else "CRC-32") in str(info.value.__cause__)
        await settle()
        check_engines(world, 0)  # both kept version 0, bit-exact
        for ref in refs:
            assert _same(await ref.ask(GetWeights()), weights_of(0))


class _NewerSender(CheckpointEngine):
    """A sender naming an algorithm this process does not have (a newer peer's)."""

    def _plan(self, version: int, weights: Any) -> SyncSession:
        session = super()._plan(version, weights)
        session.source.algorithm = "xxh128"
        return session


async def test_a_receiver_refuses_an_algorithm_it_does_not_know(autojump_clock: Any) -> None:
    world = World()
    async with afa.open_actor_system() as system:
        refs = await spawn(system, world, tick=0, load="eager")
        await CheckpointEngine(refs, config(False)).sync(0, weights_of(0))
        with pytest.raises(SyncFailed) as info:
            await _NewerSender(refs, config(False)).sync(1, weights_of(1))
        assert info.value.phase == "prepare" and not info.value.committed
        assert isinstance(info.value.__cause__, UnknownChecksum)
        assert "xxh128" in str(info.value.__cause__)
        await settle()
        check_engines(world, 0)
        for ref in refs:
            assert _same(await ref.ask(GetWeights()), weights_of(0))


async def test_a_fused_request_naming_an_unknown_algorithm_is_refused(
    autojump_clock: Any,
) -> None:
    world = World()
    async with afa.open_actor_system() as system:
        (ref,) = await spawn(system, world, n=1, tick=0, load="eager")
        manifest = plan_buckets([spec_of(n, t) for n, t in weights_of(1).items()], 4096)
        data = torch.zeros(manifest.buckets[0].nbytes, dtype=torch.uint8)
        fused = SyncFused(
            "f-1",
            PauseMode.ABORT,
            50.0,
            1,
            manifest,
            PROCESS_TOKEN,
            "xxh128",
            data,
            (checksum(data, "xxh3"),),
        )
        with pytest.raises(UnknownChecksum, match="xxh128"):
            await ref.ask(fused)
        await settle(60)  # the lease resumes the target, on its old weights
        check_engines(world, -1)


def test_auto_names_xxh3_in_the_prepare_when_xxhash_is_importable() -> None:
    pytest.importorskip("xxhash")
    engine = CheckpointEngine([], CheckpointConfig())
    assert CheckpointConfig().checksum == "auto"
    assert engine._plan(0, weights_of(0)).source.algorithm == "xxh3"
    none = CheckpointEngine([], CheckpointConfig(checksum="none"))
    assert none._plan(0, weights_of(0)).source.algorithm == ""
