"""TrioSocket over real tcp://, ipc:// and inproc:// sockets; SendTracker; CURVE and ZAP."""

from __future__ import annotations

import gc
import os
import random
import select
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest
import trio
import trio.testing
import zmq

from asyncflow_actors.actors.remote._curve import (
    CurveClient,
    CurveKeypair,
    CurveServer,
    curve_keypair,
    open_zap_authenticator,
)
from asyncflow_actors.actors.remote._zmq import SendTracker, TrioSocket, open_zmq_socket


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def endpoint(transport: str, tmp_path: Path) -> str:
    if transport == "tcp":
        return "tcp://127.0.0.1:*"
    if transport == "ipc":
        return f"ipc://{tmp_path}/sock.ipc"
    return f"inproc://test-{random.getrandbits(64):x}"


def payloads(msg: list[zmq.Frame]) -> list[bytes]:
    return [f.bytes for f in msg]


@asynccontextmanager
async def pair(
    ctx: zmq.Context[zmq.Socket[bytes]], bind: str, kind: tuple[int, int] = (zmq.PAIR, zmq.PAIR)
) -> AsyncIterator[tuple[TrioSocket, TrioSocket]]:
    async with (
        open_zmq_socket(ctx, kind[0], bind=bind) as a,
        open_zmq_socket(ctx, kind[1], connect=a.bound_endpoints[0]) as b,
    ):
        yield a, b


@pytest.mark.parametrize("transport", ["tcp", "ipc", "inproc"])
async def test_multipart_roundtrip(
    ctx: zmq.Context[zmq.Socket[bytes]], transport: str, tmp_path: Path
) -> None:
    big = os.urandom(300_000)
    async with pair(ctx, endpoint(transport, tmp_path)) as (a, b):
        with trio.fail_after(10):
            tracker = await b.send_multipart(
                [b"head", b"", bytearray(b"x" * 10), big], copy_threshold=65536
            )
            msg = await a.recv_multipart()
            await a.send_multipart([memoryview(big)[:1000]])
            back = await b.recv_multipart()
        assert isinstance(msg[0], zmq.Frame)
        assert payloads(msg) == [b"head", b"", b"x" * 10, big]
        assert payloads(back) == [big[:1000]]
        del msg  # over inproc the received frames are the sent buffers
        with trio.fail_after(10):
            await tracker.wait()
        assert tracker.done


