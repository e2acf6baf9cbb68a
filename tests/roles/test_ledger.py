"""The Driver's sample ledger through an eviction: the evicted attempt is recorded
``not_trained`` (``evicted``, injected again), the prompt comes back as its next attempt with
the same id (the attempt travels in the group's ``prompt_key``), and what the Trainer reports
for that attempt is recorded ``trained``, once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import torch
import trio
import trio.testing

import asyncflow_actors as afa
from asyncflow_actors.pipeline import check_samples, read_samples
from asyncflow_actors.roles import Driver, DriverHooks, topic_specs
from asyncflow_actors.roles import _schema as S
from asyncflow_actors.roles._ledger import trained_samples
from asyncflow_actors.roles._messages import SaveCheckpoint, StepDone, SyncReport, SyncWeights
from asyncflow_actors.transfer_queue import TransferQueueConfig, open_transfer_queue

from .test_batching import SPEC

PROMPTS = [S.PROMPT_TEXT, S.GROUP, S.PROMPT_INDEX, S.MIN_VERSION]


class FakeTrainer(afa.Actor[SyncWeights | SaveCheckpoint]):
    """Answers the Driver's sync (no weights to send here) and checkpoint requests."""

    async def receive(self, msg: Any, ctx: Any) -> Any:
        await trio.lowlevel.checkpoint()
        if isinstance(msg, SyncWeights):
            return SyncReport(msg.version, {})
        return msg.directory


def _group(version: int) -> dict[str, Any]:
    return {
        S.RESPONSE_IDS: [torch.tensor([5, 6]) for _ in range(4)],
        S.BEHAVIOUR: [torch.tensor([-0.5, -0.5]) for _ in range(4)],
        S.TOKEN_VERSIONS: [torch.tensor([version, version]) for _ in range(4)],
        S.REWARDS: torch.tensor([0.0, 1.0, 0.0, 1.0]),
        S.RESUMES: torch.zeros(4, dtype=torch.int64),
    }


async def test_an_evicted_attempt_is_recorded_and_its_next_attempt_trained(
    tmp_path: Path,
) -> None:
    spec = attrs.evolve(SPEC, run_dir=str(tmp_path))
    assert spec.staleness == 1 and spec.rollout.group_size == 4
    tq = TransferQueueConfig(topics=topic_specs(spec), units=1)
    async with afa.open_actor_system() as system, open_transfer_queue(system, tq) as queue:
        client = await queue.client("test")
        hooks = DriverHooks()
        hooks.trainer = await system.spawn(FakeTrainer, name="trainer")
        driver = await system.spawn(lambda: Driver(spec, queue.controller, hooks), name="driver")
        with trio.fail_after(30):
            first = await client.get(S.PROMPTS, "rollout", PROMPTS, 16, min_count=16)
            assert first is not None
            await client.ack(first)
            gid, index = int(first[S.GROUP][0]), int(first[S.PROMPT_INDEX][0])
            await client.put(S.ROLLOUT, _group(0), version=0, group=gid)
            # two steps that train nothing of it: version 2 puts its version 0 out of the window
            for version in (1, 2):
                await driver.ask(StepDone(version, 4, 8, (), (4, 0), {}))
            # each step's slots admitted a new prompt; the evicted one is back, in a new group
            again = await client.get(S.PROMPTS, "rollout", PROMPTS, 3, min_count=3)
            assert again is not None
            await client.ack(again)
            (k,) = [k for k in range(3) if int(again[S.PROMPT_INDEX][k]) == index]
            new_gid = int(again[S.GROUP][k])
            assert new_gid != gid
            await client.put(S.ROLLOUT, _group(2), version=2, group=new_gid)
            columns = [S.PROMPT_KEY, S.TOKEN_VERSIONS, S.REWARDS]
            batch = await client.get(S.ROLLOUT, "trainer", columns, 4, min_count=4)
            assert batch is not None and set(batch.group_ids) == {new_gid}
            trained = trained_samples([batch])
            await driver.ask(StepDone(3, 4, 8, (new_gid,), (4, 0), {}, trained))
            await driver.ask(StepDone(3, 4, 8, (new_gid,), (4, 0), {}, trained))  # again
            await client.ack(batch)
            await trio.testing.wait_all_tasks_blocked()
        await system.stop_child("driver")
    records = read_samples(str(tmp_path))
    mine = [r for r in records if r.prompt_id == str(index)]
    evicted, *samples = mine
    assert (evicted.kind, evicted.attempt, evicted.reason, evicted.reinjected) == (
        "not_trained", 0, "evicted", True,
    )  # fmt: skip
    assert evicted.admitted_version == 0
    assert [r.sample_id for r in samples] == [f"{index}/1/{k}" for k in range(4)]
    assert {(r.kind, r.attempt, r.admitted_version, r.step, r.trainer_version) for r in samples} == {
        ("trained", 1, 2, 3, 2)
    }
    assert [r.reward for r in samples] == [0.0, 1.0, 0.0, 1.0]
    assert {(r.oldest_version, r.newest_version) for r in samples} == {(2, 2)}
    others = [r for r in records if r.prompt_id != str(index)]
    assert others and {(r.kind, r.reason) for r in others} == {("not_trained", "unfinished")}
    assert check_samples(records, group_size=4, staleness=1).ok
