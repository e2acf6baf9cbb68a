"""Nodes seen from a system: start or connect one, spawn actors on it, supervise it.

A node is an actor system in another process (or host) that hosts actors for others. Locally
each node this system started or connected is represented by a ``NodeActor``: it launches (or
connects to) the node, owns the link and watches it. A node is lost only on evidence — its
process exited, its connection dropped, or libzmq's heartbeats went unanswered (``_link``) —
never because this process's loop was busy. Losing it crashes the ``NodeActor`` with
``NodeLost``: pending asks fail with ``ActorCrashed``, and its supervisor restarts it like any
actor. A restarted ``NodeActor`` launches a fresh node (or reconnects to a hand-started one,
which adopts the actors this session left there) and spawns again the actors spawned on the old
one (except ``TEMPORARY`` ones and those that terminated), so ``RemoteActorRef``s stay valid;
the watchers of those not spawned again get ``Terminated`` (``NodeLost``) as the node is lost.

Stopping a node: ask it to shut down, wait ``shutdown_grace``, then SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Mapping
from typing import Any, TypeVar

import attrs
import trio

from .._actor import Actor, ActorContext, accepted_message_types
from .._cell import Reply
from .._errors import ActorCrashed
from .._message import Request
from .._supervisor import ChildSpec, Restart
from . import _protocol as P
from ._launch import Launched, Launcher, NodeOptions
from ._link import NodeLink
from ._peer import Peer
from ._ref import RemoteActorRef
from ._typeinfo import register_actor_types, register_value_types

M = TypeVar("M")

log = logging.getLogger("asyncflow_actors.node")


@attrs.frozen
class SpawnRemote(Request["RemoteActorRef[Any]"]):
    """Spawn ``target`` (``"pkg.module:Class"``) on the node; replies with its ref."""

    target: str
    name: str
    kwargs: dict[str, Any] = attrs.Factory(dict)
    restart: Restart = Restart.PERMANENT
    mailbox_size: int | None = None


@attrs.frozen
class GetNode(Request["Node"]):
    """Reply with the ``Node`` handle of this node actor."""


class NodeActor(Actor[SpawnRemote | GetNode]):
    """The local representative of one node (see the module docstring)."""

    mailbox_size = 64

    def __init__(self, peer: Peer, launcher: Launcher, options: NodeOptions) -> None:
        self.peer = peer
        self.launcher = launcher
        self.options = options
        self.launched: Launched | None = None
        self.link: NodeLink | None = None
        self.stack = contextlib.AsyncExitStack()
        self.stopping = False

    def default_shutdown(self) -> float | None:
        return _stop_budget(self.options)

    async def on_start(self, ctx: ActorContext[SpawnRemote | GetNode]) -> None:
        if self.peer.cell is not ctx.cell:
            self.peer.cell = ctx.cell
            ctx.cell.on_terminate.append(self._terminated)
        try:
            await self._start(ctx)
        except BaseException:
            with trio.CancelScope(shield=True):
                await self._teardown(
                    P.NodeLost(f"node {self.peer.alias!r} failed to start"), polite=False
                )
            raise

    def _terminated(self) -> None:
        self.peer.node_terminated()
        update = P.PeerUpdate(self.peer.name, self.peer.incarnation, (), up=False)
        self.peer.mesh.broadcast_soon(update, self.peer.name)

    async def _start(self, ctx: ActorContext[SpawnRemote | GetNode]) -> None:
        peer = self.peer
        mesh = peer.mesh
        self.launched = launched = await self.launcher.launch(ctx, peer.alias, self.options)
        if launched.process is not None:
            ctx.start_soon(self._watch_process, ctx, launched.process)
        elif launched.wait_exit is not None:
            ctx.start_soon(self._watch_exit, ctx, launched.wait_exit)

        def lost(error: BaseException) -> None:
            if not self.stopping:
                ctx.fail(error)

        link, info = await mesh.open_link(
            peer.alias,
            launched.address,
            curve=launched.curve,
            options=self.options,
            start_soon=ctx.start_soon,
            stack=self.stack,
            owner_token=launched.owner_token,
            on_gone=peer.on_gone,
            on_rejected=peer.on_rejected,
            on_lost=lost,
        )
        self.link = link
        peer.name = info.name
        mesh.adopt(peer)
        # Under CURVE the node proved the key we connected with (the launcher's word): its
        # name is bound to that key here and, before its actors run, on the other nodes (so
        # they let it in and take its hello), and it learns where the others are and their
        # keys from us (its owner), so that its actors reach them from their first call.
        peer.key = launched.curve.server_public.decode() if launched.curve is not None else ""
        if peer.key and mesh.keys is not None:
            mesh.keys.bind(peer.name, peer.key)
        async with trio.open_nursery() as nursery:
            if peer.key:
                bind = P.PeerUpdate(peer.name, info.incarnation, (), True, key=peer.key)
                nursery.start_soon(mesh.broadcast, bind, peer.name)
            nursery.start_soon(mesh.tell_peers, link, mesh.supervised_updates(peer.name))
        if peer.specs:  # a restart: the actors spawned before come back (or are adopted)
            async with trio.open_nursery() as nursery:
                for request in list(peer.specs.values()):
                    nursery.start_soon(self._spawn_on, link, attrs.evolve(request, adopt=True))
        # Where the new process listens is known here from its own link, whatever incarnation
        # it drew; the other nodes learn it once its actors are back, before anyone here sees
        # the node up.
        endpoints = info.endpoints or (launched.address,)
        update = P.PeerUpdate(
            peer.name, info.incarnation, endpoints, True, tuple(peer.specs), peer.key
        )
        await mesh.broadcast(update, peer.name)
        peer.attach(link, info, launched.address, authoritative=True)
        # Nodes starting together miss each other above (a peer mid-start has no link to
        # tell, nor endpoints to be told about): once attached, this one tells its update
        # again and hears everyone attached by now; of any two, the later to attach then
        # finds the other attached, both ways, before its start returns.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(mesh.broadcast, update, peer.name)
            nursery.start_soon(mesh.tell_peers, link, mesh.supervised_updates(peer.name))

    async def _spawn_on(self, link: NodeLink, request: P.SpawnRequest) -> RemoteActorRef[Any]:
        register_value_types(link.registry, request.kwargs)
        info: P.ActorInfo = await link.request(P.SPAWN, request, cls=request.target)
        local = _import_locally(request.target)
        accepts: tuple[type, ...] | None = None
        if local is not None:
            register_actor_types(link.registry, local)
            accepts = accepted_message_types(local) or ()
        self.peer.learn_actor(link, info, accepts)
        return RemoteActorRef(self.peer, info.name)

    async def receive(
        self, msg: SpawnRemote | GetNode, ctx: ActorContext[SpawnRemote | GetNode]
    ) -> Any:
        if isinstance(msg, GetNode):
            return Node(self.peer, ctx.self)
        assert self.link is not None
        request = P.SpawnRequest(
            msg.target, msg.name, dict(msg.kwargs), msg.mailbox_size, msg.restart.value
        )
        # Spawns proceed concurrently (engines load in parallel), off this actor's loop.
        ctx.start_soon(self._spawn, self.link, msg, request, ctx.defer_reply())
        return None

    async def _spawn(
        self, link: NodeLink, msg: SpawnRemote, request: P.SpawnRequest, reply: Reply
    ) -> None:
        try:
            ref = await self._spawn_on(link, request)
        except Exception as exc:  # refused, failed to start, name taken: the asker's problem
            reply.fail(exc)
            return
        if msg.restart is not Restart.TEMPORARY:
            self.peer.specs[msg.name] = request
        reply.send(ref)

    async def _watch_process(self, ctx: ActorContext[Any], process: trio.Process) -> None:
        code = await process.wait()
        if not self.stopping:
            ctx.fail(
                P.NodeLost(f"node {self.peer.alias!r} (pid {process.pid}) exited with code {code}")
            )

    async def _watch_exit(self, ctx: ActorContext[Any], wait_exit: Any) -> None:
        reason = await wait_exit()
        if not self.stopping:
            ctx.fail(P.NodeLost(f"node {self.peer.alias!r} is gone: {reason}"))

    async def on_stop(
        self, ctx: ActorContext[SpawnRemote | GetNode], error: BaseException | None
    ) -> None:
        lost = error if error is not None else P.NodeLost(f"node {self.peer.alias!r} stopped")
        await self._teardown(lost, polite=not isinstance(error, P.NodeLost))

    async def _teardown(self, lost: BaseException, *, polite: bool) -> None:
        """Shut the node down (``polite``: ask it, then wait; else kill it at once).

        Bounded: the polite part (the request and the wait for the process, or the launcher's
        ``wait_exit``, to end) shares one ``shutdown_grace``; then SIGTERM and 2 s; then SIGKILL.
        """
        self.stopping = True
        self.peer.detach()
        link, launched = self.link, self.launched
        if launched is not None and launched.owns_node:
            # the process ends here whatever happens next, so its actors that are not spawned
            # again are gone: their watchers hear it now (a restart never mentions them). A
            # node we do not own lives on: the actors we leave there are not dead.
            self.peer.lost_with_process(lost, tuple(self.peer.specs))
        process = launched.process if launched is not None else None
        # a node that is not our child (a Ray actor) says when it has exited
        wait_exit = launched.wait_exit if launched is not None and process is None else None
        try:
            if polite and launched is not None and not launched.in_process:
                with trio.move_on_after(self.options.shutdown_grace):
                    if link is not None and link.closed is None:
                        await self._say_goodbye(link, launched, process)
                        if wait_exit is not None and launched.owns_node:
                            await wait_exit()  # it finishes stopping before the cleanup
                    if process is not None:
                        await process.wait()
                if process is not None and process.returncode is None:
                    log.warning(
                        "node %r (pid %d) did not exit within its shutdown grace of %.3g s: "
                        "terminating it",
                        self.peer.alias,
                        process.pid,
                        self.options.shutdown_grace,
                    )
                    process.terminate()
                    with trio.move_on_after(2.0):
                        await process.wait()
        finally:
            if process is not None:
                with trio.CancelScope(shield=True):
                    if process.returncode is None:
                        process.kill()
                        await process.wait()
                    for pipe in (process.stdin, process.stdout):
                        if pipe is not None:
                            await pipe.aclose()  # not left to the garbage collector
            if link is not None:
                link.close(lost)
            with trio.CancelScope(shield=True):
                await self.stack.aclose()
            if launched is not None and launched.cleanup is not None:
                pending = launched.cleanup()
                if pending is not None:  # an async cleanup (a Ray actor to remove)
                    with trio.CancelScope(shield=True):
                        await pending
            self.link = None

    async def _say_goodbye(
        self, link: NodeLink, launched: Launched, process: trio.Process | None
    ) -> None:
        """Ask an owned node to shut down, or stop what we spawned on one we do not own."""
        # The helper tasks (the link's receiver among them) are gone by now.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(link.run)
            if launched.owns_node and (process is None or process.returncode is None):
                try:
                    await link.request(P.SHUTDOWN)
                except ActorCrashed as exc:
                    # the node exits when asked: its connection may drop before its answer
                    # arrives. The caller waits for the process either way.
                    if not isinstance(exc.error, P.NodeLost):
                        raise
            elif not launched.owns_node:
                for actor in list(self.peer.specs):
                    await link.request(P.STOP, target=actor, tok=self.peer.tokens.get(actor, ""))
            nursery.cancel_scope.cancel()


def _stop_budget(options: NodeOptions) -> float:
    """Polite shutdown, then SIGTERM and 2 s, then SIGKILL and the clean-up."""
    return options.shutdown_grace + 2.0 + 1.0


def _import_locally(target: str) -> type[Actor[Any]] | None:
    """The actor class, if this process can import it too (for local type checks)."""
    module, _, qualname = target.partition(":")
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except Exception:
        return None
    return obj if isinstance(obj, type) and issubclass(obj, Actor) else None


class Node:
    """A handle on a node for user code: spawn actors on it, stop it, inspect it."""

    def __init__(self, peer: Peer, ref: Any) -> None:
        self._peer = peer
        self.ref = ref  # the local NodeActor

    @property
    def name(self) -> str:
        return self._peer.alias

    @property
    def address(self) -> str:
        """The endpoint of the current incarnation (it changes when the node restarts)."""
        return self._peer.address

    @property
    def key(self) -> str:
        """The CURVE public key (Z85) the node's name is bound to: the key of its current
        process (a restart may draw a new one); ``""`` without CURVE."""
        return self._peer.key

    @property
    def pid(self) -> int | None:
        return self._peer.info.pid if self._peer.info is not None else None

    async def spawn(
        self,
        target: str | type[Actor[M]],
        *,
        name: str,
        kwargs: Mapping[str, Any] | None = None,
        restart: Restart = Restart.PERMANENT,
        mailbox_size: int | None = None,
    ) -> RemoteActorRef[M]:
        """Start an actor on the node; returns once its ``on_start`` finished there.

        ``target`` is ``"package.module:Class"`` (or the class) and must be in the node's
        allowlist. ``kwargs`` go to the constructor (plain data, tensors, refs, or attrs classes
        of the constructor's annotations). ``restart`` is applied by the node's own supervisor;
        a non-``TEMPORARY`` actor is spawned again when the node itself restarts. Several
        spawns run concurrently. Raises ``SpawnRefused``, ``NameTakenError`` or
        ``ActorCrashed`` (it failed to start).
        """
        path = target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"
        msg = SpawnRemote(path, name, dict(kwargs or {}), restart, mailbox_size)
        ref: RemoteActorRef[M] = await self.ref.ask(msg)
        return ref

    async def stop(self) -> None:
        """Stop the node for good (its actors stop, the process exits)."""
        await self.ref.stop()

    def __repr__(self) -> str:
        return f"<Node {self.name!r} at {self.address or '?'}>"


def node_spec(
    name: str,
    launcher: Launcher,
    *,
    mesh: Any,
    restart: Restart = Restart.PERMANENT,
    options: NodeOptions | None = None,
) -> ChildSpec:
    """A ``ChildSpec`` for a node of ``mesh``'s system (``system.mesh``), to put under any
    supervisor; ask the child ``GetNode()`` for the handle."""
    chosen = options if options is not None else NodeOptions()
    peer = Peer(mesh, name)

    def factory() -> NodeActor:
        return NodeActor(peer, launcher, chosen)

    grace = _stop_budget(chosen)
    return ChildSpec(
        factory, name, restart=restart, mailbox_size=NodeActor.mailbox_size, shutdown=grace
    )
