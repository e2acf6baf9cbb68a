"""Nodes seen from a system: start or connect one, spawn actors on it, supervise it.

A node is an actor system in another process (or host) serving the protocol of ``_protocol``.
Locally each node is represented by a ``NodeActor``: it launches (or connects to) the node, owns
the DEALER link, heartbeats it and watches its process. Any failure — the process exits or is
killed, heartbeats stop, the link breaks — crashes the ``NodeActor`` with ``NodeLost``: pending
asks fail with ``ActorCrashed``, and its supervisor restarts it like any actor. A restarted
``NodeActor`` launches a fresh node and spawns again the actors spawned on the old one (except
``TEMPORARY`` ones and those that terminated), so ``RemoteActorRef``s stay valid.

Stopping a node: ask it to shut down, wait ``shutdown_grace``, then SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, Protocol, TypeVar

import attrs
import trio
import zmq

from .._actor import Actor, ActorContext
from .._message import Request
from .._supervisor import ChildSpec, Restart
from . import _protocol as P
from ._link import NodeLink
from ._ref import NodeHandle, RemoteActorRef
from ._server import DEFAULT_MAX_MESSAGE_BYTES, serve_node
from ._typeinfo import register_actor_types, register_value_types
from ._zmq import CurveClient, open_zmq_socket

M = TypeVar("M")


def _str_tuple(values: Iterable[str]) -> tuple[str, ...]:
    if isinstance(values, str):
        return (values,)
    return tuple(values)


@attrs.frozen
class NodeOptions:
    """Timing and limits of a node link (seconds)."""

    connect_timeout: float = 20.0
    heartbeat_interval: float = 0.5
    heartbeat_timeout: float = 5.0
    shutdown_grace: float = 5.0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES


@attrs.define
class Launched:
    """What a launcher started: where to connect, and how to clean up."""

    address: str
    curve: CurveClient | None = None
    process: trio.Process | None = None
    owns_node: bool = True  # stopping the NodeActor shuts the node down
    in_process: bool = False  # the node runs in a helper task: it stops (gracefully) with it
    cleanup: Callable[[], None] | None = None


class Launcher(Protocol):
    async def launch(self, ctx: ActorContext[Any], name: str, options: NodeOptions) -> Launched: ...


@attrs.frozen
class SubprocessLauncher:
    """Start ``python -m asyncflow_actors.node`` as a child process of this one.

    ``transport``: ``"ipc"`` (a socket file in a private temporary directory) or ``"tcp"`` (a free
    port on ``host``, loopback by default). The child exits when this process dies (it watches
    its stdin). Its stdout is forwarded to ours.
    """

    allow: tuple[str, ...] = attrs.field(converter=_str_tuple)
    transport: Literal["ipc", "tcp"] = "ipc"
    host: str = "127.0.0.1"
    python: str = sys.executable
    env: Mapping[str, str] | None = None

    async def launch(self, ctx: ActorContext[Any], name: str, options: NodeOptions) -> Launched:
        tmpdir = tempfile.mkdtemp(prefix="afa-node-")
        bind = f"ipc://{tmpdir}/node.sock" if self.transport == "ipc" else f"tcp://{self.host}:*"
        cmd = [self.python, "-m", "asyncflow_actors.node", "--bind", bind, "--name", name]
        cmd += ["--exit-on-stdin-eof", "--max-message-bytes", str(options.max_message_bytes)]
        for prefix in self.allow:
            cmd += ["--allow", prefix]
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        process = await trio.lowlevel.open_process(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        try:
            assert process.stdout is not None
            with trio.fail_after(options.connect_timeout):
                line, rest = await _read_line(process.stdout)
            ready = json.loads(line)
            address = ready["endpoints"][0]
        except BaseException:
            process.kill()
            with trio.CancelScope(shield=True):
                await process.wait()
            shutil.rmtree(tmpdir, ignore_errors=True)
            raise
        ctx.start_soon(_pump, process.stdout, rest)
        return Launched(address, process=process, cleanup=lambda: shutil.rmtree(tmpdir, True))


@attrs.frozen
class InProcessLauncher:
    """Serve the node from a task of this process over ``inproc://`` (tests, benchmarks).

    It has its own actor system; messages still cross the wire format and flow control.
    """

    allow: tuple[str, ...] = attrs.field(converter=_str_tuple)

    async def launch(self, ctx: ActorContext[Any], name: str, options: NodeOptions) -> Launched:
        bind = f"inproc://afa-node-{name}-{id(ctx)}"
        endpoints: list[str] = await ctx.start(
            lambda task_status: serve_node(
                bind,
                allow=self.allow,
                name=name,
                max_message_bytes=options.max_message_bytes,
                task_status=task_status,
            )
        )
        return Launched(endpoints[0], in_process=True)


@attrs.frozen
class ConnectLauncher:
    """Connect to a node started by hand (``python -m asyncflow_actors.node --bind ...``).

    Stopping the ``NodeActor`` stops the actors it spawned there, not the node.
    """

    address: str
    curve: CurveClient | None = None

    async def launch(self, ctx: ActorContext[Any], name: str, options: NodeOptions) -> Launched:
        await trio.lowlevel.checkpoint()
        return Launched(self.address, curve=self.curve, owns_node=False)


async def _read_line(stream: trio.abc.ReceiveStream) -> tuple[bytes, bytes]:
    buffer = b""
    while b"\n" not in buffer:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise P.NodeLost(f"node exited before it was ready (output: {buffer[-2000:]!r})")
        buffer += chunk
    line, _, rest = buffer.partition(b"\n")
    return line, rest


async def _pump(stream: trio.abc.ReceiveStream, first: bytes | bytearray) -> None:
    """Forward a node's stdout to ours (a full pipe would block the node)."""
    out = sys.stdout.buffer if hasattr(sys.stdout, "buffer") else None
    data = first
    while True:
        if data and out is not None:
            out.write(data)
            out.flush()
        data = await stream.receive_some(65536)
        if not data:
            return


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

    def __init__(self, handle: NodeHandle, launcher: Launcher, options: NodeOptions) -> None:
        self.handle = handle
        self.launcher = launcher
        self.options = options
        self.launched: Launched | None = None
        self.link: NodeLink | None = None
        self.stack = contextlib.AsyncExitStack()
        self.stopping = False

    def default_shutdown(self) -> float | None:
        return self.options.shutdown_grace * 2 + 5

    async def on_start(self, ctx: ActorContext[SpawnRemote | GetNode]) -> None:
        if self.handle.cell is not ctx._cell:
            self.handle.cell = ctx._cell
            ctx._cell.on_terminate.append(self.handle.node_terminated)
        try:
            await self._start(ctx)
        except BaseException:
            with trio.CancelScope(shield=True):
                await self._teardown(
                    P.NodeLost(f"node {self.handle.name!r} failed to start"), polite=False
                )
            raise

    async def _start(self, ctx: ActorContext[SpawnRemote | GetNode]) -> None:
        name = self.handle.name
        self.launched = launched = await self.launcher.launch(ctx, name, self.options)
        if launched.process is not None:
            ctx.start_soon(self._watch_process, ctx, launched.process)
        sock = await self.stack.enter_async_context(
            open_zmq_socket(
                zmq.Context.instance(), zmq.DEALER, connect=launched.address, curve=launched.curve
            )
        )
        link = NodeLink(
            sock,
            self.handle.registry,
            node=name,
            max_message_bytes=self.options.max_message_bytes,
            on_gone=self.handle.on_gone,
        )
        self.link = link
        ctx.start_soon(link.run)
        info: P.NodeInfo | None = None
        with trio.move_on_after(self.options.connect_timeout) as scope:
            while info is None:  # say hello again every second: a node may still be starting
                with trio.move_on_after(1.0):
                    info = await link.request(P.HELLO)
        if info is None or scope.cancelled_caught:
            raise P.NodeLost(
                f"node {name!r} at {launched.address} did not answer within "
                f"{self.options.connect_timeout}s (down, wrong address, or CURVE refused us)"
            )
        for request in list(self.handle.specs.values()):
            await self._spawn_on(link, request)
        self.handle.attach(link, info, launched.address)
        ctx.start_soon(self._heartbeat, ctx, link)

    async def _spawn_on(self, link: NodeLink, request: P.SpawnRequest) -> RemoteActorRef[Any]:
        register_value_types(self.handle.registry, request.kwargs)
        spawned: P.SpawnedInfo = await link.request(P.SPAWN, request, cls=request.target)
        link.open_credits(spawned.name, spawned.capacity)
        local = _import_locally(request.target)
        if local is not None:
            register_actor_types(self.handle.registry, local)
            from .._actor import accepted_message_types

            self.handle.accepts[spawned.name] = accepted_message_types(local) or ()
        else:
            self.handle.accepts[spawned.name] = frozenset(spawned.accepts)
        self.handle.gone.pop(spawned.name, None)
        return RemoteActorRef(self.handle, spawned.name)

    async def receive(
        self, msg: SpawnRemote | GetNode, ctx: ActorContext[SpawnRemote | GetNode]
    ) -> Any:
        if isinstance(msg, GetNode):
            return Node(self.handle, ctx.self)
        assert self.link is not None
        request = P.SpawnRequest(
            msg.target, msg.name, dict(msg.kwargs), msg.mailbox_size, msg.restart.value
        )
        try:
            ref = await self._spawn_on(self.link, request)
        except Exception as exc:  # refused, failed to start, name taken: the asker's problem
            ctx.reply_error(exc)
            return None
        if msg.restart is not Restart.TEMPORARY:
            self.handle.specs[msg.name] = request
        return ref

    async def _heartbeat(self, ctx: ActorContext[Any], link: NodeLink) -> None:
        while True:
            await trio.sleep(self.options.heartbeat_interval)
            silent = trio.current_time() - link.last_heard
            if silent > self.options.heartbeat_timeout:
                ctx.fail(P.NodeLost(f"node {self.handle.name!r} silent for {silent:.1f}s"))
                return
            with contextlib.suppress(trio.WouldBlock, trio.ClosedResourceError):
                link.send_meta_nowait(P.PING)

    async def _watch_process(self, ctx: ActorContext[Any], process: trio.Process) -> None:
        code = await process.wait()
        if not self.stopping:
            ctx.fail(
                P.NodeLost(f"node {self.handle.name!r} (pid {process.pid}) exited with code {code}")
            )

    async def on_stop(
        self, ctx: ActorContext[SpawnRemote | GetNode], error: BaseException | None
    ) -> None:
        lost = error if error is not None else P.NodeLost(f"node {self.handle.name!r} stopped")
        await self._teardown(lost, polite=not isinstance(error, P.NodeLost))

    async def _teardown(self, lost: BaseException, *, polite: bool) -> None:
        """Shut the node down (``polite``: ask it, then wait; else kill it at once)."""
        self.stopping = True
        self.handle.detach()
        link, launched = self.link, self.launched
        process = launched.process if launched is not None else None
        try:
            if (
                polite
                and link is not None
                and link.closed is None
                and launched is not None
                and not launched.in_process
            ):
                # The helper tasks (the link's receiver among them) are gone by now.
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(link.run)
                    with trio.move_on_after(self.options.shutdown_grace):
                        if launched.owns_node and (process is None or process.returncode is None):
                            await link.request(P.SHUTDOWN)
                        elif not launched.owns_node:
                            for actor in list(self.handle.specs):
                                await link.request(P.STOP, target=actor)
                    nursery.cancel_scope.cancel()
            if polite and process is not None and process.returncode is None:
                with trio.move_on_after(self.options.shutdown_grace):
                    await process.wait()
                if process.returncode is None:
                    process.terminate()
                    with trio.move_on_after(2.0):
                        await process.wait()
        finally:
            if process is not None and process.returncode is None:
                process.kill()
                with trio.CancelScope(shield=True):
                    await process.wait()
            if link is not None:
                link.close(lost)
            with trio.CancelScope(shield=True):
                await self.stack.aclose()
            if launched is not None and launched.cleanup is not None:
                launched.cleanup()
            self.link = None


