"""``open_actor_system``: the root nursery, the root supervisor and the name registry."""

from __future__ import annotations

import math
import signal
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import attrs
import trio

from ._actor import Actor, _class_mailbox
from ._cell import ActorCell, ActorStatistics
from ._errors import NameTakenError
from ._ref import ActorRef
from ._supervisor import ChildSpec, OneForOne, Restart, StartChild, StopChild, Strategy, Supervisor

if TYPE_CHECKING:
    from .remote._curve import CurveClient, CurveServer
    from .remote._launch import Launcher, NodeOptions
    from .remote._mesh import Mesh
    from .remote._node import Node

N = TypeVar("N")


@attrs.frozen
class SystemStatistics:
    """Every live actor's statistics, by path."""

    actors: tuple[ActorStatistics, ...]

    def by_name(self, name: str) -> ActorStatistics:
        for stats in self.actors:
            if stats.name == name:
                return stats
        raise KeyError(name)


class ActorSystem:
    """A tree of actors under one root supervisor; create it with ``open_actor_system``.

    Actor paths are ``/``-joined names (``"tq/storage-0"``); a path is unique among live actors.
    """

    def __init__(self, *, shutdown_grace: float, kill_grace: float = 1.0) -> None:
        self.shutdown_grace = shutdown_grace
        self.kill_grace = kill_grace
        self._cells: dict[str, ActorCell] = {}
        self._root: ActorCell | None = None
        self._mesh: Mesh | None = None

    @property
    def mesh(self) -> Mesh:
        """How this system reaches the other systems of the run and they reach it."""
        if self._mesh is None:
            raise RuntimeError("the actor system is not running")
        return self._mesh

    @property
    def name(self) -> str:
        """This system's name in the run (how addresses of its actors name it)."""
        return self.mesh.name

    async def listen(
        self,
        bind: str | Sequence[str],
        *,
        curve: CurveServer | None = None,
        authorized_keys: Sequence[bytes] | None = None,
        insecure: bool = False,
    ) -> list[str]:
        """Listen on ``bind`` so that systems on other hosts can reach this one's actors.

        A system listens on its own (ipc and loopback tcp) once it starts or connects a node;
        call this first to be reachable from other hosts. Beyond loopback, ``curve`` (with
        ``authorized_keys``, the Z85 public keys of the peers let in) is required, or
        ``insecure=True`` for a trusted network (a warning is logged). Returns the endpoints.
        """
        return await self.mesh.listen(
            bind, curve=curve, authorized_keys=authorized_keys, insecure=insecure
        )

    @property
    def root(self) -> ActorRef[Any]:
        """The root supervisor (accepts ``StartChild``, ``StopChild``, ``WhichChildren``)."""
        if self._root is None:
            raise RuntimeError("the actor system is not running")
        return self._root.ref

    async def spawn(
        self,
        factory: Callable[[], Actor[N]],
        *,
        name: str,
        restart: Restart = Restart.TEMPORARY,
        mailbox_size: int | None = None,
        shutdown: float | None = None,
    ) -> ActorRef[N]:
        """Start a top-level actor under the root supervisor; returns after its ``on_start``.

        ``factory`` is called for every (re)start: an actor class or a ``lambda``. By default a
        top-level actor is ``TEMPORARY`` (not restarted; a crash is logged and reported to its
        watchers). Raises ``NameTakenError`` or ``ActorCrashed`` (it failed to start).
        """
        size = mailbox_size if mailbox_size is not None else _class_mailbox(factory)
        spec = ChildSpec(factory, name, restart=restart, shutdown=shutdown, mailbox_size=size)
        ref: ActorRef[N] = await self.start_child(spec)
        return ref

    async def start_child(self, spec: ChildSpec) -> ActorRef[Any]:
        """Start ``spec`` under the root supervisor (see ``spawn``)."""
        return await self.root.ask(StartChild(spec))

    async def stop_child(self, name: str) -> None:
        """Stop a top-level actor for good."""
        await self.root.ask(StopChild(name))

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
        from .remote._launch import InProcessLauncher, SubprocessLauncher
        from .remote._node import node_spec

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
        from .remote._launch import ConnectLauncher
        from .remote._node import node_spec

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
        from .remote._node import node_spec

        spec = node_spec(name, launcher, mesh=self.mesh, restart=restart, options=options)
        return await self._start_node(spec)

    async def _start_node(self, spec: ChildSpec) -> Node:
        from .remote._node import GetNode

        ref = await self.start_child(spec)
        node: Node = await ref.ask(GetNode())
        return node

    def whereis(self, path: str) -> ActorRef[Any] | None:
        """The live actor at ``path``, or ``None``."""
        cell = self._cells.get(path)
        return cell.ref if cell is not None else None

    def statistics(self) -> SystemStatistics:
        return SystemStatistics(tuple(cell.statistics() for cell in self._cells.values()))

    def _new_cell(
        self,
        name: str,
        *,
        parent: ActorCell | None,
        mailbox_size: int | float,
        shutdown: float | None,
    ) -> ActorCell:
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"actor names are non-empty strings without '/', got {name!r}")
        path = f"{parent.path}/{name}" if parent is not None and parent.path else name
        if path in self._cells:
            raise NameTakenError(f"an actor named {path!r} is already running")
        if not (isinstance(mailbox_size, int) and mailbox_size >= 0) and mailbox_size != math.inf:
            raise ValueError(f"mailbox_size must be an int >= 0, got {mailbox_size!r}")
        cell = ActorCell(self, path, mailbox_size=mailbox_size, parent=parent, shutdown=shutdown)
        self._cells[path] = cell
        return cell

    def unregister(self, cell: ActorCell) -> None:
        if self._cells.get(cell.path) is cell:
            del self._cells[cell.path]


