"""The fused sync: weights in one small bucket travel in one ``SyncFused`` round, then the resume.

The same promises as the five-phase protocol (``test_protocol``): a failure or a cancellation
before every receiver's verified answer leaves every target on its old, complete weights and
resumed; after it every receiver switches. ``bucket_bytes`` here is large enough that the doubles'
weights fit in one bucket, so every sync below is fused unless a test says otherwise.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import trio

import asyncflow_actors as afa
from asyncflow_actors.checkpoint import (
    CheckpointConfig,
    CheckpointEngine,
    ChecksumMismatch,
    GetReceiverStatistics,
    ManifestError,
    PauseMode,
    StaleSync,
    SyncFailed,
    SyncFused,
    plan_buckets,
)
from asyncflow_actors.checkpoint._buckets import PROCESS_TOKEN
from asyncflow_actors.checkpoint._manifest import spec_of
from tests.checkpoint.doubles import (
    FUSED_CARRIES,
    SPECS,
    GetWeights,
    World,
    random_weights,
    weights_of,
)
from tests.checkpoint.test_protocol import FAST, check_engines, same_bytes, settle, spawn

ONE_BUCKET = 4096  # the doubles' weights (about 1 KB) fit in one bucket


def config(**kw: Any) -> CheckpointConfig:
    kw.setdefault("bucket_bytes", ONE_BUCKET)
    kw.setdefault("deadlines", FAST)
    kw.setdefault("offload", False)
    return CheckpointConfig(**kw)


async def stats_of(refs: list[afa.ActorRef[Any]]) -> list[Any]:
    return [await ref.ask(GetReceiverStatistics()) for ref in refs]


async def test_a_small_sync_is_one_fused_round_and_bit_exact() -> None:
    specs = {**SPECS, "c": ("complex64", [3, 5]), "mask": ("bool", [7])}
    world = World()
    async with afa.open_actor_system() as system:
        refs = await spawn(system, world, specs=specs, tick=0, load="eager", offload=True)
        engine = CheckpointEngine(refs, config(offload=True))
        for version in range(3):
            world.log.clear()
            sent = random_weights(version, specs)
            result = await engine.sync(version, sent)
            assert result.fused and result.buckets == 1 and result.receivers == 2
            for ref in refs:
                got = await ref.ask(GetWeights())
                assert set(got) == set(sent)
                assert all(same_bytes(got[k], v) for k, v in sent.items())
            # one request each (no PutBucket), answered with the pause's ack
            assert sorted(world.log) == [("acked", 0), ("acked", 1), ("fused", 0), ("fused", 1)]
            assert [a.mode for a in result.acks] == [PauseMode.DRAIN] * 2
            assert [r.version for r in result.resumed] == [version, version]
            assert result.pause_s == result.finalize_s == result.topology_s == 0.0
            assert result.total_s >= result.broadcast_s > 0 and result.prepare_s > 0
        assert engine.transport.buffers.allocations == 1  # type: ignore[attr-defined]
        assert engine.statistics().syncs == 3


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"fused_bytes": 0}, "fusing turned off"),
        ({"fused_bytes": 512}, "one bucket, larger than fused_bytes"),
        ({"bucket_bytes": 256}, "more than one bucket"),
    ],
)
async def test_a_sync_runs_the_five_phases_when_it_cannot_fuse(
    autojump_clock: Any, kw: dict[str, Any], why: str
) -> None:
    world = World()
    async with afa.open_actor_system() as system:
        refs = await spawn(system, world, load="lazy")
        result = await CheckpointEngine(refs, config(**kw)).sync(0, weights_of(0))
        assert not result.fused, why
        assert ("bucket", 0) in world.log and ("fused", 0) not in world.log
        await settle()
        check_engines(world, 0)


async def test_the_layout_is_planned_again_when_the_weights_change(autojump_clock: Any) -> None:
    """Each sync plans its manifest from the weights it is given (a subset, a tensor more),
    fused or not as they fit; the sender's one buffer serves both kinds."""
    world = World()
    grown = {**SPECS, "extra": ("float32", [3])}
    big = {**SPECS, "huge": ("float32", [2048])}  # 8 KB: no longer one bucket
    async with afa.open_actor_system() as system:
        refs = await spawn(system, world, tick=0, load="eager", specs={**grown, **big})
        engine = CheckpointEngine(refs, config())
        for version, specs, fused in [(0, SPECS, True), (1, grown, True), (2, big, False)]:
            sent = random_weights(version, specs)
            result = await engine.sync(version, sent)
            assert result.fused is fused and result.tensors == len(specs)
            for ref in refs:
                got = await ref.ask(GetWeights())
                assert all(same_bytes(got[k], v) for k, v in sent.items())
        sent = random_weights(3, grown)  # fused again, after the two-buffer phased sync
        assert (await engine.sync(3, sent)).fused
        for ref in refs:
            got = await ref.ask(GetWeights())
            assert all(same_bytes(got[k], v) for k, v in sent.items())


