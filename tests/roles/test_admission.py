"""Admission overlaps the weight sync: the Driver admits the next prompts as soon as a step is
done, tagged with the version they were admitted for, and the rollout starts no group on older
weights. And the groups a decode step completes together are scored in one thread call."""

from __future__ import annotations

from collections import Counter
from typing import Any

import outcome
import pytest
import torch
import trio
import trio.testing

import asyncflow_actors as afa
from asyncflow_actors.checkpoint import (
    CheckpointConfig,
    CheckpointEngine,
    PauseMode,
    SyncPause,
    SyncResume,
)
from asyncflow_actors.roles import Driver, DriverHooks, GetRoleStats, Rollout, topic_specs
from asyncflow_actors.roles import _schema as S
from asyncflow_actors.roles._batcher import _Batcher, _BatchFailed
from asyncflow_actors.roles._compute import build_policy
from asyncflow_actors.roles._group_writing import _put_outcome, _ToWrite
from asyncflow_actors.roles._messages import (
    NeedWeights,
    ResendWeights,
    StepDone,
    SyncReport,
    SyncWeights,
)
from asyncflow_actors.roles._weight_waits import NEED_WEIGHTS_AFTER_S
from asyncflow_actors.transfer_queue import TransferQueueConfig, open_transfer_queue

from ..transfer_queue.test_group_batches import Counting
from .test_batching import SPEC, put_prompts

PROMPTS = [S.PROMPT_TEXT, S.GROUP, S.MIN_VERSION]


async def sync_weights(ref: afa.ActorRef[Any], version: int) -> None:
    """Send the initial policy's weights to ``ref`` as ``version`` (lazy: pending until the
    rollout's next group boundary)."""
    model, _ = build_policy(SPEC.model, SPEC.task.build())
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    sync = CheckpointEngine((ref,), CheckpointConfig(pause_mode=PauseMode.KEEP))
    await sync.sync(version, weights)


async def test_a_group_starts_only_once_the_weights_reach_its_admitted_version() -> None:
    tq = TransferQueueConfig(topics=topic_specs(SPEC), units=1)
    async with afa.open_actor_system() as system, open_transfer_queue(system, tq) as queue:
        client = await queue.client("driver")
        with trio.fail_after(60):
            ref = await system.spawn(
                lambda: Rollout(SPEC, queue.controller, "rollout-0"), name="rollout-0"
            )
            await ref.ask(GetRoleStats())  # started: its engine serves (version 0)
            await put_prompts(client, [0], min_version=1)  # admitted while version 1 syncs
            await trio.testing.wait_all_tasks_blocked(0.05)
            stats = await ref.ask(GetRoleStats())
            assert stats.samples == 0, "generated on version 0 weights"
            # a sync that ends without a commit wakes the group: it goes on waiting
            await ref.ask(SyncPause("dropped", PauseMode.KEEP, 30.0))
            await ref.ask(SyncResume("dropped", commit=False, eager=False))
            await trio.testing.wait_all_tasks_blocked(0.05)
            assert (await ref.ask(GetRoleStats())).samples == 0
            await sync_weights(ref, 1)
            batch = await client.get(S.ROLLOUT, "trainer", [S.TOKEN_VERSIONS], 4)
            stats = await ref.ask(GetRoleStats())
    assert batch is not None and batch.versions == (1,) * 4
    assert all(set(v.tolist()) == {1} for v in batch[S.TOKEN_VERSIONS])
    assert stats.extra["weight_waits"] == 1


async def test_a_group_admitted_for_the_weights_held_does_not_wait() -> None:
    tq = TransferQueueConfig(topics=topic_specs(SPEC), units=1)
    async with afa.open_actor_system() as system, open_transfer_queue(system, tq) as queue:
        client = await queue.client("driver")
        with trio.fail_after(60):
            ref = await system.spawn(
                lambda: Rollout(SPEC, queue.controller, "rollout-0"), name="rollout-0"
            )
            await put_prompts(client, [0], min_version=0)
            batch = await client.get(S.ROLLOUT, "trainer", [S.TOKEN_VERSIONS], 4)
            stats = await ref.ask(GetRoleStats())
    assert batch is not None and batch.versions == (0,) * 4
    assert "weight_waits" not in stats.extra


