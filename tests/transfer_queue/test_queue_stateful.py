"""A hypothesis schedule, replayed against the running TransferQueue actors.

Random puts (grouped or not; batch tensors or lists of rows of random lengths), column writes,
gets by two consumers with FIFO or whole-group sampling, gets cancelled after their lease was
granted, acks, nacks, lease expiries (virtual time), version bumps, storage-unit crashes,
controller crashes, and controller crashes in the middle of a flush to the units run in one
``trio.run`` on a ``MockClock``. After every step: every batch carries exactly the rows put for
its indexes; no consumer receives a sample again once it acked it; nothing handed out is
outside the staleness window; whole groups are never split. At the end everything is drained:
every sample ever put is accounted for as consumed by every consumer, evicted, or lost —
reported, never silently dropped — and the units hold no bytes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import trio
import trio.testing
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import asyncflow_actors as afa
from asyncflow_actors import transfer_queue as tq
from asyncflow_actors.transfer_queue import _messages as M
from asyncflow_actors.transfer_queue import _unit_messages as U

from .faults import Tap, fail, restarted

STALENESS = 1
COLUMNS = {"fwd": ["tokens", "prompt", "resp"], "trainer": ["tokens", "logp"]}
SPEC = tq.TopicSpec.from_dict(
    {
        "consumers": ["fwd", "trainer"],
        "staleness": STALENESS,
        "lease_ttl": 5.0,
        "columns": {
            "prompt": {"dtype": "int64", "shape": [2], "shared": True},
            "tokens": {"dtype": "int64", "shape": [3]},
            "resp": {"dtype": "int64", "shape": [-1]},
            "logp": {"dtype": "float32", "shape": [3]},
        },
    },
    name="t",
)

ops = st.one_of(
    st.tuples(st.just("put"), st.integers(1, 4), st.booleans(), st.integers(0, 4)),
    st.tuples(st.just("group"), st.integers(2, 3)),
    st.tuples(
        st.just("groups"), st.lists(st.integers(1, 3), min_size=1, max_size=3), st.booleans()
    ),
    st.tuples(
        st.just("get"), st.sampled_from(["fwd", "trainer"]), st.integers(1, 4), st.booleans()
    ),
    st.tuples(st.just("ack"), st.integers(0, 7)),
    st.tuples(st.just("nack"), st.integers(0, 7)),
    st.tuples(st.just("write"), st.integers(0, 7)),
    st.tuples(st.just("bump")),
    st.tuples(st.just("sleep"), st.sampled_from([1.0, 6.0])),
    st.tuples(st.just("crash_unit"), st.integers(0, 1)),
    st.tuples(st.just("crash_controller")),
    st.tuples(st.just("crash_mid_flush"), st.integers(0, 1)),
    st.tuples(st.just("get_cancelled"), st.integers(1, 3)),
)


def tokens_of(serial: int) -> torch.Tensor:
    return torch.tensor([serial * 10, serial * 10 + 1, serial * 10 + 2])


def resp_of(serial: int, length: int) -> torch.Tensor:
    return torch.arange(length) + 1000 * serial


class Replay:
    def __init__(self, client: tq.TransferQueueClient, queue: tq.TransferQueue) -> None:
        self.client = client
        self.queue = queue
        self.version = 0
        self.put: dict[int, int] = {}  # index -> version
        self.serial: dict[int, int] = {}  # index -> the serial number its data was built from
        self.resp_len: dict[int, int] = {}  # index -> length of its (variable) resp row
        self.next_serial = 0
        self.prompts: dict[int, int] = {}  # group id -> prompt seed
        self.acked: dict[str, set[int]] = {"fwd": set(), "trainer": set()}
        self.held: list[tq.Batch] = []
        self.logp: set[int] = set()
        self.discarded: set[int] = set()

    async def step(self, op: tuple[Any, ...]) -> None:
        kind = op[0]
        c = self.client
        if kind == "put":
            n, as_batch, length = op[1], op[2], op[3]
            serials = list(range(self.next_serial, self.next_serial + n))
            self.next_serial += n
            # one length for a batch [n, L]; lengths varying per row for a list of rows
            lengths = [length if as_batch else (length + k) % 5 for k in serials]
            rows = [resp_of(k, ln) for k, ln in zip(serials, lengths, strict=True)]
            data = {
                "tokens": torch.stack([tokens_of(k) for k in serials]),
                "resp": torch.stack(rows) if as_batch else rows,
            }
            indexes = await c.put("t", data, version=self.version)
            assert list(indexes) == sorted(indexes) and indexes[0] > max(self.put, default=-1)
            self.put.update(dict.fromkeys(indexes, self.version))
            self.serial.update(zip(indexes, serials, strict=True))
            self.resp_len.update(zip(indexes, lengths, strict=True))
        elif kind == "group":
            size = op[1]
            slot = await c.open_group("t", size, shared={"prompt": torch.tensor([size, 7])})
            for _ in range(size):
                serial = self.next_serial
                self.next_serial += 1
                data = {"tokens": tokens_of(serial)[None], "resp": resp_of(serial, 2)[None]}
                (index,) = await c.put("t", data, version=self.version, group=slot)
                assert index > max(self.put, default=-1), "indexes are never reused"
                self.put[index] = self.version
                self.serial[index] = serial
                self.resp_len[index] = 2
        elif kind == "groups":
            await self.groups(op[1], op[2])
        elif kind == "get":
            consumer, count, whole = op[1], op[2], op[3]
            columns = COLUMNS[consumer]
            sampler = tq.WHOLE_GROUPS if whole else tq.FIFO
            batch = await c.get(
                "t", consumer, columns, count, sampler=sampler, wait=False, min_count=1
            )
            if batch is not None:
                self.check_batch(consumer, batch, whole)
                self.held.append(batch)
        elif kind in ("ack", "nack", "write") and self.held:
            batch = self.held[op[1] % len(self.held)]
            if kind == "write":
                if batch.lease.consumer == "fwd":
                    try:
                        await c.put_columns(batch, {"logp": batch["tokens"].float() / 2})
                        self.logp.update(batch.indexes)
                    except tq.TransferQueueError:
                        pass  # some samples were evicted or lost meanwhile
                return
            self.held.remove(batch)
            try:
                if kind == "ack":
                    missing = await c.ack(batch)
                    self.acked[batch.lease.consumer].update(set(batch.indexes) - set(missing))
                else:
                    await c.nack(batch)
            except tq.UnknownLease:
                pass  # it expired (sleep) or the controller restarted
        elif kind == "bump":
            self.version += 1
            await c.set_version("t", self.version)
        elif kind == "sleep":
            await trio.sleep(op[1])
        elif kind == "crash_unit":
            unit = self.queue.units[f"unit-{op[1]}"]
            unit._cell.fail(RuntimeError("injected"))  # type: ignore[attr-defined]
            await trio.sleep(2.0)  # the controller notices within its check interval
        elif kind == "crash_controller":
            await restarted(self.queue.controller, fail(self.queue.controller))
            self.held.clear()  # every lease returned by the restart
        elif kind == "crash_mid_flush":
            await self.crash_mid_flush(f"unit-{op[1]}")
        elif kind == "get_cancelled":
            await self.get_cancelled(op[1])

    async def groups(self, sizes: list[int], overfill: bool) -> None:
        """Several groups opened at once, their rows put in one call (interleaved); with
        ``overfill``, a put with a row too many for the last group is refused first, naming it,
        and stores nothing."""
        c = self.client
        shared = [{"prompt": torch.tensor([size, 7])} for size in sizes]
        slots = await c.open_groups("t", sizes, shared=shared)
        order = [s.group_id for k in range(max(sizes)) for s in slots if k < s.size]
        if overfill:
            before = (await c.statistics()).controller.state.topics[0].allocated_total
            with pytest.raises(tq.GroupError) as refused:
                await c.put("t", self.rows(len(order) + 1)[0], version=self.version,
                            group=[*order, slots[-1].group_id])  # fmt: skip
            assert refused.value.group_id == slots[-1].group_id
            after = (await c.statistics()).controller.state.topics[0].allocated_total
            assert after == before, "a refused multi-group put allocated something"
        data, serials = self.rows(len(order))
        indexes = await c.put("t", data, version=self.version, group=order)
        assert indexes[0] > max(self.put, default=-1), "indexes are never reused"
        for index, serial in zip(indexes, serials, strict=True):
            self.put[index] = self.version
            self.serial[index] = serial
            self.resp_len[index] = 2

    def rows(self, n: int) -> tuple[dict[str, torch.Tensor], list[int]]:
        serials = list(range(self.next_serial, self.next_serial + n))
        self.next_serial += n
        data = {
            "tokens": torch.stack([tokens_of(k) for k in serials]),
            "resp": torch.stack([resp_of(k, 2) for k in serials]),
        }
        return data, serials

    async def crash_mid_flush(self, unit: str) -> None:
        """The controller crashes while delivering bookkeeping (an ack's deletes and marks,
        else a version's watermarks) to ``unit``, after the other unit may have taken its part:
        nothing it decided may be lost or undone."""
        queue = self.queue
        real = queue.shared.units[unit]
        crashed: list[int] = []

        async def hook(msg: Any) -> None:
            if isinstance(msg, U.UnitBatch) and not crashed:
                crashed.append(fail(queue.controller, "crash mid-flush"))
                await trio.sleep_forever()  # the flusher dies here, with its controller

        queue.shared.units[unit] = Tap(real, hook)
        try:
            if self.held:
                await self.step(("ack", 0))
            else:
                await self.client.set_version("t", self.version + 1)
                self.version += 1
            with trio.move_on_after(1):
                while not crashed:
                    await trio.sleep(0.01)
        finally:
            queue.shared.units[unit] = real
        if crashed:
            await restarted(queue.controller, crashed[0])
            self.held.clear()  # every lease returned by the restart

    async def get_cancelled(self, count: int) -> None:
        """A get waits; something makes its claim succeed and the getter is cancelled right
        then: a nack queued just before its cancel (so the lease is granted before the claim is
        withdrawn: the claimant never sees it), or a group put (the getter may be fetching).
        Nothing may stay leased."""
        got: list[tq.Batch] = []
        scope = trio.CancelScope()
        mine = [b for b in self.held if b.lease.consumer == "fwd"]

        async def getter() -> None:
            with scope:
                batch = await self.client.get("t", "fwd", COLUMNS["fwd"], count, min_count=1)
                got.append(batch)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(getter)
            await trio.testing.wait_all_tasks_blocked()
            if mine:
                self.held.remove(mine[0])
                self.queue.controller.send_nowait(M.Nack(mine[0].lease.id))
            else:
                await self.step(("group", 2))
            scope.cancel()
        for batch in got:  # the cancel came too late: it is an ordinary batch
            self.check_batch("fwd", batch, False)
            self.held.append(batch)
        await trio.testing.wait_all_tasks_blocked()
        state = self.queue.shared.state
        assert state is not None
        outstanding = {lease.id for lease in state.leases()}
        assert outstanding <= {b.lease.id for b in self.held}, "a cancelled get kept a lease"

    def check_batch(self, consumer: str, batch: tq.Batch, whole: bool) -> None:
        assert not set(batch.indexes) & self.acked[consumer], "redelivered after ack"
        for index, version in zip(batch.indexes, batch.versions, strict=True):
            assert self.put[index] == version
            assert version >= self.version - STALENESS, "handed out outside the window"
        expected = torch.stack([tokens_of(self.serial[i]) for i in batch.indexes])
        assert torch.equal(batch["tokens"], expected), "a batch carries other data than was put"
        if consumer == "trainer":
            assert torch.equal(batch["logp"], batch["tokens"].float() / 2)
        else:
            rows = batch["resp"]
            assert isinstance(rows, list) and len(rows) == len(batch)
            for index, row in zip(batch.indexes, rows, strict=True):
                want = resp_of(self.serial[index], self.resp_len[index])
                assert row.shape == want.shape and torch.equal(row, want), "a row came back changed"
            for gid, prompt in batch.shared["prompt"].items():
                assert prompt[1] == 7 and gid in batch.group_ids
        if whole:
            sizes: dict[int, int] = {}
            for gid in batch.group_ids:
                sizes[gid] = sizes.get(gid, 0) + 1
            for gid, n in sizes.items():
                if n > 1 or gid in batch.shared.get("prompt", {}):
                    assert n == sum(1 for g in batch.group_ids if g == gid)

    async def drain(self) -> None:
        c = self.client
        for batch in self.held:
            try:
                await c.nack(batch)
            except tq.UnknownLease:
                pass
        self.held.clear()
        while True:
            fwd = await c.get("t", "fwd", ["tokens"], 64, min_count=1, wait=False)
            if fwd is not None:
                try:
                    await c.put_columns(fwd, {"logp": fwd["tokens"].float() / 2})
                except tq.TransferQueueError:
                    pass
                self.acked["fwd"].update(set(fwd.indexes) - set(await c.ack(fwd)))
            train = await c.get("t", "trainer", ["tokens", "logp"], 64, min_count=1, wait=False)
            if train is not None:
                self.check_batch("trainer", train, False)
                self.acked["trainer"].update(set(train.indexes) - set(await c.ack(train)))
            if fwd is None and train is None:
                break
        # samples fwd acked without writing logp can never be ready for the trainer: a writer
        # would discard them (and so do we); everything else must be gone by now
        stuck = sorted(self.acked["fwd"] - self.acked["trainer"] - self.logp)
        live = []
        for index in stuck:
            try:
                await c.discard("t", [index])
                live.append(index)
            except tq.UnknownSample:
                pass  # evicted or lost: reported
        self.discarded = set(live)


@given(schedule=st.lists(ops, min_size=5, max_size=30))
@settings(
    max_examples=60,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow],
)
def test_random_schedules_keep_every_promise(schedule: list[tuple[Any, ...]]) -> None:
    async def main() -> None:
        async with afa.open_actor_system() as system:
            config = tq.TransferQueueConfig(
                topics=(SPEC,), units=2, unit_check_interval=0.5, max_restarts=1000
            )
            async with tq.open_transfer_queue(system, config) as queue:
                client = await queue.client("replay")
                replay = Replay(client, queue)
                for op in schedule:
                    await replay.step(op)
                    # the controller's invariants (its module docstring), after every step
                    assert await queue.controller.ask(M.CheckInvariants()) == ()
                await replay.drain()
                reported: set[int] = set()
                events = (
                    await client.events() if (await client.statistics()).controller.events else None
                )
                for event in events.events if events else ():
                    reported.update(event.indexes)
                everyone = replay.acked["fwd"] & replay.acked["trainer"]
                unaccounted = set(replay.put) - everyone - reported - replay.discarded
                assert not unaccounted, f"silently dropped: {sorted(unaccounted)}"
                await client.flush()
                stats = await client.statistics()
                assert stats.controller.state.topics[0].live == 0
                for unit in stats.units.values():
                    assert unit is not None
                    assert (unit.nbytes, unit.samples, unit.groups) == (0, 0, 0)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
