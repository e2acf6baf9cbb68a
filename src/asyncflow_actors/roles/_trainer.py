"""Trainer: complete, fresh samples in; PPO updates; a new policy version per global batch.

Each step: take a global batch of whole groups that have every column (rollout, old and — with
a KL penalty — reference log-probs, advantages) and are inside the staleness window (with
``trainer_forward`` / ``trainer_advantage`` it computes the old log-probs / the advantages
itself and does not wait for them); check each
sample's staleness (trainer version - its oldest token's version: it must lie in
``[0, staleness]``, and at staleness 0 it is 0 for every sample, by construction); run
``mini_batches`` x ``epochs`` updates with the configured ``rl`` loss in a worker thread (a
streamed step, ``RunSpec.streams_updates``: the batch piece by piece as its groups complete,
each piece's forward and backward at once, the one optimizer step after the last); bump the
version and start syncing the weights at once (the CheckpointEngine, pause → … → resume: the
sync is on every step's critical path, so it waits for no round trip); ack (a streamed step's
leases together); report ``StepDone`` to the Driver. The Driver publishes the version to the
TQ, releases the FlowControl slots (the prompts it admits meanwhile carry the version they were
admitted for, and no rollout starts them on older weights), asks this actor for the sync's
outcome (``SyncWeights``: the report of the sync already under way; the run's last step and a
``colocated`` run sync only when asked) and answers once that returned. Meanwhile the next
step fetches, checks and runs its first forward and backward; its first optimizer step waits
for the answer: the next version is never trained before the sync of this one finished, and
the weights never change while a sync reads them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Generator
from typing import Any

import attrs
import trio

from ..actors import Actor, ActorContext, ActorRef
from ..checkpoint import CheckpointConfig, CheckpointEngine, PauseMode, SyncFailed
from ..observe import MetricInfo, clock_ns, get_registry
from ..transfer_queue import StorageUnavailable
from . import _schema as S
from ._advantage import Advantages
from ._ask_again import ask_again, driver_resuming
from ._completions import completions_due, pick_completions
from ._ledger import trained_samples
from ._messages import (
    AdoptVersion,
    GetRoleStats,
    ResendWeights,
    SaveCheckpoint,
    StepDone,
    StepTrained,
    SyncReport,
    SyncWeights,
    TrainedSamples,
)
from ._rank_settings import uses_ranks
from ._reward import reward_names, reward_part_metrics
from ._settings import RunSpec
from ._shared import shared_policy
from ._worker import Station, column, columns, in_thread

log = logging.getLogger("asyncflow_actors.roles")

SYNC_ATTEMPTS = 6  # about 30 s of retries: long enough for a node to restart

OFFPOLICY = MetricInfo(
    "afa_train_offpolicy_samples_total",
    "counter",
    "samples",
    "trained samples whose oldest token's version differs from the trainer's",
)


@attrs.define
class _Step:
    """A global batch taken for one step: when its compute started (``clock_ns``), its batches
    (one, or the pieces of a streamed step), the samples' lags and response lengths, and either
    the paused ``Learner.updates`` or the ``Learner.accumulate`` pieces."""

    started: int
    batches: list[Any]
    lags: list[int]
    lengths: list[int]
    updates: Generator[None, None, dict[str, float]] | None = None
    pieces: list[Any] = attrs.field(factory=list)
    trained: TrainedSamples = attrs.field(factory=TrainedSamples)  # for the sample ledger


def _cat(parts: list[Any]) -> Any:
    import torch

    return parts[0] if len(parts) == 1 else torch.cat(parts)


def learner_of(compute: Any, ranked: bool) -> Any:
    """The learner class: ``compute.Learner``, or a rank group's (``_ranked``: imports torch)."""
    if not ranked:
        return compute.Learner
    from ._ranked import RankedLearner

    return RankedLearner


class StalenessViolation(RuntimeError):
    """A trained sample lay outside the staleness window: a bug, never expected."""


