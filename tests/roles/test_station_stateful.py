"""A hypothesis state machine over a station that crashes at planned points: groups are put,
the Advantage station is poked (its k-th message crashes it, mid-lease or not), a consumer takes
what has advantages. Whatever the order, every sample gets its advantages and reaches the
consumer exactly once: a restarted station gets its predecessor's leased samples back."""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any

import torch
import trio
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

import asyncflow_actors as afa
from asyncflow_actors import testing as aft
from asyncflow_actors.roles import Advantage, GetRoleStats, RunSpec, topic_specs
from asyncflow_actors.roles import _schema as S
from asyncflow_actors.roles._settings import RolloutSettings, TrainSettings
from asyncflow_actors.transfer_queue import TransferQueueConfig, open_transfer_queue

FaultyAdvantage = aft.faulty(Advantage)

SPEC = RunSpec(
    mode="async",
    staleness=1,
    stage_barrier=False,
    colocated=False,
    rollout=RolloutSettings(group_size=4),
    train=TrainSettings(forward_batch=8),
)


class StationMachine(aft.ActorMachine):
    clock = "real"  # the station computes in worker threads

    def __init__(self) -> None:
        self.put: set[int] = set()
        self.handed: list[int] = []
        self.groups = 0
        super().__init__()

    async def setup(self, stack: AsyncExitStack) -> None:
        await super().setup(stack)
        queue = await stack.enter_async_context(
            open_transfer_queue(self.system, TransferQueueConfig(topics=topic_specs(SPEC), units=1))
        )
        self.client = await queue.client("test")
        self.controller = queue.controller
        self.station: Any = None

    async def _start(self, crash_at: int) -> None:
        plan = aft.FaultPlan((aft.CrashAt(message=crash_at),))
        self.station = await self.system.spawn(
            lambda: FaultyAdvantage(SPEC, self.controller, "adv-0", faults=plan),
            name="adv-0",
            restart=afa.Restart.PERMANENT,
        )

    @rule(crash_at=st.integers(1, 4))
    @aft.in_trio
    async def start_station(self, crash_at: int) -> None:
        if self.station is None:
            await self._start(crash_at)

    @rule(rewards=st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=4, max_size=4))
    @aft.in_trio
    async def put_group(self, rewards: list[float]) -> None:
        slot = await self.client.open_group(
            S.ROLLOUT, 4, shared={S.PROMPT_IDS: torch.tensor([1, 4])}
        )
        responses = [torch.tensor([5] * (1 + k)) for k in range(4)]
        data = {
            S.RESPONSE_IDS: responses,
            S.BEHAVIOUR: [torch.zeros(len(r)) for r in responses],
            S.TOKEN_VERSIONS: [torch.zeros(len(r), dtype=torch.int64) for r in responses],
            S.REWARDS: torch.tensor(rewards),
            S.RESUMES: torch.zeros(4, dtype=torch.int64),
        }
        self.put.update(await self.client.put(S.ROLLOUT, data, version=0, group=slot))

    @rule()
    @aft.in_trio
    async def poke(self) -> None:
        if self.station is not None:
            await aft.attempt(self.station.ask, GetRoleStats())  # may be its planned crash

    @rule()
    @aft.in_trio
    async def consume(self) -> None:
        await self._consume(wait=False)

    async def _consume(self, *, wait: bool) -> None:
        columns = [S.ADVANTAGES, S.RESPONSE_IDS]
        batch = await self.client.get(S.ROLLOUT, "trainer", columns, 64, min_count=1, wait=wait)
        if batch is None:
            return
        for advantages, response in zip(batch[S.ADVANTAGES], batch[S.RESPONSE_IDS], strict=True):
            assert advantages.shape == response.shape
        self.handed.extend(batch.indexes)
        await self.client.ack(batch)

    @invariant()
    def nothing_handed_twice(self) -> None:
        assert len(self.handed) == len(set(self.handed)), f"handed twice: {self.handed}"

    def teardown(self) -> None:
        try:
            if self.station is None and self.put:
                self.run(self._start, 1000)  # a station that never crashes finishes the job

            async def drain() -> None:
                with trio.fail_after(30):
                    while set(self.handed) != self.put:
                        await self._consume(wait=True)

            if self.put:
                self.run(drain)
            assert sorted(self.handed) == sorted(self.put), "every sample exactly once"
        finally:
            super().teardown()


TestStation = StationMachine.TestCase
TestStation.settings = aft.protocol_settings(max_examples=12, stateful_step_count=12)
