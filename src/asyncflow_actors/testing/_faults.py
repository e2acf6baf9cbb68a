"""Faults injected into actors: one API for local actors and actors on nodes.

``faulty(Worker)`` makes a subclass of your actor class that takes one more keyword argument,
``faults=FaultPlan(...)``, and misbehaves as planned; otherwise it is your class (same messages,
same replies, same supervision). The plan is a frozen value that crosses the wire, so the same
line works locally and remotely::

    FaultyWorker = faulty(Worker)            # at module level, so that nodes can import it
    plan = FaultPlan((CrashAt(message=3),))
    await system.spawn(lambda: FaultyWorker(faults=plan), name="w")          # local
    await node.spawn(FaultyWorker, name="w", kwargs={"faults": plan})        # on a node

Messages and starts are counted per actor path over its whole life in one process: a restarted
incarnation continues the count, so ``CrashAt(message=3)`` fires once, not every third message.
(A node process that restarts starts counting afresh.)
"""

from __future__ import annotations

import os
import signal
import sys
import time
import typing
import uuid
from typing import Any, Literal, TypeVar

import attrs
import trio

from ..actors import Actor, ActorContext

A = TypeVar("A", bound=Actor[Any])


class InjectedCrash(Exception):
    """The exception a planned crash raises (``ActorCrashed.error`` of the asker's failure)."""


class FaultPlanError(Exception):
    """A plan that cannot be carried out (a ``kill -9`` of the process that made the plan)."""


@attrs.frozen
class CrashAt:
    """Crash at the actor's ``message``-th message (1-based).

    ``when="before"``: the message is lost (``receive`` never sees it); ``"after"``: it is
    handled, its side effects happen, then the actor crashes before replying (a lost ack).
    """

    message: int = attrs.field(validator=attrs.validators.ge(1))
    when: Literal["before", "after"] = "before"


@attrs.frozen
class CrashOnStart:
    """Raise in ``on_start`` of the ``start``-th start (1: the spawn fails; 2: the first restart)."""

    start: int = attrs.field(default=1, validator=attrs.validators.ge(1))


@attrs.frozen
class StallAt:
    """Stall for ``seconds`` on receiving the ``message``-th message, before handling it.

    ``blocking=True`` calls ``time.sleep``: the whole event loop of the hosting process stops (no
    other actor runs, heartbeats go unanswered), in real time. ``blocking=False`` awaits
    ``trio.sleep``: only this actor is busy (its mailbox fills up), in the loop's time (virtual
    under a ``MockClock``).
    """

    message: int = attrs.field(validator=attrs.validators.ge(1))
    seconds: float = attrs.field(validator=attrs.validators.ge(0))
    blocking: bool = True


@attrs.frozen
class KillProcessAt:
    """``kill -9`` the hosting process on the ``message``-th message, before handling it.

    For actors on nodes: the node dies at that exact moment. Refused (``FaultPlanError``, which
    crashes the actor instead) in the process that built the plan, so a plan never kills a test
    runner.
    """

    message: int = attrs.field(validator=attrs.validators.ge(1))


Fault = CrashAt | CrashOnStart | StallAt | KillProcessAt


def _faults(value: Any) -> tuple[Fault, ...]:
    faults = tuple(value)
    for fault in faults:
        if not isinstance(fault, (CrashAt, CrashOnStart, StallAt, KillProcessAt)):
            raise TypeError(f"not a fault: {fault!r}")
    return faults


@attrs.frozen
class FaultPlan:
    """What a ``faulty`` actor does wrong, and when.

    ``key`` separates the counters of different plans (a fresh one per plan by default), so two
    examples of a hypothesis run never share a count. ``origin_pid`` is the process that built the
    plan (``KillProcessAt`` never fires there).
    """

    faults: tuple[Fault, ...] = attrs.field(default=(), converter=_faults)
    key: str = attrs.field(factory=lambda: uuid.uuid4().hex)
    origin_pid: int = attrs.field(factory=os.getpid)


@attrs.define
class FaultCounters:
    """How many messages and starts an actor (one path, one plan) had in this process."""

    messages: int = 0
    starts: int = 0
    fired: list[Fault] = attrs.Factory(list)


