"""One metrics registry per process: counters, gauges and histograms by name and labels.

A role asks the registry for a handle once (``registry.counter("afa_role_samples_total",
role="train", worker="train-0")``) and then updates it on the hot path (``handle.inc(n)``: an
attribute add, no lock — a process's actors share one trio thread). ``snapshot()`` freezes every
series into a :class:`MetricsSnapshot`, the value that exporters, the dashboard and the observer's
agents exchange.
"""

from __future__ import annotations

import bisect
import math
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from ._catalog import CATALOG, MetricError, MetricInfo

Labels = tuple[tuple[str, str], ...]


class Counter:
    """A monotonically increasing count (``inc``); ``set_total`` mirrors a count kept elsewhere."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise MetricError(f"a counter only goes up, got inc({amount!r})")
        self.value += amount

    def set_total(self, total: float) -> None:
        """Mirror a total counted elsewhere (a polled statistic); a drop reads as a reset."""
        self.value = float(total)


class Gauge:
    """A value that goes up and down."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def set(self, value: float) -> None:
        self.value = float(value)

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount


class Histogram:
    """Counts of observations per bucket (upper bounds inclusive, then ``+Inf``), sum and count."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def observe_many(self, values: Iterable[float]) -> None:
        for value in values:
            self.observe(value)

    @property
    def count(self) -> int:
        return sum(self.counts)


Metric = Counter | Gauge | Histogram


@attrs.frozen
class Series:
    """One series of a snapshot: a metric name, its labels, and its value.

    Counters and gauges carry ``value``; histograms carry ``counts`` (per bucket, ``+Inf`` last,
    not cumulative) and ``sum``.
    """

    name: str
    labels: Labels = ()
    value: float = 0.0
    counts: tuple[int, ...] = ()
    sum: float = 0.0

    @property
    def count(self) -> int:
        return sum(self.counts)

    def label(self, key: str) -> str | None:
        for k, v in self.labels:
            if k == key:
                return v
        return None


def _labels_key(labels: Mapping[str, object]) -> Labels:
    return tuple(sorted((k, str(v)) for k, v in labels.items()))


@attrs.frozen
class MetricsSnapshot:
    """Every series of a registry (or several merged) at ``time`` (unix seconds).

    ``declared`` carries the declarations of metrics outside the catalog, so a snapshot read
    elsewhere (another process, a JSONL file) still knows their kinds and units.
    """

    time: float
    series: tuple[Series, ...] = ()
    declared: tuple[MetricInfo, ...] = ()

    def info(self, name: str) -> MetricInfo:
        if name in CATALOG:
            return CATALOG[name]
        for info in self.declared:
            if info.name == name:
                return info
        raise MetricError(f"metric {name!r} is neither in the catalog nor declared")

    def find(self, name: str, **labels: object) -> Series | None:
        """The series with exactly these labels, or ``None``."""
        key = _labels_key(labels)
        for s in self.series:
            if s.name == name and s.labels == key:
                return s
        return None

    def value(self, name: str, default: float = 0.0, **labels: object) -> float:
        """A counter's or gauge's value (``default`` when the series does not exist)."""
        found = self.find(name, **labels)
        return found.value if found is not None else default

    def select(self, name: str, **labels: object) -> list[Series]:
        """Every series of ``name`` whose labels include ``labels``."""
        want = set(_labels_key(labels))
        return [s for s in self.series if s.name == name and want <= set(s.labels)]

    def total(self, name: str, **labels: object) -> float:
        """The sum of the values of ``select(name, **labels)``."""
        return sum(s.value for s in self.select(name, **labels))

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (the JSONL exporter's line); ``from_json`` reads it back."""
        out: list[dict[str, Any]] = []
        for s in self.series:
            item: dict[str, Any] = {"name": s.name, "labels": dict(s.labels)}
            if s.counts:
                item["counts"] = list(s.counts)
                item["sum"] = s.sum
            else:
                item["value"] = s.value
            out.append(item)
        declared = [attrs.asdict(info) for info in self.declared]
        return {"time": self.time, "series": out, "declared": declared}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> MetricsSnapshot:
        try:
            series = tuple(
                Series(
                    str(item["name"]),
                    _labels_key(item.get("labels", {})),
                    float(item.get("value", 0.0)),
                    tuple(int(c) for c in item.get("counts", ())),
                    float(item.get("sum", 0.0)),
                )
                for item in data["series"]
            )
            declared = tuple(MetricInfo(**info) for info in data.get("declared", ()))
            return cls(float(data["time"]), series, declared)
        except (KeyError, TypeError, ValueError) as exc:
            raise MetricError(f"not a metrics snapshot: {exc!r}") from exc


