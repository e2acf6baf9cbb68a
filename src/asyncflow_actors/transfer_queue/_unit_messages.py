"""Messages of the storage units (clients and the controller talk to units with these).

Every message that reads or writes data names the unit *incarnation* it was meant for (the token
a unit draws when it starts): a unit that restarted empty refuses them with
:class:`IncarnationMismatch`, so data is never stored on, nor read from, an incarnation the
controller does not know about.
"""

from __future__ import annotations

from typing import Any

import attrs

from ..actors import Request
from ._checks import Checked
from ._errors import TransferQueueError
from ._shm import ShmInfo


class IncarnationMismatch(TransferQueueError):
    """A unit was asked for data by someone who knew an earlier incarnation of it (it restarted
    empty since): nothing was stored or read."""


class UnitError(TransferQueueError):
    """A unit refused a malformed request (wrong row counts, unknown samples, a bad segment)."""


class MissingSamples(UnitError):
    """A unit holds none of some samples a request names: they were freed (discarded, evicted,
    acked by every consumer) or lost. Clients turn it into the documented errors:
    ``UnknownSample`` for ``put_columns``, ``StorageUnavailable`` for a fetch."""


@attrs.frozen
class ShmBody(Checked):
    """A tensor body in a shared-memory segment: ``dtype``/``shape`` at ``offset``.

    In a ``Store`` the segment is the one the store hands over (``segment`` empty); in a
    ``Fetched`` it names the unit's segment to map.
    """

    offset: int
    dtype: str
    shape: tuple[int, ...]
    segment: str = ""


@attrs.frozen
class FreeSegment(Checked):
    """A segment the unit keeps for reuse: a writer on its host may claim it (``_shm.claim``)
    and fill it instead of creating fresh pages."""

    name: str
    size: int


@attrs.frozen
class Stored(Checked):
    """Reply of ``Store``: free segments of the unit's pool (see ``storage._pool``). Of a
    ``UnitBatch``, also ``missing``: per topic, samples of told stores the unit could not take
    (their segment was gone) and does not hold; the controller reports those still live as
    lost (the others were stored and freed before: a delivery again)."""

    free: tuple[FreeSegment, ...] = ()
    missing: dict[str, list[int]] = attrs.field(factory=dict)


@attrs.frozen
class Store(Checked, Request[Stored]):
    """Store samples ``indexes`` of ``topic`` on incarnation ``incarnation``.

    ``columns`` maps a column to a batch whose first dimension runs over ``indexes`` (a tensor
    or a :class:`ShmBody`), or to a list with one value per index (tensors, :class:`ShmBody`
    rows, or plain values such as text). ``versions``, ``group_ids`` and ``lengths`` describe
    new samples (for the inventory). ``segment``: a shared-memory segment handed over to the
    unit with this store (its bodies are :class:`ShmBody` values). ``create``: new samples;
    else columns written to samples the unit holds (absent ones are refused: they are gone).
    ``reused``: the free segment ``segment`` was claimed from (the unit forgets it).
    """

    topic: str
    incarnation: str
    indexes: list[int]
    versions: list[int]
    group_ids: list[int]
    lengths: list[int]
    columns: dict[str, Any]
    segment: str = ""
    create: bool = True
    reused: str = ""  # the free segment of the unit's pool that ``segment`` was claimed from


@attrs.frozen
class StoreGroups(Checked, Request[None]):
    """Store the group-shared columns of groups on this unit (group id -> its columns; stored
    once for all members of a group; small, so always over the socket)."""

    topic: str
    incarnation: str
    groups: dict[int, dict[str, Any]]


@attrs.frozen
class Fetched(Checked):
    """Reply of ``Fetch``: per column, its parts in request order (a batch of consecutive rows,
    or a list of row values, possibly :class:`ShmBody` references); ``shared`` per group."""

    columns: dict[str, list[Any]]
    shared: dict[int, dict[str, Any]]


@attrs.frozen
class Fetch(Checked, Request[Fetched]):
    """Rows ``indexes`` of ``columns`` and the shared ``shared_columns`` of ``shared_groups``;
    ``shm``: the reader maps this unit's segments (bodies come back as :class:`ShmBody`)."""

    topic: str
    incarnation: str
    indexes: list[int]
    columns: list[str]
    shared_groups: list[int]
    shared_columns: list[str]
    shm: bool = False


@attrs.frozen
class Delete(Checked):
    """Forget samples and group blobs (the controller freed them, or a failed put's writer)."""

    topic: str
    indexes: list[int]
    group_ids: list[int]


