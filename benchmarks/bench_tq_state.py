"""Micro-benchmark of the TransferQueue control-plane core (no I/O, no data).

Prints JSON lines ``{"name", "value", "unit"}``:

- ``tq_claims_per_s``: sample selections per second by ``ControllerState.claim`` (FIFO over
  ungrouped samples, batches of 256, each acked) with 100k ready samples; median of repeats.
- ``tq_claims_per_s_whole_groups``: the same with whole-group claims over groups of 8.
- ``tq_allocate_commit_per_s``: samples allocated and written per second (batches of 256).

Usable from the coordinator's ``bench_tq.py``: ``from bench_tq_state import bench_claims``.
"""

from __future__ import annotations

import json
import statistics
import time

from asyncflow_actors.transfer_queue import (
    FIFO,
    WHOLE_GROUPS,
    ColumnSpec,
    ControllerState,
    Sampler,
    TopicSpec,
)

POOL = 100_000
BATCH = 256
GROUP = 8
COLUMNS = frozenset({"prompt_ids", "response_ids", "old_logprobs", "rewards"})


def _spec() -> TopicSpec:
    return TopicSpec(
        name="rollout",
        columns={
            "prompt_ids": ColumnSpec(dtype="int64", shape=(2048,), shared=True),
            "response_ids": ColumnSpec(dtype="int64", shape=(4096,)),
            "old_logprobs": ColumnSpec(dtype="float32", shape=(4096,)),
            "rewards": ColumnSpec(dtype="float32", shape=()),
        },
        consumers=("trainer", "logger"),
        staleness=1,
    )


PER_SAMPLE = {"response_ids": 4096 * 8, "old_logprobs": 4096 * 4, "rewards": 4}


def _filled(grouped: bool) -> ControllerState:
    """A state with ``POOL`` samples ready for ``COLUMNS``: groups of ``GROUP``, or ungrouped."""
    state = ControllerState([_spec()], ["su-0", "su-1"])
    if grouped:
        for _ in range(POOL // GROUP):
            slot = state.open_group("rollout", GROUP)
            alloc = state.allocate("rollout", GROUP, 0, group=slot.group_id)
            state.commit_shared("rollout", slot.group_id, {"prompt_ids": 2048 * 8})
            state.commit_write("rollout", alloc.indexes, PER_SAMPLE)
    else:
        for _ in range(POOL // BATCH + 1):
            alloc = state.allocate("rollout", BATCH, 0)
            for gid in alloc.group_ids:
                state.commit_shared("rollout", gid, {"prompt_ids": 2048 * 8})
            state.commit_write("rollout", alloc.indexes, PER_SAMPLE)
    return state


def bench_claims(sampler: Sampler = FIFO, *, repeats: int = 3, claims: int = 100) -> float:
    """Median sample selections per second: ``claims`` claims of ``BATCH`` samples, each acked
    (by one of two consumers, so nothing is freed), with at least ``POOL`` ready samples."""
    rates = []
    for _ in range(repeats):
        state = _filled(grouped=sampler is WHOLE_GROUPS)
        assert state.ready_count("rollout", "trainer", COLUMNS, sampler=sampler) >= POOL
        start = time.perf_counter()
        taken = 0
        for _ in range(claims):
            lease = state.claim(
                "rollout", "trainer", COLUMNS, BATCH, holder="t", now=0.0, sampler=sampler
            )
            assert lease is not None
            taken += len(lease.indexes)
            state.ack(lease.id)
        rates.append(taken / (time.perf_counter() - start))
    return statistics.median(rates)


def bench_allocate(*, repeats: int = 3, batches: int = 100) -> float:
    """Median samples allocated + committed per second (ungrouped batches of ``BATCH``)."""
    rates = []
    for _ in range(repeats):
        state = ControllerState([_spec()], ["su-0", "su-1"])
        state.ready_count("rollout", "trainer", COLUMNS)
        start = time.perf_counter()
        for _ in range(batches):
            alloc = state.allocate("rollout", BATCH, 0)
            state.commit_write("rollout", alloc.indexes, PER_SAMPLE)
        rates.append(batches * BATCH / (time.perf_counter() - start))
    return statistics.median(rates)


def main() -> None:
    for name, value in (
        ("tq_claims_per_s", bench_claims(FIFO)),
        ("tq_claims_per_s_whole_groups", bench_claims(WHOLE_GROUPS)),
        ("tq_allocate_commit_per_s", bench_allocate()),
    ):
        print(json.dumps({"name": name, "value": round(value, 1), "unit": "samples/s"}))


if __name__ == "__main__":
    main()
