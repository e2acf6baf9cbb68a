"""The TransferQueue controller state: a sans-I/O, deterministic state machine.

:class:`ControllerState` is the whole control plane of the TransferQueue and nothing else: topics,
index allocation and placement, per (sample, column) readiness, versions and staleness windows,
per-consumer consumption, leases, group reference counts, capacity, and the deadlines of writes
still in progress. It holds no data and does no I/O: the controller actor wraps it, forwards data
to storage units, and acts on the values each call returns (:class:`Update`, :class:`Loss`).
Every call checks all its arguments before it mutates anything, so a call that raises leaves the
state unchanged. Time is an argument (``now``). Bookkeeping is vectorized (numpy, see
``_topic``): a put, a claim or an ack of n samples costs a few array operations, not n steps.
The writer side (capacity, allocation, groups, discards, commits) is the base class
:class:`Writing` in ``_writing``.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import numpy as np

from .._errors import (
    InvalidArgument,
    SchemaError,
    StaleVersionError,
    UnknownUnit,
)
from .._results import Lease, Loss, Update
from .._samplers import FIFO, Balanced, Fifo, Sampler, WholeGroups, uses_groups
from .._spec import TopicSpec
from .._stats import HolderStatistics, StateStatistics
from ._audit import topic_problems
from ._check import finite_time, holder_name, int_at_least
from ._effects import Effects
from ._holders import holder_statistics
from ._inventory import GroupRecord, Inventory, TopicRecord
from ._leases import LeaseTable
from ._rebuild import Parts, export_inventory, group_records, rebuild, storage_lost
from ._statistics import topic_statistics
from ._table import Ints
from ._topic import Topic
from ._writes import Writes
from ._writing import Writing


class ControllerState(Writing):
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

    def group_records(self, topic: str, group_ids: Iterable[int]) -> tuple[GroupRecord, ...]:
        """Records of the live *explicit* groups among ``group_ids`` (opened with
        :meth:`open_group`) as storage units keep them: ``allocated`` counts committed members
        only, so a rebuild gives uncommitted members' slots back to their writer."""
        return group_records(self._units, self._topic(topic), group_ids)

    def topic_record(self, topic: str) -> TopicRecord:
        """The topic's latest version and id watermarks (what units keep for a rebuild)."""
        t = self._topic(topic)
        return TopicRecord(t.name, t.latest, t.next_index, t.next_gid)

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
        """The earliest deadline of an outstanding lease, an uncommitted allocation, an open
        group's unfilled slots or the room whole-group claims keep for groups about to go
        stale (when to call :meth:`expire` next)."""
        deadlines = [self._lease_table.next_deadline(), self._writes.next_deadline(self._topics)]
        deadlines += [t.hold_until for t in self._topics.values() if not t.hold_woken]
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
            if not t.hold_woken and t.hold_until <= now:  # claims held back for groups about
                t.hold_woken = True  # to go stale may take the others now: try them again
                t.changes += 1
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

    def units_down(self) -> frozenset[str]:
        """The units new groups and samples avoid (see :meth:`set_unit_up`)."""
        return frozenset(self._units[u] for u in self._down)

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
        return storage_lost(self._parts(), unit, u)

    # -- inventory -----------------------------------------------------------------------------

    def export_inventory(self, unit: str | None = None) -> Inventory:
        """The records storage units keep (all units, or ``unit`` only, plus every topic record):
        what :meth:`from_inventory` rebuilds from. Raises :class:`UnknownUnit`."""
        if unit is not None and unit not in self._unit_ix:
            raise UnknownUnit(f"no storage unit {unit!r} (known: {list(self._units)})")
        return export_inventory(self._parts(), unit)

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
        state = cls(specs, units, epoch=epoch)
        return state, rebuild(state._parts(), inventory, now=now)

    def _parts(self) -> Parts:
        """This state's parts, for the rebuild functions (``_rebuild``)."""
        return Parts(
            self._topics, self._units, self._unit_ix, self._load, self._writes, self._lease_table
        )

    # -- introspection -------------------------------------------------------------------------

    def check_invariants(self) -> list[str]:
        """What is inconsistent in the incremental bookkeeping, in words (empty: nothing): each
        view's candidate counts and hints against a recount from the tables, and the occupied
        slots per unit against the topics'. For tests: O(samples * views)."""
        out = [p for t in self._topics.values() for p in topic_problems(t)]
        occupied = np.zeros(len(self._units), np.int64)
        for t in self._topics.values():
            s, g = t.s, t.g
            np.add.at(occupied, s.unit[: s.n][s.live[: s.n]], 1)
            pending = (g.size[: g.n] - g.alloc[: g.n])[g.live[: g.n]]
            np.add.at(occupied, g.unit[: g.n][g.live[: g.n]], pending)
        if not np.array_equal(occupied, self._load):
            out.append(
                f"occupied slots per unit {self._load.tolist()}, counted {occupied.tolist()}"
            )
        return out

    def holders(
        self,
        claims: Iterable[tuple[str, str, str, int]] = (),
        puts: Iterable[tuple[str | None, str]] = (),
    ) -> tuple[HolderStatistics, ...]:
        """What each holder has outstanding (leases, uncommitted samples, open groups), with
        the waiting ``claims`` (``(holder, topic, consumer, count)``) and ``puts`` (``(holder,
        topic)``) the caller keeps: who waits on whom, for a diagnosis."""
        return holder_statistics(self._topics, self._lease_table, self._writes, claims, puts)

    def statistics(self) -> StateStatistics:
        """A frozen snapshot: per-topic counts, occupied slots per unit, outstanding leases."""
        return StateStatistics(
            topics=tuple(topic_statistics(t) for t in self._topics.values()),
            units=dict(zip(self._units, self._load.tolist(), strict=True)),
            leases=len(self._lease_table),
        )
