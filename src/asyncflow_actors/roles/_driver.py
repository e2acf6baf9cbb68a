"""Driver: admission of prompts, the version, the weight sync trigger, re-injection.

- **Admission.** Before it injects a prompt the Driver acquires ``group_size`` FlowControl slots;
  the capacity is ``(staleness + 1) x batch``, so rollout never runs more than ``staleness``
  versions ahead of training. Injecting a prompt opens its group in the ``rollout`` topic (the
  prompt ids stored once, shared) and puts a ``prompts`` sample naming that group; the prompts
  whose slots are free at once open their groups in one ``open_groups`` and go out in one put
  (the rollout takes them in one lease).
- **Versions and syncs.** On the Trainer's ``StepDone`` it publishes the new version to the TQ
  (samples that fall out of the window are evicted), releases the batch's slots at once, asks
  the Trainer for the weight sync (which the Trainer started right after its optimizer step)
  and answers once the sync returned. The prompts admitted meanwhile (the sync and the
  admission overlap) carry the version they were admitted for (``min_version``): a rollout
  worker starts no group on weights older than that, so at staleness 0 every trained sample is
  still on-policy by construction.
- **Re-injection.** Groups the TQ reports evicted (stale), lost (a storage unit died) or
  abandoned (a rollout worker died between allocating and committing them), groups a rollout
  worker found gone when it came to write them (``GroupGone``: e.g. a group shrunk or
  discarded to nothing, which no event names) and prompts lost before generation are injected
  again, once each, keeping their slots. A lost group stays in flight until the Trainer's
  reports show it did not train it (``_driver_replaced``: a unit can die under the Trainer's
  fetched batch).
- **Checkpoints.** Every ``checkpoint_every`` steps it asks the Trainer to save under
  ``run_dir/checkpoints/step-N`` (the newest ``keep_last`` kept), and writes the prompt cursor
  and the prompts still in flight (re-injected first on resume). At the last step it saves
  ``run_dir/final`` instead: a run with a ``run_dir`` always ends with its model saved.
- **Sample ledger.** It writes ``run_dir/samples.jsonl`` (``_ledger``): what each step trained,
  each attempt injected again or dropped, the prompts in flight at the end.
- **Resume.** With ``train.auto_resume`` a Driver that raises is started again in its cell and
  takes over the state it held (``_driver_rebuild``); a step asked again is handled once.
- **Stops.** On ``StopRun`` it saves ``run_dir/final`` at the last step unless the newest
  checkpoint holds it already; if the Trainer has moved on to the next version meanwhile, it
  saves at that step instead (whose ``StepDone`` is on its way) and ends the run there.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio

from ..actors import Actor, ActorContext, ActorCrashed, ActorRef
from ..actors.remote import NodeLost
from ..observe import clock_ns
from ..transfer_queue import FlowControl, TransferQueueClient
from . import _schema as S
from ._ask_again import ask_again, storage_unavailable
from ._driver_rebuild import adopt, start_resumed
from ._driver_replaced import (
    LostGroups,
    Replacements,
    replaced_trained,
    withdraw_newer,
    withheld,
)
from ._driver_resume import TrainerLost, UnsavedSteps, roll_back
from ._driver_state import DriverState as DriverState
from ._driver_tasks import DriverTasks
from ._ledger import SampleLedger
from ._messages import (
    GetRoleStats,
    GroupDropped,
    GroupGone,
    NeedWeights,
    ResendWeights,
    SaveCheckpoint,
    StepAck,
    StepDone,
    StepTrained,
    Stopped,
    StopRun,
    SyncReport,
    SyncWeights,
)
from ._reward import record_json
from ._settings import CHECKPOINTS, FINAL, RunSpec
from ._threads import intra_op_threads
from ._worker import Meter, in_thread, load_compute

log = logging.getLogger("asyncflow_actors.roles")

PROMPT_CHUNK = 256
RESEND_TIMEOUT_S = 300.0  # a sync with its retries (``Trainer.SYNC_ATTEMPTS``)


@attrs.define
class DriverHooks:
    """How the pipeline and the Driver (same process) talk: the trainer's ref once it exists,
    a callback per step, the end of the run (``done``; ``stopped``: by a ``StopRun``) and
    checkpoints written."""

    on_step: Callable[[StepDone, SyncReport, float], Awaitable[None]] | None = None
    trainer: ActorRef[Any] | None = None
    done: trio.Event = attrs.Factory(trio.Event)
    stopped: Stopped | None = None
    checkpoints: list[str] = attrs.Factory(list)
    reinjected: int = 0
    rollouts: list[ActorRef[Any]] = attrs.Factory(list)  # for evaluations
    flow: FlowControl | None = None  # the Driver's slots, read by the watchdog (same process)
    waiting: str | None = None  # what the Driver's step handling waits on now, in words
    end_version: int = 0  # the run's last version (later by the steps an auto-resume lost)
    driver_resumes_left: int = 0  # a Driver that raises is resumed (``_driver_rebuild``)


_Msg = (
    StepDone
    | GetRoleStats
    | NeedWeights
    | GroupGone
    | GroupDropped
    | StopRun
    | StepTrained
    | TrainerLost
)


class Driver(Actor[_Msg]):
    """The Driver of one run (see the module docstring); it lives in the driver process."""

    def __init__(
        self,
        spec: RunSpec,
        controller: ActorRef[Any],
        hooks: DriverHooks,
        resume: DriverState | None = None,
        previous: Driver | None = None,
    ) -> None:
        self.spec = spec
        self.controller = controller
        self.hooks = hooks
        self.meter = Meter("driver", "driver-0")
        self.flow = FlowControl(spec.staleness, spec.batch_size)
        hooks.flow = self.flow
        self.version = resume.version if resume else spec.start_version
        self.cursor = resume.cursor if resume else 0
        self.backlog = list(resume.pending) if resume else []
        self.inflight: dict[int, int] = {}  # rollout group id -> prompt index
        # Prompts taken (from the cursor, the backlog or a gone group) whose groups are being
        # opened: in neither ``inflight`` nor ``backlog`` until ``open_groups`` returns, but a
        # checkpoint must name them (the cursor has passed them).
        self.admitting: set[int] = set()
        self.prompt_samples: dict[int, int] = {}  # prompts-topic index -> rollout group id
        self.replaced = Replacements()  # groups whose prompts were injected again
        self.lost = LostGroups()  # groups reported lost, perhaps in the Trainer's hands
        self._chunk: tuple[int, list[Any]] = (-1, [])
        self._step_started = 0.0
        self.stopping = False
        # (version, directory) of the newest checkpoint: the one resumed from, else none yet
        self.saved = (spec.start_version, spec.resume_from or "")
        # auto-resume: the steps trained since that checkpoint (``_driver_resume``)
        self.unsaved = UnsavedSteps()
        self.end_version = spec.train.steps
        hooks.end_version = self.end_version
        # a StepDone's slots released and its record reported up to this version (a StepDone
        # asked again after a Driver's resume does neither twice)
        self.released = self.reported = self.version
        self.events_since = 0  # the queue's events handled (a resumed Driver goes on from it)
        self.resumed = previous is not None
        if previous is not None:  # the state of the incarnation that raised (``_driver_rebuild``)
            adopt(self, previous)

    async def on_start(self, ctx: ActorContext[Any]) -> None:
        if self.resumed:
            await start_resumed(self, ctx)
            return
        self.compute = await load_compute(intra_op_threads(self.spec))
        self.task = await in_thread(self.spec.task.build)
        self.tokenizer = await in_thread(self.compute.policy_tokenizer, self.spec, self.task)
        # a dataset's prompts rendered and checked, the evaluation set (``_driver_tasks``)
        self.tasks = await in_thread(DriverTasks.open, self.spec, self.task, self.tokenizer)
        ctx.start_soon(self.tasks.serve, self.hooks)
        self.ledger = await SampleLedger.open(
            self.spec.run_dir, self.spec.resume_from, self.version
        )
        ctx.start_soon(self.ledger.serve)
        self.client = await TransferQueueClient.connect(self.controller, holder="driver")
        await self.client.set_version(S.ROLLOUT, self.version)
        self.meter.set_version(self.version)
        self._step_started = trio.current_time()
        ctx.start_soon(self._inject)
        ctx.start_soon(self._watch_events)

    def problem(self, index: int) -> Any:
        """The run's ``index``-th prompt (deterministic in the task seed)."""
        prepared = self.tasks.problem(index)
        if prepared is not None:
            return prepared
        chunk = index // PROMPT_CHUNK
        if self._chunk[0] != chunk:
            seed = self.spec.task.seed * 1_000_003 + chunk
            self._chunk = (chunk, self.task.sample(PROMPT_CHUNK, seed))
        return self._chunk[1][index % PROMPT_CHUNK]

    async def _inject(self) -> None:
        """Admit prompts as slots free up: every prompt whose slots are free at once goes out in
        one ``prompts`` put, so the rollout takes them in one lease."""
        n = self.spec.rollout.group_size
        while True:
            start = clock_ns()
            await self.flow.acquire(n)
            self.meter.waited("acquire", start)
            indexes = [self._next_index()]
            while True:
                try:
                    self.flow.acquire_nowait(n)
                except trio.WouldBlock:
                    break
                indexes.append(self._next_index())
            await self._put_prompts(indexes)

    def _next_index(self) -> int:
        if self.backlog:
            return self.backlog.pop(0)
        index, self.cursor = self.cursor, self.cursor + 1
        return index

    async def _put_prompt(self, index: int, group: int | None = None) -> None:
        """Open a rollout group for prompt ``index`` (unless ``group`` is open already) and put
        the prompt that names it."""
        await self._put_prompts([index], [group])

    async def _put_prompts(
        self, indexes: list[int], groups: list[int | None] | None = None
    ) -> None:
        """Open a rollout group for each prompt (unless its group is open already) and put the
        prompts that name them, in one put."""
        # The version these prompts are admitted for, read before any await: the slots that
        # admitted them were released once the Driver held it (``_step_done``).
        version = self.version
        # Before any await too: the caller took these indexes (no await since), so a checkpoint
        # from now on names them until ``inflight`` does.
        # Left there if this raises: a resumed Driver puts them again (``_driver_rebuild``).
        self.admitting.update(indexes)
        await self._open_and_put(indexes, version, groups)
        self.admitting.difference_update(indexes)

    async def _open_and_put(
        self, indexes: list[int], version: int, groups: list[int | None] | None
    ) -> None:
        import torch

        problems = [self.problem(index) for index in indexes]
        # tokenized once here: the group stores the ids, the rollout generates from them
        encode = self.tokenizer.encode
        ids = [torch.tensor(encode(p.prompt, add_bos=True), dtype=torch.int64) for p in problems]
        given: list[int | None] = list(groups) if groups is not None else [None] * len(indexes)
        # the groups still to open, in one request (all or none: a failure opens none)
        fresh = [k for k, group in enumerate(given) if group is None]
        if fresh:
            attempts = [self.ledger.next_attempt(indexes[k]) for k in fresh]
            shared = [
                {
                    S.PROMPT_IDS: ids[k],
                    S.PROMPT_KEY: torch.tensor([indexes[k], attempt, version]),
                }
                for k, attempt in zip(fresh, attempts, strict=True)
            ]
            size = self.spec.rollout.group_size
            slots = await ask_again(  # a storage unit's death stored nothing: again
                lambda: self.client.open_groups(S.ROLLOUT, [size] * len(fresh), shared),
                "opening prompt groups",
                transient=storage_unavailable,
            )
            for k, slot, attempt in zip(fresh, slots, attempts, strict=True):
                given[k] = slot.group_id
                self.ledger.admitted(indexes[k], attempt, version)
        opened: list[int] = []
        for k, group in enumerate(given):
            assert group is not None
            self.inflight[group] = indexes[k]
            opened.append(group)
        data = {
            S.PROMPT_TEXT: [p.prompt for p in problems],
            S.PROMPT_IDS: ids,
            S.ANSWER: [p.answer for p in problems],
            S.GROUP: torch.tensor(opened),
            S.PROMPT_INDEX: torch.tensor(indexes),
            S.MIN_VERSION: torch.full((len(indexes),), version, dtype=torch.int64),
            S.RECORD: [record_json(p) for p in problems],
        }
        samples = await ask_again(
            lambda: self.client.put(S.PROMPTS, data, version=0),
            "putting prompts",
            transient=storage_unavailable,
        )
        for sample, group in zip(samples, opened, strict=True):
            self.prompt_samples[sample] = group

    async def _watch_events(self) -> None:
        while True:
            batch = await self.client.events(self.events_since)
            for event in batch.events:
                if event.topic == S.ROLLOUT and event.kind in ("evicted", "lost", "abandoned"):
                    # abandoned: a rollout worker died between allocating its groups' rows and
                    # committing them (its restarted successor's release drops them). It
                    # writes a group's rows in one put, so the group went whole: the restarted
                    # worker finds it gone and drops its prompt, which lives again only here.
                    if event.kind == "lost":  # the Trainer may be training it: see its reports
                        self.lost.defer(event.group_ids, self.version)
                        continue
                    reason = "evicted" if event.kind == "evicted" else "lost"
                    for gid in event.group_ids:
                        await self._reinject(gid, reason)
                elif event.topic == S.PROMPTS and event.kind in ("evicted", "lost"):
                    for sample in event.indexes:
                        gid = self.prompt_samples.pop(sample, -1)
                        if gid in self.inflight:
                            self.hooks.reinjected += 1
                            await self._put_prompt(self.inflight[gid], gid)
            # after the batch: a resumed Driver handles again what this one may not have
            # (each event's handling is idempotent)
            self.events_since = batch.cursor

    async def _reinject(self, gid: int, reason: str = "lost") -> bool:
        """Inject the prompt of rollout group ``gid`` again in a new group, keeping its slots,
        unless the group was trained or injected again already (``False``); the ledger records
        why its attempt ended (``reason``)."""
        index = self.inflight.pop(gid, None)
        if index is None:
            return False
        self.ledger.not_trained(index, reason, reinjected=True)
        self.replaced.replaced(gid, index, self.version)  # it may be trained all the same
        self.hooks.reinjected += 1
        await self._put_prompt(index)
        return True

    async def _gone(self, msg: GroupGone) -> None:
        # (taken out of ``inflight`` and into ``admitting`` before the task's first await: a
        # Driver that raises meanwhile leaves it to its resumed successor)
        if await self._reinject(msg.group_id, "lost"):
            log.info("group %d is gone (%s): its prompt injected again", msg.group_id,
                     msg.worker)  # fmt: skip

    async def receive(self, msg: _Msg, ctx: ActorContext[Any]) -> Any:
        if isinstance(msg, StopRun):
            return await self._stop()
        if isinstance(msg, StepTrained):
            await trio.lowlevel.checkpoint()
            if msg.version not in self.unsaved.steps and msg.version > self.released:
                self.unsaved.trained(msg, self.inflight)  # (not again: asked again)
            return None
        if isinstance(msg, TrainerLost):
            # whole or not at all: a raise elsewhere in this Driver must not cut it short (its
            # resumed successor could not tell what was rolled back; ``_driver_rebuild``)
            with trio.CancelScope(shield=True):
                point = await roll_back(self, msg.floor)
            return point
        if isinstance(msg, GroupDropped):
            await trio.lowlevel.checkpoint()
            try:
                self.tasks.on_dropped(msg)  # raises RewardFailed (fails the run) when fatal
            except Exception:
                ctx.cell.request_terminate(None)  # for good: a resume would meet it again
                raise
            index = self.inflight.pop(msg.group_id, None)
            if index is not None:
                self.ledger.not_trained(index, "dropped", reinjected=False)
                self.flow.release(self.spec.rollout.group_size)  # another prompt instead
            return None
        if isinstance(msg, GroupGone):  # answered at once (the rollout asks it)
            ctx.start_soon(self._gone, msg)
            return None
        if isinstance(msg, NeedWeights):
            ctx.start_soon(self._resend, msg.worker)
            return None
        if isinstance(msg, GetRoleStats):
            await trio.lowlevel.checkpoint()
            self.meter.extra = {"in_flight_slots": float(self.flow.statistics().in_flight)}
            return self.meter.statistics()
        return await self._step_done(msg)

    async def _step_done(self, msg: StepDone) -> StepAck:
        trainer = self.hooks.trainer
        assert trainer is not None, "the pipeline sets hooks.trainer before training starts"
        # a step asked again (the Trainer's, to a resumed Driver) is recorded and releases its
        # slots once: both happen with no await between them, before the sync
        again = msg.version <= self.released
        if not again:
            self.ledger.trained(msg)
        for gid in msg.groups:
            self.inflight.pop(gid, None)
        # a group reported lost and trained all the same: its prompt's newer attempt goes
        replaced = [] if again else replaced_trained(self, msg)
        self.prompt_samples = {s: g for s, g in self.prompt_samples.items() if g in self.inflight}
        self.version = msg.version
        self.meter.set_version(msg.version)
        async with trio.open_nursery() as nursery:
            # The window moves while the weights go out (neither waits for the other: the sync
            # is on every step's critical path).
            nursery.start_soon(self.client.set_version, S.ROLLOUT, msg.version)
            # Admission overlaps the sync: the prompts these slots admit (``_inject`` runs while
            # the sync is under way) carry ``min_version`` = this version, and the rollout
            # starts their groups only once its weights reach it. Releasing after the sync
            # instead put the injection (a TQ put and a group per prompt) on every step's
            # critical path.
            if not again:
                self.released = msg.version
                self.flow.release(msg.samples - withheld(self, replaced))
                self.unsaved.released(msg.version)
                nursery.start_soon(withdraw_newer, self, replaced, msg.version)
            # the lost groups this step did not train either: injected again
            for gid in self.lost.decided(msg.version, self.inflight):
                nursery.start_soon(self._reinject, gid, "lost")
            self.hooks.waiting = f"the trainer's answer to the weight sync of version {msg.version}"
            report = await self._sync_weights(trainer, msg.version)
            self.hooks.waiting = None
        if report is None:  # the Trainer died: the step is lost, the run resumes
            return StepAck(False)
        now = trio.current_time()
        seconds, self._step_started = now - self._step_started, now
        self.meter.done(msg.samples, msg.tokens)
        spec = self.spec
        steps_done = msg.version - spec.start_version
        every = spec.train.checkpoint_every
        stop = msg.version >= self.end_version or self.stopping
        if spec.run_dir and stop:
            if self.saved[0] < self.version:  # (a stop may have saved this step already)
                await self.save_checkpoint(trainer, final=True)
        elif every and spec.run_dir and steps_done % every == 0:
            await self.save_checkpoint(trainer)
        if self.tasks.eval_due(steps_done):
            if stop:  # the last record carries it
                await self.tasks.evaluate(self.hooks)
            else:
                self.tasks.request_eval(steps_done)
        msg = self.tasks.with_metrics(msg)
        if self.hooks.on_step is not None and msg.version > self.reported:
            self.reported = msg.version
            await self.hooks.on_step(msg, report, seconds)
        if stop:
            if self.stopping and self.hooks.stopped is None:
                self.hooks.stopped = Stopped(*self.saved)
            self.hooks.done.set()
        return StepAck(stop)

    async def _sync_weights(self, trainer: ActorRef[Any], version: int) -> SyncReport | None:
        """The Trainer's report of the sync of ``version``; ``None`` if it died meanwhile and
        ``train.auto_resume`` restarts it (else its death fails the run, as the error), or if
        the run is stopping (its stop ends the Trainer: a Ctrl-C between a step and its sync
        printed a warning besides the one line naming the resume command)."""
        try:
            report: SyncReport = await trainer.ask(SyncWeights(version))
        except (ActorCrashed, NodeLost) as exc:
            if self.stopping:
                log.debug("the sync of version %d ended with the run's stop: %r", version, exc)
                return None
            if not self.spec.train.auto_resume:
                raise
            log.warning("the sync of version %d ended with its Trainer: %r", version, exc)
            return None
        return report

    async def _stop(self) -> Stopped:
        """Save the last step unless the newest checkpoint holds it (``Stopped``), or, if the
        Trainer has moved on, mark the run to end at the step it is reporting."""
        self.stopping = True
        trainer = self.hooks.trainer
        if trainer is None or not self.spec.run_dir or self.saved[0] >= self.version:
            self.hooks.stopped = Stopped(*self.saved)
            return self.hooks.stopped
        if await self.save_checkpoint(trainer, final=True, expect=self.version) is None:
            return Stopped(self.version, "", pending=True)
        self.hooks.stopped = Stopped(*self.saved)
        return self.hooks.stopped

    async def _resend(self, worker: str) -> None:
        """Have the Trainer send the weights it holds to a restarted worker (and the others)."""
        trainer = self.hooks.trainer
        if trainer is None:
            return  # not started: its first sync reaches every worker
        log.info("resending the weights: %s was restarted", worker)
        try:
            with trio.fail_after(RESEND_TIMEOUT_S):
                await trainer.ask(ResendWeights())
        except Exception as exc:  # the worker asks again when its next incarnation starts
            log.warning("resending the weights for %s failed: %r", worker, exc)

    async def save_checkpoint(
        self, trainer: ActorRef[Any], *, final: bool = False, expect: int | None = None
    ) -> str | None:
        """Trainer state + Driver state under ``run_dir/checkpoints/step-<version>`` (the
        oldest beyond ``keep_last`` removed), or ``run_dir/final`` (``final``: written beside
        and swapped in, so a crash mid-write never leaves a half model there). With
        ``expect``: only if the Trainer still holds that version (``None`` if not)."""
        run_dir = self.spec.run_dir
        assert run_dir is not None
        version = self.version
        if final:
            directory = os.path.join(run_dir, FINAL)
            target = directory + ".partial"
            await in_thread(shutil.rmtree, target, True)
        else:
            directory = os.path.join(run_dir, CHECKPOINTS, f"step-{version:06d}")
            target = directory
        try:
            if not await trainer.ask(SaveCheckpoint(target, expect)):
                return None
        except (ActorCrashed, NodeLost) as exc:
            if self.stopping:  # the run's stop ends the Trainer: the stop names what it saved
                log.debug("no checkpoint at version %d: the run's stop ended the Trainer", version)
                return None
            if not self.spec.train.auto_resume:
                raise
            log.warning("no checkpoint at version %d: the Trainer died (%r)", version, exc)
            return None
        pending = tuple(sorted(self.pending()))
        mark = self.ledger.mark()  # with ``pending``, before any await
        await self.ledger.save_mark(target, mark)
        state = DriverState(version, self.cursor, pending, attrs.asdict(self.spec.model))
        await in_thread(state.write, target)
        if final:
            await in_thread(_swap, target, directory)
        elif self.spec.train.keep_last:
            await in_thread(self._prune)
        if directory in self.hooks.checkpoints:  # final, saved again at a later step
            self.hooks.checkpoints.remove(directory)
        self.hooks.checkpoints.append(directory)
        self.saved = (version, directory)
        self.unsaved.saved(version)
        return directory

    def pending(self) -> set[int]:
        """The prompts taken and not trained: in flight, waiting, being admitted, and those of
        a step the Trainer trained (``StepTrained`` took them out of ``inflight``) but has not
        reported yet (no ``StepDone``: the step is not this Driver's version, so neither a
        checkpoint nor the ledger counts it trained)."""
        pending = set(self.inflight.values()) | set(self.backlog) | self.admitting
        return pending | self.unsaved.unreported()

    async def on_stop(self, ctx: ActorContext[Any], error: BaseException | None) -> None:
        ledger = getattr(self, "ledger", None)
        resumed = self.hooks.driver_resumes_left > 0 and not ctx.cell.terminate_requested
        if ledger is not None and error is not None and resumed:
            with trio.CancelScope(shield=True):
                await ledger.flush()  # a resumed Driver goes on with it
        elif ledger is not None:  # the run ends: what is still in flight stays unfinished
            with trio.CancelScope(shield=True):
                await ledger.close(self.pending())

    def _prune(self) -> None:
        """Remove the intermediate checkpoints beyond the newest ``keep_last`` (never the one
        this run resumed from: a restarted station may read it)."""
        assert self.spec.run_dir is not None
        root = os.path.join(self.spec.run_dir, CHECKPOINTS)
        names = sorted(n for n in os.listdir(root) if n.startswith("step-"))
        keep = os.path.abspath(self.spec.resume_from) if self.spec.resume_from else None
        for name in names[: -self.spec.train.keep_last]:
            path = os.path.join(root, name)
            if os.path.abspath(path) != keep:
                shutil.rmtree(path, ignore_errors=True)
                if path in self.hooks.checkpoints:
                    self.hooks.checkpoints.remove(path)


def _swap(new: str, directory: str) -> None:
    """Put the complete directory ``new`` in place of ``directory``."""
    old = directory + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(directory):
        os.replace(directory, old)
    os.replace(new, directory)
    shutil.rmtree(old, ignore_errors=True)
