"""``run_pipeline``: start a run's TransferQueue, nodes and roles, train, report, stop.

The Python API of the pipeline (the CLI's ``asyncflow train`` calls it)::

    config = PipelineConfig.from_toml("run.toml")
    result = trio.run(run_pipeline, config)

Start order: the TransferQueue (``prompts`` and ``rollout`` topics), the nodes (concurrently,
in the background: each imports its roles' modules in a thread while this process spawns its
own roles), the supervised warm-up (``train.sft_warmup_steps``, where the Trainer will run:
``pipeline._warmup``), the Driver, the Reward actor, rollout workers, forward workers, the
Advantage station and the Trainer (which gets the refs of every weight holder). The run ends
after ``train.steps`` global batches; every role, node and the queue are stopped on the way
out, also on error or cancellation. A role that terminates for good fails the run
(``RunFailed``); stations that crash are restarted by their supervisors meanwhile, and a
Trainer that dies is resumed from the newest checkpoint (``train.auto_resume``: ``_resume``),
a Driver that raises from the state it held (``_driver_resumer``).
A run that makes no step for ``watchdog.fail_s`` fails with ``RunStalled`` and a diagnosis
(``_watchdog``).
"""

from __future__ import annotations

import math
import os
from collections.abc import AsyncIterator
from contextlib import ExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any

import attrs
import trio

from ..actors import ActorRef, ActorSystem
from ..actors.remote import Node, NodeSystem, open_actor_system
from ..observe import GraphEdge, ObserveConfig, Observer, open_observer
from ..roles._ask_again import ask_again, driver_resuming
from ..roles._driver_state import DriverState
from ..roles._messages import (
    StepDone,
    Stopped,
    StopRun,
    SyncReport,
)
from ..roles._schema import topic_specs
from ..roles._settings import RunSpec
from ..roles._shared import forget_shared_policy
from ..roles._warmup import WarmedUp
from ..roles._worker import wait_for_threads
from ..transfer_queue import (
    TransferQueue,
    TransferQueueConfig,
    open_transfer_queue,
)
from ._config import PipelineConfig, PipelineConfigError
from ._driver_resumer import DriverResumer
from ._placement import Placement, Watcher
from ._preflight import check_paths
from ._report import (
    Progress,
    StepRecord,
    third_party_bars_off,
)
from ._reports import Reports, open_reports
from ._resume import Resume, TrainerResumer
from ._rundir import clear_run_dir, trim_steps
from ._spawn import role_modules, spawn_roles, watch
from ._start import open_nodes_beside_checks
from ._steps import OnStep, plot_whole_run, report_steps, write_config
from ._warmup import warm_up
from ._watchdog import Watchdog

if TYPE_CHECKING:  # the roles' modules import torch: loaded in a thread as the nodes start
    from ..roles._driver import DriverHooks


def graph(config: PipelineConfig) -> tuple[GraphEdge, ...]:
    """The stations' data flow, for the observer's graph."""
    edges = []
    if not config.trainer_forward:
        edges += [
            GraphEdge("rollout", "actor_fwd", "rollout"),
            GraphEdge("actor_fwd", "trainer", "rollout"),
        ]
    if config.trainer_forward and config.trainer_advantage:
        edges.append(GraphEdge("rollout", "trainer", "rollout"))
    elif not (config.fused_advantage or config.trainer_advantage):
        edges += [
            GraphEdge("rollout", "advantage", "rollout"),
            GraphEdge("advantage", "trainer", "rollout"),
        ]
    return tuple(edges)


