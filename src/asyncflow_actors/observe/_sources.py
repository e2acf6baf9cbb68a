"""Mirror the TransferQueue's and FlowControl's statistics into a metrics registry.

Lower layers never import ``observe``: the observer polls their public ``statistics()`` and
writes the catalog's ``afa_tq_*`` and ``afa_flow_*`` series from them.
"""

from __future__ import annotations

from ..transfer_queue import FlowControlStatistics, TransferQueueStatistics
from ._metrics import MetricsRegistry

_TOPIC_TOTALS = (
    ("afa_tq_allocated_total", "allocated_total"),
    ("afa_tq_freed_total", "freed_total"),
    ("afa_tq_evicted_total", "evicted_total"),
    ("afa_tq_lost_total", "lost_total"),
    ("afa_tq_discarded_total", "discarded_total"),
)


def record_transfer_queue(registry: MetricsRegistry, stats: TransferQueueStatistics) -> None:
    """Per topic: sizes, versions, bytes, totals; per (topic, consumer): ready, leased, backlog.

    ``ready`` is what the consumer could claim now (the largest of its views, one per column
    set); ``backlog`` is every live sample it has neither acked nor leased, ready or not.
    """
    controller = stats.controller
    for t in controller.state.topics:
        topic = t.topic
        registry.gauge("afa_tq_live_samples", topic=topic).set(t.live)
        registry.gauge("afa_tq_occupied_slots", topic=topic).set(t.occupied)
        if t.capacity is not None:
            registry.gauge("afa_tq_capacity_slots", topic=topic).set(t.capacity)
        registry.gauge("afa_tq_latest_version", topic=topic).set(t.latest_version)
        registry.gauge("afa_tq_oldest_fresh_version", topic=topic).set(t.oldest_fresh_version)
        registry.gauge("afa_tq_leases", topic=topic).set(t.leases)
        registry.gauge("afa_tq_live_bytes", topic=topic).set(t.live_bytes)
        registry.gauge("afa_tq_dedup_saved_bytes", topic=topic).set(t.dedup_bytes_saved)
        for metric, field in _TOPIC_TOTALS:
            registry.counter(metric, topic=topic).set_total(getattr(t, field))
        ready: dict[str, int] = {}
        for view in t.views:
            ready[view.consumer] = max(ready.get(view.consumer, 0), view.ready)
        for c in t.consumers:
            registry.gauge("afa_tq_ready_samples", topic=topic, consumer=c.consumer).set(
                ready.get(c.consumer, 0)
            )
            registry.gauge("afa_tq_leased_samples", topic=topic, consumer=c.consumer).set(c.leased)
            registry.gauge("afa_tq_backlog_samples", topic=topic, consumer=c.consumer).set(
                t.live - c.consumed - c.leased
            )
    registry.gauge("afa_tq_waiting_puts").set(controller.waiting_puts)
    registry.gauge("afa_tq_waiting_claims").set(controller.waiting_claims)
    registry.gauge("afa_tq_units_down").set(len(controller.units_down))
    for unit, unit_stats in stats.units.items():
        if unit_stats is None:  # unreachable this time: keep the last values
            continue
        registry.gauge("afa_tq_unit_bytes", unit=unit).set(
            unit_stats.nbytes + unit_stats.shared_nbytes
        )
        registry.gauge("afa_tq_unit_samples", unit=unit).set(unit_stats.samples)


def record_flow_control(registry: MetricsRegistry, stats: FlowControlStatistics, name: str) -> None:
    registry.gauge("afa_flow_capacity_slots", flow=name).set(stats.capacity)
    registry.gauge("afa_flow_in_flight_slots", flow=name).set(stats.in_flight)
    registry.gauge("afa_flow_waiters", flow=name).set(stats.waiters)
