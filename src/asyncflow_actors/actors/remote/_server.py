"""The node side of remote actors: host actors in this process for peers over a ROUTER socket.

``serve_node`` runs an actor system and answers the protocol of ``_protocol``: it spawns actors
from import paths restricted to an allowlist, forwards tells and asks to their mailboxes, sends
replies and credits back, and reports terminated actors. It never crashes on bad input: a
malformed or unknown message is counted in ``NodeServerStatistics`` and answered with an error
where the sender can be addressed.

Flow control: a peer may have at most ``capacity`` messages (the actor's mailbox size) in flight
to an actor; one credit comes back each time a message entered the mailbox, in batches.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import os
import typing
from collections.abc import Sequence
from typing import Any

import attrs
import outcome
import trio
import zmq

from .._actor import Actor, _class_mailbox
from .._cell import Reply
from .._errors import ActorCrashed, ActorError, NameTakenError
from .._ref import LocalActorRef
from .._supervisor import OneForOne, Restart, Strategy
from .._system import ActorSystem, open_actor_system
from . import _protocol as P
from ._typeinfo import register_actor_types, register_types
from ._wire import UnknownType, WireError, decode, encode
from ._zmq import CurveServer, TrioSocket, open_zap_authenticator, open_zmq_socket

log = logging.getLogger("asyncflow_actors.node")

DEFAULT_MAX_MESSAGE_BYTES = 1 << 31
SEND_TIMEOUT = 30.0  # seconds a reply may wait for a peer's pipe before it is dropped


class SpawnRefused(ActorError):
    """A spawn request named a class outside the node's allowlist, or not an ``Actor``."""


@attrs.frozen
class NodeServerStatistics:
    name: str
    actors: int
    peers: int
    received: int
    sent: int
    wire_errors: int
    unknown_targets: int
    spawn_refusals: int


@attrs.define(eq=False)
class _Hosted:
    name: str
    ref: LocalActorRef[Any]
    owner: bytes
    capacity: int
    inbox_send: trio.MemorySendChannel[tuple[bytes, str, int, object]]
    inbox_recv: trio.MemoryReceiveChannel[tuple[bytes, str, int, object]]
    raw: bool = False  # decode its messages' tensors as RawTensor (the class says raw_tensors)
    owed: int = 0  # credits to return to the owner
    backlog: int = 0  # messages in the inbox or held by the forwarder


def _allowed(target: str, allow: Sequence[str]) -> bool:
    module = target.partition(":")[0]
    return any(module == prefix or module.startswith(prefix + ".") for prefix in allow)


