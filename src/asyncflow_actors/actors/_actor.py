"""``Actor`` (what users subclass) and ``ActorContext`` (what the runtime hands to its hooks)."""

from __future__ import annotations

import types
import typing
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import trio

from ._cell import ActorCell, ChildExited, Reply
from ._errors import ActorCrashed

if TYPE_CHECKING:
    from ._ref import ActorRef
    from ._system import ActorSystem

M = TypeVar("M")
N = TypeVar("N")


class Actor(Generic[M]):
    """Base class of actors. ``M`` is the type (or union of types) of messages it accepts.

    Subclasses implement ``receive``, and optionally ``on_start`` and ``on_stop``. The runtime
    calls them one at a time: an actor handles one message after the other, never two at once.
    For a ``Request``, the value ``receive`` returns is the reply (unless the actor answered with
    ``ctx.reply``/``ctx.reply_error`` or deferred it with ``ctx.defer_reply``). An exception that
    escapes ``receive`` or ``on_start`` crashes the actor; its supervisor decides what follows.
    """

    #: Capacity of the mailbox when the actor is spawned by class without an explicit size.
    mailbox_size: ClassVar[int] = 256

    async def on_start(self, ctx: ActorContext[M]) -> None:
        """Acquire resources and spawn children; starting the actor returns once this did."""

    async def receive(self, msg: M, ctx: ActorContext[M]) -> Any:
        """Handle one message. For a ``Request``, return its reply."""
        raise NotImplementedError(f"{type(self).__name__} does not implement receive()")

    async def on_stop(self, ctx: ActorContext[M], error: BaseException | None) -> None:
        """Release resources. ``error`` is the crash reason, ``None`` for a normal stop.

        Runs only if ``on_start`` completed, after the children stopped and helper tasks were
        cancelled, within what is left of the shutdown grace; after a kill (the grace ran out)
        it still runs, shielded, within the system's ``kill_grace``.
        """

    def default_shutdown(self) -> float | None:
        """Own shutdown grace when the spec gives none (``None``: the system's default).

        Children's budgets are added to it (``docs/actors.md``, Stopping).
        """
        return None

    async def _child_exited(self, ctx: ActorContext[M], exit: ChildExited) -> None:
        await ctx._linked_child_exited(exit)


