"""Node processes killed under a run (issue #27 §1 item 1, §1b): refs follow every restart, and
watchers of actors that died with their process hear of it. Real node processes."""

from __future__ import annotations

import os
import signal

import trio

import asyncflow_actors as afa
from tests.remote.light_actors import Forward, Forwarder, Heard, Hello, Hi, Watch, Watcher

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
