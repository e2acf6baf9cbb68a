"""What one mutating call of the state must report, collected as it goes (internal)."""

from __future__ import annotations

from collections.abc import Iterable

from .._results import STALE, Abandoned, Eviction, Release, Update
from ._table import Ints, groups_of


class Effects:
    """Collects what one mutating call must report, then builds its :class:`Update`."""

    def __init__(self) -> None:
        self._rel: dict[tuple[str, str], tuple[list[int], list[int], list[int]]] = {}
        self._evi: dict[str, tuple[list[int], list[int], list[int]]] = {}
        self._aba: dict[str, tuple[list[int], list[int]]] = {}
        self.ended: list[int] = []
        self.missing: list[int] = []

    def _entry(self, unit: str, topic: str) -> tuple[list[int], list[int], list[int]]:
        entry = self._rel.get((unit, topic))
        if entry is None:
            entry = self._rel[(unit, topic)] = ([], [], [0])
        return entry

    def free(
        self,
        units: tuple[str, ...],
        topic: str,
        unit_ix: Ints,
        ids: Ints,
        nbytes: Ints,
        *,
        groups: bool,
    ) -> None:
        """Release rows (samples, or group blobs with ``groups``) of ``topic`` placed on
        ``unit_ix`` (numbers in ``units``)."""
        for u, mine in groups_of(unit_ix):
            entry = self._entry(units[u], topic)
            entry[1 if groups else 0].extend(ids[mine].tolist())
            entry[2][0] += int(nbytes[mine].sum())

    def evicted(self, topic: str, gids: Iterable[int], indexes: Iterable[int], nbytes: int) -> None:
        entry = self._evi.setdefault(topic, ([], [], [0]))
        entry[0].extend(gids)
        entry[1].extend(indexes)
        entry[2][0] += nbytes

    def abandoned(self, topic: str, indexes: Iterable[int], gids: Iterable[int]) -> None:
        entry = self._aba.setdefault(topic, ([], []))
        entry[0].extend(indexes)
        entry[1].extend(gids)

    def update(self) -> Update:
        return Update(
            releases=tuple(
                Release(unit=u, topic=t, indexes=tuple(i), group_ids=tuple(g), nbytes=n[0])
                for (u, t), (i, g, n) in self._rel.items()
            ),
            evictions=tuple(
                Eviction(topic=t, group_ids=tuple(g), indexes=tuple(i), reason=STALE, nbytes=n[0])
                for t, (g, i, n) in self._evi.items()
            ),
            ended=tuple(self.ended),
            missing=tuple(self.missing),
            abandoned=tuple(
                Abandoned(topic=t, indexes=tuple(i), group_ids=tuple(dict.fromkeys(g)))
                for t, (i, g) in self._aba.items()
            ),
        )
