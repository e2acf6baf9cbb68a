"""The soak: a whole pipeline run under a fault campaign, judged from its per-sample ledger.

``run_soak(config, schedule, seconds=)`` starts ``config`` (a real run: one process per role,
storage units in processes, ``run_dir`` set), carries out ``schedule`` for ``seconds``
(``open_fault_campaign``), waits for a step after the last fault, stops the run cleanly and
returns a ``SoakResult``: whether the run finished, the faults and the recovery from each, and
the verdict of the run's ledger (``pipeline.check_samples``): prompts lost, samples trained
twice or outside the staleness bound; and whatever outlived the run (processes, threads,
sockets, ``/dev/shm`` segments). ``benchmarks/soak.py`` (``nox -s soak``) prints it as JSON
lines; with no schedule it measures the same configuration undisturbed, for the baseline.
"""

from __future__ import annotations

import collections
import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import trio

from ._leaks import ResourceLeak, ResourceSnapshot, check_no_leaks, warm_up_zmq
from ._processes import alive
from ._soak import (
    FAULT_KINDS,
    FaultSchedule,
    InjectedFault,
    open_fault_campaign,
    open_link_faults,
)

if TYPE_CHECKING:
    from ..pipeline import PipelineConfig
    from ..pipeline._run import Pipeline

SHM_DIR = "/dev/shm"
SHM_PREFIX = "afa-"  # the TransferQueue's segments (``transfer_queue._shm``)


class LedgerMissing(RuntimeError):
    """The pipeline has no per-sample ledger (``pipeline.read_samples``/``check_samples``)."""


def _ledger() -> tuple[Callable[..., Any], Callable[..., Any]]:
    try:
        from ..pipeline import check_samples, read_samples
    except ImportError as exc:
        raise LedgerMissing(
            "the soak judges a run from its per-sample ledger, and this asyncflow_actors has "
            "none (asyncflow_actors.pipeline.read_samples / check_samples, issue #27 §2)"
        ) from exc
    return read_samples, check_samples


def require_ledger() -> None:
    """Raise ``LedgerMissing`` now (before minutes of running) if the ledger is not there."""
    _ledger()


def _percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``values``; NaN for none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@attrs.frozen
class SoakResult:
    """What a soak (or, with no faults, a steady run) found.

    ``finished``: the run reached its clean stop (``error``: why not, one line).
    ``steps``/``seconds``: steps completed over the seconds from the first step's start to the
    stop. ``faults``: injected, by kind; ``skipped``: planned but not carried out (why).
    ``injected``: one line per fault carried out (when, what, on what); ``recovery_s``: for
    each, the seconds to the next completed step (``inf``: none came).
    ``lost``/``duplicated``/``stale``: the ledger's prompt ids and sample ids (``None``: no
    ledger was read); ``not_trained``: prompts reported not trained, by reason. ``leaks``: what
    outlived the run. ``retrained``: prompts trained in more than one attempt (each sample id
    once, the prompt twice: a group reported lost and trained all the same once did it).
    """

    finished: bool
    error: str | None
    steps: int
    seconds: float
    faults: dict[str, int]
    skipped: tuple[str, ...]
    injected: tuple[str, ...]
    recovery_s: tuple[float, ...]
    lost: tuple[str, ...] | None
    duplicated: tuple[str, ...] | None
    stale: tuple[str, ...] | None
    not_trained: dict[str, int]
    leaks: tuple[str, ...]
    retrained: tuple[str, ...] | None = None

    @property
    def steps_per_min(self) -> float:
        return 60 * self.steps / self.seconds if self.seconds > 0 else 0.0

    @property
    def ok(self) -> bool:
        """Finished, nothing lost, nothing trained twice or stale, nothing leaked, and a step
        came after every fault."""
        return (
            self.finished
            and self.lost == ()
            and self.duplicated == ()
            and self.stale == ()
            and not self.retrained
            and not self.leaks
            and all(math.isfinite(r) for r in self.recovery_s)
        )

    def metrics(self, baseline: SoakResult | None = None) -> list[dict[str, Any]]:
        """The JSON lines of ``benchmarks/soak.py``: ``{"name", "value", "unit"}``, with
        ``baseline`` and ``ratio`` for the steps per minute when ``baseline`` ran."""

        def line(name: str, value: Any, unit: str) -> dict[str, Any]:
            return {"name": name, "value": value, "unit": unit}

        def count(ids: tuple[str, ...] | None) -> int | None:
            return None if ids is None else len(ids)

        recovery = [r for r in self.recovery_s if math.isfinite(r)]
        rate = line("soak_steps_per_min", round(self.steps_per_min, 2), "steps/min")
        if baseline is not None:
            rate["baseline"] = round(baseline.steps_per_min, 2)
            if baseline.steps_per_min > 0:
                rate["ratio"] = round(self.steps_per_min / baseline.steps_per_min, 3)
        out = [
            line("soak_faults_injected", sum(self.faults.values()), "faults"),
            line("soak_samples_lost", count(self.lost), "prompts"),
            line("soak_samples_duplicated", count(self.duplicated), "samples"),
            line("soak_samples_stale", count(self.stale), "samples"),
            line("soak_prompts_retrained", count(self.retrained), "prompts"),
            line("soak_recovery_s_p50", round(_percentile(recovery, 0.5), 3), "s"),
            line("soak_recovery_s_p99", round(_percentile(recovery, 0.99), 3), "s"),
            line("soak_unrecovered", len(self.recovery_s) - len(recovery), "faults"),
            rate,
            line("soak_finished", int(self.finished), "bool"),
            line("soak_leaks", len(self.leaks), "resources"),
        ]
        out += [line(f"soak_faults_{kind}", n, "faults") for kind, n in self.faults.items()]
        out += [
            line(f"soak_not_trained_{why}", n, "prompts") for why, n in self.not_trained.items()
        ]
        return out


