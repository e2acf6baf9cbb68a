"""Weight sync from every rank: each sends the buckets of the parameters it holds.

The ``ShardedSyncEngine``'s parallel path (docs/training.md, "Weight sync from every rank").
FSDP2 shards every parameter by rows (``Shard(0)``, ``torch.chunk``'s split), so rank *r*'s
shard of a tensor is one contiguous run of the whole tensor's bytes. ``plan_shards`` lays out
one manifest (the CheckpointEngine's, ``plan_segments``) whose buckets each hold bytes of one
rank's shards only, rank after rank; a replicated parameter (``ddp``, or one FSDP2 left whole)
is cut by the same rows rule, so every byte has exactly one sender.

A sync then runs the engine's protocol from rank 0 (pause, prepare with the manifest, …,
finalize, resume: the two-phase commit), except for its broadcast: rank 0 sends the
``sync_send`` command (the manifest, which rank sends which bucket, the receivers' addresses)
and every rank packs its own buckets, double-buffered, and sends them to every receiver with
``PutBucket`` asks, in parallel; a rank > 0 does so from an actor system of its own
(``_rank_mesh``). Then one all-reduce brings every bucket's checksum and every rank's status
to rank 0: the receivers are told to commit (finalize, then resume) only when every rank sent
every bucket, and each receiver verifies every bucket against those checksums. A rank that
fails (an error, its deadline) reports it, and the sync fails with ``ShardSendFailed`` naming
it: every receiver drops the version and keeps its weights, and the group stays in step (the
all-reduce is always joined, by every rank, whatever the sync's outcome). A rank that dies
breaks the group (``RankFailed``), as in any command.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
import trio

from ..actors import ActorRef
from ..actors.remote import RemoteActorRef, mesh_of
from ..checkpoint import (
    ActorTransport,
    BucketSource,
    BucketSpec,
    CheckpointConfig,
    Manifest,
    Piece,
    PutBucket,
    TensorSpec,
)
from ..checkpoint._manifest import ALIGNMENT, plan_segments, spec_of
from ..checkpoint._transport import DoubleBuffer, SyncSession, ask_all, pipelined

if TYPE_CHECKING:
    from ._distributed import DistributedLearner
    from ._rank_learner import RankLearner

log = logging.getLogger("asyncflow_actors.roles.ranks")


class ShardSendFailed(RuntimeError):
    """Rank ``rank`` could not send its buckets of a weight sync (an error or its deadline;
    its log says which): the sync is dropped, every receiver keeps its weights."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


