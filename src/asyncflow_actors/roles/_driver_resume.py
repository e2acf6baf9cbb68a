"""The Driver's side of an automatic resume (``train.auto_resume``; docs/pipeline.md).

A step counts as trained once a checkpoint holds it: the Trainer reports each optimizer step
(``StepTrained``) before it acks the step's leases, and the Driver keeps the step's groups,
prompts and samples in ``UnsavedSteps`` until a checkpoint at that step or later is written.
When the Trainer dies, ``roll_back`` turns the steps no checkpoint holds into lost steps:

- their samples still in the TransferQueue (a Trainer that died between its report and its
  acks) are discarded, and their prompts are injected again (new groups, new samples): their
  optimizer step is gone, so they are trained again, once; the sample ledger takes back their
  ``trained`` records and records those attempts ``not_trained`` ("lost", injected again);
- every other sample in the TransferQueue stays: the Trainer's leases go back to the queue when
  its successor starts (its holder name is stable), and it trains them;
- versions only grow (the queue's window, the receivers' weights, the samples' tags depend on
  it): the restarted Trainer's weights (the checkpoint's) take the newest version anyone holds
  (``label``), and the run's last version moves on by the steps lost, so the final model still
  holds ``train.steps`` optimizer steps.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import attrs

from ..actors import Request
from . import _schema as S
from ._driver_state import DriverState

if TYPE_CHECKING:
    from ._driver import Driver
    from ._messages import StepTrained

log = logging.getLogger("asyncflow_actors.roles")


@attrs.frozen
class ResumePoint:
    """Where a restarted Trainer starts: the weights of checkpoint ``directory`` (``None``: the
    run's start state), written at step ``checkpoint_version``, tagged ``version``. The
    ``lost_steps`` the Trainer reported since are lost, and their ``lost_prompts`` injected
    again; ``skipped`` versions went out that the checkpoint does not hold (so the run now
    ends at ``end_version``, that many versions later)."""

    version: int
    directory: str | None
    checkpoint_version: int
    lost_steps: int
    lost_prompts: tuple[int, ...]
    skipped: int
    end_version: int


@attrs.frozen
class TrainerLost(Request[ResumePoint]):
    """The pipeline to the Driver: the Trainer died; roll back to the newest checkpoint.
    ``floor``: the newest version a weight receiver or the queue holds."""

    floor: int


@attrs.frozen
class _Step:
    prompts: tuple[int, ...]  # prompt index per group trained, in group order
    samples: tuple[int, ...]
    released: bool = False  # its StepDone released its FlowControl slots


@attrs.define
class UnsavedSteps:
    """The steps trained since the newest checkpoint: version -> its groups' prompts and its
    samples. ``saved(v)`` forgets those a checkpoint at ``v`` holds."""

    steps: dict[int, _Step] = attrs.Factory(dict)

    def trained(self, msg: StepTrained, inflight: dict[int, int]) -> None:
        """Retire the step's groups from ``inflight`` and remember their prompts."""
        prompts = tuple(p for p in (inflight.pop(g, None) for g in msg.groups) if p is not None)
        self.steps[msg.version] = _Step(prompts, tuple(msg.samples))

    def adopt(self, version: int, index: int) -> None:
        """Step ``version`` trained prompt ``index`` too (a group of it reported lost)."""
        step = self.steps.get(version)
        if step is not None:
            self.steps[version] = attrs.evolve(step, prompts=(*step.prompts, index))

    def released(self, version: int) -> None:
        """The step's ``StepDone`` came: its slots are free, and its samples acked (the
        Trainer acks before it reports), so only its prompts are kept."""
        step = self.steps.get(version)
        if step is not None:
            self.steps[version] = _Step(step.prompts, (), released=True)

    def unreported(self) -> set[int]:
        """The prompts of the steps trained but not yet reported (no ``StepDone``): out of
        ``inflight``, not trained as far as a checkpoint or the ledger can tell."""
        return {p for step in self.steps.values() if not step.released for p in step.prompts}

    def saved(self, version: int) -> None:
        for v in [v for v in self.steps if v <= version]:
            del self.steps[v]


async def roll_back(driver: Driver, floor: int) -> ResumePoint:
    """The Trainer died: its unsaved steps are lost (see the module docstring). ``floor``: the
    newest version a receiver or the queue holds (a sync of a step the Driver never heard of
    may have reached them). Returns where the next Trainer starts."""
    client = driver.client
    saved_version, directory = driver.saved
    label = max(driver.version, floor, saved_version)
    # The Driver's state changes only once the awaits that may raise are behind: a rollback
    # that raised in the queue (a resumed Driver is asked it again) changed nothing but the
    # discards and the window, which are made again harmlessly.
    lost = driver.unsaved.steps
    samples = [i for step in lost.values() for i in step.samples]
    if samples:  # those the dead Trainer never acked: trained by a lost step, not again
        await client.discard(S.ROLLOUT, samples, missing_ok=True)
    if label > driver.version:  # a sync the Driver never heard of: the window moves too
        await client.set_version(S.ROLLOUT, label)
    # the ledger takes back what the lost steps trained: their attempts end "lost"
    released = [v for v, step in lost.items() if step.released]
    unreported = [p for step in lost.values() if not step.released for p in step.prompts]
    await driver.ledger.lose_steps(released, unreported, directory or None)
    driver.unsaved = UnsavedSteps()
    held = sum(len(step.samples) for step in lost.values() if not step.released)
    if held:  # their StepDone never came to release their slots (as it would have): now
        driver.flow.release(held)
    prompts = tuple(p for v in sorted(lost) for p in lost[v].prompts)
    driver.backlog[:0] = list(prompts)  # first in line (each takes its slots again)
    driver.hooks.reinjected += len(prompts)
    skipped = label - saved_version
    driver.end_version += skipped
    driver.hooks.end_version = driver.end_version
    if label > driver.version:
        driver.version = label
        driver.meter.set_version(label)
    # the checkpoint's weights now carry ``label``: a stop or another resume starts there
    driver.saved = (label, directory)
    log.info(
        "rolled back to the weights of version %d (now version %d): %d step(s) lost, "
        "%d prompt(s) injected again", saved_version, label, len(lost), len(prompts),
    )  # fmt: skip
    return ResumePoint(
        version=label,
        directory=directory or None,
        checkpoint_version=_checkpoint_version(directory, driver.spec.start_version),
        lost_steps=len(lost),
        lost_prompts=prompts,
        skipped=skipped,
        end_version=driver.end_version,
    )


def _checkpoint_version(directory: str, version: int) -> int:
    """The step a checkpoint was written at (its Driver state); ``version`` (the run's first)
    without one."""
    if not directory:
        return version
    try:
        return DriverState.read(directory).version
    except (OSError, ValueError, KeyError):
        return version
