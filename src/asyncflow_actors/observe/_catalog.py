"""The metric names of a run, with their kind, unit, labels and meaning (``docs/observability.md``).

Every metric the library emits or polls is declared here, so names and units are documented in
one place and a typo fails loudly instead of creating a new series. Metrics of your own are
declared with ``MetricsRegistry.declare``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Literal

import attrs

MetricKind = Literal["counter", "gauge", "histogram"]
_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")


class MetricError(ValueError):
    """A metric used against its declaration: unknown name, wrong kind, wrong label names."""


def _check_name(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not _NAME.match(value):
        raise MetricError(
            f"metric {attribute.name} must match [a-zA-Z_][a-zA-Z0-9_]*, got {value!r}"
        )


def _check_labels(_: object, __: object, value: tuple[str, ...]) -> None:
    for label in value:
        if not isinstance(label, str) or not _NAME.match(label) or label.startswith("__"):
            raise MetricError(f"label names must match [a-zA-Z_][a-zA-Z0-9_]*, got {label!r}")
    if len(set(value)) != len(value):
        raise MetricError(f"duplicate label names in {value!r}")


def _check_buckets(info: MetricInfo, _: object, value: tuple[float, ...]) -> None:
    if info.kind == "histogram":
        if not value or any(b >= a for a, b in zip(value[1:], value[:-1], strict=True)):
            raise MetricError(
                f"histogram {info.name!r} needs strictly increasing bucket bounds, got {value!r}"
            )
    elif value:
        raise MetricError(f"{info.kind} {info.name!r} takes no buckets, got {value!r}")


def _str_tuple(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(values)


def _float_tuple(values: Iterable[float]) -> tuple[float, ...]:
    return tuple(float(x) for x in values)


@attrs.frozen
class MetricInfo:
    """What a metric is: ``kind``, ``unit`` (``"seconds"``, ``"samples"``, ...), label names.

    A histogram's ``buckets`` are the upper bounds (inclusive) of its finite buckets, increasing;
    one more bucket, ``+Inf``, catches the rest.
    """

    name: str = attrs.field(validator=_check_name)
    kind: MetricKind = attrs.field(
        validator=attrs.validators.in_(("counter", "gauge", "histogram"))
    )
    unit: str
    help: str
    labels: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple, validator=_check_labels)
    buckets: tuple[float, ...] = attrs.field(
        default=(), converter=_float_tuple, validator=_check_buckets
    )


def _c(name: str, unit: str, help: str, *labels: str) -> MetricInfo:
    return MetricInfo(name, "counter", unit, help, labels)


def _g(name: str, unit: str, help: str, *labels: str) -> MetricInfo:
    return MetricInfo(name, "gauge", unit, help, labels)


def _h(name: str, unit: str, help: str, buckets: tuple[float, ...], *labels: str) -> MetricInfo:
    return MetricInfo(name, "histogram", unit, help, labels, buckets)


SYNC_PHASES = ("pause", "prepare", "broadcast", "finalize", "load", "resume", "total")
"""The phases of a weight sync, as ``phase`` label values of the ``afa_sync_*`` metrics."""

_SECONDS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0)

CATALOG: dict[str, MetricInfo] = {
    m.name: m
    for m in (
        # The actor runtime, polled from every process by the observer and its agents.
        _g(
            "afa_actor_mailbox_depth",
            "messages",
            "messages queued in the mailbox",
            "process",
            "actor",
        ),
        _g(
            "afa_actor_senders_waiting",
            "tasks",
            "senders parked on a full mailbox",
            "process",
            "actor",
        ),
        _c("afa_actor_processed_total", "messages", "messages handled", "process", "actor"),
        _c("afa_actor_restarts_total", "restarts", "supervised restarts", "process", "actor"),
        _c(
            "afa_actor_dead_letters_total",
            "messages",
            "tells dropped at a crash",
            "process",
            "actor",
        ),
        _g("afa_process_actors", "actors", "live actors in the process", "process"),
        _c("afa_trace_spans_total", "spans", "spans recorded by the process", "process"),
        _c("afa_trace_spans_dropped_total", "spans", "spans lost to a full buffer", "process"),
        # The TransferQueue, polled through a client's statistics().
        _g("afa_tq_live_samples", "samples", "live samples", "topic"),
        _g("afa_tq_occupied_slots", "samples", "live samples plus reserved group slots", "topic"),
        _g("afa_tq_capacity_slots", "samples", "capacity (absent when unbounded)", "topic"),
        _g(
            "afa_tq_ready_samples",
            "samples",
            "claimable now by the consumer: queue depth",
            "topic",
            "consumer",
        ),
        _g(
            "afa_tq_leased_samples",
            "samples",
            "held under the consumer's leases",
            "topic",
            "consumer",
        ),
        _g(
            "afa_tq_backlog_samples",
            "samples",
            "live, not yet taken by the consumer",
            "topic",
            "consumer",
        ),
        _g("afa_tq_latest_version", "version", "latest policy version", "topic"),
        _g("afa_tq_oldest_fresh_version", "version", "oldest version inside the window", "topic"),
        _g("afa_tq_leases", "leases", "outstanding leases", "topic"),
        _g("afa_tq_live_bytes", "bytes", "bytes of live samples", "topic"),
        _g(
            "afa_tq_dedup_saved_bytes",
            "bytes",
            "bytes not stored thanks to group-shared columns",
            "topic",
        ),
        _c("afa_tq_allocated_total", "samples", "samples allocated", "topic"),
        _c(
            "afa_tq_freed_total", "samples", "samples consumed by every consumer and freed", "topic"
        ),
        _c("afa_tq_evicted_total", "samples", "samples evicted as stale", "topic"),
        _c("afa_tq_lost_total", "samples", "samples lost with a storage unit", "topic"),
        _c("afa_tq_discarded_total", "samples", "samples discarded by writers", "topic"),
        _g("afa_tq_waiting_puts", "requests", "puts parked on capacity"),
        _g("afa_tq_waiting_claims", "requests", "gets parked until samples are ready"),
        _g("afa_tq_units_down", "units", "storage units currently lost"),
        _g("afa_tq_unit_bytes", "bytes", "bytes held by a storage unit", "unit"),
        _g("afa_tq_unit_samples", "samples", "samples held by a storage unit", "unit"),
        # FlowControl (admission of prompts), polled.
        _g("afa_flow_capacity_slots", "samples", "(staleness + 1) x batch size", "flow"),
        _g("afa_flow_in_flight_slots", "samples", "slots acquired and not released", "flow"),
        _g("afa_flow_waiters", "tasks", "acquirers waiting for slots", "flow"),
        # Roles (emitted by the pipeline's stations through the registry).
        _c("afa_role_samples_total", "samples", "samples a worker finished", "role", "worker"),
        _c(
            "afa_role_tokens_total",
            "tokens",
            "tokens a worker generated or processed",
            "role",
            "worker",
        ),
        _c(
            "afa_role_steps_total", "batches", "batches (steps) a worker finished", "role", "worker"
        ),
        _c(
            "afa_role_busy_seconds_total",
            "seconds",
            "time spent computing (not waiting)",
            "role",
            "worker",
        ),
        _c(
            "afa_role_wait_seconds_total",
            "seconds",
            "time blocked on the TQ or FlowControl",
            "role",
            "worker",
            "op",
        ),
        _g("afa_policy_version", "version", "policy version the worker runs", "role", "worker"),
        _g("afa_reward_mean", "reward", "mean reward of the last batch", "role"),
        _h(
            "afa_train_staleness_versions",
            "versions",
            "trained samples' version lag",
            (0, 1, 2, 3, 4, 6, 8, 16),
        ),
        _g("afa_rollout_paused", "bool", "1 while the generation engine is paused", "worker"),
        # Weight sync (the checkpoint layer).
        _c("afa_sync_total", "syncs", "weight syncs completed"),
        _c("afa_sync_failures_total", "syncs", "weight syncs that failed (resume still ran)"),
        _h(
            "afa_sync_duration_seconds", "seconds", "duration of each sync phase", _SECONDS, "phase"
        ),
        _g("afa_sync_last_seconds", "seconds", "duration of the last sync's phases", "phase"),
        _g("afa_sync_last_version", "version", "version the last sync delivered"),
        _g("afa_sync_last_bytes", "bytes", "bytes the last sync broadcast"),
        _c("afa_sync_bytes_total", "bytes", "bytes broadcast by syncs"),
    )
}
"""Every metric the library knows, by name."""
