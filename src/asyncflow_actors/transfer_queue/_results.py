"""Values returned by the control-plane core: allocations, leases, and what to free or report.

The core holds no data. Each mutating call returns what the data plane must now do (delete these
indexes and shared blobs on these units) and what the driver must hear about (evicted or lost
groups), as frozen values.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import attrs

#: Reason of an :class:`Eviction`: the group fell out of the staleness window.
STALE = "stale"


@attrs.frozen
class GroupSlot:
    """A group opened with ``open_group``: its id and the storage unit holding it.

    Every member of the group and its shared columns are placed on ``unit``; the writer may write
    the shared columns there right away and then ``commit_shared``.
    """

    topic: str
    group_id: int
    unit: str
    size: int


@attrs.frozen
class Allocation:
    """Indexes assigned by ``allocate``, with the unit and group of each (same order)."""

    topic: str
    version: int
    indexes: tuple[int, ...]
    units: tuple[str, ...]
    group_ids: tuple[int, ...]

    def placement(self) -> dict[str, tuple[int, ...]]:
        """Indexes per storage unit, in allocation order."""
        out: dict[str, list[int]] = {}
        for index, unit in zip(self.indexes, self.units, strict=True):
            out.setdefault(unit, []).append(index)
        return {u: tuple(v) for u, v in out.items()}


@attrs.frozen
class Lease:
    """Samples handed to one consumer by ``claim``, held until ack, nack, expiry or holder death.

    ``indexes`` are in hand-out order (oldest first; group by group for whole-group sampling) with
    ``versions`` and ``group_ids`` (each sample's group) aligned. ``placement`` maps each storage unit to the indexes it holds, so the client
    fetches from each unit directly; ``shared`` maps each unit to the groups whose shared columns
    (among ``columns``) to fetch once. ``partitions`` splits ``indexes`` across data-parallel ranks
    (one partition unless a balanced sampler was used). A rank-shared lease (``share_count > 1``) is
    the same lease for every claimant of ``share_key``; ``holder`` names the claimant it was
    returned to.
    """

    id: int
    topic: str
    consumer: str
    holder: str
    columns: frozenset[str]
    indexes: tuple[int, ...]
    versions: tuple[int, ...]
    group_ids: tuple[int, ...]
    placement: Mapping[str, tuple[int, ...]] = attrs.field(hash=False)
    shared: Mapping[str, tuple[int, ...]] = attrs.field(hash=False)
    partitions: tuple[tuple[int, ...], ...]
    deadline: float
    share_key: Hashable | None = None
    share_count: int = 1


@attrs.frozen
class Release:
    """Data to delete on one storage unit: sample indexes and group-shared blobs of a topic."""

    unit: str
    topic: str
    indexes: tuple[int, ...]
    group_ids: tuple[int, ...]
    nbytes: int


@attrs.frozen
class Eviction:
    """Groups evicted from a topic (from every consumer), with their live member indexes.

    Reported exactly once, by the call that evicted them; their data is also in that call's
    :attr:`Update.releases`.
    """

    topic: str
    group_ids: tuple[int, ...]
    indexes: tuple[int, ...]
    reason: str
    nbytes: int


@attrs.frozen
class Abandoned:
    """Samples a writer allocated but never committed (it died, or stayed silent past the
    topic's ``write_ttl``), and slots of open groups it never filled: they were dropped (counted
    as discarded), so re-inject those prompts by group id."""

    topic: str
    indexes: tuple[int, ...]
    group_ids: tuple[int, ...]


@attrs.frozen
class Update:
    """What a mutating call changed that the outside must act on.

    ``releases``: data to delete, per unit (freed after every consumer acked, evicted, discarded,
    or groups whose last member went). ``evictions``: groups evicted by this call (report them).
    ``ended``: lease ids this call ended. ``missing``: indexes of an acked/nacked lease that had
    already disappeared (lost with a storage unit or discarded by the writer). ``abandoned``:
    allocations and open-group slots of writers that died or went silent (see :class:`Abandoned`).
    """

    releases: tuple[Release, ...] = ()
    evictions: tuple[Eviction, ...] = ()
    ended: tuple[int, ...] = ()
    missing: tuple[int, ...] = ()
    abandoned: tuple[Abandoned, ...] = ()

    @property
    def nbytes_freed(self) -> int:
        """Bytes the data plane frees by applying ``releases``."""
        return sum(r.nbytes for r in self.releases)

    @property
    def freed_indexes(self) -> tuple[int, ...]:
        """Every sample index released, over all units."""
        return tuple(i for r in self.releases for i in r.indexes)


@attrs.frozen
class LostSamples:
    """Samples and groups of one topic that were on a lost storage unit."""

    topic: str
    indexes: tuple[int, ...]
    group_ids: tuple[int, ...]


@attrs.frozen
class Loss:
    """What ``storage_lost`` dropped: per topic, the lost samples and groups (re-inject those
    prompts), and the outstanding leases that referred to them (their ack skips the lost indexes)."""

    unit: str
    lost: tuple[LostSamples, ...]
    leases: tuple[int, ...]

    @property
    def group_ids(self) -> dict[str, tuple[int, ...]]:
        """Lost group ids per topic."""
        return {entry.topic: entry.group_ids for entry in self.lost}
