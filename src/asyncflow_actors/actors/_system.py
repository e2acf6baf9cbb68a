"""``ActorSystem``: the root nursery, the root supervisor and the name registry.

``open_local_actor_system`` runs one local to its process; a system given a ``Transport``
reaches other systems (the remote half's ``open_actor_system`` makes such a system).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import attrs
import trio

from ._actor import Actor, default_mailbox_size, new_context
from ._cell import ActorCell, ActorStatistics
from ._errors import NameTakenError
from ._ref import ActorRef, LocalActorRef
from ._supervisor import ChildSpec, OneForOne, Restart, StartChild, StopChild, Strategy, Supervisor
from ._transport import Transport

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
    """A tree of actors under one root supervisor; run it with ``open_local_actor_system``, or
    with ``asyncflow_actors.open_actor_system`` for one that reaches other processes.

    Actor paths are ``/``-joined names (``"tq/storage-0"``); a path is unique among live actors.
    ``transport`` links the system to the other systems of a run (``Transport``; the remote
    half's ``Mesh``); without one the system is local to its process.
    """

    def __init__(
        self,
        *,
        shutdown_grace: float = 5.0,
        kill_grace: float = 1.0,
        name: str | None = None,
        transport: Transport | None = None,
    ) -> None:
        for what, value in (("shutdown_grace", shutdown_grace), ("kill_grace", kill_grace)):
            if not (isinstance(value, (int, float)) and 0 <= value < math.inf):
                raise ValueError(f"{what} must be a finite number of seconds >= 0, got {value!r}")
        self.shutdown_grace = shutdown_grace
        self.kill_grace = kill_grace
        self._name = name if name is not None else default_system_name()
        self._transport = transport
        self._cells: dict[str, ActorCell] = {}
        self._root: ActorCell | None = None

    @property
    def transport(self) -> Transport | None:
        """How this system reaches the other systems of the run (``None``: it does not)."""
        return self._transport

    @property
    def name(self) -> str:
        """This system's name in the run (how addresses of its actors name it)."""
        return self._transport.name if self._transport is not None else self._name

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
        size = mailbox_size if mailbox_size is not None else default_mailbox_size(factory)
        spec = ChildSpec(factory, name, restart=restart, shutdown=shutdown, mailbox_size=size)
        ref: ActorRef[N] = await self.start_child(spec)
        return ref

    async def start_child(self, spec: ChildSpec) -> ActorRef[Any]:
        """Start ``spec`` under the root supervisor (see ``spawn``)."""
        return await self.root.ask(StartChild(spec))

    async def stop_child(self, name: str) -> None:
        """Stop a top-level actor for good."""
        await self.root.ask(StopChild(name))

    def whereis(self, path: str) -> ActorRef[Any] | None:
        """The live actor at ``path``, or ``None``."""
        cell = self._cells.get(path)
        return cell.ref if cell is not None else None

    def lookup(self, path: str) -> ActorCell | None:
        """The cell of the live actor at ``path`` (``""``: the root), or ``None``.

        A hook for transports, which serve this system's actors to other systems; user code
        uses ``whereis``.
        """
        return self._cells.get(path)

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
        cell = ActorCell(
            self,
            path,
            mailbox_size=mailbox_size,
            parent=parent,
            shutdown=shutdown,
            ref=LocalActorRef,
        )
        self._cells[path] = cell
        return cell

    def unregister(self, cell: ActorCell) -> None:
        if self._cells.get(cell.path) is cell:
            del self._cells[cell.path]

    @asynccontextmanager
    async def run(
        self, *, strategy: Strategy | None = None, handle_signals: bool = True
    ) -> AsyncIterator[None]:
        """Run the system (its transport, then its root supervisor) for the ``async with`` block.

        See ``open_local_actor_system``, which makes a system and runs it, for what leaving the
        block does. A system runs once.
        """
        transport = self._transport
        root = ActorCell(
            self, "", mailbox_size=math.inf, parent=None, shutdown=None, ref=LocalActorRef
        )
        chosen = strategy if strategy is not None else OneForOne()

        # The actors run shielded from cancellation of the caller: cancelling the ``async with``
        # block from outside must still stop them gracefully (their ``on_stop`` may have
        # processes to reap), within their shutdown graces. Only the block's own body sees the
        # cancellation.
        tree_scope = trio.CancelScope(shield=True)

        async def run_root(task_status: trio.TaskStatus[BaseException | None]) -> None:
            with tree_scope:
                exit = await root.run(
                    lambda: Supervisor((), chosen), context=new_context, task_status=task_status
                )
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

        # The transport (sockets to other systems) outlives the actors: their on_stop may still
        # talk.
        async with contextlib.AsyncExitStack() as stack:
            if transport is not None:
                await stack.enter_async_context(transport.run())
            async with trio.open_nursery() as nursery:
                if handle_signals and threading.current_thread() is threading.main_thread():
                    await nursery.start(watch_signals, name="actor-system:signals")
                error = await nursery.start(run_root, name="actor:<root>")
                if error is not None:
                    raise error
                self._root = root
                try:
                    with block:
                        yield
                finally:
                    with trio.CancelScope(shield=True):
                        await root.stop()
                    tree_scope.cancel()
                    self._root = None
                    nursery.cancel_scope.cancel()  # the signal watcher
        if signals:
            raise SystemExit(128 + signals[0])


def default_system_name() -> str:
    """A system's name when none is given: ``host:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"


@asynccontextmanager
async def open_local_actor_system(
    *,
    strategy: Strategy | None = None,
    shutdown_grace: float = 5.0,
    kill_grace: float = 1.0,
    name: str | None = None,
    handle_signals: bool = True,
) -> AsyncIterator[ActorSystem]:
    """Run an actor system local to this process for the duration of the ``async with`` block.

    ``asyncflow_actors.open_actor_system`` is the same with the remote half's transport: a
    system that can start nodes and whose refs can travel to other processes.

    ``strategy`` is the root supervisor's (default ``OneForOne()``); ``shutdown_grace`` the
    default grace of a stopping actor and ``kill_grace`` the time ``on_stop`` still gets after
    a grace ran out. Leaving the block — normally, by an exception, or by a cancellation from
    outside — stops every actor in reverse start order, each within its budget, so it is
    bounded by the sum of the graces whatever an actor is stuck in. If the root supervisor
    fails (its restart intensity exceeded), the block is cancelled and ``SupervisorFailed``
    surfaces from the ``async with`` inside an ``ExceptionGroup`` (trio's strict groups).
    ``name`` names the system (default ``host:pid``).

    With ``handle_signals`` (the default; only in the main thread), SIGTERM stops the system as
    leaving the block does and then raises ``SystemExit(143)``; SIGINT raises
    ``KeyboardInterrupt`` in the block as usual, which leaves it the same clean way.
    """
    system = ActorSystem(shutdown_grace=shutdown_grace, kill_grace=kill_grace, name=name)
    async with system.run(strategy=strategy, handle_signals=handle_signals):
        yield system
