"""The worker skeleton every station shares: fetch → compute → write back → ack.

A ``Station`` is an actor whose helper task loops:

1. **fetch**: a TQ ``get`` of ``count`` samples ready for the station's columns, fresh, not yet
   consumed by its consumer (the wait is a ``tq.get`` span and ``afa_role_wait_seconds_total``);
2. **dispatch**: ``DataParallel`` says how the batch is split across data-parallel ranks;
3. **compute**: in a worker thread (``trio.to_thread.run_sync``), never on the event loop that
   also serves the TQ client, the weight sync and the observer;
4. **write back**: ``put_columns`` of what it computed (rows of its own partition);
5. **ack**.

Crashes: a station is a supervised actor. Its TQ holder name is stable across restarts, and
every incarnation starts by returning the leases its holder still has (``client.aclose()``: a
``ReleaseHolder``), so the samples of a crashed predecessor — even one whose process was killed —
go back to the queue at once: nothing is lost, and nothing acked is handed out again.

**Data-parallel ranks and the availability probe.** The ``size`` ranks of a group claim with the
same ``share_key`` (the group's step number) and ``share_count=size``: the TQ creates one lease
for all of them, atomically, only once ``count`` samples qualify, and a ``Balanced`` sampler
splits it into one length-balanced partition per rank. That claim is the global availability
probe: until enough data is ready every rank waits in it, and none enters a collective alone.
Each rank writes back its partition and acks the shared lease; the lease completes at the last
ack. Ranks of a group must restart together (their step numbers must agree).
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

import attrs
import trio

from ..actors import Actor, ActorContext, ActorCrashed, ActorRef
from ..observe import Gauge, Track, clock_ns, get_registry, get_tracer
from ..transfer_queue import (
    FIFO,
    Balanced,
    Batch,
    Lease,
    Sampler,
    StorageUnavailable,
    TransferQueueClient,
    TransferQueueError,
    UnknownSample,
    WholeGroups,
)
from ._ask_again import ask_again, storage_unavailable
from ._messages import GetRoleStats, RoleStatistics
from ._schema import ROLLOUT
from ._settings import RunSpec
from ._threads import intra_op_threads

log = logging.getLogger("asyncflow_actors.roles")

COMPUTE = "asyncflow_actors.roles._compute"


_running: set[threading.Event] = set()  # compute threads of this process not yet finished


async def in_thread(fn: Any, *args: Any) -> Any:
    """Run blocking ``fn(*args)`` in a worker thread; a cancellation abandons it safely (the
    thread finishes on its own and nothing reads its result). ``wait_for_threads`` waits for
    abandoned ones, so a process never exits under a running torch kernel. A call cancelled
    before its thread started is withdrawn: ``fn`` never runs and nothing waits for it."""
    done = threading.Event()
    lock = threading.Lock()
    started = withdrawn = False

    def call() -> Any:
        nonlocal started
        with lock:
            if withdrawn:
                return None
            started = True
        try:
            return fn(*args)
        finally:
            done.set()

    _running.add(done)
    try:
        return await trio.to_thread.run_sync(call, abandon_on_cancel=True)
    finally:
        with lock:
            withdrawn = not started
        if done.is_set() or withdrawn:
            _running.discard(done)


async def wait_for_threads(seconds: float) -> None:
    """Wait up to ``seconds`` for every compute thread of this process to finish."""
    with trio.move_on_after(seconds):
        for done in list(_running):
            await trio.to_thread.run_sync(done.wait, abandon_on_cancel=True)
            _running.discard(done)


async def load_compute(threads: int) -> Any:
    """Import the torch side in a worker thread (an import can take seconds) and set the
    process's intra-op threads."""
    module = await in_thread(importlib.import_module, COMPUTE)
    await in_thread(module.setup_torch, threads)
    return module


@attrs.frozen
class DataParallel:
    """Rank ``rank`` of a data-parallel group of ``size``: ``"split"`` gives each rank a
    length-balanced partition of the shared lease, ``"replicate"`` the whole batch to each."""

    rank: int = 0
    size: int = 1
    dispatch: Literal["split", "replicate"] = "split"

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside a group of size {self.size}")

    def sampler(self, whole_groups: bool) -> Sampler:
        if self.size > 1 and self.dispatch == "split":
            return Balanced(self.size, whole_groups=whole_groups, wait_expiring=whole_groups)
        return WholeGroups(wait_expiring=True) if whole_groups else FIFO

    def rows(self, batch: Batch) -> list[int]:
        """Positions in ``batch`` of this rank's samples."""
        if self.size == 1 or self.dispatch == "replicate":
            return list(range(len(batch)))
        mine = set(batch.lease.partitions[self.rank])
        return [k for k, index in enumerate(batch.indexes) if index in mine]


