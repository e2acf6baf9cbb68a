"""``Mesh``: how one actor system reaches every other system of a run, and they reach it.

Each system opened by ``open_actor_system`` has a mesh (``system.mesh``): it is the system's
``Transport`` (``actors._transport``). It names the system (``name``, and an ``incarnation``
that is new, and larger, at every start), listens on a ROUTER socket (its ``NodeServer``) so that any peer can
reach any of its actors, and keeps one ``Peer`` per other system it talks to, with a link opened
lazily on first use. Refs travel inside messages as ``ActorAddress``es: ``address_of`` names a
ref for the wire, ``resolve`` turns an address back into a ref that works here — a local ref when
it names this system, a ``RemoteActorRef`` through the right peer otherwise. Data thus goes
straight between the processes that hold it, never through a third one.

A plain system listens only once it needs to: when it starts or connects its first node, or
when one of its refs is sent to another system (an ipc socket in a private directory and a tcp
socket on loopback). ``system.listen(...)`` binds elsewhere (another host's peers), with CURVE.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import attrs
import trio
import zmq

from .._errors import ActorCrashed
from .._ref import ActorRef, DeadActorRef, LocalActorRef
from .._system import default_system_name
from . import _protocol as P
from ._address import ActorAddress
from ._curve import (
    PROCESS_KEYS,
    CurveClient,
    CurveServer,
    KeyBindings,
    KeyModel,
    ZapAuthenticator,
    open_zap_authenticator,
)
from ._endpoints import (
    advertised,
    heartbeat_options,
    is_loopback,
    new_incarnation,
    pick_endpoint,
)
from ._link import NodeLink
from ._peer import Peer
from ._ref import RemoteActorRef
from ._server import DEFAULT_MAX_MESSAGE_BYTES, ROUTER_RCVHWM, NodeServer, NodeServerStatistics
from ._zmq import open_zmq_socket

if TYPE_CHECKING:
    from .._system import ActorSystem
    from ._launch import NodeOptions

log = logging.getLogger("asyncflow_actors.node")


@attrs.frozen
class LinkStatistics:
    """This system's traffic to one peer over its link."""

    peer: str
    sent: int
    sent_bytes: int
    received_bytes: int
    rejected: int
    wire_errors: int


@attrs.frozen
class MeshStatistics:
    """Where a system listens, what its server received and sent, and each link's traffic."""

    name: str
    endpoints: tuple[str, ...]
    server: NodeServerStatistics | None
    links: tuple[LinkStatistics, ...]

    @property
    def bytes_total(self) -> int:
        """Every byte that crossed this system's sockets, both ways."""
        server = self.server
        own = server.received_bytes + server.sent_bytes if server is not None else 0
        return own + sum(link.sent_bytes + link.received_bytes for link in self.links)


