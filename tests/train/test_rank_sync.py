"""Weight sync from every rank (``_rank_send``): each rank sends the buckets of its own shards
straight to the receivers, and the engine's two-phase commit holds across the ranks.

The layout is checked without processes (every byte has one sender; packed by each sender
from its part alone, the buckets rebuild the tensors bit for bit). With processes: 2 and 4
ranks sync bit-exact into a receiver in rank 0's process and one on a node process; a rank
that fails in the middle of its buckets, or dies there, fails the sync and every receiver
keeps its old weights (never a mix), and a failed rank leaves the group in step."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import asyncflow_actors as afa
from asyncflow_actors.checkpoint import (
    CheckpointConfig,
    HostCache,
    PhaseDeadlines,
    SyncFailed,
)
from asyncflow_actors.checkpoint._buckets import BucketSource
from asyncflow_actors.roles._distributed import DistributedLearner
from asyncflow_actors.roles._rank_send import (
    RankTransport,
    ShardSendFailed,
    local_parts,
    plan_shards,
    rank_bucket_bytes,
    rows_of,
)
from asyncflow_actors.roles._rank_settings import ParallelSettings
from asyncflow_actors.roles._rank_sync import ShardedSyncEngine
from asyncflow_actors.roles._ranks import RankFailed
from tests.checkpoint.doubles import DoubleActor, GetWeights, World, weights_of

from .conftest import global_batch, run_spec

FAST = PhaseDeadlines(pause=30, prepare=30, topology=30, broadcast=30, finalize=30, resume=30)
NODE = afa.NodeOptions(heartbeat_interval=0.2, heartbeat_timeout=20.0, shutdown_grace=2.0)


def test_rows_follow_torch_chunk() -> None:
    for rows in (0, 1, 5, 8, 9):
        for world in (1, 2, 3, 4):
            chunks = torch.arange(rows).chunk(world) if rows else ()
            got = [rows_of(rows, world, r) for r in range(world)]
            want = [(int(c[0]), int(c[-1]) + 1) for c in chunks if c.numel()]
            assert [g for g in got if g[1] > g[0]] == want
            assert sum(e - s for s, e in got) == rows


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_each_rank_packs_its_rows_and_the_buckets_rebuild_every_tensor(world: int) -> None:
    """Replicated tensors are cut by the rows rule; small buckets split the large ones."""
    g = torch.Generator().manual_seed(world)
    params = {
        "embed": torch.randn(13, 8, generator=g),
        "scale": torch.tensor(3.5, dtype=torch.float64),
        "bias": torch.randint(0, 9, (5,), generator=g),
        "head": torch.randn(40, 16, generator=g).to(torch.bfloat16),
        "empty": torch.zeros(0, 4),
    }
    named = [(f"sent.{n}", n, p) for n, p in params.items()]
    plan = plan_shards(named, world, 256)
    assert plan is not None
    manifest = plan.manifest
    assert set(plan.senders) == set(range(world))  # every rank holds rows of "embed"
    cache = HostCache(manifest, copy=True, algorithm="xxh3")
    checksums = [0] * len(manifest.buckets)
    for rank in range(world):
        tensors, offsets = local_parts(params, plan, rank)
        source = BucketSource(tensors, manifest, algorithm="xxh3", offsets=offsets)
        for bucket in plan.buckets_of(rank):
            out = torch.empty(bucket.nbytes, dtype=torch.uint8)
            checksums[bucket.index] = source.pack(bucket.index, out)
            cache.stage_bucket(bucket.index, out)
    cache.verify(checksums)
    got = cache.tensors()
    for name, param in params.items():
        assert torch.equal(got[f"sent.{name}"], param), name


def test_each_rank_sends_its_share_in_two_buckets_at_least() -> None:
    """So that a rank packs its second bucket while its first is on its way."""
    mib = 1 << 20
    assert rank_bucket_bytes(101 * mib, 1, 64 * mib) == 64 * mib  # one rank: as configured
    assert rank_bucket_bytes(101 * mib, 2, 64 * mib) == -(-101 * mib // 4)
    assert rank_bucket_bytes(101 * mib, 4, 16 * mib) == -(-101 * mib // 8)
    assert rank_bucket_bytes(101 * mib, 2, 8 * mib) == 8 * mib  # never above the setting
    assert rank_bucket_bytes(3 * mib, 4, 64 * mib) == mib  # nor below 1 MiB
    assert rank_bucket_bytes(3 * mib, 4, 256) == 256
    weight = torch.zeros(1 << 20)  # 4 MiB: each of 2 ranks sends 2 MiB, in 2 buckets
    plan = plan_shards([("w", "w", weight)], 2, 64 * mib)
    assert plan is not None and plan.senders == (0, 0, 1, 1)


def test_a_shard_that_is_not_the_planned_rows_is_refused() -> None:
    plan = plan_shards([("w", "w", torch.zeros(4, 2))], 2, 64)
    assert plan is not None
    source = BucketSource([torch.zeros(1, 2)], plan.manifest, algorithm="", offsets=[0])
    with pytest.raises(Exception, match="not held here"):
        source.pack(0, torch.empty(plan.manifest.buckets[0].nbytes, dtype=torch.uint8))


# -- with processes ------------------------------------------------------------------------------


def specs_of(state: dict[str, torch.Tensor]) -> dict[str, tuple[str, list[int]]]:
    return {k: (str(v.dtype).removeprefix("torch."), list(v.shape)) for k, v in state.items()}


def double(specs: dict[str, Any], i: int, world: World | None = None) -> DoubleActor:
    return DoubleActor(index=i, world=world or World(), specs=specs, tick=0, load="eager",
                       offload=True)  # fmt: skip


async def sync_into(
    learner: DistributedLearner, version: int, *, on_node: bool = True, **config: Any
) -> tuple[Any, list[dict[str, torch.Tensor]], ShardedSyncEngine]:
    """Sync ``learner`` into a receiver here (and one on a node process); what each holds."""
    full = await afa_thread(learner.full_state_dict)
    specs = specs_of(full)
    async with afa.open_actor_system() as system:
        refs = [await system.spawn(lambda: double(specs, 0), name="here")]
        if on_node:
            node = await system.start_node("rx", allow=["tests.checkpoint"], options=NODE)
            kwargs = {"index": 1, "specs": specs, "tick": 0, "load": "eager"}
            refs.append(
                await node.spawn("tests.checkpoint.doubles:DoubleActor", name="rx", kwargs=kwargs)
            )
        cfg = CheckpointConfig(deadlines=FAST, bucket_bytes=config.pop("bucket_bytes", 4096),
                               **config)  # fmt: skip
        engine = ShardedSyncEngine(learner, refs, cfg)
        try:
            result: Any = await engine.sync(version)
        except SyncFailed as exc:
            result = exc
        held = [await ref.ask(GetWeights()) for ref in refs]
    return result, held, engine


async def afa_thread(fn: Any) -> Any:
    import trio

    return await trio.to_thread.run_sync(fn)


def test_four_ranks_sync_bit_exact() -> None:
    import trio

    with DistributedLearner.open(run_spec(), ParallelSettings(ranks=4)) as four:
        full = four.full_state_dict()
        result, held, engine = trio.run(lambda: sync_into(four, 5, on_node=False))
        assert not isinstance(result, Exception), result
        assert engine._shards is not None and engine._shards[1] is not None
        assert set(engine._shards[1].senders) == {0, 1, 2, 3}
        assert all(torch.equal(held[0][k], v) for k, v in full.items())


def test_a_rank_failing_mid_send_leaves_every_receiver_on_its_old_weights() -> None:
    """Rank 1 raises after its first bucket: the sync fails naming it, no receiver switches
    (each still holds what it started with: not a mix), and the group steps on."""
    import trio

    env = {"AFA_RANK_FAIL_IN_SYNC": "1"}
    with DistributedLearner.open(run_spec(), ParallelSettings(ranks=2), env=env) as learner:
        result, held, _ = trio.run(lambda: sync_into(learner, 1))
        assert isinstance(result, SyncFailed) and result.phase == "broadcast"
        assert isinstance(result.__cause__, ShardSendFailed) and result.__cause__.rank == 1
        old = weights_of(-1, specs_of(learner.full_state_dict()))
        for got in held:
            assert all(torch.equal(got[k], old[k]) for k in old)
        assert learner.step(global_batch())["normaliser"] > 0


def test_a_rank_killed_mid_send_fails_the_sync_and_the_receivers_keep_theirs() -> None:
    import trio

    timeout = 30.0
    env = {"AFA_RANK_KILL_IN_SYNC": "1"}
    parallel = ParallelSettings(ranks=2, timeout_s=timeout)
    with DistributedLearner.open(run_spec(), parallel, env=env) as learner:
        specs = specs_of(learner.full_state_dict())
        started = time.monotonic()
        result, held, _ = trio.run(lambda: sync_into(learner, 1, on_node=False))
        assert time.monotonic() - started < timeout
        assert isinstance(result, SyncFailed)
        assert isinstance(result.__cause__, RankFailed) and result.__cause__.rank == 1
        old = weights_of(-1, specs)
        assert all(torch.equal(held[0][k], old[k]) for k in old)
        with pytest.raises(RankFailed, match="closed"):
            learner.step(global_batch())


# -- one group for the rest (a process holds one group at a time: the groups above first)


@pytest.fixture(scope="module")
def two() -> Iterator[DistributedLearner]:
    with DistributedLearner.open(run_spec(), ParallelSettings(ranks=2)) as learner:
        yield learner


async def test_two_ranks_each_send_their_buckets_bit_exact(two: DistributedLearner) -> None:
    two.step(global_batch())
    full = two.full_state_dict()
    result, held, engine = await sync_into(two, 2)
    assert not isinstance(result, Exception), result
    assert isinstance(engine.transport, RankTransport)
    shards = engine._shards
    assert shards is not None and shards[1] is not None
    senders = shards[1].senders
    assert set(senders) == {0, 1} and result.buckets == len(senders) > 4
    for got in held:
        assert set(got) == set(full)
        for name, value in full.items():
            assert torch.equal(got[name], value), name
    assert two.step(global_batch(seed=2))["normaliser"] > 0  # the group is in step


async def test_ddp_replicas_are_cut_by_rows_and_sent_by_both(two: DistributedLearner) -> None:
    two.setup(run_spec(), ParallelSettings(ranks=2, sharding="ddp"))
    full = two.full_state_dict()
    result, held, engine = await sync_into(two, 1, on_node=False)
    assert not isinstance(result, Exception), result
    assert engine._shards is not None and engine._shards[1] is not None
    assert set(engine._shards[1].senders) == {0, 1}
    assert all(torch.equal(held[0][k], v) for k, v in full.items())
    two.setup(run_spec(), ParallelSettings(ranks=2))
