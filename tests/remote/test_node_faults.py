"""Node processes killed under a run (issue #27 §1 item 1, §1b): refs follow every restart, and
watchers of actors that died with their process hear of it. Real node processes."""

from __future__ import annotations

import os
import signal

import pytest
import trio

import asyncflow_actors as afa
from tests.remote.light_actors import (
    Forward,
    Forwarder,
    Heard,
    Hello,
    Hi,
    Poll,
    Poller,
    Seen,
    Watch,
    Watcher,
)

ALLOW = ["tests.remote"]
RESTARTS = 10


async def _killed(node: afa.Node) -> None:
    """SIGKILL the node's process and wait until its supervisor has started a new one."""
    old = node.pid
    assert old is not None
    os.kill(old, signal.SIGKILL)
    while node.pid in (None, old):
        await trio.sleep(0.02)


async def test_a_restarted_node_is_reached_by_other_nodes_after_every_restart() -> None:
    """Each start of a node draws its incarnation anew: whatever it draws, the other nodes
    reach the new process (the restart drawing a lower one left them with dead endpoints)."""
    strategy = afa.OneForOne(max_restarts=2 * RESTARTS, within=120.0)
    async with afa.open_actor_system(strategy=strategy) as system:
        a = await system.start_node("a", allow=ALLOW)
        b = await system.start_node("b", allow=ALLOW)
        forwarder = await a.spawn(Forwarder, name="forwarder")
        hello = await b.spawn(Hello, name="hello")
        assert await forwarder.ask(Forward(hello, "0")) == "hello:0"
        for i in range(1, RESTARTS + 1):
            with trio.fail_after(20):
                await _killed(b)
                # A asks B's new process (its link to the old one dropped with it)
                assert await forwarder.ask(Forward(hello, str(i))) == f"hello:{i}"


async def test_a_node_asking_while_another_restarts_waits_for_it() -> None:
    """A node that keeps asking another one while that one is killed and restarted: the ask in
    flight at the death fails (its process is gone), the next ones wait for the new process
    and reach it. They failed at once, again and again, with ``where node 'b' listens is not
    known here`` while b restarted (its socket file went with the old process), and a rollout
    asking its Reward node crash-looped until its supervisor gave up (the soak)."""
    strategy = afa.OneForOne(max_restarts=10, within=120.0)
    async with afa.open_actor_system(strategy=strategy) as system:
        a = await system.start_node("a", allow=ALLOW)
        b = await system.start_node("b", allow=ALLOW)
        poller = await a.spawn(Poller, name="poller")
        hello = await b.spawn(Hello, name="hello")
        assert await poller.ask(Poll(hello, "0")) == "hello:0"
        for i in range(1, 4):
            errors: list[str] = []
            killed = trio.Event()

            async def poll(text: str, errors: list[str], killed: trio.Event) -> None:
                """Ask until an answer comes after the kill; keep the errors met."""
                while True:
                    answer = await poller.ask(Poll(hello, text, within=30.0))
                    if answer.startswith("error"):
                        errors.append(answer)
                    elif killed.is_set():
                        assert answer == f"hello:{text}"
                        return
                    await trio.sleep(0.01)

            with trio.fail_after(40):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(poll, str(i), errors, killed)
                    await trio.sleep(0.2)
                    await _killed(b)
                    killed.set()
            # at most the ask in flight at the death failed, and for that reason
            assert len(errors) <= 1, errors
            assert all("dropped" in e or "restarted" in e for e in errors), errors