@attrs.frozen
class PipelineResult:
    """What a run did: ``records`` per step, trained ``samples`` over ``seconds`` (from the start
    of training to the last step), the final ``version``, checkpoints written. ``stopped``: the
    run was stopped (``Pipeline.stop``) before its last step; ``latest_checkpoint``: the newest
    checkpoint of the run (``final``, or the one it resumed from), ``None`` if none;
    ``warmup``: its supervised warm-up (``train.sft_warmup_steps``; a resume's is the run's)."""

    mode: str
    staleness: int
    records: tuple[StepRecord, ...]
    samples: int
    seconds: float
    version: int
    offpolicy_samples: int
    reinjected: int
    checkpoints: tuple[str, ...]
    run_dir: str | None
    stopped: bool = False
    latest_checkpoint: str | None = None
    resumes: tuple[Resume, ...] = ()  # automatic resumes (``train.auto_resume``): the
    # Trainer's, then the Driver's (``Resume.role``)
    warmup: WarmedUp | None = None

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else math.inf

    def final_reward(self, last: int = 3) -> float:
        """Mean batch reward of the ``last`` steps."""
        tail = self.records[-last:]
        return sum(r.reward_mean for r in tail) / len(tail) if tail else math.nan


async def run_pipeline(
    config: PipelineConfig,
    *,
    system: NodeSystem | None = None,
    resume: str | None = None,
    overwrite: bool = False,
    on_step: OnStep | None = None,
) -> PipelineResult:
    """Run ``config`` to the end (see the module docstring); ``resume``: a checkpoint directory
    (``run_dir/final``, ``run_dir/checkpoints/step-N``) or a run directory to continue from;
    ``overwrite``: replace the run in ``run_dir`` (a new run refuses one otherwise). ``on_step`` sees every ``StepRecord``."""
    if system is None:
        # the quick checks before the system's nursery, the others caught inside it: a bad
        # config raises PipelineConfigError itself, not in a group
        resume = await trio.to_thread.run_sync(
            lambda: check_paths(config, resume=resume, overwrite=overwrite)
        )
        failed: list[PipelineConfigError] = []
        async with open_actor_system() as own:
            try:
                pipeline = open_pipeline(own, config, resume=resume, on_step=on_step,
                                         overwrite=overwrite)  # fmt: skip
                async with pipeline as run:
                    return await run.wait()
            except PipelineConfigError as exc:  # raised by the checks, before any role
                failed.append(exc)
        raise failed[0]
    async with open_pipeline(
        system, config, resume=resume, overwrite=overwrite, on_step=on_step
    ) as run:
        return await run.wait()


class Pipeline:
    """A started run (from ``open_pipeline``): ``await wait()`` for its result; ``stop()`` asks
    it to stop cleanly (``wait`` then returns a result with ``stopped``)."""

    def __init__(self, config: PipelineConfig, progress: Progress) -> None:
        self.config = config
        self.progress = progress
        from ..roles._driver import DriverHooks  # (imported by ``_start`` already)

        self.hooks: DriverHooks = DriverHooks()
        self.records: list[StepRecord] = []
        self.failed = trio.Event()
        self.errors: list[BaseException] = []
        self.refs: dict[str, ActorRef[Any]] = {}
        self.nodes: dict[str, Node] = {}  # node name (as configured) -> its handle
        self.queue: TransferQueue | None = None  # the run's TransferQueue, once started
        self.started = 0.0
        self.version = 0
        self.resumed_from: str | None = None
        self.seconds_before = 0.0  # a resumed run: the seconds of the steps before it
        self.warmup: WarmedUp | None = None
        self._recorded = trio.Event()
        self._stop = trio.Event()
        self._stopped: Stopped | None = None
        self._record_added = trio.Event()
        self.watchdog = Watchdog(config.watchdog, config.run_dir)
        self.reports: Reports | None = None
        self.trainer: tuple[str, dict[str, Any]] | None = None  # its worker name and kwargs
        self.resumer: TrainerResumer | None = None
        self.driver_resumer: DriverResumer | None = None

    def stop(self) -> None:
        """Stop the run cleanly: the Driver saves the last step (``run_dir/final``) unless the
        newest checkpoint holds it, the roles are stopped, and ``wait`` returns."""
        self._stop.set()

    async def _stop_when_asked(self) -> None:
        await self._stop.wait()
        driver = self.refs.get("driver")
        if driver is None:  # not started yet: nothing trained, nothing to save
            self._stopped = Stopped(self.version, self.resumed_from or "")
            return
        # asked again while a Driver that raised is resumed (``_driver_resumer``)
        answer = await ask_again(
            lambda: driver.ask(StopRun()), "stopping the run", transient=driver_resuming
        )
        if answer.pending:  # the Driver saves at the step the Trainer is reporting
            await self.hooks.done.wait()
            assert self.hooks.stopped is not None
            answer = self.hooks.stopped
        self._stopped = answer
        while self.version < answer.version:  # its record reaches steps.jsonl
            await self._record_added.wait()

    async def wait(self) -> PipelineResult:
        """Until the last step is recorded; raises ``RunFailed`` if a role terminated,
        ``RunStalled`` if the run made no step for ``watchdog.fail_s``."""
        async with trio.open_nursery() as nursery:

            async def watch_failure() -> None:
                await self.failed.wait()
                nursery.cancel_scope.cancel()

            async def watch_stop() -> None:
                await self._stop_when_asked()
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch_failure)
            nursery.start_soon(watch_stop)
            await self._recorded.wait()
            nursery.cancel_scope.cancel()
        if self.errors:
            raise self.errors[0]
        return self.result()

    def result(self) -> PipelineResult:
        records = tuple(self.records)
        samples = sum(r.samples for r in records)
        seconds = records[-1].seconds - self.seconds_before if records else 0.0
        return PipelineResult(
            mode=self.config.mode,
            staleness=self.config.effective_staleness,
            records=records,
            samples=samples,
            seconds=seconds,
            version=self.version,
            offpolicy_samples=sum(r.offpolicy_samples for r in records),
            reinjected=self.hooks.reinjected,
            checkpoints=tuple(self.hooks.checkpoints),
            run_dir=self.config.run_dir,
            stopped=self._stopped is not None,
            latest_checkpoint=(
                self.hooks.checkpoints[-1] if self.hooks.checkpoints else self.resumed_from
            ),
            resumes=(tuple(self.resumer.resumes) if self.resumer else ())
            + (tuple(self.driver_resumer.resumes) if self.driver_resumer else ()),
            warmup=self.warmup,
        )


