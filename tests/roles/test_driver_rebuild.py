"""The pieces of a Driver's resume (``_driver_rebuild``): a rollout's report reaches the
resumed Driver, the state taken over, the admissions cut short."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import trio

from asyncflow_actors.actors import (
    Actor,
    ActorContext,
    ChildSpec,
    OneForOne,
    Restart,
    WhichChildren,
    open_local_actor_system,
)
from asyncflow_actors.roles._ask_again import tell_driver
from asyncflow_actors.roles._driver_rebuild import adopt, readmission
from asyncflow_actors.roles._messages import GroupGone


class _RaisesOnce(Actor[GroupGone]):
    """Raises on the first report it gets (its incarnation ends with the report's ask), and
    records what later incarnations get."""

    def __init__(self, got: list[tuple[int, GroupGone]], incarnation: int) -> None:
        self.got = got
        self.incarnation = incarnation

    async def receive(self, msg: GroupGone, ctx: ActorContext[GroupGone]) -> None:
        await trio.lowlevel.checkpoint()
        if self.incarnation == 1:
            raise RuntimeError("driver bug (test)")
        self.got.append((self.incarnation, msg))


async def test_a_report_is_asked_again_of_the_resumed_driver() -> None:
    """A tell would have died with the first incarnation's mailbox; the ask fails with
    ``ActorCrashed`` and is made again, and the next incarnation handles it."""
    got: list[tuple[int, GroupGone]] = []
    built = [0]

    def build() -> _RaisesOnce:
        built[0] += 1
        return _RaisesOnce(got, built[0])

    child = ChildSpec(build, "driver", restart=Restart.TRANSIENT)
    async with open_local_actor_system() as system:
        supervisor = await system.start_child(
            ChildSpec.supervisor("sup", [child], OneForOne(max_restarts=1, within=math.inf))
        )
        (info,) = await supervisor.ask(WhichChildren())
        with trio.fail_after(10):
            await tell_driver(info.ref, GroupGone(7, "rollout-0"))
    assert got == [(2, GroupGone(7, "rollout-0"))]


def test_readmission_names_each_prompt_cut_short_with_its_open_group() -> None:
    """Opened but not put: put again into its group; not opened: a new group."""
    driver: Any = SimpleNamespace(inflight={10: 3, 11: 4}, admitting={5, 3})
    assert readmission(driver) == [(3, 10), (5, None)]


def test_adopt_takes_over_the_state_but_not_the_incarnation_flag() -> None:
    old: Any = SimpleNamespace(resumed=False, cursor=12, inflight={1: 2}, backlog=[3])
    new: Any = SimpleNamespace(resumed=True, cursor=0, inflight={}, backlog=[])
    adopt(new, old)
    assert (new.resumed, new.cursor, new.backlog) == (True, 12, [3])
    assert new.inflight is old.inflight  # the same bookkeeping, not a copy
