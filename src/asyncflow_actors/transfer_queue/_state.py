"""The TransferQueue controller state: a sans-I/O, deterministic state machine.

:class:`ControllerState` is the whole control plane of the TransferQueue and nothing else: topics,
index allocation and placement, per (sample, column) readiness, versions and staleness windows,
per-consumer consumption, leases, group reference counts, capacity, and the deadlines of writes
still in progress. It holds no data and does no I/O: the controller actor wraps it, forwards data
to storage units, and acts on the values each call returns (:class:`Update`, :class:`Loss`).
Every call checks all its arguments before it mutates anything, so a call that raises leaves the
state unchanged. Time is an argument (``now``). Bookkeeping is vectorized (numpy, see
``_topic``): a put, a claim or an ack of n samples costs a few array operations, not n steps.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping, Sequence

import numpy as np

from ._check import byte_sizes, finite_time, holder_name, int_at_least
from ._errors import (
    CapacityError,
    GroupError,
    InvalidArgument,
    SchemaError,
    StaleVersionError,
    UnknownSample,
    UnknownTopic,
    UnknownUnit,
)
from ._inventory import GroupRecord, Inventory, TopicRecord
from ._leases import LeaseTable
from ._placement import least_loaded
from ._results import Allocation, GroupSlot, Lease, Loss, Update
from ._samplers import FIFO, Balanced, Fifo, Sampler, WholeGroups, uses_groups
from ._spec import TopicSpec
from ._stats import StateStatistics, topic_statistics
from . import _table
from ._table import Ints, rows_of
from ._topic import Effects, Topic
from ._writes import Writes


class ControllerState:
    """Control plane of a TransferQueue over ``specs`` and storage units ``units``.

    ``epoch`` numbers the controller incarnation: lease ids of different epochs never collide,
    so a holder acking a lease issued before a controller restart gets :class:`UnknownLease`.
    ``min_block``: an ungrouped batch spreads over one more unit per ``min_block`` samples, so
    a put of up to ``min_block`` samples lands whole on the least-loaded unit: a later get of
    those samples is then one fetch of one contiguous slice (zero copy), and consecutive puts
    still spread over the units.

    See ``docs/transfer_queue.md`` for the semantics; each method documents its contract.
    """

    def __init__(
        self,
        specs: Iterable[TopicSpec],
        units: Iterable[str],
        *,
        epoch: int = 0,
        min_block: int = 1024,
    ) -> None:
        self._units = tuple(units)
        self._min_block = int_at_least("min_block", min_block, 1)
        if not self._units or not all(isinstance(u, str) and u for u in self._units):
            raise InvalidArgument(
                f"units must be non-empty strings, at least one; got {self._units!r}"
            )
        if len(set(self._units)) != len(self._units):
            raise InvalidArgument(f"unit ids must be unique, got {list(self._units)}")
        self._unit_ix = {u: k for k, u in enumerate(self._units)}
        self._unit_names = np.array(self._units, dtype=object)
        self._load: Ints = np.zeros(len(self._units), np.int64)
        self._down: set[int] = set()  # units new groups avoid (see set_unit_up)
        self._topics: dict[str, Topic] = {}
        self._lease_table = LeaseTable(int_at_least("epoch", epoch, 0))
        self._writes = Writes()  # writes in progress and their deadlines
        for spec in specs:
            self.add_topic(spec)

    # -- topics --------------------------------------------------------------------------------

    def add_topic(self, spec: TopicSpec) -> None:
        """Declare a topic; raises :class:`SchemaError` if the name is taken."""
        if not isinstance(spec, TopicSpec):
            raise SchemaError(f"expected a TopicSpec, got {spec!r}")
        if spec.name in self._topics:
            raise SchemaError(f"topic {spec.name!r} is already declared")
        self._topics[spec.name] = Topic(spec, self._units, self._load)
        self._writes.add_topic(spec.name)

    @property
    def topics(self) -> tuple[str, ...]:
        return tuple(self._topics)

    @property
    def units(self) -> tuple[str, ...]:
        return self._units

    def spec(self, topic: str) -> TopicSpec:
        return self._topic(topic).spec

    def _topic(self, name: str) -> Topic:
        try:
            return self._topics[name]
        except (KeyError, TypeError):
            raise UnknownTopic(f"no topic {name!r} (declared: {sorted(self._topics)})") from None

    # -- versions ------------------------------------------------------------------------------

    def latest_version(self, topic: str) -> int:
        return self._topic(topic).latest

    def is_fresh(self, topic: str, version: int) -> bool:
        """Whether ``version >= latest - staleness`` (staleness 0: exactly the latest or newer)."""
        return version >= self._topic(topic).threshold

    def set_latest_version(self, topic: str, version: int) -> Update:
        """Move the topic's latest version to ``version`` (monotonic) and apply the new window.

        Groups with a live member below ``version - staleness`` become stale: evicted now (from
        every consumer, reported in :attr:`Update.evictions`, data in ``releases``) if no lease
        holds any member, else they leave every view at once and are evicted when the last lease
        on them ends (ack, nack, expiry or holder death). Raises :class:`StaleVersionError` if
        ``version`` is below the current latest.
        """
        t = self._topic(topic)
        int_at_least("version", version, 0)
        if version < t.latest:
            raise StaleVersionError(
                f"topic {topic!r}: latest version may only grow; got {version}, latest is {t.latest}"
            )
        fx = Effects()
        if version == t.latest:
            return fx.update()
        t.latest = version
        t.apply_window(fx)
        t.changes += 1
        t.tidy()
        return fx.update()

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
        t = self._topic(topic)
        int_at_least("size", size, 1)
        deadline = self._deadline(t, now)
        if holder is not None:
            holder_name(holder)
        self._fits(t, size, raise_full=True)
        rows = t.new_groups(self._least_loaded(1), size, explicit=True, deadline=deadline)
        gid = int(t.g.ids[rows][0])
        t.g.owner[rows] = self._writes.holder_id(holder)
        self._writes.group_deadline(topic, gid, deadline)
        t.changes += 1
        return GroupSlot(
            topic=topic, group_id=gid, unit=self._units[int(t.g.unit[rows][0])], size=size
        )

    def allocate(
        self,
        topic: str,
        n: int,
        version: int,
        *,
        group: int | None = None,
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
        Raises :class:`StaleVersionError` if ``version`` is outside the window (or the group is
        stale), :class:`GroupError` if the group has fewer than ``n`` free slots,
        :class:`UnknownGroup`, :class:`CapacityError` if ungrouped samples do not fit now.
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
        g = t.g
        if group is not None:
            gslot = t.group(group)
            if g.doomed[gslot]:
                raise StaleVersionError(f"topic {topic!r}: group {group} is stale (being evicted)")
            pending = int(g.size[gslot] - g.alloc[gslot])
            if n > pending:
                raise GroupError(
                    f"topic {topic!r}: group {group} has {pending} free slots, asked for {n}"
                )
            gslots = np.full(n, gslot, np.int64)
            if g.deadline[gslot] != math.inf and deadline != math.inf:
                g.deadline[gslot] = deadline  # the writer is alive: its open group lives on
                self._writes.group_deadline(topic, group, deadline)
            t.lower_group_hints(group)
        else:
            self._fits(t, n, raise_full=True)
            rows = t.new_groups(self._least_loaded(n), 1, explicit=False, deadline=math.inf)
            gslots = np.arange(rows.start, rows.stop, dtype=np.int64)
        rows = t.new_samples(gslots, version, lens)
        ids = t.s.ids[rows]
        self._writes.allocated(topic, ids, holder, deadline)
        t.changes += 1
        return Allocation(
            topic=topic,
            version=version,
            indexes=tuple(ids.tolist()),
            units=tuple(self._unit_names[t.s.unit[rows]].tolist()),
            group_ids=tuple(t.s.gid[rows].tolist()),
        )

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
        t = self._topic(topic)
        rows, _ = self._live(t, indexes)
        fx = Effects()
        t.discard(rows, fx)
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

    def group_records(self, topic: str, group_ids: Iterable[int]) -> tuple[GroupRecord, ...]:
        """Records of the live *explicit* groups among ``group_ids`` (opened with
        :meth:`open_group`) as storage units keep them: ``allocated`` counts committed members
        only, so a rebuild gives uncommitted members' slots back to their writer."""
        from ._rebuild import group_records

        return group_records(self, self._topic(topic), group_ids)

    def topic_record(self, topic: str) -> TopicRecord:
        """The topic's latest version and id watermarks (what units keep for a rebuild)."""
        t = self._topic(topic)
        return TopicRecord(t.name, t.latest, t.next_index, t.next_gid)

    @staticmethod
    def _live(t: Topic, indexes: Iterable[int]) -> tuple[Ints, bool]:
        """Slots of live samples ``indexes`` (distinct), and whether they are ascending."""
        try:
            wanted = np.fromiter(indexes, np.int64)
        except (TypeError, ValueError, OverflowError):
            raise InvalidArgument(f"indexes must be ints, got {indexes!r}") from None
        if not wanted.size:
            raise InvalidArgument("indexes must not be empty")
        if wanted.size <= _table.SMALL:
            v = wanted.tolist()
            ascending = all(a < b for a, b in zip(v, v[1:]))
        else:
            ascending = bool((wanted[1:] > wanted[:-1]).all())
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
        t = self._topic(topic)
        gslot = t.group(group_id)
        if not columns:
            raise InvalidArgument("columns must name at least one column")
        per_sample, mask = t.masks(columns)
        if per_sample:
            names = sorted(c for c in columns if c in t.col_bit)
            raise SchemaError(
                f"topic {topic!r}: columns {names} are per-sample; write them with commit_write"
            )
        sizes = {c: int_at_least(f"nbytes of {c!r}", v, 0) for c, v in columns.items()}
        t.write_shared(gslot, sizes, mask)

    # -- claims --------------------------------------------------------------------------------

    def changes(self, topic: str) -> int:
        """A counter bumped by every mutation of the topic: a claim that returned ``None`` cannot
        succeed before it moves (wait for it to change, then retry)."""
        return self._topic(topic).changes

    def ready_count(
        self, topic: str, consumer: str, columns: Iterable[str], *, sampler: Sampler = FIFO
    ) -> int:
        """Samples ``consumer`` could claim now for ``columns``: candidates (O(1)), or samples
        in eligible groups for a whole-group sampler (one vectorized pass over the groups)."""
        t = self._topic(topic)
        v = t.view(t.consumer(consumer), self._columns(t, columns))
        return t.ready_groups(v)[1] if uses_groups(sampler) else v.nready

    @staticmethod
    def _columns(t: Topic, columns: Iterable[str]) -> frozenset[str]:
        if isinstance(columns, str):
            raise InvalidArgument(
                f"columns must be a collection of names, got the string {columns!r}"
            )
        cols = frozenset(columns)
        if not cols:
            raise InvalidArgument("columns must name at least one column")
        t.masks(cols)
        return cols

    def claim(
        self,
        topic: str,
        consumer: str,
        columns: Iterable[str],
        count: int,
        *,
        holder: str,
        now: float,
        sampler: Sampler = FIFO,
        min_count: int | None = None,
        share_key: Hashable | None = None,
        share_count: int = 1,
    ) -> Lease | None:
        """Lease samples *ready for ``columns`` ∩ neither acked nor leased by ``consumer`` ∩
        fresh* to ``holder``, atomically: between ``min_count`` (default ``count``) and ``count``
        samples chosen by ``sampler``, or ``None`` and nothing changes (retry after
        :meth:`changes` moves). The lease ends with :meth:`ack`, :meth:`nack`, expiry at
        ``now + lease_ttl`` (:meth:`expire`) or :meth:`release_holder`.

        Rank sharing: while a lease created with ``share_key`` (per topic and consumer) is
        outstanding, claims with that key get the same lease (their own ``holder`` in it), up to
        ``share_count`` distinct holders; it is consumed once all ``share_count`` holders acked.
        Raises :class:`ShareMismatch` if a sharing claim differs (columns, count, sampler,
        share_count) or is a holder too many; :class:`UnknownTopic`, :class:`UnknownConsumer`,
        :class:`UnknownColumn`, :class:`InvalidArgument`.
        """
        t = self._topic(topic)
        ci = t.consumer(consumer)
        cols = self._columns(t, columns)
        int_at_least("count", count, 1)
        low = count if min_count is None else int_at_least("min_count", min_count, 1)
        if low > count:
            raise InvalidArgument(f"min_count must be <= count={count}, got {min_count}")
        int_at_least("share_count", share_count, 1)
        holder = holder_name(holder)
        now = finite_time(now)
        if not isinstance(sampler, (Fifo, WholeGroups, Balanced)):
            raise InvalidArgument(f"sampler must be Fifo, WholeGroups or Balanced, got {sampler!r}")
        return self._lease_table.claim(
            t, ci, cols, count, low, sampler, holder, now, share_key, share_count
        )

    # -- lease endings -------------------------------------------------------------------------

    def lease(self, lease_id: int) -> Lease:
        """The outstanding lease ``lease_id``; raises :class:`UnknownLease`."""
        return self._lease_table.get(lease_id)

    def leases(self) -> tuple[Lease, ...]:
        """Every outstanding lease, oldest first."""
        return self._lease_table.all()

    def ack(self, lease_id: int, *, holder: str | None = None) -> Update:
        """Mark the lease's samples consumed by its consumer. Samples every consumer has acked
        are freed (``releases``), and so are groups whose last member went. If this lease was
        the last one holding a stale group, the group is evicted (``evictions``); the acking
        consumer still counts as having consumed its samples.

        Lost or discarded samples are skipped and listed in ``missing``. Each holder of a
        rank-shared lease acks it (``holder`` defaults to the creator), and the lease completes
        at the last one. Raises :class:`UnknownLease` (unknown, ended, or already acked by this
        holder).
        """
        fx = Effects()
        self._lease_table.ack(lease_id, holder, fx)
        return fx.update()

    def nack(self, lease_id: int) -> Update:
        """Return the lease's samples to the pool now (for its consumer only; a rank-shared lease
        for every holder). Stale groups it was the last to hold are evicted. Raises
        :class:`UnknownLease`."""
        fx = Effects()
        self._lease_table.nack(lease_id, fx)
        return fx.update()

    def renew(self, lease_id: int, now: float) -> Lease:
        """Push the lease's deadline to ``now + lease_ttl``; raises :class:`UnknownLease`."""
        return self._lease_table.renew(lease_id, finite_time(now))

    def next_deadline(self) -> float | None:
        """The earliest deadline of an outstanding lease, an uncommitted allocation or an open
        group's unfilled slots (when to call :meth:`expire` next)."""
        deadlines = (self._lease_table.next_deadline(), self._writes.next_deadline(self._topics))
        return min((d for d in deadlines if d is not None), default=None)

    def expire(self, now: float) -> Update:
        """Return every lease whose deadline is ``<= now`` to the pool (``ended`` lists them);
        stale groups they were the last to hold are evicted. Also drops the samples of writes
        not committed by their deadline and gives up the unfilled slots of open groups past
        theirs (``abandoned``: a writer that died)."""
        now = finite_time(now)
        fx = Effects()
        self._lease_table.expire(now, fx)
        self._writes.expire(self._topics, now, fx)
        for t in self._topics.values():
            t.tidy()
        return fx.update()

    def release_holder(self, holder: str) -> Update:
        """Return every lease ``holder`` created or joined (a dead holder loses no samples), drop
        its uncommitted allocations and give up the unfilled slots of the groups it opened."""
        fx = Effects()
        self._lease_table.release_holder(holder, fx)
        self._writes.release(self._topics, holder, fx)
        for t in self._topics.values():
            t.tidy()
        return fx.update()

    # -- failures ------------------------------------------------------------------------------

    def set_unit_up(self, unit: str, up: bool) -> None:
        """Whether new groups and samples may be placed on ``unit`` (a unit that is down or
        restarting gets none; if every unit is down, placement ignores this). Raises
        :class:`UnknownUnit`."""
        u = self._unit_ix.get(unit) if isinstance(unit, str) else None
        if u is None:
            raise UnknownUnit(f"no storage unit {unit!r} (known: {list(self._units)})")
        if up:
            self._down.discard(u)
        else:
            self._down.add(u)

    def storage_lost(self, unit: str) -> Loss:
        """Drop everything placed on ``unit`` (its data is gone) and report it, per topic, so the
        driver can re-inject those prompts: the committed samples, and the groups that had one
        or were opened explicitly. Samples not committed yet are dropped as discarded, not
        reported (their writer's put fails, and it knows). Outstanding leases keep their other
        samples; their ack/nack skip the lost ones (``Update.missing``); :attr:`Loss.leases`
        names them. The unit stays usable (its supervisor restarts it empty). Raises
        :class:`UnknownUnit`."""
        u = self._unit_ix.get(unit) if isinstance(unit, str) else None
        if u is None:
            raise UnknownUnit(f"no storage unit {unit!r} (known: {list(self._units)})")
        from ._rebuild import storage_lost

        return storage_lost(self, unit, u)

    # -- inventory -----------------------------------------------------------------------------

    def export_inventory(self, unit: str | None = None) -> Inventory:
        """The records storage units keep (all units, or ``unit`` only, plus every topic record):
        what :meth:`from_inventory` rebuilds from. Raises :class:`UnknownUnit`."""
        if unit is not None and unit not in self._unit_ix:
            raise UnknownUnit(f"no storage unit {unit!r} (known: {list(self._units)})")
        from ._rebuild import export_inventory

        return export_inventory(self, unit)

    @classmethod
    def from_inventory(
        cls,
        specs: Iterable[TopicSpec],
        units: Iterable[str],
        inventory: Inventory,
        *,
        epoch: int,
        now: float | None = None,
    ) -> tuple[ControllerState, Update]:
        """Rebuild a state from the storage units' merged inventory (after a controller restart).

        The result answers every query (ready, consumed, fresh, placement, capacity) as the lost
        state would once its outstanding leases had been returned. Also returns what rebuilding
        did: samples every consumer had acked and empty groups are released, and groups stale at
        the recorded latest version are evicted. Totals in :meth:`statistics` restart from the
        rebuilt live samples. ``epoch`` must exceed every earlier incarnation's (e.g. the restart
        count). Uncommitted samples stay uncommitted (their writer may still commit them); with
        ``now`` they and open groups' unfilled slots expire ``write_ttl`` from ``now``. Raises
        :class:`InventoryError` for inconsistent records.
        """
        from ._rebuild import rebuild

        return rebuild(specs, units, inventory, epoch=epoch, now=now)

    def _rebuilt_write(self, topic: str, index: int, now: float | None) -> None:
        """A rebuilt uncommitted sample: it expires ``write_ttl`` from ``now``."""
        self._writes.rebuilt(topic, index, self._deadline(self._topics[topic], now))

    # -- introspection -------------------------------------------------------------------------

    def statistics(self) -> StateStatistics:
        """A frozen snapshot: per-topic counts, occupied slots per unit, outstanding leases."""
        return StateStatistics(
            topics=tuple(topic_statistics(t) for t in self._topics.values()),
            units=dict(zip(self._units, self._load.tolist(), strict=True)),
            leases=len(self._lease_table),
        )
