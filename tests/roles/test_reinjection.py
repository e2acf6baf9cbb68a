"""The Driver re-injects the prompt of every group the queue drops before it is trained: the run
keeps its FlowControl slots busy with groups that can still be trained, and none goes missing."""

from __future__ import annotations

from typing import Any

import trio

import asyncflow_actors as afa
from asyncflow_actors.roles import Driver, DriverHooks, topic_specs
from asyncflow_actors.roles import _schema as S
from asyncflow_actors.transfer_queue import TransferQueueConfig, open_transfer_queue
from asyncflow_actors.transfer_queue import _messages as M

from .test_batching import SPEC

PROMPTS = [S.PROMPT_TEXT, S.GROUP, S.PROMPT_INDEX, S.MIN_VERSION]


async def test_a_group_abandoned_by_a_dead_rollout_writer_is_injected_again() -> None:
    """A rollout worker killed between allocating its group's rows and committing them: its
    restarted successor's release drops the rows, and with them the whole group (the queue
    reports it ``abandoned``). The successor, taking the prompt again, finds the group gone and
    drops the prompt; the Driver must inject it again in a new group, or its slots stay taken
    for the rest of the run."""
    tq = TransferQueueConfig(topics=topic_specs(SPEC), units=1)
    async with afa.open_actor_system() as system, open_transfer_queue(system, tq) as queue:
        client = await queue.client("test")
        hooks = DriverHooks()
        await system.spawn(lambda: Driver(SPEC, queue.controller, hooks), name="driver")
        with trio.fail_after(30):
            # capacity (staleness + 1) x batch = 2 x 8 prompts
            first = await client.get(S.PROMPTS, "rollout", PROMPTS, 16, min_count=16)
            assert first is not None
            gid, index = int(first[S.GROUP][3]), int(first[S.PROMPT_INDEX][3])
            # the dead incarnation's put: allocated in the group, never committed
            allocate = M.Allocate(S.ROLLOUT, 4, 0, group=gid, put_id=1, holder="rollout-0")
            await queue.controller.ask(allocate)
            successor = await queue.client("rollout-0")
            await successor.aclose()
            again = await client.get(S.PROMPTS, "rollout", PROMPTS, 1)
    assert again is not None
    assert int(again[S.PROMPT_INDEX][0]) == index
    assert int(again[S.GROUP][0]) != gid, "a new group: the old one is gone"
    assert again[S.PROMPT_TEXT] == [first[S.PROMPT_TEXT][3]]
    assert hooks.reinjected == 1


async def test_a_group_of_a_writer_that_lives_on_is_not_injected_twice() -> None:
    """Only a dropped group's prompt comes back: a group written and committed stays."""
    tq = TransferQueueConfig(topics=topic_specs(SPEC), units=1)
    async with afa.open_actor_system() as system, open_transfer_queue(system, tq) as queue:
        client = await queue.client("test")
        hooks = DriverHooks()
        await system.spawn(lambda: Driver(SPEC, queue.controller, hooks), name="driver")
        with trio.fail_after(30):
            first = await client.get(S.PROMPTS, "rollout", PROMPTS, 16, min_count=16)
            assert first is not None
            writer = await queue.client("rollout-0")
            await writer.put(S.ROLLOUT, _group(), version=0, group=int(first[S.GROUP][0]))
            await writer.aclose()
            await trio.sleep(0.2)
            extra = await client.get(S.PROMPTS, "rollout", PROMPTS, 1, wait=False)
    assert extra is None
    assert hooks.reinjected == 0


def _group() -> dict[str, Any]:
    import torch

    return {
        S.RESPONSE_IDS: [torch.tensor([5, 6]) for _ in range(4)],
        S.BEHAVIOUR: [torch.tensor([-0.5, -0.5]) for _ in range(4)],
        S.TOKEN_VERSIONS: [torch.tensor([0, 0]) for _ in range(4)],
        S.REWARDS: torch.zeros(4),
        S.RESUMES: torch.zeros(4, dtype=torch.int64),
    }
