"""A trio loop in a helper thread, driven by synchronous code (hypothesis state machines).

Hypothesis runs rules and invariants synchronously; actors live in a trio loop. ``TrioThread``
runs that loop in a thread of its own and lets the driving thread call into it: ``run(fn, *args)``
runs ``fn`` as a task of the loop, waits for it, lets every other task settle, and returns its
result or re-raises its exception here. Resources opened by ``setup`` (an actor system, a
TransferQueue...) live in the loop's main task until ``close``.

Every call has a bound in *real* time (``call_timeout``): a hung call is cancelled and reported as
``CallTimeout`` instead of freezing the test run. ``close`` always ends the loop: it lets virtual
time run (so shutdown graces pass at once), cancels what a failing example left running, closes
the resources in reverse order and joins the thread.
"""

from __future__ import annotations

import contextlib
import functools
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import outcome
import trio
import trio.lowlevel
import trio.testing

from ._replay import seed_scheduler
from ._time import advance, settle

S = TypeVar("S")
T = TypeVar("T")

Setup = Callable[[contextlib.AsyncExitStack], Awaitable[S]]


class HarnessError(RuntimeError):
    """The harness's trio loop ended (its resources failed) or did not shut down."""


class CallTimeout(HarnessError):
    """A call into the loop did not finish within ``call_timeout`` seconds of real time."""


def _describe(fn: Callable[..., Any]) -> str:
    if isinstance(fn, functools.partial):
        return _describe(fn.func)
    return getattr(fn, "__qualname__", None) or repr(fn)


