"""An ordered set of ints (a heap with lazy deletion), the index structure behind the samplers.

``add``, ``discard`` and ``pop_smallest`` cost O(log n) amortised; membership is a set, the heap
only orders. A claim therefore never scans the ready pool.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator


class IndexSet:
    """A set of ints that yields its smallest members first."""

    __slots__ = ("_heap", "_members")

    def __init__(self, items: Iterable[int] = ()) -> None:
        self._members: set[int] = set(items)
        self._heap: list[int] = sorted(self._members)

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, item: int) -> bool:
        return item in self._members

    def __iter__(self) -> Iterator[int]:
        """Members in ascending order (a snapshot; O(n log n))."""
        return iter(sorted(self._members))

    def add(self, item: int) -> None:
        if item not in self._members:
            self._members.add(item)
            heapq.heappush(self._heap, item)

    def discard(self, item: int) -> None:
        if item in self._members:
            self._members.remove(item)
            # Stale heap entries are skipped when popped; compact if they dominate.
            if len(self._heap) > 2 * len(self._members) + 64:
                self._heap = sorted(self._members)

    def pop_smallest(self, count: int) -> list[int]:
        """Remove and return up to ``count`` smallest members, ascending."""
        out: list[int] = []
        heap, members = self._heap, self._members
        while heap and len(out) < count:
            item = heapq.heappop(heap)
            if item in members:
                members.remove(item)
                out.append(item)
        return out

    def iter_smallest(self) -> Iterator[int]:
        """Pop members one at a time, smallest first; the caller re-``add``s what it keeps out."""
        heap, members = self._heap, self._members
        while heap:
            item = heapq.heappop(heap)
            if item in members:
                members.remove(item)
                yield item
