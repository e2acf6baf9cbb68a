"""The messages of the sync conversation between the sender and each receiver.

Every message names its sync (``sync_id``); a receiver refuses (``StaleSync``) messages of a
sync it is not part of. In order, for one receiver::

    SyncPause      -> PauseAck          pause the target; arm the lease
    SyncPrepare    -> int               the manifest: allocate the host cache (bytes expected)
    (transport)                         PutBucket* | JoinGroup + ReceiveBroadcast | ReadShard*
    SyncFinalize   -> int               verify every bucket against the sender's checksums
    SyncResume     -> Resumed           commit (or drop) the staged weights, resume the target

``SyncResume`` is sent whatever happened before, and is idempotent.

Weights that fit in one small bucket (``CheckpointConfig.fused_bytes``, the actor transport)
take two round trips instead::

    SyncFused      -> FusedAck          pause, manifest, the bucket, its checksum: staged and
                                        verified before the answer (the receiver's vote)
    SyncResume     -> Resumed           the commit (or drop), as above
"""

from __future__ import annotations

import attrs
import torch

from ..actors import Request
from ._manifest import Manifest
from ._target import PauseAck, PauseMode


@attrs.frozen
class SyncPause(Request[PauseAck]):
    """Pause the target (``mode``); resume on your own after ``lease`` seconds without the
    sync's ``SyncResume`` (the sender died)."""

    sync_id: str
    mode: PauseMode
    lease: float


@attrs.frozen
class SyncPrepare(Request[int]):
    """The sync's version and manifest. ``sender`` is the sender's process token;
    ``checksum``: the algorithm of the buckets' digests (``"xxh3"``, ``"crc32"``; ``""``: none),
    which the receiver computes to verify them (it refuses one it does not know)."""

    sync_id: str
    version: int
    manifest: Manifest
    sender: str
    checksum: str


@attrs.frozen
class PutBucket(Request[int]):
    """Bucket ``index``'s bytes (the actor transport); acknowledged once they are staged.
    ``keep``: ``data`` was packed for this receiver alone and the sender never writes it again,
    so a receiver in the sender's process keeps it instead of copying it."""

    sync_id: str
    index: int
    data: torch.Tensor
    keep: bool = False


@attrs.frozen
class JoinGroup(Request[None]):
    """Join the sync's process group: ``backend`` rank ``rank`` of ``world_size``, rendezvous
    at the sender's TCPStore ``host:port``; ``timeout`` bounds every collective of it."""

    sync_id: str
    backend: str
    host: str
    port: int
    rank: int
    world_size: int
    timeout: float


@attrs.frozen
class ReceiveBroadcast(Request[int]):
    """Receive every bucket of the manifest by broadcast from rank 0; reply with the bytes."""

    sync_id: str


@attrs.frozen
class ReadShard(Request[int]):
    """Read bucket ``index`` from the safetensors file ``path`` (the file transport)."""

    sync_id: str
    index: int
    path: str


@attrs.frozen
class SyncFinalize(Request[int]):
    """Verify the staged buckets (``checksums``: the sender's, empty without checksums)."""

    sync_id: str
    checksums: tuple[int, ...]


@attrs.frozen
class FusedAck:
    """A receiver's answer to ``SyncFused``: its pause acknowledgement, and the bytes it staged
    and verified (it is ready to commit)."""

    ack: PauseAck
    staged: int


@attrs.frozen
class SyncFused(Request[FusedAck]):
    """``SyncPause``, ``SyncPrepare``, the one bucket (``data``; ``None`` when the manifest has
    no bucket) and ``SyncFinalize`` in one request: the receiver pauses, checks the manifest,
    stages the bucket and verifies it against ``checksums`` (``checksum`` names their
    algorithm, as in ``SyncPrepare``) before it answers."""

    sync_id: str
    mode: PauseMode
    lease: float
    version: int
    manifest: Manifest
    sender: str
    checksum: str
    data: torch.Tensor | None
    checksums: tuple[int, ...]


@attrs.frozen
class Resumed:
    """What a receiver holds after ``SyncResume``: the target's version, and the version
    waiting in the host cache for the next batch boundary or being loaded now (``None``:
    nothing pending)."""

    version: int
    pending: int | None


@attrs.frozen
class SyncResume(Request[Resumed]):
    """End of the sync: ``commit`` the verified weights (load now if ``eager``, else at the
    next batch boundary) or drop them; then resume the target."""

    sync_id: str
    commit: bool
    eager: bool


@attrs.frozen
class ReceiverStatistics:
    """A receiver's counters (``WeightReceiver.statistics``)."""

    name: str
    version: int
    pending_version: int | None
    paused: bool
    sync_id: str | None
    committed: int
    aborted: int
    leases_expired: int
    bytes_received: int
    loads: int
    load_errors: int
    last_load_seconds: float


@attrs.frozen
class GetReceiverStatistics(Request[ReceiverStatistics]):
    """Ask a receiver for its ``ReceiverStatistics``."""


SyncMessage = (
    SyncPause
    | SyncPrepare
    | PutBucket
    | JoinGroup
    | ReceiveBroadcast
    | ReadShard
    | SyncFinalize
    | SyncResume
    | SyncFused
    | GetReceiverStatistics
)
"""Every message a receiver answers: put it in your actor's ``Actor[M]`` union."""

SYNC_MESSAGES = (
    SyncPause,
    SyncPrepare,
    PutBucket,
    JoinGroup,
    ReceiveBroadcast,
    ReadShard,
    SyncFinalize,
    SyncResume,
    SyncFused,
    GetReceiverStatistics,
)
"""The same, as a tuple for ``isinstance(msg, SYNC_MESSAGES)``."""
