"""``CheckpointEngine``: the sender of weight syncs, and the sync protocol it runs.

One ``await engine.sync(version, weights)`` is one conversation with every target (rollout
engines and forward workers, each hosting a ``WeightReceiver``), each phase under its deadline::

    pause     every target acknowledges that nothing runs on the old weights
    prepare   every receiver gets the manifest and sets up its host cache
    topology  the transport builds its channel (a process group, a directory, nothing)
    broadcast the buckets, double-buffered
    finalize  every receiver verifies what it got                 <- the commit point
    resume    shielded, under its own deadline, ALWAYS: commit or drop, then resume

Weights that fit in one bucket of at most ``config.fused_bytes`` (the actor transport) take two
round trips instead of five: one ``SyncFused`` request carries the pause, the manifest, the bucket
and its checksum, and each receiver answers once it paused, staged and verified them (its vote);
then the resume commits or drops, as above. It is the same two-phase commit: the commit point is
still every receiver's verified answer.

Before the commit point nothing any target holds changes: a failed or cancelled sync drops the
staged copies and every target resumes on its old, complete weights. After it, every receiver
switches (at once, or lazily at its next batch boundary) and resumes. The next sync starts from
scratch, so it succeeds whatever the last one left behind.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import trio

from ..actors import ActorCrashed, ActorRef
from ._buckets import PROCESS_TOKEN, BucketSource, resolve_checksum
from ._config import PHASES, CheckpointConfig
from ._errors import ChecksumMismatch, IncompleteSync, ManifestError, StaleSync, SyncFailed
from ._manifest import Manifest, collect, plan_buckets, spec_of
from ._messages import (
    FusedAck,
    Resumed,
    SyncFinalize,
    SyncFused,
    SyncPause,
    SyncPrepare,
    SyncResume,
)
from ._target import PauseAck
from ._transport import ActorTransport, ReceiverFailed, SyncSession, Transport, ask_all

if TYPE_CHECKING:
    import torch

log = logging.getLogger("asyncflow_actors.checkpoint")

T = TypeVar("T")

# A sync cancelled from outside (its sender is stopping) resumes its targets for at most this
# long: those that answer resume now, a silent one on its own when its lease runs out. The whole
# resume deadline would hold the sender's stop past any grace (the resume is shielded).
CANCELLED_RESUME_S = 1.0


@attrs.frozen
class SyncResult:
    """What one sync did and how long each phase took (seconds, wall clock).

    ``payload_bytes``: tensor bytes sent to each receiver; ``bytes_moved``: bucket bytes
    (padding included) times receivers. ``acks``: each target's pause acknowledgement,
    ``resumed``: what each holds afterwards, both in target order. ``fused``: the sync ran as
    one ``SyncFused`` round and the resume; its round (packing included) is timed as
    ``broadcast_s``, ``prepare_s`` is the planning, and pause, topology and finalize are 0.
    """

    version: int
    sync_id: str
    transport: str
    receivers: int
    tensors: int
    buckets: int
    payload_bytes: int
    bytes_moved: int
    pause_s: float
    prepare_s: float
    topology_s: float
    broadcast_s: float
    finalize_s: float
    resume_s: float
    total_s: float
    acks: tuple[PauseAck, ...]
    resumed: tuple[Resumed, ...]
    fused: bool = False

    @property
    def bandwidth(self) -> float:
        """Payload bytes per second of the whole sync (pause to resume)."""
        return self.payload_bytes / self.total_s if self.total_s > 0 else 0.0

    def metrics(self) -> dict[str, float]:
        """``sync_pause`` ... ``sync_resume``, ``sync_total`` (s), ``sync_bytes``, ``sync_version``."""
        out = {f"sync_{phase}": float(getattr(self, f"{phase}_s")) for phase in PHASES}
        out["sync_total"] = self.total_s
        out["sync_bytes"] = float(self.bytes_moved)
        out["sync_version"] = float(self.version)
        return out


@attrs.frozen
class CheckpointEngineStatistics:
    """Counters of a ``CheckpointEngine``: ``syncs`` committed, ``failed`` syncs that raised
    (``SyncFailed`` or a cancellation), whether one is ``syncing`` now. The sync under way:
    its ``version``, ``phase``, seconds in it (``phase_s``) and the receivers that have not
    answered the phase's request yet (``waiting_for``; empty while the transport moves data)."""

    syncs: int
    failed: int
    syncing: bool
    last_version: int | None
    bytes_moved: int
    targets: int
    version: int | None = None
    phase: str | None = None
    phase_s: float = 0.0
    waiting_for: tuple[str, ...] = ()


