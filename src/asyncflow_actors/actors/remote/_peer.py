"""``Peer``: this system's view of one other actor system of the run (a node, or the driver).

A peer is known by its name. It holds the current link to it (``NodeLink``), where it listens,
and what this side learned about its actors (accepted types, stop tokens, which terminated).
Refs to its actors resolve the peer's *current* link at each call, so they stay valid when the
link is replaced (a reconnect, a restart of the peer's process).

Two kinds, one interface:

- a *supervised* peer is a node this system started or connected to (``system.start_node``,
  ``connect_node``): its ``NodeActor`` owns the link. While the node restarts, calls wait (bound
  them with ``trio.fail_after``); once the node actor terminated for good they raise.
- a *mesh* peer is any other system a ref pointed to: the mesh opens a link lazily on first use
  and again after a link was lost; a peer that cannot be reached raises ``ActorCrashed`` caused by
  ``NodeLost``.

Who may say where a peer listens (``docs/remote.md``, security): its supervisor (the
``NodeActor``'s own link) and the owner of this node (a ``PEERS`` update, or its hello) are
*authoritative*: they move the peer. Anything else — an address inside a message, a stranger's
hello — is hearsay: it tells where an unknown peer listens, and moves only a peer nobody
authoritative told about, whose link is down, to a newer incarnation. A peer whose link is up is
never re-pointed by hearsay. Under CURVE a link to a peer expects the key its name is bound to
(``KeyBindings``): for a bound name, hearsay can at worst send a connect where it fails, never
to an impostor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio

from .._cell import ActorCell, ActorState
from .._errors import ActorCrashed
from .._message import Terminated
from . import _protocol as P
from ._link import NodeLink

if TYPE_CHECKING:
    from ._mesh import Mesh


class Peer:
    """State of one remote actor system shared by the refs to its actors (module docstring)."""

    def __init__(self, mesh: Mesh, name: str, *, alias: str | None = None) -> None:
        self.mesh = mesh
        self.name = name  # the system's own name (how addresses name it)
        self.alias = alias if alias is not None else name  # how local paths show it
        self.link: NodeLink | None = None
        self.info: P.NodeInfo | None = None
        self.endpoints: tuple[str, ...] = ()
        self.incarnation = -1
        self.authoritative = False  # where it listens came from an authoritative source
        self.key = ""  # a supervised peer's CURVE public key (Z85), told to the other nodes
        self.address = ""  # the endpoint the current link connected to
        self.up = trio.Event()
        # set (and replaced) each time an authoritative source moves the peer: a connect to
        # where it was gives up then, and one waiting for its restart goes on (``Mesh.connect``)
        self.moved = trio.Event()
        self.stopped = False  # its owner said it stopped for good (or, our owner, it exited)
        self.stop_error: BaseException | None = None  # why, when known
        self.cell: ActorCell | None = None  # the NodeActor of a supervised peer
        # supervised: what to spawn again after a restart of the node, in spawn order
        self.specs: dict[str, P.SpawnRequest] = {}
        self.accepts: dict[str, tuple[type, ...] | frozenset[str]] = {}
        self.tokens: dict[str, str] = {}
        self.watchers: dict[str, set[ActorCell]] = {}
        self.gone: dict[str, BaseException | None] = {}
        self.sent: dict[str, int] = {}
        self.rejected: dict[str, P.MessageRejected] = {}
        self._connecting: trio.Event | None = None

    @property
    def supervised(self) -> bool:
        return self.cell is not None

    def learn(self, incarnation: int, endpoints: tuple[str, ...]) -> bool:
        """Hearsay of where the peer listens (module docstring); True if it moved the peer."""
        if not endpoints or self.supervised or self.authoritative:
            return False
        if self.endpoints and (
            incarnation <= self.incarnation or (self.link is not None and self.link.closed is None)
        ):
            return False
        if incarnation > self.incarnation:
            self.gone.clear()  # a new start of the peer: its actors are new ones
        self.incarnation, self.endpoints = incarnation, endpoints
        return True

    def move(self, incarnation: int, endpoints: tuple[str, ...]) -> bool:
        """An authoritative source says where the peer listens now; True if that changed."""
        if not endpoints:
            return False
        changed = incarnation != self.incarnation or endpoints != self.endpoints
        self.incarnation, self.endpoints, self.authoritative = incarnation, endpoints, True
        self.stopped, self.stop_error = False, None
        if changed:
            self.moved.set()
            self.moved = trio.Event()
        return changed

    def stop(self, error: BaseException | None = None) -> None:
        """It stopped for good (its owner says so; or it owned this node and its process
        exited, ``error`` saying so): a connect waiting for its restart gives up, and calls to
        its actors fail at once."""
        self.stopped = True
        self.stop_error = error
        self.moved.set()
        self.moved = trio.Event()

    def attach(
        self, link: NodeLink, info: P.NodeInfo, address: str, *, authoritative: bool
    ) -> None:
        """Take ``link`` (to where this side chose to connect) as current: its answer says
        which incarnation listens there, and where else (``authoritative``: the supervisor's
        own link; a mesh link only confirms what this side already believed)."""
        self.link, self.info, self.address = link, info, address
        endpoints = info.endpoints or (address,)
        if authoritative:
            self.move(info.incarnation, endpoints)
        else:
            self.incarnation, self.endpoints = info.incarnation, endpoints
        self.up.set()

    def detach(self) -> NodeLink | None:
        link, self.link = self.link, None
        if self.up.is_set():
            self.up = trio.Event()
        return link

    @property
    def terminated(self) -> bool:
        """It will not come back: a supervised peer's ``NodeActor`` terminated for good, a
        mesh peer stopped for good (``stop``)."""
        if self.cell is not None:
            return self.cell.state is ActorState.TERMINATED
        return self.stopped

    async def wait_link(self, actor: str) -> NodeLink:
        """The live link; a supervised peer's calls wait while it (re)starts, a mesh peer's
        connect now. ``ActorCrashed`` once the actor or the peer is gone for good."""
        while True:
            link = self.link
            if link is not None and link.closed is None:
                return link  # no checkpoint here: the caller's own wait is the checkpoint
            if self.terminated or actor in self.gone:
                raise self.dead(actor)
            if self.cell is None:
                await self.mesh.connect(self)
                continue
            async with trio.open_nursery() as nursery:
                for event in (self.up, self.cell.terminated):

                    async def wait(event: trio.Event = event) -> None:
                        await event.wait()
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(wait)

    def dead(self, actor: str) -> ActorCrashed:
        name = f"{self.alias}/{actor}"
        if actor in self.gone:
            return ActorCrashed(name, self.gone[actor], detail="terminated on its node")
        cause = self.cell.last_error if self.cell is not None else self.stop_error
        return ActorCrashed(name, cause, detail=f"node {self.alias!r} terminated")

    def learn_actor(
        self, link: NodeLink, info: P.ActorInfo, local: tuple[type, ...] | None
    ) -> None:
        """Record what a spawn or resolve told about an actor, and open this side's credits."""
        link.open_credits(info.name, info.capacity)
        self.accepts[info.name] = local if local is not None else frozenset(info.accepts)
        if info.token:
            self.tokens[info.name] = info.token
        self.gone.pop(info.name, None)

    def on_gone(self, actor: str, info: P.ErrorInfo | None) -> None:
        """The node reports ``actor`` terminated for good: never respawn it, tell watchers."""
        self.specs.pop(actor, None)
        error = None
        if info is not None and not info.stopped:
            crashed = P.error_from_info(info, f"{self.alias}/{actor}")
            error = crashed.error if isinstance(crashed, ActorCrashed) else crashed
        self.gone[actor] = error
        self.notify_watchers(actor, error)

    def on_rejected(self, actor: str, error: BaseException) -> None:
        """Keep the verdicts on tells to ``actor`` until the next call on it raises them."""
        earlier = self.rejected.get(actor)
        if earlier is None:
            self.rejected[actor] = P.MessageRejected(str(error))
        else:
            self.rejected[actor] = P.MessageRejected(earlier.reason, earlier.count + 1)

    def take_rejection(self, actor: str) -> None:
        """Raise the rejection of an earlier tell to ``actor`` (once), if there was one."""
        error = self.rejected.pop(actor, None)
        if error is not None:
            raise error

    def notify_watchers(self, actor: str, error: BaseException | None) -> None:
        from ._ref import RemoteActorRef

        ref: RemoteActorRef[Any] = RemoteActorRef(self, actor)
        for watcher in self.watchers.pop(actor, set()):
            watcher.deliver_system(Terminated(ref, error))

    def lost_with_process(self, error: BaseException, kept: tuple[str, ...]) -> None:
        """The peer's process is gone: every watched actor of it that is not hosted again
        (under one of the paths ``kept``) died with it — a ``TEMPORARY`` one, one this side
        never spawned — and its watchers get ``Terminated`` with ``error`` now."""
        for actor in list(self.watchers):
            if any(actor == path or actor.startswith(path + "/") for path in kept):
                continue
            self.gone[actor] = error
            self.notify_watchers(actor, error)

    def node_terminated(self) -> None:
        """The node will not come back: every remote actor of it has terminated."""
        error = self.cell.last_error if self.cell is not None else None
        for actor in list(self.watchers):
            self.notify_watchers(actor, error)