class TrioThread(Generic[S]):
    """A trio loop in a helper thread (see the module docstring).

    ``setup(stack)`` runs in the loop's main task before anything else; what it enters on
    ``stack`` stays open until ``close`` and its return value is ``value``. ``clock`` is the
    loop's clock (a ``trio.testing.MockClock`` for virtual time: it moves only by ``advance``,
    unless its ``autojump_threshold`` says otherwise). ``seed`` seeds trio's scheduler (which
    hypothesis already seeds per example when it drives the thread). A failing ``setup`` is
    raised from the constructor, with the loop already closed.

    Use it as a context manager, or call ``close`` yourself.
    """

    def __init__(
        self,
        setup: Setup[S] | None = None,
        *,
        clock: trio.abc.Clock | None = None,
        call_timeout: float = 60.0,
        seed: int | None = None,
        instruments: tuple[trio.abc.Instrument, ...] = (),
        name: str = "trio-harness",
    ) -> None:
        self.clock = clock
        self.call_timeout = call_timeout
        self._setup = setup
        self._value: S | None = None
        self._seed = seed
        self._instruments = instruments
        self._token: trio.lowlevel.TrioToken | None = None
        self._inbox: queue.SimpleQueue[Callable[[], None] | None] | None = None
        self._calls: trio.Nursery | None = None
        self._stop = trio.Event()
        self._ready = threading.Event()
        self._ended = threading.Event()
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._thread_main, name=name, daemon=True)
        self._thread.start()
        if not self._ready.wait(call_timeout):
            self._abandon()
            raise CallTimeout(f"the harness's setup did not finish within {call_timeout}s")
        if self._calls is None:  # setup failed: the loop is over
            self._thread.join(call_timeout)
            error = self._error
            self._closed = True
            raise HarnessError(f"the harness's setup failed: {error!r}") from error

    # -- the loop ------------------------------------------------------------------------------

    def _thread_main(self) -> None:
        try:
            if self._seed is not None:
                seed_scheduler(self._seed)
            trio.run(self._main, clock=self.clock, instruments=self._instruments)
        except BaseException as exc:
            self._error = exc
        finally:
            self._calls = None
            self._ready.set()
            self._ended.set()

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        async with contextlib.AsyncExitStack() as stack:
            if self._setup is not None:
                self._value = await self._setup(stack)
            try:
                async with trio.open_nursery() as calls:
                    self._calls = calls
                    self._ready.set()
                    await self._stop.wait()
                    calls.cancel_scope.cancel()
            finally:
                self._calls = None

    @property
    def value(self) -> S:
        """What ``setup`` returned."""
        return self._value  # type: ignore[return-value]

    @property
    def error(self) -> BaseException | None:
        """The exception the loop ended with, if it ended."""
        return self._error

    @property
    def running(self) -> bool:
        return not self._ended.is_set()

    # -- calls ---------------------------------------------------------------------------------

    def _ended_error(self, what: str) -> HarnessError:
        return HarnessError(f"the trio loop ended before {what} (its error: {self._error!r})")

    def _soon(self, fn: Callable[[], object], what: str) -> None:
        if self._token is None or self._ended.is_set():
            raise self._ended_error(what)
        try:
            self._token.run_sync_soon(fn)
        except trio.RunFinishedError:
            raise self._ended_error(what) from self._error

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any, settle_after: bool = True) -> T:
        """Run ``fn(*args)`` as a task of the loop; return its result or raise its exception.

        Then (``settle_after``) wait until every task of the loop is blocked, so that what the
        call set in motion has happened before the caller looks. Raises ``CallTimeout`` after
        ``call_timeout`` real seconds (the call is cancelled first), ``HarnessError`` if the
        loop ended meanwhile (an actor system whose root supervisor failed, for instance).
        While it waits, this thread serves ``call_in_driver`` requests of the call.
        """
        what = f"{_describe(fn)} returned"
        inbox: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        box: list[outcome.Outcome[T]] = []
        scope = trio.CancelScope()

        async def call() -> None:
            try:
                with scope:
                    value = await fn(*args)
                    if settle_after:
                        await settle()
                    box.append(outcome.Value(value))
            except trio.Cancelled:
                raise
            except BaseException as exc:
                box.append(outcome.Error(exc))
            finally:
                inbox.put(None)

        def start() -> None:
            calls = self._calls
            if calls is None:
                inbox.put(None)
                return
            calls.start_soon(call, name=f"harness call {_describe(fn)}")

        self._inbox = inbox
        try:
            self._soon(start, what)
            if not self._serve(inbox, self.call_timeout):
                with contextlib.suppress(HarnessError):
                    self._soon(scope.cancel, what)
                self._serve(inbox, self.call_timeout)
                raise CallTimeout(
                    f"{_describe(fn)} did not finish within {self.call_timeout}s of real time "
                    "(a deadlock, a wait on virtual time that nothing advances, or a busy loop)"
                )
        finally:
            self._inbox = None
        if not box:  # cancelled from outside the call: the loop is ending
            self._ended.wait(self.call_timeout)
            raise self._ended_error(what) from self._error
        return box[0].unwrap()

    @staticmethod
    def _serve(inbox: queue.SimpleQueue[Callable[[], None] | None], timeout: float) -> bool:
        """Run the call's requests until it is done (``True``) or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                request = inbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return False
            if request is None:
                return True
            request()

    def call_in_driver(self, fn: Callable[..., T], *args: Any) -> T:
        """From a call running in the loop: run ``fn(*args)`` in the thread waiting in ``run``.

        For APIs bound to the driving thread, such as hypothesis's ``data.draw``, ``note``,
        ``assume`` and ``target`` inside a rule (``@in_trio`` routes ``data.draw`` here by
        itself). The loop is blocked until it returns: keep it short. Called from the driving
        thread itself, it just calls ``fn``.
        """
        if threading.current_thread() is not self._thread:
            return fn(*args)
        inbox = self._inbox
        if inbox is None:
            raise RuntimeError("call_in_driver() works only inside a run() call")
        done = threading.Event()
        box: list[outcome.Outcome[T]] = []

        def request() -> None:
            box.append(outcome.capture(fn, *args))
            done.set()

        inbox.put(request)
        done.wait()  # the driver is in run(), serving requests until the call ends
        return box[0].unwrap()

    def run_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Call a synchronous ``fn(*args)`` inside the loop (no settling)."""
        if self._token is None or self._ended.is_set():
            raise self._ended_error(f"{_describe(fn)} ran")
        try:
            return trio.from_thread.run_sync(fn, *args, trio_token=self._token)
        except trio.RunFinishedError:
            raise self._ended_error(f"{_describe(fn)} ran") from self._error

    def advance(self, seconds: float) -> None:
        """Move virtual time forward by ``seconds``, deadline by deadline (``MockClock`` only)."""
        clock = self.clock
        if not isinstance(clock, trio.testing.MockClock):
            raise TypeError(f"advance() needs a trio.testing.MockClock, the loop runs on {clock!r}")
        self.run(advance, clock, seconds, settle_after=False)

    @property
    def now(self) -> float:
        """The loop's current time."""
        return self.run_sync(trio.current_time)

    # -- closing -------------------------------------------------------------------------------

    def close(self) -> None:
        """End the loop: let virtual time run, cancel pending calls, close ``setup``'s resources.

        Idempotent. Raises ``HarnessError`` if the thread is still alive after ``call_timeout``
        real seconds, and re-raises the exception the loop ended with, if any.
        """
        if self._closed:
            return
        self._closed = True
        clock = self.clock

        def finish() -> None:
            if isinstance(clock, trio.testing.MockClock):
                clock.autojump_threshold = 0  # shutdown graces and backoffs pass at once
            self._stop.set()

        with contextlib.suppress(HarnessError):
            self._soon(finish, "close")
        self._thread.join(self.call_timeout)
        if self._thread.is_alive():
            raise HarnessError(
                f"the trio loop did not shut down within {self.call_timeout}s of real time "
                "(a task that ignores cancellation, or a blocking call in the loop)"
            )
        if self._error is not None:
            raise self._error

    def _abandon(self) -> None:
        self._closed = True
        with contextlib.suppress(HarnessError):
            self._soon(self._stop.set, "close")

    def __enter__(self) -> TrioThread[S]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
