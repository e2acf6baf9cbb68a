"""The watchdog: a run that makes no step progress says who waits on what, then fails.

It runs in the driver process beside the run. When no step has completed for
``watchdog.warn_s`` seconds it gathers a ``Diagnosis`` and logs it (and appends it to
``run_dir/watchdog.log``); after ``watchdog.fail_s`` it gathers one again and fails the run
with ``RunStalled``, instead of hanging. Before the first step both limits grow by
``first_step_s`` (the first step also waits for the first generations, compilations, caches).

A diagnosis reuses what the run reports already, each source asked under a timeout (a stalled
actor may not answer; it is then named as such and never holds the watchdog up):

- the TransferQueue controller's statistics: per holder, the leases it holds (by consumer), its
  claims waiting, the samples it allocated and did not commit, the groups it opened that are
  not complete; per consumer, the samples ready for it;
- the Driver's FlowControl slots and what its step handling waits on (read in this process);
- every role's ``GetRoleStats`` ``waits``: its claim, the trainer's weight sync (phase and the
  receivers that have not answered), a receiver paused by a sync (its engines hold), weights
  waiting to load.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import attrs
import trio

from ..roles._settings import SettingsError, _non_negative, _positive

if TYPE_CHECKING:  # the configuration loads without the actor runtime and the queue
    from ..actors import ActorRef
    from ..transfer_queue import FlowControlStatistics, HolderStatistics

log = logging.getLogger("asyncflow_actors.pipeline")

LOG_FILE = "watchdog.log"  # in run_dir: every diagnosis, in full
ANSWER_S = 5.0  # each source of a diagnosis answers within this (at most half of warn_s)


@attrs.frozen
class WatchdogConfig:
    """``[watchdog]``: ``enabled``; ``warn_s``: seconds without a completed step before the
    diagnosis is logged; ``fail_s``: ... before the run fails with ``RunStalled``;
    ``first_step_s``: added to both until the first step completed (``docs/pipeline.md``,
    Watchdog, says why the defaults are what they are)."""

    enabled: bool = True
    warn_s: float = attrs.field(default=600.0, validator=_positive)
    fail_s: float = attrs.field(default=1800.0, validator=_positive)
    first_step_s: float = attrs.field(default=1800.0, validator=_non_negative)

    def __attrs_post_init__(self) -> None:
        if not self.fail_s > self.warn_s:
            raise SettingsError(
                f"fail_s: expected more than warn_s = {self.warn_s}, got {self.fail_s!r}"
            )

    @property
    def answer_s(self) -> float:
        """How long each source of a diagnosis may take to answer."""
        return min(ANSWER_S, self.warn_s / 2)


@attrs.frozen
class RoleWaits:
    """One role as a diagnosis saw it: ``answered`` its ``GetRoleStats`` in time or not, its
    policy ``version`` and ``steps``, and what it ``waits`` on (its own words)."""

    worker: str
    answered: bool
    version: int | None = None
    steps: int = 0
    waits: tuple[str, ...] = ()


@attrs.frozen
class Diagnosis:
    """Who waits on what in a run that made no step for ``stalled_s`` seconds after step
    ``step``. ``slots``: the Driver's FlowControl (``None``: not started); ``driver``: what
    the Driver's step handling waits on; ``holders``: the TransferQueue's outstanding items
    per holder (``queue_answered``: the controller answered within ``answer_s``); ``ready``:
    ``(topic, consumer, samples ready for it)``; ``roles``: each role's answer."""

    stalled_s: float
    step: int
    answer_s: float
    slots: FlowControlStatistics | None = None
    driver: str | None = None
    queue_answered: bool = True
    holders: tuple[HolderStatistics, ...] = ()
    ready: tuple[tuple[str, str, int], ...] = ()
    roles: tuple[RoleWaits, ...] = ()

    def headline(self) -> str:
        """The one line that names the stall: the most specific wait found."""
        for role in self.roles:
            for wait in role.waits:
                if wait.startswith("weight sync"):
                    return f"{role.worker}: {wait}"
        for h in self.holders:
            if h.uncommitted:
                what = f"{h.uncommitted} sample(s) of {h.topic!r}"
                return f"{h.holder!r} allocated {what} and did not commit them"
        for h in self.holders:
            if h.leases:
                what = f"{h.leased} sample(s) of {h.topic!r}"
                return f"{h.holder!r} holds {what} unacked (consumer {h.consumer!r})"
        silent = [r.worker for r in self.roles if not r.answered]
        if silent:
            return f"{', '.join(silent)} did not answer within {self.answer_s:.1f} s"
        if not self.queue_answered:
            return f"the TransferQueue did not answer within {self.answer_s:.1f} s"
        return "no role reports a wait"

    def text(self) -> str:
        """The whole diagnosis, readable: the headline, then the Driver, the queue, the roles."""
        return format_diagnosis(self)


