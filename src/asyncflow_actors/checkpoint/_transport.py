"""Transports: how bucket bytes get from the sender to the receivers (one interface).

The control conversation (pause, prepare, finalize, resume) always goes by actor messages; a
transport owns only the topology and broadcast phases. ``ActorTransport`` sends every bucket as a
``PutBucket`` ask to each receiver's ref: for a local ref that is an in-process hand-over of the
buffer, for a remote ref a zero-copy zmq message over the runtime's link (ipc or tcp, as the node
was started). The collective and file transports live in ``_collective`` and ``_file``.

Double buffering, and why reuse is safe by construction: the sender owns two buffers of
``bucket_bytes``. Bucket *k* is packed into buffer *k* mod 2 (in a worker thread) while bucket
*k-1* is on its way (a bucket that is one whole tensor is sent from the tensor, unpacked); a
buffer is refilled only after **every** receiver acknowledged the bucket it carried, and a
receiver acknowledges only once it has copied the bytes out or owns them (a frame its own
process received: every byte of it was read out of the sender's buffer). A sync that fails
leaves its buffers to whoever may still read them: the next sync allocates fresh ones.

In-process hand-over: when a receiver is an actor of this process (a local ref), copying the
bytes out is a pass over them that nothing needs. Its packed buckets then go into a fresh
buffer each, which the first such receiver keeps (``PutBucket.keep``) and the sender never
touches again; any other receiver copies as before (two targets never share one buffer).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import attrs
import trio

from ..actors import ActorRef, Request
from ._buckets import BucketSource, checksum
from ._config import CheckpointConfig
from ._copies import offloads, run_sync
from ._manifest import BucketSpec, Manifest
from ._messages import PutBucket

if TYPE_CHECKING:
    import torch

R = TypeVar("R")
T = TypeVar("T")


class ReceiverFailed(Exception):
    """Internal: a receiver's ask failed; ``receiver`` names it, ``__cause__`` is why."""

    def __init__(self, receiver: str) -> None:
        super().__init__(f"receiver {receiver!r} failed")
        self.receiver = receiver


async def ask(ref: ActorRef[Any], request: Request[R]) -> R:
    """``ref.ask(request)``, its failure wrapped in ``ReceiverFailed`` naming the receiver."""
    try:
        return await ref.ask(request)
    except Exception as exc:
        raise ReceiverFailed(ref.name) from exc


async def ask_all(
    refs: Sequence[ActorRef[Any]],
    make: Callable[[int], Request[Any]],
    waiting: set[str] | None = None,
) -> list[Any]:
    """Ask every ref concurrently (``make(i)`` builds the i-th request); the first failure
    cancels the others and is raised (inside trio's exception group). ``waiting``: the names
    of the refs not answered yet (for a diagnosis of a sync that stalls)."""
    results: list[Any] = [None] * len(refs)
    if waiting is not None:
        waiting.update(ref.name for ref in refs)

    async def one(i: int) -> None:
        results[i] = await ask(refs[i], make(i))
        if waiting is not None:
            waiting.discard(refs[i].name)

    async with trio.open_nursery() as nursery:
        for i in range(len(refs)):
            nursery.start_soon(one, i)
    return results


@attrs.define(eq=False)
class SyncSession:
    """One sync as the transports see it. ``checksums`` are filled in while packing."""

    sync_id: str
    version: int
    manifest: Manifest
    receivers: tuple[ActorRef[Any], ...]
    config: CheckpointConfig
    source: BucketSource
    checksums: list[int] = attrs.Factory(list)
    fresh: set[int] = attrs.Factory(set)  # buckets packed into new memory, handed over

    def __attrs_post_init__(self) -> None:
        self.checksums = [0] * len(self.manifest.buckets)

    async def bucket(
        self, index: int, buffers: DoubleBuffer, slot: int, *, fresh: bool = False
    ) -> torch.Tensor:
        """The bytes of bucket ``index``: a view of its tensor when it is one whole tensor (no
        copy), else packed into buffer ``slot`` (``fresh``: into new memory, handed over);
        its checksum is recorded."""
        import torch

        source = self.source
        nbytes = self.manifest.buckets[index].nbytes
        offload = offloads(self.config.offload, nbytes)
        data = source.direct(index, buffers.device)
        if data is not None:
            if source.algorithm:
                self.checksums[index] = await run_sync(offload, checksum, data, source.algorithm)
            return data
        if fresh:
            data = torch.empty(nbytes, dtype=torch.uint8, device=buffers.device)
            self.fresh.add(index)
        else:
            data = buffers.take(self.manifest.max_bucket)[slot][:nbytes]
        self.checksums[index] = await run_sync(offload, source.pack, index, data)
        return data