async def test_a_run_stops_cleanly_while_groups_wait_for_weights() -> None:
    # The sync of version 5 never comes (a sync failed for good: the run stops): the waiting
    # group must not hold up the stop.
    tq = TransferQueueConfig(topics=topic_specs(SPEC), units=1)
    with trio.fail_after(60):
        async with afa.open_actor_system() as system, open_transfer_queue(system, tq) as queue:
            client = await queue.client("driver")
            ref = await system.spawn(
                lambda: Rollout(SPEC, queue.controller, "rollout-0"), name="rollout-0"
            )
            await put_prompts(client, [0, 1], min_version=5)
            await trio.testing.wait_all_tasks_blocked(0.05)
            assert (await ref.ask(GetRoleStats())).samples == 0


class GatedTrainer(afa.Actor[Any]):
    """A trainer that answers ``SyncWeights`` only once ``gate`` is set."""

    def __init__(self, gate: trio.Event, asked: list[int]) -> None:
        self.gate = gate
        self.asked = asked

    async def receive(self, msg: Any, ctx: afa.ActorContext[Any]) -> Any:
        assert isinstance(msg, SyncWeights)
        self.asked.append(msg.version)
        await self.gate.wait()
        return SyncReport(msg.version, {})


async def test_the_driver_admits_the_next_prompts_while_the_sync_runs() -> None:
    tq = TransferQueueConfig(topics=topic_specs(SPEC), units=1)
    gate, asked = trio.Event(), []
    async with afa.open_actor_system() as system, open_transfer_queue(system, tq) as queue:
        client = await queue.client("rollout-0")
        hooks = DriverHooks()
        hooks.trainer = await system.spawn(lambda: GatedTrainer(gate, asked), name="trainer")
        driver = await system.spawn(lambda: Driver(SPEC, queue.controller, hooks), name="driver")
        with trio.fail_after(30):
            # capacity (staleness + 1) x batch = 2 x 8 prompts, admitted for version 0
            first = await client.get(S.PROMPTS, "rollout", PROMPTS, 16, min_count=16)
            assert first is not None and first[S.MIN_VERSION].tolist() == [0] * 16
            groups = tuple(first[S.GROUP][:8].tolist())
            done = StepDone(1, SPEC.batch_size, 0, groups, (SPEC.batch_size,), {})
            async with trio.open_nursery() as nursery:
                nursery.start_soon(driver.ask, done)
                # the batch's slots admit 8 prompts for version 1 before the sync returned
                second = await client.get(S.PROMPTS, "rollout", PROMPTS, 8, min_count=8)
                assert asked == [1] and not gate.is_set()
                gate.set()
    assert second is not None and second[S.MIN_VERSION].tolist() == [1] * 8


async def test_groups_completing_together_are_scored_in_one_thread_call() -> None:
    tq = TransferQueueConfig(topics=topic_specs(SPEC), units=1)
    async with afa.open_actor_system() as system, open_transfer_queue(system, tq) as queue:
        client = await queue.client("driver")
        with trio.fail_after(60):
            ref = await system.spawn(
                lambda: Rollout(SPEC, queue.controller, "rollout-0"), name="rollout-0"
            )
            await ref.ask(GetRoleStats())
            await put_prompts(client, list(range(16)))
            batch = await client.get(S.ROLLOUT, "trainer", [S.REWARDS], 64)
            stats = await ref.ask(GetRoleStats())
    assert batch is not None and len(set(batch.group_ids)) == 16
    assert stats.extra["prompt_leases"] == 1
    # 16 groups decoded together end in a few decode steps: far fewer calls than groups
    assert 1 <= stats.extra["score_calls"] < 16


async def test_the_batcher_calls_once_for_what_is_submitted_together() -> None:
    calls: list[list[int]] = []
    running = trio.Event()
    release = trio.Event()

    async def double(items: list[int]) -> list[outcome.Outcome[int]]:
        calls.append(items)
        if len(calls) == 1:
            running.set()
            await release.wait()
        if -1 in items:
            raise ValueError("a bad batch")
        return [outcome.Error(KeyError(i)) if i == 13 else outcome.Value(2 * i) for i in items]

    batcher: _Batcher[int, int] = _Batcher(double)
    results: dict[int, Any] = {}

    async def submit(item: int) -> None:
        try:
            results[item] = await batcher.submit(item)
        except Exception as exc:
            results[item] = exc

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(batcher.serve)
            for item in (1, 2, 3):
                nursery.start_soon(submit, item)
            await running.wait()
            for item in (4, 13):  # while the first call runs: the next call
                nursery.start_soon(submit, item)
            await trio.testing.wait_all_tasks_blocked()
            release.set()
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(submit, -1)
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
    assert [sorted(c) for c in calls] == [[1, 2, 3], [4, 13], [-1]]
    assert {k: results[k] for k in (1, 2, 3, 4)} == {1: 2, 2: 4, 3: 6, 4: 8}
    assert isinstance(results[13], KeyError), "one item's error goes to its submitter only"
    assert isinstance(results[-1], _BatchFailed)
    assert isinstance(results[-1].__cause__, ValueError)


