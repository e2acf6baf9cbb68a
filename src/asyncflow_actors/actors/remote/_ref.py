"""``RemoteActorRef``: an ``ActorRef`` to an actor hosted by a node, and the node's shared handle.

A remote ref names (node, actor) and resolves the node's *current* link at each call, so it stays
valid across restarts of the node: while the node restarts, ``send``/``ask`` wait (bound them with
``trio.fail_after``); once the node has terminated for good, they raise ``ActorCrashed``.
"""

from __future__ import annotations

from typing import Any, TypeVar

import trio

from .._cell import ActorCell, ActorState, ActorStatistics
from .._errors import ActorCrashed, MessageTypeError
from .._message import Request, Terminated
from .._ref import ActorRef, require_request
from . import _protocol as P
from ._link import NodeLink
from ._typeinfo import register_types
from ._wire import MessageRegistry

M = TypeVar("M")
R = TypeVar("R")


class NodeHandle:
    """State of one node shared by its ``NodeActor`` incarnations and the refs to its actors."""

    def __init__(self, name: str, registry: MessageRegistry) -> None:
        self.name = name
        self.registry = registry
        self.link: NodeLink | None = None
        self.info: P.NodeInfo | None = None
        self.address = ""
        self.up = trio.Event()
        self.cell: ActorCell | None = None
        # what to spawn again after a restart of the node, in spawn order
        self.specs: dict[str, P.SpawnRequest] = {}
        self.accepts: dict[str, tuple[type, ...] | frozenset[str]] = {}
        self.watchers: dict[str, set[ActorCell]] = {}
        self.gone: dict[str, BaseException | None] = {}
        self.sent: dict[str, int] = {}

    def attach(self, link: NodeLink, info: P.NodeInfo, address: str) -> None:
        self.link, self.info, self.address = link, info, address
        self.up.set()

    def detach(self) -> NodeLink | None:
        link, self.link = self.link, None
        if self.up.is_set():
            self.up = trio.Event()
        return link

    @property
    def terminated(self) -> bool:
        return self.cell is None or self.cell.state is ActorState.TERMINATED

    async def wait_link(self, actor: str) -> NodeLink:
        """The live link, waiting while the node (re)starts; ``ActorCrashed`` once it is gone."""
        while True:
            link = self.link
            if link is not None and link.closed is None:
                return link  # no checkpoint here: the caller's own wait is the checkpoint
            if self.terminated or actor in self.gone:
                raise self.dead(actor)
            assert self.cell is not None
            async with trio.open_nursery() as nursery:
                for event in (self.up, self.cell.terminated):

                    async def wait(event: trio.Event = event) -> None:
                        await event.wait()
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(wait)

    def dead(self, actor: str) -> ActorCrashed:
        name = f"{self.name}/{actor}"
        if actor in self.gone:
            return ActorCrashed(name, self.gone[actor], detail="terminated on its node")
        cause = self.cell.last_error if self.cell is not None else None
        return ActorCrashed(name, cause, detail=f"node {self.name!r} terminated")

    def on_gone(self, actor: str, info: P.ErrorInfo | None) -> None:
        """The node reports ``actor`` terminated for good: never respawn it, tell watchers."""
        self.specs.pop(actor, None)
        error = None
        if info is not None and not info.stopped:
            crashed = P.error_from_info(info, f"{self.name}/{actor}")
            error = crashed.error if isinstance(crashed, ActorCrashed) else crashed
        self.gone[actor] = error
        self.notify_watchers(actor, error)

    def notify_watchers(self, actor: str, error: BaseException | None) -> None:
        ref: RemoteActorRef[Any] = RemoteActorRef(self, actor)
        for watcher in self.watchers.pop(actor, set()):
            watcher.deliver_system(Terminated(ref, error))

    def node_terminated(self) -> None:
        """The node will not come back: every remote actor of it has terminated."""
        error = self.cell.last_error if self.cell is not None else None
        for actor in list(self.watchers):
            self.notify_watchers(actor, error)


class RemoteActorRef(ActorRef[M]):
    """A reference to an actor on a node; same interface and semantics as a local one.

    ``statistics()`` is this side's view (messages in flight, credits); ``fetch_statistics()``
    asks the node for the actor's own counters.
    """

    __slots__ = ("_actor", "_node")

    def __init__(self, node: NodeHandle, actor: str) -> None:
        self._node = node
        self._actor = actor

    @property
    def name(self) -> str:
        return f"{self._node.name}/{self._actor}"

    @property
    def node(self) -> str:
        return self._node.name

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
            ok = isinstance(msg, (*accepts, Terminated))
            names = " | ".join(t.__name__ for t in accepts)
        else:
            cls = type(msg)
            register_types(self._node.registry, cls)
            ok = cls in self._node.registry and self._node.registry.name_of(cls) in accepts
            names = " | ".join(sorted(accepts))
        if not ok:
            raise MessageTypeError(
                f"actor {self.name!r} accepts {names}, not {type(msg).__name__}: {msg!r}"
            )

    def _count(self) -> None:
        self._node.sent[self._actor] = self._node.sent.get(self._actor, 0) + 1

    async def send(self, msg: M) -> None:
        self._check(msg)
        link = await self._node.wait_link(self._actor)
        await link.tell(self._actor, msg)
        self._count()

    def send_nowait(self, msg: M) -> None:
        self._check(msg)
        link = self._node.link
        if link is None or link.closed is not None:
            if self._node.terminated or self._actor in self._node.gone:
                raise self._node.dead(self._actor)
            raise trio.WouldBlock  # the node is restarting: nowhere to queue
        link.tell_nowait(self._actor, msg)
        self._count()

    async def ask(self, request: Request[R]) -> R:
        require_request(request)
        self._check(request)
        link = await self._node.wait_link(self._actor)
        result: R = await link.ask(self._actor, request)
        self._count()
        return result

    async def stop(self) -> None:
        if self._actor in self._node.gone or self._node.terminated:
            await trio.lowlevel.checkpoint()
            return
        self._node.specs.pop(self._actor, None)  # never respawn it
        link = await self._node.wait_link(self._actor)
        await link.request(P.STOP, target=self._actor)

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
            state = ActorState.RESTARTING
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
