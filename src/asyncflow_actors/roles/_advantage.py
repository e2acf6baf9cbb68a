"""Advantage: whole groups in, group-relative advantages (``rl``) out. CPU only.

A separate ``Advantage`` station by default; with ``RunSpec.fused_advantage``
(``placement.roles.advantage = "actor_fwd"``) the ActorForward station computes them on the
batch it fetched for the old log-probs: one fetch, one write and one ack for both columns
instead of two of each.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from ..actors import Actor, ActorContext, ActorRef
from ..observe import clock_ns
from . import _schema as S
from ._messages import GetRoleStats
from ._settings import RunSpec
from ._worker import Station, column, in_thread, take


class Advantages:
    """The advantage step of a station: the estimator of ``spec.algorithm`` over whole groups.

    With ``train.shuffle_rewards`` the rewards are permuted across the rows first: the control
    arm of the learning test (same data, no credit assignment)."""

    def __init__(self, spec: RunSpec, compute: Any) -> None:
        import torch

        self.spec = spec
        self.compute = compute
        self.generator = torch.Generator().manual_seed(spec.train.seed + 17)

    def estimate(
        self, batch: Any, rows: Sequence[int], lengths: Sequence[int], *, padded: bool = False
    ) -> Any:
        """Per-token advantages of ``batch`` at ``rows`` (whole groups), ``lengths`` tokens: a
        tensor per row to write back, or one ``PaddedRows`` (``padded``) to train on. Blocking:
        call it in a compute thread (the trainer runs it in the thread of its update)."""
        import torch

        rewards = column(batch, S.REWARDS)
        group_ids = batch.group_ids
        if len(rows) != len(batch):
            rewards = rewards[torch.tensor(list(rows), dtype=torch.long)]
            group_ids = tuple(group_ids[k] for k in rows)
        if self.spec.train.shuffle_rewards:
            rewards = rewards[torch.randperm(len(rows), generator=self.generator)]
        compute = self.compute.padded_advantages if padded else self.compute.group_advantages
        return compute(self.spec.algorithm, rewards, group_ids, lengths)

    async def __call__(
        self, batch: Any, rows: Sequence[int], lengths: Sequence[int], *, padded: bool = False
    ) -> Any:
        """``estimate`` in a worker thread."""
        return await in_thread(
            functools.partial(self.estimate, batch, rows, lengths, padded=padded)
        )


class Advantage(Station, Actor[GetRoleStats]):
    """The advantage step as a station of its own: takes whole groups only (the estimators
    compare a group's members), writes per-token advantages."""

    role = "advantage"
    consumer = "advantage"

    def __init__(self, spec: RunSpec, controller: ActorRef[Any], worker: str) -> None:
        super().__init__(spec, controller, worker)

    async def setup(self, ctx: ActorContext[Any]) -> None:
        self.columns = S.station_columns(self.spec)["advantage"]
        self.advantages = Advantages(self.spec, self.compute)

    async def run(self) -> None:
        assert self.client is not None
        spec = self.spec
        while True:
            batch = await self.fetch(
                self.columns,
                spec.fetch_size,
                whole_groups=True,
                min_count=spec.fetch_size if spec.stage_barrier else spec.rollout.group_size,
            )
            rows = range(len(batch))
            lengths = [int(r.shape[0]) for r in take(batch, rows, S.RESPONSE_IDS)]
            with self.meter.track.span("advantage", samples=batch.indexes):
                start = clock_ns()
                advantages = await self.advantages(batch, rows, lengths)
                self.meter.busy(start)
                if not await self.write_back(batch, rows, {S.ADVANTAGES: advantages}):
                    continue  # its samples left the lease: returned, not acked
            await self.client.ack(batch)
            self.meter.done(len(batch), sum(lengths))
