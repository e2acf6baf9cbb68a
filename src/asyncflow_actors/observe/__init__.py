"""Observability: per-sample trace spans, one metrics registry, exporters, a live dashboard.

``docs/observability.md`` is the guide. In short::

    from asyncflow_actors import observe

    track = observe.get_tracer().track("train", "train-0")        # in a role
    samples = observe.get_registry().counter("afa_role_samples_total", role="train", worker="train-0")
    with track.span("train_step", samples=batch.indexes, version=v):
        ...
    samples.inc(len(batch.indexes))

    async with observe.open_observer(system, observe.ObserveConfig(run_dir="runs/x")) as obs:
        await obs.attach_node(node)                                 # spans from that process too
        obs.watch_transfer_queue(client)
        await nursery.start(observe.serve, obs.feed)                # the live dashboard

``observe`` sits above ``actors`` and ``transfer_queue``; those never import it (the observer
polls their ``statistics()``). The dashboard needs the ``observe`` extra.
"""

from __future__ import annotations

from ._agent import AGENT_TARGET as AGENT_TARGET
from ._agent import Collect as Collect
from ._agent import Collected as Collected
from ._agent import ObserveAgent as ObserveAgent
from ._agent import ProcessInfo as ProcessInfo
from ._catalog import CATALOG as CATALOG
from ._catalog import SYNC_PHASES as SYNC_PHASES
from ._catalog import MetricError as MetricError
from ._catalog import MetricInfo as MetricInfo
from ._config import GraphEdge as GraphEdge
from ._config import ObserveConfig as ObserveConfig
from ._config import ObserveConfigError as ObserveConfigError
from ._dashboard import DashboardAddress as DashboardAddress
from ._dashboard import serve as serve
from ._exporters import Exporter as Exporter
from ._exporters import JsonlExporter as JsonlExporter
from ._exporters import TensorBoardExporter as TensorBoardExporter
from ._exporters import prometheus_registry as prometheus_registry
from ._exporters import read_jsonl as read_jsonl
from ._feed import SnapshotFeed as SnapshotFeed
from ._metrics import Counter as Counter
from ._metrics import Gauge as Gauge
from ._metrics import Histogram as Histogram
from ._metrics import MetricsRegistry as MetricsRegistry
from ._metrics import MetricsSnapshot as MetricsSnapshot
from ._metrics import Series as Series
from ._metrics import get_registry as get_registry
from ._metrics import merge_snapshots as merge_snapshots
from ._observer import Observer as Observer
from ._observer import ObserverStatistics as ObserverStatistics
from ._observer import open_observer as open_observer
from ._run_files import RunFiles as RunFiles
from ._trace_json import chrome_trace as chrome_trace
from ._tracer import NO_SPAN as NO_SPAN
from ._tracer import Span as Span
from ._tracer import Tracer as Tracer
from ._tracer import Track as Track
from ._tracer import clock_ns as clock_ns
from ._tracer import get_tracer as get_tracer
from ._view import DashboardView as DashboardView
