"""Replies the controller holds until units took the puts told to them (internal)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .._runtime import Reply
from ._outbox import Outbox


class StoreWaits:
    """Replies held until units took the puts told to them so far (:meth:`Outbox.storing`):
    a reader must not ask a unit for rows it has not heard of yet."""

    def __init__(self) -> None:
        self._waits: list[tuple[dict[str, int], Reply, Any]] = []

    def __len__(self) -> int:
        return len(self._waits)

    @staticmethod
    def marks(outbox: Outbox, units: Iterable[str]) -> dict[str, int]:
        """What to wait for before asking ``units`` (empty: nothing)."""
        if not outbox.last_store:
            return {}
        return {u: m for u in units if (m := outbox.storing(u)) is not None}

    def add(self, marks: dict[str, int], reply: Reply, value: Any) -> None:
        self._waits.append((marks, reply, value))

    def ready(self, outbox: Outbox) -> list[tuple[Reply, Any]]:
        """The held replies whose units took what they waited for (removed from the waits)."""
        done, keep = [], []
        for wait in self._waits:
            marks = wait[0]
            if all(outbox.taken_up_to(u, m) for u, m in marks.items()):
                done.append((wait[1], wait[2]))
            else:
                keep.append(wait)
        self._waits = keep
        return done
