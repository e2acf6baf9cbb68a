"""NodeLink against a scripted peer: who receives, and that every message finds its waiter.

A requester receives on the link itself while no other task does (one task hop less per ask);
these tests pin down what must hold whoever receives: replies reach their own askers in any
order, unsolicited messages (credits) are handled while nobody asks, a link that closes fails a
requester parked on the socket, and cancelled requesters hand receiving back.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.lowlevel
import trio.testing
import zmq

from asyncflow_actors.actors import ActorCrashed
from asyncflow_actors.actors.remote import _protocol as P
from asyncflow_actors.actors.remote._link import NodeLink
from asyncflow_actors.actors.remote._wire import MessageRegistry, decode, encode
from asyncflow_actors.actors.remote._zmq import TrioSocket, open_zmq_socket

MAX = 1 << 20


class Peer:
    """The server side of a link, played by the test: it sees requests and answers at will."""

    def __init__(self, sock: TrioSocket, registry: MessageRegistry) -> None:
        self.sock = sock
        self.registry = registry
        self.identity = b""

    async def receive(self) -> tuple[dict[str, Any], object]:
        frames = await self.sock.recv_multipart()
        self.identity = frames[0].bytes
        return decode(frames[1:], registry=self.registry, max_message_bytes=MAX)

    async def send(self, meta: dict[str, Any], payload: object = None) -> None:
        frames = encode(meta, payload, registry=self.registry)
        await self.sock.send_multipart([self.identity, *frames])


@asynccontextmanager
async def linked(*, run: bool = True) -> AsyncIterator[tuple[NodeLink, Peer, trio.Nursery]]:
    ctx: zmq.Context[Any] = zmq.Context()
    endpoint = f"inproc://link-{random.getrandbits(64):x}"
    registry = MessageRegistry()
    try:
        async with (
            open_zmq_socket(ctx, zmq.ROUTER, bind=endpoint) as server,
            open_zmq_socket(ctx, zmq.DEALER, connect=endpoint) as client,
            trio.open_nursery() as nursery,
        ):
            link = NodeLink(client, registry, node="peer", max_message_bytes=MAX)
            link.open_credits("actor", 4)
            if run:
                nursery.start_soon(link.run)
            yield link, Peer(server, registry), nursery
            nursery.cancel_scope.cancel()
    finally:
        ctx.destroy(linger=0)


async def answer_all(peer: Peer, reply: Callable[[int], object]) -> None:
    """Answer every ask with ``reply(its payload)``, returning its credit with the reply."""
    while True:
        meta, payload = await peer.receive()
        assert meta["k"] == P.ASK
        assert isinstance(payload, int)
        await peer.send({"k": P.OK, "c": meta["c"], "t": "actor", "n": 1}, reply(payload))


async def test_after_a_loop_of_asks_unsolicited_messages_are_still_handled() -> None:
    async with linked() as (link, peer, nursery):
        with trio.fail_after(10):
            async with trio.open_nursery() as answering:
                answering.start_soon(answer_all, peer, lambda n: n * 10)
                for i in range(200):
                    assert await link.ask("actor", i) == i * 10
                answering.cancel_scope.cancel()
            # Nobody asks now. Tells use up the window (the peer returns no credit yet)...
            for i in range(4):
                await link.tell("actor", i)
            told = trio.Event()

            async def tell() -> None:
                await link.tell("actor", 4)
                told.set()

            nursery.start_soon(tell)
            await trio.sleep(0.05)
            assert not told.is_set()
            # ...so the credit the peer returns on its own must be received by run()'s task.
            await peer.send({"k": P.CREDIT, "t": "actor", "n": 1})
            await told.wait()


async def test_replies_out_of_order_reach_their_own_askers() -> None:
    async with linked() as (link, peer, nursery):
        results: dict[int, object] = {}

        async def ask(n: int) -> None:
            results[n] = await link.ask("actor", n)

        with trio.fail_after(10):
            for i in range(4):
                nursery.start_soon(ask, i)
            asks = [await peer.receive() for _ in range(4)]
            for meta, payload in reversed(asks):
                assert isinstance(payload, int)
                await peer.send({"k": P.OK, "c": meta["c"]}, -payload)
            while len(results) < 4:
                await trio.sleep(0.01)
        assert results == {0: 0, 1: -1, 2: -2, 3: -3}


async def test_concurrent_askers_each_get_their_own_reply_in_any_order() -> None:
    rng = random.Random(8)
    async with linked() as (link, peer, nursery):
        link.open_credits("actor", 1000)
        got: dict[int, object] = {}

        async def asker(k: int) -> None:
            for j in range(20):
                n = k * 1000 + j
                got[n] = await link.ask("actor", n)
                if rng.random() < 0.3:
                    await trio.lowlevel.checkpoint()

        async def shuffling_peer() -> None:
            held: list[tuple[dict[str, Any], object]] = []
            while True:
                with trio.move_on_after(0.005):
                    held.append(await peer.receive())
                    if len(held) < rng.randint(1, 6):
                        continue
                rng.shuffle(held)
                for meta, payload in held:
                    assert isinstance(payload, int)
                    await peer.send({"k": P.OK, "c": meta["c"]}, -payload)
                held.clear()

        nursery.start_soon(shuffling_peer)
        with trio.fail_after(20):
            async with trio.open_nursery() as askers:
                for k in range(8):
                    askers.start_soon(asker, k)
        assert got == {n: -n for n in got}
        assert len(got) == 8 * 20


async def test_a_closing_link_fails_a_requester_that_is_receiving() -> None:
    async with linked() as (link, peer, _):
        failed: list[BaseException] = []

        async def ask() -> None:
            try:
                await link.ask("actor", 1)
            except ActorCrashed as exc:
                failed.append(exc)

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask)
                await peer.receive()  # sent, never answered: the asker waits on the socket
                await trio.sleep(0.01)
                assert link._receiving
                link.close(P.NodeLost("the peer vanished"))
        assert len(failed) == 1
        assert isinstance(failed[0].error, P.NodeLost)


async def test_a_cancelled_requester_hands_receiving_back() -> None:
    async with linked() as (link, peer, nursery):
        with trio.move_on_after(0.05) as scope:
            await link.ask("actor", 1)  # receives on the socket until cancelled
        assert scope.cancelled_caught
        meta, _ = await peer.receive()
        # Its reply, late, is dropped; the credit riding on it still comes back (run()'s task).
        await peer.send({"k": P.OK, "c": meta["c"], "t": "actor", "n": 1}, 1)
        nursery.start_soon(answer_all, peer, lambda n: n + 1)
        with trio.fail_after(10):
            while link.credits["actor"].count != 4:
                await trio.sleep(0.01)
            assert await link.ask("actor", 41) == 42


async def test_a_request_is_answered_even_without_a_receiver_task() -> None:
    async with linked(run=False) as (link, peer, nursery):
        nursery.start_soon(answer_all, peer, lambda n: n * 2)
        with trio.fail_after(10):
            assert [await link.ask("actor", i) for i in range(5)] == [0, 2, 4, 6, 8]


@pytest.mark.parametrize("seed", range(3))
async def test_random_cancellations_lose_no_reply_and_no_credit(seed: int) -> None:
    rng = random.Random(seed)
    async with linked() as (link, peer, nursery):
        nursery.start_soon(answer_all, peer, lambda n: n)
        answered = 0

        async def asker() -> None:
            nonlocal answered
            for i in range(30):
                with trio.move_on_after(rng.choice([0, 1e-4, 1e-3, 1])):
                    assert await link.ask("actor", i) == i
                    answered += 1

        with trio.fail_after(30):
            async with trio.open_nursery() as askers:
                for _ in range(4):
                    askers.start_soon(asker)
            while link.credits["actor"].count != 4:  # every credit came back
                await trio.sleep(0.01)
            assert await link.ask("actor", 7) == 7
        assert answered > 0


async def test_an_answer_sent_just_before_the_peer_left_reaches_its_requester(
    tmp_path: Path,
) -> None:
    """A node answers ``SHUTDOWN`` and exits at once: its answer is queued on our socket when
    the monitor reports the dropped connection. The loop is held while both arrive, so the
    requester and the monitor wake in one batch, in an order trio picks at random: over 20
    rounds both orders come (a monitor that closed the link first failed the requester with
    ``NodeLost`` although its answer was there)."""
    registry = MessageRegistry()
    for n in range(20):
        assert await _ask_a_leaving_peer(f"ipc://{tmp_path}/peer-{n}.sock", registry) == "bye"


async def _ask_a_leaving_peer(endpoint: str, registry: MessageRegistry) -> object:
    ctx: zmq.Context[Any] = zmq.Context()
    bound, asked, go = threading.Event(), threading.Event(), threading.Event()

    def leaving_peer() -> None:
        server = ctx.socket(zmq.ROUTER)
        server.linger = -1  # the answer is flushed before the connection drops
        server.bind(endpoint)
        bound.set()
        identity, *frames = server.recv_multipart()
        meta, _ = decode(frames, registry=registry, max_message_bytes=MAX)
        asked.set()
        go.wait(10)
        server.send_multipart(
            [identity, *encode({"k": P.OK, "c": meta["c"]}, "bye", registry=registry)]
        )
        server.close()

    peer = threading.Thread(target=leaving_peer)
    peer.start()
    answer: list[object] = []
    try:
        bound.wait(10)
        async with (
            open_zmq_socket(ctx, zmq.DEALER, connect=endpoint) as client,
            trio.open_nursery() as nursery,
        ):
            link = NodeLink(client, registry, node="peer", max_message_bytes=MAX)
            nursery.start_soon(link.run)
            await trio.testing.wait_all_tasks_blocked()  # its monitor watches the socket

            async def requester() -> None:
                answer.append(await link.request(P.SHUTDOWN))

            nursery.start_soon(requester)
            with trio.fail_after(10):
                while not asked.is_set():
                    await trio.sleep(0.001)
                go.set()
                # the answer and the drop arrive while the loop is held (deliberately blocked)
                time.sleep(0.1)  # noqa: ASYNC251
                while link.closed is None or not answer:  # (a failed request raises)
                    await trio.sleep(0.001)
            nursery.cancel_scope.cancel()
    finally:
        go.set()
        peer.join(10)
        ctx.destroy(linger=0)
    return answer[0]