class Transport(Protocol):
    """Moves a sync's buckets to its receivers (see the module docstring).

    ``check`` refuses, before anything is paused, a manifest the transport cannot carry.
    ``open`` builds the topology, ``broadcast`` returns once every receiver has every bucket,
    ``close`` tears the topology down; it runs after every sync (``failed``: the sync did not
    commit), shielded, under the resume deadline.
    """

    @property
    def kind(self) -> str: ...

    @property
    def split(self) -> bool:
        """Whether large tensors may be split across buckets."""
        ...

    def check(self, manifest: Manifest) -> None: ...

    async def open(self, session: SyncSession) -> None: ...

    async def broadcast(self, session: SyncSession) -> None: ...

    async def close(self, session: SyncSession, *, failed: bool) -> None: ...


class DoubleBuffer:
    """The sender's two bucket buffers, kept across syncs while every sync ends cleanly."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self._buffers: list[torch.Tensor] = []
        self.allocations = 0

    def take(self, nbytes: int) -> list[torch.Tensor]:
        import torch

        if not self._buffers or self._buffers[0].numel() < nbytes:
            self._buffers = [
                torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(2)
            ]
            self.allocations += 1
        return self._buffers

    def discard(self) -> None:
        """Forget the buffers: a failed sync's receivers may still read them."""
        self._buffers = []


async def pipelined(
    session: SyncSession,
    buffers: DoubleBuffer,
    issue: Callable[[int, torch.Tensor], Any],
    complete: Callable[[Any], Awaitable[None]],
    *,
    fresh: bool = False,
    buckets: Sequence[BucketSpec] | None = None,
) -> None:
    """Send every bucket (or ``buckets``: a sender's share), double-buffered: the *k*-th is
    packed into buffer *k* mod 2 while the one before is in flight (at most two in flight,
    packed or sent from their tensor). ``issue(index, data)`` starts sending a bucket (called
    in order) and returns a handle; ``complete(handle)`` returns once the bytes it sent may be
    overwritten. ``fresh``: pack into new memory each bucket (handed over; still at most two
    in flight)."""
    free = [trio.Event(), trio.Event()]
    for event in free:
        event.set()

    async def finish(handle: Any, done: trio.Event) -> None:
        await complete(handle)
        done.set()

    completed = False
    try:
        async with trio.open_nursery() as nursery:
            for position, bucket in enumerate(
                session.manifest.buckets if buckets is None else buckets
            ):
                slot = position % 2
                await free[slot].wait()
                data = await session.bucket(bucket.index, buffers, slot, fresh=fresh)
                free[slot] = trio.Event()
                nursery.start_soon(finish, issue(bucket.index, data), free[slot])
        completed = True
    finally:
        if not completed:
            buffers.discard()


class ActorTransport:
    """Buckets as ``PutBucket`` asks to each receiver's ref (module docstring).

    In-process for local refs; zmq (the node's ipc or tcp link, zero-copy) for remote refs;
    refs of both kinds may be mixed, and the sender may live in any process that holds them.
    """

    kind = "actor"
    split = True

    def __init__(self) -> None:
        self.buffers = DoubleBuffer()

    def check(self, manifest: Manifest) -> None:
        """Every dtype in ``DTYPE_NAMES`` travels; nothing to refuse."""

    async def open(self, session: SyncSession) -> None:
        await trio.lowlevel.checkpoint()

    async def broadcast(self, session: SyncSession) -> None:
        await self.send(session, session.manifest.buckets)

    async def send(self, session: SyncSession, buckets: Sequence[BucketSpec]) -> None:
        """Send ``buckets`` of the session (all of them: ``broadcast``) to every receiver."""
        # the first receiver in this process keeps the packed buckets (module docstring)
        local = [getattr(ref, "cell", None) is not None for ref in session.receivers]
        keeper = local.index(True) if True in local and self.buffers.device == "cpu" else None

        async def complete(handle: tuple[int, torch.Tensor]) -> None:
            # The buffer is reusable once every receiver has acknowledged (module docstring).
            # When the runtime exposes the SendTracker of a remote send, waiting on it here
            # too would also release the buffer's last reference before reuse.
            index, data = handle
            keep = index in session.fresh
            await ask_all(
                session.receivers,
                lambda i: PutBucket(session.sync_id, index, data, keep=keep and i == keeper),
            )

        await pipelined(
            session,
            self.buffers,
            lambda index, data: (index, data),
            complete,
            fresh=keeper is not None,
            buckets=buckets,
        )

    async def close(self, session: SyncSession, *, failed: bool) -> None:
        await trio.lowlevel.checkpoint()


def deadline_seconds(value: float) -> float:
    """A deadline usable as a ``timedelta`` (torch.distributed wants a finite one)."""
    return value if math.isfinite(value) else 365 * 24 * 3600.0
