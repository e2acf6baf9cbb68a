"""The Driver re-injects the prompt of every group the queue drops before it is trained, once:
the run keeps its FlowControl slots busy with groups that can still be trained, and no prompt
goes missing."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import torch
import trio
import trio.testing

import asyncflow_actors as afa
from asyncflow_actors.roles import Driver, DriverHooks, topic_specs
from asyncflow_actors.roles import _schema as S
from asyncflow_actors.roles._messages import GroupGone
from asyncflow_actors.transfer_queue import TransferQueueConfig, open_transfer_queue
from asyncflow_actors.transfer_queue import _messages as M

from .test_admission import spawn_rollout
from .test_batching import SPEC

PROMPTS = [S.PROMPT_TEXT, S.GROUP, S.PROMPT_INDEX, S.MIN_VERSION]


@attrs.frozen
class Admitted:
    queue: Any
    client: Any
    hooks: DriverHooks
    driver: afa.ActorRef[Any]
    first: Any  # the prompts the Driver admitted, leased by ``client``


@asynccontextmanager
async def admitted() -> AsyncIterator[Admitted]:
    """A Driver that admitted its first prompts (capacity (staleness + 1) x batch = 2 x 8),
    all leased by the test's client."""
    tq = TransferQueueConfig(topics=topic_specs(SPEC), units=1)
    async with afa.open_actor_system() as system, open_transfer_queue(system, tq) as queue:
        client = await queue.client("test")
        hooks = DriverHooks()
        driver = await system.spawn(lambda: Driver(SPEC, queue.controller, hooks), name="driver")
        with trio.fail_after(30):
            first = await client.get(S.PROMPTS, "rollout", PROMPTS, 16, min_count=16)
            assert first is not None
            yield Admitted(queue, client, hooks, driver, first)


async def test_a_group_abandoned_by_a_dead_rollout_writer_is_injected_again() -> None:
    """A rollout worker killed between allocating its group's rows and committing them: its
    restarted successor's release drops the rows, and with them the whole group (the queue
    reports it ``abandoned``). The successor, taking the prompt again, finds the group gone and
    drops the prompt; the Driver must inject it again in a new group, or its slots stay taken
    for the rest of the run."""
    async with admitted() as run:
        first = run.first
        gid, index = int(first[S.GROUP][3]), int(first[S.PROMPT_INDEX][3])
        # the dead incarnation's put: allocated in the group, never committed
        allocate = M.Allocate(S.ROLLOUT, 4, 0, group=gid, put_id=1, holder="rollout-0")
        await run.queue.controller.ask(allocate)
        successor = await run.queue.client("rollout-0")
        await successor.aclose()
        again = await run.client.get(S.PROMPTS, "rollout", PROMPTS, 1)
    assert again is not None
    assert int(again[S.PROMPT_INDEX][0]) == index
    assert int(again[S.GROUP][0]) != gid, "a new group: the old one is gone"
    assert again[S.PROMPT_TEXT] == [first[S.PROMPT_TEXT][3]]
    assert run.hooks.reinjected == 1


async def test_a_group_of_a_writer_that_lives_on_is_not_injected_twice() -> None:
    """Only a dropped group's prompt comes back: a group written and committed stays."""
    async with admitted() as run:
        writer = await run.queue.client("rollout-0")
        await writer.put(S.ROLLOUT, _group(), version=0, group=int(run.first[S.GROUP][0]))
        await writer.aclose()
        await trio.testing.wait_all_tasks_blocked()  # the Driver saw every event
        extra = await run.client.get(S.PROMPTS, "rollout", PROMPTS, 1, wait=False)
    assert extra is None
    assert run.hooks.reinjected == 0


def _group() -> dict[str, Any]:
    return {
        S.RESPONSE_IDS: [torch.tensor([5, 6]) for _ in range(4)],
        S.BEHAVIOUR: [torch.tensor([-0.5, -0.5]) for _ in range(4)],
        S.TOKEN_VERSIONS: [torch.tensor([0, 0]) for _ in range(4)],
        S.REWARDS: torch.zeros(4),
        S.RESUMES: torch.zeros(4, dtype=torch.int64),
    }


async def test_a_rollout_worker_reports_a_group_gone_before_it_wrote_it() -> None:
    """A group shrunk to nothing (by a filter, say) is gone, reported by no event; the worker
    generating its prompt finds the group unknown. It tells the Driver, or the prompt is never
    trained."""
    tq = TransferQueueConfig(topics=topic_specs(SPEC), units=1)
    async with afa.open_actor_system() as system, open_transfer_queue(system, tq) as queue:
        client = await queue.client("driver")
        with trio.fail_after(20):
            driver, _ = await spawn_rollout(system, queue)
            slot = await client.open_group(S.ROLLOUT, 4, shared={S.PROMPT_IDS: torch.tensor([1])})
            await client.shrink_group(S.ROLLOUT, slot, 4)  # emptied: gone
            await put_prompt(client, 7, slot.group_id)
            await driver.received(1)
    assert driver.got == [GroupGone(slot.group_id, "rollout-0")]


async def test_the_driver_injects_a_gone_group_once() -> None:
    async with admitted() as run:
        first = run.first
        gid, index = int(first[S.GROUP][5]), int(first[S.PROMPT_INDEX][5])
        for _ in range(2):  # the worker and, say, a retry of it: one injection
            await run.driver.send(GroupGone(gid, "rollout-0"))
        await run.driver.send(GroupGone(10**6, "rollout-0"))  # not the Driver's: nothing
        again = await run.client.get(S.PROMPTS, "rollout", PROMPTS, 1)
        await trio.testing.wait_all_tasks_blocked()  # the Driver handled all three
        extra = await run.client.get(S.PROMPTS, "rollout", PROMPTS, 1, wait=False)
    assert again is not None and int(again[S.PROMPT_INDEX][0]) == index
    assert int(again[S.GROUP][0]) != gid
    assert extra is None
    assert run.hooks.reinjected == 1


async def put_prompt(client: Any, index: int, gid: int) -> None:
    await client.put(
        S.PROMPTS,
        {
            S.PROMPT_TEXT: [f"{index}+1="],
            S.PROMPT_IDS: [torch.tensor([1])],
            S.ANSWER: [str(index + 1)],
            S.GROUP: torch.tensor([gid]),
            S.PROMPT_INDEX: torch.tensor([index]),
            S.MIN_VERSION: torch.tensor([0]),
            S.RECORD: ["{}"],
        },
        version=0,
    )
