"""``report.report_to``: experiment trackers receive every step's scalars (those of
``steps.jsonl``, the step as x) and the run's configuration, from a thread of their own; a
tracker that fails never stops the training; one not installed is a preflight error.

TensorBoard runs through a whole (tiny) run; W&B (offline), MLflow (a local file store) and
trackio (its local SQLite) through ``TrackerThread`` with step records like a run's, read back
with each tracker's own reader.
"""

from __future__ import annotations

import glob
import json
import logging
import math
import struct
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import trio

from asyncflow_actors import cli
from asyncflow_actors.pipeline import (
    PipelineConfigError,
    _reports,
    _trackers,
    preflight,
    run_pipeline,
)
from asyncflow_actors.pipeline._report import StepRecord, read_steps
from asyncflow_actors.pipeline._trackers import TrackerThread, step_scalars
from asyncflow_actors.roles._report_settings import ReportSettings

from .kit import tiny

CONFIG = {"train": {"steps": 2, "lr": 0.001}, "report": {"report_to": ["wandb"]}}


def record(step: int) -> StepRecord:
    """A step record shaped like a run's (a reward function that scored nothing: nan)."""
    return StepRecord(
        step=step, version=step, seconds=1.5 * step, step_seconds=1.5, samples=16,
        samples_per_s=10.0 + step, tokens_per_s=40.0, reward_mean=0.25 * step,
        staleness=(12, 4), offpolicy_samples=4, in_flight_slots=3, reinjected=0,
        metrics={"loss": -0.1 * step, "reward/exact": 0.5, "reward/other": math.nan},
        sync={"sync_total": 0.02}, idle={"rollout": 0.1}, queues={"trainer": 5},
    )  # fmt: skip


def test_the_scalars_are_the_numbers_of_a_step_record() -> None:
    scalars = step_scalars(record(3))
    assert scalars["reward_mean"] == 0.75 and scalars["loss"] == pytest.approx(-0.3)
    assert scalars["reward/exact"] == 0.5 and "reward/other" not in scalars  # nan: left out
    assert scalars["sync/sync_total"] == 0.02 and scalars["idle/rollout"] == 0.1
    assert scalars["queues/trainer"] == 5.0
    assert (scalars["staleness/0"], scalars["staleness/1"]) == (12.0, 4.0)
    assert "step" not in scalars  # the x value


