"""Refs travel and any actor reaches any actor (issue #8 §1): real node processes, real sockets."""

from __future__ import annotations

import os
import signal
import socket
from typing import Any

import pytest
import trio

import asyncflow_actors as afa
from asyncflow_actors import transfer_queue as tq
from tests.remote.light_actors import Hi
from tests.remote.mesh_actors import (
    ROW,
    Consume,
    Consumer,
    Echo,
    Note,
    Notes,
    Ping,
    Produce,
    Producer,
    Relay,
    Relayer,
    SlowStart,
    WhoAmI,
)

ALLOW = ["tests.remote", "asyncflow_actors.transfer_queue"]
TOPIC = tq.TopicSpec.from_dict(
    {
        "consumers": ["c"],
        "lease_ttl": 1.0,
        "columns": {"x": {"dtype": "float32", "shape": [ROW]}},
    },
    name="t",
)


def driver_bytes(system: afa.ActorSystem) -> int:
    return system.mesh.statistics().bytes_total


async def test_tq_data_goes_node_to_node_and_a_dead_consumer_loses_nothing() -> None:
    """Producer on A, units on B, consumer on C, controller in the driver."""
    config = tq.TransferQueueConfig(topics=(TOPIC,), units=1, placement="process")
    async with afa.open_actor_system() as system, tq.open_transfer_queue(system, config) as queue:
        a = await system.start_node("a", allow=ALLOW)
        c = await system.start_node("c", allow=ALLOW)
        producer = await a.spawn(Producer, name="producer")
        consumer = await c.spawn(Consumer, name="consumer")
        before = driver_bytes(system)
        n = 32  # 2 MiB of tensor bodies
        indexes = await producer.ask(Produce(queue.controller, n, seed=1))
        assert len(indexes) == n
        got = await consumer.ask(Consume(queue.controller, n))
        assert sorted(got) == sorted(indexes)
        through_driver = driver_bytes(system) - before
        payload = n * ROW * 4
        # metadata only: the bodies went A -> B -> C, never through the driver's sockets
        assert through_driver < payload // 20, (through_driver, payload)

        # C takes a lease and dies holding it: the samples come back, nothing is lost
        second = await producer.ask(Produce(queue.controller, 8, seed=2))
        held = await consumer.ask(Consume(queue.controller, 8, hold=True))
        assert sorted(held) == sorted(second)
        old = c.pid
        assert old is not None
        os.kill(old, signal.SIGKILL)
        with trio.fail_after(30):
            while c.pid in (None, old):  # detected at once (process exit); C comes back
                await trio.sleep(0.02)
            again = await consumer.ask(Consume(queue.controller, 8))  # on C's new process
        assert again == held  # the same samples, the same bytes


async def test_refs_in_messages_reach_actors_on_any_node() -> None:
    async with afa.open_actor_system() as system:
        a = await system.start_node("a", allow=ALLOW)
        b = await system.start_node("b", allow=ALLOW)
        relayer = await a.spawn(Relayer, name="relayer")
        echo = await b.spawn(Echo, name="echo")
        local = await system.spawn(Echo, name="inbox")
        # A asks B (node to node) and tells the driver's actor (node to driver)
        answer = await relayer.ask(Relay(echo, local, "hi"))
        assert answer == "echo:hi"
        with trio.fail_after(10):
            while not await local.ask(Notes()):
                await trio.sleep(0.01)
        assert await local.ask(Notes()) == ("echo:hi",)
        # a ref that comes back home is the same ref
        assert await relayer.ask(WhoAmI()) == relayer
        # B's echo told by the driver through a ref that went A -> driver
        await echo.send(Note("direct"))
        assert await echo.ask(Notes()) == ("direct",)


async def test_spawns_on_a_node_run_concurrently() -> None:
    async with afa.open_actor_system() as system:
        node = await system.start_node("n", allow=ALLOW)
        await node.spawn(SlowStart, name="warm", kwargs={"seconds": 0.0})  # imports done
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(
                    lambda i=i: node.spawn(SlowStart, name=f"s{i}", kwargs={"seconds": 1.0})
                )
        # four one-second starts in parallel (one after the other would take 4 s)
        assert trio.current_time() - t0 < 2.0


async def test_a_ref_to_a_terminated_actor_is_dead_where_it_lands() -> None:
    async with afa.open_actor_system() as system:
        node = await system.start_node("n", allow=ALLOW)
        relayer = await node.spawn(Relayer, name="relayer")
        gone = await system.spawn(Echo, name="gone")
        await gone.stop()
        inbox = await system.spawn(Echo, name="inbox")
        with pytest.raises(afa.ActorCrashed):
            await relayer.ask(Relay(gone, inbox, "x"))  # type: ignore[arg-type]


def _pong(value: Any) -> str:
    return f"echo:{value}"


async def test_many_senders_share_one_actor_each_with_its_own_credits() -> None:
    async with afa.open_actor_system() as system:
        a = await system.start_node("a", allow=ALLOW)
        b = await system.start_node("b", allow=ALLOW)
        echo = await b.spawn(Echo, name="echo", mailbox_size=2)
        relayers = [await a.spawn(Relayer, name=f"r{i}") for i in range(3)]
        inbox = await system.spawn(Echo, name="inbox")

        async def hammer(relayer: afa.ActorRef[Any], k: int) -> None:
            for j in range(20):
                assert await relayer.ask(Relay(echo, inbox, f"{k}.{j}")) == _pong(f"{k}.{j}")

        async def direct() -> None:
            for j in range(40):
                await echo.send(Note(f"d{j}"))

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(direct)
                for k, relayer in enumerate(relayers):
                    nursery.start_soon(hammer, relayer, k)
        notes = await echo.ask(Notes())
        assert [n for n in notes if n.startswith("d")] == [f"d{j}" for j in range(40)]
        # the driver's credits for echo are all back: two senders never shared one window
        stats = echo.statistics()
        assert stats.mailbox_capacity == 2
        with trio.fail_after(10):
            while echo.statistics().mailbox_depth:
                await trio.sleep(0.01)
        _ = Ping  # (kept in the import list for readers: the relay asks Ping)


async def test_a_peer_that_does_not_answer_raises_actor_crashed_caused_by_node_lost() -> None:
    """A connect that times out fails the ask with ``ActorCrashed`` (``NodeLost``), never an
    ``ExceptionGroup`` (the connect races the peer's owner moving it, in a nursery)."""
    from asyncflow_actors.actors.remote._address import ActorAddress

    options = afa.NodeOptions(connect_timeout=0.5)
    async with afa.open_actor_system(node_options=options) as system:
        with socket.socket() as sock:  # a port nobody answers on (bound, not listening)
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            address = ActorAddress("ghost", "x", (f"tcp://127.0.0.1:{port}",), 1, "")
            ref = system.mesh.resolve(address)
            with trio.fail_after(10), pytest.raises(afa.ActorCrashed) as info:
                await ref.ask(Hi("anyone"))
    assert isinstance(info.value.error, afa.NodeLost)
