"""Remote actors on real node processes over real sockets."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
import trio.testing
import zmq

import asyncflow_actors as afa
from asyncflow_actors import testing as aft
from asyncflow_actors.actors.remote import CurveClient, CurveServer, curve_keypair
from tests.remote.remote_actors import (
    Add,
    Batch,
    Config,
    Echo,
    Exit,
    Fail,
    Hold,
    Pid,
    Reject,
    Slow,
    Sum,
    Total,
    Worker,
)

ALLOW = ["tests.remote"]
FAST = afa.NodeOptions(heartbeat_interval=0.1, heartbeat_timeout=2.0, shutdown_grace=2.0)


@pytest.mark.parametrize("transport", ["ipc", "tcp", "inproc"])
async def test_remote_tell_ask_and_stop(transport: str) -> None:
    async with afa.open_actor_system() as system:
        node = await system.start_node("n", allow=ALLOW, transport=transport)  # type: ignore[arg-type]
        ref = await node.spawn(Worker, name="w", kwargs={"start": 5, "config": Config(scale=2)})
        assert ref.name == "n/w"
        for _ in range(10):
            await ref.send(Add(1))
        assert await ref.ask(Total()) == 25
        pid = await ref.ask(Pid())
        assert (pid == os.getpid()) is (transport == "inproc")
        with pytest.raises(afa.MessageTypeError):
            await ref.send("not a message")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="bad input"):
            await ref.ask(Reject("bad input"))  # an error reply is no crash
        assert await ref.ask(Total()) == 25
        stats = await ref.fetch_statistics()
        assert stats.processed == 14
        await ref.stop()
        with pytest.raises(afa.ActorCrashed):
            await ref.ask(Total())


async def test_a_crash_on_the_node_is_supervised_there() -> None:
    async with afa.open_actor_system() as system:
        node = await system.start_node("n", allow=ALLOW)
        ref = await node.spawn(Worker, name="w", kwargs={"start": 7})
        await ref.send(Add(1))
        with pytest.raises(afa.ActorCrashed) as info:
            await ref.ask(Fail("remote boom"))
        assert isinstance(info.value.error, RuntimeError)
        assert "remote boom" in str(info.value.error)
        assert await ref.ask(Total()) == 7  # restarted by the node's supervisor, fresh state
        temp = await node.spawn(Worker, name="t", restart=afa.Restart.TEMPORARY)
        with pytest.raises(afa.ActorCrashed):
            await temp.ask(Fail("gone for good"))
        with pytest.raises(afa.ActorCrashed):
            await temp.ask(Total())


async def test_tensors_of_every_dtype_round_trip_bit_exactly() -> None:
    dtypes = [
        torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
        torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
    ]  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    values = {str(d): (torch.randn(64, 33, generator=gen) * 100).to(d) for d in dtypes}
    values["nan"] = torch.tensor([float("nan"), float("inf"), -0.0])
    values["big"] = torch.randn(1 << 20, generator=gen)  # 4 MiB: a zero-copy frame
    values["strided"] = torch.arange(100).reshape(10, 10).t()
    async with afa.open_actor_system() as system:
        node = await system.start_node("n", allow=ALLOW)
        ref = await node.spawn(Worker, name="w")
        echoed = await ref.ask(Echo(values))
        assert echoed.keys() == values.keys()
        for key, tensor in values.items():
            back = echoed[key]
            assert back.dtype == tensor.dtype and back.shape == tensor.shape, key
            assert torch.equal(
                back.contiguous().view(torch.uint8), tensor.contiguous().view(torch.uint8)
            ), key
        batch = Batch(
            torch.ones(4, 8, dtype=torch.int64), torch.ones(4, 8, dtype=torch.bool), {"step": 3}
        )
        summed = await ref.ask(Sum(batch))
        assert torch.equal(summed.tokens, torch.full((4, 1), 8))
        assert summed.meta == {"step": 3}


async def test_kill_9_fails_pending_asks_and_the_node_restarts() -> None:
    async with afa.open_actor_system() as system:
        node = await system.start_node("n", allow=ALLOW, options=FAST)
        ref = await node.spawn(Worker, name="w", kwargs={"start": 1})
        old_pid = node.pid
        assert old_pid is not None
        detected = trio.Event()
        async with trio.open_nursery() as nursery:

            async def pending() -> None:
                with pytest.raises(afa.ActorCrashed) as info:
                    await ref.ask(Hold(60))
                assert isinstance(info.value.error, afa.NodeLost)
                detected.set()

            nursery.start_soon(pending)
            await trio.sleep(0.2)
            assert aft.kill_node(node) == old_pid
            with trio.fail_after(5):  # detected within a bounded time
                await detected.wait()
        with trio.fail_after(30):
            assert await ref.ask(Total()) == 1  # same ref, respawned on the new node
        assert node.pid != old_pid
        assert not aft.alive(old_pid)
        # once: liveness is decided on evidence, so a loaded machine adds no restart
        assert node.ref.statistics().restarts == 1


async def test_missed_heartbeats_are_detected() -> None:
    async with afa.open_actor_system() as system:
        node = await system.start_node("n", allow=ALLOW, options=FAST)
        ref = await node.spawn(Worker, name="w")
        pid = node.pid
        assert pid is not None
        async with aft.frozen_process(pid):  # alive but silent
            await aft.wait_node_restarted(node, pid, timeout=30)
        assert await ref.ask(Echo("back")) == "back"
        await aft.wait_until(lambda: not aft.alive(pid))


async def test_a_node_that_exits_is_restarted_by_its_supervisor() -> None:
    async with afa.open_actor_system() as system:
        node = await system.start_node("n", allow=ALLOW, options=FAST)
        ref = await node.spawn(Worker, name="w")
        first = node.pid
        with pytest.raises(afa.ActorCrashed):
            await ref.ask(Exit())  # os._exit(3) on the node
        with trio.fail_after(30):
            assert await ref.ask(Echo(1)) == 1
        assert node.pid != first


async def test_leaving_or_cancelling_the_system_leaves_no_process_or_file() -> None:
    pids: list[int] = []
    addresses: list[str] = []
    aft.warm_up_zmq()
    before = aft.ResourceSnapshot.take()
    with trio.move_on_after(60) as scope:
        async with afa.open_actor_system() as system:
            for i, transport in enumerate(["ipc", "tcp"]):
                node = await system.start_node(f"n{i}", allow=ALLOW, transport=transport)  # type: ignore[arg-type]
                await node.spawn(Worker, name="w")
                assert node.pid is not None
                pids.append(node.pid)
                addresses.append(node.address)
            scope.cancel()  # cancel the whole tree from outside
            await trio.sleep_forever()
    assert scope.cancelled_caught
    assert not any(aft.alive(pid) for pid in pids)
    ipc_path = Path(addresses[0].removeprefix("ipc://"))
    assert not ipc_path.exists()
    assert not ipc_path.parent.exists()
    aft.check_no_leaks(before, settle=10.0)  # no thread, child, socket or pipe either


async def test_cross_process_backpressure() -> None:
    async with afa.open_actor_system() as system:
        node = await system.start_node("n", allow=ALLOW)
        ref = await node.spawn(Slow, name="slow")  # mailbox of 2: 2 credits
        # before the first message leaves: the node may start on it at once (a clock read
        # after the sends below counted from a moment the receiver had already begun)
        t0 = trio.current_time()
        ref.send_nowait(Add(1))
        ref.send_nowait(Add(1))
        with pytest.raises(trio.WouldBlock):
            ref.send_nowait(Add(1))
        assert ref.statistics().mailbox_depth == 2
        for _ in range(6):
            await ref.send(Add(1))  # each waits for the node to take one more
        # the 8th enters the mailbox once the 4th is taken: after 3 receives of 0.05 s each
        assert trio.current_time() - t0 >= 0.05 * 3  # paced by the slow receiver
        assert await ref.ask(Total()) == 8


async def test_spawn_outside_the_allowlist_is_refused() -> None:
    async with afa.open_actor_system() as system:
        node = await system.start_node("n", allow=ALLOW)
        with pytest.raises(afa.SpawnRefused, match="allowlist"):
            await node.spawn("os:system", name="evil")
        with pytest.raises(afa.SpawnRefused, match="not an Actor"):
            await node.spawn("tests.remote.remote_actors:Config", name="x")
        await node.spawn(Worker, name="w")
        with pytest.raises(afa.NameTakenError):
            await node.spawn(Worker, name="w")


async def test_garbage_on_the_wire_never_crashes_a_node() -> None:
    async with afa.open_actor_system() as system:
        node = await system.start_node("n", allow=ALLOW, transport="tcp")
        ref = await node.spawn(Worker, name="w")
        ctx = zmq.Context.instance()
        async with afa.actors.remote.open_zmq_socket(ctx, zmq.DEALER, connect=node.address) as sock:
            await sock.send_multipart([b"\xc1garbage"])
            await sock.send_multipart([b""])
            await sock.send_multipart(
                [b"\x94\x02\x81\xa1k\xa3ask\xc0\x05"]
            )  # 5 frames announced, 0 sent
            # a well-formed header naming an unregistered type, with a correlation id
            header = (
                b"\x94\x02\x83\xa1k\xa3ask\xa1c\x07\xa1t\xa1w\x93\xc7\x00\x02\xa7nope:Xx\x80\x00"
            )
            await sock.send_multipart([header])
            with trio.fail_after(5):
                reply = await sock.recv_multipart()
        meta, payload = afa.actors.remote.decode(
            reply, registry=afa.actors.remote.protocol_registry(), max_message_bytes=1 << 20
        )
        # the error names the target and returns the credit the message used
        assert meta == {"k": "err", "c": 7, "t": "w", "n": 1}
        assert "WireError" in payload.type_name or "UnknownType" in payload.type_name
        assert await ref.ask(Echo("still alive")) == "still alive"


async def test_watch_a_remote_actor() -> None:
    seen: list[afa.Terminated] = []

    class Watcher(afa.Actor[afa.Terminated]):
        def __init__(self, target: afa.ActorRef[Any]) -> None:
            self.target = target

        async def on_start(self, ctx: afa.ActorContext[afa.Terminated]) -> None:
            ctx.watch(self.target)

        async def receive(self, msg: afa.Terminated, ctx: afa.ActorContext[afa.Terminated]) -> None:
            seen.append(msg)

    async with afa.open_actor_system() as system:
        node = await system.start_node("n", allow=ALLOW, transport="inproc")
        ref = await node.spawn(Worker, name="w")
        await system.spawn(lambda: Watcher(ref), name="watcher")
        await ref.stop()
        await aft.wait_until(lambda: bool(seen))
        assert seen[0].ref == ref
        assert seen[0].error is None


async def test_connect_to_a_node_started_by_hand() -> None:
    async with aft.open_node_process(allow=ALLOW, name="standalone") as proc:
        async with afa.open_actor_system() as system:
            node = await system.connect_node(proc.address, name="remote")
            ref = await node.spawn(Worker, name="w", kwargs={"start": 3})
            assert await ref.ask(Total()) == 3
            await node.stop()  # stops our actors there, not the node
        assert proc.process.returncode is None
        async with afa.open_actor_system() as system:
            node = await system.connect_node(proc.address, name="remote")
            again = await node.spawn(Worker, name="w")  # the name is free again
            assert await again.ask(Total()) == 0


async def test_curve_refuses_unauthenticated_peers(tmp_path: Path) -> None:
    server, client, stranger = curve_keypair(), curve_keypair(), curve_keypair()
    (tmp_path / "server.keys").write_text(f"{server.public.decode()} {server.secret.decode()}\n")
    (tmp_path / "authorized").write_text(client.public.decode() + "\n")
    keys = ["--curve-keys", str(tmp_path / "server.keys")]
    keys += ["--authorized-keys", str(tmp_path / "authorized")]
    quick = afa.NodeOptions(connect_timeout=2.0)
    async with aft.open_node_process(allow=ALLOW, name="standalone", args=keys) as proc:
        address = proc.address
        async with afa.open_actor_system() as system:
            good = CurveClient(server.public, client)
            node = await system.connect_node(address, name="ok", curve=good, options=quick)
            ref = await node.spawn(Worker, name="w")
            assert await ref.ask(Echo("secret")) == "secret"
            for name, curve in [
                ("stranger", CurveClient(server.public, stranger)),
                ("plain", None),
            ]:
                with pytest.raises(afa.ActorCrashed) as info:
                    await system.connect_node(address, name=name, curve=curve, options=quick)
                assert isinstance(info.value.error, afa.NodeLost)


def test_a_node_exits_when_its_parent_dies(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import trio, asyncflow_actors as afa
        async def main():
            async with afa.open_actor_system() as system:
                node = await system.start_node("n", allow=["tests.remote"])
                print(node.pid, flush=True)
                await trio.sleep_forever()
        trio.run(main)
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, cwd=os.getcwd()
    )
    assert parent.stdout is not None
    child_pid = int(parent.stdout.readline())
    assert aft.alive(child_pid)
    parent.kill()
    parent.wait()

    async def check() -> None:
        await aft.wait_until(lambda: not aft.alive(child_pid), timeout=15)

    trio.run(check)


async def test_a_system_listening_with_curve_admits_its_key_and_closes_cleanly() -> None:
    key, stranger = curve_keypair(), curve_keypair()
    quick = afa.NodeOptions(connect_timeout=1.0)
    async with afa.open_actor_system(name="listener") as listener:
        server = CurveServer(key)
        [address] = await listener.listen(
            "tcp://127.0.0.1:*", curve=server, authorized_keys=[key.public]
        )
        async with afa.open_actor_system() as system:
            node = await system.connect_node(
                address, name="listener", curve=CurveClient(key.public, key)
            )
            assert node.pid == os.getpid()
            with pytest.raises(afa.ActorCrashed) as info:
                other = CurveClient(key.public, stranger)
                await system.connect_node(address, name="x", curve=other, options=quick)
            assert isinstance(info.value.error, afa.NodeLost)
    # leaving both systems closed the authenticator's task in order (no nursery misnesting)
