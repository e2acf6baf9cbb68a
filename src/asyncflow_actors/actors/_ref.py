"""``ActorRef[M]``: the only way to talk to an actor, local or remote.

``send`` is a tell that waits while the mailbox is full (that wait *is* the backpressure),
``send_nowait`` raises ``trio.WouldBlock`` instead, ``ask`` sends a ``Request[R]`` and returns its
``R`` reply. There are no ``timeout=`` arguments: bound waits with ``trio.fail_after``.
"""

from __future__ import annotations

import abc
from typing import Generic, TypeVar

import trio

from ._cell import ActorCell, ActorState, ActorStatistics, Ask, Reply, Tracked
from ._errors import ActorCrashed, MessageTypeError
from ._message import Request, Terminated

M = TypeVar("M")
R = TypeVar("R")


class Tracker(abc.ABC):
    """Says when the buffers of a sent message (tensors, arrays) may be modified again."""

    __slots__ = ()

    @property
    @abc.abstractmethod
    def done(self) -> bool:
        """True once nothing reads the message's buffers any more."""

    @abc.abstractmethod
    async def wait(self) -> None:
        """Wait until ``done``; a checkpoint even when already done."""


class EventTracker(Tracker):
    """A ``Tracker`` completed by a ``trio.Event`` (a local delivery)."""

    __slots__ = ("_event",)

    def __init__(self, event: trio.Event) -> None:
        self._event = event

    @property
    def done(self) -> bool:
        return self._event.is_set()

    async def wait(self) -> None:
        await self._event.wait()


class ActorRef(abc.ABC, Generic[M]):
    """A reference to an actor; equal refs address the same actor. Cheap to copy and share.

    Refs stay valid across supervised restarts. Every method that waits is a trio checkpoint
    and cancellation-atomic: a cancelled ``send`` sent nothing.
    """

    __slots__ = ()

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """The actor's path in its system, e.g. ``"tq/storage-0"``."""

    @abc.abstractmethod
    async def send(self, msg: M) -> None:
        """Deliver ``msg``; waits while the mailbox is full.

        Raises ``MessageTypeError`` for a message the actor does not accept and ``ActorCrashed``
        if the actor has terminated for good.
        """

    @abc.abstractmethod
    def send_nowait(self, msg: M) -> None:
        """Like ``send`` but raises ``trio.WouldBlock`` when the mailbox is full."""

    @abc.abstractmethod
    async def send_tracked(self, msg: M) -> Tracker:
        """Like ``send``; the returned ``Tracker`` says when ``msg``'s buffers may be reused.

        Sending never copies a large tensor: until the tracker is done, the receiver (or, for a
        remote actor, libzmq) may still read it. A local actor shares the sender's objects, so
        its tracker is done once ``receive`` returned for the message (a receiver that keeps
        a tensor must copy it). A sender that refills a buffer waits on the tracker first.
        """

    @abc.abstractmethod
    async def ask(self, request: Request[R]) -> R:
        """Send ``request`` and wait for its reply.

        Raises ``ActorCrashed`` if the actor crashes or stops before replying (the asker never
        hangs), or the error the actor answered with ``ctx.reply_error``. If the caller is
        cancelled, the request may still be processed; its reply is discarded.
        """

    @abc.abstractmethod
    async def stop(self) -> None:
        """Stop the actor for good (current message finishes, ``on_stop`` runs); wait for it."""

    @abc.abstractmethod
    def statistics(self) -> ActorStatistics:
        """Mailbox depth, processed count, restarts and more, as a frozen snapshot."""

    @abc.abstractmethod
    def _watch(self, watcher: ActorCell) -> None: ...

    @abc.abstractmethod
    def _unwatch(self, watcher: ActorCell) -> None: ...

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def require_request(request: object) -> None:
    """Raise ``MessageTypeError`` unless ``request`` is a ``Request`` (what ``ask`` sends)."""
    if not isinstance(request, Request):
        raise MessageTypeError(
            f"ask() needs a Request, got {type(request).__name__}: {request!r}; use send() "
            "for messages without a reply"
        )


