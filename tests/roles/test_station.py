"""The worker skeleton: data-parallel ranks share one lease (the availability probe) and each
writes back its own partition; a crashed station's leased samples go back to the queue."""

from __future__ import annotations

from typing import Any

import attrs
import torch
import trio

import asyncflow_actors as afa
from asyncflow_actors.rl import grpo_advantages
from asyncflow_actors.roles import ActorForward, GetRoleStats, RunSpec, topic_specs
from asyncflow_actors.roles import _schema as S
from asyncflow_actors.roles._settings import ModelSettings, RolloutSettings, TrainSettings
from asyncflow_actors.transfer_queue import (
    StorageUnavailable,
    TransferQueueConfig,
    open_transfer_queue,
)

SPEC = RunSpec(
    mode="async",
    staleness=1,
    stage_barrier=False,
    colocated=False,
    model=ModelSettings(d_model=32, n_layers=1, n_heads=2, max_seq_len=16),
    rollout=RolloutSettings(group_size=4, max_new_tokens=4),
    train=TrainSettings(forward_batch=8),
)


async def put_groups(
    client: afa.transfer_queue.TransferQueueClient, groups: int, rewards: bool = False
) -> None:
    for g in range(groups):
        slot = await client.open_group(S.ROLLOUT, 4, shared={S.PROMPT_IDS: torch.tensor([1, 4, 5])})
        responses = [torch.tensor([3 + g, 4, 2][: 1 + k % 3]) for k in range(4)]
        data = {
            S.RESPONSE_IDS: responses,
            S.BEHAVIOUR: [torch.zeros(len(r)) for r in responses],
            S.TOKEN_VERSIONS: [torch.zeros(len(r), dtype=torch.int64) for r in responses],
            S.REWARDS: torch.tensor([1.0, 0.0, float(g % 2), 1.0]) if rewards else torch.zeros(4),
            S.RESUMES: torch.zeros(4, dtype=torch.int64),
        }
        await client.put(S.ROLLOUT, data, version=0, group=slot)


async def spawn_ranks(
    system: afa.ActorSystem, spec: RunSpec, controller: afa.ActorRef[Any]
) -> list[afa.ActorRef[Any]]:
    """Two data-parallel ActorForward ranks, ``fwd-0`` and ``fwd-1``."""
    return [
        await system.spawn(
            lambda r=r: ActorForward(spec, controller, f"fwd-{r}", rank=r, ranks=2),
            name=f"fwd-{r}",
        )
        for r in range(2)
    ]


async def test_two_ranks_share_one_lease_and_write_their_own_partitions() -> None:
    tq = TransferQueueConfig(topics=topic_specs(SPEC), units=1)
    async with afa.open_actor_system() as system, open_transfer_queue(system, tq) as queue:
        client = await queue.client("test")
        ranks = await spawn_ranks(system, SPEC, queue.controller)
        with trio.fail_after(60):
            await put_groups(client, 2)
            # every sample gets its old log-probs: the trainer's view needs them all
            batch = await client.get(S.ROLLOUT, "trainer", [S.OLD, S.RESPONSE_IDS], 8)
        assert batch is not None
        for old, response in zip(batch[S.OLD], batch[S.RESPONSE_IDS], strict=True):
            assert old.shape == response.shape and bool((old < 0).all())
        stats = [await ref.ask(GetRoleStats()) for ref in ranks]
        assert [s.samples for s in stats] == [4, 4], "one balanced partition each"
        view = await client.statistics()
        (topic,) = [t for t in view.controller.state.topics if t.topic == S.ROLLOUT]
        (fwd,) = [c for c in topic.consumers if c.consumer == "actor_fwd"]
        assert fwd.consumed == 8 and fwd.leased == 0, "the shared lease completed at the last ack"


