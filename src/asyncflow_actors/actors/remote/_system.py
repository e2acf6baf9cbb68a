"""``open_actor_system``: a local actor system with the ``Mesh`` as its transport, and nodes.

The local runtime's ``ActorSystem`` is given a transport and knows nothing more of it. A
``NodeSystem`` is that system with the remote half composed in: its transport is a ``Mesh``
(so its refs travel to other processes) and it starts, connects and launches nodes, which it
supervises as children of its root like any actor. ``serve_node`` runs one as a node, and
``InProcessLauncher`` serves a node so from a task of this process.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Literal

import attrs
import trio
import zmq

from .._actor import ActorContext
from .._supervisor import ChildSpec, OneForOne, Restart, Strategy
from .._system import ActorSystem
from ._curve import CurveClient, CurveServer, KeyModel
from ._launch import (
    ConnectLauncher,
    Launched,
    Launcher,
    NodeOptions,
    SubprocessLauncher,
    _str_tuple,
)
from ._mesh import Mesh
from ._node import GetNode, Node, node_spec
from ._server import DEFAULT_MAX_MESSAGE_BYTES


class NodeSystem(ActorSystem):
    """An ``ActorSystem`` whose transport is a ``Mesh``: it reaches the other systems of a run
    and starts nodes. Create it with ``open_actor_system``."""

    def __init__(
        self,
        *,
        shutdown_grace: float = 5.0,
        kill_grace: float = 1.0,
        name: str | None = None,
        node_options: NodeOptions | None = None,
    ) -> None:
        options = node_options if node_options is not None else NodeOptions()
        # the mesh is made for this system (it serves its actors), then handed to it
        self._node_mesh = Mesh(self, name, options)
        super().__init__(
            shutdown_grace=shutdown_grace,
            kill_grace=kill_grace,
            name=name,
            transport=self._node_mesh,
        )

    @property
    def mesh(self) -> Mesh:
        """How this system reaches the other systems of the run and they reach it."""
        return self._node_mesh

    async def listen(
        self,
        bind: str | Sequence[str],
        *,
        curve: CurveServer | None = None,
        authorized_keys: Sequence[bytes] | None = None,
        insecure: bool = False,
        key_model: KeyModel = "cluster",
    ) -> list[str]:
        """Listen on ``bind`` so that systems on other hosts can reach this one's actors.

        A system listens on its own (ipc and loopback tcp) once it starts or connects a node;
        call this first to be reachable from other hosts. Beyond loopback, ``curve`` (with
        ``authorized_keys``, the Z85 public keys of the peers let in) is required, or
        ``insecure=True`` for a trusted network (a warning is logged). Returns the endpoints.

        ``key_model`` (under CURVE): ``"cluster"``, every system of the run shares the keypair
        of ``curve`` (nodes this system starts get it too); ``"node"``, ``curve``'s keypair is
        this system's own, each node it starts (or launches on Ray) gets a keypair of its own,
        and names are bound to keys: a node cannot speak as another or say where another
        listens (``authorized_keys`` may then be omitted: the nodes' keys are let in as they
        are bound). See ``docs/remote.md``, security.
        """
        return await self.mesh.listen(
            bind,
            curve=curve,
            authorized_keys=authorized_keys,
            insecure=insecure,
            key_model=key_model,
        )

    async def start_node(
        self,
        name: str,
        *,
        allow: Sequence[str],
        transport: Literal["ipc", "tcp", "inproc"] = "ipc",
        host: str = "127.0.0.1",
        env: Mapping[str, str] | None = None,
        restart: Restart = Restart.PERMANENT,
        options: NodeOptions | None = None,
    ) -> Node:
        """Start a node in a child process (``inproc``: in this process) and return its handle.

        ``allow`` lists the module prefixes actors may be spawned from on it. The node is a
        supervised child of the root (``PERMANENT``: restarted if it dies). See ``docs/remote.md``.
        """
        launcher: Launcher
        if transport == "inproc":
            launcher = InProcessLauncher(tuple(allow))
        else:
            launcher = SubprocessLauncher(tuple(allow), transport=transport, host=host, env=env)
        spec = node_spec(name, launcher, mesh=self.mesh, restart=restart, options=options)
        return await self._start_node(spec)

    async def connect_node(
        self,
        address: str,
        *,
        name: str,
        curve: CurveClient | None = None,
        restart: Restart = Restart.PERMANENT,
        options: NodeOptions | None = None,
    ) -> Node:
        """Connect to a node started elsewhere (``python -m asyncflow_actors.node``)."""
        launcher = ConnectLauncher(address, curve)
        spec = node_spec(name, launcher, mesh=self.mesh, restart=restart, options=options)
        return await self._start_node(spec)

    async def launch_node(
        self,
        name: str,
        launcher: Launcher,
        *,
        restart: Restart = Restart.PERMANENT,
        options: NodeOptions | None = None,
    ) -> Node:
        """Start a node with ``launcher`` (e.g. ``RayLauncher``, or one of your own) and return
        its handle; supervised like ``start_node``'s."""
        spec = node_spec(name, launcher, mesh=self.mesh, restart=restart, options=options)
        return await self._start_node(spec)

    async def _start_node(self, spec: ChildSpec) -> Node:
        ref = await self.start_child(spec)
        node: Node = await ref.ask(GetNode())
        return node


def mesh_of(system: ActorSystem) -> Mesh:
    """The ``Mesh`` of ``system`` (e.g. ``ctx.system`` in an actor); ``TypeError`` for a system
    local to its process (``open_local_actor_system``)."""
    if not isinstance(system, NodeSystem):
        raise TypeError(f"{system.name!r} is a local actor system: it has no mesh")
    return system.mesh