_counters: dict[tuple[str, str], FaultCounters] = {}


def fault_counters(plan: FaultPlan, path: str) -> FaultCounters:
    """The counters of actor ``path`` under ``plan`` in this process (what fired so far)."""
    return _counters.setdefault((plan.key, path), FaultCounters())


def forget_fault_counters() -> None:
    """Drop every counter of this process (between independent runs)."""
    _counters.clear()


class _Faulty:
    """The behaviour ``faulty`` mixes in front of an actor class."""

    _fault_plan: FaultPlan

    async def on_start(self, ctx: ActorContext[Any]) -> None:
        counters = fault_counters(self._fault_plan, ctx.name)
        counters.starts += 1
        for fault in self._fault_plan.faults:
            if isinstance(fault, CrashOnStart) and fault.start == counters.starts:
                counters.fired.append(fault)
                raise InjectedCrash(f"{ctx.name}: planned crash in on_start #{fault.start}")
        await super().on_start(ctx)  # type: ignore[misc]

    async def receive(self, msg: Any, ctx: ActorContext[Any]) -> Any:
        counters = fault_counters(self._fault_plan, ctx.name)
        counters.messages += 1
        k = counters.messages
        after: CrashAt | None = None
        for fault in self._fault_plan.faults:
            if isinstance(fault, CrashOnStart) or fault.message != k:
                continue
            counters.fired.append(fault)
            if isinstance(fault, CrashAt):
                if fault.when == "after":
                    after = fault
                    continue
                raise InjectedCrash(f"{ctx.name}: planned crash at message #{k} ({msg!r} lost)")
            if isinstance(fault, StallAt):
                if fault.blocking:
                    time.sleep(fault.seconds)  # noqa: ASYNC251 - the point: block the whole loop
                else:
                    await trio.sleep(fault.seconds)
            elif isinstance(fault, KillProcessAt):
                if os.getpid() == self._fault_plan.origin_pid:
                    raise FaultPlanError(
                        f"{ctx.name}: refusing to kill -9 the process that made the plan "
                        f"(pid {os.getpid()}); KillProcessAt is for actors on nodes"
                    )
                os.kill(os.getpid(), signal.SIGKILL)
        result = await super().receive(msg, ctx)  # type: ignore[misc]
        if after is not None:
            raise InjectedCrash(f"{ctx.name}: planned crash after handling message #{k} ({msg!r})")
        return result


def faulty(cls: type[A], *, name: str | None = None) -> type[A]:
    """A subclass of actor class ``cls`` that takes ``faults: FaultPlan`` (see the module doc).

    The subclass accepts the same messages (its ``Actor[M]`` is ``cls``'s), so nodes register the
    same wire types. For nodes to import it, bind it at module level under ``name`` (default
    ``"Faulty" + cls.__name__``) in a module of the node's allowlist: its ``__module__`` is the
    caller's module, like ``collections.namedtuple``.
    """
    if not (isinstance(cls, type) and issubclass(cls, Actor)):
        raise TypeError(f"faulty() takes an Actor subclass, got {cls!r}")
    qualname = name if name is not None else f"Faulty{cls.__name__}"
    caller = sys._getframe(1).f_globals.get("__name__", __name__)
    base_init = cls.__init__

    def __init__(self: Any, *args: Any, faults: FaultPlan | None = None, **kwargs: Any) -> None:
        if faults is not None and not isinstance(faults, FaultPlan):
            raise TypeError(f"faults must be a FaultPlan, got {faults!r}")
        self._fault_plan = faults if faults is not None else FaultPlan()
        base_init(self, *args, **kwargs)

    # A node decodes spawn kwargs with the types the constructor names: ``cls``'s and ours.
    try:
        hints = {k: v for k, v in typing.get_type_hints(base_init).items() if k != "return"}
    except Exception:
        hints = {}
    __init__.__annotations__ = {**hints, "faults": FaultPlan | None, "return": None}
    __init__.__qualname__ = f"{qualname}.__init__"
    namespace = {"__init__": __init__, "__module__": caller, "__qualname__": qualname}
    subclass = type(qualname, (_Faulty, cls), namespace)
    return subclass
