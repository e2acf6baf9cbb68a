"""Build the statistics snapshot of one topic from its tables (internal)."""

from __future__ import annotations

import numpy as np

from .._stats import ConsumerStatistics, TopicStatistics, ViewStatistics
from ._topic import Topic


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