def _shm_segments() -> set[str]:
    if not os.path.isdir(SHM_DIR):
        return set()
    return {name for name in os.listdir(SHM_DIR) if name.startswith(SHM_PREFIX)}


async def run_soak(
    config: PipelineConfig,
    schedule: FaultSchedule | None,
    *,
    seconds: float,
    links: bool = True,
    settle: float = 120.0,
    stop_timeout: float = 180.0,
    on_fault: Callable[[str], None] | None = None,
) -> SoakResult:
    """Run ``config`` for ``seconds`` under ``schedule`` (``None``: undisturbed), then stop it
    and judge it (see the module docstring). ``links``: route the driver's links to every
    node through a proxy (``open_link_faults``) so link faults can be planned. ``settle``: how
    long to wait, after the last fault, for a step; ``stop_timeout``: for the clean stop.
    ``on_fault`` gets one line per fault carried out. Needs ``config.run_dir`` (the ledger)."""
    import asyncflow_actors as afa

    from ..pipeline import open_pipeline

    if config.run_dir is None:
        raise ValueError("a soak reads the run's ledger: config.run_dir must be set")
    read_samples, check_samples = _ledger()
    await trio.to_thread.run_sync(warm_up_zmq)
    before = ResourceSnapshot.take()
    shm_before = _shm_segments()
    namespace = ""
    error: str | None = None
    finished = False
    steps, elapsed = 0, 0.0
    faults: dict[str, int] = dict.fromkeys(FAULT_KINDS, 0)
    skipped: tuple[str, ...] = ()
    injected: tuple[str, ...] = ()
    recovery: tuple[float, ...] = ()
    pids: set[int] = set()
    try:
        async with (
            afa.open_actor_system() as system,
            open_link_faults(system, config) as proxies,
            open_pipeline(system, config, overwrite=True) as run,
        ):
            namespace = run.queue.namespace if run.queue is not None else ""
            pids |= await _pids(run)
            if schedule is None:
                await _until_failed(run, seconds)
            else:
                async with open_fault_campaign(
                    system, run, schedule, duration=seconds,
                    links=proxies if links else None,
                ) as campaign:  # fmt: skip
                    await _campaign(run, campaign, on_fault, settle)
                faults = campaign.counts()
                skipped = tuple(f"{f.kind} {f.target}: {why}" for f, why in campaign.skipped)
                recovery = tuple(campaign.recovery_seconds())
                injected = tuple(_describe(item) for item in campaign.injected)
                pids |= campaign.pids
            pids |= await _pids(run)
            stop_at = trio.current_time()
            steps = len(run.records)
            elapsed = stop_at - run.started
            if not run.failed.is_set():
                run.stop()
            with trio.move_on_after(stop_timeout) as waited:
                await run.wait()
            if waited.cancelled_caught:
                error = f"the run did not stop within {stop_timeout:.0f} s of the stop request"
        finished = error is None
    except BaseException as exc:  # the run's own failure: what the soak reports
        if isinstance(exc, (KeyboardInterrupt, trio.Cancelled)):
            raise
        error = _one_line(exc)
    # in this thread: a worker thread would count itself (the system is closed: nothing waits)
    leaks = _leaks(before, shm_before, namespace, pids)
    records = await trio.to_thread.run_sync(_read, read_samples, config.run_dir)
    lost = duplicated = stale = retrained = None
    not_trained: dict[str, int] = {}
    if records is not None:
        check = check_samples(
            records, group_size=config.rollout.group_size, staleness=config.effective_staleness
        )
        lost, duplicated, stale = tuple(check.lost), tuple(check.duplicated), tuple(check.stale)
        retrained = tuple(check.retrained)
        reasons = collections.Counter(
            str(getattr(r, "reason", ""))
            for r in records
            if getattr(r, "kind", "") == "not_trained"
        )
        not_trained = dict(sorted(reasons.items()))
    return SoakResult(
        finished=finished,
        error=error,
        steps=steps,
        seconds=elapsed,
        faults=faults,
        skipped=skipped,
        injected=injected,
        recovery_s=recovery,
        lost=lost,
        duplicated=duplicated,
        stale=stale,
        not_trained=not_trained,
        leaks=leaks,
        retrained=retrained,
    )