def sub_lease(lease: Lease, rows: Sequence[int]) -> Lease:
    """The part of ``lease`` at ``rows``, for writing back one rank's partition."""
    indexes = tuple(lease.indexes[k] for k in rows)
    wanted = set(indexes)
    placement = {
        unit: tuple(i for i in held if i in wanted) for unit, held in lease.placement.items()
    }
    return attrs.evolve(
        lease,
        indexes=indexes,
        versions=tuple(lease.versions[k] for k in rows),
        group_ids=tuple(lease.group_ids[k] for k in rows),
        placement={unit: held for unit, held in placement.items() if held},
    )


class Meter:
    """A worker's span track, metric handles (the observe catalog) and plain counters."""

    def __init__(self, role: str, worker: str) -> None:
        registry = get_registry()
        self.role, self.worker = role, worker
        self.track: Track = get_tracer().track(role, worker)
        self._samples = registry.counter("afa_role_samples_total", role=role, worker=worker)
        self._tokens = registry.counter("afa_role_tokens_total", role=role, worker=worker)
        self._steps = registry.counter("afa_role_steps_total", role=role, worker=worker)
        self._busy = registry.counter("afa_role_busy_seconds_total", role=role, worker=worker)
        # created by the first set_version: a role without a policy (advantage, reward)
        # reports no version rather than a 0 that reads like a stuck worker
        self._version: Gauge | None = None
        self._waits = {
            op: registry.counter("afa_role_wait_seconds_total", role=role, worker=worker, op=op)
            for op in ("get", "put", "acquire")
        }
        self.samples = self.tokens = self.steps = 0
        self.busy_s = self.wait_s = 0.0
        self.version: int | None = None
        self.extra: dict[str, float] = {}

    def waited(self, op: str, start: int, **span: Any) -> None:
        """Account a wait that began at ``start`` (``clock_ns``): span ``tq.<op>`` + metrics."""
        end = clock_ns()
        seconds = (end - start) / 1e9
        self.wait_s += seconds
        self._waits[op].inc(seconds)
        name = "flow.acquire" if op == "acquire" else f"tq.{op}"
        self.track.tracer.record(
            name, role=self.role, worker=self.worker, start_ns=start, end_ns=end, **span
        )

    def busy(self, start: int) -> None:
        seconds = (clock_ns() - start) / 1e9
        self.busy_s += seconds
        self._busy.inc(seconds)

    def done(self, samples: int, tokens: int, steps: int = 1) -> None:
        self.samples += samples
        self.tokens += tokens
        self.steps += steps
        self._samples.inc(samples)
        self._tokens.inc(tokens)
        self._steps.inc(steps)

    def set_version(self, version: int) -> None:
        """The policy version this worker holds (none until the first call)."""
        if self._version is None:
            labels = {"role": self.role, "worker": self.worker}
            self._version = get_registry().gauge("afa_policy_version", **labels)
        self.version = version
        self._version.set(version)

    def statistics(self) -> RoleStatistics:
        return RoleStatistics(
            self.role,
            self.worker,
            self.version,
            self.samples,
            self.tokens,
            self.steps,
            self.busy_s,
            self.wait_s,
            dict(self.extra),
        )


