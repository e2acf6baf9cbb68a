"""``ObserveConfig``: what an observer collects, how often, and where it writes (TOML-loadable)."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ObserveConfigError(ValueError):
    """A bad observer configuration; the message names the key."""


@attrs.frozen
class GraphEdge:
    """A station-to-station edge of the role graph, and the TQ view that measures its depth.

    The edge's queue depth is ``afa_tq_ready_samples{topic, consumer}`` (summed over topics when
    ``topic`` is empty); ``consumer`` defaults to ``dst``.
    """

    src: str
    dst: str
    topic: str = ""
    consumer: str = ""

    @property
    def tq_consumer(self) -> str:
        return self.consumer or self.dst


def _edges(value: Any) -> tuple[GraphEdge, ...]:
    out = []
    for item in value:
        if isinstance(item, GraphEdge):
            out.append(item)
        elif isinstance(item, Mapping):
            out.append(GraphEdge(**item))
        elif isinstance(item, Sequence) and not isinstance(item, str) and 2 <= len(item) <= 4:
            out.append(GraphEdge(*item))
        else:
            raise ObserveConfigError(
                f"graph edges are [src, dst(, topic, consumer)] or tables, got {item!r}"
            )
    return tuple(out)


def _positive(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ObserveConfigError(f"{attribute.name} must be a number > 0, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ObserveConfigError(f"{attribute.name} must be finite, got {value!r}")


@attrs.frozen
class ObserveConfig:
    """How an observer runs.

    - ``interval``: seconds between collections (spans, metrics, exports, dashboard updates).
    - ``run_dir``: where files go — ``metrics.jsonl`` (one snapshot a line, when ``jsonl``),
      ``trace.json`` (written when the observer closes, when ``trace``), ``tensorboard/`` (when
      ``tensorboard``, needs the ``tensorboard`` extra). ``None``: nothing is written.
    - ``trace``: record spans in every observed process; ``trace_capacity`` bounds each process's
      buffer between collections, ``max_spans`` the spans the observer keeps for the trace
      (oldest dropped first, counted); ``max_flows``: samples given flow arrows.
    - ``graph``: the role graph shown by the dashboard and ordering the trace's tracks.
    - ``process_name``: label of the observer's own process; ``collect_timeout``: bound on each
      pull from a node's agent.
    """

    interval: float = attrs.field(default=1.0, validator=_positive)
    run_dir: str | None = None
    jsonl: bool = True
    tensorboard: bool = False
    trace: bool = True
    trace_capacity: int = attrs.field(default=200_000, validator=_positive)
    max_spans: int = attrs.field(default=1_000_000, validator=_positive)
    max_flows: int = attrs.field(default=5000, validator=_positive)
    graph: tuple[GraphEdge, ...] = attrs.field(default=(), converter=_edges)
    process_name: str = "driver"
    collect_timeout: float = attrs.field(default=10.0, validator=_positive)

    def role_order(self) -> tuple[str, ...]:
        """Roles in graph order (sources first), for the trace's tracks and the dashboard."""
        order: list[str] = []
        for edge in self.graph:
            for role in (edge.src, edge.dst):
                if role not in order:
                    order.append(role)
        return tuple(order)

    @classmethod
    def from_dict(cls, table: Mapping[str, Any]) -> ObserveConfig:
        known = {f.name for f in attrs.fields(cls)}
        extra = sorted(set(table) - known)
        if extra:
            raise ObserveConfigError(
                f"observe config: unknown keys {extra} (known: {sorted(known)})"
            )
        try:
            return cls(**dict(table))
        except TypeError as exc:
            raise ObserveConfigError(f"observe config: {exc}") from exc

    @classmethod
    def from_toml(
        cls, path: str | os.PathLike[str], *, table: str | None = "observe"
    ) -> ObserveConfig:
        """Load the ``[observe]`` table (``table``: a dotted key, ``None`` for the root)."""
        with open(path, "rb") as f:
            data: Any = tomllib.load(f)
        for key in table.split(".") if table else ():
            data = data[key]
        return cls.from_dict(data)
