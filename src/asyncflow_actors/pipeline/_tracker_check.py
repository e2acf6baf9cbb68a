"""Whether the trackers of ``report.report_to`` are installed: a check without imports.

Kept apart from ``_trackers`` (which imports the roles' settings, and with them torch) so that
``asyncflow train`` refuses a missing tracker in its first, quick checks, before any process
starts (``preflight.check_paths``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

from ._config import PipelineConfig, PipelineConfigError

MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}
"""The module each tracker needs; the pip extra of the same name installs it."""


def missing_trackers(names: Sequence[str]) -> list[str]:
    """The trackers of ``names`` whose package is not installed (no import: fast)."""
    return [n for n in names if importlib.util.find_spec(MODULES[n]) is None]


def check_trackers(config: PipelineConfig) -> None:
    """``PipelineConfigError`` naming the pip extra of a tracker asked for but not installed
    (or TensorBoard without a ``run_dir`` to write into)."""
    names = config.report.report_to
    missing = missing_trackers(names)
    if missing:
        extras = ",".join(missing)
        raise PipelineConfigError(
            f"report.report_to: {', '.join(map(repr, missing))} not installed: "
            f"pip install 'asyncflow-actors[{extras}]'"
        )
    if "tensorboard" in names and not config.run_dir:
        raise PipelineConfigError(
            "report.report_to: 'tensorboard' writes its events into run_dir/tensorboard: "
            "set run_dir"
        )
