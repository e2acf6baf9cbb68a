"""The metrics registry, snapshots, and the exporters (JSONL, Prometheus, TensorBoard)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from asyncflow_actors import observe
from asyncflow_actors.observe import MetricError, MetricInfo


def test_names_kinds_and_labels_are_checked_against_the_catalog() -> None:
    reg = observe.MetricsRegistry()
    with pytest.raises(MetricError, match="unknown metric 'afa_samples'"):
        reg.counter("afa_samples")
    with pytest.raises(MetricError, match="is a counter, not a gauge"):
        reg.gauge("afa_role_samples_total", role="train", worker="t0")
    with pytest.raises(MetricError, match=r"takes labels \['role', 'worker'\], got \['role'\]"):
        reg.counter("afa_role_samples_total", role="train")
    c = reg.counter("afa_role_samples_total", role="train", worker="t0")
    assert reg.counter("afa_role_samples_total", worker="t0", role="train") is c
    with pytest.raises(MetricError, match="only goes up"):
        c.inc(-1)
    with pytest.raises(MetricError, match="strictly increasing"):
        MetricInfo("h", "histogram", "s", "help", (), (1, 1))
    with pytest.raises(MetricError, match="takes no buckets"):
        MetricInfo("g", "gauge", "s", "help", (), (1,))


def test_declared_metrics_snapshot_and_json_round_trip() -> None:
    reg = observe.MetricsRegistry()
    reg.declare(
        MetricInfo("my_latency_seconds", "histogram", "seconds", "a latency", ("op",), (0.1, 1.0))
    )
    with pytest.raises(MetricError, match="already declared"):
        reg.declare(MetricInfo("my_latency_seconds", "gauge", "seconds", "other"))
    h = reg.histogram("my_latency_seconds", op="get")
    h.observe_many([0.05, 0.1, 0.5, 3.0])
    reg.counter("afa_sync_total").inc(2)
    reg.gauge("afa_reward_mean", role="train").set(0.25)
    snap = reg.snapshot()
    assert snap.find("my_latency_seconds", op="get").counts == (2, 1, 1)  # type: ignore[union-attr]
    assert snap.find("my_latency_seconds", op="get").sum == pytest.approx(3.65)  # type: ignore[union-attr]
    assert snap.value("afa_sync_total") == 2 and snap.value("afa_reward_mean", role="train") == 0.25
    back = observe.MetricsSnapshot.from_json(json.loads(json.dumps(snap.to_json())))
    assert back == snap
    with pytest.raises(MetricError, match="not a metrics snapshot"):
        observe.MetricsSnapshot.from_json({"series": [{}]})


def test_merge_adds_series_from_several_processes() -> None:
    a, b = observe.MetricsRegistry(), observe.MetricsRegistry()
    for reg, n in ((a, 3), (b, 4)):
        reg.counter("afa_sync_total").inc(n)
        reg.histogram("afa_train_staleness_versions").observe(n - 3)
        reg.gauge("afa_process_actors", process=f"p{n}").set(n)
    merged = observe.merge_snapshots([a.snapshot(), b.snapshot()], at=5.0)
    assert merged.time == 5.0 and merged.value("afa_sync_total") == 7
    assert merged.find("afa_train_staleness_versions").counts[:2] == (1, 1)  # type: ignore[union-attr]
    assert merged.total("afa_process_actors") == 7


def test_jsonl_exporter_writes_one_snapshot_a_line(tmp_path: Path) -> None:
    reg = observe.MetricsRegistry()
    exporter = observe.JsonlExporter(tmp_path / "m.jsonl")
    for _ in range(3):
        reg.counter("afa_sync_total").inc()
        exporter.export(reg.snapshot())
    exporter.close()
    assert [s.value("afa_sync_total") for s in observe.read_jsonl(tmp_path / "m.jsonl")] == [
        1,
        2,
        3,
    ]


def test_prometheus_exposition_from_the_latest_snapshot() -> None:
    reg = observe.MetricsRegistry()
    reg.counter("afa_role_samples_total", role="train", worker="t0").inc(32)
    reg.histogram("afa_train_staleness_versions").observe_many([0, 0, 1, 5, 100])
    feed = observe.SnapshotFeed()
    text = generate_latest(observe.prometheus_registry(feed)).decode()
    assert "afa_role_samples_total" not in text  # nothing published yet
    feed.publish(reg.snapshot())
    text = generate_latest(observe.prometheus_registry(feed)).decode()
    assert 'afa_role_samples_total{role="train",worker="t0"} 32.0' in text
    assert "# HELP afa_role_samples_total samples a worker finished (samples)" in text
    assert 'afa_train_staleness_versions_bucket{le="0.0"} 2.0' in text
    assert 'afa_train_staleness_versions_bucket{le="1.0"} 3.0' in text
    assert 'afa_train_staleness_versions_bucket{le="6.0"} 4.0' in text
    assert 'afa_train_staleness_versions_bucket{le="+Inf"} 5.0' in text
    assert "afa_train_staleness_versions_sum 106.0" in text


def test_tensorboard_exporter_writes_scalars_and_histograms(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reg = observe.MetricsRegistry()
    exporter = observe.TensorBoardExporter(tmp_path)
    for i in range(3):
        reg.gauge("afa_reward_mean", role="train").set(i / 2)
        reg.histogram("afa_train_staleness_versions").observe(i)
        exporter.export(reg.snapshot())
    exporter.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    scalars = events.Scalars("afa_reward_mean/role=train")
    assert [(s.step, s.value) for s in scalars] == [(1, 0.0), (2, 0.5), (3, 1.0)]
    histogram = events.Histograms("afa_train_staleness_versions")[-1].histogram_value
    assert histogram.num == 3 and histogram.sum == 3.0
    assert [s.value for s in events.Scalars("afa_train_staleness_versions/mean")] == [0.0, 0.5, 1.0]


def test_catalog_and_docs_list_the_same_metrics() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "observability.md").read_text()
    documented = {line.split("`")[1] for line in doc.splitlines() if line.startswith("| `afa_")}
    assert documented == set(observe.CATALOG)
    for name, info in observe.CATALOG.items():
        row = next(line for line in doc.splitlines() if line.startswith(f"| `{name}`"))
        assert f"| {info.kind} |" in row and f"| {info.unit} |" in row, row
