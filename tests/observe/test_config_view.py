"""The observer's configuration, and the dashboard view derived from snapshots."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncflow_actors import observe
from asyncflow_actors.observe import GraphEdge, MetricsSnapshot, ObserveConfigError, Series


def test_config_from_toml_with_graph_edges(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(
        "[observe]\ninterval = 0.5\nrun_dir = 'runs/x'\n"
        "graph = [['rollout', 'fwd', 'rollout'], {src = 'fwd', dst = 'train', consumer = 'trainer'}]\n"
    )
    config = observe.ObserveConfig.from_toml(path)
    assert config.interval == 0.5 and config.run_dir == "runs/x"
    assert config.graph == (
        GraphEdge("rollout", "fwd", "rollout"),
        GraphEdge("fwd", "train", consumer="trainer"),
    )
    assert config.graph[1].tq_consumer == "trainer" and config.role_order() == (
        "rollout",
        "fwd",
        "train",
    )
    with pytest.raises(ObserveConfigError, match=r"unknown keys \['intervall'\]"):
        observe.ObserveConfig.from_dict({"intervall": 1})
    with pytest.raises(ObserveConfigError, match="interval must be a number > 0, got 0"):
        observe.ObserveConfig(interval=0)
    with pytest.raises(ObserveConfigError, match="graph edges"):
        observe.ObserveConfig(graph=["rollout"])


def snap(
    t: float, samples: float, busy: float, syncs: float = 0, **extra: float
) -> MetricsSnapshot:
    series = [
        Series("afa_role_samples_total", (("role", "train"), ("worker", "t0")), samples),
        Series("afa_role_busy_seconds_total", (("role", "train"), ("worker", "t0")), busy),
        Series(
            "afa_tq_ready_samples", (("consumer", "train"), ("topic", "s")), extra.get("ready", 0)
        ),
        Series("afa_sync_total", (), syncs),
        Series("afa_sync_last_version", (), extra.get("version", 0)),
        Series("afa_sync_last_seconds", (("phase", "total"),), extra.get("sync_s", 0)),
        Series("afa_sync_last_seconds", (("phase", "broadcast"),), extra.get("sync_s", 0) / 2),
        Series("afa_train_staleness_versions", (), 0.0, (3, 1, 0, 0, 0, 0, 0, 0, 0), 1.0),
    ]
    return MetricsSnapshot(t, tuple(series))


def test_view_rates_busy_ratio_depths_staleness_and_sync_history() -> None:
    view = observe.DashboardView([GraphEdge("rollout", "train", "s")], rate_window=2.0)
    first = view.update(snap(100.0, 0, 0), seq=1)
    assert [r["role"] for r in first["roles"]] == ["rollout", "train"]
    assert first["roles"][1]["rate"] is None and first["syncs"] == []
    view.update(snap(101.0, 50, 0.5, ready=7), seq=2)
    third = view.update(snap(102.0, 150, 1.0, syncs=1, version=3, sync_s=0.2, ready=4), seq=3)
    train = third["roles"][1]
    assert train["samples"] == 150 and train["rate"] == 75.0  # (150 - 0) / (102 - 100)
    assert train["busy"] == 0.5 and train["workers"] == 1
    assert third["edges"] == [
        {
            "src": "rollout",
            "dst": "train",
            "topic": "s",
            "consumer": "train",
            "depth": 4,
            "leased": 0,
            "backlog": 0,
        }
    ]
    assert third["staleness"]["counts"][:2] == [3, 1] and third["staleness"]["mean"] == 0.25
    assert third["syncs"] == [
        {
            "time": 102.0,
            "count": 1,
            "version": 3,
            "seconds": 0.2,
            "phases": {"broadcast": 0.1, "total": 0.2},
            "bytes": 0.0,
        }
    ]
    fourth = view.update(snap(103.0, 200, 1.0, syncs=1), seq=4)  # the window moved on
    assert fourth["roles"][1]["rate"] == 75.0 and len(fourth["syncs"]) == 1  # (200-50)/(103-101)
    assert [p[1] for p in fourth["throughput"]["train"]] == [50.0, 75.0, 75.0]
