"""``[report]``: where a run's figures go besides ``steps.jsonl`` (trackers, sample completions,
the plot's cadence). TRL's names where the concept is the same (``report_to``, ``run_name``).

Part of ``RunSpec`` because the Trainer picks the sample completions it reports; the rest is
read by the pipeline only.
"""

from __future__ import annotations

from typing import Any

import attrs

TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")
"""The experiment trackers ``report_to`` may name."""


class ReportSettingsError(ValueError):
    """A ``[report]`` value out of range; the message names the key."""


def _trackers(value: Any) -> tuple[str, ...]:
    """One name or a list; ``"none"`` (as TRL spells it) is no tracker."""
    names = (value,) if isinstance(value, str) else tuple(value)
    return tuple(n for n in names if n != "none")


def _known(inst: object, attribute: attrs.Attribute[Any], value: tuple[str, ...]) -> None:
    for name in value:
        if name not in TRACKERS:
            raise ReportSettingsError(
                f"{attribute.name}: expected names from {list(TRACKERS)}, got {name!r}"
            )
    if len(set(value)) != len(value):
        raise ReportSettingsError(f"{attribute.name}: a tracker is named twice: {list(value)}")


def _count(minimum: int) -> Any:
    def check(inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ReportSettingsError(
                f"{attribute.name}: expected an int >= {minimum}, got {value!r}"
            )

    return check


@attrs.frozen
class ReportSettings:
    """A run's reporting (``docs/pipeline.md`` §Reporting).

    ``report_to``: experiment trackers that receive every step's scalars (the numbers of
    ``steps.jsonl``, the step as x) and the run's configuration: ``"tensorboard"``
    (``run_dir/tensorboard``), ``"wandb"``, ``"mlflow"``, ``"trackio"``; each is an optional
    extra of its own name. ``project``: the W&B / trackio project and the MLflow experiment;
    ``run_name``: the run's name in them (default: ``run_dir``'s last part).
    ``log_completions_every``: every so many steps (0: never) the Trainer reports
    ``log_completions_n`` of the step's samples (prompt, completion, rewards, version) to
    ``run_dir/completions.jsonl``, the progress display and the dashboard.
    ``plot_every``: redraw ``run_dir/curves.png`` every so many steps (0: at the end only).
    """

    report_to: tuple[str, ...] = attrs.field(default=(), converter=_trackers, validator=_known)
    project: str = "asyncflow"
    run_name: str | None = None
    log_completions_every: int = attrs.field(default=10, validator=_count(0))
    log_completions_n: int = attrs.field(default=2, validator=_count(1))
    plot_every: int = attrs.field(default=25, validator=_count(0))
