"""Stations batch what is ready: a queue round trip per group costs more than a tiny model's
compute, so a station that falls behind catches up in few large steps."""

from __future__ import annotations

import threading
from typing import Any

import attrs
import pytest
import torch
import trio
import trio.testing

import asyncflow_actors as afa
from asyncflow_actors.checkpoint import CheckpointConfig, CheckpointEngine, PauseMode
from asyncflow_actors.roles import (
    ActorForward,
    Driver,
    DriverHooks,
    GetRoleStats,
    Rollout,
    RunSpec,
    topic_specs,
)
from asyncflow_actors.roles import _schema as S
from asyncflow_actors.roles._compute import build_policy
from asyncflow_actors.roles._settings import DEFAULT_ENGINE_ROWS, RolloutSettings, TrainSettings
from asyncflow_actors.rollout._torch_engine import _TinyBackend
from asyncflow_actors.transfer_queue import TransferQueueConfig, open_transfer_queue

from .test_station import SPEC as STATION_SPEC
from .test_station import put_groups

SPEC = attrs.evolve(STATION_SPEC, train=TrainSettings(prompts_per_step=8))


def test_a_streaming_station_takes_up_to_a_batch_of_whole_groups() -> None:
    assert SPEC.fetch_size == 32, "default: up to one global batch"
    capped = attrs.evolve(SPEC, train=TrainSettings(prompts_per_step=8, forward_batch=10))
    assert capped.fetch_size == 8, "forward_batch caps it, in whole groups"
    barrier = attrs.evolve(SPEC, stage_barrier=True, train=TrainSettings(forward_batch=4))
    assert barrier.fetch_size == barrier.batch_size


async def old_logprob_steps(spec: RunSpec, groups: int) -> int:
    """Put ``groups`` groups, then start an ActorForward; its steps once all have log-probs."""
    tq = TransferQueueConfig(topics=topic_specs(spec), units=1)
    async with afa.open_actor_system() as system, open_transfer_queue(system, tq) as queue:
        client = await queue.client("test")
        with trio.fail_after(60):
            await put_groups(client, groups)
            ref = await system.spawn(
                lambda: ActorForward(spec, queue.controller, "fwd-0"), name="fwd-0"
            )
            await client.get(S.ROLLOUT, "trainer", [S.OLD], 4 * groups)
        steps: int = (await ref.ask(GetRoleStats())).steps
        return steps


async def test_actor_forward_takes_every_ready_group_in_one_step() -> None:
    assert await old_logprob_steps(SPEC, 6) == 1
    capped = attrs.evolve(SPEC, train=TrainSettings(prompts_per_step=8, forward_batch=8))
    assert await old_logprob_steps(capped, 6) == 3


async def test_rollout_takes_every_ready_prompt_in_one_lease() -> None:
    tq = TransferQueueConfig(topics=topic_specs(SPEC), units=1)
    async with afa.open_actor_system() as system, open_transfer_queue(system, tq) as queue:
        client = await queue.client("driver")
        with trio.fail_after(60):
            for index in range(3):
                slot = await client.open_group(
                    S.ROLLOUT, 4, shared={S.PROMPT_IDS: torch.tensor([1])}
                )
                prompt = {
                    S.PROMPT_TEXT: [f"{index}+1="],
                    S.PROMPT_IDS: [torch.tensor([1])],
                    S.ANSWER: [str(index + 1)],
                    S.GROUP: torch.tensor([slot.group_id]),
                    S.PROMPT_INDEX: torch.tensor([index]),
                    S.MIN_VERSION: torch.tensor([0]),
                    S.RECORD: ["{}"],
                }
                await client.put(S.PROMPTS, prompt, version=0)
            ref = await system.spawn(
                lambda: Rollout(SPEC, queue.controller, "rollout-0"), name="rollout-0"
            )
            batch = await client.get(S.ROLLOUT, "trainer", [S.RESPONSE_IDS, S.REWARDS], 12)
            assert batch is not None and len(set(batch.group_ids)) == 3
            stats = await ref.ask(GetRoleStats())
            assert stats.samples == 12
            assert stats.extra["prompt_leases"] == 1, "three prompts ready: one lease"
            while True:  # the lease is acked right after the last group's put
                view = await client.statistics()
                (prompts,) = [t for t in view.controller.state.topics if t.topic == S.PROMPTS]
                if prompts.freed_total == 3:
                    break
                await trio.sleep(0.01)
    (rollout,) = prompts.consumers
    assert rollout.leased == 0 and prompts.live == 0, "every prompt acked once written"


