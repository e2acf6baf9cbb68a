"""Inventory records: the per-sample metadata storage units keep so a controller can be rebuilt.

A storage unit holds, next to the data, one :class:`SampleRecord` per sample it stores, one
:class:`GroupRecord` per group placed on it, and the latest :class:`TopicRecord` of every topic.
After a controller restart the wrapper collects every unit's :class:`Inventory`, merges them with
:meth:`Inventory.merge`, and calls ``ControllerState.from_inventory``. To keep the records
accurate the wrapper forwards to the units: allocations (sample and group records), column writes
(the unit sees them), group changes (``open_group``, ``allocate`` into a group, ``shrink_group``,
``discard``), acks (``acked`` consumers of each sample) and version bumps / index watermarks
(topic records), and it applies every :class:`Release`.
"""

from __future__ import annotations

import types
from collections.abc import Iterable, Mapping

import attrs


def _frozen_map(value: Mapping[str, int]) -> Mapping[str, int]:
    return types.MappingProxyType(dict(value))


def _names(value: Iterable[str]) -> frozenset[str]:
    return frozenset(value)


@attrs.frozen
class SampleRecord:
    """One live sample: where it is, its version and length, its columns (bytes each), the
    consumers that acked it, and whether its writer committed it (an uncommitted sample was
    stored but its put had not finished: it expires ``write_ttl`` after a rebuild unless the
    writer commits it)."""

    topic: str
    index: int
    version: int
    group_id: int
    unit: str
    length: int
    columns: Mapping[str, int] = attrs.field(converter=_frozen_map, hash=False)
    acked: frozenset[str] = attrs.field(converter=_names)
    committed: bool = True


@attrs.frozen
class GroupRecord:
    """One live group: expected ``size``, members ``allocated`` so far (not discarded, freed ones
    included), and its shared columns present (bytes each). ``explicit``: opened with
    ``open_group`` (else the implicit group of one ungrouped sample)."""

    topic: str
    group_id: int
    unit: str
    size: int
    allocated: int
    shared: Mapping[str, int] = attrs.field(converter=_frozen_map, hash=False)
    explicit: bool = True


@attrs.frozen
class TopicRecord:
    """A topic's latest version and id watermarks (next index and group id never reused)."""

    topic: str
    latest_version: int
    next_index: int
    next_group_id: int


@attrs.frozen
class Inventory:
    """Records from one or several storage units."""

    topics: tuple[TopicRecord, ...] = ()
    groups: tuple[GroupRecord, ...] = ()
    samples: tuple[SampleRecord, ...] = ()

    @classmethod
    def merge(cls, parts: Iterable[Inventory]) -> Inventory:
        """Union of unit inventories; topic records merge by maximum (each field)."""
        topics: dict[str, TopicRecord] = {}
        groups: list[GroupRecord] = []
        samples: list[SampleRecord] = []
        for part in parts:
            for rec in part.topics:
                old = topics.get(rec.topic)
                topics[rec.topic] = (
                    rec
                    if old is None
                    else TopicRecord(
                        topic=rec.topic,
                        latest_version=max(old.latest_version, rec.latest_version),
                        next_index=max(old.next_index, rec.next_index),
                        next_group_id=max(old.next_group_id, rec.next_group_id),
                    )
                )
            groups.extend(part.groups)
            samples.extend(part.samples)
        return cls(topics=tuple(topics.values()), groups=tuple(groups), samples=tuple(samples))
