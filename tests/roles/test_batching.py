"""Stations batch what is ready: a queue round trip per group costs more than a tiny model's
compute, so a station that falls behind catches up in few large steps."""

from __future__ import annotations

import attrs
import torch
import trio
import trio.testing

import asyncflow_actors as afa
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
from asyncflow_actors.roles._settings import TrainSettings
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
                    S.ANSWER: [str(index + 1)],
                    S.GROUP: torch.tensor([slot.group_id]),
                    S.PROMPT_INDEX: torch.tensor([index]),
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
