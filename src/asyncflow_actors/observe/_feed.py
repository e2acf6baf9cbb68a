"""``SnapshotFeed``: the latest snapshots of a run, for the dashboard and other live readers."""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import trio

from ._config import GraphEdge
from ._metrics import MetricsSnapshot
from ._view import DashboardView


class SnapshotFeed:
    """Snapshots published in order (``seq`` 1, 2, ...), their dashboard views, and a wait.

    An observer publishes after each collection; ``asyncflow dashboard`` publishes what it reads
    from a JSONL file. Readers call ``await wait_after(seq)`` to get the next one. ``trace``, when
    set, returns the run's trace so far, or of its last ``seconds`` (the dashboard serves it at
    ``/api/trace``); it is called in a worker thread. ``steps`` and ``completions``, when set,
    return a run's latest step records and sample completions (``/api/steps``,
    ``/api/completions``; ``RunFiles`` reads them from a run directory), also in a thread.
    """

    def __init__(self, graph: Sequence[GraphEdge] = (), *, keep: int = 64) -> None:
        self.graph = tuple(graph)
        self._builder = DashboardView(self.graph)
        self._kept: collections.deque[tuple[int, MetricsSnapshot, dict[str, Any]]] = (
            collections.deque(maxlen=keep)
        )
        self._changed = trio.Event()
        self.trace: Callable[[float | None], dict[str, Any]] | None = None
        self.steps: Callable[[int | None], list[dict[str, Any]]] | None = None
        self.completions: Callable[[int | None], list[dict[str, Any]]] | None = None

    @property
    def seq(self) -> int:
        """The number of the latest snapshot (0 before the first)."""
        return self._kept[-1][0] if self._kept else 0

    @property
    def latest(self) -> MetricsSnapshot | None:
        return self._kept[-1][1] if self._kept else None

    @property
    def view(self) -> dict[str, Any] | None:
        return self._kept[-1][2] if self._kept else None

    def get(self, seq: int) -> tuple[MetricsSnapshot, dict[str, Any]]:
        """A recent snapshot and its view by number (``KeyError`` once it is too old)."""
        for number, snap, view in self._kept:
            if number == seq:
                return snap, view
        raise KeyError(seq)

    def publish(self, snapshot: MetricsSnapshot) -> int:
        seq = self.seq + 1
        self._kept.append((seq, snapshot, self._builder.update(snapshot, seq)))
        self._changed.set()
        self._changed = trio.Event()
        return seq

    async def wait_after(self, seq: int) -> int:
        """Wait until a snapshot newer than ``seq`` is published; return the latest number."""
        await trio.lowlevel.checkpoint()
        while self.seq <= seq:
            await self._changed.wait()
        return self.seq
