"""Free shared-memory segments a storage unit keeps for writers to fill again (internal).

When the last row of a segment is freed, the unit offers it to its :class:`SegmentPool`
instead of unlinking it (see ``_shm`` for why, and for the locking rules). The pool renames it
to a free name once no reader maps it any more (until then it *drains*: retried on every later
store and bookkeeping delivery), and lists free segments in its replies to stores, so writers
on the host claim them instead of creating fresh pages. The pool holds at most ``limit`` bytes
(free and draining together); what does not fit, and what stays unused or undrained for
``max_age`` seconds, is unlinked. Everything stays in the unit's namespace, so the unit's
sweeps remove what is left at its stop or after a crash.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from .. import _shm
from .._unit_messages import FreeSegment

MAX_HINTS = 8  # free segments named in one store reply


class SegmentPool:
    """See the module docstring. ``prefix``: the unit incarnation's segment prefix."""

    def __init__(self, prefix: str, limit: int, clock: Callable[[], float]) -> None:
        self.prefix = prefix
        self.limit = limit
        self.clock = clock
        self.free: dict[str, tuple[int, float]] = {}  # free name -> (size, since)
        self.draining: dict[str, tuple[int, float]] = {}  # segment -> (size, since)
        self.recycled = 0  # segments made free so far
        self._seq = itertools.count()

    @property
    def nbytes(self) -> int:
        return sum(size for size, _ in self.free.values()) + sum(
            size for size, _ in self.draining.values()
        )

    def offer(self, name: str, size: int) -> bool:
        """Keep segment ``name`` (its rows are all freed) for reuse; ``False``: no room (the
        caller unlinks it)."""
        if size <= 0 or self.nbytes + size > self.limit:
            return False
        self.draining[name] = (size, self.clock())
        self.drain()
        return True

    def drain(self) -> None:
        """Make free the draining segments no reader maps any more."""
        for name, (size, _) in list(self.draining.items()):
            free = f"{self.prefix}f{next(self._seq)}"
            try:
                if not _shm.recycle(name, free):
                    continue  # a reader still maps it
            except FileNotFoundError:
                pass  # gone (swept)
            else:
                self.free[free] = (size, self.clock())
                self.recycled += 1
            del self.draining[name]

    def hints(self, limit: int = MAX_HINTS) -> tuple[FreeSegment, ...]:
        """Free segments for writers to claim, the most recently freed first."""
        newest = sorted(self.free.items(), key=lambda item: -item[1][1])[:limit]
        return tuple(FreeSegment(name, size) for name, (size, _) in newest)

    def taken(self, free: str) -> None:
        """A writer claimed ``free`` (it handed it over again under its own name)."""
        self.free.pop(free, None)

    def expire(self, max_age: float) -> None:
        """Unlink free segments nobody claimed, and draining ones a reader kept mapped, for
        ``max_age`` seconds (a reader's mapping stays valid after the unlink)."""
        now = self.clock()
        for table in (self.free, self.draining):
            for name, (_, since) in list(table.items()):
                if now - since >= max_age:
                    del table[name]
                    _shm.unlink(name)
