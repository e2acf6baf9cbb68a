"""What the dashboard shows, derived from a sequence of metrics snapshots (pure, no I/O).

The page renders this view as it is: every number on the page is a number of the view, and every
number of the view is a metric value (or a rate of one over ``rate_window`` seconds), so the
browser test can check the page against the registry.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

from ._catalog import CATALOG, SYNC_PHASES
from ._config import GraphEdge
from ._metrics import MetricsSnapshot


def _roles(snap: MetricsSnapshot, graph: Sequence[GraphEdge]) -> list[str]:
    order: list[str] = []
    for edge in graph:
        for role in (edge.src, edge.dst):
            if role not in order:
                order.append(role)
    for s in snap.select("afa_role_samples_total"):
        seen = s.label("role")
        if seen is not None and seen not in order:
            order.append(seen)
    return order


class DashboardView:
    """Turns each new snapshot into the dashboard's JSON view, keeping short histories."""

    def __init__(
        self, graph: Sequence[GraphEdge] = (), *, history: int = 300, rate_window: float = 5.0
    ) -> None:
        self.graph = tuple(graph)
        self.rate_window = rate_window
        self._past: collections.deque[MetricsSnapshot] = collections.deque()
        self._throughput: dict[str, collections.deque[tuple[float, float]]] = {}
        self._reward: collections.deque[tuple[float, float]] = collections.deque(maxlen=history)
        self._syncs: collections.deque[dict[str, Any]] = collections.deque(maxlen=20)
        self._history = history
        self._last_sync_total = 0.0

    def _base(self, now: float) -> MetricsSnapshot | None:
        """The oldest kept snapshot within the rate window (older ones are dropped)."""
        while len(self._past) > 1 and now - self._past[1].time >= self.rate_window:
            self._past.popleft()
        return self._past[0] if self._past else None

    def update(self, snap: MetricsSnapshot, seq: int = 0) -> dict[str, Any]:
        base = self._base(snap.time)
        dt = snap.time - base.time if base is not None else 0.0
        roles = []
        for role in _roles(snap, self.graph):
            samples = snap.total("afa_role_samples_total", role=role)
            busy = snap.total("afa_role_busy_seconds_total", role=role)
            workers = len(snap.select("afa_role_samples_total", role=role))
            rate = busy_ratio = None
            if base is not None and dt > 0:
                rate = (samples - base.total("afa_role_samples_total", role=role)) / dt
                if workers:
                    spent = busy - base.total("afa_role_busy_seconds_total", role=role)
                    busy_ratio = spent / (dt * workers)
            versions = [s.value for s in snap.select("afa_policy_version", role=role)]
            roles.append(
                {
                    "role": role,
                    "samples": samples,
                    "steps": snap.total("afa_role_steps_total", role=role),
                    "tokens": snap.total("afa_role_tokens_total", role=role),
                    "workers": workers,
                    "rate": rate,
                    "busy": busy_ratio,
                    "version": max(versions) if versions else None,
                }
            )
            if rate is not None:
                points = self._throughput.setdefault(role, collections.deque(maxlen=self._history))
                points.append((snap.time, rate))
        edges = []
        for edge in self.graph:
            where: dict[str, str] = {"consumer": edge.tq_consumer}
            if edge.topic:
                where["topic"] = edge.topic
            edges.append(
                {
                    "src": edge.src,
                    "dst": edge.dst,
                    "topic": edge.topic,
                    "consumer": edge.tq_consumer,
                    "depth": snap.total("afa_tq_ready_samples", **where),
                    "leased": snap.total("afa_tq_leased_samples", **where),
                    "backlog": snap.total("afa_tq_backlog_samples", **where),
                }
            )
        rewards = snap.select("afa_reward_mean")
        reward = rewards[0].value if rewards else None
        if reward is not None:
            self._reward.append((snap.time, reward))
        self._note_sync(snap)
        self._past.append(snap)
        return {
            "seq": seq,
            "time": snap.time,
            "roles": roles,
            "edges": edges,
            "throughput": {role: list(points) for role, points in self._throughput.items()},
            "reward": {"value": reward, "history": list(self._reward)},
            "staleness": self._staleness(snap),
            "syncs": list(reversed(self._syncs)),
            "tq": self._tq(snap),
        }

    @staticmethod
    def _staleness(snap: MetricsSnapshot) -> dict[str, Any]:
        info = CATALOG["afa_train_staleness_versions"]
        parts = snap.select(info.name)
        counts = [0] * (len(info.buckets) + 1)
        total = 0.0
        for s in parts:
            if len(s.counts) == len(counts):
                counts = [a + b for a, b in zip(counts, s.counts, strict=True)]
                total += s.sum
        n = sum(counts)
        return {
            "bounds": list(info.buckets),
            "counts": counts,
            "count": n,
            "mean": total / n if n else None,
        }

    @staticmethod
    def _tq(snap: MetricsSnapshot) -> dict[str, Any]:
        versions = [s.value for s in snap.select("afa_tq_latest_version")]
        return {
            "live": snap.total("afa_tq_live_samples"),
            "latest_version": max(versions) if versions else None,
            "evicted": snap.total("afa_tq_evicted_total"),
            "lost": snap.total("afa_tq_lost_total"),
            "bytes": snap.total("afa_tq_live_bytes"),
        }

    def _note_sync(self, snap: MetricsSnapshot) -> None:
        total = snap.total("afa_sync_total")
        if total > self._last_sync_total:
            phases = {
                p: snap.value("afa_sync_last_seconds", phase=p)
                for p in SYNC_PHASES
                if snap.find("afa_sync_last_seconds", phase=p) is not None
            }
            self._syncs.append(
                {
                    "time": snap.time,
                    "count": total,
                    "version": snap.value("afa_sync_last_version"),
                    "seconds": phases.get("total"),
                    "phases": phases,
                    "bytes": snap.value("afa_sync_last_bytes"),
                }
            )
        self._last_sync_total = total
