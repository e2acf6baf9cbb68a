"""``TransferQueueLedger``: the TransferQueue's promises to its clients, checked from outside.

A station that wraps or extends the TransferQueue (a reward service that writes a column, a
consumer with its own batching, a filter that discards samples) must keep the queue's promises.
The ledger is a plain-Python model at the client's level: tell it what was put, handed out,
acked, returned and reported, and it asserts, as things happen and at the end:

- **exactly once per consumer after ack**: no consumer is handed a sample it has acked, nor one
  it holds in another open lease; and at the end every sample is acked by every consumer unless
  it was reported (evicted, lost) or discarded: nothing is dropped silently;
- **the staleness window**: nothing handed out is older than ``latest - staleness``;
- **leases return samples**: a nacked, expired or released lease makes its samples available
  again (the end-of-run accounting fails otherwise);
- **whole groups** stay whole under whole-group sampling;
- **memory is freed after all acks**: a drained queue holds no sample and no byte.

It knows nothing of the queue's internals, so it keeps holding when they change.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import attrs

from ..transfer_queue import Batch, Lease, TQEvent, TransferQueueStatistics


@attrs.define
class _Sample:
    version: int
    group: int | None
    fingerprint: Hashable | None


@attrs.define
class _OpenLease:
    consumer: str
    indexes: tuple[int, ...]


class TransferQueueLedger:
    """The expected state of one topic, as its clients see it (see the module docstring).

    ``consumers`` are the topic's consumers, ``staleness`` its window. Every ``check``-style
    method raises ``AssertionError`` with a message naming the sample and the promise broken.
    """

    def __init__(self, consumers: Sequence[str], *, staleness: int, version: int = 0) -> None:
        self.consumers = tuple(consumers)
        self.staleness = staleness
        self.latest = version
        self.samples: dict[int, _Sample] = {}
        self.groups: dict[int, int] = {}  # group id -> size
        self.acked: dict[str, set[int]] = {c: set() for c in self.consumers}
        self.leases: dict[int, _OpenLease] = {}
        self.reported: set[int] = set()
        self.discarded: set[int] = set()

    # -- writers ---------------------------------------------------------------------------------

    def set_version(self, version: int) -> None:
        assert version >= self.latest, f"version went back from {self.latest} to {version}"
        self.latest = version

    def open_group(self, group: int, size: int) -> None:
        assert group not in self.groups, f"group id {group} handed out twice"
        self.groups[group] = size

    def put(
        self,
        indexes: Sequence[int],
        version: int,
        *,
        group: int | None = None,
        fingerprints: Sequence[Hashable] | None = None,
    ) -> None:
        """``put`` returned ``indexes`` for samples of ``version`` (members of ``group``).

        ``fingerprints`` (one per sample: a value derived from its data) are compared with what
        ``handed`` is given later, to catch a batch carrying another sample's data.
        """
        if fingerprints is not None:
            assert len(fingerprints) == len(indexes), "one fingerprint per sample"
        for k, index in enumerate(indexes):
            assert index not in self.samples, f"index {index} was handed out by two puts"
            fp = fingerprints[k] if fingerprints is not None else None
            self.samples[index] = _Sample(version, group, fp)

    def discard(self, indexes: Iterable[int]) -> None:
        """The writer discarded these samples (they need no consumer any more)."""
        self.discarded.update(indexes)

    # -- readers ---------------------------------------------------------------------------------

    def handed(
        self,
        batch: Batch | Lease,
        *,
        whole_groups: bool = False,
        fingerprints: Sequence[Hashable] | None = None,
    ) -> None:
        """A ``get`` returned ``batch``: check it, and open its lease."""
        lease = batch.lease if isinstance(batch, Batch) else batch
        consumer = lease.consumer
        assert consumer in self.acked, f"unknown consumer {consumer!r}"
        assert lease.id not in self.leases, f"lease {lease.id} handed out twice"
        held = {
            i for open_ in self.leases.values() if open_.consumer == consumer for i in open_.indexes
        }
        window = self.latest - self.staleness
        for k, (index, version) in enumerate(zip(lease.indexes, lease.versions, strict=True)):
            sample = self.samples.get(index)
            assert sample is not None, f"sample {index} was never put"
            assert version == sample.version, (
                f"sample {index} handed out as version {version}, put as {sample.version}"
            )
            assert index not in self.acked[consumer], (
                f"sample {index} handed to {consumer!r} again after it acked it"
            )
            assert index not in held, f"sample {index} handed to {consumer!r} in two open leases"
            assert version >= window, (
                f"sample {index} of version {version} handed out outside the window "
                f"[{window}, {self.latest}]"
            )
            assert index not in self.discarded, f"discarded sample {index} handed out"
            if fingerprints is not None and sample.fingerprint is not None:
                assert fingerprints[k] == sample.fingerprint, (
                    f"sample {index} carries other data than was put: "
                    f"{fingerprints[k]!r} != {sample.fingerprint!r}"
                )
        if whole_groups:
            self._check_whole(consumer, lease)
        self.leases[lease.id] = _OpenLease(consumer, lease.indexes)

    def _check_whole(self, consumer: str, lease: Lease) -> None:
        got = set(lease.indexes)
        for gid in set(lease.group_ids):
            size = self.groups.get(gid)
            members = {i for i, s in self.samples.items() if s.group == gid}
            if size is not None:
                assert len(members) == size, f"group {gid} handed out before it was complete"
            rest = members - self.acked[consumer] - self.reported - self.discarded
            assert rest <= got, f"group {gid} split: {sorted(rest - got)} left out of the batch"

    def acked_batch(self, batch: Batch | Lease, missing: Iterable[int] = ()) -> None:
        """``ack`` succeeded (it returned ``missing``: samples gone meanwhile)."""
        open_ = self._close(batch)
        gone = set(missing)
        self.acked[open_.consumer].update(i for i in open_.indexes if i not in gone)

    def returned(self, batch: Batch | Lease) -> None:
        """The lease ended without an ack: ``nack``, expiry, the holder released or restarted."""
        self._close(batch)

    def returned_all(self) -> None:
        """Every open lease ended (a controller restart returns them all)."""
        self.leases.clear()

    def _close(self, batch: Batch | Lease) -> _OpenLease:
        lease = batch.lease if isinstance(batch, Batch) else batch
        open_ = self.leases.pop(lease.id, None)
        assert open_ is not None, f"lease {lease.id} is not open"
        return open_

    # -- events ------------------------------------------------------------------------------------

    def report(self, events: Iterable[TQEvent]) -> None:
        """Evictions and losses the queue reported (``client.events()``): accounted for."""
        for event in events:
            if event.kind in ("evicted", "lost"):
                self.reported.update(event.indexes)

    # -- the end -----------------------------------------------------------------------------------

    def unaccounted(self) -> dict[str, list[int]]:
        """Per consumer, samples neither acked by it nor reported nor discarded."""
        settled = self.reported | self.discarded
        out = {}
        for consumer in self.consumers:
            missing = sorted(set(self.samples) - self.acked[consumer] - settled)
            if missing:
                out[consumer] = missing
        return out

    def check_drained(
        self, statistics: TransferQueueStatistics | None = None, *, topic: str | None = None
    ) -> None:
        """After a drain: no open lease, every sample accounted for by every consumer, and (with
        ``statistics``) no live sample in the controller and no byte in any storage unit.

        Take ``statistics`` after ``await client.flush()``: the controller hands deletions to
        the units in the background, so only a flushed snapshot reflects every ack."""
        assert not self.leases, f"leases still open: {sorted(self.leases)}"
        missing = self.unaccounted()
        assert not missing, f"samples silently dropped (never acked nor reported): {missing}"
        if statistics is None:
            return
        topics = statistics.controller.state.topics
        for ts in topics:
            if topic is None or ts.topic == topic:
                assert ts.live == 0, f"topic {ts.topic!r} still holds {ts.live} live samples"
        units: Mapping[str, Any] = statistics.units
        for name, unit in units.items():
            assert unit is not None, f"storage unit {name!r} did not answer"
            assert (unit.nbytes, unit.samples, unit.groups) == (0, 0, 0), (
                f"storage unit {name!r} holds {unit.nbytes} bytes in {unit.samples} samples and "
                f"{unit.groups} groups after every consumer acked"
            )
