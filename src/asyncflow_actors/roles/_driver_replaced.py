"""Groups reported lost that the Trainer trained all the same (the 30-minute soak's evictions).

A storage unit that dies while the Trainer holds a lease on samples it already fetched makes the
queue report their groups ``lost``; the Trainer still trains them (the data is in its hands) and
its ``StepDone`` names them. When the event reaches the Driver first, the Driver has injected the
prompt again in a new group, keeping its FlowControl slots, and the ``StepDone`` then released
those slots once more: one prompt in flight beyond ``(staleness + 1) x batch`` for the rest of
the run, which the window evicts over and over (about one eviction every two versions per
prompt too many), and the prompt trained twice (``check_samples``: ``retrained``).

So the Driver remembers which group each re-injected prompt replaced (``Replacements``), and when
a step trains a replaced group, ``settle_replaced`` withdraws the prompt's newer attempt: its
group is shrunk to nothing (possible while no member is written; the rollout's put then finds
it gone) and its attempt recorded ``withdrawn``. If it cannot be withdrawn (being admitted,
written already, trained in the same step, gone), the trained group's slots stay with it
instead (``withheld``): the accounting is right either way, and only then is the prompt trained
twice.

That came too late in a 3-minute campaign of unit kills every 10 s (2 of 3 newer attempts were
written before the step's report: a tiny model generates in milliseconds), so a ``lost`` group
is first kept in flight (``LostGroups``) until the Trainer's reports show it was not in the step
it was training: the Trainer holds at most the batch of the step after the Driver's version, so
a group the reports of version ``version + 2`` do not name was not trained, and its prompt is
injected again then (a group the rollout finds gone is injected again at once: never written,
never held). ``settle_replaced`` stays as the net for any other way a replaced group is trained.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import attrs

from ..transfer_queue import TransferQueueError
from . import _schema as S

if TYPE_CHECKING:
    from ._driver import Driver
    from ._messages import StepDone

log = logging.getLogger("asyncflow_actors.roles")


@attrs.define
class Replacements:
    """Group id -> (prompt index, version) of each group whose prompt was injected again."""

    groups: dict[int, tuple[int, int]] = attrs.Factory(dict)

    def replaced(self, gid: int, index: int, version: int) -> None:
        self.groups[gid] = (index, version)

    def trained(self, groups: tuple[int, ...]) -> list[int]:
        """The prompts of the trained ``groups`` that had been replaced (forgotten now)."""
        return [self.groups.pop(g)[0] for g in groups if g in self.groups]

    def forget_before(self, version: int) -> None:
        """Drop the groups replaced before ``version``: older than any lease can hold them."""
        self.groups = {g: iv for g, iv in self.groups.items() if iv[1] >= version}


@attrs.define
class LostGroups:
    """Groups reported ``lost`` and kept in flight: group id -> the version whose report
    decides (the Driver's version when the event came, plus 2)."""

    due: dict[int, int] = attrs.Factory(dict)

    def defer(self, groups: tuple[int, ...], version: int) -> None:
        for g in groups:
            self.due.setdefault(g, version + 2)

    def decided(self, version: int, inflight: dict[int, int]) -> list[int]:
        """The groups still in flight whose deciding report (``version``) did not name them:
        to inject again. Those out of flight (trained, injected again) are forgotten."""
        out = [g for g, v in self.due.items() if g in inflight and v <= version]
        self.due = {g: v for g, v in self.due.items() if g in inflight and v > version}
        return out


async def settle_replaced(driver: Driver, msg: StepDone) -> int:
    """Withdraw the newer attempt of each prompt whose replaced group ``msg`` trained (see the
    module docstring); returns the slots the step must not release (held by the attempts that
    could not be withdrawn)."""
    size = driver.spec.rollout.group_size
    withheld = 0
    for index in driver.replaced.trained(msg.groups):
        newer = [g for g, i in driver.inflight.items() if i == index]
        if newer and await _withdraw(driver, newer[0], size):
            del driver.inflight[newer[0]]
            driver.ledger.not_trained(index, "withdrawn", reinjected=False)
            driver.unsaved.adopt(msg.version, index)  # a lost step injects it again
            log.info("prompt %d: its group reported lost was trained; group %d withdrawn",
                     index, newer[0])  # fmt: skip
        else:
            withheld += size
    # a lease outlives no window: a group replaced this long ago is never trained now
    driver.replaced.forget_before(msg.version - driver.spec.staleness - 2)
    return withheld


async def _withdraw(driver: Driver, gid: int, size: int) -> bool:
    """Shrink group ``gid`` to nothing; False if a member was written (or it is gone)."""
    try:
        await driver.client.shrink_group(S.ROLLOUT, gid, size)
    except TransferQueueError as exc:
        log.info("group %d not withdrawn: %r", gid, exc)
        return False
    return True
