"""Statistics snapshots of the controller state (frozen values)."""

from __future__ import annotations

from collections.abc import Mapping

import attrs


@attrs.frozen
class ViewStatistics:
    """What one consumer could claim now for one column set (views exist once claimed/queried).

    ``ready``: candidate samples (ready for ``columns``, fresh, neither acked nor leased by the
    consumer). ``ready_groups`` / ``ready_group_samples``: groups a whole-group claim could take.
    """

    consumer: str
    columns: frozenset[str]
    ready: int
    ready_groups: int
    ready_group_samples: int


@attrs.frozen
class ConsumerStatistics:
    """Per consumer: live samples it holds under leases, and live samples it acked."""

    consumer: str
    leased: int
    consumed: int


@attrs.frozen
class TopicStatistics:
    """A topic's counts. Totals (``*_total``) count since the state was created or rebuilt.

    Every allocated sample is in exactly one place:
    ``allocated_total == live + freed_total + evicted_total + lost_total + discarded_total``.
    """

    topic: str
    latest_version: int
    oldest_fresh_version: int
    staleness: int
    capacity: int | None
    occupied: int
    reserved: int
    live: int
    written: int
    groups: int
    complete_groups: int
    pending_eviction_groups: int
    consumers: tuple[ConsumerStatistics, ...]
    views: tuple[ViewStatistics, ...]
    leases: int
    live_bytes: int
    shared_bytes: int
    dedup_bytes_saved: int
    allocated_total: int
    freed_total: int
    evicted_total: int
    evicted_groups_total: int
    lost_total: int
    lost_groups_total: int
    discarded_total: int
    changes: int


@attrs.frozen
class HolderStatistics:
    """What one holder (a client, e.g. a worker's name) has outstanding in one topic: who
    waits on whom when a run stalls (``docs/pipeline.md``, Watchdog).

    ``consumer``: the consumer its leases and claims are for (``""``: none). ``leases`` /
    ``leased``: leases it holds and their samples; ``claims`` / ``claimed``: claims of it
    waiting in the queue and the samples they ask for; ``uncommitted``: samples it allocated
    and has not committed; ``open_groups``: groups it opened whose members are not all
    committed (``group_ids``: the first ``GROUP_IDS`` of those and of the groups of its
    uncommitted samples); ``puts``: its puts waiting for capacity.
    """

    holder: str
    topic: str
    consumer: str = ""
    leases: int = 0
    leased: int = 0
    claims: int = 0
    claimed: int = 0
    uncommitted: int = 0
    open_groups: int = 0
    group_ids: tuple[int, ...] = ()
    puts: int = 0


GROUP_IDS = 16  # group ids a ``HolderStatistics`` names at most


@attrs.frozen
class StateStatistics:
    """Snapshot of the whole controller state: per topic, occupied slots per unit, leases."""

    topics: tuple[TopicStatistics, ...]
    units: Mapping[str, int] = attrs.field(hash=False)
    leases: int
