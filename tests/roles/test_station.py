"""The worker skeleton: data-parallel ranks share one lease (the availability probe) and each
writes back its own partition; a crashed station's leased samples go back to the queue."""

from __future__ import annotations

import torch
import trio

import asyncflow_actors as afa
from asyncflow_actors.roles import ActorForward, GetRoleStats, RunSpec, topic_specs
from asyncflow_actors.roles import _schema as S
from asyncflow_actors.roles._settings import ModelSettings, RolloutSettings, TrainSettings
from asyncflow_actors.transfer_queue import TransferQueueConfig, open_transfer_queue

SPEC = RunSpec(
    mode="async",
    staleness=1,
    stage_barrier=False,
    colocated=False,
    model=ModelSettings(d_model=32, n_layers=1, n_heads=2, max_seq_len=16),
    rollout=RolloutSettings(group_size=4, max_new_tokens=4),
    train=TrainSettings(forward_batch=8),
)


async def put_groups(client: afa.transfer_queue.TransferQueueClient, groups: int) -> None:
    for g in range(groups):
        slot = await client.open_group(S.ROLLOUT, 4, shared={S.PROMPT_IDS: torch.tensor([1, 4, 5])})
        responses = [torch.tensor([3 + g, 4, 2][: 1 + k % 3]) for k in range(4)]
        data = {
            S.RESPONSE_IDS: responses,
            S.BEHAVIOUR: [torch.zeros(len(r)) for r in responses],
            S.TOKEN_VERSIONS: [torch.zeros(len(r), dtype=torch.int64) for r in responses],
            S.REWARDS: torch.zeros(4),
            S.RESUMES: torch.zeros(4, dtype=torch.int64),
        }
        await client.put(S.ROLLOUT, data, version=0, group=slot)


async def test_two_ranks_share_one_lease_and_write_their_own_partitions() -> None:
    tq = TransferQueueConfig(topics=topic_specs(SPEC), units=1)
    async with afa.open_actor_system() as system, open_transfer_queue(system, tq) as queue:
        client = await queue.client("test")
        ranks = [
            await system.spawn(
                lambda r=r: ActorForward(SPEC, queue.controller, f"fwd-{r}", rank=r, ranks=2),
                name=f"fwd-{r}",
            )
            for r in range(2)
        ]
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
