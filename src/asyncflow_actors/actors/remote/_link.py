"""The sending side of one connection to another actor system: requests, replies, credits.

A ``NodeLink`` owns a DEALER socket connected to a peer's ROUTER (its server); any task may send.
Every request waits on a ``Reply`` keyed by a correlation id; when the link closes (the peer died,
the connection dropped, the owner stopped), every pending request fails with ``ActorCrashed``
chained to a ``NodeLost``, so no asker ever hangs.

One task at a time receives, and whoever receives dispatches everything that arrives. That is
``run``'s task, except while a requester waits for its reply and no one else receives: then the
requester receives (``_wait_reply``), so the socket wakes it directly instead of waking ``run``'s
task, which would then wake it (a scheduling round and a task switch less per ask). ``run``'s
task steps aside after answering a requester, so that a loop of asks keeps receiving its own
replies, and takes over again as soon as no requester receives.

Liveness is decided on evidence only (``docs/remote.md``): the socket's monitor reports a dropped
connection, and libzmq's ZMTP heartbeats (answered by libzmq's own I/O threads, so a busy Python
loop on either side never misses one) drop a connection whose peer stopped answering. Neither is
fooled by this process's event loop being blocked for a while.

Credits implement flow control across processes, per sender: an actor's mailbox capacity is the
number of messages *this* process may have in flight to it; ``tell``/``ask`` wait for a credit,
the peer returns them as messages enter the mailbox (or with a rejection). zmq's high-water mark
is not flow control: it counts messages per pipe, not per actor.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from .._cell import Reply
from .._errors import ActorCrashed
from . import _protocol as P
from ._hosting import learn_type
from ._typeinfo import register_types
from ._wire import (
    AddressOf,
    MalformedMessage,
    MessageRegistry,
    MessageTooLarge,
    UnknownType,
    WireError,
    decode,
    encode,
)
from ._wire_decode import ResolveRef
from ._zmq import SendTracker, TrioSocket, open_monitor_socket

if TYPE_CHECKING:
    from ._peer import Peer

log = logging.getLogger("asyncflow_actors.node")

_MONITORED = int(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_MAX_LEARNED_TYPES = 16  # new types one message may make this side register


def _nbytes(frames: list[bytes | memoryview]) -> int:
    return sum([memoryview(f).nbytes for f in frames])


class Credits:
    """A counter of messages that may still be sent to one remote actor; FIFO waiters."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.capacity = count
        self._lot = trio.lowlevel.ParkingLot()
        self.closed: BaseException | None = None

    @property
    def waiting(self) -> int:
        return len(self._lot)

    def acquire_nowait(self) -> None:
        if self.closed is not None:
            raise self.closed
        if self.count <= 0 or self._lot:
            raise trio.WouldBlock
        self.count -= 1

    async def acquire(self) -> None:
        """Take one credit, waiting (FIFO) until the node returns one. Cancellation-atomic."""
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            self.acquire_nowait()
        except trio.WouldBlock:
            await self._lot.park()  # woken by release(), which reserved our credit, or by close()
            if self.closed is not None:
                raise self.closed from None
        else:
            await trio.lowlevel.cancel_shielded_checkpoint()

    def release(self, n: int = 1) -> None:
        self.count += n
        while self.count > 0 and self._lot:
            self._lot.unpark(count=1)
            self.count -= 1

    def close(self, error: BaseException) -> None:
        self.closed = error
        self._lot.unpark_all()


