"""The Driver's sample ledger through an eviction: the evicted attempt is recorded
``not_trained`` (``evicted``, injected again), the prompt comes back as its next attempt with
the same id (the attempt travels in the group's ``prompt_key``), and what the Trainer reports
for that attempt is recorded ``trained``, once."""

from __future__ import annotations

import json
import math
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
from asyncflow_actors.roles._ledger import (
    SampleLedger,
    _recover,
    _trained_lines,
    trained_samples,
)
from asyncflow_actors.roles._messages import (
    SaveCheckpoint,
    StepDone,
    SyncReport,
    SyncWeights,
    TrainedSamples,
)
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
            trained = trained_samples([batch], [2] * 4)
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
    assert {
        (r.kind, r.attempt, r.admitted_version, r.step, r.trainer_version) for r in samples
    } == {("trained", 1, 2, 3, 2)}
    assert [r.reward for r in samples] == [0.0, 1.0, 0.0, 1.0]
    assert {(r.oldest_version, r.newest_version) for r in samples} == {(2, 2)}
    others = [r for r in records if r.prompt_id != str(index)]
    assert others and {(r.kind, r.reason) for r in others} == {("not_trained", "unfinished")}
    assert check_samples(records, group_size=4, staleness=1).ok


def test_trained_lines_are_the_records_json() -> None:
    t = TrainedSamples((12, 3), (0, 2), (1, 4), (3, 0), (1, 4), (2, 5), (0.25, math.nan))
    expected = [
        {"kind": "trained", "prompt_id": str(p), "sample_id": f"{p}/{a}/{i}", "attempt": a,
         "admitted_version": adm, "oldest_version": old, "newest_version": new, "step": 7,
         "trainer_version": 6, "reward": r}
        for p, a, adm, i, old, new, r in zip(*attrs.astuple(t), strict=True)
    ]  # fmt: skip
    assert _trained_lines(7, t) == [json.dumps(r) + "\n" for r in expected]


def test_a_resume_cuts_the_ledger_back_to_its_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "samples.jsonl"
    records = [
        {"kind": "not_trained", "prompt_id": str(p), "attempt": a, "admitted_version": 0,
         "reason": "evicted", "reinjected": True}
        for p, a in [(0, 0), (1, 0), (0, 1), (1, 1)]
    ]  # fmt: skip
    text = "".join(json.dumps(r) + "\n" for r in records)
    checkpoint = tmp_path / "step-000001"
    checkpoint.mkdir()
    (checkpoint / "ledger.json").write_text(json.dumps({"records": 3}))
    path.write_text(text + '{"kind": "trai')  # the last line cut by a crash
    assert _recover(str(path), str(checkpoint)) == (3, {0: 2, 1: 1})
    assert path.read_text() == "".join(text.splitlines(keepends=True)[:3])
    path.write_text(text + '{"kind": "trai')
    assert _recover(str(path), str(tmp_path)) == (4, {0: 2, 1: 2})  # no mark: whole lines
    assert path.read_text() == text
    assert _recover(str(path), None) == (0, {}) and path.read_text() == ""  # a new run


def test_a_trainer_step_reports_each_sample_it_trained() -> None:
    from asyncflow_actors.roles._trainer import _Step

    from .test_trainer_step import SPEC as TRAIN_SPEC
    from .test_trainer_step import make_batch, make_trainer

    trainer = make_trainer(TRAIN_SPEC)
    trainer.version = 2
    batch = make_batch(version=2, oldest=1)  # sample 5's first token is of version 1
    data = {name: batch[name] for name in S.station_columns(TRAIN_SPEC)["trainer"]}
    updates, lags, lengths = trainer._prepare(batch, data)
    step = _Step(0, [batch], lags, lengths, updates=updates)
    trainer._finish(step)
    t = step.trained
    assert t.prompt == tuple(k // 4 for k in range(16)) and t.attempt == (0,) * 16
    assert t.admitted == (2,) * 16 and t.index == tuple(k % 4 for k in range(16))
    assert t.oldest == tuple(1 if k == 5 else 2 for k in range(16)) and t.newest == (2,) * 16
    assert t.reward == tuple(batch[S.REWARDS].tolist())


async def test_a_ledger_writes_in_order_and_rewinds_to_a_checkpoint(tmp_path: Path) -> None:
    ledger = await SampleLedger.open(str(tmp_path), None, 0)
    ledger.admitted(0, 0, 0)
    ledger.not_trained(0, "evicted", reinjected=True)
    ledger.admitted(0, 1, 0)
    t = TrainedSamples((0, 0), (1, 1), (0, 0), (0, 1), (0, 0), (0, 0), (1.0, 0.0))
    ledger.trained(StepDone(1, 2, 4, (), (2,), {}, t))
    ledger.trained(StepDone(1, 2, 4, (), (2,), {}, t))  # step 1 again: not recorded
    checkpoint = tmp_path / "step-000001"
    await ledger.save_mark(str(checkpoint), ledger.mark())
    assert ledger.mark() == 3 and json.loads((checkpoint / "ledger.json").read_text()) == {
        "records": 3
    }
    assert [r.kind for r in read_samples(str(tmp_path))] == ["not_trained", "trained", "trained"]
    ledger.admitted(1, 0, 1)
    ledger.not_trained(1, "dropped", reinjected=False)
    await ledger.flush()
    assert len(read_samples(str(tmp_path))) == 4
    await ledger.rewind(str(checkpoint), 1)
    assert len(read_samples(str(tmp_path))) == 3 and ledger.mark() == 3
    assert (ledger.next_attempt(0), ledger.next_attempt(1)) == (2, 0)
    await ledger.close([1])
    ledger.not_trained(2, "lost", reinjected=True)  # closed: not recorded
    await ledger.flush()
    records = read_samples(str(tmp_path))
    assert [(r.prompt_id, r.reason) for r in records[3:]] == [("1", "unfinished")]
