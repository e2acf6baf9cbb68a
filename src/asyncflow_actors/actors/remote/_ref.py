"""``RemoteActorRef``: an ``ActorRef`` to an actor hosted by another actor system of the run.

A remote ref names (peer, actor path) and resolves the peer's *current* link at each call, so it
stays valid across reconnects and restarts of the peer (``_peer``). It has the local ref's
interface and semantics; ``send_tracked`` also says when the message's zero-copy buffers may be
reused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

import trio

from .._cell import ActorCell, ActorState, ActorStatistics
from .._errors import MessageTypeError
from .._message import Request, Terminated
from .._ref import ActorRef, require_request
from . import _protocol as P
from ._typeinfo import register_types
from ._zmq import SendTracker

if TYPE_CHECKING:
    from ._mesh import Mesh
    from ._peer import Peer

M = TypeVar("M")
R = TypeVar("R")


class RemoteActorRef(ActorRef[M]):
    """A reference to an actor in another process; same interface and semantics as a local one.

    ``statistics()`` is this side's view (messages in flight, credits); ``fetch_statistics()``
    asks the node for the actor's own counters.
    """

    __slots__ = ("_actor", "_node")

    def __init__(self, node: Peer, actor: str) -> None:
        self._node = node
        self._actor = actor

    @property
    def name(self) -> str:
        return f"{self._node.alias}/{self._actor}"

    @property
    def node(self) -> str:
        """The name of the actor system that hosts the actor."""
        return self._node.name

    @property
    def mesh(self) -> Mesh:
        """The mesh of the system this ref belongs to (``mesh.address_of(ref)`` names it for
        another process)."""
        return self._node.mesh

    @property
    def path(self) -> str:
        """The actor's path on its node."""
        return self._actor

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, RemoteActorRef)
            and other._node is self._node
            and other._actor == self._actor
        )

    def __hash__(self) -> int:
        return hash((id(self._node), self._actor))

    def _check(self, msg: object) -> None:
        accepts = self._node.accepts.get(self._actor, ())
        if not accepts:
            return
        if isinstance(accepts, tuple):
            if isinstance(msg, (accepts, Terminated)):
                return
            names = " | ".join(t.__name__ for t in accepts)
        else:
            cls = type(msg)
            registry = self._node.mesh.registry
            if cls not in registry:  # (a link walks the nested types when it first sends it)
                register_types(registry, cls)
            if cls in registry and registry.name_of(cls) in accepts:
                return
            names = " | ".join(sorted(accepts))
        raise MessageTypeError(
            f"actor {self.name!r} accepts {names}, not {type(msg).__name__}: {msg!r}"
        )

    def _count(self) -> None:
        self._node.sent[self._actor] = self._node.sent.get(self._actor, 0) + 1

    async def send(self, msg: M) -> None:
        await self.send_tracked(msg)

    async def send_tracked(self, msg: M) -> SendTracker:
        """Like ``send``; the tracker says when the message's buffers may be modified again.

        Tensors, arrays and large ``bytes`` of at least 512 KiB leave zero-copy: until
        ``tracker.done`` (``await tracker.wait()``) libzmq may still read them, so a sender that
        refills a buffer (a double-buffered weight sync) waits on the tracker first.
        """
        self._node.take_rejection(self._actor)
        link = await self._node.wait_link(self._actor)
        await link.ensure_target(self._node, self._actor)
        self._check(msg)
        tracker = await link.tell(self._actor, msg)
        self._count()
        return tracker

    def send_nowait(self, msg: M) -> None:
        self._node.take_rejection(self._actor)
        link = self._node.link
        if link is None or link.closed is not None or self._actor not in link.credits:
            if self._node.terminated or self._actor in self._node.gone:
                raise self._node.dead(self._actor)
            raise trio.WouldBlock  # not connected (yet): nowhere to queue it without waiting
        self._check(msg)
        link.tell_nowait(self._actor, msg)
        self._count()

    async def ask(self, request: Request[R]) -> R:
        require_request(request)
        self._node.take_rejection(self._actor)
        link = self._node.link
        if link is None or link.closed is not None or self._actor not in link.credits:
            link = await self._node.wait_link(self._actor)  # the link's ask is the checkpoint
            await link.ensure_target(self._node, self._actor)
        self._check(request)
        result: R = await link.ask(self._actor, request)
        self._count()
        return result

    async def stop(self) -> None:
        if self._actor in self._node.gone or self._node.terminated:
            await trio.lowlevel.checkpoint()
            return
        self._node.specs.pop(self._actor, None)  # never respawn it
        link = await self._node.wait_link(self._actor)
        token = self._node.tokens.get(self._actor, "")
        await link.request(P.STOP, target=self._actor, tok=token)

    async def fetch_statistics(self) -> ActorStatistics:
        """The remote actor's own statistics (one round trip)."""
        link = await self._node.wait_link(self._actor)
        stats: P.RemoteStatistics = await link.request(P.STATS, target=self._actor)
        return stats.local(self.name)

    def statistics(self) -> ActorStatistics:
        link = self._node.link
        credits = link.credits.get(self._actor) if link is not None else None
        if self._actor in self._node.gone or self._node.terminated:
            state = ActorState.TERMINATED
        elif credits is None:
            state = ActorState.RESTARTING if self._node.supervised else ActorState.RUNNING
        else:
            state = ActorState.RUNNING
        cell = self._node.cell
        return ActorStatistics(
            name=self.name,
            state=state,
            mailbox_depth=credits.capacity - credits.count if credits is not None else 0,
            mailbox_capacity=credits.capacity if credits is not None else 0,
            senders_waiting=credits.waiting if credits is not None else 0,
            processed=self._node.sent.get(self._actor, 0),
            restarts=cell.restarts if cell is not None else 0,
            dead_letters=0,
            replies_outstanding=0,
        )

    def _watch(self, watcher: ActorCell) -> None:
        if self._actor in self._node.gone or self._node.terminated:
            error = self._node.gone.get(self._actor)
            watcher.deliver_system(Terminated(self, error))
        else:
            self._node.watchers.setdefault(self._actor, set()).add(watcher)

    def _unwatch(self, watcher: ActorCell) -> None:
        self._node.watchers.get(self._actor, set()).discard(watcher)