def rows_of(rows: int, world: int, rank: int) -> tuple[int, int]:
    """The rows ``[start, end)`` of a tensor of ``rows`` rows that ``rank`` holds under FSDP2's
    ``Shard(0)`` (``torch.chunk``: ``ceil(rows / world)`` a rank, the last ones short or
    empty); a replicated tensor is cut the same way."""
    chunk = -(-rows // world)
    start = min(rows, rank * chunk)
    return start, min(rows, start + chunk)


def _sharded(param: torch.Tensor) -> bool | None:
    """True for a ``Shard(0)`` DTensor, False for a whole tensor (plain or replicated), None
    for one sharded another way (not sent by its ranks)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(param, DTensor):
        return False
    placements = tuple(param.placements)
    if placements == (Shard(0),) and param.dim() > 0:
        return True
    if all(isinstance(p, Replicate) for p in placements):
        return False
    return None


@attrs.frozen
class ShardPlan:
    """A sync's layout over the ranks: the manifest, each bucket's sending rank (``senders``)
    and the parameter behind each of the manifest's tensors (``names``)."""

    world: int
    manifest: Manifest
    senders: tuple[int, ...]
    names: tuple[str, ...]

    def buckets_of(self, rank: int) -> list[BucketSpec]:
        return [b for b in self.manifest.buckets if self.senders[b.index] == rank]


#: A rank's buckets are never made smaller than this to fill two (``rank_bucket_bytes``).
SMALLEST_BUCKET = 1 << 20


def rank_bucket_bytes(total: int, world: int, bucket_bytes: int) -> int:
    """The bucket size of a sync of ``total`` bytes from ``world`` ranks: at most
    ``bucket_bytes``, and from several ranks small enough that each rank's share fills two
    buckets (its double buffer then packs one while the other is on its way: with one bucket
    a rank would pack its whole share before its first byte left), but not below
    ``SMALLEST_BUCKET``."""
    if world == 1:
        return bucket_bytes
    half = -(-total // (2 * world))
    half = -(-half // ALIGNMENT) * ALIGNMENT
    return min(bucket_bytes, max(half, SMALLEST_BUCKET))


def plan_shards(
    named: Sequence[tuple[str, str, torch.Tensor]], world: int, bucket_bytes: int
) -> ShardPlan | None:
    """The layout of a sync of ``named`` (``(sent name, parameter name, parameter)``) from
    ``world`` ranks, in buckets of ``rank_bucket_bytes``; None if a parameter is sharded
    another way than by rows."""
    specs: list[TensorSpec] = []
    segments: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]
    for index, (name, _, param) in enumerate(named):
        if _sharded(param) is None:
            return None
        spec = spec_of(name, param)
        specs.append(spec)
        if param.dim() == 0:
            segments[0].append((index, 0, spec.nbytes))
            continue
        rows = param.shape[0]
        row_bytes = spec.nbytes // rows if rows else 0
        for rank in range(world):
            start, end = rows_of(rows, world, rank)
            segments[rank].append((index, start * row_bytes, (end - start) * row_bytes))
    total = sum(spec.nbytes for spec in specs)
    manifest, senders = plan_segments(
        specs, segments, rank_bucket_bytes(total, world, bucket_bytes)
    )
    return ShardPlan(world, manifest, senders, tuple(source for _, source, _ in named))


def local_parts(
    params: dict[str, torch.Tensor], plan: ShardPlan, rank: int
) -> tuple[list[torch.Tensor], list[int]]:
    """This rank's bytes of each of the plan's tensors, and where they start in the whole
    tensor (``BucketSource``'s ``offsets``). Raises ``ValueError`` if a shard is not the rows
    the plan expects of this rank."""
    tensors: list[torch.Tensor] = []
    offsets: list[int] = []
    for spec, name in zip(plan.manifest.tensors, plan.names, strict=True):
        param = params[name].detach()
        sharded = _sharded(param)
        local = param.to_local() if hasattr(param, "to_local") else param
        if param.dim() == 0:
            tensors.append(local if rank == 0 else local.new_empty(0))
            offsets.append(0)
            continue
        start, end = rows_of(param.shape[0], plan.world, rank)
        if sharded:
            if local.shape[0] != end - start:
                raise ValueError(
                    f"{name}: rank {rank} holds {local.shape[0]} rows, expected {end - start}"
                )
        else:
            local = local[start:end]
        tensors.append(local.contiguous())
        offsets.append(start * spec.nbytes // param.shape[0] if param.shape[0] else 0)
    return tensors, offsets


# -- the wire: plain data in the rank command's msgpack header ----------------------------------


def manifest_to_wire(manifest: Manifest) -> dict[str, Any]:
    return {
        "tensors": [[t.name, t.dtype, list(t.shape)] for t in manifest.tensors],
        "buckets": [
            [b.index, b.nbytes, [[p.tensor, p.offset, p.start, p.nbytes] for p in b.pieces]]
            for b in manifest.buckets
        ],
        "bucket_bytes": manifest.bucket_bytes,
    }


def manifest_from_wire(data: dict[str, Any]) -> Manifest:
    manifest = Manifest(
        [TensorSpec(name, dtype, shape) for name, dtype, shape in data["tensors"]],
        [BucketSpec(i, n, [Piece(*p) for p in pieces]) for i, n, pieces in data["buckets"]],
        data["bucket_bytes"],
    )
    manifest.check()
    return manifest


async def addresses_of(refs: Sequence[ActorRef[Any]]) -> list[list[Any]] | None:
    """The receivers' addresses as plain data (``_rank_keys.address_entry``: with their
    nodes' CURVE keys, without their stop tokens: the ranks only send buckets), or None if one
    cannot be reached from another process (a system without a mesh)."""
    from ._rank_keys import address_entry

    out: list[list[Any]] = []
    for ref in refs:
        cell = getattr(ref, "cell", None)  # a ref to an actor of this process
        if cell is not None:
            try:
                mesh = mesh_of(cell.system)
            except TypeError:
                return None
            await mesh.ensure_listening()  # so that the ranks can reach it
        elif isinstance(ref, RemoteActorRef):
            mesh = ref.mesh
        else:
            return None
        out.append(address_entry(mesh, mesh.address_of(ref)))
    await trio.lowlevel.checkpoint()
    return out


# -- a rank > 0's side of the ``sync_send`` command ---------------------------------------------

_BUFFERS: list[DoubleBuffer] = []  # this process's two bucket buffers, kept across syncs


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _unsigned(value: int) -> int:
    return value + (1 << 64) if value < 0 else value


def serve_send(learner: RankLearner, header: dict[str, Any]) -> None:
    """Send this rank's buckets of a sync to every receiver, then join the all-reduce of the
    checksums and statuses (always, whatever happened: rank 0 waits in it)."""
    from ._rank_mesh import rank_mesh
    from ._ranks import control_group

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    buckets = len(header["manifest"]["buckets"])
    result = torch.zeros(buckets + world, dtype=torch.int64)
    try:
        manifest = manifest_from_wire(header["manifest"])
        plan = ShardPlan(world, manifest, tuple(header["senders"]), tuple(header["names"]))
        tensors, offsets = local_parts(dict(learner.named_parameters()), plan, rank)
        source = BucketSource(tensors, manifest, algorithm=header["checksum"], offsets=offsets)
        mesh = rank_mesh(rank)
        sums = mesh.run(_send, mesh, header, source, plan.buckets_of(rank), rank)
        for index, value in sums.items():
            result[index] = _signed(value)
    except Exception:
        log.exception("rank %d: sending its buckets of sync %s failed", rank, header["sync_id"])
        result[buckets + rank] = 1
    torch.distributed.all_reduce(result, group=control_group())


async def _send(
    mesh: Any, header: dict[str, Any], source: BucketSource, mine: list[BucketSpec], rank: int
) -> dict[int, int]:
    """Pack and send ``mine``, double-buffered, under the sync's deadline; their checksums."""
    system = mesh.system
    assert system is not None
    from ._rank_keys import resolve_entry

    own = mesh_of(system)
    refs = tuple(resolve_entry(own, entry) for entry in header["receivers"])
    sync_id = header["sync_id"]
    config = CheckpointConfig(bucket_bytes=source.manifest.bucket_bytes)
    session = SyncSession(sync_id, header["version"], source.manifest, refs, config, source)
    if not _BUFFERS:
        _BUFFERS.append(DoubleBuffer())
    fault = _fault(rank)

    async def complete(handle: tuple[int, torch.Tensor]) -> None:
        index, data = handle
        # every receiver is in another process: the bytes it gets are its own (``keep``)
        await ask_all(refs, lambda _: PutBucket(sync_id, index, data, keep=True))
        fault()

    with trio.fail_after(header["deadline"]):
        await pipelined(session, _BUFFERS[0], lambda i, d: (i, d), complete, buckets=mine)
    return {b.index: session.checksums[b.index] for b in mine}


def _fault(rank: int) -> Callable[[], None]:  # pragma: no cover - a test hook
    """``AFA_RANK_FAIL_IN_SYNC=<rank>``: that rank raises once its first bucket was sent;
    ``AFA_RANK_KILL_IN_SYNC=<rank>``: it SIGKILLs itself then (tests)."""
    me = str(rank)
    if os.environ.get("AFA_RANK_KILL_IN_SYNC") == me:

        def kill() -> None:
            os.kill(os.getpid(), signal.SIGKILL)

        return kill
    if os.environ.get("AFA_RANK_FAIL_IN_SYNC") == me:

        def fail() -> None:
            raise RuntimeError("AFA_RANK_FAIL_IN_SYNC: failing after the first bucket")

        return fail
    return lambda: None


# -- rank 0's side ------------------------------------------------------------------------------


class _Join:
    """Rank 0's part of a ``sync_send``'s closing all-reduce, in a thread of its own started
    right after the command: whatever becomes of the sync here, it is joined (the other ranks
    wait in it), and the next command waits for it (``ShardedSyncEngine.sync``)."""

    def __init__(self, fn: Callable[[], torch.Tensor]) -> None:
        self.result: torch.Tensor | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._fn = fn
        threading.Thread(target=self._run, name="afa-sync-join", daemon=True).start()

    def _run(self) -> None:
        try:
            self.result = self._fn()
        except BaseException as exc:
            self.error = exc
        finally:
            self.done.set()

    async def wait(self) -> torch.Tensor:
        """The all-reduced checksums and statuses (raises what the collective raised)."""
        await trio.to_thread.run_sync(self.done.wait, abandon_on_cancel=True)
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


class RankTransport(ActorTransport):
    """The ``ActorTransport`` of a ``ShardedSyncEngine``: with a ``ShardPlan`` of several ranks
    (``shards``, set for one sync), each rank sends its own buckets (module docstring);
    without, rank 0 sends them all, as the actor transport does."""

    def __init__(self, learner: DistributedLearner) -> None:
        super().__init__()
        self.learner = learner
        self.shards: ShardPlan | None = None
        self.receivers: list[list[Any]] = []
        self.join: _Join | None = None

    async def broadcast(self, session: SyncSession) -> None:
        plan = self.shards
        if plan is None or plan.world == 1:
            await super().broadcast(session)
            return
        manifest, learner = session.manifest, self.learner
        deadline = min(session.config.deadlines.broadcast, 0.8 * learner.group.rendezvous.timeout_s)
        header = {
            "op": "sync_send", "sync_id": session.sync_id, "version": session.version,
            "manifest": manifest_to_wire(manifest), "senders": list(plan.senders),
            "names": list(plan.names), "receivers": self.receivers,
            "checksum": session.source.algorithm, "deadline": deadline,
        }  # fmt: skip
        size = len(manifest.buckets) + plan.world
        with trio.CancelScope(shield=True):  # a command sent is always joined
            await trio.to_thread.run_sync(learner.start_send, header)
            self.join = join = _Join(lambda: learner.join_send(size))
        await self.send(session, plan.buckets_of(0))
        result = (await join.wait()).tolist()
        failed = [rank for rank in range(plan.world) if result[len(manifest.buckets) + rank]]
        if failed:
            raise ShardSendFailed(
                f"rank {failed[0]} could not send its buckets of sync {session.sync_id} (its "
                f"log says why; {len(failed)} rank(s) failed)",
                failed[0],
            )
        for bucket in manifest.buckets:
            if plan.senders[bucket.index] != 0:
                session.checksums[bucket.index] = _unsigned(result[bucket.index])

    async def finish(self) -> None:
        """Wait (shielded) for the last sync's all-reduce, if any: the group is in step after."""
        join, self.join = self.join, None
        if join is not None:
            with trio.CancelScope(shield=True):
                try:
                    await join.wait()
                except Exception:  # the sync reported it; the group's state says the rest
                    pass
