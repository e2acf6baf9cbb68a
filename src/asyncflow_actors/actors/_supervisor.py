"""OTP-style supervision: child specs, restart types, strategies, restart intensity, backoff.

A ``Supervisor`` is an actor whose children are described by ``ChildSpec``s. It starts them in
order and stops them in reverse order. When a child ends it applies the child's ``Restart`` type:

- ``PERMANENT``: always restarted (a crash or a normal self-exit);
- ``TRANSIENT``: restarted only after a crash;
- ``TEMPORARY``: never restarted.

A child stopped through ``ref.stop()`` or ``StopChild`` is never restarted. Which children restart
together is the strategy: ``OneForOne`` (only the one that ended), ``OneForAll`` (all: the others
are stopped in reverse order, then all restart in order), ``RestForOne`` (it and every child
started after it). More than ``max_restarts`` restarts within ``within`` seconds make the
supervisor stop all its children and fail with ``SupervisorFailed``; its own parent decides.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import trio

from ._actor import Actor, ActorContext
from ._cell import ActorCell, ActorState, ChildExited, Reply
from ._errors import ActorCrashed, NameTakenError, SupervisorFailed
from ._message import Request
from ._ref import ActorRef


class Restart(enum.Enum):
    """When a supervisor restarts a child that ended (see the module docstring)."""

    PERMANENT = "permanent"
    TRANSIENT = "transient"
    TEMPORARY = "temporary"


def _positive(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value > 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value!r}")


@attrs.frozen
class Backoff:
    """Delay before the n-th restart within the intensity window: ``initial * factor**(n-1)``."""

    initial: float = attrs.field(default=0.05, validator=_positive)
    factor: float = attrs.field(default=2.0, validator=_positive)
    max: float = attrs.field(default=5.0, validator=_positive)

    def delay(self, n: int) -> float:
        return float(min(self.max, self.initial * self.factor ** max(0, n - 1)))


def _non_negative_int(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"{attribute.name} must be an int >= 0, got {value!r}")


@attrs.frozen
class Strategy:
    """Restart intensity shared by all strategies: at most ``max_restarts`` in ``within`` s."""

    max_restarts: int = attrs.field(default=3, validator=_non_negative_int)
    within: float = attrs.field(default=5.0, validator=_positive)
    backoff: Backoff | None = None


@attrs.frozen
class OneForOne(Strategy):
    """Restart only the child that ended."""


@attrs.frozen
class OneForAll(Strategy):
    """Stop all other children (reverse order) and restart all of them (in order)."""


@attrs.frozen
class RestForOne(Strategy):
    """Restart the child that ended and every child started after it."""


def _check_name(_: object, __: object, value: str) -> None:
    if not isinstance(value, str) or not value or "/" in value:
        raise ValueError(f"actor names are non-empty strings without '/', got {value!r}")


@attrs.frozen
class ChildSpec:
    """How to create and supervise one child.

    ``factory`` builds a fresh actor for every (re)start. ``shutdown`` is the grace in seconds a
    stopping child gets before it is killed (``None``: the actor's ``default_shutdown()``, else
    the system default); the budgets of its own children are added to it.
    """

    factory: Callable[[], Actor[Any]]
    name: str = attrs.field(validator=_check_name)
    restart: Restart = Restart.PERMANENT
    shutdown: float | None = None
    mailbox_size: int | None = None

    @classmethod
    def supervisor(
        cls,
        name: str,
        children: Sequence[ChildSpec],
        strategy: Strategy | None = None,
        *,
        restart: Restart = Restart.PERMANENT,
    ) -> ChildSpec:
        """A spec for a nested supervisor of ``children``."""
        specs = tuple(children)
        chosen = strategy if strategy is not None else OneForOne()
        return cls(lambda: Supervisor(specs, chosen), name, restart=restart)


@attrs.frozen
class ChildInfo:
    """One row of ``WhichChildren``."""

    name: str
    ref: ActorRef[Any]
    restart: Restart
    state: ActorState
    restarts: int


@attrs.frozen
class StartChild(Request[ActorRef[Any]]):
    """Add and start a child; replies with its ref (``ActorCrashed`` if it fails to start)."""

    spec: ChildSpec


@attrs.frozen
class StartChildren(Request[tuple[ActorRef[Any], ...]]):
    """Add and start several independent children *concurrently* (e.g. node processes whose
    start is dominated by process launch); they take the given order for stopping. If one fails
    to start, the others are stopped again and the error is the reply."""

    specs: tuple[ChildSpec, ...]


@attrs.frozen
class StopChild(Request[None]):
    """Stop a child for good and forget it (``KeyError`` if there is no such child)."""

    name: str


@attrs.frozen
class WhichChildren(Request[tuple[ChildInfo, ...]]):
    """List the children in start order."""


SupervisorMessage = StartChild | StartChildren | StopChild | WhichChildren


@attrs.define(eq=False)
class _Slot:
    spec: ChildSpec
    cell: ActorCell
    # the restarter owns this child until it has restarted it: exits meanwhile are its own doing
    restarting: bool = False


@attrs.frozen
class _RestartJob:
    slots: tuple[_Slot, ...]


class Supervisor(Actor[SupervisorMessage]):
    """An actor that starts, watches and restarts children (see the module docstring).

    The supervisor's own loop never waits for a child's ``on_start``: children requested at run
    time (``StartChild``, ``StartChildren``) start in helper tasks and restarts run in one
    restarter task, one restart after the other in the order the exits arrived. So a child's
    ``on_start`` may itself ask this supervisor (or the system) to start siblings.
    """

    mailbox_size = 64

    def __init__(
        self, children: Sequence[ChildSpec] = (), strategy: Strategy | None = None
    ) -> None:
        names = [spec.name for spec in children]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise NameTakenError(
                f"child names must be unique in a supervisor, repeated: {duplicates}"
            )
        self._specs = tuple(children)
        self.strategy = strategy if strategy is not None else OneForOne()
        self._slots: list[_Slot] = []
        self._restart_times: deque[float] = deque()
        self._failures: deque[BaseException] = deque(maxlen=32)
        self._jobs_send, self._jobs_recv = trio.open_memory_channel[_RestartJob](math.inf)

    def default_shutdown(self) -> float | None:
        # Its own part of the stop budget; each child's budget is added to it (ActorCell).
        return 0.5

    async def on_start(self, ctx: ActorContext[SupervisorMessage]) -> None:
        for spec in self._specs:
            try:
                await self._add(ctx, spec)
            except ActorCrashed as exc:
                raise SupervisorFailed(
                    ctx.name or "<root>", f"child {spec.name!r} failed to start", [exc.error or exc]
                ) from exc
        ctx.start_soon(self._restarter, ctx, name=f"restarter:{ctx.name or '<root>'}")

    async def receive(self, msg: SupervisorMessage, ctx: ActorContext[SupervisorMessage]) -> Any:
        if isinstance(msg, StartChild):
            try:
                slot = self._slot(ctx, msg.spec)
            except (NameTakenError, ValueError) as exc:
                ctx.reply_error(exc)
                return None
            ctx.start_soon(self._start_new, ctx, slot, ctx.defer_reply())
            return None
        if isinstance(msg, StartChildren):
            slots: list[_Slot] = []
            try:
                for spec in msg.specs:
                    slots.append(self._slot(ctx, spec))
            except (NameTakenError, ValueError) as exc:
                for slot in slots:
                    self._forget(ctx, slot, None)
                ctx.reply_error(exc)
                return None
            ctx.start_soon(self._start_all, ctx, tuple(slots), ctx.defer_reply())
            return None
        if isinstance(msg, StopChild):
            found = next((s for s in self._slots if s.spec.name == msg.name), None)
            if found is None:
                ctx.reply_error(KeyError(f"{ctx.name!r} has no child named {msg.name!r}"))
                return None
            found.cell.request_terminate(None)
            ctx.start_soon(self._await_stop, ctx, found, ctx.defer_reply())
            return None
        return tuple(
            ChildInfo(s.spec.name, s.cell.ref, s.spec.restart, s.cell.state, s.cell.restarts)
            for s in self._slots
        )

    # -- starting ---------------------------------------------------------------------------------

    def _slot(self, ctx: ActorContext[SupervisorMessage], spec: ChildSpec) -> _Slot:
        cell = ctx.system._new_cell(
            spec.name,
            parent=ctx._cell,
            mailbox_size=spec.mailbox_size or _mailbox_of(spec),
            shutdown=spec.shutdown,
        )
        slot = _Slot(spec, cell)
        self._slots.append(slot)
        ctx.children.append(cell)
        return slot

    async def _add(self, ctx: ActorContext[SupervisorMessage], spec: ChildSpec) -> ActorRef[Any]:
        slot = self._slot(ctx, spec)
        error = await ctx._start_cell(slot.cell, spec.factory)
        if error is not None:
            self._forget(ctx, slot, error)
            raise ActorCrashed(slot.cell.path, error, detail="failed to start")
        return slot.cell.ref

    async def _start_new(
        self, ctx: ActorContext[SupervisorMessage], slot: _Slot, reply: Reply
    ) -> None:
        error = await ctx._start_cell(slot.cell, slot.spec.factory)
        if error is not None:
            self._forget(ctx, slot, error)
            reply.fail(ActorCrashed(slot.cell.path, error, detail="failed to start"))
        else:
            reply.send(slot.cell.ref)

    async def _start_all(
        self, ctx: ActorContext[SupervisorMessage], slots: tuple[_Slot, ...], reply: Reply
    ) -> None:
        errors: dict[int, BaseException] = {}

        async def start(k: int, slot: _Slot) -> None:
            error = await ctx._start_cell(slot.cell, slot.spec.factory)
            if error is not None:
                errors[k] = error

        async with trio.open_nursery() as nursery:
            for k, slot in enumerate(slots):
                nursery.start_soon(start, k, slot)
        if not errors:
            reply.send(tuple(slot.cell.ref for slot in slots))
            return
        first = min(errors)
        for k in reversed(range(len(slots))):
            slot = slots[k]
            if k not in errors and slot.cell.state is not ActorState.TERMINATED:
                slot.cell.request_terminate(None)
                await slot.cell.exited.wait()
            self._forget(ctx, slot, errors.get(k))
        path = slots[first].cell.path
        reply.fail(ActorCrashed(path, errors[first], detail="failed to start"))

    async def _await_stop(
        self, ctx: ActorContext[SupervisorMessage], slot: _Slot, reply: Reply
    ) -> None:
        await slot.cell.exited.wait()
        self._forget(ctx, slot, slot.cell.last_error)
        reply.send(None)

    def _forget(
        self, ctx: ActorContext[SupervisorMessage], slot: _Slot, error: BaseException | None
    ) -> None:
        if slot in self._slots:
            self._slots.remove(slot)
        if slot.cell in ctx.children:
            ctx.children.remove(slot.cell)
        slot.cell.terminate(error)

    # -- restarting -------------------------------------------------------------------------------

    async def _child_exited(self, ctx: ActorContext[SupervisorMessage], exit: ChildExited) -> None:
        slot = next((s for s in self._slots if s.cell is exit.cell), None)
        if slot is None or exit.incarnation != slot.cell.incarnation or slot.restarting:
            return  # an exit the restarter caused, or of a child already gone
        if slot.cell.terminate_requested:
            self._forget(ctx, slot, exit.error)
            return
        restart = slot.spec.restart
        if restart is Restart.TEMPORARY or (restart is Restart.TRANSIENT and exit.error is None):
            self._forget(ctx, slot, exit.error)
            return
        self._count_restart(ctx, exit.error)
        index = self._slots.index(slot)
        if isinstance(self.strategy, OneForAll):
            affected = list(self._slots)
        elif isinstance(self.strategy, RestForOne):
            affected = self._slots[index:]
        else:
            affected = [slot]
        affected = [s for s in affected if s is slot or not s.restarting]
        for other in affected:
            other.restarting = True
        self._jobs_send.send_nowait(_RestartJob(tuple(affected)))
        await trio.lowlevel.checkpoint()

    async def _restarter(self, ctx: ActorContext[SupervisorMessage]) -> None:
        """Carry out restart jobs one at a time: stop the others (reverse), restart (in order)."""
        async for job in self._jobs_recv:
            for other in reversed(job.slots):
                if other.cell.state not in (ActorState.RESTARTING, ActorState.TERMINATED):
                    other.cell.request_stop(None)
                    await other.cell.exited.wait()
            for other in job.slots:
                try:
                    await self._restart(ctx, other)
                finally:
                    other.restarting = False
                if ctx._cell.stop_requested:
                    return

    async def _restart(self, ctx: ActorContext[SupervisorMessage], slot: _Slot) -> None:
        cell = slot.cell
        while True:
            if self.strategy.backoff is not None:
                delay = self.strategy.backoff.delay(len(self._restart_times))
                with trio.move_on_after(delay):
                    await _wait_any(cell.terminate_event, ctx._cell.stopping)
            if cell.terminate_requested or cell.state is ActorState.TERMINATED:
                self._forget(ctx, slot, cell.last_error)
                return
            if ctx._cell.stop_requested:
                return  # we are stopping: the teardown terminates the children
            cell.prepare_restart()
            error = await ctx._start_cell(cell, slot.spec.factory)
            if error is None:
                return
            if cell.terminate_requested:
                self._forget(ctx, slot, cell.last_error)
                return
            try:
                self._count_restart(ctx, error)
            except SupervisorFailed as failed:
                ctx.fail(failed)  # crash the supervisor as-is (not as a helper's group)
                await trio.sleep_forever()

    def _count_restart(
        self, ctx: ActorContext[SupervisorMessage], error: BaseException | None
    ) -> None:
        """Record one restart; past the intensity, fail (the teardown stops all children)."""
        now = trio.current_time()
        if error is not None:
            self._failures.append(error)
        self._restart_times.append(now)
        while self._restart_times and self._restart_times[0] <= now - self.strategy.within:
            self._restart_times.popleft()
        if len(self._restart_times) > self.strategy.max_restarts:
            raise SupervisorFailed(
                ctx.name or "<root>",
                f"more than {self.strategy.max_restarts} restarts within {self.strategy.within}s",
                list(self._failures),
            )


async def _wait_any(*events: trio.Event) -> None:
    """Return as soon as one of ``events`` is set."""
    async with trio.open_nursery() as nursery:

        async def wait(event: trio.Event) -> None:
            await event.wait()
            nursery.cancel_scope.cancel()

        for event in events:
            nursery.start_soon(wait, event)


def _mailbox_of(spec: ChildSpec) -> int:
    size = getattr(spec.factory, "mailbox_size", None) if isinstance(spec.factory, type) else None
    return size if isinstance(size, int) else Actor.mailbox_size
