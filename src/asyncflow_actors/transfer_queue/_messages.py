"""Messages of the TransferQueue controller actor, and the values it reports."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import attrs

from ._checks import Checked
from ._located import Located
from ._results import Allocation, GroupSlot, Lease
from ._runtime import ActorRef, Request
from ._samplers import FIFO, Sampler
from ._spec import TopicSpec
from ._stats import HolderStatistics, StateStatistics
from ._unit_messages import FreeSegment, ShmBody, Store


@attrs.frozen
class TQEvent(Checked):
    """Something the driver must hear about: groups ``evicted`` from the staleness window,
    samples ``lost`` with a storage unit (re-inject those prompts), samples and group slots
    ``abandoned`` by a writer that died or went silent past ``write_ttl`` (re-inject those
    prompts too), or lease samples ``missing`` at ack. ``seq`` numbers events from 1."""

    seq: int
    kind: str
    topic: str
    group_ids: tuple[int, ...]
    indexes: tuple[int, ...]
    detail: str = ""


@attrs.frozen
class EventBatch(Checked):
    """Events after a cursor; pass ``cursor`` as ``since`` to wait for the next ones."""

    cursor: int
    events: tuple[TQEvent, ...]


@attrs.frozen
class ControllerStatistics(Checked):
    """The controller's counts: its state, waiting requests, reported events, its epoch (one
    per incarnation), the units it considers down and every unit's known incarnation."""

    state: StateStatistics
    waiting_puts: int
    waiting_claims: int
    evicted_groups: int
    lost_samples: int
    events: int
    epoch: int
    units_down: tuple[str, ...]
    event_waiters: int = 0
    abandoned_samples: int = 0
    outbox: int = 0  # bookkeeping items not yet taken by their unit
    incarnations: dict[str, str | None] = attrs.Factory(dict)
    holders: tuple[HolderStatistics, ...] = ()  # who holds and waits for what, per holder


@attrs.frozen
class CreateTopic(Checked, Request[None]):
    spec: TopicSpec


@attrs.frozen
class GetTopology(Checked, Request["Topology"]):
    """The topics' specs and the storage units' refs (what a client needs)."""


@attrs.frozen
class Topology(Checked):
    """What a client needs: the topics, the units, and how to talk to the units (data messages
    at least ``shm_min_bytes`` big go through shared memory to a unit on the same host; ``None``:
    never; every unit request is bounded by ``unit_timeout`` seconds)."""

    specs: dict[str, TopicSpec]
    units: dict[str, ActorRef[Any]]
    shm_min_bytes: int | None = 64 << 10
    unit_timeout: float = 60.0


@attrs.frozen
class Placed(Checked):
    """An allocation and the incarnation of each unit it places samples on (stores name it);
    ``free``: the free segments those units last reported (a writer on their host may claim
    one instead of creating a segment, see ``storage._pool``)."""

    allocation: Allocation
    incarnations: dict[str, str]
    free: dict[str, tuple[FreeSegment, ...]] = attrs.Factory(dict)


@attrs.frozen
class OpenedGroups(Checked):
    """The groups an ``OpenGroups`` opened (in request order) and their units' incarnations."""

    slots: tuple[GroupSlot, ...]
    incarnations: dict[str, str]


@attrs.frozen
class Leased(Checked):
    """A lease and the incarnation of each unit holding its samples (fetches name it);
    ``located``: for units whose rows of the lease all lie in shared memory, the parts a fetch
    would return (a reader on that host maps them without asking the unit, see ``_located``)."""

    lease: Lease
    incarnations: dict[str, str]
    located: dict[str, dict[str, list[ShmBody | list[ShmBody]]]] = attrs.Factory(dict)


@attrs.frozen
class Allocate(Checked, Request[Placed]):
    """Assign indexes; waits (does not fail) while the topic is at capacity."""

    topic: str
    n: int
    version: int
    group: int | tuple[int, ...] | None = None  # an open group, or one per sample
    lengths: tuple[int, ...] | None = None
    put_id: int = 0  # names the request for CancelPut
    holder: str | None = None  # the writer: its uncommitted samples go when it does


@attrs.frozen
class OpenGroups(Checked, Request[OpenedGroups]):
    """Open one group per entry of ``sizes``, all or none; waits while they do not fit
    together (their total size) in the topic's capacity."""

    topic: str
    sizes: tuple[int, ...]
    put_id: int = 0
    holder: str | None = None


@attrs.frozen
class CancelPut(Checked):
    """The writer gave up waiting: drop its put, or undo the allocation it won meanwhile."""

    put_id: int


