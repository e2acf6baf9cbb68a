"""Advantage: whole groups in, group-relative advantages (``rl``) out. CPU only."""

from __future__ import annotations

from typing import Any

from ..actors import Actor, ActorContext, ActorRef
from ..observe import clock_ns
from . import _schema as S
from ._messages import GetRoleStats
from ._settings import RunSpec
from ._worker import Station, column, in_thread, take


class Advantage(Station, Actor[GetRoleStats]):
    """Takes whole groups only (the estimators compare a group's members), writes per-token
    advantages. With ``train.shuffle_rewards`` the rewards are permuted across the batch
    first: the control arm of the learning test (same data, no credit assignment)."""

    role = "advantage"
    consumer = "advantage"

    def __init__(self, spec: RunSpec, controller: ActorRef[Any], worker: str) -> None:
        super().__init__(spec, controller, worker)

    async def setup(self, ctx: ActorContext[Any]) -> None:
        import torch

        self.columns = S.station_columns(self.spec)["advantage"]
        self.generator = torch.Generator().manual_seed(self.spec.train.seed + 17)

    async def run(self) -> None:
        import torch

        assert self.client is not None
        spec = self.spec
        while True:
            batch = await self.fetch(
                self.columns,
                spec.fetch_size,
                whole_groups=True,
                min_count=spec.fetch_size if spec.stage_barrier else spec.rollout.group_size,
            )
            rows = list(range(len(batch)))
            rewards = column(batch, S.REWARDS)
            if spec.train.shuffle_rewards:
                rewards = rewards[torch.randperm(len(batch), generator=self.generator)]
            lengths = [int(r.shape[0]) for r in take(batch, rows, S.RESPONSE_IDS)]
            with self.meter.track.span("advantage", samples=batch.indexes):
                start = clock_ns()
                advantages = await in_thread(
                    self.compute.group_advantages,
                    spec.algorithm,
                    rewards,
                    batch.group_ids,
                    lengths,
                )
                self.meter.busy(start)
                await self.write_back(batch, rows, {S.ADVANTAGES: advantages})
            await self.client.ack(batch)
            self.meter.done(len(batch), sum(lengths))
