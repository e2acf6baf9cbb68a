"""Collective transports: a ``torch.distributed`` broadcast in a process group built per sync.

The topology phase builds a dedicated group: the sender (rank 0) opens a ``TCPStore`` on a free
port of ``config.host``; each receiver joins as rank 1..N (``JoinGroup``); every rank builds its
process group object directly (``ProcessGroupGloo`` / ``ProcessGroupNCCL`` / torch_npu's
``ProcessGroupHCCL``), so the sync never touches the process's default group (the trainer's own
``init_process_group`` stays untouched) and two receivers may share a process. Keys live under a
per-sync prefix, so a late rank of an old sync cannot join a new one.

Every blocking call (rendezvous, ``Work.wait``) runs in a worker thread; the group's timeout
bounds it even when a cancelled sync abandons the thread, and closing the group aborts it. The
sender double-buffers with async work handles: bucket *k+1* is packed while the broadcast of
bucket *k* runs; a buffer is refilled only once the broadcast that read it completed. Receivers
receive bucket *k+1* while bucket *k* is checksummed into the host cache.

``gloo`` runs on CPU tensors and is tested here; ``nccl`` (CUDA) and ``hccl`` (Ascend, through
torch_npu, whose ``ProcessGroupHCCL(store, rank, size, timeout)`` is documented) use the same
code with device buffers; their tests skip where the backend is not importable.
"""

from __future__ import annotations

import datetime
import logging
import socket
from typing import TYPE_CHECKING, Any, Literal

import trio

from ._buckets import HostCache
from ._errors import ManifestError
from ._manifest import Manifest
from ._messages import JoinGroup, ReceiveBroadcast
from ._transport import DoubleBuffer, SyncSession, ask_all, deadline_seconds, pipelined

if TYPE_CHECKING:
    import torch

log = logging.getLogger("asyncflow_actors.checkpoint")

Backend = Literal["gloo", "nccl", "hccl"]


def _device_type(backend: str) -> str:
    return {"gloo": "cpu", "nccl": "cuda", "hccl": "npu"}[backend]


def _local_address(peer: str) -> str:
    """The address of this host on the route to ``peer`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer, 9))
            return str(s.getsockname()[0])
        except OSError:
            return peer


def _new_group(backend: str, store: Any, rank: int, size: int, timeout: float, host: str) -> Any:
    """Build the backend's process group object (blocks until every rank has joined)."""
    import torch.distributed as dist

    delta = datetime.timedelta(seconds=deadline_seconds(timeout))
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = delta
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=_local_address(host))]
        return dist.ProcessGroupGloo(store, rank, size, options)
    if backend == "nccl":
        nccl_options = dist.ProcessGroupNCCL.Options()
        nccl_options._timeout = delta
        return dist.ProcessGroupNCCL(store, rank, size, nccl_options)
    if backend == "hccl":
        import torch_npu  # noqa: F401  (registers torch.distributed.ProcessGroupHCCL)

        return dist.ProcessGroupHCCL(store, rank, size, delta)  # type: ignore[attr-defined]
    raise ValueError(f"unknown collective backend {backend!r}")


def _wait(backend: str, work: Any, device: str) -> None:
    """Block until a collective completed (device backends: until its stream finished too)."""
    work.wait()
    if backend == "nccl":
        import torch

        torch.cuda.current_stream(device).synchronize()
    elif backend == "hccl":
        import torch

        torch.npu.current_stream(device).synchronize()  # type: ignore[attr-defined]


def _broadcast(group: Any, tensor: torch.Tensor) -> Any:
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([tensor], options)


class Group:
    """One rank's process group of one sync; ``close`` aborts whatever is in flight."""

    def __init__(self, backend: str, group: Any, store: Any, device: str) -> None:
        self.backend = backend
        self.group = group
        self.store = store
        self.device = device

    async def wait(self, work: Any) -> None:
        # abandon_on_cancel: a cancelled sync does not wait; the group's timeout (or close)
        # ends the abandoned thread.
        await trio.to_thread.run_sync(
            _wait, self.backend, work, self.device, abandon_on_cancel=True
        )

    def close(self) -> None:
        group, self.group, self.store = self.group, None, None
        if group is None:
            return
        for method in ("abort", "shutdown"):
            try:
                getattr(group, method)()
                return
            except Exception as exc:  # not supported by this backend / version
                log.debug("process group %s(): %s", method, exc)


