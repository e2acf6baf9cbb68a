"""Per-step metrics of a run: one ``StepRecord`` per global batch, written as JSONL, shown as a
progress display (rich on a terminal, plain lines otherwise), drawn as a PNG at the end."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TextIO

import attrs

from ..roles._messages import RoleStatistics


def _floats(value: Mapping[str, float]) -> dict[str, float]:
    return dict(value)


def _ints(value: Mapping[str, int]) -> dict[str, int]:
    return dict(value)


@attrs.frozen
class StepRecord:
    """What one global batch did.

    ``seconds``: wall time since the run started; ``step_seconds``: since the previous step.
    ``samples_per_s``/``tokens_per_s``: trained samples (tokens) per second over the step.
    ``staleness``: trained samples by version lag (index = lag); ``offpolicy_samples``: those
    with a lag > 0. ``idle``: per role, the share of the step's wall time its workers were not
    computing (1 - busy). ``queues``: per consumer, samples ready for it in the TQ.
    ``sync``: the weight sync's phase seconds and bytes. ``metrics``: the loss's figures
    (``pg_loss``, ``clip_frac``, ``approx_kl``, ``mismatch_kl_k1``, ``ess``...), ``reward_mean``,
    ``accuracy``, ``response_length``, ``partial_rollout_ratio``.
    """

    step: int
    version: int
    seconds: float
    step_seconds: float
    samples: int
    samples_per_s: float
    tokens_per_s: float
    reward_mean: float
    staleness: tuple[int, ...]
    offpolicy_samples: int
    in_flight_slots: int
    reinjected: int
    metrics: Mapping[str, float] = attrs.field(factory=dict, converter=_floats)
    sync: Mapping[str, float] = attrs.field(factory=dict, converter=_floats)
    idle: Mapping[str, float] = attrs.field(factory=dict, converter=_floats)
    queues: Mapping[str, int] = attrs.field(factory=dict, converter=_ints)

    def to_json(self) -> dict[str, Any]:
        out = attrs.asdict(self)
        out["staleness"] = list(self.staleness)
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> StepRecord:
        data = dict(raw)
        data["staleness"] = tuple(data["staleness"])
        return cls(**data)


def read_steps(path: str | os.PathLike[str]) -> list[StepRecord]:
    """The records of a run's ``steps.jsonl``."""
    with open(path, encoding="utf-8") as f:
        return [StepRecord.from_json(json.loads(line)) for line in f if line.strip()]


def idle_ratios(
    before: Sequence[RoleStatistics], after: Sequence[RoleStatistics], wall: float
) -> dict[str, float]:
    """Per role: 1 - (busy seconds added over ``wall``), averaged over its workers."""
    if wall <= 0:
        return {}
    old = {s.worker: s.busy_s for s in before}
    shares: dict[str, list[float]] = {}
    for stats in after:
        busy = stats.busy_s - old.get(stats.worker, 0.0)
        shares.setdefault(stats.role, []).append(min(1.0, max(0.0, busy / wall)))
    return {role: round(1.0 - sum(v) / len(v), 4) for role, v in shares.items()}


class Progress:
    """Shows each step: a rich progress bar on a terminal (``mode="rich"``, or ``"auto"`` on a
    TTY with ``rich`` installed), else one plain line per step (``"plain"``), or nothing."""

    def __init__(
        self, mode: str, total: int, stream: TextIO | None = None, *, start: int = 0
    ) -> None:
        """``total``: the run's last step; ``start``: the step it starts after (a resume)."""
        self.stream = stream or sys.stdout
        self.total = total
        self._rich: Any = None
        if mode == "auto":
            mode = "rich" if self.stream.isatty() and _has_rich() else "plain"
        self.mode = mode
        if mode == "rich":
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self._rich = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.description}"),
                console=Console(file=self.stream),
            )
            self._task = self._rich.add_task("", total=total, completed=start)
            self._rich.start()

    def update(self, record: StepRecord) -> None:
        text = describe(record)
        if self.mode == "plain":
            print(f"step {record.step}/{self.total} {text}", file=self.stream, flush=True)
        elif self._rich is not None:
            self._rich.update(self._task, completed=record.step, description=text)

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()
            self._rich = None


HF_BARS = "HF_HUB_DISABLE_PROGRESS_BARS"


