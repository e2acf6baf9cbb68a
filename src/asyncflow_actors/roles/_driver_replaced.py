"""Groups reported lost that the Trainer trained all the same (the 30-minute soak's evictions).

A storage unit that dies while the Trainer holds a lease on samples it already fetched makes the
queue report their groups ``lost``; the Trainer still trains them (the data is in its hands) and
its ``StepDone`` names them. When the event reaches the Driver first, the Driver has injected the
prompt again in a new group, keeping its FlowControl slots, and the ``StepDone`` then released
those slots once more: one prompt in flight beyond ``(staleness + 1) x batch`` for the rest of
the run, which the window evicts over and over (about one eviction every two versions per
prompt too many), and the prompt trained twice (``check_samples``: ``retrained``).

So the Driver remembers which group each re-injected prompt replaced (``Replacements``). A step
that trains a replaced group keeps its slots back (``withheld``: the newer attempt holds them),
and ``withdraw_newer`` then withdraws that attempt: its group is shrunk to nothing (possible
while no member is written; the rollout's put then finds it gone), its attempt recorded
``withdrawn`` and the slots released. One that cannot be withdrawn (being admitted, written
already, trained in the same step, gone) keeps them: the accounting is right either way, and
only then is the prompt trained twice.

That came too late in a 3-minute campaign of unit kills every 10 s (2 of 3 newer attempts were
written before the step's report: a tiny model generates in milliseconds), so a ``lost`` group
is first kept in flight (``LostGroups``) until the Trainer's reports show it was not in the step
it was training: the Trainer holds at most the batch of the step after the Driver's version, so
a group the reports of version ``version + 2`` do not name was not trained, and its prompt is
injected again then (a group the rollout finds gone is injected again at once: never written,
never held). ``withdraw_newer`` stays as the net for any other way a replaced group is trained.
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
        to inject again (kept until they are out of flight: a Driver that raises before
        injecting them leaves them to its successor). Those out of flight (trained, injected
        again) are forgotten."""
        self.due = {g: v for g, v in self.due.items() if g in inflight}
        return [g for g, v in self.due.items() if v <= version]


def replaced_trained(driver: Driver, msg: StepDone) -> list[tuple[int, int | None]]:
    """The prompts whose replaced group ``msg`` trained, each with its newer attempt's group in
    flight (``None``: none yet, being admitted). No await: the step's slots are released with
    those of these attempts kept back (``withheld``), in the same breath as the ledger records
    the step (a resumed Driver must see both or neither)."""
    group_of = {i: g for g, i in driver.inflight.items()}
    out = [(index, group_of.get(index)) for index in driver.replaced.trained(msg.groups)]
    # a lease outlives no window: a group replaced this long ago is never trained now
    driver.replaced.forget_before(msg.version - driver.spec.staleness - 2)
    return out


def withheld(driver: Driver, replaced: list[tuple[int, int | None]]) -> int:
    """The slots a step keeps back for the newer attempts of its ``replaced`` prompts."""
    return driver.spec.rollout.group_size * len(replaced)


async def withdraw_newer(
    driver: Driver, replaced: list[tuple[int, int | None]], version: int
) -> None:
    """Withdraw the newer attempt of each prompt of ``replaced`` (trained by step ``version``),
    releasing the slots kept back for it; one whose group has a member written already (or
    none yet) keeps them, and is trained too (see the module docstring)."""
    size = driver.spec.rollout.group_size
    for index, gid in replaced:
        if gid is None or not await _withdraw(driver, gid, size):
            continue
        if driver.inflight.get(gid) != index:  # gone meanwhile (its slots went with it)
            continue
        del driver.inflight[gid]
        driver.ledger.not_trained(index, "withdrawn", reinjected=False)
        driver.unsaved.adopt(version, index)  # a lost step injects it again
        driver.flow.release(size)
        log.info("prompt %d: its group reported lost was trained; group %d withdrawn",
                 index, gid)  # fmt: skip


async def _withdraw(driver: Driver, gid: int, size: int) -> bool:
    """Shrink group ``gid`` to nothing; False if a member was written (or it is gone)."""
    try:
        await driver.client.shrink_group(S.ROLLOUT, gid, size)
    except TransferQueueError as exc:
        log.info("group %d not withdrawn: %r", gid, exc)
        return False
    return True
