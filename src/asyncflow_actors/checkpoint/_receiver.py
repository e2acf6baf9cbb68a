"""The receiving half of weight sync: what a rollout engine or a forward worker embeds.

``WeightReceiver`` wraps one ``SyncTarget``. The actor that hosts the target hands it every sync
message (``await receiver.handle(msg, ctx)``, or use ``SyncTargetActor``), and — when it loads
lazily — calls ``await receiver.apply_pending()`` at each batch boundary.

What it promises:

- Received bytes land in a host cache (copies and checksums in worker threads: the hosting
  process's event loop keeps running); the target's weights are untouched until the commit.
  The pieces of a tensor split across buckets it owns are checksummed on arrival and copied
  together only after the commit, before the load (``_assembly``).
- A target switches whole or not at all: ``load_weights`` gets every tensor of a verified
  version at once. Before the sender's commit nothing changes; a dropped sync leaves the old
  weights in place.
- ``lazy`` receivers keep the committed weights pending until ``apply_pending()`` (the next
  batch boundary); ``eager`` ones (or a sync with ``eager=True``) load before resuming. Pending
  weights of a sync that sent a subset (LoRA) are merged with any still pending before.
- A lazy receiver built with ``pause=False`` acknowledges a sync's pause without pausing its
  target: its host loads at its own boundaries, so nothing needs to stop while the bytes
  arrive (a rollout engine keeps generating on its old weights until its next group).
- The target is resumed by ``SyncResume`` whatever happened, and on its own once the pause's
  lease runs out (the sender died), so no target stays paused. Weights it voted for (verified
  at finalize) outlive the lease: the sender may have committed them already, so they wait
  for its late ``SyncResume`` (commit or drop) until a newer sync supersedes them. A yes vote
  never turns into weights silently dropped while the sender counts them as delivered.
- Bad input is answered with an error (``ctx.reply_error``), never a crash of the host actor.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import attrs
import trio

from ..actors import Actor, ActorContext, Reply
from ._assembly import Assembling, Assembly
from ._buckets import PROCESS_TOKEN, HostCache
from ._copies import offloads, run_sync
from ._errors import ManifestError, StaleSync
from ._manifest import TensorSpec, spec_of
from ._messages import (
    FusedAck,
    GetReceiverStatistics,
    JoinGroup,
    PutBucket,
    ReadShard,
    ReceiveBroadcast,
    ReceiverStatistics,
    Resumed,
    SyncFinalize,
    SyncFused,
    SyncMessage,
    SyncPause,
    SyncPrepare,
    SyncResume,
)
from ._target import PauseAck, PauseMode, SyncTarget

if TYPE_CHECKING:
    import torch

    from ._collective import Group

log = logging.getLogger("asyncflow_actors.checkpoint")

LoadMode = Literal["lazy", "eager"]


@attrs.define(eq=False)
class _Digests:
    """Checksums of buckets acknowledged on arrival, running in worker threads."""

    running: int = 0
    idle: trio.Event = attrs.Factory(trio.Event)
    error: BaseException | None = None

    def __attrs_post_init__(self) -> None:
        self.idle.set()

    async def wait(self) -> None:
        await self.idle.wait()
        if self.error is not None:
            raise self.error


@attrs.define(eq=False)
class _Sync:
    """The receiver's side of the sync in progress."""

    sync_id: str
    paused: bool = False  # the target acknowledged the pause
    mode: PauseMode = PauseMode.DRAIN  # the pause the sender asked for
    pausing: trio.Event = attrs.Factory(trio.Event)  # set once the pause ended, either way
    version: int = -1
    cache: HostCache | None = None
    verified: dict[str, torch.Tensor] | None = None
    assembling: Assembling | None = None  # its split tensors, put together after the commit
    group: Group | None = None
    scopes: list[trio.CancelScope] = attrs.Factory(list)  # lease, broadcast receive
    digests: _Digests = attrs.Factory(_Digests)