async def test_tensorboard_receives_every_steps_numbers_and_the_config(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    config = tiny(run_dir=str(run_dir), report={"report_to": "tensorboard"})
    await run_pipeline(config)
    steps = read_steps(run_dir / "steps.jsonl")
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for step in steps:
        for name, value in step_scalars(step).items():
            assert name in tags
            logged = {e.step: e.value for e in events.Scalars(name)}
            assert logged[step.step] == pytest.approx(value, rel=1e-6, abs=1e-9), name
    assert [e.step for e in events.Scalars("reward_mean")] == [1, 2, 3]
    assert "config/text_summary" in events.Tags()["tensors"]


def _wandb_records(path: str) -> list[Any]:
    """The records of an offline run's ``.wandb`` file (a LevelDB-style log of protobufs)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            pos += block - pos % block if pos % block else 0
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(pending)
            out.append(rec)
    return out


def _run_trackers(names: list[str], run_dir: Path, config: Mapping[str, Any]) -> TrackerThread:
    settings = ReportSettings(report_to=names, project="afa-test", run_name="tiny")
    thread = TrackerThread(names, settings, str(run_dir), config)
    for step in (1, 2, 3):
        thread.log(step, step_scalars(record(step)))
    thread.close(True)
    assert thread.failures == {}
    return thread


def test_wandb_offline_run_holds_the_history_and_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb", reason="the wandb extra")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    import wandb

    _run_trackers(["wandb"], tmp_path, CONFIG)
    # wandb-core writes an offline run's log out when its service stops (at the process's
    # exit, by its atexit hook): stop it now, as the end of `asyncflow train` does
    wandb.teardown()
    (path,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    history, config, exits = {}, {}, []
    for rec in _wandb_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): float(i.value_json) for i in rec.history.item}
            history[rec.history.step.num] = {k: v for k, v in items.items() if k[0] != "_"}
        elif kind == "run":
            config.update({u.key: u.value_json for u in rec.run.config.update})
        elif kind == "exit":
            exits.append(rec.exit.exit_code)
    assert sorted(history) == [1, 2, 3]
    for step, logged in history.items():
        assert logged == pytest.approx(step_scalars(record(step)))
    assert json.loads(config["train"]) == {"steps": 2, "lr": 0.001} and exits == [0]


def test_mlflow_local_file_store_holds_the_metrics_and_params(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("mlflow", reason="the mlflow extra")
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3: the file store opt-in
    _run_trackers(["mlflow"], tmp_path, CONFIG)
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("afa-test")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "tiny"
    assert run.data.params["train.lr"] == "0.001"
    assert run.data.params["report.report_to"] == '["wandb"]'
    for name in step_scalars(record(1)):
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
        assert history == pytest.approx({s: step_scalars(record(s))[name] for s in (1, 2, 3)})


def test_trackio_local_storage_holds_the_logs_and_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("trackio", reason="the trackio extra")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    for name, module in list(sys.modules.items()):  # trackio reads it once, at import
        if name.startswith("trackio") and hasattr(module, "TRACKIO_DIR"):
            monkeypatch.setattr(module, "TRACKIO_DIR", tmp_path / "trackio")
    _run_trackers(["trackio"], tmp_path, CONFIG)
    from trackio.sqlite_storage import SQLiteStorage

    logs = {row["step"]: row for row in SQLiteStorage.get_logs("afa-test", "tiny")}
    assert sorted(logs) == [1, 2, 3]
    for step, row in logs.items():
        expected = step_scalars(record(step))
        assert {k: row[k] for k in expected} == pytest.approx(expected)
    stored = SQLiteStorage.get_run_config("afa-test", "tiny")
    assert stored is not None and stored["train"]["lr"] == 0.001


class _Failing:
    def __init__(self, *args: Any) -> None:
        pass

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        raise ConnectionError("the tracker's server went away")

    def close(self, ok: bool) -> None:
        raise ConnectionError("still away")


async def test_a_failing_tracker_warns_once_and_the_run_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(_trackers.OPENERS, "tensorboard", _Failing)
    config = tiny(run_dir=str(tmp_path / "run"), report={"report_to": ["tensorboard"]})
    with caplog.at_level(logging.WARNING, logger="asyncflow_actors.pipeline"):
        result = await run_pipeline(config)
    assert len(result.records) == 3
    warnings = [r.getMessage() for r in caplog.records if "report_to" in r.getMessage()]
    assert warnings == [
        "report_to tensorboard failed at step 1 (ConnectionError: the tracker's server went "
        "away); training goes on without it"
    ]


async def test_tracker_logging_never_holds_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tracker stuck in its first ``log`` until the run's last step: the run still gets
    there (on the event loop, it would wait forever for itself)."""
    release = threading.Event()
    logged: list[int] = []

    class Stuck(_Failing):
        def log(self, step: int, scalars: Mapping[str, float]) -> None:
            release.wait(60)
            logged.append(step)

        def close(self, ok: bool) -> None:
            logged.append(-1 if ok else -2)

    monkeypatch.setitem(_trackers.OPENERS, "tensorboard", Stuck)
    config = tiny(run_dir=str(tmp_path / "run"), report={"report_to": ["tensorboard"]})

    def on_step(step: StepRecord) -> None:
        if step.step == 3:
            assert logged == []  # still stuck in step 1's
            release.set()

    with trio.fail_after(60):
        await run_pipeline(config, on_step=on_step)
    assert logged == [1, 2, 3, -1]  # every step, in order, then closed as finished


def test_a_tracker_not_installed_is_a_one_line_preflight_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(_trackers.MODULES, "wandb", "afa_no_such_module")
    config = tiny(run_dir=str(tmp_path / "run"), report={"report_to": ["tensorboard", "wandb"]})
    with pytest.raises(PipelineConfigError, match=r"pip install 'asyncflow-actors\[wandb\]'"):
        preflight(config)
    toml = tmp_path / "run.toml"
    toml.write_text('run_dir = "x"\n[report]\nreport_to = ["wandb"]\n')
    started = []
    monkeypatch.setattr(cli, "_train_run", lambda *a: started.append(a))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", str(toml)])
    assert exit_.value.code == 2 and started == []
    assert capsys.readouterr().err == (
        "asyncflow train: report.report_to: 'wandb' not installed: "
        "pip install 'asyncflow-actors[wandb]'\n"
    )


def test_report_settings_are_checked() -> None:
    with pytest.raises(PipelineConfigError, match=r"report\.report_to: expected names from"):
        tiny(report={"report_to": ["neptune"]})
    with pytest.raises(PipelineConfigError, match=r"report\.log_completions_n: expected an int"):
        tiny(report={"log_completions_n": 0})
    with pytest.raises(PipelineConfigError, match="'tensorboard' writes its events"):
        preflight(tiny(report={"report_to": "tensorboard"}))
    assert tiny(report={"report_to": "none"}).report.report_to == ()
    assert _reports.config_json(tiny())["report"]["plot_every"] == 25


async def test_a_stopped_run_closes_its_trackers_as_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncflow_actors.actors.remote import open_actor_system
    from asyncflow_actors.pipeline import open_pipeline

    calls: list[Any] = []

    class Recording(_Failing):
        def log(self, step: int, scalars: Mapping[str, float]) -> None:
            calls.append(step)

        def close(self, ok: bool) -> None:
            calls.append(("closed", ok))

    monkeypatch.setitem(_trackers.OPENERS, "tensorboard", Recording)
    config = tiny(
        run_dir=str(tmp_path / "run"), train={"steps": 20}, report={"report_to": ["tensorboard"]}
    )
    runs: list[Any] = []
    async with open_actor_system() as system:
        async with open_pipeline(system, config, on_step=lambda r: runs[0].stop()) as run:
            runs.append(run)
            result = await run.wait()
        assert result.stopped and calls[-1] == ("closed", True)
        assert calls[:-1] == [r.step for r in result.records]


def test_wandb_online_without_credentials_warns_instead_of_prompting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("wandb", reason="the wandb extra")
    import wandb

    wandb.teardown()  # a fresh W&B session reads the environment below
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    settings = ReportSettings(report_to=["wandb"])
    with caplog.at_level(logging.WARNING, logger="asyncflow_actors.pipeline"):
        thread = TrackerThread(["wandb"], settings, str(tmp_path), CONFIG)
        thread.log(1, step_scalars(record(1)))
        thread.close(True)
    assert thread.failures == {"wandb": 1}
    assert "report_to wandb could not start (RuntimeError: not logged in" in caplog.text
    wandb.teardown()