class MetricsRegistry:
    """Counters, gauges and histograms of one process, by name and labels.

    Names come from the :data:`CATALOG` or from ``declare``; the labels given must be exactly
    the declared label names (so every exporter sees consistent families). Asking twice for the
    same series returns the same handle.
    """

    def __init__(self) -> None:
        self._declared: dict[str, MetricInfo] = {}
        self._series: dict[tuple[str, Labels], Metric] = {}
        self.token = uuid.uuid4().hex  # names this registry (a process) across snapshots

    def declare(self, info: MetricInfo) -> None:
        """Declare a metric outside the catalog (idempotent for an equal declaration)."""
        known = CATALOG.get(info.name) or self._declared.get(info.name)
        if known is not None and known != info:
            raise MetricError(f"metric {info.name!r} is already declared as {known!r}")
        self._declared.setdefault(info.name, info)

    def info(self, name: str) -> MetricInfo:
        info = CATALOG.get(name) or self._declared.get(name)
        if info is None:
            raise MetricError(
                f"unknown metric {name!r}: use a catalog name (docs/observability.md) or "
                "declare it with MetricsRegistry.declare(MetricInfo(...))"
            )
        return info

    def _get(self, name: str, kind: str, labels: Mapping[str, object]) -> Metric:
        key = (name, _labels_key(labels))
        found = self._series.get(key)
        if found is not None:
            return found
        info = self.info(name)
        if info.kind != kind:
            raise MetricError(f"metric {name!r} is a {info.kind}, not a {kind}")
        if set(labels) != set(info.labels):
            raise MetricError(
                f"metric {name!r} takes labels {sorted(info.labels)}, got {sorted(labels)}"
            )
        metric: Metric
        if kind == "counter":
            metric = Counter()
        elif kind == "gauge":
            metric = Gauge()
        else:
            metric = Histogram(info.buckets)
        self._series[key] = metric
        return metric

    def counter(self, name: str, **labels: object) -> Counter:
        metric = self._get(name, "counter", labels)
        assert isinstance(metric, Counter)
        return metric

    def gauge(self, name: str, **labels: object) -> Gauge:
        metric = self._get(name, "gauge", labels)
        assert isinstance(metric, Gauge)
        return metric

    def histogram(self, name: str, **labels: object) -> Histogram:
        metric = self._get(name, "histogram", labels)
        assert isinstance(metric, Histogram)
        return metric

    def remove(self, name: str, **labels: object) -> None:
        """Forget every series of ``name`` whose labels include ``labels`` (a gone actor)."""
        want = set(_labels_key(labels))
        for key in [k for k in self._series if k[0] == name and want <= set(k[1])]:
            del self._series[key]

    def clear(self) -> None:
        """Forget every series (not the declarations) and take a new token: what a process
        starting a new run, or a test, does. Observers treat it like a restarted process."""
        self._series.clear()
        self.token = uuid.uuid4().hex

    def snapshot(self) -> MetricsSnapshot:
        series = []
        for (name, labels), metric in self._series.items():
            if isinstance(metric, Histogram):
                series.append(Series(name, labels, 0.0, tuple(metric.counts), metric.sum))
            else:
                series.append(Series(name, labels, metric.value))
        return MetricsSnapshot(time.time(), tuple(series), tuple(self._declared.values()))


def merge_snapshots(
    parts: Iterable[MetricsSnapshot], *, at: float | None = None
) -> MetricsSnapshot:
    """One snapshot from several processes' snapshots.

    Series with the same name and labels add up (counters and histograms; gauges too, which is
    right for per-process shares of one quantity and harmless when each process reports its own
    labels, as the catalog's runtime metrics do with ``process``).
    """
    values: dict[tuple[str, Labels], Series] = {}
    declared: dict[str, MetricInfo] = {}
    latest = -math.inf
    for part in parts:
        latest = max(latest, part.time)
        for info in part.declared:
            declared.setdefault(info.name, info)
        for s in part.series:
            key = (s.name, s.labels)
            prev = values.get(key)
            if prev is None:
                values[key] = s
            elif s.counts and len(s.counts) == len(prev.counts):
                counts = tuple(a + b for a, b in zip(prev.counts, s.counts, strict=True))
                values[key] = Series(s.name, s.labels, 0.0, counts, prev.sum + s.sum)
            else:
                values[key] = Series(s.name, s.labels, prev.value + s.value)
    when = at if at is not None else (latest if latest > -math.inf else time.time())
    return MetricsSnapshot(when, tuple(values.values()), tuple(declared.values()))


_PROCESS_REGISTRY = MetricsRegistry()


def get_registry() -> MetricsRegistry:
    """This process's metrics registry (what its ``ObserveAgent`` reports to the observer)."""
    return _PROCESS_REGISTRY
