"""Link faults across processes: a real node process behind the fault-injecting proxy."""

from __future__ import annotations

import functools
import math
import time

import pytest
import trio

import asyncflow_actors as afa
from asyncflow_actors import testing as aft
from asyncflow_actors.testing import (
    Direction,
    LinkRule,
    alive,
    open_link_proxy,
    open_node_process,
)
from tests.testing.actors import Add, Asker, AskTotal, Counter, Echo, Total

ALLOW = ["tests.testing", "asyncflow_actors.testing"]

# The driver's links to the nodes behind the proxy: one patient (a link lost only after 30 s of
# silence, so a loaded machine never loses it by accident)...
PATIENT = afa.NodeOptions(heartbeat_timeout=30.0)
# ...and one quick, where losing it is the point: 2 s of silence (ZMTP pings every 0.1 s).
QUICK = afa.NodeOptions(heartbeat_interval=0.1, heartbeat_timeout=2.0)
# The nodes' own heartbeats (their pings carry this TTL to the driver) are patient too.
NODE_ARGS = ["--heartbeat-timeout", "30"]


def test_rules_are_validated() -> None:
    with pytest.raises(ValueError, match="action"):
        LinkRule("reorder")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="probability"):
        LinkRule("drop", probability=1.5)
    assert LinkRule("drop", kinds="tell").kinds == frozenset({"tell"})


async def test_proxy_addresses_are_checked() -> None:
    async with open_link_proxy() as proxy:
        with pytest.raises(RuntimeError, match="without an upstream"):
            proxy.address  # noqa: B018
        with pytest.raises(ValueError, match="inproc"):
            proxy.relay("inproc://somewhere")
        assert proxy.relay("tcp://127.0.0.1:9") == proxy.relay("tcp://127.0.0.1:9")
    with pytest.raises(ValueError, match="HOST:PORT"):
        async with open_link_proxy(bind="ipc:///tmp/x"):
            pass


async def _receive_exactly(stream: trio.SocketStream, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = await stream.receive_some()
        assert chunk, f"EOF after {data!r}"
        data += chunk
    return data


async def test_a_partition_stops_the_bytes_and_keeps_the_connection() -> None:
    """Below zmq: any TCP stream is relayed byte for byte; a partition holds it (a stream that
    is not ZMTP has no message to drop) and holds back a close until it heals, like a FIN."""

    accepted: list[trio.SocketStream] = []
    close_now = trio.Event()

    async def upstream(stream: trio.SocketStream) -> None:
        accepted.append(stream)
        async with stream:
            while data := await stream.receive_some():
                if data == b"bye":
                    await stream.send_all(b"ok")
                    await close_now.wait()
                    return  # closes
                await stream.send_all(data)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, upstream, 0, host="127.0.0.1")
        )
        port = listeners[0].socket.getsockname()[1]
        async with open_link_proxy(f"tcp://127.0.0.1:{port}") as proxy:
            host, _, proxy_port = proxy.address.removeprefix("tcp://").rpartition(":")
            stream = await trio.open_tcp_stream(host, int(proxy_port))
            await stream.send_all(b"hello")
            assert await _receive_exactly(stream, 5) == b"hello"

            proxy.partition(math.inf)
            await stream.send_all(b"during")
            late = await trio.open_tcp_stream(host, int(proxy_port))  # connects to the proxy...
            await late.send_all(b"late")
            with trio.move_on_after(0.3):
                await stream.receive_some()
                raise AssertionError("bytes crossed a partition")
            assert proxy.statistics().connections == 2
            assert len(accepted) == 1  # the new connection waits for the end, like its SYN
            proxy.heal()
            assert await _receive_exactly(stream, 6) == b"during"
            assert await _receive_exactly(late, 4) == b"late"  # ...and through it once healed
            await late.aclose()

            await stream.send_all(b"bye")
            assert await _receive_exactly(stream, 2) == b"ok"
            proxy.partition(math.inf)
            close_now.set()  # the upstream closes, behind the partition
            with trio.move_on_after(0.5):
                await stream.receive_some()
                raise AssertionError("a close crossed a partition")
            proxy.heal()
            with trio.fail_after(5):
                assert await stream.receive_some() == b""
                await aft.wait_until(lambda: proxy.statistics().connections == 0)
            await stream.aclose()
        nursery.cancel_scope.cancel()


async def test_drop_duplicate_delay_and_partitions_on_a_node_link() -> None:
    async with (
        open_node_process(allow=["tests.testing"], name="far", args=NODE_ARGS) as far,
        open_node_process(allow=["tests.testing"], name="near", args=NODE_ARGS) as near,
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

        # a partition longer than a link's heartbeat timeout loses that node, although it is
        # alive: its ZMTP pings go unanswered (the same proxy relays to a second node)
        quick = await system.connect_node(
            proxy.relay(near.address), name="near", options=QUICK, restart=afa.Restart.TEMPORARY
        )
        other = await quick.spawn(Counter, name="c2")
        assert await other.ask(Total()) == 0
        began = trio.current_time()
        proxy.partition(30.0)
        with pytest.raises(afa.ActorCrashed) as info, trio.fail_after(20):
            await other.ask(Total())  # waits for an answer that cannot come
        assert isinstance(info.value.error, afa.NodeLost)
        # lost by the heartbeats: no sooner than the timeout after the last answered ping
        assert trio.current_time() - began >= QUICK.heartbeat_timeout - QUICK.heartbeat_interval
        assert alive(near.pid)
        assert proxy.statistics().heartbeats_dropped >= 1
        proxy.heal()
        assert not proxy.partitioned
        assert await ref.ask(Total()) == 22  # the patient link rode it out


async def test_links_the_runtime_opens_go_through_proxies() -> None:
    """The driver's link to a node it starts (``route_through``) and a node-to-node link the
    mesh opens lazily (``RouteLinks`` on the node), each through a proxy; a partition between
    two nodes is seen by them only."""
    # the nodes' links (node to node included) are lost after 2 s of silence
    options = afa.NodeOptions(heartbeat_interval=0.1, heartbeat_timeout=2.0)
    async with (
        afa.open_actor_system() as system,
        open_link_proxy() as driver_proxy,
        open_link_proxy() as ab_proxy,
    ):
        with aft.route_through(system, driver_proxy, peers={"a"}):
            a = await system.start_node("a", allow=ALLOW, options=options)
        assert system.mesh.route is None
        b = await system.start_node("b", allow=ALLOW, options=options)
        assert driver_proxy.statistics().peers == 1  # the driver's link to a, not to b
        routes = {"b": ab_proxy.relay(b.address)}
        router = await a.spawn(aft.RouteLinks, name="routes", kwargs={"routes": routes})
        assert await router.ask(aft.Routes()) == routes
        asker = await a.spawn(Asker, name="asker")
        counter = await b.spawn(Counter, name="c", kwargs={"start": 5})
        assert await asker.ask(AskTotal(counter)) == 5  # a asks b through the proxy
        assert ("ask", "c") in [(m.kind, m.target) for m, _ in ab_proxy.history]
        assert ("spawn", None) in [(m.kind, m.target) for m, _ in driver_proxy.history]

        ab_proxy.partition(math.inf)
        with trio.fail_after(20):
            assert await asker.ask(AskTotal(counter)) == "NodeLost"  # a lost b...
        assert await counter.ask(Total()) == 5  # ...the driver did not
        assert b.pid is not None and alive(b.pid)
        ab_proxy.heal()
        with trio.fail_after(20):
            assert await asker.ask(AskTotal(counter)) == 5  # a reconnects, through the proxy
        assert ab_proxy.statistics().peers >= 2
