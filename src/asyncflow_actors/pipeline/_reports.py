"""What a run reports besides ``steps.jsonl`` and its display, while it runs (``[report]``).

``open_reports`` owns, for the life of a run: the trackers' thread (``_trackers.py``), the
sample completions the Trainer sends (appended to ``run_dir/completions.jsonl`` and shown on the
progress display) and the plot redrawn every ``report.plot_every`` steps (in a worker thread:
a step never waits for a drawing; a step due while one is drawing asks for one more, drawn
after it). Nothing here may fail the run: a plot or tracker error is a warning, once.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from ..roles._completions import SampleCompletion
from ._config import PipelineConfig
from ._plot import plot_run
from ._report import Progress, StepRecord
from ._trackers import TrackerThread, step_scalars

log = logging.getLogger("asyncflow_actors.pipeline")

COMPLETIONS = "completions.jsonl"
CURVES = "curves.png"


def run_title(config: PipelineConfig) -> str:
    """The plot's title: the mode and its staleness."""
    return f"{config.mode} (staleness {config.effective_staleness})"


def config_json(config: PipelineConfig) -> dict[str, Any]:
    """The run's configuration as JSON-able data (``config.json``, the trackers' config)."""
    return json.loads(json.dumps(attrs.asdict(config), default=str))  # type: ignore[no-any-return]


def read_completions(path: str | os.PathLike[str]) -> list[SampleCompletion]:
    """The sample completions of a run's ``completions.jsonl``."""
    with open(path, encoding="utf-8") as f:
        return [SampleCompletion.from_json(json.loads(line)) for line in f if line.strip()]


def trim_completions(path: str, step: int) -> None:
    """Keep the completions of ``path`` up to ``step`` (a resume from that step)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line for line in f if line.strip()]
    except FileNotFoundError:
        return
    kept = [line for line in lines if int(json.loads(line).get("step", 0)) <= step]
    if len(kept) != len(lines):
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)


class Reports:
    """A run's reporting while it runs (from ``open_reports``)."""

    def __init__(
        self,
        config: PipelineConfig,
        progress: Progress,
        earlier: Sequence[StepRecord],
        trackers: TrackerThread | None,
    ) -> None:
        self.config = config
        self.progress = progress
        self.records: list[StepRecord] = list(earlier)  # the whole run's, for the plot
        self.trackers = trackers
        self.plots = 0  # drawn while the run ran
        self._plot_send, self._plot_receive = trio.open_memory_channel[None](1)
        self._plot_warned = False

    async def step(self, record: StepRecord, completions: Sequence[SampleCompletion]) -> None:
        """Report one step (after its line reached ``steps.jsonl``)."""
        await trio.lowlevel.checkpoint()
        self.records.append(record)
        if self.trackers is not None:
            self.trackers.log(record.step, step_scalars(record))
        if completions:
            run_dir = self.config.run_dir
            if run_dir is not None:
                lines = "".join(json.dumps(c.to_json()) + "\n" for c in completions)
                path = os.path.join(run_dir, COMPLETIONS)
                async with await trio.open_file(path, "a", encoding="utf-8") as f:
                    await f.write(lines)
            self.progress.completions(completions)
        every = self.config.report.plot_every
        if every and record.step % every == 0 and self._plots_on:
            try:
                self._plot_send.send_nowait(None)
            except trio.WouldBlock:
                pass  # one is asked for already: it draws the records as they are then

    @property
    def _plots_on(self) -> bool:
        return bool(self.config.plot and self.config.run_dir)

    async def _plot_when_asked(self) -> None:
        assert self.config.run_dir is not None
        path = os.path.join(self.config.run_dir, CURVES)
        title = run_title(self.config)
        async for _ in self._plot_receive:
            records = tuple(self.records)
            try:
                await trio.to_thread.run_sync(plot_run, records, path, title)
                self.plots += 1
            except Exception as exc:
                if not self._plot_warned:
                    self._plot_warned = True
                    log.warning("plot_every: drawing %s failed (%r); the run goes on", path, exc)


@asynccontextmanager
async def open_reports(
    config: PipelineConfig,
    progress: Progress,
    earlier: Sequence[StepRecord] = (),
    start_step: int = 0,
) -> AsyncIterator[Reports]:
    """Reporting for one run (see the module docstring); ``earlier``: the records of the steps
    before the checkpoint a run resumed from, at ``start_step`` (the plot covers the whole run;
    the interrupted run's completions after it are dropped, as its step records are). On the
    way out the trackers are closed (finished, or failed if an error leaves the block)."""
    report = config.report
    if config.run_dir is not None and start_step > 0:
        path = os.path.join(config.run_dir, COMPLETIONS)
        await trio.to_thread.run_sync(trim_completions, path, start_step)
    trackers = None
    if report.report_to:
        trackers = TrackerThread(report.report_to, report, config.run_dir, config_json(config))
    reports = Reports(config, progress, earlier, trackers)
    ok = False
    try:
        async with trio.open_nursery() as nursery:
            if reports._plots_on and report.plot_every:
                nursery.start_soon(reports._plot_when_asked)
            yield reports
            ok = True
            reports._plot_send.close()  # a plot asked for is drawn; then the task ends
    finally:
        if trackers is not None:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(trackers.close, ok)
