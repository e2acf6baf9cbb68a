"""Experiment trackers (``report.report_to``): TensorBoard, Weights & Biases, MLflow, trackio.

Each receives every step's scalars (``step_scalars``: the numbers of the step's line in
``steps.jsonl``, the step as x) and the run's configuration (W&B config, MLflow params, trackio
config, TensorBoard hparams and a text summary). One thread (``TrackerThread``) owns them all:
it opens them, logs each step in order and closes them, so a slow upload never holds the event
loop. A tracker that fails (at its start or mid-run) is reported once, as a warning, and the run
goes on: losing a dashboard never loses the training.

Each tracker is an optional extra named after it (``pip install 'asyncflow-actors[wandb]'``);
``preflight`` refuses a run that names one not installed. Their own environment variables
apply as usual (``WANDB_MODE``, ``WANDB_DIR``, ``MLFLOW_TRACKING_URI``, ``TRACKIO_DIR``...).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from ..roles._report_settings import ReportSettings
from ._report import StepRecord
from ._tracker_check import MODULES as MODULES
from ._tracker_check import check_trackers as check_trackers
from ._tracker_check import missing_trackers as missing_trackers

log = logging.getLogger("asyncflow_actors.pipeline")


CLOSE_TIMEOUT_S = 120.0  # an upload still running after this is abandoned (the run ends)

_RECORD_NUMBERS = (
    "version",
    "seconds",
    "step_seconds",
    "samples",
    "samples_per_s",
    "tokens_per_s",
    "reward_mean",
    "offpolicy_samples",
    "in_flight_slots",
    "reinjected",
)


def step_scalars(record: StepRecord) -> dict[str, float]:
    """A step's numbers by name: the record's own (``reward_mean``, ``samples_per_s``...), its
    ``metrics`` under their names (``loss``, ``reward/<function>``, ``eval/...``), and
    ``sync/<phase>``, ``idle/<role>``, ``queues/<consumer>``, ``staleness/<lag>``. Not-a-number
    values (a reward function that scored nothing this step) are left out."""
    out = {key: float(getattr(record, key)) for key in _RECORD_NUMBERS}
    out.update((k, float(v)) for k, v in record.metrics.items())
    for section in ("sync", "idle", "queues"):
        values: Mapping[str, float] = getattr(record, section)
        out.update((f"{section}/{k}", float(v)) for k, v in values.items())
    out.update((f"staleness/{lag}", float(n)) for lag, n in enumerate(record.staleness))
    return {k: v for k, v in out.items() if math.isfinite(v)}


def flat_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested configuration as ``{"train.lr": 0.0005, ...}`` (lists as JSON text)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flat_config(value, f"{name}."))
        elif isinstance(value, (list, tuple)):
            out[name] = json.dumps(value, default=str)
        else:
            out[name] = value
    return out


class Tracker(Protocol):
    """One tracker's run: ``log`` a step's scalars, ``close`` it (``ok``: the run finished or
    was stopped cleanly; otherwise it failed)."""

    def log(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def close(self, ok: bool) -> None: ...


@contextlib.contextmanager
def _quiet() -> Any:
    """A tracker's start-up banner off the run's terminal (it would interleave with the
    display, which holds its own reference to the terminal)."""
    with contextlib.redirect_stdout(io.StringIO()) as out:
        yield
    if out.getvalue().strip():
        log.debug("%s", out.getvalue().strip())


class _TensorBoard:
    def __init__(self, settings: ReportSettings, run_dir: str | None, config: Mapping[str, Any]):
        from torch.utils.tensorboard import SummaryWriter, summary

        assert run_dir is not None  # preflight: tensorboard writes into run_dir
        self.writer: Any = SummaryWriter(log_dir=os.path.join(run_dir, "tensorboard"))
        text = json.dumps(config, indent=1, default=str)
        self.writer.add_text("config", "    " + text.replace("\n", "\n    "))
        plain = {
            k: v if isinstance(v, (int, float, str, bool)) else str(v)
            for k, v in flat_config(config).items()
        }
        # the HPARAMS tab: the settings, and the metric they are compared by
        hparams: Any = summary.hparams
        events: Any = self.writer.file_writer
        for part in hparams(plain, {"reward_mean": 0.0}):
            events.add_summary(part)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self, ok: bool) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, settings: ReportSettings, run_dir: str | None, config: Mapping[str, Any]):
        import wandb

        if os.environ.get("WANDB_MODE", "").lower() not in ("offline", "disabled", "dryrun"):
            # online: W&B would ask for a key on the terminal, from this thread, under the
            # run's display; without credentials it is a warning instead
            try:
                logged_in = wandb.login(prompt=False, verify=False)
            except TypeError:  # a W&B without ``prompt``: its own init decides
                logged_in = True
            if not logged_in:
                raise RuntimeError(
                    "not logged in: run `wandb login`, set WANDB_API_KEY or WANDB_MODE=offline"
                )
        self.run: Any = wandb.init(
            project=settings.project,
            name=settings.run_name or _default_name(run_dir),
            config=dict(config),
            dir=run_dir,
            reinit="create_new",
            # console "off": W&B must not wrap this process's stdout (the run's display)
            settings=wandb.Settings(console="off", quiet=True, show_info=False),
        )

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)


class _MLflow:
    BATCH = 100  # MLflow's log_batch takes at most 100 params (and 1000 metrics)

    def __init__(self, settings: ReportSettings, run_dir: str | None, config: Mapping[str, Any]):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient()  # MLFLOW_TRACKING_URI, else MLflow's default
        experiment = self.client.get_experiment_by_name(settings.project)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(settings.project)
        )
        name = settings.run_name or _default_name(run_dir)
        self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        params = [Param(k, str(v)[:500]) for k, v in flat_config(config).items()]
        for i in range(0, len(params), self.BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + self.BATCH])

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = _millis()
        metrics = [Metric(_mlflow_key(k), v, now, step) for k, v in scalars.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")


class _Trackio:
    def __init__(self, settings: ReportSettings, run_dir: str | None, config: Mapping[str, Any]):
        import trackio

        with _quiet():
            self.run: Any = trackio.init(
                project=settings.project,
                name=settings.run_name or _default_name(run_dir),
                config=dict(config),
            )

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self, ok: bool) -> None:
        with _quiet():
            self.run.finish()


OPENERS: dict[str, Callable[[ReportSettings, str | None, Mapping[str, Any]], Tracker]] = {
    "tensorboard": _TensorBoard,
    "wandb": _WandB,
    "mlflow": _MLflow,
    "trackio": _Trackio,
}


def _default_name(run_dir: str | None) -> str | None:
    return os.path.basename(os.path.normpath(run_dir)) if run_dir else None


def _millis() -> int:
    import time

    return int(time.time() * 1000)


def _mlflow_key(name: str) -> str:
    """MLflow's metric names allow letters, digits, ``_ - . / `` and spaces only."""
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in name)


