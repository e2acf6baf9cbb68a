"""Statistics snapshots of the controller state (frozen values)."""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import numpy as np

from .state._topic import Topic


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
class StateStatistics:
    """Snapshot of the whole controller state: per topic, occupied slots per unit, leases."""

    topics: tuple[TopicStatistics, ...]
    units: Mapping[str, int] = attrs.field(hash=False)
    leases: int


def topic_statistics(t: Topic) -> TopicStatistics:
    """Build the snapshot of one topic (O(groups + views))."""
    consumers = t.spec.consumers
    g = t.g
    live = g.live[: g.n]
    complete = int(np.count_nonzero(live & (g.alloc[: g.n] == g.size[: g.n])))
    doomed = t.ndoomed
    saved = int((g.nbytes[: g.n] * np.maximum(g.size[: g.n] - 1, 0))[live].sum())
    views = [(v, t.ready_groups(v)) for v in t.views.values()]
    return TopicStatistics(
        topic=t.name,
        latest_version=t.latest,
        oldest_fresh_version=max(t.threshold, 0),
        staleness=t.spec.staleness,
        capacity=t.spec.capacity,
        occupied=t.occupied,
        reserved=t.reserved,
        live=t.s.nlive,
        written=t.written,
        groups=g.nlive,
        complete_groups=complete,
        pending_eviction_groups=doomed,
        consumers=tuple(
            ConsumerStatistics(consumer=c, leased=t.leased_count[i], consumed=t.consumed_count[i])
            for i, c in enumerate(consumers)
        ),
        views=tuple(
            ViewStatistics(
                consumer=consumers[v.ci],
                columns=v.columns,
                ready=v.nready,
                ready_groups=groups,
                ready_group_samples=samples,
            )
            for v, (groups, samples) in views
        ),
        leases=t.leases,
        live_bytes=t.live_bytes,
        shared_bytes=t.shared_total,
        dedup_bytes_saved=saved,
        allocated_total=t.allocated_total,
        freed_total=t.freed_total,
        evicted_total=t.evicted_total,
        evicted_groups_total=t.evicted_groups,
        lost_total=t.lost_total,
        lost_groups_total=t.lost_groups,
        discarded_total=t.discarded_total,
        changes=t.changes,
    )