@contextmanager
def third_party_bars_off() -> Iterator[None]:
    """Hugging Face's download and loading bars off while a run's display is live (they would
    interleave with its lines): in this process, and in the node processes started meanwhile
    (they inherit ``HF_HUB_DISABLE_PROGRESS_BARS``). Restored afterwards."""
    saved = os.environ.get(HF_BARS)
    os.environ[HF_BARS] = "1"
    # already imported (a preflight loads a model's config): switch theirs off too
    hub: Any = sys.modules.get("huggingface_hub.utils")
    hub_on = hub is not None and not hub.are_progress_bars_disabled()
    if hub_on:
        hub.disable_progress_bars()
    hf: Any = sys.modules.get("transformers.utils.logging")
    hf_on = hf is not None and hf.is_progress_bar_enabled()
    if hf_on:
        hf.disable_progress_bar()
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(HF_BARS, None)
        else:
            os.environ[HF_BARS] = saved
        if hub_on:
            hub.enable_progress_bars()
        if hf_on:
            hf.enable_progress_bar()


def _has_rich() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def describe(record: StepRecord) -> str:
    """One line: reward, loss, throughput, staleness, sync, idle."""
    m = record.metrics
    idle = " ".join(f"{role} {share:.0%}" for role, share in sorted(record.idle.items()))
    return (
        f"v{record.version} reward {record.reward_mean:.3f} acc {m.get('accuracy', 0.0):.2f} "
        f"loss {m.get('loss', 0.0):+.4f} | {record.samples_per_s:.1f} samples/s "
        f"{record.tokens_per_s:.0f} tok/s | staleness {list(record.staleness)} "
        f"| sync {record.sync.get('sync_total', 0.0) * 1e3:.0f} ms"
        + (f" | idle {idle}" if idle else "")
    )


def plot_run(records: Sequence[StepRecord], path: str | os.PathLike[str], title: str) -> bool:
    """Reward and throughput over time as a PNG (needs Pillow); False if it is not installed."""
    try:
        from PIL import Image, ImageDraw
    except ImportError:
        return False
    if not records:
        return False
    width, height, margin = 900, 620, 60
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    draw.text((margin, 12), title, fill="black")
    xs = [r.seconds for r in records]
    panels = [
        ("mean batch reward", [r.reward_mean for r in records], (31, 119, 180)),
        ("trained samples/s", [r.samples_per_s for r in records], (214, 39, 40)),
    ]
    panel_h = (height - 2 * margin) // 2
    for k, (label, ys, color) in enumerate(panels):
        top = margin + k * panel_h + 10
        box = (margin, top, width - margin // 2, top + panel_h - 40)
        _panel(draw, box, xs, ys, color, label)
    draw.text((width // 2 - 40, height - 25), "wall time (s)", fill="black")
    image.save(os.fspath(path))
    return True


def _panel(
    draw: Any,
    box: tuple[int, int, int, int],
    xs: Sequence[float],
    ys: Sequence[float],
    color: tuple[int, int, int],
    label: str,
) -> None:
    left, top, right, bottom = box
    draw.rectangle(box, outline="black")
    draw.text((left + 6, top + 4), label, fill=color)
    x0, x1 = min(0.0, min(xs)), max(xs) or 1.0
    y0, y1 = min(ys), max(ys)
    if y1 - y0 < 1e-9:
        y0, y1 = y0 - 0.5, y1 + 0.5
    pad = (y1 - y0) * 0.08
    y0, y1 = y0 - pad, y1 + pad

    def at(x: float, y: float) -> tuple[float, float]:
        return (
            left + (x - x0) / (x1 - x0 or 1.0) * (right - left),
            bottom - (y - y0) / (y1 - y0) * (bottom - top),
        )

    for frac in (0.0, 0.5, 1.0):
        y = y0 + frac * (y1 - y0)
        _, py = at(x0, y)
        draw.line((left - 4, py, left, py), fill="black")
        draw.text((4, py - 6), f"{y:.3g}", fill="black")
        x = x0 + frac * (x1 - x0)
        px, _ = at(x, y0)
        draw.line((px, bottom, px, bottom + 4), fill="black")
        draw.text((px - 10, bottom + 6), f"{x:.0f}", fill="black")
    points = [at(x, y) for x, y in zip(xs, ys, strict=True)]
    if len(points) > 1:
        draw.line(points, fill=color, width=2)
    for px, py in points:
        draw.ellipse((px - 2, py - 2, px + 2, py + 2), fill=color)
