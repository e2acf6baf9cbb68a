"""A run's step records: every ``StepDone`` the Driver reports becomes a ``StepRecord`` (with
the roles' statistics and the queue's depths), a line of ``steps.jsonl``, the progress display,
the trackers and ``on_step``; at the end the whole run's curves and, at the start,
``config.json``."""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import attrs
import trio

from ..actors import ActorRef
from ..roles._messages import GetRoleStats, RoleStatistics, StepDone, SyncReport
from ..transfer_queue import TransferQueueClient
from ._config import PipelineConfig
from ._plot import plot_run
from ._report import StepRecord, idle_ratios, read_steps

if TYPE_CHECKING:
    from ._run import Pipeline

OnStep = Callable[[StepRecord], Awaitable[None] | None]


async def role_statistics(refs: dict[str, ActorRef[Any]]) -> list[RoleStatistics]:
    """Every role's statistics (those that answer within 2 s)."""
    out: list[RoleStatistics] = []

    async def one(ref: ActorRef[Any]) -> None:
        with trio.move_on_after(2):
            try:
                out.append(await ref.ask(GetRoleStats()))
            except Exception:
                pass  # restarting or gone: skip it this step

    async with trio.open_nursery() as nursery:
        for name, ref in refs.items():
            if name != "reward-0":
                nursery.start_soon(one, ref)
    return out


async def report_steps(
    run: Pipeline,
    receive: trio.MemoryReceiveChannel[tuple[StepDone, SyncReport, float]],
    client: TransferQueueClient,
    total: int,
    path: str | None,
    on_step: OnStep | None,
) -> None:
    previous = await role_statistics(run.refs)
    last = run.started
    count = 0
    total_before = run.config.train.steps - total
    async for msg, report, _ in receive:
        now = trio.current_time()
        stats = await role_statistics(run.refs)
        queues: dict[str, int] = {}
        with trio.move_on_after(2):
            tq = await client.statistics()
            for topic in tq.controller.state.topics:
                if topic.topic == "rollout":
                    queues = {view.consumer: view.ready for view in topic.views}
        driver = next((s for s in stats if s.role == "driver"), None)
        count += 1
        wall = now - last
        record = StepRecord(
            step=total_before + count,  # continuous over a resume
            version=msg.version,
            seconds=run.seconds_before + now - run.started,
            step_seconds=wall,
            samples=msg.samples,
            samples_per_s=msg.samples / wall if wall > 0 else 0.0,
            tokens_per_s=msg.tokens / wall if wall > 0 else 0.0,
            reward_mean=float(msg.metrics.get("reward_mean", 0.0)),
            staleness=msg.staleness,
            offpolicy_samples=sum(msg.staleness[1:]),
            in_flight_slots=int(driver.extra.get("in_flight_slots", 0)) if driver else 0,
            reinjected=run.hooks.reinjected,
            metrics=msg.metrics,
            sync=report.metrics,
            idle=idle_ratios(previous, [s for s in stats if s.role != "driver"], wall),
            queues=queues,
        )
        previous, last = stats, now
        if path is not None:
            line = json.dumps(record.to_json()) + "\n"
            async with await trio.open_file(path, "a", encoding="utf-8") as f:
                await f.write(line)
        run.progress.update(record)
        if run.reports is not None:
            await run.reports.step(record, msg.completions)
        # recorded once reported everywhere: a stop waiting for this step ends the run only
        # then (its line in steps.jsonl, its trackers' scalars)
        run.records.append(record)
        run.version = msg.version
        run._record_added.set()
        run._record_added = trio.Event()
        if on_step is not None:
            maybe = on_step(record)
            if maybe is not None:
                await maybe
        if msg.version >= run.hooks.end_version:  # later by the steps a resume lost
            run._recorded.set()


def plot_whole_run(records: list[StepRecord], steps: str | None, path: str, title: str) -> None:
    """The whole run's curves: every record of ``steps.jsonl`` (a resumed run's earlier steps
    too), else this run's."""
    if steps is not None and os.path.exists(steps):
        records = read_steps(steps)
    plot_run(records, path, title)


def write_config(config: PipelineConfig) -> None:
    assert config.run_dir is not None
    os.makedirs(config.run_dir, exist_ok=True)
    with open(os.path.join(config.run_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(_plain(attrs.asdict(config)), f, indent=1)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