@attrs.define
class _Progress:
    """Where the sync under way is: for ``statistics()`` (a diagnosis of a stalled sync)."""

    version: int
    phase: str = "prepare"
    since: float = attrs.Factory(trio.current_time)  # the loop's clock (virtual in tests)
    waiting: set[str] = attrs.Factory(set)

    def enter(self, phase: str) -> None:
        self.phase, self.since = phase, trio.current_time()
        self.waiting.clear()


def make_transport(config: CheckpointConfig) -> Transport:
    """The transport ``config.transport`` names."""
    if config.transport == "actor":
        return ActorTransport()
    if config.transport == "file":
        from ._file import FileTransport

        assert config.directory is not None
        return FileTransport(config.directory, keep_versions=config.keep_versions)
    from ._collective import CollectiveTransport

    return CollectiveTransport(config.transport)


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups, or ``[exc]``."""
    inner = getattr(exc, "exceptions", None)
    if not isinstance(inner, tuple):
        return [exc]
    return [leaf for e in inner for leaf in _leaves(e)]


def _cancelled(exc: BaseException) -> bool:
    return any(isinstance(leaf, trio.Cancelled) for leaf in _leaves(exc))


def _fused_phase(cause: BaseException) -> str:
    """The phase a failure of the fused round belongs to, from its cause: no answer in time is
    a pause not acknowledged; a refused manifest or version is prepare's; a bucket that did not
    verify is finalize's (a bucket of the wrong size is refused as a ``ManifestError``:
    prepare's); anything else (a receiver crashed, its node died) is broadcast's."""
    if isinstance(cause, trio.TooSlowError):
        return "pause"
    if isinstance(cause, (ChecksumMismatch, IncompleteSync)):
        return "finalize"
    if isinstance(cause, (ManifestError, StaleSync)):
        return "prepare"
    return "broadcast"


def _behind(
    targets: Sequence[ActorRef[Any]], resumed: Sequence[Resumed | None], version: int
) -> list[tuple[str, str]]:
    """The receivers whose answer to a committing ``SyncResume`` holds neither ``version`` nor
    a newer one, loaded or pending (a receiver that did not answer is not judged here)."""
    out = []
    for ref, answer in zip(targets, resumed, strict=True):
        if answer is None:
            continue
        newest = max(answer.version, answer.pending if answer.pending is not None else -1)
        if newest < version:
            out.append((ref.name, f"version {answer.version} (pending {answer.pending})"))
    return out


def _root_cause(exc: BaseException) -> tuple[BaseException, str | None]:
    """The first error inside trio's exception groups, and the receiver it came from."""
    first = _leaves(exc)[0]
    if isinstance(first, ReceiverFailed) and first.__cause__ is not None:
        return first.__cause__, first.receiver
    return first, None


