"""The receiving side of a system: serve its actors to peers over one ROUTER socket.

Every actor system of a run that talks to others has a ``NodeServer`` (the driver included).
Peers reach any of its actors by path: ``resolve`` gives them a credit window, then their tells
and asks go straight into the actor's mailbox, and replies, credits, rejections and ``gone``
notices go back. A node (``python -m asyncflow_actors.node``) also spawns actors for peers, from
import paths restricted to an allowlist.

It never crashes on bad input: a malformed or unknown message (the protocol's own messages
have every field checked against its annotation as they are decoded) is counted in
``NodeServerStatistics`` and answered (an error reply, or a ``reject`` that returns the sender's
credit) wherever the sender can be addressed; an unexpected error while handling a request is
logged and answered as that request's error reply.

Flow control is per sender: each peer may have at most ``capacity`` (the mailbox size) messages
in flight to an actor; one credit goes back to *that* peer each time one of its messages enters
the mailbox (in batches, or piggybacked on replies). A peer that ignores its window is refused,
so what one actor's inbox holds is bounded by its peers' windows.

Authorization: only the peer that spawned an actor, the node's owner (the process that started
it, proven by its owner token), or a peer presenting the actor's stop token (carried by refs to
it) may stop it; only the owner may shut the node down; only the owner (or, under CURVE, a key
that directs: any member of the cluster in the cluster key model, the supervisors' in the node
model) may say where other nodes listen (``PEERS``). Under CURVE every connection's messages
carry the key it proved (ZAP's ``User-Id``), and a hello claiming a name bound to another key
is refused. Refusals are answered ``NotAuthorized`` and counted (``unauthorized``).
"""

from __future__ import annotations

import logging
import math
import os
import secrets
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import outcome
import trio
import zmq

from .._cell import ActorCell, Reply
from .._errors import ActorCrashed, ActorError
from .._ref import LocalActorRef
from .._system import ActorSystem
from . import _protocol as P
from ._curve import user_id
from ._hosting import NotAuthorized, learn_type
from ._sessions import PeerState, Sessions, source_fd
from ._spawning import spawn_for, stop_for
from ._typeinfo import register_actor_types
from ._wire import MalformedMessage, UnknownType, WireError, decode, encode
from ._zmq import TrioSocket

if TYPE_CHECKING:
    from ._mesh import Mesh

log = logging.getLogger("asyncflow_actors.node")

DEFAULT_MAX_MESSAGE_BYTES = 1 << 31
SEND_TIMEOUT = 30.0  # seconds a reply may wait for a peer's pipe before it is dropped
ROUTER_RCVHWM = 8192  # messages libzmq buffers per peer before it stops reading that peer
_MAX_LEARNED_TYPES = 16  # new types one message may make a node import and register


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
    rejected: int = 0
    received_bytes: int = 0
    sent_bytes: int = 0
    failed_requests: int = 0  # unexpected errors while handling a request (answered, logged)
    # requests refused as not authorized: a hello claiming a name bound to another CURVE key,
    # a PEERS update from neither the owner nor a supervisor, a shutdown from a non-owner
    unauthorized: int = 0


@attrs.define(eq=False)
class _Window:
    """One sender's flow-control state for one served actor."""

    in_flight: int = 0  # messages received from it whose credit has not gone back yet
    owed: int = 0  # of those, the ones already in the mailbox: credit to return