async def test_bound_endpoints_resolve_wildcards(
    ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    async with open_zmq_socket(ctx, zmq.PULL, bind=["tcp://127.0.0.1:*", "ipc://*"]) as s:
        tcp, ipc = s.bound_endpoints
        assert tcp.startswith("tcp://127.0.0.1:")
        assert int(tcp.rsplit(":", 1)[1]) > 0
        assert ipc.startswith("ipc://")


async def test_ipc_file_is_removed_after_close(
    ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path
) -> None:
    path = tmp_path / "node.ipc"
    async with open_zmq_socket(ctx, zmq.ROUTER, bind=f"ipc://{path}"):
        assert await trio.Path(path).exists()
    assert not await trio.Path(path).exists()


async def test_ipc_wildcard_files_are_removed_after_close(
    ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    async with open_zmq_socket(ctx, zmq.ROUTER, bind="ipc://*") as sock:
        path = trio.Path(sock.bound_endpoints[0].removeprefix("ipc://"))
        assert await path.exists()
        assert tmp_path in Path(path).parents
    with trio.fail_after(5):  # libzmq removes them from its I/O thread, shortly after close
        while await path.parent.exists():
            await trio.sleep(0.001)


async def test_nowait_operations(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    async with pair(ctx, "inproc://nowait") as (a, b):
        with pytest.raises(trio.WouldBlock):
            a.recv_multipart_nowait()
        b.send_multipart_nowait([b"1", b"2"])
        assert payloads(a.recv_multipart_nowait()) == [b"1", b"2"]
        with pytest.raises(ValueError, match="at least one frame"):
            b.send_multipart_nowait([])
        with pytest.raises(TypeError, match="frame 1 is a str"):
            b.send_multipart_nowait([b"ok", "text"])  # type: ignore[list-item]
        with pytest.raises(trio.WouldBlock):  # the rejected message sent no part
            a.recv_multipart_nowait()


async def test_operations_checkpoint(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    async with pair(ctx, "inproc://checkpoints") as (a, b):
        with trio.testing.assert_checkpoints():
            await b.send_multipart([b"x"])
        with trio.testing.assert_checkpoints():
            await a.recv_multipart()
        with trio.testing.assert_checkpoints():
            await SendTracker().wait()


async def test_closed_socket_raises_and_wakes_parked_tasks(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    errors: list[BaseException] = []

    async def recv(sock: TrioSocket) -> None:
        try:
            await sock.recv_multipart()
        except trio.ClosedResourceError as exc:
            errors.append(exc)

    async with open_zmq_socket(ctx, zmq.DEALER, bind="inproc://closing") as sock:
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(recv, sock)  # the FD watcher
                nursery.start_soon(recv, sock)  # parked on the lot
                await trio.testing.wait_all_tasks_blocked()
                await sock.aclose()
    assert len(errors) == 2
    with pytest.raises(trio.ClosedResourceError):
        sock.send_multipart_nowait([b"x"])
    await sock.aclose()  # idempotent


async def test_cancelled_recv_loses_no_message(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    async with pair(ctx, "tcp://127.0.0.1:*") as (a, b):
        with trio.move_on_after(0.05) as scope:
            await a.recv_multipart()
        assert scope.cancelled_caught
        await b.send_multipart([b"after cancel"])
        with trio.fail_after(5):
            assert payloads(await a.recv_multipart()) == [b"after cancel"]


async def test_cancellation_storm_delivers_every_message_exactly_once(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """Receives are cancelled at random moments while messages arrive: none is lost or doubled."""
    rng = random.Random(7)
    n = 300
    got: list[int] = []
    async with pair(ctx, "tcp://127.0.0.1:*", (zmq.PULL, zmq.PUSH)) as (a, b):

        async def produce() -> None:
            for i in range(n):
                await b.send_multipart([i.to_bytes(4, "little"), b"tail"])
                if rng.random() < 0.3:
                    await trio.sleep(rng.random() * 1e-3)

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(produce)
                while len(got) < n:
                    with trio.move_on_after(rng.random() * 1e-3):
                        msg = await a.recv_multipart()
                        got.append(int.from_bytes(msg[0].bytes, "little"))
                        assert msg[1].bytes == b"tail"
    assert got == list(range(n))


async def test_concurrent_sender_and_receiver_on_one_dealer(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """Both tasks park on the same FD (small HWM) without BusyResourceError or lost wakeups."""
    n = 3000
    async with (
        open_zmq_socket(ctx, zmq.DEALER, bind="tcp://127.0.0.1:*", sndhwm=5, rcvhwm=5) as dealer,
        open_zmq_socket(
            ctx, zmq.DEALER, connect=dealer.bound_endpoints[0], sndhwm=5, rcvhwm=5
        ) as echo,
    ):

        async def echo_server() -> None:
            for _ in range(n):
                msg = await echo.recv_multipart()
                await echo.send_multipart(msg)

        async def send_all() -> None:
            for i in range(n):
                await dealer.send_multipart([str(i).encode(), b"x" * 100])

        received: list[int] = []

        async def recv_all() -> None:
            for _ in range(n):
                msg = await dealer.recv_multipart()
                received.append(int(msg[0].bytes))

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(echo_server)
                nursery.start_soon(recv_all)
                nursery.start_soon(send_all)
    assert received == list(range(n))


async def test_backpressure_parks_sender_until_peer_reads(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    async with pair(ctx, "inproc://backpressure", (zmq.PULL, zmq.PUSH)) as (pull, push):
        pull.socket.setsockopt(zmq.RCVHWM, 1)
        push.socket.setsockopt(zmq.SNDHWM, 1)
        queued = 0
        while True:
            try:
                push.send_multipart_nowait([b"m", str(queued).encode()])
            except trio.WouldBlock:
                break
            queued += 1
            assert queued < 10_000, "the high-water mark never applied"
        sent = trio.Event()

        async def blocked_send() -> None:
            await push.send_multipart([b"m", str(queued).encode()])
            sent.set()

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(blocked_send)
                await trio.testing.wait_all_tasks_blocked()
                assert not sent.is_set()
                got = [payloads(await pull.recv_multipart())[1] for _ in range(queued + 1)]
                await sent.wait()
    assert got == [str(i).encode() for i in range(queued + 1)]


async def test_cancelled_send_sends_nothing(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    async with pair(ctx, "inproc://cancel-send", (zmq.PULL, zmq.PUSH)) as (pull, push):
        pull.socket.setsockopt(zmq.RCVHWM, 1)
        push.socket.setsockopt(zmq.SNDHWM, 1)
        queued = 0
        while True:
            try:
                push.send_multipart_nowait([b"a", b"b", b"c"])
            except trio.WouldBlock:
                break
            queued += 1
        with trio.move_on_after(0.05) as scope:
            await push.send_multipart([b"cancelled", b"b", b"c"])
        assert scope.cancelled_caught
        got = []
        with trio.fail_after(5):
            for _ in range(queued):
                got.append(payloads(await pull.recv_multipart()))
        assert got == [[b"a", b"b", b"c"]] * queued
        with trio.move_on_after(0.05):
            extra = await pull.recv_multipart()
            pytest.fail(f"the cancelled send delivered {payloads(extra)}")


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
async def test_burst_of_10k_messages_drains(
    ctx: zmq.Context[zmq.Socket[bytes]], transport: str, tmp_path: Path
) -> None:
    n = 10_000
    async with pair(ctx, endpoint(transport, tmp_path), (zmq.PULL, zmq.PUSH)) as (pull, push):
        count = 0

        async def produce() -> None:
            for i in range(n):
                await push.send_multipart([i.to_bytes(4, "little")])

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(produce)
                # Let the burst pile up so the receiver must drain after a single wake-up.
                await trio.sleep(0.05)
                while count < n:
                    msg = await pull.recv_multipart()
                    assert int.from_bytes(msg[0].bytes, "little") == count
                    count += 1
        with pytest.raises(trio.WouldBlock):
            pull.recv_multipart_nowait()


async def test_two_receivers_share_a_socket(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    n = 2000
    seen: list[int] = []
    async with pair(ctx, "tcp://127.0.0.1:*", (zmq.PULL, zmq.PUSH)) as (pull, push):

        async def consume() -> None:
            while len(seen) < n:
                with trio.move_on_after(0.2):
                    msg = await pull.recv_multipart()
                    seen.append(int(msg[0].bytes))

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(consume)
                nursery.start_soon(consume)
                for i in range(n):
                    await push.send_multipart([str(i).encode()])
    assert sorted(seen) == list(range(n))


async def test_wake_nudges_the_fd_watcher_and_the_fd_is_watched_again(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """wake() interrupts the task parked on the FD (not as a close), and the next wait watches
    the FD again: the nudge drops trio's registration of it."""
    async with pair(ctx, "inproc://nudge", (zmq.DEALER, zmq.DEALER)) as (a, b):
        done = False
        results: list[object] = []

        async def until() -> None:
            results.append(await a.recv_multipart_until(lambda: done))

        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(until)
                await trio.testing.wait_all_tasks_blocked()
                a.wake()  # not done yet: it re-checks and parks again
                await trio.testing.wait_all_tasks_blocked()
                assert results == []
                done = True
                a.wake()
            assert results == [None]

            async def recv() -> None:
                results.append(payloads(await a.recv_multipart()))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(recv)
                await trio.testing.wait_all_tasks_blocked()
                await b.send_multipart([b"after"])
        assert results == [None, [b"after"]]


async def test_a_send_that_consumes_the_fd_edge_wakes_the_parked_receiver(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """The FD fires for a message, then another task's send processes libzmq's commands before
    the receiver ran: the edge is gone, so only the sender's wake-up can get the message read."""
    async with pair(ctx, "inproc://edge", (zmq.DEALER, zmq.DEALER)) as (a, b):
        got: list[list[bytes]] = []

        async def recv() -> None:
            got.append(payloads(await a.recv_multipart()))

        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(recv)
                await trio.testing.wait_all_tasks_blocked()  # recv watches a's FD
                b.send_multipart_nowait([b"hello"])  # a's FD fires...
                # libzmq processes commands on send at most once a millisecond or so: past that,
                # a's next send processes them (no checkpoint in between: recv cannot run yet)
                time.sleep(0.01)  # noqa: ASYNC251 (blocking on purpose: no checkpoint)
                a.send_multipart_nowait([b"out"])
                fd = a.socket.getsockopt(zmq.FD)
                assert not select.select([fd], [], [], 0)[0], "the send left the edge in place"
        assert got == [[b"hello"]]


async def test_a_refused_send_that_consumes_the_fd_edge_wakes_the_parked_receiver(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """As above, but the send fails (``ROUTER_MANDATORY``, the peer gone) after libzmq processed
    its commands: a node's notice to a peer that just left once ate the edge of a new peer's
    connection, and the node answered nothing more until some other command woke it (20 s of
    unanswered hellos in the suite)."""
    options = {zmq.ROUTER_MANDATORY: 1}
    async with (
        open_zmq_socket(ctx, zmq.ROUTER, bind="inproc://refused", options=options) as router,
        open_zmq_socket(ctx, zmq.DEALER) as dealer,
    ):
        got: list[list[bytes]] = []

        async def recv() -> None:
            got.append(payloads(await router.recv_multipart())[1:])

        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(recv)
                await trio.testing.wait_all_tasks_blocked()  # recv watches the router's FD
                dealer.connect("inproc://refused")  # the router's FD fires (a new pipe)...
                dealer.send_multipart_nowait([b"hello"])
                fd = router.socket.getsockopt(zmq.FD)
                assert select.select([fd], [], [], 1)[0]
                time.sleep(0.01)  # noqa: ASYNC251 (past libzmq's throttle; no checkpoint)
                with pytest.raises(zmq.ZMQError) as info:
                    router.send_multipart_nowait([b"gone-peer", b"notice"])
                assert info.value.errno == zmq.EHOSTUNREACH
                assert not select.select([fd], [], [], 0)[0], "the send left the edge in place"
        assert got == [[b"hello"]]


# ---------------------------------------------------------------------------- send tracker


async def test_tracker_covers_every_zero_copy_frame(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """Over inproc the receiver holds the sender's buffers: the tracker completes only when the
    receiver released every frame, not just the last one."""
    first = np.zeros(1 << 20, np.uint8)
    second = np.ones(1 << 20, np.uint8)
    async with pair(ctx, "inproc://tracker") as (a, b):
        tracker = await b.send_multipart([b"header", first.data, second.data], copy_threshold=1024)
        with trio.fail_after(5):
            msg = await a.recv_multipart()
        assert np.frombuffer(msg[1].buffer, np.uint8).ctypes.data == first.ctypes.data  # zero copy
        del msg[2]
        gc.collect()
        await trio.sleep(0.05)
        assert not tracker.done  # frame 1 still held by the receiver
        del msg
        gc.collect()
        with trio.fail_after(5):
            await tracker.wait()
        assert tracker.done


async def test_tracker_done_after_peer_receives_over_tcp(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    buf = np.arange(4 << 20, dtype=np.uint8)
    async with pair(ctx, "tcp://127.0.0.1:*") as (a, b):
        tracker = await b.send_multipart([buf.data])
        with trio.fail_after(10):
            msg = await a.recv_multipart()
            await tracker.wait()
        assert msg[0].bytes == buf.tobytes()


async def test_small_frames_are_copied_and_untracked(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    async with pair(ctx, "inproc://copied") as (a, b):
        tracker = await b.send_multipart([b"x" * 100, b"y" * 1000], copy_threshold=4096)
        assert tracker.done
        await a.recv_multipart()


# ----------------------------------------------------------------------------- CURVE / ZAP


async def expect_nothing(sock: TrioSocket, seconds: float) -> None:
    with trio.move_on_after(seconds):
        msg = await sock.recv_multipart()
        pytest.fail(f"an unauthenticated peer got through: {payloads(msg)}")


async def test_curve_refuses_unknown_clients_and_accepts_allowed_ones(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    server_keys, good, stranger = curve_keypair(), curve_keypair(), curve_keypair()
    async with open_zap_authenticator(ctx) as auth:
        auth.allow("nodes", [good.public])
        async with open_zmq_socket(
            ctx, zmq.PULL, bind="tcp://127.0.0.1:*", curve=CurveServer(server_keys, domain="nodes")
        ) as server:
            addr = server.bound_endpoints[0]
            refused_clients = [
                CurveClient(server_keys.public, stranger),  # key not allowed
                CurveClient(curve_keypair().public, good),  # wrong server key
                None,  # no CURVE at all
            ]
            for curve in refused_clients:
                async with open_zmq_socket(ctx, zmq.PUSH, connect=addr, curve=curve) as client:
                    await client.send_multipart([b"intruder"])
                    await expect_nothing(server, 0.3)
            assert auth.refused >= 1
            async with open_zmq_socket(
                ctx, zmq.PUSH, connect=addr, curve=CurveClient(server_keys.public, good)
            ) as client:
                await client.send_multipart([b"hello"])
                with trio.fail_after(10):
                    msg = await server.recv_multipart()
            assert payloads(msg) == [b"hello"]
            assert msg[0].get("User-Id") == good.public.decode()
            assert auth.accepted >= 1
            auth.revoke("nodes")
            async with open_zmq_socket(
                ctx, zmq.PUSH, connect=addr, curve=CurveClient(server_keys.public, good)
            ) as client:
                await client.send_multipart([b"revoked"])
                await expect_nothing(server, 0.3)


async def test_curve_server_without_authenticator_fails_closed(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    server_keys, client_keys = curve_keypair(), curve_keypair()
    async with (
        open_zmq_socket(
            ctx, zmq.PULL, bind="tcp://127.0.0.1:*", curve=CurveServer(server_keys)
        ) as server,
        open_zmq_socket(
            ctx,
            zmq.PUSH,
            connect=server.bound_endpoints[0],
            curve=CurveClient(server_keys.public, client_keys),
        ) as client,
    ):
        await client.send_multipart([b"no zap handler"])
        await expect_nothing(server, 0.3)


async def test_curve_any_key_policy_encrypts_without_client_allowlist(
    ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path
) -> None:
    server_keys = curve_keypair()
    async with open_zap_authenticator(ctx) as auth:
        auth.allow("open", None)
        async with (
            open_zmq_socket(
                ctx,
                zmq.PULL,
                bind=f"ipc://{tmp_path}/s",
                curve=CurveServer(server_keys, domain="open"),
            ) as server,
            open_zmq_socket(
                ctx,
                zmq.PUSH,
                connect=server.bound_endpoints[0],
                curve=CurveClient(server_keys.public, curve_keypair()),
            ) as client,
        ):
            await client.send_multipart([b"hi"])
            with trio.fail_after(10):
                assert payloads(await server.recv_multipart()) == [b"hi"]


def test_curve_keys_are_validated_and_secret_is_not_printed() -> None:
    keys = curve_keypair()
    assert len(keys.public) == 40
    assert keys.secret.decode() not in repr(keys)
    raw = zmq.utils.z85.decode(keys.public)
    assert CurveKeypair(raw, keys.secret).public == keys.public
    with pytest.raises(ValueError, match="40 bytes of Z85"):
        CurveKeypair(b"short", keys.secret)


async def test_only_one_zap_handler_per_context(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    async with open_zap_authenticator(ctx):
        with pytest.raises(zmq.ZMQError):
            async with open_zap_authenticator(ctx):
                pass  # pragma: no cover