class LocalActorRef(ActorRef[M]):
    """A reference to an actor in this process."""

    __slots__ = ("_cell",)

    def __init__(self, cell: ActorCell) -> None:
        self._cell = cell

    @property
    def name(self) -> str:
        return self._cell.path

    @property
    def cell(self) -> ActorCell:
        """The actor's cell: its mailbox, state and incarnations (a hook for runtime extensions,
        such as the remote half serving this actor to other systems; user code needs the ref)."""
        return self._cell

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LocalActorRef) and other._cell is self._cell

    def __hash__(self) -> int:
        return id(self._cell)

    def _check(self, msg: object) -> None:
        accepts = self._cell.accepts
        if accepts is not None and not isinstance(msg, accepts) and not isinstance(msg, Terminated):
            names = " | ".join(t.__name__ for t in accepts)
            raise MessageTypeError(
                f"actor {self._cell.path!r} accepts {names}, not {type(msg).__name__}: {msg!r}"
            )

    def _dead(self, detail: str = "") -> ActorCrashed:
        return ActorCrashed(self._cell.path, self._cell.last_error, detail=detail or "terminated")

    async def send(self, msg: M) -> None:
        self._check(msg)
        try:
            await self._cell.mailbox_send.send(msg)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise self._dead() from self._cell.last_error

    async def send_tracked(self, msg: M) -> Tracker:
        self._check(msg)
        event = trio.Event()
        try:
            await self._cell.mailbox_send.send(Tracked(msg, event))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise self._dead() from self._cell.last_error
        return EventTracker(event)

    def send_nowait(self, msg: M) -> None:
        self._check(msg)
        try:
            self._cell.mailbox_send.send_nowait(msg)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise self._dead() from self._cell.last_error

    async def ask(self, request: Request[R]) -> R:
        require_request(request)
        self._check(request)
        reply = Reply()
        item = Ask(request, reply)
        # The wait for the reply is the checkpoint: no scheduler round trip before parking.
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            try:
                self._cell.mailbox_send.send_nowait(item)
            except trio.WouldBlock:
                await self._cell.mailbox_send.send(item)  # the mailbox is full: backpressure
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise self._dead() from self._cell.last_error
        result: R = await reply.wait()
        return result

    async def stop(self) -> None:
        await self._cell.stop()

    def statistics(self) -> ActorStatistics:
        return self._cell.statistics()

    async def enqueue_ask(self, request: object, reply: Reply) -> None:
        """Queue ``request`` (FIFO with tells) with ``reply`` as its slot, without waiting for the
        answer: the hook by which a server of this actor (the remote half) forwards an ask and
        learns the answer from ``reply``'s callback. Waits while the mailbox is full; raises
        ``MessageTypeError`` or ``ActorCrashed`` as ``send`` does."""
        self._check(request)
        try:
            await self._cell.mailbox_send.send(Ask(request, reply))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise self._dead() from self._cell.last_error

    def enqueue_ask_nowait(self, request: object, reply: Reply) -> None:
        """Like ``enqueue_ask`` but raises ``trio.WouldBlock`` when the mailbox is full."""
        self._check(request)
        try:
            self._cell.mailbox_send.send_nowait(Ask(request, reply))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise self._dead() from self._cell.last_error

    def _watch(self, watcher: ActorCell) -> None:
        if self._cell.state is ActorState.TERMINATED:
            watcher.deliver_system(Terminated(self, self._cell.last_error))
        else:
            self._cell.watchers.add(watcher)

    def _unwatch(self, watcher: ActorCell) -> None:
        self._cell.watchers.discard(watcher)


class DeadActorRef(ActorRef[M]):
    """A ref to an actor that terminated before the ref arrived (an address that names no live
    actor of this system): every send raises ``ActorCrashed``, watching reports ``Terminated``."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeadActorRef) and other._name == self._name

    def __hash__(self) -> int:
        return hash(("dead", self._name))

    def _dead(self) -> ActorCrashed:
        return ActorCrashed(self._name, None, detail="no such actor (terminated)")

    async def send(self, msg: M) -> None:
        await trio.lowlevel.checkpoint()
        raise self._dead()

    def send_nowait(self, msg: M) -> None:
        raise self._dead()

    async def send_tracked(self, msg: M) -> Tracker:
        await trio.lowlevel.checkpoint()
        raise self._dead()

    async def ask(self, request: Request[R]) -> R:
        require_request(request)
        await trio.lowlevel.checkpoint()
        raise self._dead()

    async def stop(self) -> None:
        await trio.lowlevel.checkpoint()

    def statistics(self) -> ActorStatistics:
        return ActorStatistics(self._name, ActorState.TERMINATED, 0, 0, 0, 0, 0, 0, 0)

    def _watch(self, watcher: ActorCell) -> None:
        watcher.deliver_system(Terminated(self, None))

    def _unwatch(self, watcher: ActorCell) -> None:
        pass