@pytest.mark.parametrize("settle", [0, 8])
async def test_the_batcher_waits_for_submitters_a_few_checkpoints_behind(settle: int) -> None:
    # the groups of one decode stretch reach the scorer a checkpoint or a few apart
    calls: list[list[int]] = []

    async def same(items: list[int]) -> list[outcome.Outcome[int]]:
        calls.append(sorted(items))
        await trio.lowlevel.checkpoint()
        return [outcome.Value(i) for i in items]

    batcher: _Batcher[int, int] = _Batcher(same, settle)

    async def late(item: int) -> None:
        for _ in range(item):
            await trio.lowlevel.checkpoint()
        assert await batcher.submit(item) == item

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(batcher.serve)
            for item in range(4):
                nursery.start_soon(late, item)
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
    assert sorted(i for call in calls for i in call) == [0, 1, 2, 3]
    assert (calls == [[0, 1, 2, 3]]) == (settle > 0)


async def test_an_overlapping_batcher_does_not_wait_for_a_slow_call() -> None:
    # the writer: a put held up (a storage unit restarting) holds up no other group's put
    release = trio.Event()
    calls: list[list[int]] = []

    async def put(items: list[int]) -> list[outcome.Outcome[int]]:
        calls.append(sorted(items))
        if 0 in items:
            await release.wait()
        return [outcome.Value(i) for i in items]

    batcher: _Batcher[int, int] = _Batcher(put, overlap=True)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(batcher.serve)
            nursery.start_soon(batcher.submit, 0)
            await trio.testing.wait_all_tasks_blocked()
            assert await batcher.submit(1) == 1
            assert not release.is_set() and calls == [[0], [1]]
            release.set()
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()


def group_rows(seed: int, n: int = 4) -> dict[str, Any]:
    """A scored group's rows, as the rollout writes them (each row tagged with ``seed``)."""
    return {
        S.RESPONSE_IDS: [torch.tensor([seed, k, 2]) for k in range(n)],
        S.BEHAVIOUR: [torch.full((3,), -0.5) for _ in range(n)],
        S.TOKEN_VERSIONS: [torch.zeros(3, dtype=torch.int64) for _ in range(n)],
        S.REWARDS: torch.full((n,), float(seed)),
        S.RESUMES: torch.zeros(n, dtype=torch.int64),
    }


async def test_groups_of_one_version_are_written_in_one_put_each_to_its_group() -> None:
    tq = TransferQueueConfig(topics=topic_specs(SPEC), units=2)
    async with afa.open_actor_system() as system, open_transfer_queue(system, tq) as queue:
        client = await queue.client("rollout-0")
        counts: Counter[str] = Counter()
        rollout = Rollout(SPEC, queue.controller, "rollout-0")
        rollout.client = client
        with trio.fail_after(60):
            slots = await client.open_groups(
                S.ROLLOUT, [4] * 5, [{S.PROMPT_IDS: torch.tensor([1])}] * 5
            )
            await client.set_version(S.ROLLOUT, 1)
            client.controller = Counting(client.controller, counts)
            todo = [
                _ToWrite(s.group_id, group_rows(k), 1 if k < 4 else 0) for k, s in enumerate(slots)
            ]
            results = await rollout._write_many(todo)
            assert counts["Allocate"] == 2, "versions 1 (four groups) and 0: one put each"
            batch = await client.get(S.ROLLOUT, "trainer", [S.REWARDS, S.RESPONSE_IDS], 20)
    assert batch is not None
    written = [r.unwrap() for r in results]
    assert [len(w) for w in written] == [4] * 5
    for k, (slot, indexes) in enumerate(zip(slots, written, strict=True)):
        for index in indexes:  # each row landed in its own group with its own data
            row = batch.indexes.index(index)
            assert batch.group_ids[row] == slot.group_id
            assert float(batch[S.REWARDS][row]) == k
            assert int(batch[S.RESPONSE_IDS][row][0]) == k


