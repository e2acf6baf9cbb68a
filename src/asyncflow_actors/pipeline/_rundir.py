"""A run's directory: which checkpoint a ``--resume`` means, and what a run may find there.

``run_dir`` holds ``config.json``, ``steps.jsonl``, ``curves.png``, ``final/`` (the model at
the end of the run or at a clean stop) and ``checkpoints/step-N/``. ``--resume`` takes a
checkpoint directory or a run directory (its newest checkpoint, ``final`` included).
"""

from __future__ import annotations

import json
import os

from ..roles._settings import CHECKPOINTS, DRIVER_FILE, FINAL
from ._config import PipelineConfigError


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