async def test_watchers_hear_when_a_temporary_actor_dies_with_its_node() -> None:
    """A TEMPORARY actor is not spawned again when its node restarts: its watchers — in the
    supervising system and on another node — get ``Terminated`` (``NodeLost``) at once."""
    async with afa.open_actor_system() as system:
        a = await system.start_node("a", allow=ALLOW)
        b = await system.start_node("b", allow=ALLOW)
        lone = await b.spawn(Hello, name="lone", restart=afa.Restart.TEMPORARY)
        kept = await b.spawn(Hello, name="kept")
        here = await system.spawn(Watcher, name="here")
        there = await a.spawn(Watcher, name="there")
        await here.ask(Watch(lone))
        await there.ask(Watch(lone))
        with trio.fail_after(afa.NodeOptions().heartbeat_timeout):
            await _killed(b)
            assert await here.ask(Heard()) == "NodeLost"
            assert await there.ask(Heard()) == "NodeLost"
            assert await kept.ask(Hi("again")) == "kept:again"  # a PERMANENT one came back


@pytest.mark.parametrize("restart", list(afa.Restart))
async def test_watchers_hear_when_a_node_that_is_not_restarted_dies(restart: afa.Restart) -> None:
    """Whatever an actor's own restart policy, its watchers hear its death (``NodeLost``) when
    its node process dies for good (the node itself ``TEMPORARY``): nothing brings it back."""
    async with afa.open_actor_system() as system:
        a = await system.start_node("a", allow=ALLOW)
        b = await system.start_node("b", allow=ALLOW, restart=afa.Restart.TEMPORARY)
        actor = await b.spawn(Hello, name="actor", restart=restart)
        here = await system.spawn(Watcher, name="here")
        there = await a.spawn(Watcher, name="there")
        await here.ask(Watch(actor))
        await there.ask(Watch(actor))
        pid = b.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        with trio.fail_after(afa.NodeOptions().heartbeat_timeout):
            for watcher in (here, there):
                while not await watcher.ask(Seen()):
                    await trio.sleep(0.02)
                assert await watcher.ask(Seen()) == "NodeLost"


async def test_a_client_on_another_node_reaches_a_restarted_storage_unit() -> None:
    """Issue #27 §1 item 9: a TransferQueue client on node A puts into a storage unit whose
    process was killed and restarted, every time (it met ``NodeLost`` in 7 of 12 restarts)."""
    from asyncflow_actors import transfer_queue as tq
    from asyncflow_actors.actors.remote import GetNode
    from tests.remote.mesh_actors import ROW, Produce, Producer

    topic = tq.TopicSpec.from_dict(
        {"consumers": ["c"], "columns": {"x": {"dtype": "float32", "shape": [ROW]}}}, name="t"
    )
    config = tq.TransferQueueConfig(topics=(topic,), units=1, placement="process")
    async with (
        afa.open_actor_system() as system,
        tq.open_transfer_queue(system, config) as queue,
    ):
        a = await system.start_node("a", allow=[*ALLOW, "asyncflow_actors.transfer_queue"])
        producer = await a.spawn(Producer, name="producer")
        client = await queue.client("driver")
        assert len(await producer.ask(Produce(queue.controller, 2, seed=0))) == 2
        unit = "unit-0"
        unit_node = system.whereis(f"{config.name}/{config.name}-unit-0")
        assert unit_node is not None
        node: afa.Node = await unit_node.ask(GetNode())
        since = 0  # no event yet: nothing was lost before the first kill
        for i in range(1, 7):  # each restart drew a lower incarnation half the time
            with trio.fail_after(30):
                await _killed(node)
                # the controller reports the samples the dead process held: it knows the
                # unit restarted (a put placed before that stores nothing, and says so); the
                # events of this restart only (an earlier restart's "lost" says nothing here)
                lost = False
                while not lost:
                    batch = await client.events(since)
                    since = batch.cursor
                    lost = any(e.kind == "lost" for e in batch.events)
                # and it adopted the restarted process (a put placed in between meets the old
                # incarnation's end: StorageUnavailable, nothing stored)
                while (await client.statistics()).controller.incarnations.get(unit) is None:
                    await trio.sleep(0.05)
                assert len(await producer.ask(Produce(queue.controller, 2, seed=i))) == 2