class CheckpointEngine:
    """Sends weights to ``targets`` (refs to actors hosting a ``WeightReceiver``).

    ``transport`` defaults to the one ``config.transport`` names. One sync runs at a time
    (a second call waits). See the module docstring for the protocol and failure semantics.
    """

    def __init__(
        self,
        targets: Sequence[ActorRef[Any]] = (),
        config: CheckpointConfig | None = None,
        *,
        transport: Transport | None = None,
    ) -> None:
        self.config = config if config is not None else CheckpointConfig()
        self.transport = transport if transport is not None else make_transport(self.config)
        self._targets = tuple(targets)
        self._lock = trio.Lock()
        self._syncs = self._failed = self._bytes = 0
        self._last_version: int | None = None
        self._layout: tuple[Any, Manifest] | None = None  # the last plan and what it was of
        self._progress: _Progress | None = None

    @property
    def targets(self) -> tuple[ActorRef[Any], ...]:
        return self._targets

    def set_targets(self, targets: Sequence[ActorRef[Any]]) -> None:
        """Replace the targets (a sync in progress keeps its own)."""
        self._targets = tuple(targets)

    def statistics(self) -> CheckpointEngineStatistics:
        at = self._progress
        return CheckpointEngineStatistics(
            syncs=self._syncs,
            failed=self._failed,
            syncing=self._lock.locked(),
            last_version=self._last_version,
            bytes_moved=self._bytes,
            targets=len(self._targets),
            version=at.version if at is not None else None,
            phase=at.phase if at is not None else None,
            phase_s=trio.current_time() - at.since if at is not None else 0.0,
            waiting_for=tuple(sorted(at.waiting)) if at is not None else (),
        )

    def _waiting(self) -> set[str] | None:
        return self._progress.waiting if self._progress is not None else None

    async def sync(
        self,
        version: int,
        weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    ) -> SyncResult:
        """Pause every target, send ``weights`` tagged ``version``, commit, resume them all.

        ``weights``: a state dict or ``(name, tensor)`` pairs (filtered by the config: e.g.
        LoRA only); the tensors must not change until this returns. Raises ``ManifestError``
        for weights that cannot be sent (before anything is paused) and ``SyncFailed`` (its
        ``__cause__`` says why) for a sync that failed. If cancelled before the commit point it
        raises ``Cancelled`` with every target back on its old weights; after it, the sync
        completes (shielded) and returns.
        """
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ManifestError(f"version must be an int >= 0, got {version!r}")
        async with self._lock:
            self._progress = _Progress(version)
            try:
                return await self._sync(version, weights)
            finally:
                self._progress = None

    async def _phase(
        self,
        name: str,
        timings: dict[str, float],
        fn: Callable[..., Awaitable[T]],
        *args: Any,
    ) -> T:
        started = time.perf_counter()
        if self._progress is not None:
            self._progress.enter(name)
        try:
            with trio.fail_after(getattr(self.config.deadlines, name)):
                return await fn(*args)
        finally:
            timings[name] = timings.get(name, 0.0) + time.perf_counter() - started

    def _plan(
        self,
        version: int,
        weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    ) -> SyncSession:
        """Check and plan the weights (raises ``ManifestError``: nothing is paused yet)."""
        config = self.config
        keep = config.tensor_filter()
        named = [(name, tensor) for name, tensor in collect(weights) if keep(name)]
        if not named:
            raise ManifestError(f"no tensor to sync: none matched {keep}")
        # The same names, dtypes and shapes in the same order (every step of a run): the same
        # plan. Anything else (and another bucket size or transport) plans again.
        key = (
            config.bucket_bytes,
            self.transport.split,
            [(name, tensor.dtype, tensor.shape) for name, tensor in named],
        )
        if self._layout is not None and self._layout[0] == key:
            manifest = self._layout[1]
        else:
            specs = [spec_of(name, tensor) for name, tensor in named]
            manifest = plan_buckets(specs, config.bucket_bytes, split=self.transport.split)
            self._layout = (key, manifest)
        self.transport.check(manifest)
        algorithm = resolve_checksum(config.checksum)
        source = BucketSource([t for _, t in named], manifest, algorithm=algorithm)
        sync_id = f"{version}-{secrets.token_hex(4)}"
        return SyncSession(sync_id, version, manifest, self._targets, config, source)

    async def _converse(
        self, session: SyncSession, timings: dict[str, float], progress: list[str]
    ) -> list[PauseAck]:
        """Pause, prepare, topology, broadcast, finalize; ``progress[0]`` names the phase."""
        sync_id, targets, config = session.sync_id, session.receivers, self.config
        algorithm = session.source.algorithm
        pause = SyncPause(sync_id, config.pause_mode, config.lease)
        acks: list[PauseAck] = await self._phase(
            "pause", timings, ask_all, targets, lambda _: pause, self._waiting()
        )
        progress[0] = "prepare"
        prepare = SyncPrepare(sync_id, session.version, session.manifest, PROCESS_TOKEN, algorithm)
        await self._phase("prepare", timings, ask_all, targets, lambda _: prepare, self._waiting())
        progress[0] = "topology"
        await self._phase("topology", timings, self.transport.open, session)
        progress[0] = "broadcast"
        await self._phase("broadcast", timings, self.transport.broadcast, session)
        progress[0] = "finalize"
        finalize = SyncFinalize(sync_id, tuple(session.checksums) if algorithm else ())
        await self._phase(
            "finalize", timings, ask_all, targets, lambda _: finalize, self._waiting()
        )
        return acks

    def _fusable(self, session: SyncSession) -> bool:
        manifest = session.manifest
        return (
            isinstance(self.transport, ActorTransport)
            and len(manifest.buckets) <= 1
            and manifest.bucket_total <= self.config.fused_bytes
        )

    def _fused_deadline(self) -> float:
        """The fused round's deadline: the four phases it folds together, each its own."""
        d = self.config.deadlines
        return d.pause + d.prepare + d.broadcast + d.finalize

    async def _converse_fused(
        self, session: SyncSession, timings: dict[str, float], progress: list[str]
    ) -> list[PauseAck]:
        """One ``SyncFused`` round: every receiver paused, staged and verified (its vote)."""
        assert isinstance(self.transport, ActorTransport)
        sync_id, targets, config = session.sync_id, session.receivers, self.config
        buffers = self.transport.buffers
        started = time.perf_counter()
        progress[0] = "broadcast"
        if self._progress is not None:
            self._progress.enter("broadcast")
        completed = False
        try:
            with trio.fail_after(self._fused_deadline()):
                data = await session.bucket(0, buffers, 0) if session.manifest.buckets else None
                fused = SyncFused(
                    sync_id,
                    config.pause_mode,
                    config.lease,
                    session.version,
                    session.manifest,
                    PROCESS_TOKEN,
                    session.source.algorithm,
                    data,
                    tuple(session.checksums) if session.source.algorithm else (),
                )
                answers: list[FusedAck] = await ask_all(targets, lambda _: fused, self._waiting())
            completed = True
        except BaseException as exc:
            if not _cancelled(exc) and isinstance(exc, Exception):
                progress[0] = _fused_phase(_root_cause(exc)[0])
            raise
        finally:
            timings["broadcast"] = time.perf_counter() - started
            if not completed:
                buffers.discard()  # a receiver may still read the buffer
        return [answer.ack for answer in answers]

    async def _sync(
        self,
        version: int,
        weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    ) -> SyncResult:
        started = time.perf_counter()
        session = self._plan(version, weights)
        timings = {"prepare": time.perf_counter() - started}
        progress = ["pause"]
        acks: list[PauseAck] = []
        failure: BaseException | None = None
        fused = self._fusable(session)
        try:
            if fused:
                acks = await self._converse_fused(session, timings, progress)
            else:
                acks = await self._converse(session, timings, progress)
        except BaseException as exc:
            failure = exc
        committed = failure is None
        # A receiver that crashed during the sync lost it with its incarnation (a restarted one
        # was never paused): do not wait for it to come back just to resume nothing.
        gone = None
        if failure is not None:
            cause, receiver = _root_cause(failure)
            gone = receiver if isinstance(cause, ActorCrashed) else None
        limit = self.config.deadlines.resume
        if failure is not None and _cancelled(failure):
            limit = min(limit, CANCELLED_RESUME_S)
        resumed, errors = await self._end(session, committed, timings, skip=gone, limit=limit)
        total = time.perf_counter() - started
        timings = {p: timings.get(p, 0.0) for p in PHASES}
        unresumed = ""
        if errors:
            name, error = errors[0]
            unresumed = (
                f"{len(errors)} target(s) did not confirm the resume (first: {name!r}: "
                f"{type(error).__name__}: {error})"
            )
        if failure is not None:
            self._failed += 1
            if _cancelled(failure) or not isinstance(failure, Exception):
                raise failure
            phase = progress[0]
            cause, receiver = _root_cause(failure)
            if isinstance(cause, trio.TooSlowError):
                limit = self._fused_deadline() if fused else getattr(self.config.deadlines, phase)
                detail = f"deadline of {limit} s passed"
                if fused:
                    detail += " (the fused round: pause, prepare, broadcast and finalize)"
            else:
                detail = f"{type(cause).__name__}: {cause}"
            where = f" at receiver {receiver!r}" if receiver else ""
            log.warning("sync %s failed in %s%s: %s", session.sync_id, phase, where, detail)
            raise SyncFailed(
                f"weight sync of version {version} failed in {phase}{where}: {detail}; every "
                f"target kept its weights{'; ' + unresumed if unresumed else ' and was resumed'}",
                phase=phase,
                version=version,
                receiver=receiver,
                timings=timings,
            ) from cause
        behind = _behind(session.receivers, resumed, version)
        if behind:
            # Told to commit, a receiver reports older weights (it dropped the verified ones):
            # the sync did not reach it, whatever the others hold. Say so, so the caller syncs
            # again instead of counting it as delivered.
            self._failed += 1
            name, held = behind[0]
            raise SyncFailed(
                f"weight sync of version {version}: receiver {name!r} reports {held} after the "
                f"commit ({len(behind)} receiver(s) behind); sync again",
                phase="resume",
                version=version,
                receiver=name,
                timings=timings,
            )
        manifest = session.manifest
        self._syncs += 1
        self._last_version = version
        self._bytes += manifest.bucket_total * len(session.receivers)
        if errors:
            self._failed += 1
            raise SyncFailed(
                f"weight sync of version {version} committed, but {unresumed}",
                phase="resume",
                version=version,
                receiver=errors[0][0],
                committed=True,
                timings=timings,
            ) from errors[0][1]
        result = SyncResult(
            version=version,
            sync_id=session.sync_id,
            transport=self.transport.kind,
            receivers=len(session.receivers),
            tensors=len(manifest.tensors),
            buckets=len(manifest.buckets),
            payload_bytes=manifest.payload_bytes,
            bytes_moved=manifest.bucket_total * len(session.receivers),
            pause_s=timings["pause"],
            prepare_s=timings["prepare"],
            topology_s=timings["topology"],
            broadcast_s=timings["broadcast"],
            finalize_s=timings["finalize"],
            resume_s=timings["resume"],
            total_s=total,
            acks=tuple(acks),
            resumed=tuple(r for r in resumed if r is not None),
            fused=fused,
        )
        log.info("sync %s: %s", session.sync_id, result.metrics())
        return result

    async def _end(
        self,
        session: SyncSession,
        committed: bool,
        timings: dict[str, float],
        skip: str | None,
        *,
        limit: float,
    ) -> tuple[list[Resumed | None], list[tuple[str, BaseException]]]:
        """Close the transport and resume every target (but ``skip``): shielded, for at most
        ``limit`` seconds (the resume deadline; ``CANCELLED_RESUME_S`` for a cancelled sync)."""
        started = time.perf_counter()
        targets = session.receivers
        if self._progress is not None:
            self._progress.enter("resume")
            self._progress.waiting.update(t.name for t in targets if t.name != skip)
        resumed: list[Resumed | None] = [None] * len(targets)
        errors: list[tuple[str, BaseException]] = []
        end = SyncResume(session.sync_id, committed, self.config.eager)

        async def close() -> None:
            try:
                await self.transport.close(session, failed=not committed)
            except Exception:
                log.exception(
                    "sync %s: closing the %s transport failed", session.sync_id, self.transport.kind
                )

        async def resume(i: int) -> None:
            try:
                resumed[i] = await targets[i].ask(end)
            except Exception as exc:
                errors.append((targets[i].name, exc))
            if self._progress is not None:
                self._progress.waiting.discard(targets[i].name)

        with trio.CancelScope(shield=True), trio.move_on_after(limit):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(close)
                for i in range(len(targets)):
                    if targets[i].name != skip:
                        nursery.start_soon(resume, i)
        for i, ref in enumerate(targets):
            if ref.name == skip:
                continue
            if resumed[i] is None and all(name != ref.name for name, _ in errors):
                errors.append((ref.name, trio.TooSlowError("no answer within the resume deadline")))
        timings["resume"] = time.perf_counter() - started
        return resumed, errors
