"""The actor cell: one named actor's mailbox, state and incarnation loop.

A cell outlives the actor instances it runs: a supervisor restarts a crashed actor in the same cell,
so references to it stay valid across restarts. The cell owns:

- the user mailbox, a bounded trio memory channel (its capacity *is* the backpressure);
- a system queue (stop requests, child exits, ``Terminated`` notices) that bypasses the bounded
  mailbox, so a full mailbox can never block a shutdown;
- the set of outstanding replies, so that no asker ever hangs: when an incarnation ends, every
  pending and queued ask fails with ``ActorCrashed``.
"""

from __future__ import annotations

import enum
import logging
import math
import secrets
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import outcome
import trio

from ._errors import ActorCrashed, ActorKilled
from ._message import Terminated

if TYPE_CHECKING:
    from ._actor import Actor, ActorContext
    from ._ref import LocalActorRef
    from ._system import ActorSystem

    # Makes the context of a new incarnation: (cell, actor, helper nursery, children nursery).
    ContextFactory = Callable[
        ["ActorCell", Actor[Any], trio.Nursery, trio.Nursery], ActorContext[Any]
    ]

log = logging.getLogger("asyncflow_actors.actors")

_WAKE = object()  # handed to a parked loop to make it look at its system queue and flags


class ActorState(enum.Enum):
    """Where a cell is in its life. ``RESTARTING`` is the gap between two incarnations."""

    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    RESTARTING = "restarting"
    TERMINATED = "terminated"


@attrs.frozen
class ActorStatistics:
    """A snapshot of one actor's counters (``ref.statistics()``)."""

    name: str
    state: ActorState
    mailbox_depth: int
    mailbox_capacity: int | float
    senders_waiting: int
    processed: int
    restarts: int
    dead_letters: int
    replies_outstanding: int


class Reply:
    """A one-shot reply slot: the asker waits on it, the actor fulfils it exactly once.

    Actors get one from ``ctx.defer_reply()`` to answer a request later (from another message or
    a helper task). ``send``/``fail`` return ``False`` if the slot was already resolved.
    """

    __slots__ = ("_callback", "_cell", "_event", "_outcome")

    def __init__(
        self,
        cell: ActorCell | None = None,
        callback: Callable[[outcome.Outcome[Any]], None] | None = None,
    ) -> None:
        self._event: trio.Event | None = None  # made by the first waiter: most replies have none
        self._outcome: outcome.Outcome[Any] | None = None
        self._cell = cell
        self._callback = callback  # run synchronously on resolution (must not raise)

    @property
    def done(self) -> bool:
        return self._outcome is not None

    def send(self, value: object) -> bool:
        """Answer the request with ``value``."""
        return self._resolve(outcome.Value(value))

    def fail(self, error: BaseException) -> bool:
        """Answer the request with an error: the asker's ``ask`` raises ``error``."""
        return self._resolve(outcome.Error(error))

    def _resolve(self, result: outcome.Outcome[Any]) -> bool:
        if self._outcome is not None:
            return False
        self._outcome = result
        if self._event is not None:
            self._event.set()
        if self._cell is not None:
            self._cell.outstanding.discard(self)
        if self._callback is not None:
            self._callback(result)
        return True

    async def wait(self) -> Any:
        if self._outcome is None:
            if self._event is None:
                self._event = trio.Event()
            await self._event.wait()
        else:
            await trio.lowlevel.checkpoint()
        return self.unwrap()

    def unwrap(self) -> Any:
        """The answer of a resolved slot (raises its error), for a waiter that saw it ``done``."""
        assert self._outcome is not None
        return self._outcome.unwrap()


@attrs.frozen
class Ask:
    """A request travelling through a mailbox together with its reply slot."""

    msg: object
    reply: Reply


@attrs.frozen
class Tracked:
    """A tell whose sender waits (``send_tracked``) until the actor has handled it."""

    msg: object
    done: trio.Event