def _import_locally(target: str) -> type[Actor[Any]] | None:
    """The actor class, if this process can import it too (for local type checks)."""
    import importlib

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

    def __init__(self, handle: NodeHandle, ref: Any) -> None:
        self._handle = handle
        self.ref = ref  # the local NodeActor

    @property
    def name(self) -> str:
        return self._handle.name

    @property
    def address(self) -> str:
        """The endpoint of the current incarnation (it changes when the node restarts)."""
        return self._handle.address

    @property
    def pid(self) -> int | None:
        return self._handle.info.pid if self._handle.info is not None else None

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
        allowlist. ``kwargs`` go to the constructor (plain data, tensors, or attrs classes of
        the constructor's annotations). ``restart`` is applied by the node's own supervisor; a
        non-``TEMPORARY`` actor is spawned again when the node itself restarts. Raises
        ``SpawnRefused``, ``NameTakenError`` or ``ActorCrashed`` (it failed to start).
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
    restart: Restart = Restart.PERMANENT,
    options: NodeOptions | None = None,
) -> ChildSpec:
    """A ``ChildSpec`` for a node, to put under any supervisor (``GetNode`` gets its handle)."""
    chosen = options if options is not None else NodeOptions()
    handle = NodeHandle(name, P.protocol_registry())

    def factory() -> NodeActor:
        return NodeActor(handle, launcher, chosen)

    return ChildSpec(factory, name, restart=restart, mailbox_size=NodeActor.mailbox_size)
