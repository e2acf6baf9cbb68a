"""A Driver that raised, resumed in place (``train.auto_resume``; docs/pipeline.md).

The Driver lives in the driver process, beside the TransferQueue; when one of its messages or
tasks raises, that process and everything the Driver knows live on. Its supervisor (the
pipeline's ``_driver_resumer``) starts a new incarnation in the same actor cell, so every ref
to the Driver (the Trainer's, the rollouts', the pipeline's) reaches the new one, and the new
one takes over the state of the old (``adopt``) rather than a checkpoint's: a checkpoint is
older than the truth (the Trainer, alive, has trained since), while the Driver's bookkeeping
changes between awaits only, together, so it is whole whatever raised. What the raise cut
short is settled here (``start_resumed``):

- **prompts being admitted** (``admitting``): their groups were not opened, or opened but their
  prompt not put (a cancelled put stores nothing): they are put again, keeping their slots and
  their attempt (never re-generated: nothing of theirs was generated);
- **the queue's events** are read again from the last batch handled in full (handling one is
  idempotent: a group injected again leaves ``inflight``);
- **the step under way**: the Trainer asks its ``StepTrained`` and ``StepDone`` again (they
  failed with ``ActorCrashed``); the Driver handles a step asked again without releasing its
  slots or reporting its record twice (``released``, ``reported``), and syncs its weights and
  writes its checkpoint again;
- **the rollouts' reports** (``GroupGone``, ``GroupDropped``, ``NeedWeights``) are asked, not
  told (``_ask_again.tell_driver``): one queued when the Driver raised fails and is asked again
  of the new incarnation; a ``GroupGone`` is answered at once and its prompt moved into
  ``admitting`` before the handling task's first await;
- **the weights**: the resumed Driver has the Trainer send the weights it holds once (a
  restarted rollout's ``NeedWeights`` may have been in the dead incarnation's hands).

Nothing in the queue is generated again, no prompt admitted is left behind, and the ledger
(the same writer, flushed by the old incarnation) records each sample once.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import trio

if TYPE_CHECKING:
    from ..actors import ActorContext
    from ._driver import Driver

log = logging.getLogger("asyncflow_actors.roles")

# set by each incarnation itself: never taken over
_OWN = frozenset({"resumed"})


def adopt(driver: Driver, previous: Driver) -> None:
    """Take over ``previous``'s state (an incarnation that raised; possibly one that raised
    while it started, holding what it took over itself)."""
    for name, value in vars(previous).items():
        if name not in _OWN:
            setattr(driver, name, value)


def readmission(driver: Driver) -> list[tuple[int, int | None]]:
    """The prompts a raise left being admitted: (prompt index, its open group or ``None``)."""
    group_of = {index: gid for gid, index in driver.inflight.items()}
    return [(index, group_of.get(index)) for index in sorted(driver.admitting)]


async def start_resumed(driver: Driver, ctx: ActorContext[Any]) -> None:
    """``on_start`` of a resumed Driver: its tasks again, the admissions cut short first."""
    await trio.lowlevel.checkpoint()
    driver.hooks.flow = driver.flow
    driver.hooks.waiting = None
    ctx.start_soon(driver.tasks.serve, driver.hooks)
    ctx.start_soon(driver.ledger.serve)
    ctx.start_soon(_readmit_then_inject, driver, readmission(driver))
    ctx.start_soon(driver._watch_events)
    ctx.start_soon(driver._resend, "the driver")


async def _readmit_then_inject(driver: Driver, prompts: list[tuple[int, int | None]]) -> None:
    """Put again the prompts being admitted when the last incarnation raised (their slots are
    held), then admit new ones as slots free up."""
    for index, group in prompts:
        await driver._put_prompts([index], [group])
    if prompts:
        log.info("resumed driver: %d prompt(s) being admitted put again", len(prompts))
    await driver._inject()