@attrs.frozen
class ChildExited:
    """System notice to a parent: one incarnation of a child cell ended."""

    cell: ActorCell
    incarnation: int
    error: BaseException | None
    stopped: bool  # ended because someone asked it to stop (not a crash, not a self-exit)


@attrs.frozen
class IncarnationExit:
    """How one incarnation ended (returned by ``ActorCell.run``)."""

    error: BaseException | None
    stopped: bool
    killed: bool
    start_failed: bool


class ActorCell:
    """Runtime record of one named actor; see the module docstring."""

    def __init__(
        self,
        system: ActorSystem,
        path: str,
        *,
        mailbox_size: int | float,
        parent: ActorCell | None,
        shutdown: float | None,
        ref: Callable[[ActorCell], LocalActorRef[Any]],
    ) -> None:
        self.system = system
        self.path = path
        self.parent = parent
        self.shutdown = shutdown
        self.mailbox_capacity = mailbox_size
        self.mailbox_send, self.mailbox_recv = trio.open_memory_channel[object](mailbox_size)
        self.system_queue: deque[object] = deque()
        self.state = ActorState.STARTING
        self.accepts: tuple[type, ...] | None = None
        self.processed = 0
        self.restarts = 0
        self.dead_letters = 0
        self.incarnation = 0
        self.outstanding: set[Reply] = set()
        self.watchers: set[ActorCell] = set()
        self.on_terminate: list[Callable[[], None]] = []  # run once, when it terminates for good
        self.last_error: BaseException | None = None
        self.stop_requested = False  # the current incarnation was asked to stop
        self.self_exit = False  # it called ctx.stop_self()
        self.terminate_requested = False  # stop for good: no restart (ref.stop())
        self.terminate_event = trio.Event()
        self.stopping = trio.Event()  # set by request_stop for the current incarnation
        self.exited = trio.Event()
        self.exited.set()  # no incarnation yet
        self.terminated = trio.Event()
        self.loop_task: trio.lowlevel.Task | None = None
        self.ref = ref(self)  # the local ref type is given: refs sit above cells
        self.token = secrets.token_hex(8)  # the stop capability its refs carry to other nodes
        self._parked = False
        self.actor: Actor[Any] | None = None  # the current (or last) incarnation's instance
        self.ctx: ActorContext[Any] | None = None  # the current incarnation's context
        self._kill_scope: trio.CancelScope | None = None
        self._start_scope: trio.CancelScope | None = None
        self._kill_deadline = math.inf
        self._grace = math.inf
        self._failure: BaseException | None = None

    @property
    def name(self) -> str:
        return self.path

    def __repr__(self) -> str:
        return f"<ActorCell {self.path!r} {self.state.value}>"

    # -- delivery -----------------------------------------------------------------------------

    def deliver_system(self, msg: object) -> None:
        """Queue a system message; it is handled before any user message, whatever the mailbox."""
        if self.state is ActorState.TERMINATED:
            return
        self.system_queue.append(msg)
        self._wake()

    def request_stop(self, grace: float | None) -> None:
        """Ask the running incarnation to stop after its current message, within ``grace`` s.

        ``None``: the cell's budget (``default_grace``). Past the grace the incarnation is killed
        (``run``). A stop requested during ``on_start`` cancels it at once. Idempotent; a later
        call can only shorten the deadline.
        """
        if grace is None:
            grace = self.default_grace()
        self.stop_requested = True
        self.stopping.set()
        deadline = trio.current_time() + grace
        if deadline < self._kill_deadline:
            self._kill_deadline = deadline
            self._grace = grace
        if self._kill_scope is not None:
            self._kill_scope.deadline = self._kill_deadline
        if self._start_scope is not None:
            self._start_scope.cancel()  # a start that will be stopped anyway: stop it now
        self._wake()

    def fail(self, error: BaseException) -> None:
        """Crash the running incarnation with ``error`` at its next message boundary."""
        if self._failure is None:
            self._failure = error
        self._wake()

    def default_grace(self) -> float:
        """The stop budget: the actor's own grace, plus each child's budget and kill grace.

        The own grace is the spec's ``shutdown``, else the actor's ``default_shutdown()``, else
        the system's ``shutdown_grace``. Children stop one after the other within their own
        budgets, so a parent's budget covers them: stopping a tree is bounded by the sum.
        """
        own = self.shutdown
        if own is None and self.actor is not None:
            own = self.actor.default_shutdown()
        if own is None:
            own = self.system.shutdown_grace
        ctx = self.ctx
        if ctx is not None:
            kill = self.system.kill_grace
            own += sum(child.default_grace() + kill for child in ctx.children)
        return own

    def _wake(self) -> None:
        # The loop parks in the mailbox's receive; a parked receiver means an empty buffer, so
        # handing it a sentinel cannot block and cannot be refused.
        if self._parked:
            self._parked = False
            try:
                self.mailbox_send.send_nowait(_WAKE)
            except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                pass

    # -- the incarnation --------------------------------------------------------------------------

    async def run(
        self,
        factory: Callable[[], Actor[Any]],
        *,
        context: ContextFactory,
        task_status: trio.TaskStatus[BaseException | None] = trio.TASK_STATUS_IGNORED,
    ) -> IncarnationExit:
        """Run one incarnation: create the actor, ``on_start``, the message loop, ``on_stop``.

        Reports ``task_status.started(None)`` once ``on_start`` returned, or
        ``started(error)`` if creating or starting the actor failed (then returns at once).
        Never raises an actor's exception; an outer cancellation propagates after cleanup.

        Stopping is bounded: past the grace set by ``request_stop`` the incarnation is *killed*
        (its work and its remaining children are cancelled) and ``on_stop`` still runs, within
        the system's ``kill_grace``; the exit's error is then ``ActorKilled``. An outer
        cancellation is a kill too. A stop requested while ``on_start`` runs cancels it.
        ``context`` makes the incarnation's ``ActorContext`` (``_actor.new_context``).
        """
        if self.terminate_requested or self.state is ActorState.TERMINATED:
            task_status.started(_start_interrupted(self))
            return IncarnationExit(error=None, stopped=True, killed=False, start_failed=True)
        self.incarnation += 1
        self.state = ActorState.STARTING
        self.exited = trio.Event()
        self.system_queue.clear()
        self._failure = None
        self.self_exit = False
        kill_scope = trio.CancelScope(deadline=self._kill_deadline)
        self._kill_scope = kill_scope
        try:
            return await self._incarnation(factory, context, task_status, kill_scope)
        except BaseException as exc:
            # Something escaped the incarnation (a child's task raising, a BaseException out
            # of on_stop): it propagates, but whoever waits for this exit (a stop, shielded)
            # must not wait for good.
            if not self.exited.is_set():
                self._end_incarnation(exc)
            raise

    async def _incarnation(
        self,
        factory: Callable[[], Actor[Any]],
        context: ContextFactory,
        task_status: trio.TaskStatus[BaseException | None],
        kill_scope: trio.CancelScope,
    ) -> IncarnationExit:
        error: BaseException | None = None
        started = False
        reported = False
        killed = False
        ctx: ActorContext[Any] | None = None
        try:
            # Children live in their own nursery: a crashing helper task cancels the helpers
            # and the loop, never the children, which are then stopped gracefully.
            async with trio.open_nursery() as children:
                try:
                    try:
                        with kill_scope:
                            try:
                                actor = factory()
                                self.actor = actor
                                async with trio.open_nursery() as helpers:
                                    ctx = context(self, actor, helpers, children)
                                    self.ctx = ctx
                                    try:
                                        started = await self._start(actor, ctx)
                                        if started:
                                            self.state = ActorState.RUNNING
                                            self.loop_task = trio.lowlevel.current_task()
                                            task_status.started(None)
                                            reported = True
                                            await self._loop(actor, ctx)
                                    except Exception as exc:
                                        error = exc
                                    finally:
                                        self.loop_task = None
                                    helpers.cancel_scope.cancel()
                            except Exception as exc:  # the factory, or a helper task (a group)
                                if error is None:
                                    error = exc
                            self.state = ActorState.STOPPING
                            if ctx is not None:
                                await ctx.stop_children()
                    except Exception as exc:
                        # A group of the helpers' that held the kill's Cancelled too: the kill
                        # scope took its Cancelled and left the rest, the incarnation's error
                        # (what the children still run lost its grace: killed below).
                        if error is None:
                            error = exc
                        self.state = ActorState.STOPPING
                finally:
                    killed = kill_scope.cancelled_caught
                    children.cancel_scope.cancel()  # what is left lost its grace: kill it
        finally:
            self._kill_scope = None
            self.ctx = None
            outer = trio.current_effective_deadline() == -math.inf
            if outer or killed:
                killed = True
                if error is None and self.stop_requested:
                    error = ActorKilled(self.path, self._grace)
            if started and ctx is not None:
                error = await self._on_stop(ctx, error, killed=killed)
            if outer:
                # Cancelled from outside (the parent's nursery is going away): nobody will
                # restart this cell, so it terminates here; pending asks must not hang.
                self._end_incarnation(error)
                self.terminate(error)
        self._end_incarnation(error)
        if error is not None and not (self.stop_requested and killed):
            log.warning("actor %s crashed: %r", self.path, error, exc_info=error)
        elif killed:
            log.warning("actor %s was killed: %s", self.path, error)
        if not reported:
            task_status.started(error if error is not None else _start_interrupted(self))
        return IncarnationExit(
            error=error,
            stopped=self.stop_requested,
            killed=killed,
            start_failed=not started,
        )

    async def _start(self, actor: Actor[Any], ctx: ActorContext[Any]) -> bool:
        """Run ``on_start``; ``False`` if a stop requested meanwhile cancelled it."""
        with trio.CancelScope() as scope:
            self._start_scope = scope
            if self.stop_requested:
                scope.cancel()
            try:
                await actor.on_start(ctx)
            finally:
                self._start_scope = None
            return True
        return False

    async def _on_stop(
        self, ctx: ActorContext[Any], error: BaseException | None, *, killed: bool
    ) -> BaseException | None:
        """Run ``on_stop`` within what is left of the grace, or ``kill_grace`` after a kill."""
        if killed:
            scope = trio.CancelScope(deadline=trio.current_time() + self.system.kill_grace)
            scope.shield = True
        else:
            scope = trio.CancelScope(deadline=self._kill_deadline)
            self._kill_scope = scope  # a stop requested now still bounds on_stop
        try:
            with scope:
                try:
                    await ctx.actor.on_stop(ctx, error)
                except Exception as exc:
                    if error is None:
                        return exc
                    log.warning("%s: on_stop raised after a crash", self.path, exc_info=exc)
        finally:
            self._kill_scope = None
        if scope.cancelled_caught and not killed and error is None and self.stop_requested:
            return ActorKilled(self.path, self._grace)  # on_stop itself outlived the grace
        return error

    async def _loop(self, actor: Actor[Any], ctx: ActorContext[Any]) -> None:
        recv = self.mailbox_recv
        receive = actor.receive
        checkpoint = trio.lowlevel.checkpoint
        while True:
            if (
                self.system_queue
                or self._failure is not None
                or self.stop_requested
                or self.self_exit
            ):
                while self.system_queue:
                    await self._dispatch_system(actor, ctx, self.system_queue.popleft())
                if self._failure is not None:
                    raise self._failure
                if self.stop_requested or self.self_exit:
                    return
            try:
                item = recv.receive_nowait()
            except trio.WouldBlock:
                self._parked = True
                try:
                    item = await recv.receive()
                finally:
                    self._parked = False
            else:
                # receive_nowait does not yield: keep the loop a checkpoint per message.
                await checkpoint()
            if item is _WAKE:
                continue
            if type(item) is Ask:
                await self._dispatch_ask(actor, ctx, item)
            elif type(item) is Tracked:
                try:
                    await receive(item.msg, ctx)
                finally:
                    item.done.set()
            else:
                await receive(item, ctx)
            self.processed += 1

    async def _dispatch_ask(self, actor: Actor[Any], ctx: ActorContext[Any], item: Ask) -> None:
        reply = item.reply
        reply._cell = self
        self.outstanding.add(reply)
        ctx._current = reply
        try:
            result = await actor.receive(item.msg, ctx)
        finally:
            ctx._current = None
        if reply is not ctx._deferred:
            reply.send(result)
        ctx._deferred = None

    async def _dispatch_system(
        self, actor: Actor[Any], ctx: ActorContext[Any], item: object
    ) -> None:
        if isinstance(item, ChildExited):
            await actor._child_exited(ctx, item)
        else:
            await actor.receive(item, ctx)
        self.processed += 1

    def _end_incarnation(self, error: BaseException | None) -> None:
        """Fail every outstanding and queued ask; count queued tells as dead letters."""
        self.last_error = error
        if self.state is not ActorState.TERMINATED:
            self.state = ActorState.RESTARTING
        for reply in list(self.outstanding):
            reply.fail(ActorCrashed(self.path, error))
        self.outstanding.clear()
        self._flush_mailbox(error)
        self.exited.set()

    def _flush_mailbox(self, error: BaseException | None) -> None:
        while True:
            try:
                item = self.mailbox_recv.receive_nowait()
            except (trio.WouldBlock, trio.ClosedResourceError):
                return
            if isinstance(item, Ask):
                item.reply.fail(ActorCrashed(self.path, error, detail="request was queued"))
            elif item is not _WAKE:
                if isinstance(item, Tracked):
                    item.done.set()  # dropped: nothing will read its buffers
                self.dead_letters += 1

    def prepare_restart(self) -> None:
        """Reset the stop state for a new incarnation (a supervisor restarts the cell)."""
        self.stop_requested = False
        self.stopping = trio.Event()
        self._kill_deadline = math.inf
        self._grace = math.inf
        self.restarts += 1

    def terminate(self, error: BaseException | None) -> None:
        """End the cell for good: close the mailbox, notify watchers, free the name."""
        if self.state is ActorState.TERMINATED:
            return
        self.state = ActorState.TERMINATED
        self.last_error = error
        self._flush_mailbox(error)
        self.mailbox_recv.close()
        self.terminate_event.set()
        for watcher in self.watchers:
            watcher.deliver_system(Terminated(self.ref, error))
        self.watchers.clear()
        self.system.unregister(self)
        self.terminated.set()
        for callback in self.on_terminate:
            callback()
        self.on_terminate.clear()

    async def stop(self, grace: float | None = None) -> None:
        """Stop the actor for good and wait until it has terminated."""
        if self.loop_task is not None and trio.lowlevel.current_task() is self.loop_task:
            raise RuntimeError(
                f"actor {self.path!r} awaited its own stop() from receive: that would deadlock; "
                "use ctx.stop_self()"
            )
        if self.state is ActorState.TERMINATED:
            await trio.lowlevel.checkpoint()
            return
        self.request_terminate(grace)
        await self.exited.wait()
        self.terminate(self.last_error)

    def request_terminate(self, grace: float | None) -> None:
        """Ask for a stop for good: no supervisor will restart this cell afterwards."""
        self.terminate_requested = True
        self.terminate_event.set()
        self.request_stop(grace)

    def statistics(self) -> ActorStatistics:
        stats = self.mailbox_send.statistics()
        return ActorStatistics(
            name=self.path,
            state=self.state,
            mailbox_depth=stats.current_buffer_used,
            mailbox_capacity=self.mailbox_capacity,
            senders_waiting=stats.tasks_waiting_send,
            processed=self.processed,
            restarts=self.restarts,
            dead_letters=self.dead_letters,
            replies_outstanding=len(self.outstanding),
        )


def _start_interrupted(cell: ActorCell) -> BaseException:
    return ActorCrashed(cell.path, None, detail="stopped before on_start finished")