@attrs.define(eq=False)
class _Served:
    path: str
    ref: LocalActorRef[Any]
    capacity: int
    inbox_send: trio.MemorySendChannel[tuple[bytes, str, int, object]]
    inbox_recv: trio.MemoryReceiveChannel[tuple[bytes, str, int, object]]
    raw: bool = False  # decode its messages' tensors as RawTensor (the class says raw_tensors)
    spawner: str | None = None  # the session that spawned it here (None: a local actor)
    windows: dict[bytes, _Window] = attrs.Factory(dict)
    backlog: int = 0  # messages in the inbox or held by the forwarder
    # credits go back in batches of this many (or piggybacked on a reply before that)
    credit_batch: int = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.credit_batch = max(1, self.capacity // 2)


def _credit_window(capacity: float) -> int:
    return int(capacity) if math.isfinite(capacity) and capacity > 0 else 1024


class NodeServer:
    """One system's ROUTER socket and the actors it serves (see the module docstring)."""

    def __init__(
        self,
        mesh: Mesh,
        sock: TrioSocket,
        *,
        allow: Sequence[str] = (),
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        peer_timeout: float = math.inf,
        owner_token: str = "",
        on_shutdown: Callable[[], None] | None = None,
    ) -> None:
        self.mesh = mesh
        self.system: ActorSystem = mesh.system
        self.sock = sock
        self.name = mesh.name
        self.allow = tuple(allow)
        self.max_message_bytes = max_message_bytes
        self.peer_timeout = peer_timeout
        self.owner_token = owner_token
        self.on_shutdown = on_shutdown
        self.registry = mesh.registry
        self.served: dict[str, _Served] = {}
        self.sessions = Sessions()
        self.peers = self.sessions.peers
        self.received = self.sent = self.wire_errors = self.unknown_targets = 0
        self.refusals = self.rejected = self.failed_requests = self.unauthorized = 0
        self.received_bytes = self.sent_bytes = 0
        self._nursery: trio.Nursery | None = None

    def statistics(self) -> NodeServerStatistics:
        connected = sum(1 for p in self.peers.values() if p.disconnected_at is None)
        return NodeServerStatistics(
            self.name,
            len(self.served),
            connected,
            self.received,
            self.sent,
            self.wire_errors,
            self.unknown_targets,
            self.refusals,
            self.rejected,
            self.received_bytes,
            self.sent_bytes,
            self.failed_requests,
            self.unauthorized,
        )

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Answer peers until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self.sessions.watch, self.sock, self._peer_dropped)
            if math.isfinite(self.peer_timeout):
                nursery.start_soon(self.sessions.reap, self.peer_timeout, self._peer_gone)
            task_status.started()
            await self._receive_loop()

    # -- sending -------------------------------------------------------------------------------

    def _encode(self, meta: dict[str, Any], payload: object) -> list[Any]:
        """Frames of a message; a reply whose value cannot be sent becomes an error reply."""
        try:
            return encode(
                meta,
                payload,
                registry=self.registry,
                address_of=self.mesh.address_of,
                auto_register=True,
            )
        except WireError as exc:
            if meta.get("k") != P.OK:
                raise
            info = P.error_info(exc, self.name)
            error_meta = {k: v for k, v in meta.items() if k != "k"}
            return encode({"k": P.ERR, **error_meta}, info, registry=self.registry)

    async def _send(self, peer: bytes, meta: dict[str, Any], payload: object = None) -> None:
        frames = self._encode(meta, payload)
        try:
            # bounded: a peer that went away must not hold a task forever
            with trio.move_on_after(SEND_TIMEOUT) as scope:
                await self.sock.send_multipart([peer, *frames])
                self.sent += 1
                self.sent_bytes += _nbytes(frames)
            if scope.cancelled_caught:
                log.info("node %s: gave up sending a %s to a peer", self.name, meta.get("k"))
        except (zmq.ZMQError, trio.ClosedResourceError) as exc:  # gone (ROUTER_MANDATORY)
            log.info("node %s: cannot reach peer: %s", self.name, exc)

    def send_nowait(self, peer: bytes, meta: dict[str, Any], payload: object) -> None:
        """Encode and queue a message without waiting (the ROUTER has no send high-water mark)."""
        try:
            frames = self._encode(meta, payload)
            self.sock.send_multipart_nowait([peer, *frames])
            self.sent += 1
            self.sent_bytes += _nbytes(frames)
        except trio.WouldBlock:
            assert self._nursery is not None
            self._nursery.start_soon(self._send, peer, meta, payload)
        except (zmq.ZMQError, trio.ClosedResourceError) as exc:
            log.info("node %s: cannot reach peer: %s", self.name, exc)
        except Exception:  # called from inside actors: never let it escape into them
            log.exception("node %s: failed to send a %s", self.name, meta.get("k"))

    def reply_error(
        self, peer: bytes, corr: int, error: BaseException, actor: str, **extra: Any
    ) -> None:
        self.send_nowait(peer, {"k": P.ERR, "c": corr, **extra}, P.error_info(error, actor))

    # -- receiving -------------------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        recv = self.sock.recv_multipart
        peers = self.peers
        while True:
            frames = await recv()
            if len(frames) < 2:
                self.wire_errors += 1
                continue
            peer = frames[0].bytes
            state = peers.get(peer)
            key = user_id(frames[1]) if self.mesh.keys is not None else b""
            if state is None or state.key != key:
                # a new peer, or a new connection under a routing id another key used before
                # (a client may choose its routing id): it inherits nothing of that peer's
                state = peers[peer] = PeerState(peer, key=key, fd=source_fd(frames[1]))
            state.disconnected_at = None
            self.received += 1
            self.received_bytes += sum([len(f) for f in frames])  # zmq.Frame: its byte size
            try:
                meta, payload = self._decode(frames[1:])
            except WireError as exc:
                self._refuse(peer, exc)
                continue
            except Exception as exc:  # learning a type ran foreign code: still the sender's fault
                self._refuse(peer, MalformedMessage(f"{type(exc).__name__}: {exc}"))
                continue
            try:
                self._dispatch(peer, state, meta, payload)
            except Exception as exc:  # a bug must cost one request, never the server
                self._failed(peer, meta, exc)

    def _failed(self, peer: bytes, meta: dict[str, Any], exc: Exception) -> None:
        """An unexpected error while handling a request: log it, answer it as an error."""
        self.failed_requests += 1
        log.error("node %s: handling a %r failed", self.name, meta.get("k"), exc_info=exc)
        corr = meta.get("c")
        if isinstance(corr, int):
            self.reply_error(peer, corr, exc, self.name)

    def _refuse(self, peer: bytes, exc: WireError) -> None:
        """Answer an undecodable message so its sender learns, and gets its credit back."""
        self.wire_errors += 1
        log.warning("node %s: bad message from a peer: %s", self.name, exc)
        meta = exc.meta if isinstance(exc.meta, dict) else {}
        corr, kind, target = meta.get("c"), meta.get("k"), meta.get("t")
        served = self.served.get(target) if isinstance(target, str) else None
        credit = served is not None and kind in (P.TELL, P.ASK)  # it used one: give it back
        extra = {"t": target, "n": 1} if credit else {}
        if isinstance(corr, int):
            self.rejected += 1
            self.reply_error(peer, corr, exc, self.name, **extra)
        elif kind == P.TELL and isinstance(target, str):
            self.rejected += 1
            meta_out = {"k": P.REJECT, "t": target, "n": 1 if credit else 0}
            self.send_nowait(peer, meta_out, P.error_info(exc, target))

    def _raw_for(self, meta: dict[str, Any]) -> bool:
        target = meta.get("t")
        served = self.served.get(target) if isinstance(target, str) else None
        return served is not None and served.raw

    def _decode(self, frames: Sequence[Any]) -> tuple[dict[str, Any], object]:
        for _ in range(_MAX_LEARNED_TYPES):
            try:
                return decode(
                    frames,
                    registry=self.registry,
                    max_message_bytes=self.max_message_bytes,
                    raw_tensors=self._raw_for,
                    resolve=self.mesh.resolve,
                )
            except UnknownType as exc:
                if not learn_type(self.registry, exc, self.allow, self.name):
                    raise
        raise MalformedMessage(f"a message naming more than {_MAX_LEARNED_TYPES} new types")

    def _dispatch(
        self, peer: bytes, state: PeerState, meta: dict[str, Any], payload: object
    ) -> None:
        """Act on one message without waiting (the receive loop's own wait is its checkpoint:
        a scheduling round per message less on the path of every remote ask)."""
        kind = meta.get("k")
        corr = meta.get("c", 0)
        if not isinstance(corr, int):
            self.wire_errors += 1
            return
        assert self._nursery is not None
        if kind in (P.TELL, P.ASK):
            self._deliver(peer, kind, corr, meta.get("t"), payload)
        elif kind == P.PING:
            self.send_nowait(peer, {"k": P.PONG}, None)
        elif kind == P.HELLO and isinstance(payload, P.Hello):
            self._hello(peer, state, corr, payload)
        elif kind == P.RESOLVE:
            self._resolve(peer, corr, meta.get("t"))
        elif kind == P.SPAWN and isinstance(payload, P.SpawnRequest):
            self._nursery.start_soon(self._guarded, spawn_for, peer, meta, state, corr, payload)
        elif kind == P.STOP:
            self._nursery.start_soon(self._guarded, stop_for, peer, meta, state, corr, meta)
        elif kind == P.STATS:
            self._stats(peer, corr, meta.get("t"))
        elif kind == P.PEERS and isinstance(payload, P.PeerUpdate):
            if not (state.owner or self._directs(state)):
                # where other nodes listen is the word of our owner (their supervisor) only
                error = NotAuthorized("only the node's owner may say where its peers are")
                self._unauthorized(peer, corr, error)
                return
            self.mesh.peer_update(payload)
            self.send_nowait(peer, {"k": P.OK, "c": corr}, None)
        elif kind == P.SHUTDOWN:
            if not state.owner:
                error = NotAuthorized("only the node's owner may shut it down")
                self._unauthorized(peer, corr, error)
                return
            self.send_nowait(peer, {"k": P.OK, "c": corr}, None)
            if self.on_shutdown is not None:
                self.on_shutdown()
        else:
            self.wire_errors += 1
            unknown = WireError(
                f"a {kind!r} request cannot carry a {type(payload).__name__}"
                if kind in (P.HELLO, P.SPAWN, P.PEERS)
                else f"unknown request kind {kind!r}"
            )
            self.reply_error(peer, corr, unknown, self.name)

    # -- messages to actors -------------------------------------------------------------------------

    def _deliver(self, peer: bytes, kind: str, corr: int, target: object, msg: object) -> None:
        served = self.served.get(target) if isinstance(target, str) else None
        if served is None:
            self.unknown_targets += 1
            error = ActorCrashed(str(target), None, detail=f"no such actor on node {self.name!r}")
            if kind == P.ASK:
                self.reply_error(peer, corr, error, str(target))
            else:
                self.send_nowait(peer, {"k": P.GONE, "t": target}, P.error_info(error, str(target)))
            return
        window = served.windows.get(peer)
        if window is None:
            window = served.windows[peer] = _Window()
        window.in_flight += 1
        if window.in_flight > served.capacity:  # it ignored its window: refuse, bounded inbox
            window.in_flight -= 1
            self.rejected += 1
            refused = P.MessageRejected(f"{served.path!r}: more messages in flight than credits")
            if kind == P.ASK:
                self.reply_error(peer, corr, refused, served.path, t=served.path, n=1)
            else:
                meta = {"k": P.REJECT, "t": served.path, "n": 1}
                self.send_nowait(peer, meta, P.error_info(refused, served.path))
            return
        if served.backlog == 0:
            try:  # fast path: straight into the mailbox, no forwarder hop
                self._enqueue_nowait(served, peer, kind, corr, msg)
            except trio.WouldBlock:
                pass
            else:
                window.owed += 1
                if window.owed >= served.credit_batch:
                    self._owe(served, peer, 0)
                return
        served.backlog += 1
        served.inbox_send.send_nowait((peer, kind, corr, msg))

    async def _forward(self, served: _Served) -> None:
        """Move an actor's backlog into its mailbox in order, waiting while it is full."""
        async for peer, kind, corr, msg in served.inbox_recv:
            try:
                if kind == P.TELL:
                    await served.ref.send(msg)
                else:
                    reply = self._reply_slot(served, peer, corr)
                    await served.ref.enqueue_ask(msg, reply)
            except (ActorError, TypeError) as exc:
                if kind == P.ASK:
                    self.reply_error(peer, corr, exc, served.path)
            finally:
                served.backlog -= 1
            self._owe(served, peer, 1)

    def _enqueue_nowait(
        self, served: _Served, peer: bytes, kind: str, corr: int, msg: object
    ) -> None:
        """Put one message in the mailbox now, or raise ``trio.WouldBlock``; errors are answered."""
        try:
            if kind == P.TELL:
                served.ref.send_nowait(msg)
            else:
                reply = self._reply_slot(served, peer, corr)
                served.ref.enqueue_ask_nowait(msg, reply)
        except (ActorError, TypeError) as exc:
            if kind == P.ASK:
                self.reply_error(peer, corr, exc, served.path)

    def _reply_slot(self, served: _Served, peer: bytes, corr: int) -> Reply:
        """A reply slot that sends the answer from the actor's own resolution, with no task."""

        def answer(result: outcome.Outcome[Any]) -> None:
            meta: dict[str, Any] = {"k": P.OK, "c": corr}
            payload: object
            if isinstance(result, outcome.Error):
                meta["k"] = P.ERR
                payload = P.error_info(result.error, served.path)
            else:
                payload = result.unwrap()
            window = served.windows.get(peer)
            if window is not None and window.owed:  # piggyback the credits we owe this peer
                meta["t"], meta["n"] = served.path, window.owed
                window.in_flight -= window.owed
                window.owed = 0
            self.send_nowait(peer, meta, payload)

        return Reply(callback=answer)

    def _owe(self, served: _Served, peer: bytes, n: int) -> None:
        window = served.windows.get(peer)
        if window is None:
            return  # that peer's window was dropped (it reconnected or left)
        window.owed += n
        if window.owed >= served.credit_batch:
            meta = {"k": P.CREDIT, "t": served.path, "n": window.owed}
            window.in_flight -= window.owed
            window.owed = 0
            self.send_nowait(peer, meta, None)

    # -- requests --------------------------------------------------------------------------------

    async def _guarded(
        self, handler: Callable[..., Awaitable[None]], peer: bytes, meta: dict[str, Any], *args: Any
    ) -> None:
        """Run a request's handler task (``handler(server, peer, *args)``); an unexpected error
        becomes its error reply."""
        try:
            await handler(self, peer, *args)
        except Exception as exc:
            self._failed(peer, meta, exc)

    def _directs(self, state: PeerState) -> bool:
        """Whether the connection proved a key that may say where other nodes listen."""
        keys = self.mesh.keys
        return keys is not None and keys.directs(state.key)

    def _unauthorized(self, peer: bytes, corr: int, error: NotAuthorized) -> None:
        self.unauthorized += 1
        log.warning("node %s: refused a peer: %s", self.name, error)
        self.reply_error(peer, corr, error, self.name)

    def _hello(self, peer: bytes, state: PeerState, corr: int, hello: P.Hello) -> None:
        owner = bool(self.owner_token) and secrets.compare_digest(
            hello.owner_token, self.owner_token
        )
        keys = self.mesh.keys
        if keys is not None and not owner and keys.claim_refused(hello.name, self.name, state.key):
            # its name is bound to another key: whoever this is, it is not that system
            error = NotAuthorized(f"the name {hello.name!r} is bound to another CURVE key")
            self._unauthorized(peer, corr, error)
            return
        state.name, state.session, state.owner = hello.name, hello.session, owner
        self.mesh.peer_hello(hello, owner=owner, key=state.key, directs=self._directs(state))
        info = P.NodeInfo(
            self.name,
            os.getpid(),
            P.PROTOCOL_VERSION,
            tuple(p for p, s in self.served.items() if s.spawner is not None),
            self.mesh.incarnation,
            self.mesh.endpoints,
        )
        self.send_nowait(peer, {"k": P.OK, "c": corr}, info)

    def serve_actor(
        self, cell: ActorCell, *, spawner: str | None = None, raw: bool | None = None
    ) -> _Served:
        """Start serving a local actor to peers (idempotent): its inbox, forwarder and watch."""
        served = self.served.get(cell.path)
        if served is not None and served.ref.cell is cell:
            return served
        actor_cls = type(cell.actor) if cell.actor is not None else None
        if actor_cls is not None:
            register_actor_types(self.registry, actor_cls)
        send, recv = trio.open_memory_channel[tuple[bytes, str, int, object]](math.inf)
        served = _Served(
            cell.path,
            cell.ref,
            _credit_window(cell.mailbox_capacity),
            send,
            recv,
            raw=bool(getattr(actor_cls, "raw_tensors", False)) if raw is None else raw,
            spawner=spawner,
        )
        self.served[cell.path] = served
        assert self._nursery is not None
        self._nursery.start_soon(self._forward, served)
        self._nursery.start_soon(self._watch, served)
        return served

    def open_window(self, served: _Served, peer: bytes) -> None:
        """A fresh flow-control window for ``peer``'s messages to ``served``."""
        served.windows[peer] = _Window()

    def actor_info(self, served: _Served, *, token: bool) -> P.ActorInfo:
        """What a sender needs; the stop token only for the actor's spawner (a capability:
        others get it only inside a ref that someone holding it chose to send)."""
        cell = served.ref.cell
        actor_cls = type(cell.actor) if cell.actor is not None else None
        accepts = register_actor_types(self.registry, actor_cls) if actor_cls is not None else ()
        return P.ActorInfo(served.path, accepts, served.capacity, cell.token if token else "")

    def _resolve(self, peer: bytes, corr: int, target: object) -> None:
        cell = self.system.lookup(target) if isinstance(target, str) else None
        if cell is None or not cell.path:
            error = ActorCrashed(str(target), None, detail=f"no such actor on node {self.name!r}")
            self.reply_error(peer, corr, error, str(target))
            return
        served = self.serve_actor(cell)
        self.open_window(served, peer)
        self.send_nowait(peer, {"k": P.OK, "c": corr}, self.actor_info(served, token=False))

    async def _watch(self, served: _Served) -> None:
        cell = served.ref.cell
        await cell.terminated.wait()
        if self.served.get(served.path) is served:
            del self.served[served.path]
        served.inbox_send.close()
        info = P.error_info(ActorCrashed(served.path, cell.last_error), served.path)
        for peer in list(served.windows):
            self.send_nowait(peer, {"k": P.GONE, "t": served.path}, info)

    def _stats(self, peer: bytes, corr: int, target: object) -> None:
        served = self.served.get(target) if isinstance(target, str) else None
        if served is None:
            error = ActorCrashed(str(target), None, detail=f"no such actor on node {self.name!r}")
            self.reply_error(peer, corr, error, str(target))
            return
        stats = P.RemoteStatistics.of(served.ref.statistics())
        self.send_nowait(peer, {"k": P.OK, "c": corr}, stats)

    # -- peers coming and going -----------------------------------------------------------------

    def _peer_dropped(self, state: PeerState) -> None:
        for served in self.served.values():
            served.windows.pop(state.identity, None)  # its credits died with its connection

    async def _peer_gone(self, session: str) -> None:
        for served in [s for s in self.served.values() if s.spawner == session]:
            log.warning("node %s: peer gone, stopping %s", self.name, served.path)
            await served.ref.stop()


def _nbytes(frames: Sequence[Any]) -> int:
    return sum([memoryview(f).nbytes for f in frames])
