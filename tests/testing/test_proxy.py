"""Link faults across processes: a real node process behind the fault-injecting proxy."""

from __future__ import annotations

import time

import pytest
import trio

import asyncflow_actors as afa
from asyncflow_actors.testing import (
    Direction,
    LinkRule,
    alive,
    open_link_proxy,
    open_node_process,
)
from tests.testing.actors import Add, Counter, Echo, Total

# Not a liveness test: a link declared lost only after 30 s of silence, so that a loaded
# machine never loses it by accident...
PATIENT = afa.NodeOptions(heartbeat_timeout=30.0)
# ...except where losing it is the point: 2 s of silence (pings every 0.1 s).
QUICK = afa.NodeOptions(heartbeat_interval=0.1, heartbeat_timeout=2.0)


def test_rules_are_validated() -> None:
    with pytest.raises(ValueError, match="action"):
        LinkRule("reorder")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="probability"):
        LinkRule("drop", probability=1.5)
    assert LinkRule("drop", kinds="tell").kinds == frozenset({"tell"})


async def test_drop_duplicate_delay_and_partitions_on_a_node_link() -> None:
    async with (
        open_node_process(allow=["tests.testing"], name="far") as far,
        open_link_proxy(far.address, seed=1) as proxy,
        afa.open_actor_system() as system,
    ):
        node = await system.connect_node(
            proxy.address, name="far", options=PATIENT, restart=afa.Restart.TEMPORARY
        )
        assert node.pid == far.pid
        ref = await node.spawn(Counter, name="c")
        assert await ref.ask(Echo("through")) == "through"
        stats = proxy.statistics()
        assert stats.peers == 1 and stats.to_node >= 3 and stats.to_peer >= 3

        # drop: the next tell is lost on its way to the node
        proxy.add_rule(LinkRule("drop", direction=Direction.TO_NODE, kinds={"tell"}, count=1))
        await ref.send(Add(1))
        await ref.send(Add(2))
        assert await ref.ask(Total()) == 2
        dropped = [m for m, outcome in proxy.history if outcome == "dropped"]
        assert [(m.kind, m.target) for m in dropped] == [("tell", "c")]

        # duplicate: the next tell arrives twice
        proxy.add_rule(LinkRule("duplicate", kinds={"tell"}, count=1))
        await ref.send(Add(10))
        assert await ref.ask(Total()) == 22
        assert proxy.statistics().duplicated == 1

        # delay: replies come back late, in order
        proxy.clear_rules()
        proxy.add_rule(LinkRule("delay", direction=Direction.TO_PEER, kinds={"ok"}, seconds=0.3))
        began = time.monotonic()
        async with trio.open_nursery() as nursery:
            answers: list[str] = []

            async def ask(value: str) -> None:
                answers.append(await ref.ask(Echo(value)))

            nursery.start_soon(ask, "first")
            await trio.sleep(0.05)
            nursery.start_soon(ask, "second")
        assert time.monotonic() - began >= 0.3
        assert answers == ["first", "second"]
        proxy.clear_rules()

        # a short partition that holds messages is a stall, not a loss: nothing fails
        began = trio.current_time()
        proxy.partition(0.5, hold=True)
        assert proxy.partitioned
        assert await ref.ask(Total()) == 22
        assert trio.current_time() - began >= 0.5
        assert proxy.statistics().held >= 1

        # a partition longer than the heartbeat timeout loses the node (it is alive meanwhile)
        quick = await system.connect_node(
            proxy.address, name="quick", options=QUICK, restart=afa.Restart.TEMPORARY
        )
        other = await quick.spawn(Counter, name="c2")
        proxy.partition(30.0)
        with pytest.raises(afa.ActorCrashed) as info, trio.fail_after(20):
            await other.ask(Total())  # waits for an answer that cannot come
        assert isinstance(info.value.error, afa.NodeLost)
        assert alive(far.pid)
        proxy.heal()
        assert not proxy.partitioned
        assert await ref.ask(Total()) == 22  # the patient link rode it out