def test_an_engine_has_rows_for_every_admitted_sample_by_default() -> None:
    big = attrs.evolve(SPEC, train=TrainSettings(prompts_per_step=32))
    assert big.engine_rows == 256, "staleness 1: two batches of 32 x 4 admitted, all decode"
    sync = attrs.evolve(big, mode="sync", staleness=0)
    assert sync.engine_rows == 128, "staleness 0: one batch admitted"
    split = attrs.evolve(big, rollout=RolloutSettings(group_size=4, workers=2, engines=2))
    assert split.engine_rows == 64, "four engines share what is admitted"
    huge = attrs.evolve(SPEC, train=TrainSettings(prompts_per_step=1000))
    assert huge.engine_rows == DEFAULT_ENGINE_ROWS
    tiny = attrs.evolve(SPEC, rollout=RolloutSettings(group_size=4, engines=64))
    assert tiny.engine_rows == 4, "at least a group"
    colocated = attrs.evolve(big, colocated=True, rollout=RolloutSettings(group_size=4, engines=4))
    assert colocated.engine_rows == 256, "colocated: one engine whatever engines says"
    fixed = attrs.evolve(big, rollout=RolloutSettings(group_size=4, max_batch=24))
    assert fixed.engine_rows == 24


async def test_rollout_generates_a_global_batch_of_groups_at_once_by_default() -> None:
    # 32 prompts of 4 samples ready: one lease takes them all and they generate together (with
    # 64 rows, the default before it followed what is admitted, the rollout had room for 16:
    # two leases).
    spec = attrs.evolve(SPEC, train=TrainSettings(prompts_per_step=32))
    tq = TransferQueueConfig(topics=topic_specs(spec), units=1)
    async with afa.open_actor_system() as system, open_transfer_queue(system, tq) as queue:
        client = await queue.client("driver")
        with trio.fail_after(60):
            await put_prompts(client, list(range(32)))
            ref = await system.spawn(
                lambda: Rollout(spec, queue.controller, "rollout-0"), name="rollout-0"
            )
            batch = await client.get(S.ROLLOUT, "trainer", [S.RESPONSE_IDS], 128)
            stats = await ref.ask(GetRoleStats())
    assert batch is not None and len(set(batch.group_ids)) == 32
    assert stats.extra["prompt_leases"] == 1, "32 prompts ready: one lease"


async def test_prompts_for_slots_freed_while_a_fetch_waited_start_with_the_fetched_ones() -> None:
    # 16 slots (2 x 8 prompts admitted, 64 rows). Prompt 0 alone: the rollout takes it and
    # waits for more with room for the 15 other slots; prompt 0's slot frees meanwhile. Then
    # 16 prompts come: the waiting fetch takes 15 and the 16th is taken at once for the freed
    # slot (a lease of its own), and all 16 groups start together: one prefill and the decode
    # steps (a static-batching engine would otherwise decode the 16th in a wave of its own).
    tq = TransferQueueConfig(topics=topic_specs(SPEC), units=1)
    async with afa.open_actor_system() as system, open_transfer_queue(system, tq) as queue:
        client = await queue.client("driver")
        with trio.fail_after(60):
            ref = await system.spawn(
                lambda: Rollout(SPEC, queue.controller, "rollout-0"), name="rollout-0"
            )
            await put_prompts(client, [0])
            first = await client.get(S.ROLLOUT, "trainer", [S.RESPONSE_IDS], 4)
            await trio.testing.wait_all_tasks_blocked(0.05)  # its slot free, a fetch waiting
            await put_prompts(client, list(range(1, 17)))
            rest = await client.get(S.ROLLOUT, "trainer", [S.RESPONSE_IDS], 64)
            stats = await ref.ask(GetRoleStats())
    assert first is not None and rest is not None and len(set(rest.group_ids)) == 16
    assert stats.extra["prompt_leases"] == 3, "prompt 0; then 15 and the top-up of 1"
    max_new = SPEC.rollout.max_new_tokens
    assert stats.extra["engine_steps"] == 2 * max_new, "prompt 0's steps, then one wave's"