async def test_a_group_refused_in_a_multi_group_put_fails_alone() -> None:
    tq = TransferQueueConfig(topics=topic_specs(SPEC), units=1)
    async with afa.open_actor_system() as system, open_transfer_queue(system, tq) as queue:
        client = await queue.client("rollout-0")
        rollout = Rollout(SPEC, queue.controller, "rollout-0")
        rollout.client = client
        with trio.fail_after(60):
            slots = await client.open_groups(
                S.ROLLOUT, [4] * 3, [{S.PROMPT_IDS: torch.tensor([1])}] * 3
            )
            await client.shrink_group(S.ROLLOUT, slots[1], 4)  # evicted meanwhile: gone
            todo = [_ToWrite(s.group_id, group_rows(k), 0) for k, s in enumerate(slots)]
            results = await rollout._write_many(todo)
            batch = await client.get(S.ROLLOUT, "trainer", [S.REWARDS], 12, min_count=8)
    assert len(results[0].unwrap()) == 4 and len(results[2].unwrap()) == 4
    with pytest.raises(Exception) as refused:
        results[1].unwrap()
    assert _put_outcome(refused.value) == "gone"
    assert batch is not None and sorted(set(batch.group_ids)) == [
        slots[0].group_id,
        slots[2].group_id,
    ]


class Recorder(afa.Actor[Any]):
    """Records what it is sent; answers a ``ResendWeights`` as a trainer would."""

    def __init__(self) -> None:
        self.got: list[Any] = []
        self._arrived = trio.Event()

    async def receive(self, msg: Any, ctx: afa.ActorContext[Any]) -> Any:
        self.got.append(msg)
        self._arrived.set()
        self._arrived = trio.Event()
        if isinstance(msg, ResendWeights):
            return SyncReport(0, {})
        return None

    async def received(self, count: int) -> None:
        """Until ``count`` messages came."""
        while len(self.got) < count:
            await self._arrived.wait()


async def spawn_rollout(system: afa.ActorSystem, queue: Any) -> tuple[Recorder, afa.ActorRef[Any]]:
    """A Rollout worker (``rollout-0``) whose Driver is a ``Recorder``."""
    driver = Recorder()
    driver_ref = await system.spawn(lambda: driver, name="driver")
    ref = await system.spawn(
        lambda: Rollout(SPEC, queue.controller, "rollout-0", driver=driver_ref), name="rollout-0"
    )
    return driver, ref


async def test_a_restarted_rollout_waiting_for_weights_asks_the_driver_once() -> None:
    tq = TransferQueueConfig(topics=topic_specs(SPEC), units=1)
    async with afa.open_actor_system() as system, open_transfer_queue(system, tq) as queue:
        client = await queue.client("driver")
        with trio.fail_after(60):
            driver, ref = await spawn_rollout(system, queue)
            await ref.ask(GetRoleStats())
            # a fresh incarnation on version 0, prompts admitted for version 2 and no sync
            # coming: after NEED_WEIGHTS_AFTER_S it asks, once for both groups
            await put_prompts(client, [0, 1], min_version=2)
            await driver.received(1)
            await trio.sleep(NEED_WEIGHTS_AFTER_S + 0.2)
            assert driver.got == [NeedWeights("rollout-0")]
            assert (await ref.ask(GetRoleStats())).samples == 0
            await sync_weights(ref, 2)  # the Trainer's answer
            batch = await client.get(S.ROLLOUT, "trainer", [S.TOKEN_VERSIONS], 8)
            # with weights received, a wait for the next version asks nothing
            await put_prompts(client, [2], min_version=3)
            await trio.sleep(NEED_WEIGHTS_AFTER_S + 0.2)
    assert batch is not None and batch.versions == (2,) * 8
    assert driver.got == [NeedWeights("rollout-0")]


async def test_the_driver_has_the_trainer_resend_the_weights_a_worker_needs() -> None:
    tq = TransferQueueConfig(topics=topic_specs(SPEC), units=1)
    async with afa.open_actor_system() as system, open_transfer_queue(system, tq) as queue:
        trainer = Recorder()
        with trio.fail_after(60):
            hooks = DriverHooks(trainer=await system.spawn(lambda: trainer, name="trainer"))
            driver = await system.spawn(
                lambda: Driver(SPEC, queue.controller, hooks), name="driver"
            )
            await driver.send(NeedWeights("rollout-0"))
            while not trainer.got:
                await trio.sleep(0.01)
    assert trainer.got == [ResendWeights()]
