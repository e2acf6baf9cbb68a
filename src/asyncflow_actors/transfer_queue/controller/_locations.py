"""The controller's :class:`Locations`: where rows put through shared memory lie (internal).

A lease carries, for each unit whose rows of the lease are all located (see ``_located``), the
parts a ``Fetch`` from that unit would return, so a reader on the host maps them without asking
the unit. :class:`Locations` belongs to one controller incarnation: a restarted controller knows
none (readers fetch from the units), and a unit's locations go with its loss.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from .._located import Located
from .._results import Lease
from .._runtime import itemsize
from .._spec import TopicSpec
from .._unit_messages import ShmBody


class _Block:
    __slots__ = ("columns", "segment", "unit")

    def __init__(self, unit: str, located: Located) -> None:
        self.unit = unit
        self.segment = located.segment
        self.columns = located.columns


class Locations:
    """See the module docstring."""

    def __init__(self) -> None:
        self._rows: dict[str, dict[int, tuple[_Block, int]]] = {}  # topic -> index -> cell

    def add(self, topic: str, unit: str, located: Located) -> None:
        block = _Block(unit, located)
        rows = self._rows.setdefault(topic, {})
        for r, index in enumerate(located.indexes):
            rows[index] = (block, r)

    def drop(self, topic: str, indexes: Iterable[int]) -> None:
        """Forget rows (freed, or rewritten elsewhere)."""
        rows = self._rows.get(topic)
        if rows:
            for index in indexes:
                rows.pop(index, None)

    def drop_unit(self, unit: str) -> None:
        """Forget every row on ``unit`` (it was lost)."""
        for rows in self._rows.values():
            for index in [i for i, (block, _) in rows.items() if block.unit == unit]:
                del rows[index]

    def parts(
        self, topic: str, indexes: Sequence[int], columns: Iterable[str]
    ) -> dict[str, list[Any]] | None:
        """``columns`` of ``indexes`` as a ``Fetch`` of their unit would return them (runs of
        consecutive rows as one body, rows stored one by one as lists), or ``None`` if any
        cell is not located."""
        rows = self._rows.get(topic)
        if not rows:
            return None
        cells = [rows.get(i) for i in indexes]
        if any(cell is None for cell in cells):
            return None
        runs: list[tuple[_Block, int, int]] = []  # (block, first row, count), in order
        for block, r in cells:  # type: ignore[misc]
            if runs and runs[-1][0] is block and runs[-1][1] + runs[-1][2] == r:
                runs[-1] = (block, runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((block, r, 1))
        out: dict[str, list[Any]] = {}
        for column in columns:
            parts: list[Any] = []
            for run in runs:
                block, first, count = run
                body = block.columns.get(column)
                if body is None:
                    return None
                if isinstance(body, ShmBody):
                    parts.append(_rows(run, column))
                    continue
                values = [
                    attrs.evolve(body[r], segment=block.segment)
                    for r in range(first, first + count)
                ]
                if parts and isinstance(parts[-1], list):
                    parts[-1].extend(values)
                else:
                    parts.append(values)
            out[column] = parts
        return out

    def of_lease(self, lease: Lease, spec: TopicSpec) -> dict[str, Any]:
        """The lease's parts on units whose rows all lie in shared memory (a unit that also
        holds group-shared columns the lease needs is fetched from, as usual)."""
        per_sample = [c for c in lease.columns if not spec.columns[c].shared]
        shared = len(per_sample) < len(lease.columns)
        out = {}
        for unit, indexes in lease.placement.items():
            if not (shared and lease.shared.get(unit)):
                parts = self.parts(lease.topic, indexes, per_sample)
                if parts is not None:
                    out[unit] = parts
        return out


def _rows(run: tuple[_Block, int, int], column: str) -> ShmBody:
    block, first, count = run
    body = block.columns[column]
    assert isinstance(body, ShmBody)
    row_bytes = itemsize(body.dtype) * math.prod(body.shape[1:])
    return ShmBody(
        body.offset + first * row_bytes, body.dtype, (count, *body.shape[1:]), block.segment
    )
