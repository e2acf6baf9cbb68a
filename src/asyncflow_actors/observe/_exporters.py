"""Where snapshots go: a JSONL file (the default), TensorBoard, and Prometheus scrapes.

An exporter is any object with ``export(snapshot)`` and ``close()``; the observer calls them in
a worker thread after each collection, so a slow disk never stalls the event loop. Prometheus is
pull-based instead: ``prometheus_registry(feed)`` answers scrapes from the latest snapshot (the
dashboard server mounts it at ``/metrics``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from ._metrics import MetricsSnapshot, Series

if TYPE_CHECKING:
    from ._feed import SnapshotFeed


class Exporter(Protocol):
    def export(self, snapshot: MetricsSnapshot) -> None: ...

    def close(self) -> None: ...


class JsonlExporter:
    """Appends each snapshot as one JSON line (``MetricsSnapshot.to_json``) and flushes it.

    ``asyncflow dashboard PATH`` follows such a file; ``read_jsonl`` reads it back.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())

    def export(self, snapshot: MetricsSnapshot) -> None:
        self._file.write(json.dumps(snapshot.to_json(), separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_jsonl(path: str | os.PathLike[str]) -> Iterator[MetricsSnapshot]:
    """The snapshots of a JSONL metrics file, in order (a torn last line is skipped)."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.endswith("\n"):
                yield MetricsSnapshot.from_json(json.loads(line))


def _tag(s: Series) -> str:
    if not s.labels:
        return s.name
    return s.name + "/" + ",".join(f"{k}={v}" for k, v in s.labels)


class TensorBoardExporter:
    """Writes each snapshot as TensorBoard scalars (and histograms) under ``log_dir``.

    Needs the ``tensorboard`` extra. The step is the collection number; the wall time the
    snapshot's. Histograms are written with their exact buckets, counts and sum; TensorBoard's
    sum of squares is estimated from the bucket bounds.
    """

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # tensorboard itself is missing
            raise ImportError(
                "the TensorBoard exporter needs the tensorboard package: "
                "pip install 'asyncflow-actors[tensorboard]'"
            ) from exc
        self._writer: Any = SummaryWriter(log_dir=os.fspath(log_dir))
        self._step = 0

    def export(self, snapshot: MetricsSnapshot) -> None:
        self._step += 1
        for s in snapshot.series:
            tag = _tag(s)
            if not s.counts:
                self._writer.add_scalar(tag, s.value, self._step, walltime=snapshot.time)
                continue
            bounds = snapshot.info(s.name).buckets
            n = s.count
            if n == 0:
                continue
            nonzero = [i for i, c in enumerate(s.counts) if c]
            limits = [*bounds, math.inf]
            reps = [*bounds, bounds[-1]]  # a bucket's representative value
            self._writer.add_histogram_raw(
                tag,
                min=reps[nonzero[0]],
                max=reps[nonzero[-1]],
                num=n,
                sum=s.sum,
                sum_squares=sum(c * r * r for c, r in zip(s.counts, reps, strict=True)),
                bucket_limits=[min(x, 1e300) for x in limits],
                bucket_counts=list(s.counts),
                global_step=self._step,
                walltime=snapshot.time,
            )
            self._writer.add_scalar(tag + "/mean", s.sum / n, self._step, walltime=snapshot.time)

    def close(self) -> None:
        self._writer.close()


def prometheus_registry(feed: SnapshotFeed) -> Any:
    """A ``prometheus_client`` registry that answers each scrape from ``feed.latest``.

    Needs ``prometheus-client`` (the ``observe`` extra). Units are in each family's help text.
    """
    from prometheus_client.core import (
        CollectorRegistry,
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    class SnapshotCollector:
        def collect(self) -> Iterator[Any]:
            snap = feed.latest
            if snap is None:
                return
            by_name: dict[str, list[Series]] = {}
            for s in snap.series:
                by_name.setdefault(s.name, []).append(s)
            for name, series in sorted(by_name.items()):
                info = snap.info(name)
                help_text = f"{info.help} ({info.unit})"
                labels = list(info.labels)
                family: Any
                if info.kind == "counter":
                    family = CounterMetricFamily(name, help_text, labels=labels)
                elif info.kind == "gauge":
                    family = GaugeMetricFamily(name, help_text, labels=labels)
                else:
                    family = HistogramMetricFamily(name, help_text, labels=labels)
                for s in series:
                    values = [s.label(k) or "" for k in labels]
                    if info.kind == "histogram":
                        cumulative, buckets = 0, []
                        for bound, count in zip([*info.buckets, math.inf], s.counts, strict=True):
                            cumulative += count
                            le = "+Inf" if bound == math.inf else repr(float(bound))
                            buckets.append((le, cumulative))
                        family.add_metric(values, buckets, s.sum)
                    else:
                        family.add_metric(values, s.value)
                yield family

    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector())
    return registry