def format_diagnosis(d: Diagnosis) -> str:
    """``d`` as text (see ``docs/pipeline.md``, Watchdog, for an example)."""
    lines = [f"no step for {d.stalled_s:.1f} s after step {d.step}: {d.headline()}"]
    driver = "driver:"
    if d.slots is not None:
        s = d.slots
        driver += f" {s.in_flight} of {s.capacity} FlowControl slots in flight"
        if s.waiters:
            driver += f", {s.waiters} admission(s) waiting for {s.waiting_slots} slot(s)"
    if d.driver is not None:
        driver += f"; waits for {d.driver}"
    lines.append("  " + (driver if driver != "driver:" else "driver: not started"))
    if not d.queue_answered:
        lines.append(f"  queue: the controller did not answer within {d.answer_s:.1f} s")
    topics = sorted({h.topic for h in d.holders} | {t for t, _, _ in d.ready})
    for topic in topics:
        lines.append(f"  queue {topic!r}:")
        for h in (h for h in d.holders if h.topic == topic):
            lines.append(f"    {_holder(h)}")
        ready = [f"{n} for {c!r}" for t, c, n in d.ready if t == topic]
        if ready:
            lines.append(f"    ready: {', '.join(ready)}")
    if d.roles:
        lines.append("  roles:")
    for r in d.roles:
        if not r.answered:
            lines.append(f"    {r.worker}: did not answer within {d.answer_s:.1f} s")
            continue
        where = f"{r.worker} (version {r.version}, {r.steps} steps)" if r.version is not None \
            else f"{r.worker} ({r.steps} steps)"  # fmt: skip
        lines.append(f"    {where}: {'; '.join(r.waits) if r.waits else 'no wait reported'}")
    return "\n".join(lines)


def _holder(h: HolderStatistics) -> str:
    parts = []
    if h.leases:
        parts.append(f"holds {h.leases} lease(s) of {h.leased} sample(s) not acked")
    if h.claims:
        parts.append(f"{h.claims} claim(s) waiting for {h.claimed} sample(s)")
    if h.uncommitted:
        parts.append(f"{h.uncommitted} sample(s) allocated, not committed")
    if h.open_groups:
        parts.append(f"{h.open_groups} group(s) opened, not complete")
    if h.puts:
        parts.append(f"{h.puts} put(s) waiting for capacity")
    if h.group_ids:
        more = "..." if h.open_groups > len(h.group_ids) else ""
        parts.append(f"groups {', '.join(map(str, h.group_ids))}{more}")
    who = f"{h.holder} (consumer {h.consumer!r})" if h.consumer else h.holder
    return f"{who}: {'; '.join(parts)}"


class RunStalled(RuntimeError):
    """The run made no step for ``watchdog.fail_s`` seconds. ``diagnosis``: who waited on what
    (a ``Diagnosis``); ``log``: the file that holds it too (``None`` without a run_dir). The
    message's first line names the stall; the rest is the diagnosis."""

    def __init__(self, diagnosis: Diagnosis, log: str | None = None) -> None:
        self.diagnosis = diagnosis
        self.log = log
        super().__init__(f"run stalled: {diagnosis.text()}")

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.diagnosis, self.log))


Gather = Callable[[float], Awaitable[Diagnosis]]