@attrs.frozen
class Commit(Checked, Request[None]):
    """The bytes of these cells are stored: mark them present (``columns``: nbytes per index,
    or one for all). ``new``: the first write of new samples (a put, not ``put_columns``).
    ``put_id`` makes a retry after a controller restart harmless. ``located``: per unit,
    where the rows the put stored through shared memory lie (see ``_located``). ``stores``:
    per unit, the ``Store`` of rows the writer put in a shared-memory segment without asking
    the unit: the controller tells the unit (in order with the rest of its bookkeeping)."""

    topic: str
    indexes: tuple[int, ...]
    columns: dict[str, list[int] | int]
    put_id: int = 0
    new: bool = False
    located: dict[str, Located] = attrs.Factory(dict)
    stores: dict[str, Store] = attrs.Factory(dict)


@attrs.frozen
class CommitSharedGroups(Checked, Request[None]):
    """The group-shared columns of these groups are stored (group id -> nbytes per column):
    record them, all or none."""

    topic: str
    columns: dict[int, dict[str, int]]


@attrs.frozen
class Claim(Checked, Request["Leased | None"]):
    """Lease ready ∩ unconsumed ∩ fresh samples; with ``wait``, waits until enough qualify."""

    topic: str
    consumer: str
    columns: tuple[str, ...]
    count: int
    holder: str
    claim_id: int
    sampler: Sampler = FIFO
    min_count: int | None = None
    share_key: Hashable | None = None
    share_count: int = 1
    wait: bool = True
    maps: tuple[str, ...] = ()  # units whose segments the claimant maps (it is on their host)


@attrs.frozen
class CancelClaim(Checked):
    """The claimant gave up: drop its wait, or return the lease if it was granted meanwhile."""

    claim_id: int


@attrs.frozen
class Ack(Checked, Request[tuple[int, ...]]):
    """Complete a lease; replies with the indexes that had gone missing (lost, discarded).
    ``request_id`` makes a retry after a controller restart answer what the first got."""

    lease_id: int
    holder: str | None = None
    request_id: int = 0


@attrs.frozen
class Nack(Checked, Request[None]):
    lease_id: int


@attrs.frozen
class Renew(Checked, Request[Lease]):
    lease_id: int


@attrs.frozen
class SetVersion(Checked, Request[None]):
    """The policy ``version`` is now the latest: samples out of the window are evicted."""

    topic: str
    version: int


@attrs.frozen
class Discard(Checked, Request[tuple[int, ...]]):
    """Drop samples on purpose; with ``missing_ok`` indexes no longer live are skipped (and
    returned), else they fail the whole request (``UnknownSample``). ``undo``: the samples of
    a put that failed before its commit; members of open groups give their slots back.
    ``put_id``: the failed put's id with ``undo``, else this request's id (a retry after a
    controller restart gets the first try's answer; 0: none)."""

    topic: str
    indexes: tuple[int, ...]
    put_id: int = 0
    missing_ok: bool = False
    undo: bool = False


@attrs.frozen
class ShrinkGroup(Checked, Request[None]):
    topic: str
    group_id: int
    slots: int
    request_id: int = 0


@attrs.frozen
class ReleaseHolder(Checked, Request[None]):
    """Return every lease of ``holder`` (a consumer that goes away loses no samples), drop its
    uncommitted writes and withdraw its claims and puts still waiting (they fail)."""

    holder: str


@attrs.frozen
class WaitEvents(Checked, Request[EventBatch]):
    """Events with ``seq > since``; waits until there is one (bound it with fail_after)."""

    since: int = 0
    wait_id: int = 0  # names the wait for CancelWait


@attrs.frozen
class CancelWait(Checked):
    """The watcher gave up waiting for events."""

    wait_id: int


@attrs.frozen
class GetControllerStatistics(Checked, Request[ControllerStatistics]):
    pass


@attrs.frozen
class Flushed(Checked, Request[None]):
    """Reply once every unit has taken the bookkeeping queued so far (or was declared lost)."""


@attrs.frozen
class AwaitStores(Checked, Request[None]):
    """Reply once ``units`` have taken every put told to them so far (or were declared lost):
    a writer of columns to samples it leased asks this before it asks those units."""

    units: tuple[str, ...]


@attrs.frozen
class CheckUnits(Checked, Request[None]):
    """Check now that every storage unit is alive and unchanged (a client saw it fail)."""


@attrs.frozen
class CheckInvariants(Checked, Request[tuple[str, ...]]):
    """The controller's invariants, checked now: what is violated, in words (empty: nothing).
    For tests: it recounts the whole state."""


ControllerMessage = (
    CreateTopic
    | GetTopology
    | Allocate
    | OpenGroups
    | Commit
    | CommitSharedGroups
    | Claim
    | CancelClaim
    | CancelPut
    | Ack
    | Nack
    | Renew
    | SetVersion
    | Discard
    | ShrinkGroup
    | ReleaseHolder
    | WaitEvents
    | CancelWait
    | GetControllerStatistics
    | Flushed
    | AwaitStores
    | CheckUnits
    | CheckInvariants
    # not sent on their own: named so a node registers them at the top level (deterministic)
    | Located
    | ShmBody
    | OpenedGroups
)