class Station(Actor[Any]):
    """Base of the stations (see the module docstring). Subclasses set ``role`` and
    ``consumer``, implement ``setup`` and ``step``, and declare their messages in ``Actor[M]``."""

    role: ClassVar[str] = "station"
    consumer: ClassVar[str] = "station"

    def __init__(
        self,
        spec: RunSpec,
        controller: ActorRef[Any],
        worker: str,
        rank: int = 0,
        ranks: int = 1,
    ) -> None:
        self.spec = spec
        self.controller = controller
        self.worker = worker
        self.dp = DataParallel(rank, ranks)
        self.meter = Meter(self.role, worker)
        self.compute: Any = None
        self.client: TransferQueueClient | None = None
        self._step_no = 0
        self._claiming: tuple[str, int, float] | None = None  # topic, count, since (a fetch)

    async def on_start(self, ctx: ActorContext[Any]) -> None:
        self.compute = await load_compute(intra_op_threads(self.spec))
        self.client = await TransferQueueClient.connect(self.controller, holder=self.worker)
        await self.client.aclose()  # leases a crashed incarnation of this worker still holds
        await self.setup(ctx)
        ctx.start_soon(self.run)

    async def setup(self, ctx: ActorContext[Any]) -> None:
        """Build what the station computes with (in a thread)."""

    async def run(self) -> None:
        raise NotImplementedError

    async def fetch(
        self,
        columns: Sequence[str],
        count: int,
        *,
        whole_groups: bool,
        min_count: int | None = None,
        topic: str = ROLLOUT,
        fetch: Sequence[str] | None = None,
    ) -> Batch:
        """Step 1 (and the availability probe of a data-parallel group). ``fetch``: only
        these of ``columns`` are fetched (a trainer's ranks fetch the rest)."""
        assert self.client is not None
        start = clock_ns()
        shared = self.dp.size > 1
        self._claiming = (topic, count, trio.current_time())
        client = self.client
        try:
            # a storage unit that restarted empty fails the fetch (its lease is returned: nothing
            # was taken) until the controller knows: get again, as the Driver puts again
            batch = await ask_again(
                lambda: client.get(
                    topic,
                    self.consumer,
                    columns,
                    count,
                    sampler=self.dp.sampler(whole_groups),
                    min_count=min_count,
                    share_key=f"{self.consumer}:{self._step_no}" if shared else None,
                    share_count=self.dp.size,
                    fetch=fetch,
                ),
                f"{self.role} {self.worker}: get",
                transient=storage_unavailable,
            )
        finally:
            self._claiming = None
        assert batch is not None  # wait=True
        self._step_no += 1
        self.meter.waited("get", start, samples=batch.indexes)
        return batch

    async def write_back(self, batch: Batch, rows: Sequence[int], data: Mapping[str, Any]) -> bool:
        """Step 4: ``data`` rows follow ``rows`` (this rank's partition of ``batch``). False if
        samples left the lease meanwhile (evicted, discarded, lost: ``UnknownSample``), as an
        ack would report them missing: not a fault. A lease of this rank alone is then
        returned (its live samples go out again) and must not be acked; a rank-shared one is
        acked as usual (a nack would take it from the other ranks)."""
        assert self.client is not None
        start = clock_ns()
        lease = batch.lease if len(rows) == len(batch) else sub_lease(batch.lease, rows)
        try:
            await self.client.put_columns(lease, data)
        except (UnknownSample, StorageUnavailable) as exc:
            # StorageUnavailable: a unit of the lease restarted empty (or did not answer), so
            # its samples left the lease (the queue reports them lost): as a missing ack
            log.info("%s %s: samples left lease %d: %s", self.role, self.worker, lease.id, exc)
            if self.dp.size > 1:
                return True
            with trio.CancelScope(shield=True):
                try:
                    await self.client.nack(batch)
                except TransferQueueError:
                    pass  # it ended already (expired): its live samples are back anyway
            return False
        self.meter.waited("put", start, samples=lease.indexes)
        return True

    async def receive(self, msg: Any, ctx: ActorContext[Any]) -> Any:
        if isinstance(msg, GetRoleStats):
            await trio.lowlevel.checkpoint()
            return attrs.evolve(self.meter.statistics(), waits=tuple(self.waits()))
        return await self.handle(msg, ctx)

    def waits(self) -> list[str]:
        """What this worker waits on now, in words (``RoleStatistics.waits``): its claim in
        the queue, the weight sync that paused it, weights waiting to load."""
        out = []
        if self._claiming is not None:
            topic, count, since = self._claiming
            out.append(
                f"claiming {count} sample(s) of {topic!r} as consumer {self.consumer!r} "
                f"for {trio.current_time() - since:.1f} s"
            )
        receiver = getattr(self, "receiver", None)
        if receiver is not None:
            stats = receiver.statistics()
            if stats.paused:
                out.append(f"paused by weight sync {stats.sync_id} (its engines hold)")
            elif stats.sync_id is not None:
                out.append(f"in weight sync {stats.sync_id}")
            if stats.pending_version is not None:
                out.append(f"weights of version {stats.pending_version} wait to load")
        return out

    async def handle(self, msg: Any, ctx: ActorContext[Any]) -> Any:
        raise TypeError(f"{self.role} {self.worker!r} does not handle {type(msg).__name__}")

    async def on_stop(self, ctx: ActorContext[Any], error: BaseException | None) -> None:
        with trio.CancelScope(shield=True):
            await wait_for_threads(10)
        if self.client is not None:
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                try:
                    await self.client.aclose()
                except ActorCrashed:
                    pass  # the queue is gone (the run is ending): no lease outlives it


def column(batch: Batch, name: str) -> Any:
    """A fixed-shape column of ``batch`` as one tensor."""
    import torch

    value = batch[name]
    return torch.stack(value) if isinstance(value, list) else value


def columns(batch: Batch, name: str) -> Any:
    """Column ``name`` of the whole ``batch`` as the batch holds it (one tensor for a
    fixed-shape column, a list of rows for a variable one; a shared column expanded per
    sample): no per-row work."""
    return batch.expand(name) if name in batch.shared else batch[name]


def take(batch: Batch, rows: Sequence[int], name: str) -> list[Any]:
    """Column ``name`` of ``batch`` at ``rows`` as a list (shared columns expanded)."""
    values = columns(batch, name)
    return [values[k] for k in rows]