async def test_a_slow_pause_fails_the_fused_round_and_everyone_resumes(
    autojump_clock: Any,
) -> None:
    world = World(slow_pause=100.0, slow_engine=0)
    async with afa.open_actor_system() as system:
        refs = await spawn(system, world)
        engine = CheckpointEngine(refs, config())
        with pytest.raises(SyncFailed) as info:
            await engine.sync(0, weights_of(0))
        # no answer: the pause was not acknowledged within the round's deadline (4 phases' sum)
        assert info.value.phase == "pause" and not info.value.committed
        assert isinstance(info.value.__cause__, trio.TooSlowError)
        assert "deadline of 40" in str(info.value) and "fused" in str(info.value)
        await settle(120)
        check_engines(world, -1)
        world.engines[0].pause_delay = 0.0
        await engine.sync(1, weights_of(1))
        await settle()
        check_engines(world, 1)


@pytest.mark.parametrize("message", FUSED_CARRIES)
async def test_a_fused_sync_cancelled_mid_round_leaves_the_old_weights(
    autojump_clock: Any, message: str
) -> None:
    world = World()
    async with afa.open_actor_system() as system:
        refs = await spawn(system, world)
        engine = CheckpointEngine(refs, config())
        await engine.sync(0, weights_of(0))
        world.cancel_on = message
        with trio.CancelScope() as world.scope:
            await engine.sync(1, weights_of(1))
        assert world.scope.cancelled_caught
        await settle()
        check_engines(world, 0)
        for stats in await stats_of(refs):
            assert stats.pending_version is None and stats.sync_id is None and not stats.paused
            assert stats.aborted == 1
        world.cancel_on = None
        assert (await engine.sync(2, weights_of(2))).fused
        await settle()
        check_engines(world, 2)


async def test_a_cancel_during_the_resume_of_a_fused_sync_still_completes_it(
    autojump_clock: Any,
) -> None:
    world = World(cancel_on="SyncResume")
    async with afa.open_actor_system() as system:
        refs = await spawn(system, world)
        with trio.CancelScope() as world.scope:
            result = await CheckpointEngine(refs, config()).sync(0, weights_of(0))
        assert result.version == 0 and result.fused
        await settle()
        check_engines(world, 0)


async def test_a_receiver_killed_in_the_fused_round_restarts_fresh(autojump_clock: Any) -> None:
    """The killed receiver's new incarnation knows nothing of the failed sync (no staged bytes,
    no cache): the next fused sync reaches it whole."""
    world = World(crash_engine=1, crash_on_bucket=0)
    async with afa.open_actor_system() as system:
        refs = await spawn(system, world, restart=afa.Restart.PERMANENT)
        engine = CheckpointEngine(refs, config())
        with pytest.raises(SyncFailed) as info:
            await engine.sync(0, weights_of(0))
        assert info.value.phase == "broadcast" and info.value.receiver == "engine-1"
        assert isinstance(info.value.__cause__, afa.ActorCrashed)
        await settle()
        check_engines(world, -1)
        world.crash_engine = None
        result = await engine.sync(1, weights_of(1))
        assert result.fused
        await settle()
        check_engines(world, 1)
        assert [s.committed for s in await stats_of(refs)] == [1, 1]  # engine-1: its new self


