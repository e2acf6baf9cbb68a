"""Who may say where a node listens (issue #27 §1 item 2): its supervisor and the node's owner;
a stranger's hello, an address inside a message or a ``PEERS`` update from a non-owner never
re-point a known node. Real node processes, and a rogue DEALER speaking the node protocol."""

from __future__ import annotations

from typing import Any

import trio
import zmq

import asyncflow_actors as afa
from asyncflow_actors.actors.remote import (
    ActorAddress,
    decode,
    encode,
    open_zmq_socket,
    protocol_registry,
)
from asyncflow_actors.actors.remote import _protocol as P
from tests.remote.light_actors import Forward, Forwarder, Hello, Hi

ALLOW = ["tests.remote"]
BOGUS = ("tcp://127.0.0.1:9",)  # where the stranger says the node is now (nothing listens)
NEWEST = 1 << 62  # an incarnation newer than any real one


async def _rogue(address: str, *requests: tuple[str, object]) -> list[tuple[str, object]]:
    """Send node-protocol requests from a fresh connection; the kind and payload of each reply."""
    registry = protocol_registry()
    replies = []
    async with open_zmq_socket(zmq.Context.instance(), zmq.DEALER, connect=address) as sock:
        for corr, (kind, payload) in enumerate(requests, 1):
            await sock.send_multipart(encode({"k": kind, "c": corr}, payload, registry=registry))
            with trio.fail_after(10):
                meta, body = decode(
                    await sock.recv_multipart(), registry=registry, max_message_bytes=1 << 20
                )
            replies.append((meta["k"], body))
    return replies


def _tcp(endpoints: Any) -> str:
    return next(e for e in endpoints if e.startswith("tcp://"))


def _stranger(name: str) -> P.Hello:
    return P.Hello(name, NEWEST, BOGUS, session="stranger")


async def test_a_strangers_hello_or_an_address_does_not_repoint_a_supervised_node() -> None:
    async with afa.open_actor_system() as system:
        b = await system.start_node("b", allow=ALLOW)
        peer = system.mesh.peers["b"]
        before = (peer.incarnation, peer.endpoints)
        # a local process connects to the driver claiming to be b, newer than b
        [(kind, _)] = await _rogue(_tcp(system.mesh.endpoints), (P.HELLO, _stranger("b")))
        assert kind == P.OK
        assert (peer.incarnation, peer.endpoints) == before
        # an address naming b inside a message is hearsay too
        system.mesh.resolve(ActorAddress("b", "anyone", BOGUS, NEWEST, ""))
        assert (peer.incarnation, peer.endpoints) == before
        hello = await b.spawn(Hello, name="hello")
        assert await hello.ask(Hi("x")) == "hello:x"


async def test_a_peers_update_from_a_non_owner_is_refused_and_changes_nothing() -> None:
    async with afa.open_actor_system() as system:
        a = await system.start_node("a", allow=ALLOW)
        b = await system.start_node("b", allow=ALLOW)
        forwarder = await a.spawn(Forwarder, name="forwarder")
        hello = await b.spawn(Hello, name="hello")
        assert await forwarder.ask(Forward(hello, "0")) == "hello:0"  # A's link to B is up
        # a stranger tells A that B moved (and claims B's name in its hello first)
        update = P.PeerUpdate("b", NEWEST, BOGUS, up=True)
        replies = await _rogue(a.address, (P.HELLO, _stranger("b")), (P.PEERS, update))
        assert replies[0][0] == P.OK
        kind, error = replies[1]
        assert kind == P.ERR
        assert isinstance(error, P.ErrorInfo) and error.type_name.endswith("NotAuthorized")
        # A still reaches B where B really is: its link was neither dropped nor re-pointed
        assert await forwarder.ask(Forward(hello, "1")) == "hello:1"