class Mesh:
    """One system's place in the run (see the module docstring)."""

    def __init__(self, system: ActorSystem, name: str | None, options: NodeOptions) -> None:
        self.system = system
        self.name = name if name is not None else default_system_name()
        self.incarnation = new_incarnation()
        self.session = secrets.token_hex(16)
        self.options = options
        self.registry = P.protocol_registry()
        self.endpoints: tuple[str, ...] = ()
        self.server: NodeServer | None = None
        self.peers: dict[str, Peer] = {}
        self.owner: str | None = None  # the system that owns this node (its last owner hello)
        # CURVE, set when it listens with it: this system's keypair and the key each peer's
        # name is bound to (its links to a peer expect that key; ``KeyBindings``)
        self.keys: KeyBindings | None = None
        self.curve: CurveClient | None = None  # this system's keypair as a client's
        # A hook that may rewrite where a link connects: (peer name, endpoint) -> endpoint.
        # The testing kit routes links through a fault-injecting proxy with it.
        self.route: Callable[[str, str], str] | None = None
        self._nursery: trio.Nursery | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._tmpdir: str | None = None
        self._listening = trio.Event()

    def statistics(self) -> MeshStatistics:
        links = tuple(
            LinkStatistics(
                peer.name,
                link.sent,
                link.sent_bytes,
                link.received_bytes,
                link.rejected,
                link.wire_errors,
            )
            for peer in self.peers.values()
            if (link := peer.link) is not None
        )
        server = self.server.statistics() if self.server is not None else None
        return MeshStatistics(self.name, self.endpoints, server, links)

    # -- lifetime ----------------------------------------------------------------------------------

    @asynccontextmanager
    async def run(self) -> AsyncIterator[Mesh]:
        """Own the mesh's tasks and sockets for the life of the system (``open_actor_system``)."""
        async with contextlib.AsyncExitStack() as stack, trio.open_nursery() as nursery:
            self._nursery, self._stack = nursery, stack
            try:
                yield self
            finally:
                for peer in self.peers.values():
                    if not peer.supervised and peer.link is not None:
                        peer.link.close(P.NodeLost(f"system {self.name!r} closed"))
                nursery.cancel_scope.cancel()
                self._nursery = None
                if self.keys in PROCESS_KEYS:
                    PROCESS_KEYS.remove(self.keys)
                if self._tmpdir is not None:
                    shutil.rmtree(self._tmpdir, ignore_errors=True)

    # -- listening ---------------------------------------------------------------------------------

    @property
    def listening(self) -> bool:
        return self.server is not None

    async def listen(
        self,
        bind: str | Sequence[str],
        *,
        allow: Sequence[str] = (),
        curve: CurveServer | None = None,
        authorized_keys: Sequence[bytes] | None = None,
        insecure: bool = False,
        key_model: KeyModel = "cluster",
        supervisor_keys: Sequence[bytes] = (),
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        peer_timeout: float = float("inf"),
        owner_token: str = "",
        on_shutdown: Any = None,
        context: zmq.Context[Any] | None = None,
    ) -> list[str]:
        """Bind this system's server; return the resolved endpoints (see ``ActorSystem.listen``)."""
        if self.server is not None:
            raise RuntimeError(f"system {self.name!r} already listens on {list(self.endpoints)}")
        assert self._stack is not None and self._nursery is not None
        binds = [bind] if isinstance(bind, str) else list(bind)
        exposed = [b for b in binds if not is_loopback(b)]
        if exposed and curve is None and not insecure:
            raise ValueError(
                f"binding {exposed} without CURVE exposes every actor of this system to the "
                "network: pass curve=CurveServer(...) (and authorized keys), or insecure=True "
                "if the network itself is trusted"
            )
        if exposed and curve is None:
            log.warning("system %s listens on %s WITHOUT authentication", self.name, exposed)
        if curve is not None and authorized_keys is None and key_model == "cluster":
            raise ValueError(
                "CURVE without authorized client keys would let any client that knows the "
                "server key in: pass authorized_keys"
            )
        ctx = context if context is not None else zmq.Context.instance()
        if curve is not None:
            # a task of the mesh: its nursery must not open in (and outlive) the caller's task
            auth = await self._nursery.start(_serve_zap, ctx)
            self.keys = KeyBindings(
                curve.keypair,
                key_model,
                authorized=authorized_keys or (),
                supervisors=supervisor_keys,
                domain=curve.domain,
                zap=auth,
            )
            self.curve = CurveClient(curve.keypair.public, curve.keypair)
            PROCESS_KEYS.append(self.keys)
        options: dict[int, int | bytes | str] = {zmq.ROUTER_MANDATORY: 1}
        options.update(heartbeat_options(self.options))
        options[zmq.MAXMSGSIZE] = max_message_bytes
        sock = await self._stack.enter_async_context(
            open_zmq_socket(
                ctx,
                zmq.ROUTER,
                bind=binds,
                curve=curve,
                options=options,
                sndhwm=0,
                rcvhwm=ROUTER_RCVHWM,
            )
        )
        self.endpoints = tuple(advertised(e) for e in sock.bound_endpoints)
        self.server = NodeServer(
            self,
            sock,
            allow=allow,
            max_message_bytes=max_message_bytes,
            peer_timeout=peer_timeout,
            owner_token=owner_token,
            on_shutdown=on_shutdown,
        )
        await self._nursery.start(self.server.serve)
        self._listening.set()
        return list(sock.bound_endpoints)

    async def ensure_listening(self) -> None:
        """Listen on the default endpoints (ipc in a private directory, tcp on loopback)."""
        if self.server is not None:
            await trio.lowlevel.checkpoint()
            return
        self._tmpdir = tempfile.mkdtemp(prefix="afa-sys-")
        await self.listen([f"ipc://{self._tmpdir}/system.sock", "tcp://127.0.0.1:*"])

    # -- refs on the wire ---------------------------------------------------------------------------

    def address_of(self, ref: ActorRef[Any]) -> ActorAddress:
        """The wire form of ``ref``; sending a local ref requires this system to listen."""
        if isinstance(ref, LocalActorRef):
            if self.server is None:
                raise RuntimeError(
                    f"system {self.name!r} does not listen: refs to its actors cannot leave "
                    "it (it listens once it starts or connects a node, or after listen())"
                )
            cell = ref.cell
            return ActorAddress(self.name, cell.path, self.endpoints, self.incarnation, cell.token)
        if isinstance(ref, RemoteActorRef):
            peer = ref._node
            path = ref.path
            return ActorAddress(
                peer.name, path, peer.endpoints, peer.incarnation, peer.tokens.get(path, "")
            )
        raise TypeError(f"{type(ref).__name__} cannot be sent")

    def resolve(self, address: ActorAddress) -> ActorRef[Any]:
        """A ref that works here for ``address`` (no I/O: links open on first use)."""
        if address.node == self.name:
            cell = self.system.lookup(address.path)
            if cell is None or not cell.path:
                return DeadActorRef(f"{self.name}/{address.path}")
            return cell.ref
        peer = self.peer(address.node)
        peer.learn(address.incarnation, address.endpoints)
        if address.token:
            peer.tokens.setdefault(address.path, address.token)
        return RemoteActorRef(peer, address.path)

    # -- peers ---------------------------------------------------------------------------------------

    def peer(self, name: str) -> Peer:
        """The peer called ``name`` (created on first mention)."""
        peer = self.peers.get(name)
        if peer is None:
            peer = self.peers[name] = Peer(self, name)
        return peer

    def adopt(self, peer: Peer) -> None:
        """Register a supervised peer (a node's handle) under its own name once known.

        Addresses naming that node then resolve through it. Nothing is closed: a mesh peer's
        link goes on serving the refs that hold it, and a node connected twice (two aliases)
        keeps both links; addresses resolve through the first one still alive.
        """
        current = self.peers.get(peer.name)
        if current is peer or (
            current is not None and current.supervised and not current.terminated
        ):
            return
        self.peers[peer.name] = peer

    def peer_hello(
        self, hello: P.Hello, *, owner: bool, key: bytes = b"", directs: bool = False
    ) -> None:
        """A peer connected to our server: learn where it listens (to reach it back). Our
        owner's word is authoritative; anyone else's is hearsay (``Peer.learn``). Under CURVE
        the key it proved binds its name when it is our owner or a supervisor (``directs``);
        anyone else's is remembered while nobody bound that name (the server refused the
        hello already if it claimed a name bound to another key)."""
        if hello.name == self.name:
            return
        if self.keys is not None and key:
            if owner or directs:
                self.keys.bind(hello.name, key)
            else:
                self.keys.hear(hello.name, key)
        peer = self.peer(hello.name)
        if owner and not peer.supervised:
            self.owner = hello.name
            peer.move(hello.incarnation, hello.endpoints)
        else:
            peer.learn(hello.incarnation, hello.endpoints)

    def owner_exited(self) -> None:
        """This node's owner's process is gone (``serve_node``'s ``watch_owner`` says so): its
        actors are gone for good. Calls to them fail at once (``ActorCrashed``, ``NodeLost``)
        instead of waiting for a connection that cannot come back, so that the clean-ups of
        this node's actors as it stops (a TransferQueue client returning its leases) are
        prompt; watchers of its actors hear of their end."""
        peer = self.peers.get(self.owner) if self.owner is not None else None
        if peer is None or peer.supervised:
            return
        lost = P.NodeLost(f"the owner of this node, {peer.name!r}, exited")
        link = peer.detach()
        if link is not None:
            link.close(lost)
        peer.stop(lost)
        peer.lost_with_process(lost, ())

    def peer_update(self, update: P.PeerUpdate) -> None:
        """This node's owner (the supervisor of the node named) says where that node is now,
        or that it is gone for good: authoritative, whatever incarnation this side knew."""
        if update.name == self.name:
            return
        if update.key and self.keys is not None:
            self.keys.bind(update.name, update.key)
        if update.key and update.up and not update.endpoints:
            # the name's new key only; where it listens comes next, from the same source:
            # hearsay cannot place it meanwhile, and a connect waits for that word
            bound = self.peer(update.name)
            if not bound.supervised:
                bound.authoritative = True
            return
        peer = self.peers.get(update.name)
        if peer is None and update.up:
            peer = self.peer(update.name)  # known now, so that hearsay cannot place it later
        if peer is None or peer.supervised:
            return
        older = peer.incarnation
        if peer.move(update.incarnation, update.endpoints) or not update.up:
            link = peer.detach()
            if link is not None:
                link.close(P.NodeLost(f"node {update.name!r} restarted or stopped"))
        if update.up and older not in (-1, update.incarnation):
            lost = P.NodeLost(f"node {update.name!r} restarted: its process died")
            peer.lost_with_process(lost, update.actors)
        if not update.up:
            peer.stop()
            for actor in list(peer.watchers):
                peer.notify_watchers(actor, P.NodeLost(f"node {update.name!r} stopped"))

    async def broadcast(self, update: P.PeerUpdate, skip: str) -> None:
        """Tell the other supervised peers where node ``skip`` is now (best effort, all at
        once: a peer that does not answer delays it by ``connect_timeout`` at most)."""
        async with trio.open_nursery() as nursery:
            for peer in list(self.peers.values()):
                link = peer.link
                if not peer.supervised or peer.name == skip or link is None or link.closed:
                    continue
                nursery.start_soon(self.tell_peers, link, (update,))

    def supervised_updates(self, skip: str) -> tuple[P.PeerUpdate, ...]:
        """Where each supervised peer that is up listens now (for a node that just started)."""
        return tuple(
            P.PeerUpdate(
                peer.name, peer.incarnation, peer.endpoints, True, tuple(peer.specs), peer.key
            )
            for peer in list(self.peers.values())
            if peer.supervised
            and peer.name != skip
            and peer.endpoints
            and peer.link is not None
            and not peer.link.closed
        )

    async def tell_peers(self, link: NodeLink, updates: Sequence[P.PeerUpdate]) -> None:
        with trio.move_on_after(self.options.connect_timeout), contextlib.suppress(Exception):
            for update in updates:
                await link.request(P.PEERS, update)

    def broadcast_soon(self, update: P.PeerUpdate, skip: str) -> None:
        """``broadcast`` from a task of the mesh (nothing once the system is closed)."""
        if self._nursery is not None:
            self._nursery.start_soon(self.broadcast, update, skip)

    def hello(self, owner_token: str = "") -> P.Hello:
        return P.Hello(self.name, self.incarnation, self.endpoints, self.session, owner_token)

    async def open_link(
        self,
        name: str,
        address: str,
        *,
        curve: CurveClient | None,
        options: NodeOptions,
        start_soon: Callable[..., Any],
        stack: contextlib.AsyncExitStack,
        owner_token: str = "",
        on_gone: Any = None,
        on_rejected: Any = None,
        on_lost: Any = None,
    ) -> tuple[NodeLink, P.NodeInfo]:
        """Connect a DEALER to ``address``, run its link with ``start_soon``, say hello.

        Raises ``NodeLost`` if the peer does not answer within ``options.connect_timeout``.
        """
        if self.server is None:
            await self.ensure_listening()  # so the peer can reach our actors back
        if self.route is not None:
            address = self.route(name, address)
        sock = await stack.enter_async_context(
            open_zmq_socket(
                zmq.Context.instance(),
                zmq.DEALER,
                connect=address,
                curve=curve,
                options=heartbeat_options(options),
            )
        )
        link = NodeLink(
            sock,
            self.registry,
            node=name,
            max_message_bytes=options.max_message_bytes,
            address_of=self.address_of,
            resolve=self.resolve,
            on_gone=on_gone,
            on_rejected=on_rejected,
            on_lost=on_lost,
        )
        start_soon(link.run)
        info: P.NodeInfo | None = None
        with trio.move_on_after(options.connect_timeout):
            while info is None:  # say hello again every second: a node may still be starting
                with trio.move_on_after(1.0):
                    try:
                        info = await link.request(P.HELLO, self.hello(owner_token))
                    except ActorCrashed as exc:  # the link closed: CURVE refused, dropped
                        if isinstance(exc.error, P.NodeLost):
                            raise exc.error from None
                        raise P.NodeLost(f"node {name!r} at {address}: {exc}") from exc
        if info is None:
            link.close(P.NodeLost(f"no answer from {address}"))
            raise P.NodeLost(
                f"node {name!r} at {address} did not answer within {options.connect_timeout}s "
                "(down, wrong address, or CURVE refused us)"
            )
        return link, info

    async def connect(self, peer: Peer) -> None:
        """Open a link to a mesh peer (one connect at a time per peer); ``ActorCrashed`` if
        it cannot be reached within ``connect_timeout``.

        A peer whose place its owner told (``peer_update``) and whose process is gone (its
        socket file removed) is restarting: the connect waits for the owner's word of where
        the new process listens, as a supervised peer's calls wait while it restarts. A
        connect to where the peer was gives up as soon as the owner says it moved, and tries
        the new place (a connect to the dead process's endpoint would wait out the timeout).
        """
        while peer._connecting is not None:
            await peer._connecting.wait()
            if peer.link is not None and peer.link.closed is None:
                return
        if self._nursery is None:
            raise ActorCrashed(peer.alias, P.NodeLost("the actor system is closed"))
        peer._connecting = event = trio.Event()
        try:
            deadline = trio.current_time() + self.options.connect_timeout
            while True:
                moved = peer.moved
                if peer.stopped:  # for good: where it was, nothing will answer again
                    raise _stopped_error(peer)
                address = pick_endpoint(peer.endpoints)
                if address is None and not peer.authoritative:
                    raise P.NodeLost(f"where node {peer.name!r} listens is not known here")
                if address is None:  # restarting: its owner tells where it is once it is up
                    with trio.move_on_at(deadline):
                        await moved.wait()
                    if not moved.is_set():
                        raise P.NodeLost(
                            f"node {peer.name!r} did not come back within "
                            f"{self.options.connect_timeout}s (its process is gone)"
                        )
                    continue
                if self.keys is not None and not await self.keys.wait_for_key(peer.name, deadline):
                    raise P.NodeLost(f"the CURVE key of node {peer.name!r} is not known here")
                if await self._connect_at(peer, address, moved, deadline):
                    return
        except P.NodeLost as exc:
            raise ActorCrashed(peer.alias, exc, detail="unreachable") from exc
        finally:
            peer._connecting = None
            event.set()

    def client_curve(self, name: str) -> CurveClient | None:
        """CURVE for a link to ``name``: its bound key (``None`` without CURVE here);
        ``NodeLost`` when that key is not known here (the node key model)."""
        if self.keys is None:
            return None
        curve = self.keys.client(name)
        if curve is None:
            raise P.NodeLost(f"the CURVE key of node {name!r} is not known here")
        return curve

    async def _connect_at(
        self, peer: Peer, address: str, moved: trio.Event, deadline: float
    ) -> bool:
        """Link ``peer`` at ``address``; False if its owner moved it meanwhile (try again)."""
        assert self._nursery is not None
        stack = contextlib.AsyncExitStack()
        link_nursery = self._nursery
        result: tuple[NodeLink, P.NodeInfo] | None = None

        def lost(error: BaseException) -> None:
            if result is not None and peer.link is result[0]:
                peer.detach()
            link_nursery.start_soon(stack.aclose)

        options = attrs.evolve(
            self.options, connect_timeout=max(0.0, deadline - trio.current_time())
        )
        failure: Exception | None = None
        try:
            async with trio.open_nursery() as race:

                async def give_up_when_moved() -> None:
                    await moved.wait()
                    race.cancel_scope.cancel()

                race.start_soon(give_up_when_moved)
                try:
                    result = await self.open_link(
                        peer.name,
                        address,
                        curve=self.client_curve(peer.name),
                        options=options,
                        start_soon=link_nursery.start_soon,
                        stack=stack,
                        on_gone=peer.on_gone,
                        on_rejected=peer.on_rejected,
                        on_lost=lost,
                    )
                except Exception as exc:  # raised below as itself, not in an ExceptionGroup
                    failure = exc
                race.cancel_scope.cancel()
            if failure is not None:
                raise failure
        except BaseException:
            with trio.CancelScope(shield=True):
                await stack.aclose()
            raise
        if result is None:  # moved while connecting: the old place is not where it is
            with trio.CancelScope(shield=True):
                await stack.aclose()
            return False
        link, info = result
        if info.name != peer.name:
            link.close(P.NodeLost(f"{address} is node {info.name!r}, not {peer.name!r}"))
            with trio.CancelScope(shield=True):
                await stack.aclose()
            raise P.NodeLost(f"{address} is node {info.name!r}, not {peer.name!r}")
        if moved.is_set():  # the answer came from where the peer was: not current
            link.close(P.NodeLost(f"node {peer.name!r} moved while connecting"))
            with trio.CancelScope(shield=True):
                await stack.aclose()
            return False
        peer.attach(link, info, address, authoritative=False)
        return True


async def _serve_zap(
    ctx: zmq.Context[Any], *, task_status: trio.TaskStatus[ZapAuthenticator]
) -> None:
    async with open_zap_authenticator(ctx) as auth:
        task_status.started(auth)
        await trio.sleep_forever()


def _stopped_error(peer: Peer) -> P.NodeLost:
    error = peer.stop_error
    return error if isinstance(error, P.NodeLost) else P.NodeLost(f"node {peer.name!r} stopped")