async def test_the_rollout_generates_from_the_prompt_ids_the_driver_put(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The Driver tokenizes each prompt once (the group stores the ids, the prompt carries
    # them); the rollout does not tokenize it again.
    from asyncflow_actors.models import CharTokenizer

    encoded: list[str] = []
    encode = CharTokenizer.encode

    def counted(self: CharTokenizer, text: str, *args: Any, **kwargs: Any) -> list[int]:
        encoded.append(text)
        return encode(self, text, *args, **kwargs)

    monkeypatch.setattr(CharTokenizer, "encode", counted)
    tq = TransferQueueConfig(topics=topic_specs(SPEC), units=1)
    async with afa.open_actor_system() as system, open_transfer_queue(system, tq) as queue:
        client = await queue.client("driver")
        with trio.fail_after(60):
            await system.spawn(lambda: Rollout(SPEC, queue.controller, "rollout-0"), name="r")
            await put_prompts(client, [0, 1])
            batch = await client.get(S.ROLLOUT, "trainer", [S.RESPONSE_IDS], 8)
    assert batch is not None and len(set(batch.group_ids)) == 2
    assert encoded == [], "the rollout re-tokenized a prompt"


async def put_prompts(
    client: afa.transfer_queue.TransferQueueClient, indexes: list[int], min_version: int = 0
) -> None:
    """The prompts ``indexes`` in one put, each naming a group it opens (as the Driver does),
    admitted for ``min_version``."""
    groups = []
    for _ in indexes:
        slot = await client.open_group(S.ROLLOUT, 4, shared={S.PROMPT_IDS: torch.tensor([1])})
        groups.append(slot.group_id)
    prompts = {
        S.PROMPT_TEXT: [f"{index}+1=" for index in indexes],
        S.PROMPT_IDS: [torch.tensor([1]) for _ in indexes],
        S.ANSWER: [str(index + 1) for index in indexes],
        S.GROUP: torch.tensor(groups),
        S.PROMPT_INDEX: torch.tensor(indexes),
        S.MIN_VERSION: torch.full((len(indexes),), min_version, dtype=torch.int64),
        S.RECORD: ["{}"] * len(indexes),
    }
    await client.put(S.PROMPTS, prompts, version=0)


async def test_a_group_started_while_new_weights_load_waits_for_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Group A takes the pending weights at its boundary and loads them (held up here in the
    # engine's preparation); group B, starting meanwhile, finds nothing pending. It must wait
    # for A's load, not start on the old weights: its group would be a version older than the
    # Driver admitted it for, and evicted as stale before it is trained.
    gate = threading.Event()
    prepare = _TinyBackend.prepare

    def held_prepare(self: _TinyBackend, weights: Any) -> Any:
        gate.wait(30)
        return prepare(self, weights)

    monkeypatch.setattr(_TinyBackend, "prepare", held_prepare)
    tq = TransferQueueConfig(topics=topic_specs(SPEC), units=1)
    async with afa.open_actor_system() as system, open_transfer_queue(system, tq) as queue:
        client = await queue.client("driver")
        with trio.fail_after(60):
            ref = await system.spawn(
                lambda: Rollout(SPEC, queue.controller, "rollout-0"), name="rollout-0"
            )
            await ref.ask(GetRoleStats())  # started: its engine serves
            model, _ = build_policy(SPEC.model, SPEC.task.build())
            weights = {k: v.detach() for k, v in model.state_dict().items()}
            sync = CheckpointEngine((ref,), CheckpointConfig(pause_mode=PauseMode.KEEP))
            await sync.sync(1, weights)  # lazy: pending until the next group boundary
            await put_prompts(client, [0])
            await trio.testing.wait_all_tasks_blocked(0.05)  # A loads, held in prepare
            await put_prompts(client, [1])
            await trio.testing.wait_all_tasks_blocked(0.05)  # B as far as it goes
            gate.set()
            batch = await client.get(S.ROLLOUT, "trainer", [S.TOKEN_VERSIONS], 8)
    assert batch is not None and len(set(batch.group_ids)) == 2
    assert batch.versions == (1,) * 8
    assert all(set(v.tolist()) == {1} for v in batch[S.TOKEN_VERSIONS])


async def test_the_driver_puts_the_prompts_admitted_together_in_one_put() -> None:
    tq = TransferQueueConfig(topics=topic_specs(SPEC), units=1)
    async with afa.open_actor_system() as system, open_transfer_queue(system, tq) as queue:
        client = await queue.client("rollout-0")
        columns = [S.PROMPT_TEXT, S.GROUP]
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                got: list[int] = []

                async def first_claim() -> None:
                    # waiting before the Driver starts: satisfied by its first put
                    batch = await client.get(S.PROMPTS, "rollout", columns, 64, min_count=1)
                    assert batch is not None
                    got.append(len(batch))

                nursery.start_soon(first_claim)
                await trio.testing.wait_all_tasks_blocked()
                driver = Driver(SPEC, queue.controller, DriverHooks())
                await system.spawn(lambda: driver, name="driver")
        # capacity (staleness + 1) x batch = 2 x 8 prompts, all free at the start
        assert got == [16]
