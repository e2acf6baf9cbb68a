"""Liveness on evidence only (issue #8 §2): busy loops are never convicted, dead peers are."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

import asyncflow_actors as afa
from tests.remote.mesh_actors import Block, Busy, Count

ALLOW = ["tests.remote"]
# a short heartbeat, so "3x the timeout" stays a short test
QUICK = afa.NodeOptions(heartbeat_interval=0.2, heartbeat_timeout=1.0, shutdown_grace=2.0)


async def test_a_blocked_driver_loop_never_convicts_a_healthy_node() -> None:
    async with afa.open_actor_system(node_options=QUICK) as system:
        node = await system.start_node("n", allow=ALLOW, options=QUICK)
        busy = await node.spawn(Busy, name="busy")
        assert await busy.ask(Count()) == 1
        pid = node.pid
        time.sleep(3 * QUICK.heartbeat_timeout)  # noqa: ASYNC251 (a torch step, a checkpoint load)
        await trio.sleep(2 * QUICK.heartbeat_interval)  # let anything pending surface
        assert await busy.ask(Count()) == 2  # same incarnation: its state survived
        assert node.pid == pid
        assert node.ref.statistics().restarts == 0


async def test_a_blocked_node_loop_never_convicts_it() -> None:
    async with afa.open_actor_system(node_options=QUICK) as system:
        node = await system.start_node("n", allow=ALLOW, options=QUICK)
        busy = await node.spawn(Busy, name="busy")
        pid = node.pid
        # the node's whole event loop stalls for 3x the heartbeat timeout
        assert await busy.ask(Block(3 * QUICK.heartbeat_timeout)) == 1
        assert await busy.ask(Count()) == 2
        assert node.pid == pid
        assert node.ref.statistics().restarts == 0


async def test_kill_9_of_a_child_node_is_detected_within_a_second() -> None:
    async with afa.open_actor_system() as system:
        node = await system.start_node("n", allow=ALLOW)  # default (5 s) heartbeats
        busy = await node.spawn(Busy, name="busy")
        pid = node.pid
        assert pid is not None
        failed = trio.Event()
        took: list[float] = []

        async def pending() -> None:
            with pytest.raises(afa.ActorCrashed) as info:
                await busy.ask(Block(60))
            took.append(trio.current_time() - t0)
            assert isinstance(info.value.error, afa.NodeLost)
            failed.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(pending)
            await trio.sleep(0.3)  # the ask is on the node, its loop blocked
            t0 = trio.current_time()
            os.kill(pid, signal.SIGKILL)
            with trio.fail_after(5):
                await failed.wait()
        assert took[0] < 1.0
        with trio.fail_after(30):
            assert await busy.ask(Count()) == 1  # respawned on a fresh node


@asynccontextmanager
async def open_tcp_relay(target_port: int) -> AsyncIterator[tuple[int, trio.CancelScope]]:
    """A TCP relay to ``target_port``; cancelling the yielded scope cuts every connection."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    cut = trio.CancelScope()

    async def pipe(src: trio.SocketStream, dst: trio.SocketStream) -> None:
        try:
            while data := await src.receive_some(65536):
                await dst.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async def serve(nursery: trio.Nursery) -> None:
        async def handle(client: trio.SocketStream) -> None:
            nonlocal cut
            scope = cut
            with scope:
                server = await trio.open_tcp_stream("127.0.0.1", target_port)
                async with client, server, trio.open_nursery() as inner:
                    inner.start_soon(pipe, client, server)
                    inner.start_soon(pipe, server, client)

        await trio.serve_listeners(handle, listeners, handler_nursery=nursery)

    class Cutter:
        def cancel(self) -> None:
            nonlocal cut
            cut.cancel()  # the open connections drop (RST/FIN); new ones are relayed again
            cut = trio.CancelScope()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve, nursery)
        yield port, Cutter()  # type: ignore[misc]
        nursery.cancel_scope.cancel()


async def test_a_hand_started_node_whose_link_blips_is_reconnected_and_keeps_its_actors() -> None:
    cmd = [sys.executable, "-m", "asyncflow_actors.node", "--bind", "tcp://127.0.0.1:*"]
    cmd += ["--allow", "tests.remote", "--name", "far"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, cwd=os.getcwd())  # noqa: ASYNC220
    try:
        assert proc.stdout is not None
        port = int(json.loads(proc.stdout.readline())["endpoints"][0].rpartition(":")[2])
        async with open_tcp_relay(port) as (relay, cutter), afa.open_actor_system() as system:
            node = await system.connect_node(f"tcp://127.0.0.1:{relay}", name="far")
            busy = await node.spawn(Busy, name="busy")
            assert await busy.ask(Count()) == 1
            cutter.cancel()  # the link drops (the node process never noticed anything wrong)
            with trio.fail_after(20):
                while node.ref.statistics().restarts == 0:
                    await trio.sleep(0.02)
                # reconnected; the node adopted the actor this session had spawned there
                assert await busy.ask(Count()) == 2
            assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


async def test_leaving_with_a_stuck_node_is_bounded_and_leaves_nothing() -> None:
    options = afa.NodeOptions(shutdown_grace=1.0)
    async with afa.open_actor_system() as system:
        node = await system.start_node("n", allow=ALLOW, options=options)
        await node.spawn(Busy, name="busy")
        pid = node.pid
        assert pid is not None
        folder = node.address.removeprefix("ipc://").rpartition("/")[0]
        os.kill(pid, signal.SIGSTOP)  # stuck: it will answer nothing, not even SIGTERM
        t0 = trio.current_time()
    # the polite shutdown (1 s), SIGTERM (2 s), then SIGKILL: within the node's budget
    assert trio.current_time() - t0 < 1.0 + 2.0 + 1.0 + 1.0
    assert not os.path.exists(f"/proc/{pid}") or _zombie_or_gone(pid)
    assert not os.path.exists(folder)


def _zombie_or_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


async def test_a_node_connected_twice_serves_both_handles() -> None:
    cmd = [sys.executable, "-m", "asyncflow_actors.node", "--bind", "tcp://127.0.0.1:*"]
    cmd += ["--allow", "tests.remote", "--name", "shared"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, cwd=os.getcwd())  # noqa: ASYNC220
    try:
        assert proc.stdout is not None
        address = json.loads(proc.stdout.readline())["endpoints"][0]
        async with afa.open_actor_system() as system:
            first = await system.connect_node(address, name="first")
            one = await first.spawn(Busy, name="one")
            second = await system.connect_node(address, name="second")
            two = await second.spawn(Busy, name="two")
            with trio.fail_after(10):  # neither handle's link was closed under the other
                assert await one.ask(Count()) == 1
                assert await two.ask(Count()) == 1
    finally:
        proc.kill()
        proc.wait()
