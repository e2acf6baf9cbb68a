"""Hypothesis state machines whose rules drive trio code: ``TrioStateMachine``, ``ActorMachine``.

A ``RuleBasedStateMachine`` is synchronous; these base classes give each example a trio loop in a
helper thread (``TrioThread``), with resources opened once per example by ``setup`` and closed
by ``teardown`` whatever the example left behind. Rules call into the loop with ``self.run(fn,
*args)``, or are written ``async`` and marked ``@in_trio``::

    class MyMachine(ActorMachine):
        async def setup(self, stack):
            await super().setup(stack)                       # opens self.system
            self.counter = await self.system.spawn(Counter, name="counter")
            self.total = 0

        @rule(n=st.integers(1, 5))
        @in_trio
        async def add(self, n):
            await self.counter.send(Add(n))
            self.total += n

        @invariant()
        @in_trio
        async def total_matches(self):
            assert await self.counter.ask(Get()) == self.total

    TestMyMachine = MyMachine.TestCase
    TestMyMachine.settings = protocol_settings()

Time is virtual (``clock = "manual"``): it moves only when a rule calls ``self.advance(dt)``, so
every timeout, lease and backoff is under the machine's control and replays exactly.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, Concatenate, Literal, ParamSpec, TypeVar

import trio
import trio.testing
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import RuleBasedStateMachine
from hypothesis.strategies import DataObject, SearchStrategy

from ..actors import Strategy
from ..actors.remote import NodeSystem, open_actor_system
from ._harness import TrioThread

P = ParamSpec("P")
T = TypeVar("T")
M = TypeVar("M", bound="TrioStateMachine")

Clock = Literal["manual", "autojump", "real"]


def _make_clock(kind: Clock) -> trio.abc.Clock | None:
    if kind == "manual":
        return trio.testing.MockClock()  # moves only by advance()
    if kind == "autojump":
        return trio.testing.MockClock(autojump_threshold=0)
    if kind == "real":
        return None
    raise ValueError(f"clock must be 'manual', 'autojump' or 'real', got {kind!r}")


class _DrawInDriver:
    """``st.data()`` for a rule running in the loop's thread: draws happen in hypothesis's."""

    def __init__(self, data: DataObject, trio: TrioThread[Any]) -> None:
        self._data = data
        self._trio = trio

    def draw(self, strategy: SearchStrategy[T], label: object = None) -> T:
        value: T = self._trio.call_in_driver(self._data.draw, strategy, label)
        return value

    def __repr__(self) -> str:
        return repr(self._data)


def in_trio(fn: Callable[Concatenate[M, P], Awaitable[T]]) -> Callable[Concatenate[M, P], T]:
    """Run an ``async`` rule, invariant or initialize of a ``TrioStateMachine`` in its loop.

    Put it *under* ``@rule``/``@invariant``/``@initialize``: hypothesis calls a plain function,
    which runs the coroutine as one call (``self.run``) and returns once the loop has settled.
    ``data.draw`` of an ``st.data()`` argument works as usual (it runs in hypothesis's thread);
    other hypothesis calls (``note``, ``assume``, ``target``) go through
    ``self.trio.call_in_driver``.
    """

    def call(self: M, /, *args: P.args, **kwargs: P.kwargs) -> T:
        def wrap(value: Any) -> Any:
            return _DrawInDriver(value, self.trio) if isinstance(value, DataObject) else value

        args = tuple(wrap(a) for a in args)  # type: ignore[assignment]
        kwargs = {k: wrap(v) for k, v in kwargs.items()}  # type: ignore[assignment]
        return self.run(functools.partial(fn, self, *args, **kwargs))

    functools.update_wrapper(call, fn)  # hypothesis reads the signature through __wrapped__
    return call


def _note(error: BaseException, text: str) -> None:
    add_note = getattr(error, "add_note", None)  # Python >= 3.11
    if add_note is not None:
        add_note(text)


class TrioStateMachine(RuleBasedStateMachine):
    """A ``RuleBasedStateMachine`` with a trio loop per example (see the module docstring).

    Class options: ``clock`` (``"manual"``: a ``MockClock`` moved by ``advance``;
    ``"autojump"``: virtual time that jumps whenever the loop is idle, also between rules;
    ``"real"``: for node processes and sockets), ``call_timeout`` (real seconds one call may take
    before it is reported as a hang).
    """

    clock: ClassVar[Clock] = "manual"
    call_timeout: ClassVar[float] = 60.0

    def __init__(self) -> None:
        super().__init__()
        self.trio: TrioThread[None] = TrioThread(
            self.setup,
            clock=_make_clock(self.clock),
            call_timeout=self.call_timeout,
            name=f"trio-{type(self).__name__}",
        )

    async def setup(self, stack: contextlib.AsyncExitStack) -> None:
        """Open this example's resources (runs in the loop, before the first rule).

        Enter them on ``stack``: they are closed in reverse order at ``teardown``.
        """

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` in the loop, wait for it and for the loop to settle; return its value."""
        return self.trio.run(fn, *args)

    def run_sync(self, fn: Callable[..., T], *args: Any) -> T:
        return self.trio.run_sync(fn, *args)

    def advance(self, seconds: float) -> None:
        """Move virtual time by ``seconds``, firing each timer at its own time (manual clock)."""
        self.trio.advance(seconds)

    @property
    def now(self) -> float:
        return self.trio.now

    def teardown(self) -> None:
        """Close the loop and its resources. Override to drain and check first, then call this.

        If the example is already failing, an error from closing is attached to that failure as
        a note instead of replacing it (hypothesis then shrinks the original failure).
        """
        failing = sys.exc_info()[1]
        try:
            self.trio.close()
        except BaseException as exc:
            if failing is None:
                raise
            _note(failing, f"closing the trio loop also failed: {exc!r}")


class ActorMachine(TrioStateMachine):
    """A ``TrioStateMachine`` whose ``setup`` opens an actor system: ``self.system``.

    ``strategy`` and ``shutdown_grace`` are passed to ``open_actor_system``. Leaving the system at
    ``teardown`` stops every actor (graces pass in virtual time).
    """

    strategy: ClassVar[Strategy | None] = None
    shutdown_grace: ClassVar[float] = 5.0
    system: NodeSystem

    async def setup(self, stack: contextlib.AsyncExitStack) -> None:
        self.system = await stack.enter_async_context(
            open_actor_system(strategy=self.strategy, shutdown_grace=self.shutdown_grace)
        )


def protocol_settings(
    *, max_examples: int = 50, stateful_step_count: int = 20, **overrides: Any
) -> settings:
    """Hypothesis settings for protocol tests that stay fast and readable on a loaded machine.

    No per-example deadline (loop start-up and process I/O vary), no *explain* phase (its line
    tracing of a whole actor runtime turns a failure into minutes), one bug reported at a time,
    and no ``too_slow`` health check. Anything else can be overridden (``derandomize=True`` for a
    fixed search, ``database=None``...).
    """
    options: dict[str, Any] = {
        "max_examples": max_examples,
        "stateful_step_count": stateful_step_count,
        "deadline": None,
        "phases": [Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
        "report_multiple_bugs": False,
        "suppress_health_check": [HealthCheck.too_slow],
    }
    options.update(overrides)
    return settings(**options)
