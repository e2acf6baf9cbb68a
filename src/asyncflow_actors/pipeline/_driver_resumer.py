"""Automatic resume of the Driver: a Driver that raises is started again in its own cell.

With ``train.auto_resume`` (and ``auto_resume_retries`` > 0) the Driver runs under a supervisor
of its own (``driver-sup.<run>``, ``OneForOne``, at most ``auto_resume_retries`` restarts a run)
as a ``TRANSIENT`` child: a Driver that raises is restarted in the same actor cell, so the refs
the Trainer, the rollouts and the pipeline hold reach the new incarnation, which takes over
the state of the one that raised (``roles._driver_rebuild``: nothing in the queue generated
again, the admissions cut short put again, the step under way handled once). Each resume logs
one line (``driver died (<cause>); resuming from its state at version V (...), attempt 2/4``)
and joins ``PipelineResult.resumes`` (``role = "driver"``). One more death fails the
supervisor and the run (``RunFailed`` naming the Driver's error). The driver process's own
death ends the run (the TransferQueue lives there): ``--resume`` covers that.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..actors import (
    ActorRef,
    ChildSpec,
    OneForOne,
    Restart,
    WhichChildren,
    root_error,
)
from ._placement import Placement
from ._resume import Resume

if TYPE_CHECKING:  # the Driver's module imports torch: the run loads it in a thread first
    from ..roles import Driver, DriverHooks

log = logging.getLogger("asyncflow_actors.pipeline")


class DriverResumer:
    """The Driver's factory (``build``: the first Driver, then each resumed one) and its
    resumes. ``make(previous)`` builds a Driver (``previous``: the incarnation to take over)."""

    def __init__(
        self, make: Callable[[Driver | None], Driver], hooks: DriverHooks, retries: int
    ) -> None:
        self.make = make
        self.hooks = hooks
        self.retries = retries
        self.resumes: list[Resume] = []
        self.ref: ActorRef[Any] | None = None
        self._current: Driver | None = None
        hooks.driver_resumes_left = retries

    def build(self) -> Driver:
        previous = self._current
        if previous is not None:
            self._record(previous)
        self._current = self.make(previous)
        return self._current

    def _record(self, previous: Driver) -> None:
        """Log and count the resume of ``previous`` (called by the supervisor's restart)."""
        self.hooks.driver_resumes_left -= 1
        cell = getattr(self.ref, "cell", None)
        error = cell.last_error if cell is not None else None
        root = root_error(error) if error is not None else None
        cause = "stopped" if root is None else f"{type(root).__name__}: {root}"
        attempt = len(self.resumes) + 2
        admitting = len(previous.admitting)
        log.warning(
            "driver died (%s); resuming from its state at version %d (%d group(s) in flight "
            "kept, %d admission(s) cut short put again), attempt %d/%d",
            cause, previous.version, len(previous.inflight), admitting, attempt,
            self.retries + 1,
        )  # fmt: skip
        self.resumes.append(
            Resume(
                attempt, cause, previous.saved[0], previous.version, lost_steps=0,
                lost_prompts=0, skipped=0, role="driver",
            )
        )  # fmt: skip


async def spawn_driver(
    place: Placement, make: Callable[[Driver | None], Driver], hooks: DriverHooks
) -> tuple[ActorRef[Any], ActorRef[Any], DriverResumer | None]:
    """Start the run's Driver: (its ref, the ref to stop at the run's end, its resumer).
    Without ``train.auto_resume`` (or with no retries) it is ``TEMPORARY``: its death fails
    the run."""
    train = place.config.train
    name = f"driver.{place.suffix}"
    if not (train.auto_resume and train.auto_resume_retries > 0):
        ref = await place.system.spawn(lambda: make(None), name=name, restart=Restart.TEMPORARY)
        return ref, ref, None
    resumer = DriverResumer(make, hooks, train.auto_resume_retries)
    child = ChildSpec(resumer.build, name, restart=Restart.TRANSIENT)
    # restarts counted over the whole run, as the Trainer's resumes are
    strategy = OneForOne(max_restarts=train.auto_resume_retries, within=math.inf)
    supervisor = await place.system.start_child(
        ChildSpec.supervisor(
            f"driver-sup.{place.suffix}", [child], strategy, restart=Restart.TEMPORARY
        )
    )
    (info,) = await supervisor.ask(WhichChildren())
    resumer.ref = info.ref
    return info.ref, supervisor, resumer
