"""The kit's models on our own protocols: supervision, FlowControl, the TransferQueue.

Each model catches a planted bug in a variant of the protocol. The models' runs on the real
implementations: supervision in ``tests/actors/test_supervision_stateful.py``, FlowControl in
``tests/transfer_queue/test_flow_control.py``, the TransferQueue here.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import pytest
import torch
import trio
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

import asyncflow_actors as afa
from asyncflow_actors import transfer_queue as tq
from asyncflow_actors.testing import (
    LifecycleLog,
    LoggingSupervisor,
    SupervisionMachine,
    TransferQueueLedger,
    check_flow_control_schedule,
    find_exception,
    flow_control_ops,
    protocol_settings,
    replay,
    run_deterministic,
)

# -- supervision (the full run is tests/actors/test_supervision_stateful.py) ------------------------


class OffByOneIntensity(SupervisionMachine):
    """A supervisor that allows one restart more than its strategy says."""

    def make_supervisor(
        self, log: LifecycleLog, children: list[afa.ChildSpec], strategy: afa.Strategy
    ) -> afa.Supervisor:
        lax = attrs.evolve(strategy, max_restarts=strategy.max_restarts + 1)
        return LoggingSupervisor(log, children, lax)


def test_the_supervision_model_catches_a_lax_restart_intensity() -> None:
    settings = protocol_settings(
        max_examples=60, stateful_step_count=20, derandomize=True, database=None
    )
    with pytest.raises(AssertionError):
        run_state_machine_as_test(OffByOneIntensity, settings=settings)


# -- FlowControl (the run on FlowControl is tests/transfer_queue/test_flow_control.py) ------------


class NaiveLimiter:
    """A limiter whose waiters poll an event: a small request overtakes a large one, and
    ``acquire_nowait`` barges past waiters. The planted bug."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_flight = self.acquired = self.released = 0
        self.waiting: dict[object, int] = {}
        self.changed = trio.Event()

    async def acquire(self, n: int) -> None:
        if n > self.capacity:
            raise tq.CapacityError(f"{n} > {self.capacity}")
        token = object()
        self.waiting[token] = n
        try:
            while self.in_flight + n > self.capacity:
                await self.changed.wait()
        finally:
            del self.waiting[token]
        self.in_flight += n
        self.acquired += n

    def acquire_nowait(self, n: int) -> None:
        if self.in_flight + n > self.capacity:
            raise trio.WouldBlock
        self.in_flight += n
        self.acquired += n

    def release(self, n: int) -> None:
        if n > self.in_flight:
            raise tq.FlowControlError(f"{n} > {self.in_flight}")
        self.in_flight -= n
        self.released += n
        self.changed.set()
        self.changed = trio.Event()

    def statistics(self) -> tq.FlowControlStatistics:
        return tq.FlowControlStatistics(
            self.capacity, self.in_flight, self.capacity - self.in_flight, len(self.waiting),
            sum(self.waiting.values()), self.acquired, self.released,
        )  # fmt: skip


def test_the_flow_control_model_catches_barging() -> None:
    @given(ops=flow_control_ops())
    @protocol_settings(max_examples=200, derandomize=True, database=None)
    def check(ops: Any) -> None:
        run_deterministic(check_flow_control_schedule, functools.partial(NaiveLimiter, 4), ops)

    with pytest.raises(AssertionError):
        check()


# -- the TransferQueue ------------------------------------------------------------------------------

SPEC = tq.TopicSpec.from_dict(
    {
        "consumers": ["fwd", "train"],
        "staleness": 1,
        "lease_ttl": 5.0,
        "columns": {
            "prompt": {"dtype": "int64", "shape": [2], "shared": True},
            "tokens": {"dtype": "int64", "shape": [3]},
        },
    },
    name="t",
)

ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(1, 3)),
        st.tuples(st.just("group"), st.integers(2, 3)),
        st.tuples(
            st.just("get"), st.sampled_from(["fwd", "train"]), st.integers(1, 4), st.booleans()
        ),
        st.tuples(st.just("ack"), st.integers(0, 5)),
        st.tuples(st.just("nack"), st.integers(0, 5)),
        st.tuples(st.just("bump")),
        st.tuples(st.just("sleep"), st.sampled_from([1.0, 6.0])),
    ),
    max_size=20,
)


def tokens(serial: int) -> torch.Tensor:
    return torch.tensor([serial, serial + 1, serial + 2])


def fingerprints(batch: tq.Batch) -> list[tuple[int, ...]]:
    return [tuple(row.tolist()) for row in batch["tokens"]]


