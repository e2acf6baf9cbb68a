"""The TransferQueue controller state: a sans-I/O, deterministic state machine.

:class:`ControllerState` is the whole control plane of the TransferQueue and nothing else: topics,
index allocation and placement, per (sample, column) readiness, versions and staleness windows,
per-consumer consumption, leases, group reference counts, capacity. It holds no data and does no
I/O: the controller actor wraps it, forwards data to storage units, and acts on the values each
call returns (:class:`Update`, :class:`Loss`). Every call checks all its arguments before it
mutates anything, so a call that raises leaves the state unchanged. Time is an argument (``now``).
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable, Mapping, Sequence

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
from ._inventory import Inventory, TopicRecord
from ._leases import LeaseTable
from ._results import Allocation, GroupSlot, Lease, Loss, LostSamples, Update
from ._samplers import FIFO, Balanced, Fifo, Sampler, WholeGroups, uses_groups
from ._spec import TopicSpec
from ._stats import StateStatistics, topic_statistics
from ._topic import Effects, Group, Sample, Topic


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
        self._load = dict.fromkeys(self._units, 0)
        self._topics: dict[str, Topic] = {}
        self._lease_table = LeaseTable(int_at_least("epoch", epoch, 0))
        for spec in specs:
            self.add_topic(spec)

    # -- topics --------------------------------------------------------------------------------

    def add_topic(self, spec: TopicSpec) -> None:
        """Declare a topic; raises :class:`SchemaError` if the name is taken."""
        if not isinstance(spec, TopicSpec):
            raise SchemaError(f"expected a TopicSpec, got {spec!r}")
        if spec.name in self._topics:
            raise SchemaError(f"topic {spec.name!r} is already declared")
        self._topics[spec.name] = Topic(spec, self._load)

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
        except KeyError:
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
        self._apply_window(t, fx)
        t.changes += 1
        return fx.update()

    def _apply_window(self, t: Topic, fx: Effects) -> None:
        threshold = t.threshold
        while t.vheap and t.vheap[0][0] < threshold:
            _, gid = heapq.heappop(t.vheap)
            g = t.groups.get(gid)
            if g is None or g.doomed or not t.is_stale(g):
                continue  # that member is gone; a stale live member has its own entry
            if g.held:
                t.doom(g)
            else:
                t.evict(g, fx)

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

    def _fits(self, t: Topic, n: int, *, raise_full: bool) -> bool:
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

    def _least_loaded(self, n: int) -> list[str]:
        """Units for ``n`` new groups: the least-loaded ``k`` units, ``k`` growing with ``n`` in
        steps of ``min_block`` samples, each taking one contiguous run (a small batch goes to
        one unit whole; a large one splits into one slice per unit, never interleaved rows)."""
        k = max(1, min(len(self._units), -(-n // self._min_block)))
        ranked = sorted(range(len(self._units)), key=lambda r: (self._load[self._units[r]], r))
        heap = [(self._load[self._units[r]], r) for r in ranked[:k]]
        heapq.heapify(heap)
        picks: list[int] = []
        for _ in range(n):  # fill the least loaded first, one sample at a time
            load, rank = heapq.heappop(heap)
            picks.append(rank)
            heapq.heappush(heap, (load + 1, rank))
        return [self._units[rank] for rank in sorted(picks)]

    def open_group(self, topic: str, size: int) -> GroupSlot:
        """Open a group of ``size`` members (e.g. n responses of one prompt) on one storage unit.

        The group reserves ``size`` slots of capacity at once (so a group being streamed member
        by member can always complete). It is *complete* once ``size`` members are allocated;
        ``shrink_group`` and ``discard`` lower ``size``. Raises :class:`CapacityError` if it does
        not fit now (check :meth:`can_allocate` first).
        """
        t = self._topic(topic)
        int_at_least("size", size, 1)
        self._fits(t, size, raise_full=True)
        (unit,) = self._least_loaded(1)
        g = t.new_group(unit, size)
        t.changes += 1
        return GroupSlot(topic=topic, group_id=g.gid, unit=unit, size=size)

    def allocate(
        self,
        topic: str,
        n: int,
        version: int,
        *,
        group: int | None = None,
        lengths: Sequence[int] | None = None,
    ) -> Allocation:
        """Assign ``n`` new indexes (monotonic per topic) written with policy ``version``.

        With ``group``, the samples become members of that open group (on its unit; they use its
        reserved slots). Without, each sample is its own implicit group of size 1, placed on the
        least-loaded unit. ``lengths`` (default 1 each) feed the length-balanced sampler.
        Raises :class:`StaleVersionError` if ``version`` is outside the window (or the group is
        stale), :class:`GroupError` if the group has fewer than ``n`` free slots,
        :class:`UnknownGroup`, :class:`CapacityError` if ungrouped samples do not fit now.
        """
        t = self._topic(topic)
        int_at_least("n", n, 1)
        int_at_least("version", version, 0)
        if lengths is None:
            lens = [1] * n
        else:
            lens = [int_at_least("length", x, 0) for x in lengths]
            if len(lens) != n:
                raise InvalidArgument(f"lengths has {len(lens)} entries, expected n={n}")
        if version < t.threshold:
            raise StaleVersionError(
                f"topic {topic!r}: version {version} is outside the window (oldest fresh version "
                f"{t.threshold}: latest {t.latest}, staleness {t.spec.staleness})"
            )
        if group is not None:
            g = t.group(group)
            if g.doomed:
                raise StaleVersionError(f"topic {topic!r}: group {group} is stale (being evicted)")
            if n > g.pending:
                raise GroupError(
                    f"topic {topic!r}: group {group} has {g.pending} free slots, asked for {n}"
                )
            groups = [g] * n
        else:
            self._fits(t, n, raise_full=True)
            groups = [t.new_group(unit, 1) for unit in self._least_loaded(n)]
        views = list(t.views.values())
        samples: list[Sample] = []
        for g, length in zip(groups, lens, strict=True):
            s = t.new_sample(g, version, length)
            samples.append(s)
            heapq.heappush(t.vheap, (version, g.gid))
            t.sync(s, g, views)
        t.changes += 1
        return Allocation(
            topic=topic,
            version=version,
            indexes=tuple(s.index for s in samples),
            units=tuple(s.unit for s in samples),
            group_ids=tuple(s.gid for s in samples),
        )

    def shrink_group(self, topic: str, group_id: int, slots: int) -> Update:
        """Give up ``slots`` not-yet-allocated member slots of a group (a writer that will not
        produce them). The reservation is released; a group left with no members and no slots is
        freed (its shared blob in ``releases``). Raises :class:`GroupError` if fewer are free."""
        t = self._topic(topic)
        g = t.group(group_id)
        int_at_least("slots", slots, 1)
        if slots > g.pending:
            raise GroupError(
                f"topic {topic!r}: group {group_id} has {g.pending} free slots, cannot shrink by {slots}"
            )
        g.size -= slots
        t.reserved -= slots
        self._load[g.unit] -= slots
        fx = Effects()
        t.refresh_all(g)
        t.settle(g, fx)
        t.changes += 1
        return fx.update()

    def discard(self, topic: str, indexes: Iterable[int]) -> Update:
        """Drop allocated samples on purpose (failed generation, filtered group): they leave
        every consumer, their groups shrink by as many members, and their data is released.
        Leases holding them skip them on ack (listed in ``missing``). Counted as discarded,
        not evicted. Raises :class:`UnknownSample` if any index is not live."""
        t = self._topic(topic)
        targets = self._live(t, indexes)
        fx = Effects()
        touched: dict[int, Group] = {}
        for s in targets:
            g = t.groups[s.gid]
            g.size -= 1
            g.allocated -= 1
            t.drop_sample(s, g, fx)
            t.discarded_total += 1
            touched[g.gid] = g
        for g in touched.values():
            t.refresh_all(g)
            t.settle(g, fx)
        t.changes += 1
        return fx.update()

    def locate(self, topic: str, indexes: Iterable[int]) -> dict[int, tuple[int, str]]:
        """``index -> (group id, unit)`` of live samples; raises :class:`UnknownSample`."""
        return {s.index: (s.gid, s.unit) for s in self._live(self._topic(topic), indexes)}

    def group_unit(self, topic: str, group_id: int) -> str:
        """The unit holding a live group; raises :class:`UnknownGroup`."""
        return self._topic(topic).group(group_id).unit

    def topic_record(self, topic: str) -> TopicRecord:
        """The topic's latest version and id watermarks (what units keep for a rebuild)."""
        t = self._topic(topic)
        return TopicRecord(t.name, t.latest, t.next_index, t.next_gid)

    def _live(self, t: Topic, indexes: Iterable[int]) -> list[Sample]:
        wanted = list(indexes)
        if not wanted:
            raise InvalidArgument("indexes must not be empty")
        if len(set(wanted)) != len(wanted):
            raise InvalidArgument(f"indexes must be distinct, got duplicates in {wanted[:16]}")
        missing = [i for i in wanted if i not in t.samples]
        if missing:
            raise UnknownSample(t.name, missing)
        return [t.samples[i] for i in wanted]

    # -- writes --------------------------------------------------------------------------------

    def commit_write(
        self, topic: str, indexes: Sequence[int], columns: Mapping[str, int | Sequence[int]]
    ) -> None:
        """Record that per-sample ``columns`` of ``indexes`` are now stored (after the unit stored
        them): ``columns`` maps each column to its byte size per sample (one int for every index,
        or a sequence aligned with ``indexes``). Rewriting a present column replaces its bytes.

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
        targets = self._live(t, indexes)
        sizes = {c: byte_sizes(c, v, len(targets)) for c, v in columns.items()}
        views = list(t.views.values())
        for k, s in enumerate(targets):
            for col, per in sizes.items():
                new = per[k]
                s.nbytes += new - s.col_bytes.get(col, 0)
                t.live_bytes += new - s.col_bytes.get(col, 0)
                s.col_bytes[col] = new
            if not s.cols:
                t.written += 1
            if s.cols | mask != s.cols:
                s.cols |= mask
                t.sync(s, t.groups[s.gid], views)
        t.changes += 1

    def commit_shared(self, topic: str, group_id: int, columns: Mapping[str, int]) -> None:
        """Record that group-shared ``columns`` (name -> bytes, stored once) of a group are stored.

        Raises :class:`UnknownGroup`, :class:`UnknownColumn`, :class:`SchemaError` (a per-sample
        column: use :meth:`commit_write`), :class:`InvalidArgument` for bad sizes.
        """
        t = self._topic(topic)
        g = t.group(group_id)
        if not columns:
            raise InvalidArgument("columns must name at least one column")
        per_sample, mask = t.masks(columns)
        if per_sample:
            names = sorted(c for c in columns if c in t.col_bit)
            raise SchemaError(
                f"topic {topic!r}: columns {names} are per-sample; write them with commit_write"
            )
        sizes = {c: int_at_least(f"nbytes of {c!r}", v, 0) for c, v in columns.items()}
        for col, new in sizes.items():
            delta = new - g.shared_bytes.get(col, 0)
            g.nbytes += delta
            t.shared_total += delta
            g.shared_bytes[col] = new
        if g.shared | mask != g.shared:
            g.shared |= mask
            t.resync_group(g)
        t.changes += 1

    # -- claims --------------------------------------------------------------------------------

    def changes(self, topic: str) -> int:
        """A counter bumped by every mutation of the topic: a claim that returned ``None`` cannot
        succeed before it moves (wait for it to change, then retry)."""
        return self._topic(topic).changes

    def ready_count(
        self, topic: str, consumer: str, columns: Iterable[str], *, sampler: Sampler = FIFO
    ) -> int:
        """Samples ``consumer`` could claim now for ``columns``: candidates, or samples in
        eligible groups for a whole-group sampler. O(1) after the first call (builds the view)."""
        t = self._topic(topic)
        v = t.view(t.consumer(consumer), self._columns(t, columns))
        return v.total if uses_groups(sampler) else len(v.ready)

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
        """The earliest deadline of an outstanding lease (when to call :meth:`expire` next)."""
        return self._lease_table.next_deadline()

    def expire(self, now: float) -> Update:
        """Return every lease whose deadline is ``<= now`` to the pool (``ended`` lists them);
        stale groups they were the last to hold are evicted."""
        now = finite_time(now)
        fx = Effects()
        self._lease_table.expire(now, fx)
        return fx.update()

    def release_holder(self, holder: str) -> Update:
        """Return every lease ``holder`` created or joined (a dead holder loses no samples)."""
        fx = Effects()
        self._lease_table.release_holder(holder, fx)
        return fx.update()

    # -- failures ------------------------------------------------------------------------------

    def storage_lost(self, unit: str) -> Loss:
        """Drop everything placed on ``unit`` (its data is gone) and report it, per topic, so the
        driver can re-inject those prompts. Outstanding leases keep their other samples; their
        ack/nack skip the lost ones (``Update.missing``); :attr:`Loss.leases` names them. The
        unit stays usable (its supervisor restarts it empty). Raises :class:`UnknownUnit`."""
        if unit not in self._load:
            raise UnknownUnit(f"no storage unit {unit!r} (known: {list(self._units)})")
        lost: list[LostSamples] = []
        for t in self._topics.values():
            gids = [g.gid for g in t.groups.values() if g.unit == unit]
            indexes: list[int] = []
            for gid in gids:
                g = t.groups[gid]
                for index in list(g.members):
                    t.drop_sample(t.samples[index], g, None)
                    indexes.append(index)
                t.drop_group(g, None)
            if gids:
                t.lost_total += len(indexes)
                t.lost_groups += len(gids)
                t.changes += 1
                lost.append(
                    LostSamples(topic=t.name, indexes=tuple(indexes), group_ids=tuple(gids))
                )
        assert self._load[unit] == 0, self._load[unit]
        leases = tuple(
            lid
            for entry in lost
            for lid in self._lease_table.touching(entry.topic, set(entry.indexes))
        )
        return Loss(unit=unit, lost=tuple(lost), leases=leases)

    # -- inventory -----------------------------------------------------------------------------

    def export_inventory(self, unit: str | None = None) -> Inventory:
        """The records storage units keep (all units, or ``unit`` only, plus every topic record):
        what :meth:`from_inventory` rebuilds from. Raises :class:`UnknownUnit`."""
        if unit is not None and unit not in self._load:
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
    ) -> tuple[ControllerState, Update]:
        """Rebuild a state from the storage units' merged inventory (after a controller restart).

        The result answers every query (ready, consumed, fresh, placement, capacity) as the lost
        state would once its outstanding leases had been returned. Also returns what rebuilding
        did: samples every consumer had acked and empty groups are released, and groups stale at
        the recorded latest version are evicted. Totals in :meth:`statistics` restart from the
        rebuilt live samples. ``epoch`` must exceed every earlier incarnation's (e.g. the restart
        count). Raises :class:`InventoryError` for inconsistent records.
        """
        from ._rebuild import rebuild

        return rebuild(specs, units, inventory, epoch=epoch)

    # -- introspection -------------------------------------------------------------------------

    def statistics(self) -> StateStatistics:
        """A frozen snapshot: per-topic counts, occupied slots per unit, outstanding leases."""
        return StateStatistics(
            topics=tuple(topic_statistics(t) for t in self._topics.values()),
            units=dict(self._load),
            leases=len(self._lease_table),
        )