class _Answer:
    """The Driver's answer to one ``StepDone``, asked in the background; ``wait`` returns once
    it came (and never if it says stop: the run ends without another update)."""

    def __init__(self, driver: ActorRef[Any], done: StepDone, again: bool) -> None:
        self.driver = driver
        self.done = done
        self.again = again
        self.answered = trio.Event()
        self.stop = False

    async def run(self) -> None:
        # answered once the sync of its version returned
        ack = await ask_driver(self.driver, self.done, self.again)
        self.stop = bool(ack.stop)
        self.answered.set()

    async def wait(self) -> None:
        await self.answered.wait()
        if self.stop:
            await trio.sleep_forever()


async def ask_driver(driver: ActorRef[Any], request: Any, again: bool) -> Any:
    """Ask the Driver; ``again`` (``train.auto_resume``): again while a Driver that raised is
    resumed (``_driver_rebuild``: it handles a step asked again once)."""
    if not again:
        return await driver.ask(request)
    what = f"asking the driver {type(request).__name__}"
    return await ask_again(lambda: driver.ask(request), what, transient=driver_resuming)


class _EarlySync:
    """A sync the trainer started itself, right after its optimizer step, for the Driver's
    ``SyncWeights`` of the same version to pick up (its report, or its error)."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.finished = trio.Event()
        self.report: SyncReport | None = None
        self.error: Exception | None = None

    async def run(self, sync: Callable[[int], Awaitable[SyncReport]]) -> None:
        try:
            self.report = await sync(self.version)
        except Exception as exc:  # the Driver's SyncWeights raises it
            self.error = exc
        finally:
            self.finished.set()

    async def result(self) -> SyncReport:
        await self.finished.wait()
        if self.error is not None:
            raise self.error
        assert self.report is not None
        return self.report


class Trainer(Station, Actor[GetRoleStats | SyncWeights | ResendWeights | SaveCheckpoint]):
    """The trainer (see the module docstring). ``targets``: refs of the rollout and
    ActorForward workers that receive its weights."""

    role = "trainer"
    consumer = "trainer"

    def __init__(
        self,
        spec: RunSpec,
        controller: ActorRef[Any],
        worker: str,
        driver: ActorRef[Any],
        targets: tuple[ActorRef[Any], ...] = (),
    ) -> None:
        super().__init__(spec, controller, worker)
        self.driver = driver
        self.targets = tuple(targets)
        self.version = spec.start_version
        registry = get_registry()
        registry.declare(OFFPOLICY)
        self._offpolicy = registry.counter(OFFPOLICY.name)
        self._staleness = registry.histogram("afa_train_staleness_versions")
        self._reward = registry.gauge("afa_reward_mean", role=self.role)
        self._model_lock = trio.Lock()
        self._early: _EarlySync | None = None
        self._answer_wait: int | None = None  # the version whose answer a step waits for

    async def setup(self, ctx: ActorContext[Any]) -> None:
        spec = self.spec
        task = await in_thread(spec.task.build)
        shared = await shared_policy(spec, self.compute, task) if spec.colocated else None
        ranked = uses_ranks(spec)
        self.learner = await in_thread(
            lambda: learner_of(self.compute, ranked)(
                spec, task, resume=spec.resume_from, shared=shared
            )
        )
        # pause_mode "none": the receivers acknowledge without pausing (the mode is unused)
        mode = PauseMode(spec.rollout.pause_mode) if spec.rollout.pauses else PauseMode.KEEP
        self.sync_engine: CheckpointEngine
        if ranked:  # weights gathered from the ranks as they are sent (LoRA: merged)
            from ._rank_sync import ShardedSyncEngine

            # rollout.vllm_lora: the adapters alone (vLLM serves them; forward stations merge)
            adapters = spec.rollout.vllm_lora
            self.sync_engine = ShardedSyncEngine(
                self.learner.dist, self.targets,
                CheckpointConfig(pause_mode=mode, lora_only=adapters),
                merged=spec.model.lora.enabled and not adapters,
            )  # fmt: skip
        else:
            self.sync_engine = CheckpointEngine(self.targets, CheckpointConfig(pause_mode=mode))
        self.columns = S.station_columns(spec)["trainer"]
        self.advantages = Advantages(spec, self.compute) if spec.trainer_advantage else None
        self.meter.set_version(self.version)

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            await self._train(nursery)

    async def on_stop(self, ctx: ActorContext[Any], error: BaseException | None) -> None:
        await super().on_stop(ctx, error)
        close = getattr(getattr(self, "learner", None), "close", None)
        if close is not None:  # a rank group: stop the other ranks, leave the process group
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(close)

    async def _train(self, nursery: trio.Nursery) -> None:
        """The step loop. A step's sync (started at once) and its ``StepDone`` (the Driver
        publishes, collects the sync, answers) run in the background while the next step
        fetches its batch, checks it and runs its first forward and backward; that step's first
        optimizer step waits for the answer. So the
        weights the sync reads never change under it, and no version is trained before the
        sync of the one before it finished (colocated: no overlap, the model is shared)."""
        assert self.client is not None
        spec = self.spec
        previous: _Answer | None = None
        while True:
            step = await (self._pieces() if spec.streams_updates else self._whole())
            batches = step.batches
            histogram = self._count_staleness(step.lags)
            if previous is not None:
                self._answer_wait = previous.done.version
                await previous.wait()  # the sync of the last version finished
                self._answer_wait = None
            start = clock_ns()
            try:
                async with self._model_lock:  # no sync or checkpoint reads them meanwhile
                    metrics = await in_thread(self._finish, step)
            except StorageUnavailable as exc:  # a rank could not fetch its rows: none trained
                log.warning("%s: step %d: %s; its samples go out again", self.worker,
                            self.version + 1, exc)  # fmt: skip
                for batch in batches:
                    await self.client.nack(batch)
                continue
            self.meter.busy(start)
            indexes = tuple(i for b in batches for i in b.indexes)
            self.meter.track.tracer.record(
                "train", role=self.role, worker=self.worker, start_ns=step.started,
                end_ns=clock_ns(), samples=indexes, version=self.version,
            )  # fmt: skip
            self.version += 1
            self.meter.set_version(self.version)
            last = self.version >= spec.train.steps
            if not (spec.colocated or last):
                # The sync is on every step's critical path: it starts now, not after the acks
                # and a round trip to the Driver; the Driver's SyncWeights takes its report.
                self._early = _EarlySync(self.version)
                nursery.start_soon(self._early.run, self._sync)
            groups = tuple(sorted({g for b in batches for g in b.group_ids}))
            if spec.train.auto_resume:
                # told before the acks: if this trainer dies, the Driver knows the step and
                # whether its samples may still be in the queue (``_driver_resume``)
                trained = StepTrained(self.version, groups, indexes)
                await ask_driver(self.driver, trained, again=True)
            shown = (
                await self._completions(batches)
                if completions_due(spec.report, self.version)
                else ()
            )
            await self._ack(batches)
            samples = len(indexes)
            tokens = sum(step.lengths)
            self._reward.set(metrics["reward_mean"])
            self.meter.done(samples, tokens)
            done = StepDone(self.version, samples, tokens, groups, histogram, metrics,
                            step.trained, shown)  # fmt: skip
            if spec.colocated or last:
                # the Driver syncs the weights first
                ack = await ask_driver(self.driver, done, spec.train.auto_resume)
                if ack.stop or last:
                    await trio.sleep_forever()
                continue
            # The Driver publishes the version while this trainer publishes it too: the next
            # fetch must see the new version's window (a sample older would be a violation).
            previous = _Answer(self.driver, done, spec.train.auto_resume)
            nursery.start_soon(previous.run)
            await self.client.set_version(S.ROLLOUT, self.version)

    async def _completions(self, batches: list[Any]) -> tuple[Any, ...]:
        """A few of the step's samples as text (``_completions.py``), decoded in a thread;
        none (and a warning) if that fails: showing samples never stops training."""
        tokenizer = self.learner.tokenizer
        names = reward_names(self.spec)
        try:
            shown: tuple[Any, ...] = await in_thread(
                pick_completions, self.spec.report, tokenizer, batches, self.version, names
            )
        except Exception as exc:
            log.warning("%s: sample completions of step %d: %r", self.worker, self.version, exc)
            return ()
        return shown

    async def _ack(self, batches: list[Any]) -> None:
        """Ack a step's leases (the pieces of a streamed step) all at once: one round trip."""
        assert self.client is not None
        async with trio.open_nursery() as nursery:
            for batch in batches:
                nursery.start_soon(self.client.ack, batch)

    async def _take(self, count: int, least: int) -> tuple[Any, dict[str, Any]]:
        """Whole groups, and their columns as the batch holds them (no per-row Python); when
        each rank fetches its own rows, only the small columns, and the lease for the ranks
        (``_rank_fetch``)."""
        fetched = None
        if getattr(self.learner, "rank_fetch", False):
            from ._rank_fetch import leased_data, rank_columns  # a rank group: torch is loaded

            text = completions_due(self.spec.report, self.version + 1)
            fetched = await rank_columns(self.client, self.learner, self.columns, text=text)
        batch = await self.fetch(
            self.columns, count, whole_groups=True, min_count=least, fetch=fetched
        )
        data = {name: columns(batch, name) for name in fetched or self.columns}
        if fetched is not None:
            await leased_data(self.client, batch, data, self.columns, self.learner)
        return batch, data

    async def _whole(self) -> _Step:
        """A global batch in one fetch, its updates run up to their first optimizer step (one
        compute thread: the staleness check, the advantages, the first forward and backward;
        it reads the weights only, as a sync does, and the event loop stays free for it)."""
        size = self.spec.batch_size
        batch, data = await self._take(size, size)
        start = clock_ns()
        updates, lags, lengths = await in_thread(self._prepare, batch, data)
        self.meter.busy(start)
        return _Step(start, [batch], lags, lengths, updates=updates)

    async def _pieces(self) -> _Step:
        """A global batch piece by piece (``RunSpec.streams_updates``): every whole group
        ready, up to the batch; each piece's forward and backward run as it arrives, so when
        the last group comes only its own share is left before the optimizer step."""
        spec = self.spec
        left = spec.batch_size
        step = _Step(0, [], [], [])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._renew, step.batches)
            while left > 0:
                batch, data = await self._take(left, min(left, spec.rollout.group_size))
                start = clock_ns()
                step.started = step.started or start
                first = not step.batches
                piece, lags, lengths = await in_thread(self._accumulate, batch, data, first)
                self.meter.busy(start)
                self.meter.track.tracer.record(
                    "train.piece", role=self.role, worker=self.worker, start_ns=start,
                    end_ns=clock_ns(), samples=batch.indexes, version=self.version,
                )  # fmt: skip
                step.batches.append(batch)
                step.pieces.append(piece)
                step.lags += lags
                step.lengths += lengths
                left -= len(batch)
            nursery.cancel_scope.cancel()
        return step

    @functools.cached_property
    def _renew_every(self) -> float:
        return S.topic_specs(self.spec)[1].lease_ttl / 3

    async def _renew(self, batches: list[Any]) -> None:
        """Renew the leases of a streamed step's pieces every third of the topic's
        ``lease_ttl`` while the step waits for the rest: a long tail may outlast the TTL, and
        a piece whose lease ran out would go out again while its gradient is already in."""
        assert self.client is not None
        while True:
            await trio.sleep(self._renew_every)
            for batch in list(batches):
                await self.client.renew(batch)

    def _checked(self, batch: Any, data: dict[str, Any]) -> tuple[list[int], list[int]]:
        """Each sample's lag (``StalenessViolation`` before any update if one lies outside the
        window) and response length; the advantages (``trainer_advantage``) into ``data``."""
        lengths = [int(r.shape[0]) for r in data.get(S.RESPONSE_IDS, data[S.TOKEN_VERSIONS])]
        lags = self._lags(data[S.TOKEN_VERSIONS], batch.versions)
        if self.advantages is not None:
            rows = range(len(batch))
            data[S.ADVANTAGES] = self.advantages.estimate(batch, rows, lengths, padded=True)
        return lags, lengths

    def _accumulate(
        self, batch: Any, data: dict[str, Any], first: bool
    ) -> tuple[Any, list[int], list[int]]:
        """One piece, in a compute thread: checked, then its forward and backward."""
        lags, lengths = self._checked(batch, data)
        return self.learner.accumulate(data, first=first), lags, lengths

    def _prepare(
        self, batch: Any, data: dict[str, Any]
    ) -> tuple[Generator[None, None, dict[str, float]], list[int], list[int]]:
        """A whole batch up to its first optimizer step, in a compute thread: checked, then
        ``Learner.updates`` up to its yield. Returns the paused updates, the lags and the
        response lengths."""
        lags, lengths = self._checked(batch, data)
        updates = self.learner.updates(data)
        next(updates)
        return updates, lags, lengths

    def _finish(self, step: _Step) -> dict[str, float]:
        """The optimizer step(s) and the batch's figures (its samples for the ledger in
        ``step.trained``), in a compute thread."""
        if step.updates is not None:
            metrics: dict[str, float] = self.compute.finish(step.updates)
        else:
            metrics = self.learner.apply(step.pieces)
        rewards = _cat([column(b, S.REWARDS) for b in step.batches])
        resumes = _cat([column(b, S.RESUMES) for b in step.batches])
        metrics["reward_mean"] = float(rewards.mean())
        metrics["accuracy"] = float((rewards == 1.0).float().mean())
        metrics["response_length"] = sum(step.lengths) / len(rewards)
        metrics["partial_rollout_ratio"] = int((resumes > 0).sum()) / len(rewards)
        names = reward_names(self.spec)
        if names:  # ``reward/<name>``: each reward function's mean
            parts = _cat([column(b, S.REWARD_PARTS) for b in step.batches])
            metrics.update(reward_part_metrics(names, parts))
        oldest = [self.version - lag for lag in step.lags]
        step.trained = trained_samples(step.batches, oldest)
        return metrics

    def _lags(self, token_versions: list[Any], versions: tuple[int, ...]) -> list[int]:
        """Per sample: trainer version - oldest token version, within [0, staleness]."""
        limit = self.spec.staleness
        lags = [
            self.version - oldest
            for oldest in self.compute.oldest_versions(token_versions, versions)
        ]
        for lag in lags:
            if not 0 <= lag <= limit:
                raise StalenessViolation(
                    f"a sample of version {self.version - lag} reached the trainer at version "
                    f"{self.version}; the window is {limit}"
                )
        return lags

    def _count_staleness(self, lags: list[int]) -> tuple[int, ...]:
        """The samples per lag; the staleness histogram and off-policy counter."""
        counts = [0] * (self.spec.staleness + 1)
        for lag in lags:
            counts[lag] += 1
        self._staleness.observe_many(lags)
        self._offpolicy.inc(sum(counts[1:]))
        return tuple(counts)

    def waits(self) -> list[str]:
        out = super().waits()
        if self._answer_wait is not None:
            out.append(f"waiting for the Driver's answer to step {self._answer_wait} (its sync)")
        engine = getattr(self, "sync_engine", None)
        stats = engine.statistics() if engine is not None else None
        if stats is not None and stats.phase is not None:
            # "actor_fwd-0.<run>/actor_fwd-0.<run>" (an actor on a node): the worker's name
            names = [name.rpartition("/")[2].partition(".")[0] for name in stats.waiting_for]
            who = ", ".join(repr(name) for name in names) or "the transport"
            out.append(
                f"weight sync of version {stats.version} in phase {stats.phase} for "
                f"{stats.phase_s:.1f} s, waiting for {who}"
            )
        return out

    async def handle(self, msg: Any, ctx: ActorContext[Any]) -> Any:
        if isinstance(msg, (SyncWeights, ResendWeights)):
            # Answered off the mailbox: while a sync runs, this trainer still answers
            # ``GetRoleStats`` (a stalled sync's phase and receivers, for the watchdog). A sync
            # that fails crashes the trainer as before (``ctx.fail``: its error as raised).
            early: _EarlySync | None = None
            if isinstance(msg, SyncWeights):  # taken now: the next step's may follow
                early, self._early = self._early, None
                if early is not None and early.version != msg.version:
                    early = None
            ctx.start_soon(self._answer_sync, msg, early, ctx.defer_reply(), ctx)
            return None
        if isinstance(msg, SaveCheckpoint):
            async with self._model_lock:
                if msg.version is not None and msg.version != self.version:
                    return ""  # moved on: its StepDone is on its way to the Driver
                meta = {"version": self.version}
                await in_thread(self.learner.save, msg.directory, meta)
            return msg.directory
        return await super().handle(msg, ctx)

    async def _answer_sync(
        self,
        msg: SyncWeights | ResendWeights,
        early: _EarlySync | None,
        reply: Any,
        ctx: ActorContext[Any],
    ) -> None:
        """Answer ``msg`` with its sync's report (``early``: the one under way already)."""
        try:
            if early is not None:
                report = await early.result()
            else:
                report = await self._sync(msg.version if isinstance(msg, SyncWeights) else None)
        except Exception as exc:
            ctx.fail(exc)
            return
        reply.send(report)

    async def _sync_with_retries(self, version: int, weights: Any) -> tuple[Any, int]:
        """Sync, and sync again after a failure: a receiver whose node died is restarted by its
        supervisor (asks to it wait meanwhile), and the next sync starts from scratch. A sync
        that committed but missed a resume confirmation counts as done (``None``)."""
        registry = get_registry()
        delay = 0.5
        for attempt in range(SYNC_ATTEMPTS):
            try:
                return await self.sync_engine.sync(version, weights), attempt
            except SyncFailed as exc:
                registry.counter("afa_sync_failures_total").inc()
                if exc.committed:
                    log.warning(
                        "sync of version %d committed, resume unconfirmed: %s", version, exc
                    )
                    return None, attempt
                if attempt == SYNC_ATTEMPTS - 1:
                    raise
                log.warning(
                    "sync of version %d failed (%s); retrying in %.1f s", version, exc, delay
                )
                await trio.sleep(delay)
                delay = min(delay * 2, 10.0)
        raise AssertionError("unreachable")

    async def _sync(self, asked: int | None) -> SyncReport:
        """Send the weights tagged ``asked``, or (``None``: a resend) the version they are: read
        under the model lock, so that a step's sync that ran first is never undercut by an
        older tag (a receiver refuses an older version)."""
        registry = get_registry()
        started = clock_ns()
        version = self.version if asked is None else asked
        if self.spec.colocated:
            # The targets hold this very model: only the version moves.
            for target in self.targets:
                await target.ask(AdoptVersion(version))
            total = (clock_ns() - started) / 1e9
            return SyncReport(version, {"sync_total": total, "sync_bytes": 0.0})
        async with self._model_lock:
            if asked is None:
                version = self.version
            weights = self.learner.state_dict()  # views: no copy
            result, retries = await self._sync_with_retries(version, weights)
        if result is None:  # committed, but a target did not confirm its resume in time
            return SyncReport(version, {"sync_retries": float(retries)})
        metrics = result.metrics()
        metrics["sync_retries"] = float(retries)
        track = self.meter.track
        at = started
        for phase in ("pause", "prepare", "topology", "broadcast", "finalize", "resume"):
            seconds = metrics[f"sync_{phase}"]
            end = at + int(seconds * 1e9)
            track.tracer.record(
                f"sync.{phase}", role=self.role, worker=self.worker, start_ns=at, end_ns=end,
                version=version,
            )  # fmt: skip
            at = end
            if phase != "topology":
                registry.histogram("afa_sync_duration_seconds", phase=phase).observe(seconds)
                registry.gauge("afa_sync_last_seconds", phase=phase).set(seconds)
        registry.histogram("afa_sync_duration_seconds", phase="total").observe(result.total_s)
        registry.gauge("afa_sync_last_seconds", phase="total").set(result.total_s)
        registry.gauge("afa_sync_last_version").set(version)
        registry.gauge("afa_sync_last_bytes").set(result.bytes_moved)
        registry.counter("afa_sync_bytes_total").inc(result.bytes_moved)
        registry.counter("afa_sync_total").inc()
        return SyncReport(version, metrics)
