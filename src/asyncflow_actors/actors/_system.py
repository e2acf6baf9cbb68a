"""``open_actor_system``: the root nursery, the root supervisor and the name registry."""

from __future__ import annotations

import math
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
    from .remote._node import Launcher, Node, NodeOptions
    from .remote._zmq import CurveClient

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
        from .remote._node import InProcessLauncher, SubprocessLauncher, node_spec

        launcher: Launcher
        if transport == "inproc":
            launcher = InProcessLauncher(tuple(allow))
        else:
            launcher = SubprocessLauncher(tuple(allow), transport=transport, host=host, env=env)
        return await self._start_node(node_spec(name, launcher, restart=restart, options=options))

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
        from .remote._node import ConnectLauncher, node_spec

        spec = node_spec(name, ConnectLauncher(address, curve), restart=restart, options=options)
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
    *, strategy: Strategy | None = None, shutdown_grace: float = 5.0, kill_grace: float = 1.0
) -> AsyncIterator[ActorSystem]:
    """Run an actor system for the duration of the ``async with`` block.

    ``strategy`` is the root supervisor's (default ``OneForOne()``); ``shutdown_grace`` the
    default grace of a stopping actor. Leaving the block — normally, by an exception, or by a
    cancellation from outside — stops every actor in reverse start order, each within its
    grace, then cancels what is left. If the root supervisor fails (its
    restart intensity exceeded), the block is cancelled and ``SupervisorFailed`` surfaces from
    the ``async with`` inside an ``ExceptionGroup`` (trio's strict exception groups).
    """
    for what, value in (("shutdown_grace", shutdown_grace), ("kill_grace", kill_grace)):
        if not (isinstance(value, (int, float)) and 0 <= value < math.inf):
            raise ValueError(f"{what} must be a finite number of seconds >= 0, got {value!r}")
    system = ActorSystem(shutdown_grace=shutdown_grace, kill_grace=kill_grace)
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

    async with trio.open_nursery() as nursery:
        error = await nursery.start(run_root, name="actor:<root>")
        if error is not None:
            raise error
        system._root = root
        try:
            yield system
        finally:
            with trio.CancelScope(shield=True):
                await root.stop()
            tree_scope.cancel()
            system._root = None
