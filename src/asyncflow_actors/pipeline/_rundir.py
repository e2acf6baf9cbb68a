"""A run's directory: which checkpoint a ``--resume`` means, and what a run may find there.

``run_dir`` holds ``config.json``, ``steps.jsonl``, ``samples.jsonl`` (the sample ledger),
``curves.png``, ``final/`` (the model at the end of the run or at a clean stop) and
``checkpoints/step-N/`` (and an observer's ``metrics.jsonl``, ``trace.json``,
``observe.json``). ``--resume`` takes a checkpoint directory or a run directory (its newest
checkpoint, ``final`` included). A new run refuses a directory that holds a run's files unless
it overwrites them; a resumed run drops the step records of the interrupted run after its
checkpoint and continues the numbering.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import attrs

from ..roles._settings import CHECKPOINTS, DRIVER_FILE, FINAL, ModelSettings
from ._config import PipelineConfig, PipelineConfigError

STEPS = "steps.jsonl"
RUN_FILES = (
    "config.json", STEPS, "samples.jsonl", "curves.png", FINAL, FINAL + ".partial",
    FINAL + ".old", CHECKPOINTS, "metrics.jsonl", "trace.json", "observe.json",
)  # fmt: skip
"""What a run writes in its ``run_dir`` (``--overwrite`` removes these, and only these)."""


def checkpoint_version(directory: str) -> int | None:
    """The version a checkpoint directory holds (``None``: not a checkpoint)."""
    try:
        with open(os.path.join(directory, DRIVER_FILE), encoding="utf-8") as f:
            return int(json.load(f)["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def latest_checkpoint(run_dir: str) -> str | None:
    """The newest checkpoint of a run directory (``final`` wins a tie), or ``None``."""
    found: list[tuple[int, int, str]] = []
    final = os.path.join(run_dir, FINAL)
    version = checkpoint_version(final)
    if version is not None:
        found.append((version, 1, final))
    root = os.path.join(run_dir, CHECKPOINTS)
    names = os.listdir(root) if os.path.isdir(root) else []
    for name in names:
        path = os.path.join(root, name)
        version = checkpoint_version(path)
        if name.startswith("step-") and version is not None:
            found.append((version, 0, path))
    return max(found)[2] if found else None


def resolve_resume(path: str) -> str:
    """The checkpoint directory ``--resume path`` means: ``path`` itself if it is one, else
    the newest checkpoint of the run directory ``path``; ``PipelineConfigError`` if none."""
    if not os.path.isdir(path):
        raise PipelineConfigError(f"--resume: no such directory: {path}")
    if checkpoint_version(path) is not None:
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise PipelineConfigError(
            f"--resume: {path} holds no checkpoint (no {DRIVER_FILE}, no {FINAL}/ or "
            f"{CHECKPOINTS}/step-N/ inside)"
        )
    return latest


def run_files(run_dir: str) -> list[str]:
    """The run files ``run_dir`` holds already."""
    return [name for name in RUN_FILES if os.path.lexists(os.path.join(run_dir, name))]


def check_run_dir(config: PipelineConfig, *, resume: str | None, overwrite: bool) -> None:
    """A new run (no ``resume``, no ``overwrite``) refuses a ``run_dir`` holding a run."""
    run_dir = config.run_dir
    if not run_dir or resume is not None or overwrite:
        return
    found = run_files(run_dir)
    if found:
        raise PipelineConfigError(
            f"run_dir: {run_dir} holds a run already ({', '.join(found)}): --resume {run_dir} "
            "continues it, --overwrite replaces it; or choose another run_dir"
        )


def clear_run_dir(run_dir: str) -> None:
    """Remove the files of an earlier run (``RUN_FILES``) from ``run_dir``; nothing else."""
    for name in run_files(run_dir):
        path = os.path.join(run_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


def check_model(config: PipelineConfig, checkpoint: str) -> None:
    """A resume's ``[model]`` is the checkpoint's (but for ``device``); the differing keys."""
    with open(os.path.join(checkpoint, DRIVER_FILE), encoding="utf-8") as f:
        saved: dict[str, Any] = json.load(f).get("model") or {}
    if not saved:
        return  # written before checkpoints recorded it
    # as JSON holds them (tuples read back as lists), so that equal settings compare equal
    here = json.loads(json.dumps(attrs.asdict(config.model)))
    defaults = json.loads(json.dumps(attrs.asdict(ModelSettings())))
    keys = sorted(k for k in here if k != "device" and saved.get(k, defaults[k]) != here[k])
    if keys:
        diffs = "; ".join(f"{k} = {here[k]!r} here, {saved.get(k)!r} there" for k in keys)
        raise PipelineConfigError(
            f"model: differs from the checkpoint's ({checkpoint}): {diffs} "
            "(a resume trains the checkpoint's model: give its [model] section)"
        )


def trim_steps(run_dir: str, version: int) -> list[dict[str, Any]]:
    """Keep the records of ``run_dir/steps.jsonl`` up to ``version`` (a resume from a
    checkpoint of that version: the interrupted run's later steps are replaced by the
    resumed ones); the records kept."""
    path = os.path.join(run_dir, STEPS)
    try:
        with open(path, encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []
    kept = [r for r in records if int(r.get("version", 0)) <= version]
    if len(kept) != len(records):
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        os.replace(path + ".tmp", path)
    return kept