@asynccontextmanager
async def open_pipeline(
    system: NodeSystem,
    config: PipelineConfig,
    *,
    resume: str | None = None,
    overwrite: bool = False,
    on_step: OnStep | None = None,
    checked: bool = False,
) -> AsyncIterator[Pipeline]:
    """Start a run under ``system``; stop everything when the block exits. ``resume``: a
    checkpoint directory, or a run directory (its newest checkpoint). Everything checkable is
    checked first (``preflight``: ``PipelineConfigError`` before any role starts; the node
    processes start beside its slower half, ``_start``) unless ``checked``: ``preflight``
    already passed on this ``config`` and ``resume``."""
    if not checked:
        resume = await trio.to_thread.run_sync(
            lambda: check_paths(config, resume=resume, overwrite=overwrite)
        )
    state = DriverState.read(resume) if resume else None
    spec = config.run_spec(
        start_version=state.version if state else 0,
        resume_from=_absolute(resume),
    )
    place = Placement(system, config, spec.run_id[:8])
    async with (
        open_nodes_beside_checks(place, config, resume, role_modules(), checked=checked),
        _open_run(system, config, spec, place, (resume, state), overwrite, on_step) as run,
    ):
        yield run


@asynccontextmanager
async def _open_run(
    system: NodeSystem,
    config: PipelineConfig,
    spec: RunSpec,
    place: Placement,
    resumed: tuple[str | None, DriverState | None],
    overwrite: bool,
    on_step: OnStep | None,
) -> AsyncIterator[Pipeline]:
    """``open_pipeline`` once the checks passed and the nodes are starting (``resumed``: the
    checkpoint resumed from and its Driver state, or none)."""
    resume, state = resumed
    total = config.train.steps - spec.start_version
    earlier: list[dict[str, Any]] = []  # the step records before the checkpoint resumed
    if config.run_dir:
        if overwrite and state is None:
            await trio.to_thread.run_sync(clear_run_dir, config.run_dir)
        if state is not None:
            earlier = await trio.to_thread.run_sync(trim_steps, config.run_dir, state.version)
        await trio.to_thread.run_sync(write_config, config)
    progress = Progress(config.progress, config.train.steps, start=spec.start_version)
    run = Pipeline(config, progress)
    run.version = run.watchdog.version = spec.start_version
    run.seconds_before = float(earlier[-1].get("seconds", 0.0)) if earlier else 0.0
    run.resumed_from = resume
    bars = ExitStack()  # third parties' progress bars off while the display is live
    if config.progress != "none":
        bars.enter_context(third_party_bars_off())
    suffix = spec.run_id[:8]
    tq_config = TransferQueueConfig(
        topics=topic_specs(spec),
        units=config.placement.tq_units,
        placement=config.placement.tq_placement,
        transport=config.placement.transport,
        name=f"tq.{suffix}",
    )
    spawned: list[ActorRef[Any]] = []
    steps_jsonl = os.path.join(config.run_dir, "steps.jsonl") if config.run_dir else None
    try:
        async with (
            open_reports(
                config, progress, [StepRecord.from_json(r) for r in earlier], spec.start_version
            ) as reports,
            open_transfer_queue(system, tq_config) as queue,
            _observer(system, config) as observer,
        ):
            run.reports = reports
            try:
                async with trio.open_nursery() as nursery:
                    run.queue = queue
                    # the nodes start and preload while this process spawns its own roles;
                    # the observer attaches to each before its roles start
                    place.observe(observer.attach_node if observer is not None else None)
                    client = await queue.client(f"pipeline.{suffix}")
                    if observer is not None:
                        observer.watch_transfer_queue(client)
                    send, receive = trio.open_memory_channel[tuple[StepDone, SyncReport, float]](
                        math.inf
                    )

                    async def step_done(msg: StepDone, report: SyncReport, seconds: float) -> None:
                        run.watchdog.step(msg.version)
                        send.send_nowait((msg, report, seconds))

                    run.hooks.on_step = step_done
                    run.warmup = await warm_up(place, config, spec, progress)
                    await spawn_roles(place, spec, queue.controller, run, spawned)
                    run.nodes = place.nodes  # every node is up: a role of each was spawned
                    watched = dict(run.refs)
                    if config.train.auto_resume and run.trainer is not None:
                        worker, kwargs = run.trainer  # watched by its resumer instead
                        run.resumer = TrainerResumer(run, place, client, worker, kwargs, spawned)
                        await run.resumer.watch(watched.pop(worker))
                        nursery.start_soon(run.resumer.serve)
                    watcher = await system.spawn(
                        lambda: Watcher(list(watched.values()), run.failed, run.errors),
                        name=f"watcher.{suffix}",
                    )
                    spawned.insert(0, watcher)
                    run.started = trio.current_time()
                    nursery.start_soon(
                        report_steps, run, receive, client, total, steps_jsonl, on_step
                    )
                    nursery.start_soon(watch, run, queue.controller)
                    if total <= 0:
                        run._recorded.set()
                    yield run
                    nursery.cancel_scope.cancel()
            finally:
                # roles and nodes go before the queue they use; the observer's last pull
                # comes between the two, while the nodes' agents can still answer
                await place.stop(spawned, before_nodes=observer.finish if observer else None)
                with trio.CancelScope(shield=True):
                    await wait_for_threads(10)
    finally:
        with trio.CancelScope(shield=True):
            run.progress.close()
            bars.close()
            forget_shared_policy(spec)
            if config.run_dir and config.plot and run.records:
                title = f"{config.mode} (staleness {config.effective_staleness})"
                path = os.path.join(config.run_dir, "curves.png")
                await trio.to_thread.run_sync(plot_whole_run, run.records, steps_jsonl, path, title)


@asynccontextmanager
async def _observer(system: ActorSystem, config: PipelineConfig) -> AsyncIterator[Observer | None]:
    if not config.observe:
        yield None
        return
    observe = ObserveConfig(run_dir=config.run_dir, graph=graph(config))
    async with open_observer(system, observe) as observer:
        yield observer


def _absolute(path: str | None) -> str | None:
    return os.path.abspath(path) if path else None