async def test_fused_forward_writes_old_logprobs_and_advantages_of_whole_groups() -> None:
    """``fused_advantage``: ActorForward computes the advantages of the whole groups it fetched
    (two ranks: each rank's partition is made of whole groups, and a lease of one group leaves
    a rank none, which it acks), in the same write as the old log-probs; the topic has no
    ``advantage`` consumer to wait for."""
    spec = attrs.evolve(SPEC, fused_advantage=True)
    assert "advantage" not in topic_specs(spec)[1].consumers
    tq = TransferQueueConfig(topics=topic_specs(spec), units=1)
    async with afa.open_actor_system() as system, open_transfer_queue(system, tq) as queue:
        client = await queue.client("test")
        ranks = await spawn_ranks(system, spec, queue.controller)
        columns = [S.OLD, S.ADVANTAGES, S.RESPONSE_IDS, S.REWARDS]
        with trio.fail_after(60):
            await put_groups(client, 4, rewards=True)
            batch = await client.get(S.ROLLOUT, "trainer", columns, 16)
        assert batch is not None
        rewards = batch[S.REWARDS]
        responses = batch[S.RESPONSE_IDS]
        mask = torch.zeros((16, 3), dtype=torch.bool)
        for i, r in enumerate(responses):
            mask[i, : len(r)] = True
        expected = grpo_advantages(rewards, torch.tensor(batch.group_ids), mask).advantages
        for i, (old, adv) in enumerate(zip(batch[S.OLD], batch[S.ADVANTAGES], strict=True)):
            assert old.shape == adv.shape == responses[i].shape and bool((old < 0).all())
            assert torch.allclose(adv, expected[i, : len(responses[i])])
        assert any(bool(a.abs().sum() > 0) for a in batch[S.ADVANTAGES])
        stats = [await ref.ask(GetRoleStats()) for ref in ranks]
        assert sum(s.samples for s in stats) == 16


async def test_samples_that_left_the_lease_before_the_write_back_return_it_without_a_crash() -> (
    None
):
    """Samples discarded (or evicted, lost) while a station computed: its write-back finds them
    gone (``UnknownSample``) and the station returns the lease, as an ack would report them
    missing; no crash, no restart."""
    tq = TransferQueueConfig(topics=topic_specs(SPEC), units=1)
    async with afa.open_actor_system() as system, open_transfer_queue(system, tq) as queue:
        client = await queue.client("test")
        await put_groups(client, 1)
        batch = await client.get(S.ROLLOUT, "actor_fwd", [S.RESPONSE_IDS], 4)
        assert batch is not None
        await client.discard(S.ROLLOUT, batch.indexes[:2])  # gone while leased
        station = ActorForward(SPEC, queue.controller, "fwd-0")
        station.client = client
        old = [torch.zeros(len(r)) for r in batch[S.RESPONSE_IDS]]
        assert not await station.write_back(batch, range(4), {S.OLD: old})
        view = await client.statistics()
        (topic,) = [t for t in view.controller.state.topics if t.topic == S.ROLLOUT]
        (fwd,) = [c for c in topic.consumers if c.consumer == "actor_fwd"]
        assert (fwd.leased, fwd.consumed, topic.live) == (0, 0, 2)  # returned: to compute again


class _RestartedEmpty:
    """A queue client whose storage unit restarted empty: the first gets fail with
    ``StorageUnavailable`` (each returned its lease), and so does every write-back."""

    def __init__(self, batch: Any) -> None:
        self.batch = batch
        self.gets = 0
        self.nacked: list[Any] = []

    async def get(self, *args: Any, **kwargs: Any) -> Any:
        await trio.lowlevel.checkpoint()
        self.gets += 1
        if self.gets <= 2:
            raise StorageUnavailable("storage unit 'unit-0' failed: it restarted empty since")
        return self.batch

    async def put_columns(self, lease: Any, data: Any) -> None:
        await trio.lowlevel.checkpoint()
        raise StorageUnavailable("storage unit 'unit-0' failed: it restarted empty since")

    async def nack(self, batch: Any) -> None:
        await trio.lowlevel.checkpoint()
        self.nacked.append(batch)


async def test_a_storage_unit_that_restarted_empty_does_not_crash_a_station() -> None:
    """A unit killed and restarted empty: the station's gets fail until the controller knows
    (they returned their lease) and it gets again; its write-back finds the samples gone with
    the unit and returns the lease, as for ``UnknownSample``. Each station crashed on it, and
    one whose get kept failing crash-looped until its supervisor failed the run (the soak's
    unit kills, #27 §1 item 9)."""
    tq = TransferQueueConfig(topics=topic_specs(SPEC), units=1)
    async with afa.open_actor_system() as system, open_transfer_queue(system, tq) as queue:
        client = await queue.client("test")
        await put_groups(client, 1)
        batch = await client.get(S.ROLLOUT, "actor_fwd", [S.RESPONSE_IDS], 4)
        assert batch is not None
        station = ActorForward(SPEC, queue.controller, "fwd-0")
        restarted = _RestartedEmpty(batch)
        station.client = restarted  # type: ignore[assignment]
        assert await station.fetch([S.RESPONSE_IDS], 4, whole_groups=False) is batch
        assert restarted.gets == 3
        old = [torch.zeros(len(r)) for r in batch[S.RESPONSE_IDS]]
        assert not await station.write_back(batch, range(4), {S.OLD: old})
        assert restarted.nacked == [batch]
