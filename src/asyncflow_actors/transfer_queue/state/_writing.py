"""The writer side of :class:`ControllerState` (internal): capacity, placement, allocation,
groups, discards and commits.

:class:`Writing` is a base class of ``ControllerState`` (it owns the attributes declared below
and documents the public contract of each method); split out so that each module holds one
concept. Like the rest of the state, every method checks all its arguments before it mutates
anything, and small index arrays are inspected as Python lists (``_table.SMALL``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import (
    CapacityError,
    GroupError,
    InvalidArgument,
    SchemaError,
    StaleVersionError,
    UnknownSample,
    UnknownTopic,
    about_group,
)
from .._results import Allocation, GroupSlot, Update
from . import _table
from ._check import byte_sizes, finite_time, holder_name, int_at_least
from ._effects import Effects
from ._placement import least_loaded
from ._table import Ints, rows_of
from ._topic import Topic
from ._writes import Writes


class Writing:
    """Capacity, allocation, groups and commits of :class:`ControllerState` (see there)."""

    _units: tuple[str, ...]
    _unit_names: npt.NDArray[Any]
    _load: Ints
    _down: set[int]
    _min_block: int
    _topics: dict[str, Topic]
    _writes: Writes

    def _topic(self, name: str) -> Topic:
        try:
            return self._topics[name]
        except (KeyError, TypeError):
            raise UnknownTopic(f"no topic {name!r} (declared: {sorted(self._topics)})") from None

    # -- capacity and allocation ---------------------------------------------------------------

    def can_allocate(self, topic: str, n: int) -> bool:
        """Whether ``n`` more slots (samples or a group of ``n``) fit under the capacity now.

        ``False`` means wait (slots free as samples are freed, evicted, lost or discarded; watch
        :meth:`changes` or the returned :class:`Update` values). Raises :class:`CapacityError` if
        ``n`` exceeds the capacity, so that waiting would be forever.
        """
        t = self._topic(topic)
        int_at_least("n", n, 1)
        return self._fits(t, n, raise_full=False)

    def free_slots(self, topic: str) -> int | None:
        """Capacity minus occupied slots (live samples + reserved group slots); ``None``: unbounded."""
        t = self._topic(topic)
        cap = t.spec.capacity
        return None if cap is None else cap - t.occupied

    @staticmethod
    def _fits(t: Topic, n: int, *, raise_full: bool) -> bool:
        cap = t.spec.capacity
        if cap is None:
            return True
        if n > cap:
            raise CapacityError(f"topic {t.name!r}: {n} slots can never fit in capacity {cap}")
        fits = t.occupied + n <= cap
        if not fits and raise_full:
            raise CapacityError(
                f"topic {t.name!r}: {n} slots do not fit now ({t.occupied} of {cap} occupied); "
                "wait until can_allocate() is true"
            )
        return fits

    def _least_loaded(self, n: int) -> Ints:
        """Units (as numbers) for ``n`` new groups (see :func:`least_loaded`)."""
        return least_loaded(self._load.tolist(), self._down, n, self._min_block)

    def _deadline(self, t: Topic, now: float | None) -> float:
        ttl = t.spec.write_ttl
        return math.inf if now is None or ttl is None else finite_time(now) + ttl

    def open_group(
        self, topic: str, size: int, *, holder: str | None = None, now: float | None = None
    ) -> GroupSlot:
        """Open a group of ``size`` members (e.g. n responses of one prompt) on one storage unit.

        The group reserves ``size`` slots of capacity at once (so a group being streamed member
        by member can always complete). It is *complete* once ``size`` members are allocated;
        ``shrink_group`` and ``discard`` lower ``size``. With ``now`` and a topic ``write_ttl``,
        slots still unfilled ``write_ttl`` seconds after the last allocation into the group are
        given up by :meth:`expire` (a writer that died); ``holder`` owns the group, and
        :meth:`release_holder` gives up its unfilled slots at once. Raises
        :class:`CapacityError` if it does not fit now (check :meth:`can_allocate` first).
        """
        (slot,) = self.open_groups(topic, (size,), holder=holder, now=now)
        return slot

    def open_groups(
        self,
        topic: str,
        sizes: Sequence[int],
        *,
        holder: str | None = None,
        now: float | None = None,
    ) -> tuple[GroupSlot, ...]:
        """Open one group per entry of ``sizes`` at once, all or none (see :meth:`open_group`):
        they need ``sum(sizes)`` free slots together, and each is placed as if opened one after
        the other (least-loaded unit first). Raises :class:`CapacityError` if they do not fit
        now together (or never could), :class:`InvalidArgument` for no sizes or a size < 1.
        """
        t = self._topic(topic)
        if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
            raise InvalidArgument(f"sizes must be a sequence of ints, got {sizes!r}")
        if not sizes:
            raise InvalidArgument("sizes must name at least one group")
        wanted = [int_at_least("size", size, 1) for size in sizes]
        deadline = self._deadline(t, now)
        if holder is not None:
            holder_name(holder)
        self._fits(t, sum(wanted), raise_full=True)
        owner = self._writes.holder_id(holder)
        slots = []
        for size in wanted:  # one by one: each lands on the unit least loaded after the last
            rows = t.new_groups(self._least_loaded(1), size, explicit=True, deadline=deadline)
            gid = int(t.g.ids[rows][0])
            t.g.owner[rows] = owner
            self._writes.group_deadline(topic, gid, deadline)
            unit = self._units[int(t.g.unit[rows][0])]
            slots.append(GroupSlot(topic=topic, group_id=gid, unit=unit, size=size))
        t.changes += 1
        return tuple(slots)

    def allocate(
        self,
        topic: str,
        n: int,
        version: int,
        *,
        group: int | Sequence[int] | None = None,
        lengths: Sequence[int] | None = None,
        holder: str | None = None,
        now: float | None = None,
    ) -> Allocation:
        """Assign ``n`` new indexes (monotonic per topic) written with policy ``version``.

        With ``group``, the samples become members of that open group (on its unit; they use its
        reserved slots). Without, each sample is its own implicit group of size 1, placed on the
        least-loaded unit. ``lengths`` (default 1 each) feed the length-balanced sampler. With
        ``now`` and a topic ``write_ttl``, samples not committed within ``write_ttl`` seconds are
        dropped by :meth:`expire` (reported in :attr:`Update.abandoned`); ``holder`` names the
        writer, and :meth:`release_holder` drops its uncommitted samples at once.
        ``group`` may also be a sequence of ``n`` group ids, one per sample (rows of several
        open groups in one allocation, all or none).
        Raises :class:`StaleVersionError` if ``version`` is outside the window (or a group is
        stale), :class:`GroupError` if a group has fewer free slots than samples for it,
        :class:`UnknownGroup`, :class:`CapacityError` if ungrouped samples do not fit now. An
        error about one group names it in ``group_id`` (the first such group in row order).
        """
        t = self._topic(topic)
        int_at_least("n", n, 1)
        int_at_least("version", version, 0)
        if lengths is None:
            lens = np.ones(n, np.int64)
        else:
            lens = np.array([int_at_least("length", x, 0) for x in lengths], np.int64)
            if len(lens) != n:
                raise InvalidArgument(f"lengths has {len(lens)} entries, expected n={n}")
        deadline = self._deadline(t, now)
        if holder is not None:
            holder_name(holder)
        if version < t.threshold:
            raise StaleVersionError(
                f"topic {topic!r}: version {version} is outside the window (oldest fresh version "
                f"{t.threshold}: latest {t.latest}, staleness {t.spec.staleness})"
            )
        if group is None:
            self._fits(t, n, raise_full=True)
            rows = t.new_groups(self._least_loaded(n), 1, explicit=False, deadline=math.inf)
            gslots = np.arange(rows.start, rows.stop, dtype=np.int64)
        elif isinstance(group, Sequence):
            gslots, firsts = self._member_slots(t, group, n)
            for gid, gslot in firsts.items():
                self._extend_group(t, gslot, gid, deadline)
        else:
            gslot = self._member_slot(t, group, n)
            gslots = np.full(n, gslot, np.int64)
            self._extend_group(t, gslot, group, deadline)
        rows = t.new_samples(gslots, version, lens)
        ids = t.s.ids[rows]
        self._writes.allocated(t, ids, holder, deadline)
        t.changes += 1
        return Allocation(
            topic=topic,
            version=version,
            indexes=tuple(ids.tolist()),
            units=tuple(self._unit_names[t.s.unit[rows]].tolist()),
            group_ids=tuple(t.s.gid[rows].tolist()),
        )

    @staticmethod
    def _member_slot(t: Topic, group: int, n: int) -> int:
        """The slot of open group ``group`` if ``n`` more members fit in it (else raises, naming
        the group)."""
        gslot = t.group(group)
        if t.g.doomed[gslot]:
            raise about_group(
                StaleVersionError(f"topic {t.name!r}: group {group} is stale (being evicted)"),
                group,
            )
        pending = int(t.g.size[gslot] - t.g.alloc[gslot])
        if n > pending:
            raise about_group(
                GroupError(
                    f"topic {t.name!r}: group {group} has {pending} free slots, asked for {n}"
                ),
                group,
            )
        return gslot

    def _member_slots(self, t: Topic, groups: Sequence[int], n: int) -> tuple[Ints, dict[int, int]]:
        """Slots of the groups of ``n`` rows (one group id each), and each group's slot (in
        order of first appearance), checking every group before anything changes."""
        if len(groups) != n:
            raise InvalidArgument(f"group has {len(groups)} entries, expected n={n}")
        counts: dict[int, int] = {}
        for gid in groups:
            if not isinstance(gid, int) or isinstance(gid, bool):
                raise InvalidArgument(f"group ids must be ints, got {gid!r}")
            counts[gid] = counts.get(gid, 0) + 1
        slots = {gid: self._member_slot(t, gid, k) for gid, k in counts.items()}
        gslots = np.fromiter((slots[gid] for gid in groups), np.int64, count=n)
        return gslots, slots

    def _extend_group(self, t: Topic, gslot: int, gid: int, deadline: float) -> None:
        """A member was allocated into the group: the writer is alive, its open group lives on."""
        if t.g.deadline[gslot] != math.inf and deadline != math.inf:
            t.g.deadline[gslot] = deadline
            self._writes.group_deadline(t.name, gid, deadline)

    def shrink_group(self, topic: str, group_id: int, slots: int) -> Update:
        """Give up ``slots`` not-yet-allocated member slots of a group (a writer that will not
        produce them). The reservation is released; a group left with no members and no slots is
        freed (its shared blob in ``releases``). Raises :class:`GroupError` if fewer are free."""
        t = self._topic(topic)
        gslot = t.group(group_id)
        int_at_least("slots", slots, 1)
        pending = int(t.g.size[gslot] - t.g.alloc[gslot])
        if slots > pending:
            raise GroupError(
                f"topic {topic!r}: group {group_id} has {pending} free slots, cannot shrink by {slots}"
            )
        fx = Effects()
        t.shrink(np.array([gslot], np.int64), np.array([slots], np.int64), fx)
        t.changes += 1
        t.tidy()
        return fx.update()

    def discard(self, topic: str, indexes: Iterable[int]) -> Update:
        """Drop allocated samples on purpose (failed generation, filtered group): they leave
        every consumer, their groups shrink by as many members, and their data is released.
        Leases holding them skip them on ack (listed in ``missing``). Counted as discarded,
        not evicted. Raises :class:`UnknownSample` if any index is not live."""
        return self._drop(topic, indexes, Topic.discard)

    def unallocate(self, topic: str, indexes: Iterable[int]) -> Update:
        """Undo a put that failed before its commit: its samples leave as :meth:`discard`'s
        do, but those of open groups give their slots back (the groups keep their size, so
        the writer may put into them again; a discard would shrink them for good). Committed
        samples and ungrouped ones are discarded. Counted as discarded. Raises
        :class:`UnknownSample` if any index is not live."""
        return self._drop(topic, indexes, Topic.unallocate)

    def lose(self, topic: str, indexes: Iterable[int]) -> Update:
        """Drop live samples whose data a unit turned out not to hold (a told store whose
        segment was gone when it arrived): as :meth:`discard`, but counted as lost. Raises
        :class:`UnknownSample` if any index is not live."""

        def lose(t: Topic, rows: Ints, fx: Effects) -> None:
            t.discard(rows, fx)
            t.discarded_total -= len(rows)
            t.lost_total += len(rows)

        return self._drop(topic, indexes, lose)

    def _drop(
        self, topic: str, indexes: Iterable[int], how: Callable[[Topic, Ints, Effects], None]
    ) -> Update:
        """Drop live samples ``indexes`` of ``topic`` the way ``how`` does."""
        t = self._topic(topic)
        rows, _ = self._live(t, indexes)
        fx = Effects()
        how(t, rows, fx)
        t.changes += 1
        t.tidy()
        return fx.update()

    def locate(self, topic: str, indexes: Iterable[int]) -> dict[int, tuple[int, str]]:
        """``index -> (group id, unit)`` of live samples; raises :class:`UnknownSample`."""
        t = self._topic(topic)
        rows, _ = self._live(t, indexes)
        units = t.s.unit[rows].tolist()
        return {
            i: (gid, self._units[u])
            for i, gid, u in zip(t.s.ids[rows].tolist(), t.s.gid[rows].tolist(), units, strict=True)
        }

    def group_unit(self, topic: str, group_id: int) -> str:
        """The unit holding a live group; raises :class:`UnknownGroup`."""
        t = self._topic(topic)
        return self._units[int(t.g.unit[t.group(group_id)])]

    @staticmethod
    def _live(t: Topic, indexes: Iterable[int]) -> tuple[Ints, bool]:
        """Slots of live samples ``indexes`` (distinct), and whether they are ascending."""
        try:
            wanted = np.fromiter(indexes, np.int64)
        except (TypeError, ValueError, OverflowError):
            raise InvalidArgument(f"indexes must be ints, got {indexes!r}") from None
        if not wanted.size:
            raise InvalidArgument("indexes must not be empty")
        ascending = _table.ascending(wanted)
        if not ascending and np.unique(wanted).size != wanted.size:
            raise InvalidArgument(
                f"indexes must be distinct, got duplicates in {wanted[:16].tolist()}"
            )
        slots, ok = t.s.find(wanted)
        if not ok.all():
            raise UnknownSample(t.name, wanted[~ok].tolist())
        return slots, ascending

    # -- writes --------------------------------------------------------------------------------

    def commit_write(
        self, topic: str, indexes: Sequence[int], columns: Mapping[str, int | Sequence[int]]
    ) -> None:
        """Record that per-sample ``columns`` of ``indexes`` are now stored (after the unit stored
        them): ``columns`` maps each column to its byte size per sample (one int for every index,
        or a sequence aligned with ``indexes``). Rewriting a present column replaces its bytes.
        The first write of a sample *commits* it (its allocation no longer expires).

        Raises :class:`UnknownColumn`, :class:`SchemaError` (a group-shared column: use
        :meth:`commit_shared`), :class:`UnknownSample` (not live: freed, evicted, lost), and
        :class:`InvalidArgument` for empty/duplicate indexes or bad sizes.
        """
        t = self._topic(topic)
        if not columns:
            raise InvalidArgument("columns must name at least one column")
        mask, shared = t.masks(columns)
        if shared:
            names = sorted(c for c in columns if c in t.shared_bit)
            raise SchemaError(
                f"topic {topic!r}: columns {names} are group-shared; write them with commit_shared"
            )
        slots, ascending = self._live(t, indexes)
        sizes = {c: byte_sizes(c, v, len(slots)) for c, v in columns.items()}
        if t.write(slots, ascending, sizes, mask):
            rows_are_one_run = ascending and isinstance(rows_of(slots), slice)
            self._writes.committed(t, int(t.s.ids[slots[0]]), len(slots), whole=rows_are_one_run)

    def commit_shared(self, topic: str, group_id: int, columns: Mapping[str, int]) -> None:
        """Record that group-shared ``columns`` (name -> bytes, stored once) of a group are stored.

        Raises :class:`UnknownGroup`, :class:`UnknownColumn`, :class:`SchemaError` (a per-sample
        column: use :meth:`commit_write`), :class:`InvalidArgument` for bad sizes.
        """
        self.commit_shared_groups(topic, {group_id: columns})

    def commit_shared_groups(self, topic: str, columns: Mapping[int, Mapping[str, int]]) -> None:
        """:meth:`commit_shared` of several groups (group id -> its columns), all or none: every
        group and size is checked before any is recorded."""
        t = self._topic(topic)
        checked = []
        for group_id, cols in columns.items():
            gslot = t.group(group_id)
            if not cols:
                raise InvalidArgument("columns must name at least one column")
            per_sample, mask = t.masks(cols)
            if per_sample:
                names = sorted(c for c in cols if c in t.col_bit)
                raise SchemaError(
                    f"topic {topic!r}: columns {names} are per-sample; write them with commit_write"
                )
            sizes = {c: int_at_least(f"nbytes of {c!r}", v, 0) for c, v in cols.items()}
            checked.append((gslot, sizes, mask))
        for gslot, sizes, mask in checked:
            t.write_shared(gslot, sizes, mask)