class ActorContext(Generic[M]):
    """The runtime's handle for one actor incarnation, passed to every hook."""

    def __init__(
        self, cell: ActorCell, actor: Actor[M], nursery: trio.Nursery, children: trio.Nursery
    ) -> None:
        self._cell = cell
        self.actor = actor
        self._nursery = nursery  # helper tasks
        self._children_nursery = children  # child cells: outlive a crashing helper task
        self._current: Reply | None = None
        self._deferred: Reply | None = None
        self.children: list[ActorCell] = []

    @property
    def self(self) -> ActorRef[M]:
        """This actor's own reference."""
        return self._cell.ref

    @property
    def name(self) -> str:
        return self._cell.path

    @property
    def system(self) -> ActorSystem:
        return self._cell.system

    @property
    def cell(self) -> ActorCell:
        """This actor's cell (a hook for runtime extensions, such as the remote half's node
        actors, which follow their own termination; user code needs ``self`` and ``name``)."""
        return self._cell

    # -- replies -------------------------------------------------------------------------------

    def _require_request(self, what: str) -> Reply:
        if self._current is None:
            raise RuntimeError(f"ctx.{what}() outside the handling of a Request")
        return self._current

    def reply(self, value: object) -> None:
        """Answer the request being handled now (before ``receive`` returns)."""
        self._require_request("reply").send(value)

    def reply_error(self, error: BaseException) -> None:
        """Answer the request being handled with an error; the asker's ``ask`` raises it.

        Unlike raising from ``receive``, this does not crash the actor: use it for bad input.
        """
        self._require_request("reply_error").fail(error)

    def defer_reply(self) -> Reply:
        """Take over the reply of the current request, to answer it later.

        The returned ``Reply`` must be resolved with ``send`` or ``fail``; if the actor stops or
        crashes first, the asker gets ``ActorCrashed``.
        """
        reply = self._require_request("defer_reply")
        self._deferred = reply
        return reply

    # -- tasks and children ----------------------------------------------------------------------

    def start_soon(
        self, fn: Callable[..., Awaitable[object]], *args: object, name: str | None = None
    ) -> None:
        """Run a helper task that lives and dies with this incarnation.

        An exception in it crashes the actor (as an ``ExceptionGroup``, trio's strict groups).
        """
        self._nursery.start_soon(fn, *args, name=name)

    async def start(
        self, fn: Callable[..., Awaitable[object]], *args: object, name: str | None = None
    ) -> Any:
        """Like ``start_soon`` but waits for ``task_status.started(value)`` and returns value."""
        return await self._nursery.start(fn, *args, name=name)

    def fail(self, error: BaseException) -> None:
        """Crash this actor with ``error`` (as-is, no exception group) at its next message boundary.

        For helper tasks that detect a fatal condition: raising in the helper would crash the
        actor too, but wrapped in an ``ExceptionGroup``.
        """
        self._cell.fail(error)

    def stop_self(self) -> None:
        """Stop after the current message (a normal exit: a PERMANENT child is restarted)."""
        self._cell.self_exit = True

    async def spawn(
        self,
        factory: Callable[[], Actor[N]],
        *,
        name: str,
        mailbox_size: int | None = None,
        shutdown: float | None = None,
    ) -> ActorRef[N]:
        """Start a child actor linked to this one; returns once its ``on_start`` finished.

        The child stops (in reverse order of spawning) when this actor stops or restarts. If it
        crashes and this actor does not ``watch`` it, this actor crashes too (a link); if it
        watches it, a ``Terminated`` message arrives instead. Raises ``ActorCrashed`` if the child
        fails to start and ``NameTakenError`` if ``name`` is in use.
        """
        cell = self._cell.system._new_cell(
            name,
            parent=self._cell,
            mailbox_size=mailbox_size
            if mailbox_size is not None
            else default_mailbox_size(factory),
            shutdown=shutdown,
        )
        self.children.append(cell)
        error = await self._start_cell(cell, factory)
        if error is not None:
            self.children.remove(cell)
            cell.terminate(error)
            raise ActorCrashed(cell.path, error, detail="failed to start")
        return cell.ref

    async def _start_cell(
        self, cell: ActorCell, factory: Callable[[], Actor[Any]]
    ) -> BaseException | None:
        parent = self._cell

        async def run_child(task_status: trio.TaskStatus[BaseException | None]) -> None:
            exit = await cell.run(factory, context=new_context, task_status=task_status)
            if not exit.start_failed:
                parent.deliver_system(ChildExited(cell, cell.incarnation, exit.error, exit.stopped))

        result: BaseException | None = await self._children_nursery.start(
            run_child, name=f"actor:{cell.path}"
        )
        return result

    async def _linked_child_exited(self, exit: ChildExited) -> None:
        cell = exit.cell
        if cell not in self.children or exit.incarnation != cell.incarnation:
            return
        self.children.remove(cell)
        watched = self._cell in cell.watchers
        cell.terminate(exit.error)
        if exit.error is not None and not exit.stopped and not watched:
            raise ActorCrashed(cell.path, exit.error, detail="linked child crashed")

    async def stop_children(self) -> None:
        """Stop every child in reverse start order, each within its shutdown grace."""
        while self.children:
            cell = self.children.pop()
            cell.request_stop(None)
            await cell.exited.wait()
            cell.terminate(cell.last_error)

    # -- watching ---------------------------------------------------------------------------------

    def watch(self, ref: ActorRef[Any]) -> None:
        """Get ``Terminated(ref, error)`` when ``ref`` terminates for good (at once if it has)."""
        ref._watch(self._cell)

    def unwatch(self, ref: ActorRef[Any]) -> None:
        ref._unwatch(self._cell)


def default_mailbox_size(factory: Callable[[], Actor[Any]]) -> int:
    """The mailbox size of an actor started from ``factory`` without an explicit one: the
    class's ``mailbox_size`` when ``factory`` is an actor class, else ``Actor.mailbox_size``."""
    size = getattr(factory, "mailbox_size", None) if isinstance(factory, type) else None
    return size if isinstance(size, int) else Actor.mailbox_size


def new_context(
    cell: ActorCell, actor: Actor[Any], helpers: trio.Nursery, children: trio.Nursery
) -> ActorContext[Any]:
    """The context of a new incarnation of ``cell`` running ``actor`` (``ActorCell.run`` makes it
    with this); it also records the message types the actor accepts, which its refs check."""
    cell.accepts = accepted_message_types(type(actor))
    return ActorContext(cell, actor, helpers, children)


def accepted_message_types(actor_cls: type) -> tuple[type, ...] | None:
    """The message classes an actor class declares through ``Actor[M]``; ``None``: anything."""
    for klass in actor_cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            if typing.get_origin(base) is Actor:
                (arg,) = typing.get_args(base)
                return _flatten(arg)
    return None


def _flatten(arg: object) -> tuple[type, ...] | None:
    if arg is Any or arg is object or isinstance(arg, TypeVar):
        return None
    origin = typing.get_origin(arg)
    if origin is typing.Union or origin is types.UnionType:
        out: list[type] = []
        for member in typing.get_args(arg):
            flat = _flatten(member)
            if flat is None:
                return None
            out.extend(flat)
        return tuple(out)
    if isinstance(arg, type):
        return (arg,)
    if isinstance(origin, type):
        return (origin,)
    return None