class Watchdog:
    """The clock of one run: ``step()`` on every completed step; ``run`` watches it."""

    def __init__(self, config: WatchdogConfig, log_dir: str | None = None) -> None:
        self.config = config
        self.log = os.path.join(log_dir, LOG_FILE) if log_dir else None
        self.steps = 0
        self.version = 0  # the last step's (or the one resumed from)
        self.last = trio.current_time()
        self._stepped = trio.Event()
        self.warnings = 0

    def step(self, version: int) -> None:
        """Step ``version`` completed: the clock starts again."""
        self.steps += 1
        self.version = version
        self.last = trio.current_time()
        self._stepped.set()
        self._stepped = trio.Event()

    def limits(self) -> tuple[float, float]:
        """(warn, fail) seconds from the last step (or the start) as things stand."""
        extra = self.config.first_step_s if self.steps == 0 else 0.0
        return self.config.warn_s + extra, self.config.fail_s + extra

    async def run(self, gather: Gather, fail: Callable[[RunStalled], None]) -> None:
        """Watch until cancelled: log ``gather``'s diagnosis at ``warn_s``, and at ``fail_s``
        call ``fail`` with ``RunStalled`` (then return)."""
        if not self.config.enabled:
            return
        self.last = trio.current_time()
        warned_at: float | None = None  # the ``last`` a warning was logged for
        while True:
            warn, limit = self.limits()
            idle = trio.current_time() - self.last
            if idle >= limit:
                diagnosis = await gather(idle)
                await self._write("failed", diagnosis)
                fail(RunStalled(diagnosis, self.log))
                return
            if idle >= warn and warned_at != self.last:
                warned_at = self.last
                diagnosis = await gather(idle)
                self.warnings += 1
                log.warning("the run made no step for %.0f s: %s", idle, diagnosis.text())
                await self._write("warning", diagnosis)
                continue
            until = limit if warned_at == self.last else warn
            with trio.move_on_after(max(until - idle, 0.0)):
                await self._stepped.wait()

    async def _write(self, what: str, diagnosis: Diagnosis) -> None:
        if self.log is None:
            return
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        text = f"{stamp} {what}: {diagnosis.text()}\n"
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            try:
                async with await trio.open_file(self.log, "a", encoding="utf-8") as f:
                    await f.write(text)
            except OSError as exc:  # the diagnosis is logged anyway
                log.warning("writing %s failed: %s", self.log, exc)


async def gather_diagnosis(
    stalled_s: float,
    *,
    step: int,
    answer_s: float,
    controller: ActorRef[Any] | None,
    roles: Mapping[str, ActorRef[Any]],
    hooks: Any,
) -> Diagnosis:
    """Ask every source at once, each under ``answer_s``: the TransferQueue controller, every
    role (but the Driver, read from ``hooks`` in this process, and the reward actor, which
    keeps no statistics). Never raises for a source that fails or is silent."""
    from ..roles._messages import GetRoleStats
    from ..transfer_queue._messages import GetControllerStatistics

    answers: dict[str, Any] = {}
    queue: list[Any] = []

    async def ask_role(name: str, ref: ActorRef[Any]) -> None:
        with trio.move_on_after(answer_s):
            try:
                answers[name] = await ref.ask(GetRoleStats())
            except Exception as exc:  # gone or restarting: say so, never fail the diagnosis
                answers[name] = exc

    async def ask_queue() -> None:
        if controller is None:
            return
        with trio.move_on_after(answer_s):
            try:
                queue.append(await controller.ask(GetControllerStatistics()))
            except Exception as exc:
                log.info("watchdog: the TransferQueue controller failed to answer: %r", exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask_queue)
        for name, ref in roles.items():
            if name != "driver" and not name.startswith("reward"):
                nursery.start_soon(ask_role, name, ref)
    reports = []
    for name in roles:
        if name == "driver" or name.startswith("reward"):
            continue
        got = answers.get(name)
        if got is None or isinstance(got, Exception):
            waits = (f"failed to answer: {type(got).__name__}: {got}",) if got is not None else ()
            reports.append(RoleWaits(name, answered=got is not None, waits=waits))
        else:
            reports.append(RoleWaits(name, True, got.version, got.steps, tuple(got.waits)))
    holders: tuple[HolderStatistics, ...] = ()
    ready: list[tuple[str, str, int]] = []
    if queue:
        stats = queue[0]
        holders = tuple(stats.holders)
        for topic in stats.state.topics:
            seen: set[str] = set()
            for view in topic.views:
                if view.consumer not in seen:  # one view per consumer: the first
                    seen.add(view.consumer)
                    ready.append((topic.topic, view.consumer, view.ready))
    flow = getattr(hooks, "flow", None)
    return Diagnosis(
        stalled_s=stalled_s,
        step=step,
        answer_s=answer_s,
        slots=flow.statistics() if flow is not None else None,
        driver=getattr(hooks, "waiting", None),
        queue_answered=bool(queue) or controller is None,
        holders=holders,
        ready=tuple(ready),
        roles=tuple(reports),
    )