async def join_group(msg: JoinGroup, device: str) -> Group:
    """A receiver joins the sync's group as ``msg.rank`` (the blocking rendezvous in a thread);
    ``device``: where it receives."""

    def build() -> Group:
        import torch.distributed as dist

        delta = datetime.timedelta(seconds=deadline_seconds(msg.timeout))
        store = dist.TCPStore(  # type: ignore[attr-defined]
            msg.host, msg.port, msg.world_size, False, timeout=delta
        )
        prefixed = dist.PrefixStore(f"afa-sync/{msg.sync_id}", store)  # type: ignore[attr-defined]
        group = _new_group(msg.backend, prefixed, msg.rank, msg.world_size, msg.timeout, msg.host)
        return Group(msg.backend, group, store, device)

    return await trio.to_thread.run_sync(build, abandon_on_cancel=True)


async def receive_broadcast(group: Group, cache: HostCache, offload: bool) -> int:
    """Receive every bucket of ``cache``'s manifest from rank 0 into fresh buffers, staging
    bucket *k* into the cache while bucket *k+1* arrives. Returns the bytes staged."""
    import torch

    from ._copies import run_sync

    received = 0
    async with trio.open_nursery() as nursery:
        staged = trio.Event()
        staged.set()
        for bucket in cache.manifest.buckets:
            buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=group.device)
            await group.wait(_broadcast(group.group, buffer))
            await staged.wait()  # at most one bucket being staged while the next arrives
            staged = trio.Event()

            async def stage(index: int, data: torch.Tensor, done: trio.Event) -> None:
                nonlocal received
                received += await run_sync(offload, cache.stage_bucket, index, data)
                done.set()

            nursery.start_soon(stage, bucket.index, buffer, staged)
    return received


class CollectiveTransport:
    """Buckets by ``torch.distributed`` broadcast (``backend``: gloo, nccl or hccl).

    ``device``: the sender's bucket buffers (``"cpu"`` for gloo; e.g. ``"cuda:0"`` for nccl).
    """

    split = True

    def __init__(self, backend: Backend = "gloo", *, device: str | None = None) -> None:
        if backend not in ("gloo", "nccl", "hccl"):
            raise ManifestError(f"collective backend {backend!r} is not gloo, nccl or hccl")
        self.backend = backend
        self.device = device if device is not None else _device_type(backend)
        self.buffers = DoubleBuffer(self.device)
        self._groups: dict[str, Group] = {}

    @property
    def kind(self) -> str:
        return self.backend

    def check(self, manifest: Manifest) -> None:
        """Every dtype travels as bytes; the backend must be importable here."""
        import torch.distributed as dist

        if not dist.is_available():
            raise ManifestError("torch.distributed is not available in this torch build")
        if self.backend == "hccl":
            try:
                import torch_npu  # noqa: F401
            except ImportError as exc:
                raise ManifestError("the hccl transport needs torch_npu (Ascend)") from exc

    async def open(self, session: SyncSession) -> None:
        import torch.distributed as dist

        config = session.config
        timeout = deadline_seconds(config.deadlines.broadcast)
        world = len(session.receivers) + 1
        delta = datetime.timedelta(seconds=deadline_seconds(config.deadlines.topology))
        store = await trio.to_thread.run_sync(
            lambda: dist.TCPStore(  # type: ignore[attr-defined]
                config.host, 0, world, True, timeout=delta, wait_for_workers=False
            )
        )
        prefixed = dist.PrefixStore(f"afa-sync/{session.sync_id}", store)  # type: ignore[attr-defined]
        holder: list[Any] = []

        async def build() -> None:
            def make() -> Any:
                return _new_group(self.backend, prefixed, 0, world, timeout, config.host)

            holder.append(await trio.to_thread.run_sync(make, abandon_on_cancel=True))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(build)
            nursery.start_soon(
                ask_all,
                session.receivers,
                lambda i: JoinGroup(
                    session.sync_id,
                    self.backend,
                    config.host,
                    int(store.port),
                    i + 1,
                    world,
                    timeout,
                ),
            )
        self._groups[session.sync_id] = Group(self.backend, holder[0], store, self.device)

    async def broadcast(self, session: SyncSession) -> None:
        group = self._groups[session.sync_id]

        def issue(index: int, data: torch.Tensor) -> Any:
            return _broadcast(group.group, data)  # in bucket order: the receivers post in order

        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                ask_all, session.receivers, lambda _: ReceiveBroadcast(session.sync_id)
            )
            # complete() returns once the broadcast that read the buffer finished
            await pipelined(session, self.buffers, issue, group.wait)

    async def close(self, session: SyncSession, *, failed: bool) -> None:
        group = self._groups.pop(session.sync_id, None)
        if group is not None:
            if failed:
                self.buffers.discard()  # an abandoned broadcast may still read them
            await trio.to_thread.run_sync(group.close)
        else:
            await trio.lowlevel.checkpoint()
