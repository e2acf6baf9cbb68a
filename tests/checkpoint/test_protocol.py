"""The sync protocol in one process: receivers are local actors hosting engine doubles.

Time is virtual (``autojump_clock``) wherever the doubles decode or deadlines matter; those
tests run copies inline (``offload=False``): a worker thread would let the mock clock jump.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import trio

import asyncflow_actors as afa
from asyncflow_actors.checkpoint import (
    BucketSource,
    CheckpointConfig,
    CheckpointEngine,
    ChecksumMismatch,
    GetReceiverStatistics,
    HostCache,
    ManifestError,
    PauseAck,
    PauseMode,
    PhaseDeadlines,
    PutBucket,
    StaleSync,
    SyncFailed,
    SyncPause,
    SyncTargetActor,
)
from asyncflow_actors.checkpoint._engine import CANCELLED_RESUME_S
from asyncflow_actors.checkpoint._manifest import tensor_bytes
from tests.checkpoint.doubles import (
    SPECS,
    DoubleActor,
    GetState,
    GetWeights,
    World,
    random_weights,
    weights_of,
)

FAST = PhaseDeadlines(pause=10, prepare=10, topology=10, broadcast=10, finalize=10, resume=10)


def config(**kw: Any) -> CheckpointConfig:
    kw.setdefault("bucket_bytes", 256)
    kw.setdefault("deadlines", FAST)
    kw.setdefault("offload", False)
    return CheckpointConfig(**kw)


async def spawn(
    system: afa.ActorSystem, world: World, n: int = 2, **kw: Any
) -> list[afa.ActorRef[Any]]:
    kw.setdefault("offload", False)
    restart = kw.pop("restart", afa.Restart.TEMPORARY)
    prefix = kw.pop("prefix", "engine")
    return [
        await system.spawn(
            lambda i=i: DoubleActor(index=i, world=world, **kw),  # type: ignore[misc]
            name=f"{prefix}-{i}",
            restart=restart,
        )
        for i in range(n)
    ]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype and a.shape == b.shape and torch.equal(tensor_bytes(a), tensor_bytes(b))
    )


async def settle(seconds: float = 20.0) -> None:
    """Let the doubles decode past a batch boundary (virtual time)."""
    await trio.sleep(seconds)


def check_engines(world: World, version: int) -> None:
    for index, engine in world.engines.items():
        assert not engine.paused, f"engine {index} stayed paused"
        assert engine.version == version, (index, engine.version, version)
        assert not engine.violations, engine.violations


async def test_in_process_sync_is_bit_exact_and_reports_its_phases() -> None:
    specs = {
        **SPECS,
        "c": ("complex64", [3, 5]),
        "mask": ("bool", [7]),
        "big": ("float32", [300]),  # split across 256-byte buckets
    }
    world = World()
    async with afa.open_actor_system() as system:
        refs = await spawn(system, world, specs=specs, tick=0, load="eager", offload=True)
        engine = CheckpointEngine(refs, config(offload=True))
        for version in range(2):
            sent = random_weights(version, specs)
            result = await engine.sync(version, sent)
            for ref in refs:
                got = await ref.ask(GetWeights())
                assert set(got) == set(sent)
                assert all(same_bytes(got[k], v) for k, v in sent.items())
            assert result.version == version and result.receivers == 2
            assert result.tensors == len(specs) and result.buckets > 5
            assert result.payload_bytes == sum(t.nbytes for t in sent.values())
            assert result.bytes_moved >= 2 * result.payload_bytes
            assert [a.mode for a in result.acks] == [PauseMode.DRAIN] * 2
            assert [r.version for r in result.resumed] == [version, version]
            metrics = result.metrics()
            assert {f"sync_{p}" for p in ("pause", "prepare", "topology", "broadcast")} <= set(
                metrics
            )
            assert metrics["sync_total"] >= metrics["sync_broadcast"] > 0
        # in-process receivers: every packed bucket went into fresh memory (handed over), the
        # double buffer is never allocated (a remote receiver's sync reuses it)
        assert engine.transport.buffers.allocations == 0  # type: ignore[attr-defined]
        stats = engine.statistics()
        assert (stats.syncs, stats.failed, stats.last_version, stats.targets) == (2, 0, 1, 2)


async def test_the_first_in_process_receiver_keeps_the_packed_buckets(monkeypatch: Any) -> None:
    """A receiver in the sender's process takes the packed buckets as they are (``keep``: no
    copy); a second one copies them, so two targets never share one buffer; both bit-exact.
    One digest cache per receiver: which of them owned its buckets."""
    from asyncflow_actors.checkpoint import HostCache

    seen: dict[int, set[bool]] = {}
    digest = HostCache.digest

    def digested(self: HostCache, index: int, data: torch.Tensor, owned: bool = False) -> int:
        seen.setdefault(id(self), set()).add(owned)
        return digest(self, index, data, owned)

    monkeypatch.setattr(HostCache, "digest", digested)
    specs = {"a": ("float32", [40]), "b": ("float32", [30]), "big": ("float32", [300])}
    async with afa.open_actor_system() as system:
        refs = await spawn(system, World(), specs=specs, tick=0, load="eager", offload=True)
        sent = random_weights(0, specs)
        result = await CheckpointEngine(refs, config(offload=True)).sync(0, sent)
        assert not result.fused and result.buckets > 2
        for ref in refs:
            got = await ref.ask(GetWeights())
            assert all(same_bytes(got[k], v) for k, v in sent.items())
    # (a bucket that is one whole tensor is sent from the tensor: copied by both)
    assert sorted(True in owned for owned in seen.values()) == [False, True]


@pytest.mark.parametrize("mode", list(PauseMode))
async def test_lazy_load_applies_exactly_at_the_batch_boundary(
    autojump_clock: Any, mode: PauseMode
) -> None:
    world = World()
    async with afa.open_actor_system() as system:
        refs = await spawn(system, world, load="lazy")
        engine = CheckpointEngine(refs, config(pause_mode=mode))
        await trio.sleep(5.5)  # mid-batch
        result = await engine.sync(0, weights_of(0))
        assert [r.pending for r in result.resumed] == [0, 0]  # committed, not loaded yet
        assert [r.version for r in result.resumed] == [-1, -1]
        await settle()
        check_engines(world, 0)
        for engine_double in world.engines.values():
            events = engine_double.events
            load = events.index(("load", 0))
            assert events[load - 1] == ("boundary",)  # loaded at a boundary, by the loop itself
            assert events.index(("resumed",)) < load
            before = [e[1] for e in events[:load] if e[0] == "token"]
            after = [e[1] for e in events[load:] if e[0] == "token"]
            assert set(before) == {-1} and after and set(after) == {0}
            if mode is PauseMode.KEEP:  # the frozen batch went on under the new weights
                assert events[load - 2 : load] == [("resumed",), ("boundary",)]


async def test_eager_load_happens_before_the_resume(autojump_clock: Any) -> None:
    world = World()
    async with afa.open_actor_system() as system:
        refs = await spawn(system, world, n=1, load="eager")
        lazy = await spawn(system, World(), n=1, load="lazy", prefix="lazy")
        engine = CheckpointEngine([*refs, *lazy], config(eager=True))
        result = await engine.sync(3, weights_of(3))
        assert [(r.version, r.pending) for r in result.resumed] == [(3, None), (3, None)]
        events = world.engines[0].events
        assert events.index(("paused",)) < events.index(("load", 3)) < events.index(("resumed",))
        await settle()
        check_engines(world, 3)


@pytest.mark.parametrize("mode", list(PauseMode))
async def test_a_lazy_receiver_without_pause_never_stops_its_target(
    autojump_clock: Any, mode: PauseMode
) -> None:
    """``pause=False``: the sync acknowledges the pause without pausing the engine, which keeps
    decoding on its old weights while the bytes arrive and loads them at its next boundary."""
    world = World()
    async with afa.open_actor_system() as system:
        refs = await spawn(system, world, load="lazy", pause=False)
        engine = CheckpointEngine(refs, config(pause_mode=mode))
        await trio.sleep(5.5)  # mid-batch
        result = await engine.sync(0, weights_of(0))
        assert [(a.mode, a.version) for a in result.acks] == [(mode, -1)] * 2
        assert [(r.version, r.pending) for r in result.resumed] == [(-1, 0)] * 2
        await settle()
        check_engines(world, 0)
        for double in world.engines.values():
            assert double.pauses == [] and ("paused",) not in double.events
            load = double.events.index(("load", 0))
            assert double.events[load - 1] == ("boundary",)
            tokens = [e[1] for e in double.events if e[0] == "token"]
            assert tokens == sorted(tokens) and tokens[-1] == 0  # old weights up to the load


async def test_an_eager_sync_pauses_a_receiver_without_pause_for_the_load_only(
    autojump_clock: Any,
) -> None:
    world = World()
    async with afa.open_actor_system() as system:
        refs = await spawn(system, world, n=1, load="lazy", pause=False)
        result = await CheckpointEngine(refs, config(eager=True)).sync(2, weights_of(2))
        assert [(r.version, r.pending) for r in result.resumed] == [(2, None)]
        events = world.engines[0].events
        assert events.index(("paused",)) < events.index(("load", 2)) < events.index(("resumed",))
        await settle()
        check_engines(world, 2)


def test_a_receiver_without_pause_must_load_lazily() -> None:
    from asyncflow_actors.checkpoint import WeightReceiver
    from tests.checkpoint.doubles import EngineDouble

    with pytest.raises(ValueError, match="pause=False needs load='lazy'"):
        WeightReceiver(EngineDouble(), load="eager", pause=False)


async def test_broadcast_starts_only_after_every_pause_ack(autojump_clock: Any) -> None:
    world = World(slow_pause=5.0, slow_engine=1)  # engine 1 takes 5 s more to pause
    async with afa.open_actor_system() as system:
        refs = await spawn(system, world)
        await CheckpointEngine(refs, config()).sync(0, weights_of(0))
        first_bucket = world.log.index(("bucket", 0))
        assert {("acked", 0), ("acked", 1)} <= set(world.log[:first_bucket])


async def test_a_pause_past_its_deadline_fails_the_sync_and_everyone_resumes(
    autojump_clock: Any,
) -> None:
    world = World(slow_pause=100.0, slow_engine=0)
    async with afa.open_actor_system() as system:
        refs = await spawn(system, world)
        engine = CheckpointEngine(refs, config())
        with pytest.raises(SyncFailed) as info:
            await engine.sync(0, weights_of(0))
        assert info.value.phase == "pause" and not info.value.committed
        assert isinstance(info.value.__cause__, trio.TooSlowError)
        assert "deadline of 10" in str(info.value)
        await settle(120)  # the slow pause ends; the queued resume follows it
        check_engines(world, -1)
        world.slow_engine = None
        world.engines[0].pause_delay = 0.0
        await engine.sync(1, weights_of(1))
        await settle()
        check_engines(world, 1)
        assert engine.statistics().failed == 1


@pytest.mark.parametrize("message", ["SyncPause", "SyncPrepare", "PutBucket", "SyncFinalize"])
async def test_a_sync_cancelled_in_any_phase_leaves_the_old_weights(
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
        for ref in refs:
            stats = await ref.ask(GetReceiverStatistics())
            assert stats.pending_version is None and stats.sync_id is None and not stats.paused
        world.cancel_on = None
        await engine.sync(2, weights_of(2))
        await settle()
        check_engines(world, 2)


async def test_a_cancel_during_the_resume_still_completes_the_sync(autojump_clock: Any) -> None:
    world = World(cancel_on="SyncResume")
    async with afa.open_actor_system() as system:
        refs = await spawn(system, world)
        with trio.CancelScope() as world.scope:
            result = await CheckpointEngine(refs, config()).sync(0, weights_of(0))
        assert result.version == 0  # committed before the cancel: it completed
        await settle()
        check_engines(world, 0)


async def test_a_cancelled_sync_does_not_wait_out_the_resume_deadline(
    autojump_clock: Any,
) -> None:
    """Its sender stopping (a cancel) and receivers that never answer the resume: the sync
    gives the resume ``CANCELLED_RESUME_S``, not the whole deadline (the sender's stop would
    wait it out, shielded); the receivers resume on their own when their lease runs out."""
    world = World(cancel_on="PutBucket", silent_on="SyncResume")
    async with afa.open_actor_system() as system:
        refs = await spawn(system, world, tick=0)  # (no decode loop: they pause at once)
        started = trio.current_time()
        chosen = config()
        with trio.CancelScope() as world.scope:
            await CheckpointEngine(refs, chosen).sync(0, weights_of(0))
        assert trio.current_time() - started <= CANCELLED_RESUME_S + 0.1 < FAST.resume
        await settle(chosen.lease)
        assert not any(engine.paused for engine in world.engines.values())


async def test_a_receiver_killed_mid_broadcast(autojump_clock: Any) -> None:
    world = World(crash_engine=1, crash_on_bucket=1)
    async with afa.open_actor_system() as system:
        refs = await spawn(system, world, restart=afa.Restart.PERMANENT)
        engine = CheckpointEngine(refs, config())
        with pytest.raises(SyncFailed) as info:
            await engine.sync(0, weights_of(0))
        assert info.value.phase == "broadcast" and info.value.receiver == "engine-1"
        assert isinstance(info.value.__cause__, afa.ActorCrashed)
        await settle()
        check_engines(world, -1)  # engine 0 kept its weights; engine 1 is a fresh incarnation
        world.crash_engine = None
        await engine.sync(1, weights_of(1))
        await settle()
        check_engines(world, 1)


async def test_a_corrupted_bucket_fails_the_checksum_at_finalize(autojump_clock: Any) -> None:
    world = World(corrupt_engine=0, corrupt_bucket=0)
    async with afa.open_actor_system() as system:
        refs = await spawn(system, world)
        engine = CheckpointEngine(refs, config())
        with pytest.raises(SyncFailed) as info:
            await engine.sync(0, weights_of(0))
        assert info.value.phase == "finalize"
        assert isinstance(info.value.__cause__, ChecksumMismatch)
        assert "bucket 0" in str(info.value.__cause__)
        await settle()
        check_engines(world, -1)


async def test_the_lease_resumes_a_receiver_whose_sender_vanished(autojump_clock: Any) -> None:
    world = World()
    async with afa.open_actor_system() as system:
        (ref,) = await spawn(system, world, n=1)
        ack = await ref.ask(SyncPause("gone-1", PauseMode.ABORT, 50.0))
        assert isinstance(ack, PauseAck) and world.engines[0].paused
        await trio.sleep(49)
        assert world.engines[0].paused
        await trio.sleep(2)
        assert not world.engines[0].paused
        stats = await ref.ask(GetReceiverStatistics())
        assert stats.leases_expired == 1 and stats.sync_id is None
        data = torch.zeros(4, dtype=torch.uint8)
        with pytest.raises(StaleSync, match="gone-1 is not in progress"):
            await ref.ask(PutBucket("gone-1", 0, data))


async def test_lora_only_syncs_send_adapters_and_merge_with_pending_weights(
    autojump_clock: Any,
) -> None:
    world = World()
    async with afa.open_actor_system() as system:
        (ref,) = await spawn(system, world, n=1, load="lazy", tick=0)
        full = CheckpointEngine([ref], config())
        lora = CheckpointEngine([ref], config(lora_only=True))
        await full.sync(1, weights_of(1))
        result = await lora.sync(2, weights_of(2))
        assert result.tensors == 2
        state = await ref.ask(GetState())
        assert (state.version, state.pending) == (-1, 2)
        target = world.engines[0]
        assert (await ref.ask(GetReceiverStatistics())).name == "engine-0"
        assert await world.receivers[0].apply_pending() == 2  # the batch boundary, by hand
        assert await world.receivers[0].apply_pending() is None
        for name, tensor in target.weights.items():
            expected = 2 if ".lora_" in name else 1
            assert tensor.numel() == 0 or set(tensor.flatten().tolist()) == {expected}, name
        assert target.loads == [2]  # one switch, to the merged version


async def test_a_receiver_refuses_changed_shapes_and_older_versions_before_any_byte(
    autojump_clock: Any,
) -> None:
    world = World()
    async with afa.open_actor_system() as system:
        refs = await spawn(system, world, tick=0, load="eager")
        engine = CheckpointEngine(refs, config())
        await engine.sync(5, weights_of(5))
        world.log.clear()
        changed = weights_of(6)
        changed["embed.weight"] = torch.zeros(16, 9)
        with pytest.raises(SyncFailed) as info:
            await engine.sync(6, changed)
        assert info.value.phase == "prepare" and isinstance(info.value.__cause__, ManifestError)
        assert "embed.weight" in str(info.value.__cause__)
        with pytest.raises(SyncFailed) as old:
            await engine.sync(4, weights_of(4))
        assert old.value.phase == "prepare" and isinstance(old.value.__cause__, StaleSync)
        assert not [e for e in world.log if e[0] == "bucket"]
        check_engines(world, 5)


async def test_a_receiver_with_expected_specs_refuses_unknown_tensors(autojump_clock: Any) -> None:
    world = World()
    async with afa.open_actor_system() as system:
        refs = await spawn(system, world, n=1, tick=0, strict=True)
        with pytest.raises(SyncFailed, match="not a weight here"):
            await CheckpointEngine(refs, config()).sync(0, {"b": torch.zeros(2)})
        result = await CheckpointEngine(refs, config()).sync(
            0, {"norm.weight": torch.ones(8).half()}
        )
        assert result.resumed[0].pending == 0


async def test_a_load_refused_after_the_commit_is_reported_and_keeps_old_weights(
    autojump_clock: Any,
) -> None:
    world = World()
    async with afa.open_actor_system() as system:
        refs = await spawn(system, world, load="eager")
        engine = CheckpointEngine(refs, config())
        await engine.sync(0, weights_of(0))
        bad = {**weights_of(1), "unknown": torch.zeros(3)}
        with pytest.raises(SyncFailed) as info:
            await engine.sync(1, bad)
        assert info.value.phase == "resume" and info.value.committed
        assert "cannot load 'unknown'" in str(info.value.__cause__)
        await settle()
        check_engines(world, 0)


async def test_bad_weights_fail_before_anything_is_paused(autojump_clock: Any) -> None:
    world = World()
    async with afa.open_actor_system() as system:
        refs = await spawn(system, world)
        engine = CheckpointEngine(refs, config())
        with pytest.raises(ManifestError, match="given twice"):
            await engine.sync(0, [("a", torch.zeros(1)), ("a", torch.zeros(1))])
        with pytest.raises(ManifestError, match="no tensor to sync"):
            await CheckpointEngine(refs, config(lora_only=True)).sync(0, {"x": torch.zeros(1)})
        with pytest.raises(ManifestError, match="version"):
            await engine.sync(-1, weights_of(0))
        with pytest.raises(ManifestError, match="safetensors cannot store"):
            file = CheckpointEngine(refs, config(transport="file", directory="/nonexistent"))
            await file.sync(0, {"c": torch.zeros(2, dtype=torch.complex64)})
        assert all(not e.pauses for e in world.engines.values())


class Plain:
    """A minimal ``SyncTarget`` without a decode loop."""

    def __init__(self) -> None:
        self.version = -1
        self.weights: dict[str, torch.Tensor] = {}

    async def pause(self, mode: PauseMode) -> PauseAck:
        await trio.lowlevel.checkpoint()
        return PauseAck(mode, self.version)

    async def resume(self) -> None:
        await trio.lowlevel.checkpoint()

    async def load_weights(self, weights: Any, version: int) -> None:
        await trio.lowlevel.checkpoint()
        self.weights, self.version = dict(weights), version


class PlainActor(SyncTargetActor):
    def __init__(self, plain: Plain) -> None:
        self.plain = plain

    async def make_target(self, ctx: afa.ActorContext[Any]) -> Plain:
        await trio.lowlevel.checkpoint()
        return self.plain


async def test_sync_target_actor_hosts_a_plain_target() -> None:
    plain = Plain()
    async with afa.open_actor_system() as system:
        ref = await system.spawn(lambda: PlainActor(plain), name="plain")
        sent = random_weights(3)
        result = await CheckpointEngine([ref], config(offload=True)).sync(7, sent)
        assert result.resumed[0].version == 7  # SyncTargetActor loads eagerly
        assert all(same_bytes(plain.weights[k], v) for k, v in sent.items())


@pytest.mark.parametrize("inline_bytes", [0, 1 << 30])
async def test_copies_and_checksums_run_off_the_event_loop_unless_small(
    monkeypatch: Any, inline_bytes: int
) -> None:
    """With ``offload``, buckets of ``INLINE_BYTES`` or more are packed and digested in worker
    threads; smaller ones inline (a thread hop would cost more than the copy)."""
    from asyncflow_actors.checkpoint import _copies

    monkeypatch.setattr(_copies, "INLINE_BYTES", inline_bytes)
    threads: list[str] = []
    digest, pack = HostCache.digest, BucketSource.pack

    def digested(self: HostCache, index: int, data: torch.Tensor, owned: bool = False) -> int:
        threads.append(f"digest {threading.current_thread() is threading.main_thread()}")
        return digest(self, index, data, owned)

    def packed(self: BucketSource, index: int, out: torch.Tensor) -> int:
        threads.append(f"pack {threading.current_thread() is threading.main_thread()}")
        return pack(self, index, out)

    monkeypatch.setattr(HostCache, "digest", digested)
    monkeypatch.setattr(BucketSource, "pack", packed)
    async with afa.open_actor_system() as system:
        refs = await spawn(system, World(), n=1, tick=0, offload=True)
        await CheckpointEngine(refs, config(offload=True)).sync(0, random_weights(0))
    main = inline_bytes > 0
    assert set(threads) == {f"digest {main}", f"pack {main}"}


async def test_apply_pending_waits_for_a_load_another_task_started(autojump_clock: Any) -> None:
    """Two groups start at one boundary: the first takes the pending weights and loads them;
    the second must not start on the old weights meanwhile (it waits for that load)."""
    from asyncflow_actors.checkpoint import WeightReceiver
    from tests.checkpoint.doubles import EngineDouble

    class SlowLoad(EngineDouble):
        async def load_weights(self, weights: Any, version: int) -> None:
            await trio.sleep(1.0)
            await super().load_weights(weights, version)

    engine = SlowLoad()
    receiver = WeightReceiver(engine, load="lazy")
    # what a committed lazy sync leaves behind (the protocol tests above drive real syncs)
    receiver._pending, receiver._pending_version = weights_of(4), 4
    seen: dict[str, int] = {}

    async def group(name: str) -> None:
        await receiver.apply_pending()
        seen[name] = engine.version  # the weights this group would start on

    async with trio.open_nursery() as nursery:
        nursery.start_soon(group, "first")
        await trio.sleep(0.1)  # the first is loading
        nursery.start_soon(group, "second")
    assert seen == {"first": 4, "second": 4}


async def test_the_waiters_of_a_load_wake_together() -> None:
    """The tasks that wait for a load another task runs wake in one scheduling round (an
    event), not one a round through a lock: a rollout's groups then reach the engine together,
    and a static-batching engine decodes them in one wave."""
    from asyncflow_actors.checkpoint import WeightReceiver
    from tests.checkpoint.doubles import EngineDouble

    release = trio.Event()

    class HeldLoad(EngineDouble):
        async def load_weights(self, weights: Any, version: int) -> None:
            await release.wait()
            await super().load_weights(weights, version)

    engine = HeldLoad()
    receiver = WeightReceiver(engine, load="lazy")
    receiver._pending, receiver._pending_version = weights_of(4), 4
    back: list[str] = []

    async def group(name: str) -> None:
        await receiver.apply_pending()
        back.append(name)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(group, "loader")
        await trio.testing.wait_all_tasks_blocked()
        for k in range(8):
            nursery.start_soon(group, f"waiter-{k}")
        await trio.testing.wait_all_tasks_blocked()
        release.set()
        while "loader" not in back:
            await trio.lowlevel.checkpoint()
        for _ in range(3):  # the loader's round, then the waiters' (in either order)
            await trio.lowlevel.checkpoint()
        assert len(back) == 9, f"only {back} back three rounds after the load"
    assert engine.version == 4
