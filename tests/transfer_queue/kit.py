"""Helpers shared by the TransferQueue core tests."""

from __future__ import annotations

from asyncflow_actors.transfer_queue import ColumnSpec, ControllerState, TopicSpec

T = "rollout"
ALL = frozenset({"prompt", "resp", "lp"})
RESP = frozenset({"resp"})


def topic(
    *,
    staleness: int = 1,
    capacity: int | None = None,
    consumers: tuple[str, ...] = ("fwd", "train"),
    ttl: float = 10.0,
    write_ttl: float | None = 600.0,
) -> TopicSpec:
    return TopicSpec(
        name=T,
        columns={
            "prompt": ColumnSpec(dtype="int64", shape=(None,), shared=True),
            "resp": ColumnSpec(dtype="int64", shape=(None,)),
            "lp": ColumnSpec(dtype="float32", shape=(None,)),
        },
        consumers=consumers,
        staleness=staleness,
        capacity=capacity,
        lease_ttl=ttl,
        write_ttl=write_ttl,
    )


def make(units: tuple[str, ...] = ("u0", "u1"), **kw: object) -> ControllerState:
    return ControllerState([topic(**kw)], units)  # type: ignore[arg-type]


def put_group(
    state: ControllerState,
    size: int,
    *,
    version: int = 0,
    columns: frozenset[str] = ALL,
    lengths: list[int] | None = None,
) -> tuple[int, tuple[int, ...]]:
    """Open a group, allocate and write all its members; returns (group id, indexes)."""
    slot = state.open_group(T, size)
    alloc = state.allocate(T, size, version, group=slot.group_id, lengths=lengths)
    if "prompt" in columns:
        state.commit_shared(T, slot.group_id, {"prompt": 1000})
    per = columns - {"prompt"}
    if per:
        state.commit_write(T, alloc.indexes, dict.fromkeys(per, 10))
    return slot.group_id, alloc.indexes


def put(
    state: ControllerState, n: int, *, version: int = 0, columns: frozenset[str] = RESP
) -> tuple[int, ...]:
    """Allocate ``n`` ungrouped samples and write ``columns`` (per-sample ones)."""
    alloc = state.allocate(T, n, version)
    per = columns - {"prompt"}
    if per:
        state.commit_write(T, alloc.indexes, dict.fromkeys(per, 10))
    if "prompt" in columns:
        for gid in alloc.group_ids:
            state.commit_shared(T, gid, {"prompt": 1000})
    return alloc.indexes
