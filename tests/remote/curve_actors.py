"""An actor the per-node CURVE tests place on nodes: with its own node's keypair, it speaks the
node protocol to another system as someone else (issue #27 §1 item 2). No torch imported."""

from __future__ import annotations

from typing import Any

import attrs
import trio
import zmq

import asyncflow_actors as afa
from asyncflow_actors.actors.remote import (
    CurveClient,
    decode,
    encode,
    mesh_of,
    open_zmq_socket,
    protocol_registry,
)
from asyncflow_actors.actors.remote import _protocol as P

BOGUS = ("tcp://127.0.0.1:9",)  # where the impostor says a node is now (nothing listens)
NEWEST = 1 << 62  # an incarnation newer than any real one


@attrs.frozen
class Claim(afa.Request[tuple[str, ...]]):
    """Connect to ``address`` (a system whose key is ``server_key``) with this node's keypair,
    say hello as ``name``, then say ``name`` moved (``PEERS``). Replies, for each: ``"ok"`` or
    the error's type name."""

    address: str
    server_key: str
    name: str


@attrs.frozen
class Keys(afa.Request[tuple[str, str]]):
    """This node's keypair (public, secret): a test plays its old process with it."""


@attrs.frozen
class BoundKey(afa.Request[str]):
    """The key this node binds ``name`` to ("" if none)."""

    name: str


@attrs.frozen
class Unauthorized(afa.Request[int]):
    """How many requests this node's server refused as not authorized."""


class Impostor(afa.Actor[Claim | Keys | BoundKey | Unauthorized]):
    async def receive(self, msg: Any, ctx: afa.ActorContext[Any]) -> Any:
        await trio.lowlevel.checkpoint()
        mesh = mesh_of(ctx.system)
        keys = mesh.keys
        assert keys is not None
        if isinstance(msg, Keys):
            return keys.keypair.public.decode(), keys.keypair.secret.decode()
        if isinstance(msg, BoundKey):
            return keys.bound.get(msg.name, b"").decode()
        if isinstance(msg, Unauthorized):
            assert mesh.server is not None
            return mesh.server.statistics().unauthorized
        hello = P.Hello(msg.name, NEWEST, BOGUS, "impostor")
        moved = P.PeerUpdate(msg.name, NEWEST, BOGUS, True, key=keys.keypair.public.decode())
        curve = CurveClient(msg.server_key, keys.keypair)
        return await speak(msg.address, curve, [(P.HELLO, hello), (P.PEERS, moved)])


async def speak(
    address: str,
    curve: CurveClient | None,
    requests: list[tuple[str, object]],
    *,
    within: float = 10,
    routing_id: bytes | None = None,
) -> tuple[str, ...]:
    """Send node-protocol requests over one fresh connection (with ``routing_id``, the
    connection's chosen routing id); ``"ok"`` or the error's type name for each.
    ``trio.TooSlowError`` if no answer comes within ``within`` s (refused)."""
    registry = protocol_registry()
    out = []
    options = {} if routing_id is None else {zmq.ROUTING_ID: routing_id}
    async with open_zmq_socket(
        zmq.Context.instance(), zmq.DEALER, connect=address, curve=curve, options=options
    ) as sock:
        for corr, (kind, payload) in enumerate(requests, 1):
            await sock.send_multipart(encode({"k": kind, "c": corr}, payload, registry=registry))
            with trio.fail_after(within):
                meta, body = decode(
                    await sock.recv_multipart(), registry=registry, max_message_bytes=1 << 20
                )
            if meta["k"] == P.OK:
                out.append("ok")
            else:
                assert isinstance(body, P.ErrorInfo)
                out.append(body.type_name.rpartition(":")[2].rpartition(".")[2])
    return tuple(out)