async def _pids(run: Pipeline) -> set[int]:
    """The processes of the run's nodes and storage units now."""
    out = {n.pid for n in run.nodes.values() if n.pid is not None}
    if run.queue is not None:
        with trio.move_on_after(5):
            out |= {p for p in (await run.queue.unit_pids()).values() if p is not None}
    return out


async def _until_failed(run: Pipeline, seconds: float) -> None:
    with trio.move_on_after(seconds):
        await run.failed.wait()


async def _campaign(
    run: Pipeline, campaign: Any, on_fault: Callable[[str], None] | None, settle: float
) -> None:
    """Until the campaign is over and a step came after its last fault (or the run failed)."""
    async with trio.open_nursery() as nursery:

        async def failed() -> None:
            await run.failed.wait()
            nursery.cancel_scope.cancel()

        async def report() -> None:
            told = 0
            while True:
                for item in campaign.injected[told:]:
                    if on_fault is not None:
                        on_fault(_describe(item))
                told = len(campaign.injected)
                await trio.sleep(0.5)

        nursery.start_soon(failed)
        nursery.start_soon(report)
        await campaign.wait()
        last = max((i.at + i.fault.seconds for i in campaign.injected), default=0.0)
        with trio.move_on_after(settle):
            while not any(t > last for t in campaign.step_times()):  # noqa: ASYNC110 - records
                await trio.sleep(0.1)
        await trio.sleep(0.6)  # the reporter's last lines
        nursery.cancel_scope.cancel()


def _describe(item: InjectedFault) -> str:
    f = item.fault
    return f"{f.at:7.1f}s {f.kind} {f.target} ({item.detail})"


def _read(read_samples: Callable[[str], Any], run_dir: str) -> Any:
    try:
        return read_samples(run_dir)
    except FileNotFoundError:
        return None


def _leaks(
    before: ResourceSnapshot, shm_before: set[str], namespace: str, pids: set[int]
) -> tuple[str, ...]:
    out: list[str] = []
    try:
        check_no_leaks(before, settle=15.0)
    except ResourceLeak as exc:
        out.append(str(exc))
    out += [f"node process {pid} alive" for pid in sorted(pids) if alive(pid)]
    left = _shm_segments() - shm_before
    if namespace:
        left = {name for name in left if name.startswith(namespace)}
    out += [f"/dev/shm/{name}" for name in sorted(left)]
    return tuple(out)


def _one_line(exc: BaseException) -> str:
    from ..actors import root_error

    group = getattr(exc, "exceptions", None)  # a BaseExceptionGroup (3.10: a backport)
    if isinstance(group, tuple) and group:
        return "; ".join(_one_line(e) for e in group)
    root = root_error(exc)
    return f"{type(root).__name__}: {root}".splitlines()[0][:400]