@attrs.define
class Station:
    """Drives a client and keeps the ledger in step with what it sees."""

    client: Any
    ledger: TransferQueueLedger
    held: list[tq.Batch] = attrs.Factory(list)
    serial: int = 0
    version: int = 0

    async def get(self, consumer: str, count: int, whole: bool) -> tq.Batch | None:
        sampler = tq.WHOLE_GROUPS if whole else tq.FIFO
        return await self.client.get(  # type: ignore[no-any-return]
            "t", consumer, ["tokens"], count, sampler=sampler, min_count=1, wait=False
        )

    async def step(self, op: tuple[Any, ...]) -> None:
        kind, c = op[0], self.client
        if kind in ("put", "group"):
            n = op[1]
            rows = [tokens(10 * (self.serial + k)) for k in range(n)]
            self.serial += n
            slot = None
            if kind == "group":
                slot = await c.open_group("t", n, shared={"prompt": torch.tensor([n, 0])})
                self.ledger.open_group(slot.group_id, n)
            indexes = await c.put(
                "t", {"tokens": torch.stack(rows)}, version=self.version, group=slot
            )
            prints = [tuple(r.tolist()) for r in rows]
            gid = slot.group_id if slot is not None else None
            self.ledger.put(indexes, self.version, group=gid, fingerprints=prints)
        elif kind == "get":
            batch = await self.get(op[1], op[2], op[3])
            if batch is not None:
                self.ledger.handed(batch, whole_groups=op[3], fingerprints=fingerprints(batch))
                self.held.append(batch)
        elif kind in ("ack", "nack") and self.held:
            batch = self.held.pop(op[1] % len(self.held))
            try:
                if kind == "ack":
                    self.ledger.acked_batch(batch, await c.ack(batch))
                else:
                    await c.nack(batch)
                    self.ledger.returned(batch)
            except tq.UnknownLease:
                self.ledger.returned(batch)  # it expired meanwhile
        elif kind == "bump":
            self.version += 1
            await c.set_version("t", self.version)
            self.ledger.set_version(self.version)
        elif kind == "sleep":
            await trio.sleep(op[1])
            for batch in [b for b in self.held if b.lease.deadline <= trio.current_time()]:
                self.held.remove(batch)
                self.ledger.returned(batch)  # expired: its samples come back

    async def drain(self) -> None:
        for batch in self.held:
            await self.client.nack(batch)
            self.ledger.returned(batch)
        self.held.clear()
        while True:
            got = False
            for consumer in ("fwd", "train"):
                batch = await self.get(consumer, 64, False)
                if batch is not None:
                    got = True
                    self.ledger.handed(batch, fingerprints=fingerprints(batch))
                    self.ledger.acked_batch(batch, await self.client.ack(batch))
            if not got:
                break
        stats = await self.client.statistics()
        if stats.controller.events:  # events() waits for one: ask only when there are some
            self.ledger.report((await self.client.events()).events)


async def run_station(
    schedule: list[tuple[Any, ...]], station_type: type[Station] = Station
) -> None:
    async with afa.open_actor_system() as system:
        config = tq.TransferQueueConfig(topics=(SPEC,), units=2)
        async with tq.open_transfer_queue(system, config) as queue:
            client = await queue.client("station")
            station = station_type(client, TransferQueueLedger(SPEC.consumers, staleness=1))
            await replay(schedule, station.step)
            await station.drain()
            await client.flush()  # deletions reach the units in the background
            station.ledger.check_drained(await client.statistics(), topic="t")


@given(schedule=ops)
@protocol_settings(max_examples=30)
def test_the_transfer_queue_keeps_the_ledger_s_promises(schedule: list[tuple[Any, ...]]) -> None:
    run_deterministic(run_station, schedule)


class Redelivering(Station):
    """A consumer that serves the batch it just acked once more: the planted bug."""

    async def get(self, consumer: str, count: int, whole: bool) -> tq.Batch | None:
        last = getattr(self, "last_acked", None)
        if last is not None and last.lease.consumer == consumer:
            self.last_acked = None
            return last  # type: ignore[no-any-return]
        return await super().get(consumer, count, whole)

    async def step(self, op: tuple[Any, ...]) -> None:
        if op[0] == "ack" and self.held:
            self.last_acked = self.held[op[1] % len(self.held)]
        await super().step(op)


def test_the_ledger_catches_a_redelivery_after_ack() -> None:
    schedule = [("put", 2), ("get", "fwd", 2, False), ("ack", 0), ("get", "fwd", 2, False)]
    run_deterministic(run_station, schedule)  # the real queue: fine
    with pytest.raises(BaseException) as info:
        run_deterministic(run_station, schedule, Redelivering)
    found = find_exception(info.value, AssertionError)
    assert found is not None and "again after it acked it" in str(found)


def test_the_ledger_catches_a_silent_drop() -> None:
    ledger = TransferQueueLedger(["fwd"], staleness=0)
    ledger.put([0, 1], 0)
    with pytest.raises(AssertionError, match=r"silently dropped.*'fwd': \[0, 1\]"):
        ledger.check_drained()
    ledger.report([tq.TQEvent(1, "lost", "t", (), (0,))])
    ledger.discard([1])
    ledger.check_drained()
