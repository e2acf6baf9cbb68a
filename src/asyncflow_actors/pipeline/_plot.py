"""A run's curves as a PNG: matplotlib (headless, the Agg backend), one panel per concern.

Against the step (a run resumed from a checkpoint continues its numbering, so one figure covers
the whole run). Panels, each drawn only when the run has its figures: reward (the batch mean,
its moving average over ``smooth`` steps, one line per reward function when there are several:
``metrics["reward/<name>"]``), accuracy, evaluation (``metrics["eval/..."]``), the policy loss,
KL and the rollout/trainer mismatch, response length, staleness (the mean version lag of the
trained samples) and throughput (trained samples/s). Tick labels in plain numbers (a
power of ten at the axis top for very small or large ranges).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._report import StepRecord

__all__ = ["plot_run"]

Series = tuple[str, Callable[["StepRecord"], float | None]]


def _metric(name: str) -> Callable[[StepRecord], float | None]:
    return lambda r: r.metrics.get(name)


def _mean_lag(record: StepRecord) -> float | None:
    total = sum(record.staleness)
    if not total:
        return None
    return sum(lag * n for lag, n in enumerate(record.staleness)) / total


def _panels(records: Sequence[StepRecord]) -> list[tuple[str, list[Series]]]:
    keys = sorted({k for r in records for k in r.metrics})
    per_function = [k for k in keys if k.startswith("reward/")]
    evals = [k for k in keys if k.startswith("eval/")]
    reward: list[Series] = [("batch mean", lambda r: r.reward_mean)]
    if len(per_function) > 1:
        reward += [(k.removeprefix("reward/"), _metric(k)) for k in per_function]
    panels: list[tuple[str, list[Series]]] = [
        ("reward", reward),
        ("accuracy", [("accuracy", _metric("accuracy"))]),
        ("evaluation", [(k.removeprefix("eval/"), _metric(k)) for k in evals]),
        ("policy loss", [("loss", _metric("loss")), ("pg_loss", _metric("pg_loss"))]),
        (
            "KL",
            [
                ("approx_kl (update)", _metric("approx_kl")),
                ("kl (reference)", _metric("kl")),
                ("mismatch_kl_k1 (rollout vs trainer)", _metric("mismatch_kl_k1")),
            ],
        ),
        ("response length (tokens)", [("mean", _metric("response_length"))]),
        ("staleness (mean version lag)", [("trained samples", _mean_lag)]),
        ("throughput (trained samples/s)", [("samples/s", lambda r: r.samples_per_s)]),
    ]
    out = []
    for title, series in panels:
        kept = [s for s in series if any(_finite(s[1](r)) for r in records)]
        if kept:
            out.append((title, kept))
    return out


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _moving_average(values: Sequence[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_run(
    records: Sequence[StepRecord],
    path: str | os.PathLike[str],
    title: str,
    *,
    smooth: int = 10,
) -> bool:
    """Draw ``records`` to ``path`` (PNG). False when there is nothing to draw or matplotlib is
    not installed (the ``pipeline`` extra)."""
    if not records:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator, ScalarFormatter
    except ImportError:
        return False
    records = sorted(records, key=lambda r: r.step)
    panels = _panels(records)
    columns = 2
    rows = max(1, math.ceil(len(panels) / columns))
    fig, axes = plt.subplots(rows, columns, figsize=(12, 3.2 * rows), squeeze=False)
    try:
        fig.suptitle(title)
        for ax, (name, series) in zip(axes.flat, panels, strict=False):
            _draw(ax, records, name, series, smooth)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            # plain numbers; very small or large ranges as "x 1e-9" once at the axis top
            formatter = ScalarFormatter(useOffset=False, useMathText=True)
            formatter.set_powerlimits((-3, 4))
            ax.yaxis.set_major_formatter(formatter)
        for ax in list(axes.flat)[len(panels) :]:
            ax.set_visible(False)
        for ax in axes[-1]:
            ax.set_xlabel("step")
        fig.tight_layout()
        fig.savefig(os.fspath(path), dpi=100)
    finally:
        plt.close(fig)
    return True


def _draw(
    ax: Any, records: Sequence[StepRecord], name: str, series: list[Series], smooth: int
) -> None:
    ax.set_title(name, fontsize=10)
    ax.grid(alpha=0.3)
    for label, read in series:
        points = [(r.step, v) for r in records if _finite(v := read(r))]
        xs = [x for x, _ in points]
        ys = [float(y) for _, y in points if y is not None]
        (line,) = ax.plot(xs, ys, marker="." if len(xs) < 40 else None, lw=1, label=label)
        if name == "reward" and label == "batch mean" and len(ys) > smooth:
            ax.plot(xs, _moving_average(ys, smooth), color=line.get_color(), lw=2.2,
                    label=f"batch mean, {smooth}-step average")  # fmt: skip
    if len(series) > 1 or name == "reward":
        ax.legend(fontsize=8, loc="best", framealpha=0.8)