@attrs.frozen
class MarkConsumed(Checked):
    """Record that ``consumer`` acked ``indexes`` (kept only for the inventory)."""

    topic: str
    consumer: str
    indexes: list[int]


@attrs.frozen
class Committed(Checked):
    """The writer of ``indexes`` committed them: a rebuild keeps them as committed samples."""

    topic: str
    indexes: list[int]


@attrs.frozen
class TopicInfo(Checked):
    """A topic's latest version and id watermarks, as the controller last told this unit."""

    topic: str
    latest_version: int
    next_index: int
    next_group_id: int


@attrs.frozen
class GroupInfo(Checked):
    """An explicit group's record (absolute values, so applying it twice is harmless):
    ``size`` members expected, ``committed`` members committed so far (freed ones included)."""

    topic: str
    group_id: int
    size: int
    committed: int


@attrs.frozen
class Unlink(Checked):
    """Segments written for told stores that an earlier incarnation of this unit never took (it
    was lost before they reached it): nobody will take them, unlink them."""

    segments: list[str]


@attrs.frozen
class UnitBatch(Checked, Request[Stored]):
    """The controller's bookkeeping for incarnation ``incarnation``, applied in order; replied
    to once applied (the controller keeps the items until then). Every item is idempotent.

    A ``Store`` item is a put a writer on the unit's host handed over in a shared-memory
    segment and committed through the controller (told, not asked: see ``client._client``); applied
    again, or after its segment went, it changes nothing. The reply names the unit's free
    segments (the controller passes them on to writers with their placements)."""

    incarnation: str
    items: list[Delete | MarkConsumed | Committed | GroupInfo | TopicInfo | Store | Unlink]


@attrs.frozen
class UnitSample(Checked):
    """One sample as a unit reports it in its inventory."""

    index: int
    version: int
    group_id: int
    length: int
    columns: dict[str, int]  # bytes per column
    consumed: list[str]
    committed: bool


@attrs.frozen
class UnitGroup(Checked):
    group_id: int
    size: int
    committed: int
    shared: dict[str, int]  # bytes per shared column
    explicit: bool


@attrs.frozen
class UnitInventory(Checked):
    unit: str
    incarnation: str
    topics: list[TopicInfo]
    samples: dict[str, list[UnitSample]]  # per topic
    groups: dict[str, list[UnitGroup]]  # per topic


@attrs.frozen
class GetInventory(Checked, Request[UnitInventory]):
    pass


@attrs.frozen
class StorageStatistics(Checked):
    """A unit's counts. ``nbytes``: bytes it really holds (buffers and segments, shared blobs
    included); ``live_nbytes``: the bytes of live rows and blobs (``nbytes`` exceeds it while a
    buffer still holds freed rows next to live ones: compaction keeps it under twice that)."""

    unit: str
    incarnation: str
    samples: int
    groups: int
    nbytes: int
    live_nbytes: int
    shared_nbytes: int
    segments: int
    stores: int
    fetches: int
    zero_copy_fetches: int
    shm_stores: int
    shm_fetches: int
    compactions: int
    pool_nbytes: int = 0  # freed segments kept for writers to fill again (not counted above)
    recycled: int = 0  # segments made free for reuse so far


@attrs.frozen
class GetStorageStatistics(Checked, Request[StorageStatistics]):
    pass


@attrs.frozen
class GetToken(Checked, Request[str]):
    """The unit's incarnation token: a new one means its data is gone (it restarted)."""


@attrs.frozen
class Reset(Checked, Request[str]):
    """Drop everything and draw a new incarnation token (replied): the controller declared this
    unit lost (it did not answer in time) and its data reported lost, so none of it may stay."""


@attrs.frozen
class GetShm(Checked, Request["ShmInfo | None"]):
    """How to reach the unit's shared-memory segments (``None``: it has none)."""


StorageMessage = (
    Store
    | StoreGroups
    | Fetch
    | Delete
    | UnitBatch
    | GetInventory
    | GetStorageStatistics
    | GetToken
    | Reset
    | GetShm
    # not sent on their own: named so a node registers them at the top level (deterministic)
    | ShmBody
    | Fetched
    | Stored
    | FreeSegment
    | MarkConsumed
    | Committed
    | TopicInfo
    | GroupInfo
    | Unlink
    | UnitSample
    | UnitGroup
    | UnitInventory
    | StorageStatistics
    | ShmInfo
)