class NodeServer:
    """One node: an actor system plus the ROUTER socket its peers talk to."""

    def __init__(
        self,
        system: ActorSystem,
        sock: TrioSocket,
        *,
        name: str,
        allow: Sequence[str],
        max_message_bytes: int,
        peer_timeout: float,
    ) -> None:
        self.system = system
        self.sock = sock
        self.name = name
        self.allow = tuple(allow)
        self.max_message_bytes = max_message_bytes
        self.peer_timeout = peer_timeout
        self.registry = P.protocol_registry()
        self.hosted: dict[str, _Hosted] = {}
        self.last_seen: dict[bytes, float] = {}
        self.received = self.sent = self.wire_errors = self.unknown_targets = self.refusals = 0
        self.shutdown = trio.Event()
        self._nursery: trio.Nursery | None = None

    def statistics(self) -> NodeServerStatistics:
        return NodeServerStatistics(
            self.name,
            len(self.hosted),
            len(self.last_seen),
            self.received,
            self.sent,
            self.wire_errors,
            self.unknown_targets,
            self.refusals,
        )

    async def serve(self) -> None:
        """Answer peers until a ``shutdown`` request (then return) or cancellation."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._receive_loop)
            if math.isfinite(self.peer_timeout):
                nursery.start_soon(self._reap_peers)
            await self.shutdown.wait()
            nursery.cancel_scope.cancel()

    # -- sending -------------------------------------------------------------------------------

    def _encode(self, meta: dict[str, Any], payload: object) -> list[Any]:
        """Frames of a message; a reply whose value cannot be sent becomes an error reply."""
        try:
            return encode(meta, payload, registry=self.registry)
        except WireError as exc:
            if meta.get("k") != P.OK:
                raise
            info = P.error_info(exc, self.name)
            return encode({"k": P.ERR, "c": meta["c"]}, info, registry=self.registry)

    async def _send(self, peer: bytes, meta: dict[str, Any], payload: object = None) -> None:
        frames = self._encode(meta, payload)
        try:
            # bounded: a peer that went away must not hold a task forever
            with trio.move_on_after(SEND_TIMEOUT) as scope:
                await self.sock.send_multipart([peer, *frames])
                self.sent += 1
            if scope.cancelled_caught:
                log.info("node %s: gave up sending a %s to a peer", self.name, meta.get("k"))
        except (zmq.ZMQError, trio.ClosedResourceError) as exc:  # gone (ROUTER_MANDATORY)
            log.info("node %s: cannot reach peer: %s", self.name, exc)

    async def _reply_error(self, peer: bytes, corr: int, error: BaseException, actor: str) -> None:
        self._send_nowait(peer, {"k": P.ERR, "c": corr}, P.error_info(error, actor))
        await trio.lowlevel.checkpoint()

    # -- receiving -------------------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            if len(frames) < 2:
                self.wire_errors += 1
                continue
            peer = frames[0].bytes
            self.last_seen[peer] = trio.current_time()
            self.received += 1
            try:
                meta, payload = self._decode(frames[1:])
            except WireError as exc:
                self.wire_errors += 1
                log.warning("node %s: bad message from a peer: %s", self.name, exc)
                corr = exc.meta.get("c") if isinstance(exc.meta, dict) else None
                if isinstance(corr, int):
                    await self._reply_error(peer, corr, exc, self.name)
                continue
            await self._dispatch(peer, meta, payload)

    def _raw_for(self, meta: dict[str, Any]) -> bool:
        target = meta.get("t")
        hosted = self.hosted.get(target) if isinstance(target, str) else None
        return hosted is not None and hosted.raw

    def _decode(self, frames: Sequence[Any]) -> tuple[dict[str, Any], object]:
        try:
            return decode(
                frames,
                registry=self.registry,
                max_message_bytes=self.max_message_bytes,
                raw_tensors=self._raw_for,
            )
        except UnknownType as exc:
            # A spawn's kwargs may use the classes of the actor's own module: import it (within
            # the allowlist), learn its constructor's types, and decode again.
            meta = exc.meta if isinstance(exc.meta, dict) else {}
            target = meta.get("cls")
            if meta.get("k") != P.SPAWN or not isinstance(target, str):
                raise
            try:
                cls = self._import(target)
            except SpawnRefused:
                raise exc from None
            register_types(self.registry, *_init_hints(cls))
            return decode(frames, registry=self.registry, max_message_bytes=self.max_message_bytes)

    async def _dispatch(self, peer: bytes, meta: dict[str, Any], payload: object) -> None:
        kind = meta.get("k")
        corr = meta.get("c", 0)
        if not isinstance(corr, int):
            self.wire_errors += 1
            return
        assert self._nursery is not None
        if kind == P.PING:
            self._send_nowait(peer, {"k": P.PONG}, None)
        elif kind in (P.TELL, P.ASK):
            target = meta.get("t")
            hosted = self.hosted.get(target) if isinstance(target, str) else None
            if hosted is None:
                self.unknown_targets += 1
                if kind == P.ASK:
                    error = ActorCrashed(
                        str(target), None, detail=f"no such actor on node {self.name!r}"
                    )
                    await self._reply_error(peer, corr, error, str(target))
                else:
                    self._send_nowait(peer, {"k": P.GONE, "t": target}, None)
                return
            if hosted.backlog == 0:
                try:  # fast path: straight into the mailbox, no forwarder hop
                    self._deliver_nowait(hosted, peer, kind, corr, payload)
                except trio.WouldBlock:
                    pass
                else:
                    self._owe(hosted, 1)
                    return
            hosted.backlog += 1
            hosted.inbox_send.send_nowait((peer, kind, corr, payload))
        elif kind == P.HELLO:
            info = P.NodeInfo(self.name, os.getpid(), P.PROTOCOL_VERSION, tuple(self.hosted))
            self._send_nowait(peer, {"k": P.OK, "c": corr}, info)
        elif kind == P.SPAWN and isinstance(payload, P.SpawnRequest):
            self._nursery.start_soon(self._spawn, peer, corr, payload)
        elif kind == P.STOP:
            self._nursery.start_soon(self._stop, peer, corr, meta.get("t"))
        elif kind == P.STATS:
            await self._stats(peer, corr, meta.get("t"))
        elif kind == P.SHUTDOWN:
            self._send_nowait(peer, {"k": P.OK, "c": corr}, None)
            self.shutdown.set()
        else:
            self.wire_errors += 1
            await self._reply_error(
                peer, corr, WireError(f"unknown request kind {kind!r}"), self.name
            )

    # -- requests --------------------------------------------------------------------------------

    def _import(self, target: str) -> type[Actor[Any]]:
        if not isinstance(target, str) or target.count(":") != 1:
            raise SpawnRefused(f"spawn target must be 'package.module:Class', got {target!r}")
        if not _allowed(target, self.allow):
            raise SpawnRefused(
                f"{target!r} is not in node {self.name!r}'s allowlist {list(self.allow)}"
            )
        module_name, _, qualname = target.partition(":")
        try:
            obj: Any = importlib.import_module(module_name)
            for part in qualname.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            raise SpawnRefused(f"cannot import {target!r}: {exc}") from exc
        if not (isinstance(obj, type) and issubclass(obj, Actor)):
            raise SpawnRefused(f"{target!r} is not an Actor subclass")
        return obj

    async def _spawn(self, peer: bytes, corr: int, request: P.SpawnRequest) -> None:
        try:
            cls = self._import(request.target)
            accepts = register_actor_types(self.registry, cls)
            kwargs = dict(request.kwargs)
            ref = await self.system.spawn(
                lambda: cls(**kwargs),
                name=request.name,
                restart=Restart(request.restart),
                mailbox_size=request.mailbox_size
                if request.mailbox_size is not None
                else _class_mailbox(cls),
            )
        except (SpawnRefused, NameTakenError, ActorCrashed, ValueError, TypeError) as exc:
            if isinstance(exc, SpawnRefused):
                self.refusals += 1
            await self._reply_error(peer, corr, exc, request.name)
            return
        assert isinstance(ref, LocalActorRef)
        capacity = ref.statistics().mailbox_capacity
        credit = int(capacity) if math.isfinite(capacity) and capacity > 0 else 1024
        send, recv = trio.open_memory_channel[tuple[bytes, str, int, object]](math.inf)
        hosted = _Hosted(request.name, ref, peer, credit, send, recv)
        hosted.raw = bool(getattr(cls, "raw_tensors", False))
        self.hosted[request.name] = hosted
        assert self._nursery is not None
        self._nursery.start_soon(self._forward, hosted)
        self._nursery.start_soon(self._watch, hosted)
        self._send_nowait(
            peer, {"k": P.OK, "c": corr}, P.SpawnedInfo(request.name, accepts, credit)
        )

    async def _forward(self, hosted: _Hosted) -> None:
        """Move a hosted actor's backlog into its mailbox in order, waiting while it is full."""
        async for peer, kind, corr, msg in hosted.inbox_recv:
            try:
                if kind == P.TELL:
                    await hosted.ref.send(msg)
                else:
                    reply = self._reply_slot(hosted, peer, corr)
                    await hosted.ref._enqueue_ask(msg, reply)  # type: ignore[arg-type]
            except (ActorError, TypeError) as exc:
                if kind == P.ASK:
                    await self._reply_error(peer, corr, exc, hosted.name)
            finally:
                hosted.backlog -= 1
            self._owe(hosted, 1)

    def _deliver_nowait(
        self, hosted: _Hosted, peer: bytes, kind: str, corr: int, msg: object
    ) -> None:
        """Put one message in the mailbox now, or raise ``trio.WouldBlock``; errors are answered."""
        try:
            if kind == P.TELL:
                hosted.ref.send_nowait(msg)
            else:
                hosted.ref._enqueue_ask_nowait(msg, self._reply_slot(hosted, peer, corr))  # type: ignore[arg-type]
        except (ActorError, TypeError) as exc:
            if kind == P.ASK:
                self._send_nowait(peer, {"k": P.ERR, "c": corr}, P.error_info(exc, hosted.name))

    def _reply_slot(self, hosted: _Hosted, peer: bytes, corr: int) -> Reply:
        """A reply slot that sends the answer from the actor's own resolution, with no task."""

        def answer(result: outcome.Outcome[Any]) -> None:
            meta: dict[str, Any] = {"k": P.OK, "c": corr}
            payload: object
            if isinstance(result, outcome.Error):
                meta["k"] = P.ERR
                payload = P.error_info(result.error, hosted.name)
            else:
                payload = result.unwrap()
            if hosted.owed and peer == hosted.owner:  # piggyback the credits we owe
                meta["t"], meta["n"], hosted.owed = hosted.name, hosted.owed, 0
            self._send_nowait(peer, meta, payload)

        return Reply(callback=answer)

    def _owe(self, hosted: _Hosted, n: int) -> None:
        hosted.owed += n
        if hosted.owed >= max(1, hosted.capacity // 2):
            meta = {"k": P.CREDIT, "t": hosted.name, "n": hosted.owed}
            hosted.owed = 0
            self._send_nowait(hosted.owner, meta, None)

    def _send_nowait(self, peer: bytes, meta: dict[str, Any], payload: object) -> None:
        """Encode and queue a message without waiting (the ROUTER has no high-water mark)."""
        try:
            self.sock.send_multipart_nowait([peer, *self._encode(meta, payload)])
            self.sent += 1
        except trio.WouldBlock:
            assert self._nursery is not None
            self._nursery.start_soon(self._send, peer, meta, payload)
        except (zmq.ZMQError, trio.ClosedResourceError) as exc:
            log.info("node %s: cannot reach peer: %s", self.name, exc)
        except Exception:  # called from inside actors: never let it escape into them
            log.exception("node %s: failed to send a %s", self.name, meta.get("k"))

    async def _watch(self, hosted: _Hosted) -> None:
        cell = hosted.ref._cell
        await cell.terminated.wait()
        if self.hosted.get(hosted.name) is hosted:
            del self.hosted[hosted.name]
        hosted.inbox_send.close()
        error = cell.last_error
        info = P.error_info(ActorCrashed(hosted.name, error), hosted.name)
        self._send_nowait(hosted.owner, {"k": P.GONE, "t": hosted.name}, info)

    async def _stop(self, peer: bytes, corr: int, target: object) -> None:
        hosted = self.hosted.get(target) if isinstance(target, str) else None
        if hosted is not None:
            await hosted.ref.stop()
        self._send_nowait(peer, {"k": P.OK, "c": corr}, None)

    async def _stats(self, peer: bytes, corr: int, target: object) -> None:
        hosted = self.hosted.get(target) if isinstance(target, str) else None
        if hosted is None:
            error = ActorCrashed(str(target), None, detail=f"no such actor on node {self.name!r}")
            await self._reply_error(peer, corr, error, str(target))
            return
        stats = P.RemoteStatistics.of(hosted.ref.statistics())
        self._send_nowait(peer, {"k": P.OK, "c": corr}, stats)

    async def _reap_peers(self) -> None:
        """Stop the actors of peers that stopped talking (their systems died or left)."""
        while True:
            await trio.sleep(self.peer_timeout / 4)
            deadline = trio.current_time() - self.peer_timeout
            for peer in [p for p, seen in self.last_seen.items() if seen < deadline]:
                del self.last_seen[peer]
                for hosted in [h for h in self.hosted.values() if h.owner == peer]:
                    log.warning("node %s: peer gone, stopping %s", self.name, hosted.name)
                    await hosted.ref.stop()


def _init_hints(cls: type) -> list[object]:
    try:
        init = vars(cls).get("__init__") or next(
            (vars(k)["__init__"] for k in cls.__mro__ if "__init__" in vars(k)), None
        )
        return list(typing.get_type_hints(init).values()) if init is not None else []
    except Exception:
        return []


async def serve_node(
    bind: str | Sequence[str],
    *,
    allow: Sequence[str],
    name: str = "node",
    curve: CurveServer | None = None,
    authorized_keys: Sequence[bytes] | None = None,
    strategy: Strategy | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    peer_timeout: float = math.inf,
    context: zmq.Context[Any] | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a node until a peer asks it to shut down (or the caller cancels it).

    ``bind``: endpoints (``tcp://127.0.0.1:*`` picks a port); ``task_status.started`` reports the
    resolved ones. ``allow``: module prefixes actors may be spawned from. ``curve``: require
    CURVE; ``authorized_keys`` (Z85 public keys) limits which clients may connect (``None``:
    any client that knows the server's public key). ``peer_timeout``: stop a peer's actors once
    it has been silent that long (a client heartbeats; ``inf`` disables).
    """
    ctx = context if context is not None else zmq.Context.instance()
    chosen = strategy if strategy is not None else OneForOne(max_restarts=3, within=5.0)
    async with contextlib.AsyncExitStack() as stack:
        if curve is not None:
            auth = await stack.enter_async_context(open_zap_authenticator(ctx))
            auth.allow(curve.domain, list(authorized_keys) if authorized_keys is not None else None)
        system = await stack.enter_async_context(open_actor_system(strategy=chosen))
        sock = await stack.enter_async_context(
            open_zmq_socket(
                ctx,
                zmq.ROUTER,
                bind=bind,
                curve=curve,
                options={zmq.ROUTER_MANDATORY: 1},
                sndhwm=0,
                rcvhwm=0,
            )
        )
        server = NodeServer(
            system,
            sock,
            name=name,
            allow=allow,
            max_message_bytes=max_message_bytes,
            peer_timeout=peer_timeout,
        )
        task_status.started(list(sock.bound_endpoints))
        await server.serve()
