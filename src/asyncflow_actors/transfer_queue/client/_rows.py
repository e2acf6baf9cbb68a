"""Some rows of a lease, fetched by a reader that did not claim it (a trainer's rank).

The claimant holds the lease (and acks it); a reader it hands a :class:`LeaseView` (the lease's
placement, incarnations and located parts, as plain values) reads only the rows it needs: a
unit whose rows of the lease are located is mapped at once, without asking it (its rows picked
from the mapping: only their pages are read), else the unit is asked for those rows alone, with
the group-shared columns of their groups. Every request is bounded by the reader's
``UnitIO.timeout``; any failure is one :class:`StorageUnavailable` naming the unit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from .._errors import StorageUnavailable
from .._spec import TopicSpec
from .._unit_messages import Fetch, Fetched, UnitError
from ._batch import assemble, materialize, take
from ._unit_io import UnitIO, _mapped


@attrs.frozen
class LeaseView:
    """What a reader needs of a lease to fetch rows of it: ``indexes`` and ``group_ids`` in
    the lease's order, ``placement`` (unit -> its indexes), ``shared`` (unit -> the groups whose
    shared columns it holds), the units' ``incarnations`` and ``located`` parts."""

    topic: str
    indexes: tuple[int, ...]
    group_ids: tuple[int, ...]
    placement: Mapping[str, Sequence[int]]
    shared: Mapping[str, Sequence[int]]
    incarnations: Mapping[str, str]
    located: Mapping[str, dict[str, list[Any]]]


async def fetch_rows(
    io: UnitIO,
    spec: TopicSpec,
    view: LeaseView,
    positions: Sequence[int],
    columns: Sequence[str],
    shared_columns: Sequence[str] = (),
) -> tuple[dict[str, Any], dict[str, dict[int, Any]]]:
    """The lease's rows at ``positions`` (places in ``view.indexes``): the per-sample
    ``columns`` in the order of ``positions`` (as ``get`` assembles them) and the
    ``shared_columns`` of their groups (``{column: {group: value}}``). Raises
    :class:`StorageUnavailable` naming the unit that failed (its ``unit``)."""
    wanted = {view.indexes[p] for p in positions}
    groups = {view.group_ids[p] for p in positions}
    mine = {u: [i for i in ix if i in wanted] for u, ix in view.placement.items()}
    need = {u: [g for g in gs if g in groups] for u, gs in view.shared.items()}
    units = [u for u in view.placement if mine.get(u) or (shared_columns and need.get(u))]
    units += [u for u in view.shared if u not in view.placement and shared_columns and need[u]]

    def make(unit: str) -> Callable[[], Any]:
        async def one() -> tuple[dict[str, list[Any]], dict[int, dict[str, Any]]]:
            incarnation = view.incarnations.get(unit, "")
            shm = await io._prefix(unit, incarnation) is not None
            parts = view.located.get(unit) if shm and not need.get(unit) else None
            mapped = io.map_located(parts, unit) if parts is not None and mine.get(unit) else None
            if mapped is not None:
                where = {i: k for k, i in enumerate(view.placement[unit])}
                rows = [where[i] for i in mine[unit]]
                return {
                    c: [take(assemble(spec.columns[c], materialize(mapped.columns[c]), None), rows)]
                    for c in columns
                }, {}  # fmt: skip
            msg = Fetch(
                view.topic, incarnation, mine.get(unit, []), list(columns),
                list(need.get(unit, ())) if shared_columns else [], list(shared_columns), shm,
            )  # fmt: skip
            try:
                fetched: Fetched = await io._ask(unit, msg)
            except UnitError as exc:  # it lacks samples of the lease: their data is lost
                raise StorageUnavailable(f"storage unit {unit!r}: {exc}") from exc
            if shm:
                fetched = _mapped(fetched, unit)
            return fetched.columns, fetched.shared

        return one

    def named(unit: str) -> Callable[[], Any]:
        async def one() -> Any:
            try:
                return await make(unit)()
            except StorageUnavailable as exc:
                exc.unit = unit
                raise

        return one

    results = await io._each({unit: named(unit) for unit in units})
    order = [u for u in units if mine.get(u)]
    arrived = [i for u in order for i in mine[u]]
    where = {index: k for k, index in enumerate(arrived)}
    perm = [where[view.indexes[p]] for p in positions]
    data = {
        c: assemble(
            spec.columns[c],
            [materialize(p) for u in order for p in results[u][0][c]],
            None if perm == list(range(len(perm))) else perm,
        )
        for c in columns
    }
    shared: dict[str, dict[int, Any]] = {c: {} for c in shared_columns}
    for unit in units:
        for gid, blobs in results[unit][1].items():
            for column, value in blobs.items():
                shared[column][gid] = materialize(value)
    return data, shared