@asynccontextmanager
async def open_actor_system(
    *,
    strategy: Strategy | None = None,
    shutdown_grace: float = 5.0,
    kill_grace: float = 1.0,
    name: str | None = None,
    node_options: NodeOptions | None = None,
    handle_signals: bool = True,
) -> AsyncIterator[ActorSystem]:
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
    from .remote._launch import NodeOptions as _NodeOptions
    from .remote._mesh import Mesh

    for what, value in (("shutdown_grace", shutdown_grace), ("kill_grace", kill_grace)):
        if not (isinstance(value, (int, float)) and 0 <= value < math.inf):
            raise ValueError(f"{what} must be a finite number of seconds >= 0, got {value!r}")
    system = ActorSystem(shutdown_grace=shutdown_grace, kill_grace=kill_grace)
    mesh = Mesh(system, name, node_options if node_options is not None else _NodeOptions())
    root = ActorCell(system, "", mailbox_size=math.inf, parent=None, shutdown=None)
    chosen = strategy if strategy is not None else OneForOne()

    # The actors run shielded from cancellation of the caller: cancelling the ``async with``
    # block from outside must still stop them gracefully (their ``on_stop`` may have processes
    # to reap), within their shutdown graces. Only the block's own body sees the cancellation.
    tree_scope = trio.CancelScope(shield=True)

    async def run_root(task_status: trio.TaskStatus[BaseException | None]) -> None:
        with tree_scope:
            exit = await root.run(lambda: Supervisor((), chosen), task_status=task_status)
        root.terminate(exit.error)
        if exit.error is not None and not exit.start_failed and not exit.killed:
            raise exit.error  # the root failed (a kill during the stop was logged already)

    signals: list[int] = []
    block = trio.CancelScope()

    async def watch_signals(task_status: trio.TaskStatus[None]) -> None:
        with trio.open_signal_receiver(signal.SIGTERM) as received:
            task_status.started()
            async for signum in received:
                signals.append(signum)
                block.cancel()  # leave the block: the finally below stops everything cleanly
                return

    # The mesh (sockets to other systems) outlives the actors: their on_stop may still talk.
    async with mesh.run(), trio.open_nursery() as nursery:
        system._mesh = mesh
        if handle_signals and threading.current_thread() is threading.main_thread():
            await nursery.start(watch_signals, name="actor-system:signals")
        error = await nursery.start(run_root, name="actor:<root>")
        if error is not None:
            raise error
        system._root = root
        try:
            with block:
                yield system
        finally:
            with trio.CancelScope(shield=True):
                await root.stop()
            tree_scope.cancel()
            system._root = None
            nursery.cancel_scope.cancel()  # the signal watcher
    if signals:
        raise SystemExit(128 + signals[0])
