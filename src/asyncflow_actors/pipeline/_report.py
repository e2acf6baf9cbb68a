"""Per-step metrics of a run: one ``StepRecord`` per global batch, written as JSONL, shown as a
progress display (rich on a terminal, plain lines otherwise), drawn as a PNG at the end
(``_plot.plot_run``)."""

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

    def completions(self, samples: Sequence[Any]) -> None:
        """A few sample completions (``SampleCompletion``), one short line each."""
        lines = [describe_completion(c) for c in samples]
        if self.mode == "plain":
            for line in lines:
                print(line, file=self.stream, flush=True)
        elif self._rich is not None:
            for line in lines:  # printed above the live bar
                self._rich.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def note(self, text: str) -> None:
        """A line about the run outside its steps (the warm-up), in either display."""
        if self.mode == "plain":
            print(text, file=self.stream, flush=True)
        elif self._rich is not None:
            self._rich.console.print(text, markup=False, highlight=False)

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


def _short(text: str, width: int, *, tail: bool = False) -> str:
    """``text`` on one line (newlines shown as ``⏎``), cut to ``width`` characters (its end
    kept with ``tail``: a templated prompt ends with the question)."""
    flat = text.replace("\r", "").replace("\n", "⏎")
    if len(flat) <= width:
        return flat
    return "…" + flat[1 - width :] if tail else flat[: width - 1] + "…"


def describe_completion(sample: Any, width: int = 60) -> str:
    """One line of a ``SampleCompletion``: version, rewards, prompt and completion, cut."""
    parts = " ".join(f"{k} {v:.2f}" for k, v in sample.rewards.items())
    rewards = f"reward {sample.reward:.2f}" + (f" ({parts})" if parts else "")
    return (
        f"  sample v{sample.version} {rewards} | {_short(sample.prompt, width, tail=True)} "
        f"→ {_short(sample.completion, width)}"
    )


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
