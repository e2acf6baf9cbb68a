"""Split tensors put together after the commit (``_assembly``): a receiver checksums the
pieces of a tensor split across buckets it owns on arrival, and copies them into one
allocation only once the sender committed; pieces it must copy before acknowledging are
copied at once. Bit-exact either way; a sync that fails never pays the copy; a newer sync's
tensor replaces an older pending one that was still to be put together."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import asyncflow_actors as afa
from asyncflow_actors.checkpoint import (
    BucketSource,
    CheckpointEngine,
    ChecksumMismatch,
    HostCache,
    SyncFailed,
)
from asyncflow_actors.checkpoint._assembly import Assembly
from asyncflow_actors.checkpoint._manifest import Manifest, plan_segments, spec_of

from .doubles import GetState, World, random_weights, weights_of
from .test_protocol import check_engines, config, same_bytes, settle, spawn


def two_senders() -> tuple[dict[str, torch.Tensor], Manifest, list[BucketSource]]:
    """A sharded trainer's layout: each of two senders holds half the rows of every tensor."""
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(8, 6, generator=g), "b": torch.randn(4, generator=g)}
    specs = [spec_of(name, t) for name, t in params.items()]
    segments: list[list[tuple[int, int, int]]] = [[], []]
    for index, t in enumerate(params.values()):
        half = t.nbytes // 2
        segments[0].append((index, 0, half))
        segments[1].append((index, half, half))
    manifest, _ = plan_segments(specs, segments, 1024)
    sources = []
    for sender in range(2):
        parts = [tensor.flatten()[sender * (tensor.numel() // 2) :] for tensor in params.values()]
        offsets = [sender * (t.nbytes // 2) for t in params.values()]
        sources.append(BucketSource(parts, manifest, algorithm="xxh3", offsets=offsets))
    return params, manifest, sources


def test_owned_pieces_are_checksummed_on_arrival_and_copied_only_by_the_assembly() -> None:
    params, manifest, sources = two_senders()
    assert len(manifest.buckets) == 2
    cache = HostCache(manifest, copy=False, algorithm="xxh3")
    sums = []
    for sender, bucket in enumerate(manifest.buckets):
        out = torch.empty(bucket.nbytes, dtype=torch.uint8)
        sums.append(sources[sender].pack(bucket.index, out))
        cache.stage_bucket(bucket.index, out)
    assert cache.assembled == {}  # nothing allocated, nothing copied yet
    with pytest.raises(ChecksumMismatch):
        cache.verify([sums[0], sums[1] ^ 1])  # the vote still covers every byte
    cache.verify(sums)
    whole, assembly = cache.staged()
    assert whole == {}
    assert isinstance(assembly, Assembly) and assembly.names == {"w", "b"}
    got = assembly.run()
    assert list(got) == ["w", "b"] and assembly.parts == []  # the buckets let go
    for name, tensor in params.items():
        assert torch.equal(got[name], tensor), name
    assert all(torch.equal(cache.tensors()[n], t) for n, t in params.items())


def test_pieces_not_owned_are_copied_at_once_and_owned_ones_after() -> None:
    """A receiver in the sender's process: one bucket is the sender's buffer (copied before
    the acknowledgement, then overwritten by the sender), the other handed over."""
    params, manifest, sources = two_senders()
    cache = HostCache(manifest, copy=True, algorithm="xxh3")
    sums = []
    for sender, bucket in enumerate(manifest.buckets):
        out = torch.empty(bucket.nbytes, dtype=torch.uint8)
        sums.append(sources[sender].pack(bucket.index, out))
        cache.take(bucket.index, out)
        cache.digest(bucket.index, out, owned=sender == 1)
        if sender == 0:
            out.fill_(0xEE)  # the sender reuses its buffer
    cache.verify(sums)
    _, assembly = cache.staged()
    assert assembly is not None and assembly.names == {"w", "b"}
    got = assembly.run()
    for name, tensor in params.items():
        assert torch.equal(got[name], tensor), name


SPLIT = {"big": ("float32", [300]), "small": ("float32", [4])}  # big: across 256-byte buckets


async def test_a_lazy_receiver_loads_split_tensors_bit_exact_after_the_commit(
    autojump_clock: Any,
) -> None:
    world = World()
    async with afa.open_actor_system() as system:
        # the first in-process receiver owns the packed buckets: its pieces wait for the commit
        refs = await spawn(system, world, specs=SPLIT, load="lazy", tick=0)
        engine = CheckpointEngine(refs, config())
        sent = random_weights(3, SPLIT)
        result = await engine.sync(0, sent)
        assert result.buckets > 2
        for index in range(2):
            assert world.engines[index].version == -1  # nothing changes before the load
            assert await world.receivers[index].apply_pending() == 0
            got = world.engines[index].weights
            assert all(same_bytes(got[k], v) for k, v in sent.items())


async def test_a_sync_that_fails_its_vote_never_puts_its_tensors_together(
    autojump_clock: Any, monkeypatch: Any
) -> None:
    runs: list[int] = []
    run = Assembly.run

    def counted(self: Assembly) -> dict[str, torch.Tensor]:
        runs.append(len(self.parts))
        return run(self)

    monkeypatch.setattr(Assembly, "run", counted)
    world = World(corrupt_engine=0, corrupt_bucket=0)
    async with afa.open_actor_system() as system:
        refs = await spawn(system, world, specs=SPLIT, n=1, load="eager")
        engine = CheckpointEngine(refs, config())
        with pytest.raises(SyncFailed):
            await engine.sync(0, weights_of(0, SPLIT))
        await settle()
        check_engines(world, -1)
        assert runs == []
        world.corrupt_engine = None
        await engine.sync(1, weights_of(1, SPLIT))
        check_engines(world, 1)
        assert runs == [1]


async def test_a_newer_pending_tensor_replaces_one_still_to_be_put_together(
    autojump_clock: Any,
) -> None:
    world = World()
    async with afa.open_actor_system() as system:
        (ref,) = await spawn(system, world, specs=SPLIT, n=1, load="lazy", tick=0)
        engine = CheckpointEngine([ref], config())
        await engine.sync(1, weights_of(1, SPLIT))
        await engine.sync(2, {"big": weights_of(2, SPLIT)["big"]})  # a subset, split again
        await engine.sync(3, {"small": weights_of(3, SPLIT)["small"]})
        state = await ref.ask(GetState())
        assert (state.version, state.pending) == (-1, 3)
        assert await world.receivers[0].apply_pending() == 3
        target = world.engines[0]
        assert set(target.weights["big"].tolist()) == {2.0}
        assert set(target.weights["small"].tolist()) == {3.0}
        assert target.loads == [3]  # one switch, to the merged version