async def test_a_corrupted_fused_bucket_fails_at_finalize(autojump_clock: Any) -> None:
    world = World(corrupt_engine=1, corrupt_bucket=0)
    async with afa.open_actor_system() as system:
        refs = await spawn(system, world)
        engine = CheckpointEngine(refs, config())
        with pytest.raises(SyncFailed) as info:
            await engine.sync(0, weights_of(0))
        assert info.value.phase == "finalize" and info.value.receiver == "engine-1"
        assert isinstance(info.value.__cause__, ChecksumMismatch)
        await settle()
        check_engines(world, -1)  # engine 0 verified too, and dropped it: nobody committed
        assert [s.aborted for s in await stats_of(refs)] == [1, 1]


async def test_without_checksums_a_fused_sync_still_arrives_whole(autojump_clock: Any) -> None:
    world = World()
    async with afa.open_actor_system() as system:
        refs = await spawn(system, world, tick=0, load="eager")
        sent = random_weights(1)
        result = await CheckpointEngine(refs, config(checksum="none")).sync(1, sent)
        assert result.fused
        for ref in refs:
            got = await ref.ask(GetWeights())
            assert all(same_bytes(got[k], v) for k, v in sent.items())


async def test_a_fused_round_refuses_changed_shapes_and_older_versions(
    autojump_clock: Any,
) -> None:
    world = World()
    async with afa.open_actor_system() as system:
        refs = await spawn(system, world, tick=0, load="eager")
        engine = CheckpointEngine(refs, config())
        await engine.sync(5, weights_of(5))
        changed = weights_of(6)
        changed["embed.weight"] = torch.zeros(16, 9)
        with pytest.raises(SyncFailed) as info:
            await engine.sync(6, changed)
        assert info.value.phase == "prepare" and isinstance(info.value.__cause__, ManifestError)
        assert "embed.weight" in str(info.value.__cause__)
        with pytest.raises(SyncFailed) as old:
            await engine.sync(4, weights_of(4))
        assert old.value.phase == "prepare" and isinstance(old.value.__cause__, StaleSync)
        check_engines(world, 5)
        assert [s.aborted for s in await stats_of(refs)] == [2, 2]


async def test_a_load_refused_after_a_fused_commit_is_reported(autojump_clock: Any) -> None:
    world = World()
    async with afa.open_actor_system() as system:
        refs = await spawn(system, world, load="eager")
        engine = CheckpointEngine(refs, config())
        await engine.sync(0, weights_of(0))
        with pytest.raises(SyncFailed) as info:
            await engine.sync(1, {**weights_of(1), "unknown": torch.zeros(3)})
        assert info.value.phase == "resume" and info.value.committed
        await settle()
        check_engines(world, 0)


async def test_a_fused_request_whose_bucket_does_not_match_is_refused(autojump_clock: Any) -> None:
    """A receiver checks what a fused request carries against its manifest (one bucket or none,
    of the manifest's size), and a lease it armed resumes its target if the sender vanishes."""
    world = World()
    async with afa.open_actor_system() as system:
        (ref,) = await spawn(system, world, n=1)
        specs = [spec_of(name, t) for name, t in weights_of(0).items()]
        manifest = plan_buckets(specs, ONE_BUCKET)
        size = manifest.buckets[0].nbytes

        def fused(sync_id: str, data: torch.Tensor | None, lease: float = 50.0) -> SyncFused:
            return SyncFused(
                sync_id, PauseMode.ABORT, lease, 0, manifest, PROCESS_TOKEN, "", data, ()
            )

        with pytest.raises(ManifestError, match="no bucket for 1"):
            await ref.ask(fused("a-1", None))
        with pytest.raises(ManifestError, match=f"expected {size} bytes"):
            await ref.ask(fused("a-2", torch.zeros(size + 1, dtype=torch.uint8)))
        ack = await ref.ask(fused("a-3", torch.zeros(size, dtype=torch.uint8)))
        assert ack.staged == size and world.engines[0].paused
        await trio.sleep(51)  # the sender vanished: the lease resumes the target, uncommitted
        assert not world.engines[0].paused
        stats = await ref.ask(GetReceiverStatistics())
        assert stats.leases_expired == 1 and stats.sync_id is None
        assert stats.pending_version is None and world.engines[0].version == -1