_CLOSE = object()


class TrackerThread:
    """The run's trackers, in a thread of their own (see the module docstring).

    ``log`` never blocks (a queue); ``close`` waits for what was queued, closes every tracker
    and returns within ``CLOSE_TIMEOUT_S`` (call it from a worker thread).
    """

    def __init__(
        self,
        names: Sequence[str],
        settings: ReportSettings,
        run_dir: str | None,
        config: Mapping[str, Any],
        *,
        openers: Mapping[str, Callable[..., Tracker]] = OPENERS,
    ) -> None:
        self.names = tuple(names)
        self._open = {n: (lambda n=n: openers[n](settings, run_dir, config)) for n in names}
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._warned: set[str] = set()
        self.failures: dict[str, int] = {}
        self._thread = threading.Thread(target=self._serve, name="afa-trackers", daemon=True)
        self._thread.start()

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self._queue.put((step, dict(scalars)))

    def close(self, ok: bool) -> None:
        self._queue.put((_CLOSE, ok))
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            log.warning("report_to: trackers still closing after %.0f s: left", CLOSE_TIMEOUT_S)

    def _serve(self) -> None:
        trackers: dict[str, Tracker] = {}
        for name in self.names:
            try:
                trackers[name] = self._open[name]()
            except Exception as exc:
                self._failed(name, "could not start", exc)
        while True:
            step, item = self._queue.get()
            if step is _CLOSE:
                for name, tracker in trackers.items():
                    try:
                        tracker.close(bool(item))
                    except Exception as exc:
                        self._failed(name, "did not close", exc)
                return
            for name, tracker in trackers.items():
                try:
                    tracker.log(step, item)
                except Exception as exc:
                    self._failed(name, f"failed at step {step}", exc)

    def _failed(self, name: str, what: str, exc: BaseException) -> None:
        self.failures[name] = self.failures.get(name, 0) + 1
        if name in self._warned:
            return
        self._warned.add(name)
        first = str(exc).strip().splitlines()
        detail = f"{type(exc).__name__}: {first[0]}" if first else type(exc).__name__
        if len(detail) > 240:  # a tracker's advice can run long: the gist, on one line
            detail = detail[:239] + "…"
        log.warning("report_to %s %s (%s); training goes on without it", name, what, detail)