class NodeLink:
    """One DEALER connection to another system's server (see the module docstring)."""

    def __init__(
        self,
        sock: TrioSocket,
        registry: MessageRegistry,
        *,
        node: str,
        max_message_bytes: int,
        address_of: AddressOf | None = None,
        resolve: ResolveRef | None = None,
        on_gone: Callable[[str, P.ErrorInfo | None], None] | None = None,
        on_rejected: Callable[[str, BaseException], None] | None = None,
        on_lost: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.sock = sock
        self.registry = registry
        self.node = node
        self.max_message_bytes = max_message_bytes
        self.address_of = address_of
        self.resolve = resolve
        self.on_gone = on_gone
        self.on_rejected = on_rejected
        self.on_lost = on_lost
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[Reply, str]] = {}
        self._resolving: dict[str, trio.Event] = {}
        self.credits: dict[str, Credits] = {}
        self.closed: BaseException | None = None
        # Who receives: the task in run(), or a requester waiting for its reply (_wait_reply);
        # run() parks on _idle while a requester does.
        self._receiving = False
        self._idle = trio.lowlevel.ParkingLot()
        self._registered: set[type] = set()
        self.sent = 0
        self.sent_bytes = 0
        self.received_bytes = 0
        self.wire_errors = 0
        self.rejected = 0

    # -- receiving -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Receive and dispatch while no requester does; watch the connection meanwhile.

        A dropped connection (or a refused CURVE handshake) closes the link with ``NodeLost``
        and calls ``on_lost``.
        """
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._monitor)
            while True:
                if self._receiving:  # a requester receives for everyone (_wait_reply)
                    await self._idle.park()
                    continue
                self._receiving = True
                try:
                    frames = await self.sock.recv_multipart()
                except trio.ClosedResourceError:
                    nursery.cancel_scope.cancel()
                    return
                finally:
                    self._receiving = False
                if self._handle(frames):
                    # It answered a waiting requester: let that one receive its next reply
                    # itself (a request loop saves a task hop per request); it wakes us when
                    # it leaves the request, unless it (or another) receives by then.
                    await self._idle.park()

    def _handle(self, frames: list[Any]) -> bool:
        """Decode and dispatch one received message; True if it resolved a pending request."""
        self.received_bytes += sum([len(f) for f in frames])  # zmq.Frame: its byte size
        try:
            meta, payload = self._decode(frames)
        except WireError as exc:
            self.wire_errors += 1
            log.warning("link to %s: undecodable message: %s", self.node, exc)
            corr = exc.meta.get("c") if isinstance(exc.meta, dict) else None
            if isinstance(corr, int) and corr in self._pending:
                reply, _ = self._pending.pop(corr)
                reply.fail(exc)
                return True
            return False
        return self._dispatch(meta, payload)

    async def _wait_reply(self, reply: Reply) -> Any:
        """Wait for a request's reply; a checkpoint. Cancelled, the reply is lost.

        If no task is receiving on the link, this one does, dispatching whatever arrives until
        its own reply is there: its wake-up comes straight from the socket, one task hop less
        than the receiver task's dispatching it. Then the receiver task takes over again.
        """
        if self._receiving:
            return await reply.wait()
        self._receiving = True
        try:
            while not reply.done:
                frames = await self.sock.recv_multipart_until(lambda: reply.done)
                if frames is not None:
                    self._handle(frames)
        except trio.ClosedResourceError:
            reply.fail(ActorCrashed(self._local_name(""), P.NodeLost("the link closed")))
        finally:
            self._receiving = False
            self._release()
        return reply.unwrap()

    def _release(self) -> None:
        """Hand receiving back to the receiver task if no requester receives now."""
        if not self._receiving and self._idle:
            self._idle.unpark_all()

    def _decode(self, frames: list[Any]) -> tuple[dict[str, Any], object]:
        """Decode a reply or notice; a type it names is learned if its module is imported here
        (a reply's field typed ``Any`` may hold a class no annotation reaches)."""
        for _ in range(_MAX_LEARNED_TYPES):
            try:
                return decode(
                    frames,
                    registry=self.registry,
                    max_message_bytes=self.max_message_bytes,
                    resolve=self.resolve,
                )
            except UnknownType as exc:
                if not learn_type(self.registry, exc, (), self.node):
                    raise
        raise MalformedMessage(f"a message naming more than {_MAX_LEARNED_TYPES} new types")

    async def _monitor(self) -> None:
        async with open_monitor_socket(self.sock, _MONITORED) as mon:
            while True:
                try:
                    event = parse_monitor_message([f.bytes for f in await mon.recv_multipart()])[
                        "event"
                    ]
                except trio.ClosedResourceError:
                    return
                if event & zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                    lost = P.NodeLost(f"node {self.node!r} refused our CURVE credentials")
                else:
                    lost = P.NodeLost(f"the connection to node {self.node!r} dropped")
                self._drain_queued()
                self.close(lost)
                if self.on_lost is not None:
                    self.on_lost(lost)
                return

    def _drain_queued(self) -> None:
        """Dispatch what the peer sent before its connection dropped and is queued here: a
        node answers ``SHUTDOWN`` and exits at once, and whether this task or the receiver
        runs first must not decide if its answer is seen."""
        while True:
            try:
                frames = self.sock.recv_multipart_nowait()
            except (trio.WouldBlock, trio.ClosedResourceError):
                return
            self._handle(frames)

    def _dispatch(self, meta: dict[str, Any], payload: object) -> bool:
        """Act on one message; True if it resolved a pending request."""
        kind = meta.get("k")
        if kind == P.OK or kind == P.ERR:
            if "n" in meta:  # credits piggybacked on a reply
                self._credit(meta)
            entry = self._pending.pop(meta.get("c", -1), None)
            if entry is None:
                return False  # the asker gave up (cancelled)
            reply, target = entry
            if kind == P.OK:
                reply.send(payload)
            elif isinstance(payload, P.ErrorInfo):
                reply.fail(P.error_from_info(payload, self._local_name(target)))
            else:
                reply.fail(WireError(f"malformed error reply from node {self.node!r}"))
            return True
        if kind == P.CREDIT:
            self._credit(meta)
        elif kind == P.REJECT:
            self._credit(meta)
            refused = meta.get("t")
            if isinstance(refused, str):
                self.rejected += 1
                error = P.MessageRejected(
                    f"node {self.node!r} rejected a message told to {refused!r}: "
                    + (
                        f"{payload.type_name}: {payload.message}"
                        if isinstance(payload, P.ErrorInfo)
                        else "?"
                    )
                )
                log.warning("%s", error)
                if self.on_rejected is not None:
                    self.on_rejected(refused, error)
        elif kind == P.GONE:
            gone = meta.get("t")
            if isinstance(gone, str):
                self._gone(gone, payload)
        return False

    def _credit(self, meta: dict[str, Any]) -> None:
        credits = self.credits.get(meta.get("t", ""))
        n = meta.get("n")
        if credits is not None and isinstance(n, int) and n > 0:
            credits.release(n)

    def _gone(self, target: str, payload: object) -> None:
        credits = self.credits.pop(target, None)
        info = payload if isinstance(payload, P.ErrorInfo) else None
        local = self._local_name(target)
        error = P.error_from_info(info, local) if info is not None else ActorCrashed(local, None)
        if credits is not None:
            credits.close(error if isinstance(error, ActorCrashed) else ActorCrashed(local, error))
        if self.on_gone is not None:
            self.on_gone(target, info)

    def _local_name(self, target: str) -> str:
        return f"{self.node}/{target}" if target else self.node

    # -- sending ---------------------------------------------------------------------------------

    def _frames(
        self, meta: dict[str, Any], payload: object
    ) -> tuple[list[bytes | memoryview], int]:
        """The frames of a message to send, and their size in bytes."""
        cls = type(payload)
        if cls not in self._registered:
            register_types(self.registry, cls)
            self._registered.add(cls)
        frames = encode(
            meta, payload, registry=self.registry, address_of=self.address_of, auto_register=True
        )
        size = _nbytes(frames)
        if size > self.max_message_bytes:  # the peer would drop the connection: refuse here
            raise MessageTooLarge(
                f"a {type(payload).__name__} of {size} bytes to node {self.node!r}: the limit is "
                f"max_message_bytes={self.max_message_bytes}"
            )
        return frames, size

    def _check_open(self, target: str = "") -> None:
        if self.closed is not None:
            raise ActorCrashed(self._local_name(target), self.closed, detail="node link closed")

    async def request(
        self, kind: str, payload: object = None, *, target: str = "", **meta: Any
    ) -> Any:
        """Send a request and wait for its ``ok`` (returned) or ``err`` (raised) reply.

        The wait for the reply is its checkpoint: a caller cancelled before the call sent
        nothing; one cancelled while waiting loses the reply.
        """
        self._check_open(target)
        await trio.lowlevel.checkpoint_if_cancelled()
        corr = next(self._ids)
        envelope: dict[str, Any] = {"k": kind, "c": corr, **meta}
        if target:
            envelope["t"] = target
        frames, size = self._frames(envelope, payload)
        reply = Reply()
        self._pending[corr] = (reply, target)
        try:
            try:
                self.sock.send_multipart_nowait(frames)
            except trio.WouldBlock:
                await self.sock.send_multipart(frames)
            self.sent += 1
            self.sent_bytes += size
            return await self._wait_reply(reply)
        finally:
            self._pending.pop(corr, None)
            self._release()

    async def ensure_target(self, peer: Peer, target: str) -> None:
        """Learn ``target``'s credit window (and types, token) from the peer on first use."""
        if target in self.credits:
            return
        while target not in self.credits:
            event = self._resolving.get(target)
            if event is not None:
                await event.wait()
                self._check_open(target)
                if target in peer.gone:
                    raise peer.dead(target)
                continue
            event = self._resolving[target] = trio.Event()
            try:
                info: P.ActorInfo = await self.request(P.RESOLVE, target=target)
                peer.learn_actor(self, info, None)
            finally:
                del self._resolving[target]
                event.set()

    async def tell(self, target: str, msg: object) -> SendTracker:
        credits = self._credits(target)
        frames, size = self._frames({"k": P.TELL, "t": target}, msg)
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            credits.acquire_nowait()
        except trio.WouldBlock:
            await credits.acquire()  # the remote mailbox is full: wait for the node
        try:
            try:
                tracker = self.sock.send_multipart_nowait(frames)
            except trio.WouldBlock:
                tracker = await self.sock.send_multipart(frames)
        except BaseException:
            credits.release(1)
            raise
        self.sent += 1
        self.sent_bytes += size
        await trio.lowlevel.cancel_shielded_checkpoint()
        return tracker

    def tell_nowait(self, target: str, msg: object) -> None:
        credits = self._credits(target)
        frames, size = self._frames({"k": P.TELL, "t": target}, msg)
        credits.acquire_nowait()
        try:
            self.sock.send_multipart_nowait(frames)
        except BaseException:
            credits.release(1)
            raise
        self.sent += 1
        self.sent_bytes += size

    async def ask(self, target: str, msg: object) -> Any:
        """Ask ``target``; its credit comes back with the reply (or the rejection).

        A request that never left — it could not be encoded, or the caller was cancelled
        before it was sent — returns its credit here at once.
        """
        credits = self._credits(target)
        corr = next(self._ids)
        frames, size = self._frames({"k": P.ASK, "c": corr, "t": target}, msg)  # before any credit
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            credits.acquire_nowait()
        except trio.WouldBlock:
            await credits.acquire()  # cancellation-atomic: cancelled, it took nothing
        reply = Reply()
        self._pending[corr] = (reply, target)
        try:
            try:
                try:
                    self.sock.send_multipart_nowait(frames)
                except trio.WouldBlock:
                    await self.sock.send_multipart(frames)  # cancelled here: nothing was sent
            except BaseException:
                credits.release(1)
                raise
            self.sent += 1
            self.sent_bytes += size
            return await self._wait_reply(reply)
        finally:
            self._pending.pop(corr, None)
            self._release()

    def _credits(self, target: str) -> Credits:
        self._check_open(target)
        credits = self.credits.get(target)
        if credits is None:
            raise ActorCrashed(self._local_name(target), None, detail="not on this node (anymore)")
        return credits

    def open_credits(self, target: str, capacity: int) -> None:
        self.credits[target] = Credits(capacity)

    def close(self, error: BaseException) -> None:
        """Fail every pending request and credit waiter with ``ActorCrashed(.., error)``."""
        if self.closed is not None:
            return
        self.closed = error
        for corr, (reply, target) in list(self._pending.items()):
            reply.fail(ActorCrashed(self._local_name(target), error, detail="node link lost"))
            del self._pending[corr]
        for target, credits in self.credits.items():
            credits.close(ActorCrashed(self._local_name(target), error, detail="node link lost"))
        self.sock.wake()  # a requester receiving on the socket sees its reply failed