def test_the_sender_reuses_its_plan_only_for_the_same_layout() -> None:
    """Planning is cached on the tensors' names, dtypes, shapes and order, the bucket size and
    the transport's splitting: any change plans again (and bytes always come from the tensors
    given)."""
    engine = CheckpointEngine([], config())
    weights = weights_of(0)
    first = engine._plan(0, weights).manifest
    other = random_weights(1)  # other values, same layout
    again = engine._plan(1, other)
    assert again.manifest is first
    assert again.source.tensors[0] is other["embed.weight"]  # bytes from this sync's tensors
    reshaped = {**weights, "embed.weight": torch.zeros(8, 16)}
    retyped = {**weights, "norm.weight": torch.zeros(8, dtype=torch.float32)}
    renamed = {("w." + k): v for k, v in weights.items()}
    reordered = dict(reversed(list(weights.items())))
    for changed in (reshaped, retyped, renamed, reordered):
        manifest = engine._plan(2, changed).manifest
        assert manifest is not first
        assert [(t.name, t.dtype, t.shape) for t in manifest.tensors] == [
            (spec_of(k, v).name, spec_of(k, v).dtype, tuple(v.shape)) for k, v in changed.items()
        ]
        assert engine._plan(3, changed).manifest is manifest  # and cached in turn
    assert engine._plan(4, weights).manifest == first
    engine.config = config(bucket_bytes=256)
    smaller = engine._plan(5, weights).manifest
    assert smaller != first and len(smaller.buckets) > 1


async def test_a_fused_sync_never_stops_a_receiver_without_pause(autojump_clock: Any) -> None:
    """The pipeline's receivers (lazy, ``pause=False``): the fused round acknowledges without
    pausing, the engine decodes on its old weights and switches at its next boundary."""
    world = World()
    async with afa.open_actor_system() as system:
        refs = await spawn(system, world, load="lazy", pause=False)
        engine = CheckpointEngine(refs, config(pause_mode=PauseMode.KEEP))
        await trio.sleep(5.5)  # mid-batch
        result = await engine.sync(0, weights_of(0))
        assert result.fused
        assert [(a.mode, a.version) for a in result.acks] == [(PauseMode.KEEP, -1)] * 2
        assert [(r.version, r.pending) for r in result.resumed] == [(-1, 0)] * 2
        await settle()
        check_engines(world, 0)
        for double in world.engines.values():
            assert double.pauses == [] and ("paused",) not in double.events
            load = double.events.index(("load", 0))
            assert double.events[load - 1] == ("boundary",)


async def test_a_fused_bucket_of_megabytes_is_copied_and_checked_in_worker_threads(
    monkeypatch: Any,
) -> None:
    """Up to ``fused_bytes`` (4 MiB): a bucket of 1 MiB or more is packed, copied (a receiver in
    the sender's process) and checksummed in worker threads on both sides, bit-exact."""
    import threading

    from asyncflow_actors.checkpoint import BucketSource, HostCache

    threads: set[str] = set()
    digest, pack = HostCache.digest, BucketSource.pack

    def digested(self: HostCache, index: int, data: torch.Tensor, owned: bool = False) -> int:
        threads.add(f"digest {threading.current_thread() is threading.main_thread()}")
        return digest(self, index, data, owned)

    def packed(self: BucketSource, index: int, out: torch.Tensor) -> int:
        threads.add(f"pack {threading.current_thread() is threading.main_thread()}")
        return pack(self, index, out)

    monkeypatch.setattr(HostCache, "digest", digested)
    monkeypatch.setattr(BucketSource, "pack", packed)
    specs = {"w": ("float32", [3 << 18]), "b": ("bfloat16", [5])}  # 3 MiB and 10 bytes
    world = World()
    async with afa.open_actor_system() as system:
        refs = await spawn(system, world, specs=specs, tick=0, load="eager", offload=True)
        engine = CheckpointEngine(refs, config(offload=True, bucket_bytes=4 << 20))
        for version in range(2):
            sent = random_weights(version, specs)
            result = await engine.sync(version, sent)
            assert result.fused and result.payload_bytes > 3 << 20
            for ref in refs:
                got = await ref.ask(GetWeights())
                assert all(same_bytes(got[k], v) for k, v in sent.items())
        assert threads == {"digest False", "pack False"}  # never on the event loop
        too_big = config(offload=True, bucket_bytes=4 << 20, fused_bytes=3 << 20)
        assert not (await CheckpointEngine(refs, too_big).sync(2, random_weights(2, specs))).fused