class WeightReceiver:
    """Receives weights for ``target`` (see the module docstring).

    ``load``: ``"lazy"`` (the host calls ``apply_pending()`` at its batch boundaries) or
    ``"eager"``. ``expected``: the tensors the target holds (a state dict or ``TensorSpec``s);
    a sync naming another tensor, dtype or shape is refused before any byte moves (without it,
    the specs of each committed sync are remembered and checked the same way). ``device``: where
    collective transports receive (``"cuda:0"`` for nccl); the host cache is always in host
    memory. ``offload``: run copies and checksums in worker threads. ``pause=False`` (lazy
    only): answer a sync's pause without pausing the target, which keeps running on its old
    weights until it calls ``apply_pending()`` (the ack reports the version it holds).
    """

    def __init__(
        self,
        target: SyncTarget,
        *,
        load: LoadMode = "lazy",
        expected: Mapping[str, torch.Tensor | TensorSpec] | None = None,
        device: str = "cpu",
        offload: bool = True,
        name: str = "",
        pause: bool = True,
    ) -> None:
        if load not in ("lazy", "eager"):
            raise ValueError(f"load must be 'lazy' or 'eager', got {load!r}")
        if not pause and load == "eager":
            raise ValueError(
                "pause=False needs load='lazy': an eager receiver loads while its target is paused"
            )
        self.target = target
        self.load = load
        self.pause = pause
        self.device = device
        self.offload = offload
        self.name = name
        self._strict = expected is not None
        self._known: dict[str, TensorSpec] = {}
        for key, value in (expected or {}).items():
            self._known[key] = value if isinstance(value, TensorSpec) else spec_of(key, value)
        self._sync: _Sync | None = None
        # a sync whose lease ran out after this receiver voted yes: its verified weights wait
        # for the sender's word (a late ``SyncResume``), its target already resumed
        self._voted: _Sync | None = None
        self._pending: dict[str, torch.Tensor] | None = None
        self._pending_version: int | None = None
        self._assembling: list[Assembling] = []  # the pending weights' split tensors
        self._loading: int | None = None  # the version a load under way brings
        self._load_lock = trio.Lock()
        self._loaded = trio.Event()  # set when the load under way ends (replaced per load)
        self._limiter = trio.CapacityLimiter(2)  # background checksums at a time
        self._committed = self._aborted = self._expired = 0
        self._bytes = self._loads = self._load_errors = 0
        self._last_load = 0.0

    # -- what the host calls -------------------------------------------------------------------

    @property
    def pending_version(self) -> int | None:
        """The version waiting for ``apply_pending()``, or ``None``."""
        return self._pending_version

    async def apply_pending(self) -> int | None:
        """Load the pending weights into the target, if any; return their version (else None).

        Call it at a batch boundary. If the target refuses them (``load_weights`` raises), it
        keeps its old weights, the pending ones are dropped and the error is raised.
        """
        await trio.lowlevel.checkpoint()
        if self._pending is None and not self._load_lock.locked():
            return None
        return await self._apply()

    async def _apply(self) -> int | None:
        # A load under way (another task took the pending weights): wait for it, so that
        # whatever the caller starts next runs on the new weights. Its waiters wake together
        # (an event), not one per scheduling round through the lock: the groups a rollout
        # starts after a load then reach its engine together, in one wave.
        while self._load_lock.locked():
            await self._loaded.wait()
        if self._pending is None:
            return None
        async with self._load_lock:
            self._loaded = trio.Event()
            weights, version = self._pending, self._pending_version
            if weights is None or version is None:
                return None
            assembling, self._assembling = self._assembling, []
            self._pending = self._pending_version = None
            self._loading = version
            started = time.perf_counter()
            try:
                for job in assembling:  # split tensors: their copies, started at the commit
                    weights.update(await job.result())
                await self.target.load_weights(weights, version)
            except BaseException:
                self._load_errors += 1
                raise
            finally:
                self._loading = None
                self._loaded.set()
            self._loads += 1
            self._last_load = time.perf_counter() - started
            return version

    def statistics(self) -> ReceiverStatistics:
        sync = self._sync
        return ReceiverStatistics(
            name=self.name,
            version=self.target.version,
            pending_version=self._pending_version,
            paused=sync is not None and sync.paused,
            sync_id=sync.sync_id if sync is not None else None,
            committed=self._committed,
            aborted=self._aborted,
            leases_expired=self._expired,
            bytes_received=self._bytes,
            loads=self._loads,
            load_errors=self._load_errors,
            last_load_seconds=self._last_load,
        )

    async def handle(self, msg: SyncMessage, ctx: ActorContext[Any]) -> Any:
        """Answer one sync message (the host actor returns this from ``receive``).

        Errors are answered to the sender (``ctx.reply_error``); the host never crashes on them.
        """
        try:
            return await self._dispatch(msg, ctx)
        except Exception as exc:
            ctx.reply_error(exc)
            return None

    # -- the conversation ------------------------------------------------------------------------

    async def _dispatch(self, msg: SyncMessage, ctx: ActorContext[Any]) -> Any:
        if isinstance(msg, SyncPause):
            return await self._pause(msg, ctx)
        if isinstance(msg, SyncResume):
            return await self._resume(msg, ctx)
        if isinstance(msg, SyncFused):
            return await self._fused(msg, ctx)
        if isinstance(msg, GetReceiverStatistics):
            await trio.lowlevel.checkpoint()
            return self.statistics()
        sync = self._current(msg.sync_id)
        if isinstance(msg, SyncPrepare):
            return await self._prepare(sync, msg)
        cache = sync.cache
        if cache is None:
            raise StaleSync(f"{self._who()}: sync {msg.sync_id} was not prepared")
        if isinstance(msg, PutBucket):
            return await self._put_bucket(sync, cache, msg, ctx)
        if isinstance(msg, ReadShard):
            from ._file import read_shard

            tensors, digest = await run_sync(self.offload, read_shard, msg.path, cache.algorithm)
            staged = cache.stage_tensors(msg.index, tensors, digest)
            self._bytes += staged
            return staged
        if isinstance(msg, JoinGroup):
            from ._collective import join_group

            sync.group = await join_group(msg, self.device)
            return None
        if isinstance(msg, ReceiveBroadcast):
            self._start_broadcast(sync, cache, ctx)
            return None
        if isinstance(msg, SyncFinalize):
            return await self._finalize(sync, cache, msg.checksums)
        raise TypeError(f"{self._who()}: not a sync message: {msg!r}")

    async def _finalize(self, sync: _Sync, cache: HostCache, checksums: tuple[int, ...]) -> int:
        """Verify every bucket (the receiver's vote); the verified tensors wait for the commit."""
        await sync.digests.wait()

        def verified() -> tuple[dict[str, torch.Tensor], Assembly | None]:
            cache.verify(checksums)
            return cache.staged()  # pieces in buckets we keep: copied after the commit

        total = cache.manifest.bucket_total
        tensors, assembly = await run_sync(offloads(self.offload, total), verified)
        sync.verified = tensors
        sync.assembling = Assembling(assembly, self.offload) if assembly is not None else None
        sync.cache = None
        return cache.bytes

    async def _fused(self, msg: SyncFused, ctx: ActorContext[Any]) -> FusedAck:
        """Pause, prepare, stage the one bucket, verify: the five-phase conversation's first
        four steps in one request, in the same order and with the same checks."""
        ack = await self._pause(SyncPause(msg.sync_id, msg.mode, msg.lease), ctx)
        sync = self._current(msg.sync_id)
        prepare = SyncPrepare(msg.sync_id, msg.version, msg.manifest, msg.sender, msg.checksum)
        await self._prepare(sync, prepare)
        cache = sync.cache
        assert cache is not None
        buckets = len(cache.manifest.buckets)
        if (msg.data is None) != (buckets == 0) or buckets > 1:
            raise ManifestError(
                f"{self._who()}: a fused sync carries the manifest's one bucket, got "
                f"{'no' if msg.data is None else 'one'} bucket for {buckets}"
            )
        if msg.data is not None:
            cache.take(0, msg.data)
            size = cache.manifest.buckets[0].nbytes
            self._bytes += size
            await run_sync(offloads(self.offload, size), cache.digest, 0, msg.data)
        staged = await self._finalize(sync, cache, msg.checksums)
        return FusedAck(ack, staged)

    def _who(self) -> str:
        return f"receiver {self.name!r}" if self.name else "receiver"

    def _current(self, sync_id: str) -> _Sync:
        sync = self._sync
        if sync is None or sync.sync_id != sync_id:
            now = sync.sync_id if sync is not None else "none"
            raise StaleSync(f"{self._who()}: sync {sync_id} is not in progress (current: {now})")
        return sync

    async def _pause(self, msg: SyncPause, ctx: ActorContext[Any]) -> PauseAck:
        sync = self._sync
        if sync is None or sync.sync_id != msg.sync_id:
            if sync is not None:
                # A new sync supersedes one whose sender vanished; the target stays paused.
                log.warning("%s: sync %s superseded by %s", self._who(), sync.sync_id, msg.sync_id)
                self._drop(sync, count=True)
            voted, self._voted = self._voted, None
            if voted is not None:  # its sender moved on without a word: a newer sync replaces it
                self._drop(voted, count=True)
            sync = self._sync = _Sync(msg.sync_id)
            if math.isfinite(msg.lease):
                scope = trio.CancelScope(deadline=trio.current_time() + msg.lease)
                sync.scopes.append(scope)
                ctx.start_soon(self._watch_lease, sync, scope)
        sync.mode = msg.mode
        try:
            if not self.pause:
                await trio.lowlevel.checkpoint()
                return PauseAck(msg.mode, self.target.version)
            ack = await self.target.pause(msg.mode)
            sync.paused = True
        finally:
            sync.pausing.set()
        return ack

    async def _watch_lease(self, sync: _Sync, scope: trio.CancelScope) -> None:
        with scope:
            await trio.sleep_forever()
        if self._sync is not sync or trio.current_time() < scope.deadline:
            return  # the sync ended: its end cancelled this scope
        self._expired += 1
        log.warning("%s: lease of sync %s ran out: resuming on our own", self._who(), sync.sync_id)
        await sync.pausing.wait()  # never resume under a pause that is still going on
        if self._sync is not sync:
            return
        if sync.verified is not None:
            # Voted yes: the sender may have committed already (its resume is late, not lost).
            # Resume the target on its old weights; the verified ones wait for that resume.
            self._sync, self._voted = None, sync
            with trio.CancelScope(shield=True):
                try:
                    await self.target.resume()
                except Exception:
                    log.exception(
                        "%s: resuming after the lease of %s failed", self._who(), sync.sync_id
                    )
            return
        try:
            await self._end(sync, commit=False, eager=False)
        except Exception:
            log.exception("%s: resuming after the lease of %s failed", self._who(), sync.sync_id)

    async def _prepare(self, sync: _Sync, msg: SyncPrepare) -> int:
        manifest = msg.manifest
        manifest.check()
        pending = self._pending_version
        newest = max(self.target.version, pending if pending is not None else -1)
        if msg.version < newest:
            raise StaleSync(f"{self._who()}: version {msg.version} is older than {newest}")
        for spec in manifest.tensors:
            known = self._known.get(spec.name)
            if known is None and self._strict:
                raise ManifestError(f"{self._who()}: tensor {spec.name!r} is not a weight here")
            if known is not None and (known.dtype, known.shape) != (spec.dtype, spec.shape):
                raise ManifestError(
                    f"{self._who()}: tensor {spec.name!r} is {spec.dtype} {spec.shape}, "
                    f"expected {known.dtype} {known.shape}"
                )
        sync.version = msg.version
        sync.verified = None
        sync.cache = await run_sync(
            offloads(self.offload, manifest.bucket_total),
            lambda: HostCache(manifest, copy=msg.sender == PROCESS_TOKEN, algorithm=msg.checksum),
        )
        return manifest.bucket_total

    async def _put_bucket(
        self, sync: _Sync, cache: HostCache, msg: PutBucket, ctx: ActorContext[Any]
    ) -> int:
        """Stage a bucket and acknowledge it (the sender then reuses its buffer).

        Bytes another process sent are ours from the moment they arrived, and so are those the
        sender handed over (``msg.keep``): acknowledge at once and checksum them in the
        background (finalize waits). Other bytes shared with the sender (same process) are
        copied before the acknowledgement.
        """
        cache.take(msg.index, msg.data)
        size = cache.manifest.buckets[msg.index].nbytes
        self._bytes += size
        offload = offloads(self.offload, size)
        owned = msg.keep and msg.data.device.type == "cpu"
        if (cache.copy and not owned) or msg.data.device.type != "cpu" or not offload:
            await run_sync(offload, cache.digest, msg.index, msg.data, owned)
            return size
        digests = sync.digests
        if digests.running == 0:
            digests.idle = trio.Event()
        digests.running += 1

        async def digest() -> None:
            try:
                await run_sync(
                    True, cache.digest, msg.index, msg.data, owned, limiter=self._limiter
                )
            except Exception as exc:
                digests.error = digests.error or exc
            finally:
                digests.running -= 1
                if digests.running == 0:
                    digests.idle.set()

        ctx.start_soon(digest)
        await trio.lowlevel.checkpoint()
        return size

    def _start_broadcast(self, sync: _Sync, cache: HostCache, ctx: ActorContext[Any]) -> None:
        """Receive by collective in a helper task, so the host stays responsive (a
        ``SyncResume`` that drops the sync cancels it); the reply is deferred to its end."""
        from ._collective import receive_broadcast

        group = sync.group
        if group is None:
            raise StaleSync(f"{self._who()}: sync {sync.sync_id} has no process group")
        reply: Reply = ctx.defer_reply()
        scope = trio.CancelScope()
        sync.scopes.append(scope)

        async def run() -> None:
            try:
                with scope:
                    received = await receive_broadcast(group, cache, self.offload)
                    self._bytes += received
                    reply.send(received)
                    return
                reply.fail(StaleSync(f"{self._who()}: sync {sync.sync_id} was dropped"))
            except Exception as exc:
                reply.fail(exc)

        ctx.start_soon(run)

    async def _resume(self, msg: SyncResume, ctx: ActorContext[Any]) -> Resumed:
        sync, voted = self._sync, self._voted
        if sync is not None and sync.sync_id == msg.sync_id:
            await self._end(sync, commit=msg.commit, eager=msg.eager, ctx=ctx)
        elif voted is not None and voted.sync_id == msg.sync_id:
            self._voted = None  # the sender's word on weights voted for before the lease ran out
            await self._end(voted, commit=msg.commit, eager=msg.eager, resumed=True, ctx=ctx)
        else:
            await trio.lowlevel.checkpoint()  # a repeated or stale resume: nothing to do
        # What it holds or will: pending weights, or those a load under way brings (the host
        # may have taken them at its boundary while the target resumed).
        pending = self._pending_version if self._pending_version is not None else self._loading
        return Resumed(self.target.version, pending)

    def _commit(
        self, weights: dict[str, torch.Tensor], assembling: Assembling | None, version: int
    ) -> None:
        """Make ``version`` the pending weights, merged with any still pending (a newer
        tensor replaces an older one, whole or still to be put together)."""
        names = set(weights)
        if assembling is not None:
            names |= assembling.assembly.names
            for part in assembling.assembly.parts:
                self._known.setdefault(part.spec.name, part.spec)
        merged = {k: v for k, v in (self._pending or {}).items() if k not in names}
        merged.update(weights)
        for job in self._assembling:
            job.assembly.discard(names)
        self._assembling = [j for j in self._assembling if j.assembly.names]
        if assembling is not None:
            self._assembling.append(assembling)
        self._pending, self._pending_version = merged, version
        for name, tensor in weights.items():
            self._known.setdefault(name, spec_of(name, tensor))
        self._committed += 1

    def _drop(self, sync: _Sync, *, count: bool) -> None:
        for scope in sync.scopes:
            scope.cancel()
        if sync.group is not None:
            sync.group.close()
            sync.group = None
        sync.cache = sync.verified = sync.assembling = None
        if count:
            self._aborted += 1

    async def _end(
        self,
        sync: _Sync,
        *,
        commit: bool,
        eager: bool,
        resumed: bool = False,
        ctx: ActorContext[Any] | None = None,
    ) -> None:
        """Commit (or drop) the staged weights, then resume the target whatever happens.

        ``resumed``: the target runs already (a voted sync whose lease ran out): an eager load
        pauses it for the load only. ``ctx``: where the split tensors' copies start at once
        (else ``apply_pending`` runs them)."""
        if self._sync is sync:
            self._sync = None
        weights, assembling = sync.verified, sync.assembling
        self._drop(sync, count=not commit)
        try:
            if commit:
                if weights is None:
                    raise StaleSync(f"{self._who()}: sync {sync.sync_id} was never verified")
                self._commit(weights, assembling, sync.version)
                if assembling is not None and ctx is not None:
                    ctx.start_soon(assembling.start)  # in a worker thread, the host running
                if eager or self.load == "eager":
                    if not self.pause or resumed:  # an eager load of a running target
                        await self.target.pause(sync.mode)  # pauses for the load only
                    await self._apply()
        finally:
            with trio.CancelScope(shield=True):
                await self.target.resume()  # idempotent: also after a pause that failed


class SyncTargetActor(Actor[SyncMessage]):
    """An actor hosting one ``SyncTarget`` and its ``WeightReceiver``: a ready-made receiver.

    Subclass it and implement ``make_target``. Its ``load`` (class attribute) is ``"eager"``:
    a target that calls ``apply_pending()`` at its batch boundaries may set ``"lazy"``. An actor
    with messages of its own embeds a ``WeightReceiver`` instead (``docs/weight_sync.md``).
    """

    load: LoadMode = "eager"
    offload: bool = True

    async def make_target(self, ctx: ActorContext[SyncMessage]) -> SyncTarget:
        raise NotImplementedError(f"{type(self).__name__} must implement make_target()")

    async def on_start(self, ctx: ActorContext[SyncMessage]) -> None:
        target = await self.make_target(ctx)
        self.receiver = WeightReceiver(target, load=self.load, offload=self.offload, name=ctx.name)

    async def receive(self, msg: SyncMessage, ctx: ActorContext[SyncMessage]) -> Any:
        return await self.receiver.handle(msg, ctx)