@asynccontextmanager
async def open_actor_system(
    *,
    strategy: Strategy | None = None,
    shutdown_grace: float = 5.0,
    kill_grace: float = 1.0,
    name: str | None = None,
    node_options: NodeOptions | None = None,
    handle_signals: bool = True,
) -> AsyncIterator[NodeSystem]:
    """Run an actor system for the duration of the ``async with`` block.

    ``strategy`` is the root supervisor's (default ``OneForOne()``); ``shutdown_grace`` the
    default grace of a stopping actor and ``kill_grace`` the time ``on_stop`` still gets after
    a grace ran out. Leaving the block — normally, by an exception, or by a cancellation from
    outside — stops every actor in reverse start order, each within its budget, so it is
    bounded by the sum of the graces whatever an actor is stuck in. If the root supervisor
    fails (its restart intensity exceeded), the block is cancelled and ``SupervisorFailed``
    surfaces from the ``async with`` inside an ``ExceptionGroup`` (trio's strict groups).

    ``name`` names the system in the run (default ``host:pid``); ``node_options`` time the
    links it opens to other systems (``docs/remote.md``).

    With ``handle_signals`` (the default; only in the main thread), SIGTERM stops the system as
    leaving the block does — node processes stopped, their sockets and files removed — and
    then raises ``SystemExit(143)``; SIGINT raises ``KeyboardInterrupt`` in the block as usual,
    which leaves it the same clean way.
    """
    system = NodeSystem(
        shutdown_grace=shutdown_grace, kill_grace=kill_grace, name=name, node_options=node_options
    )
    async with system.run(strategy=strategy, handle_signals=handle_signals):
        yield system


async def serve_node(
    bind: str | Sequence[str],
    *,
    allow: Sequence[str],
    name: str | None = None,
    curve: CurveServer | None = None,
    authorized_keys: Sequence[bytes] | None = None,
    key_model: KeyModel = "cluster",
    supervisor_keys: Sequence[bytes] = (),
    insecure: bool = False,
    strategy: Strategy | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    peer_timeout: float = math.inf,
    owner_token: str = "",
    options: NodeOptions | None = None,
    context: zmq.Context[Any] | None = None,
    watch_owner: Callable[[], Awaitable[object]] | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a node until its owner asks it to shut down, its owner exits, or the caller cancels
    it.

    ``bind``: endpoints (``tcp://127.0.0.1:*`` picks a port); ``task_status.started`` reports the
    resolved ones. ``allow``: module prefixes actors may be spawned from. ``curve`` requires
    CURVE and ``authorized_keys`` (Z85 public keys) lists the clients let in; binding beyond
    loopback without CURVE needs ``insecure=True``. ``key_model="node"``: ``curve``'s keypair is
    this node's own, names are bound to keys, and only the owner and the systems proving one of
    ``supervisor_keys`` say where other nodes listen (``NodeSystem.listen``). ``peer_timeout``: stop a session's actors once
    all its connections have been gone that long. ``owner_token``: the secret of the process
    allowed to shut the node down (its launcher). ``watch_owner`` returns once the owner's
    process has exited (a launched node: its stdin closed); the node then stops, and its
    actors' calls to the owner's actors fail at once (``Mesh.owner_exited``) rather than wait
    for a connection that cannot come back.
    """
    chosen = strategy if strategy is not None else OneForOne(max_restarts=3, within=5.0)
    shutdown = trio.Event()
    async with open_actor_system(name=name, strategy=chosen, node_options=options) as system:
        endpoints = await system.mesh.listen(
            bind,
            allow=allow,
            curve=curve,
            authorized_keys=authorized_keys,
            key_model=key_model,
            supervisor_keys=supervisor_keys,
            insecure=insecure,
            max_message_bytes=max_message_bytes,
            peer_timeout=peer_timeout,
            owner_token=owner_token,
            on_shutdown=shutdown.set,
            context=context,
        )
        task_status.started(endpoints)
        async with trio.open_nursery() as nursery:
            if watch_owner is not None:
                owner = watch_owner  # (narrowed for the closure)

                async def owner_exited() -> None:
                    await owner()
                    # Every actor stops first (their work is cancelled within a scheduling
                    # round), then calls to the owner's actors fail at once: the work ends
                    # quietly, not failing and crashing its actor, and the clean-ups as the
                    # actors stop meet the dead owner at once.
                    root = system.lookup("")
                    if root is not None and root.ctx is not None:
                        for child in root.ctx.children:
                            child.request_stop(None)
                    await trio.lowlevel.checkpoint()
                    system.mesh.owner_exited()
                    shutdown.set()

                nursery.start_soon(owner_exited)
            await shutdown.wait()
            nursery.cancel_scope.cancel()


@attrs.frozen
class InProcessLauncher:
    """Serve the node from a task of this process over ``inproc://`` (tests, benchmarks).

    It has its own actor system; messages still cross the wire format and flow control.
    """

    allow: tuple[str, ...] = attrs.field(converter=_str_tuple)

    async def launch(self, ctx: ActorContext[Any], name: str, options: NodeOptions) -> Launched:
        bind = f"inproc://afa-node-{name}-{id(ctx)}"
        token = secrets.token_hex(16)
        endpoints: list[str] = await ctx.start(
            lambda task_status: serve_node(
                bind,
                allow=self.allow,
                name=name,
                max_message_bytes=options.max_message_bytes,
                owner_token=token,
                options=options,
                task_status=task_status,
            )
        )
        return Launched(endpoints[0], in_process=True, owner_token=token)
