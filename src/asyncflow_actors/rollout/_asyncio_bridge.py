"""One dedicated asyncio thread that trio code can await coroutines on.

vLLM's ``AsyncLLM`` is an asyncio object: it must be created and driven on one asyncio loop.
``AsyncioThread`` runs that loop in its own thread; trio tasks ``await bridge.call(fn, ...)``
without blocking their event loop, worker threads use ``call_blocking``, and asyncio code
hands items back to trio through ``TrioSink`` (``run_sync_soon``: never blocks the asyncio
loop on trio).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Generic, TypeVar

import trio

__all__ = ["AsyncioThread", "TrioSink"]

T = TypeVar("T")
Item = TypeVar("Item")


class TrioSink(Generic[Item]):
    """A thread-safe, non-blocking way for the asyncio thread to feed a trio channel."""

    def __init__(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self.send, self.receive = trio.open_memory_channel[Item](float("inf"))

    def put(self, item: Item) -> None:
        """From any thread: deliver ``item`` (dropped if the trio side is gone)."""
        try:
            self._token.run_sync_soon(self._deliver, item)
        except trio.RunFinishedError:
            pass

    def _deliver(self, item: Item) -> None:
        try:
            self.send.send_nowait(item)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


class AsyncioThread:
    """An asyncio event loop in a daemon thread, from ``start()`` until ``stop()``."""

    def __init__(self, name: str = "afa-asyncio") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        # every submitted call until it is done: one the loop never ran (submitted as it
        # stopped: its callback dropped by ``close``) is cancelled after, never left pending
        # (a shielded ``call`` waiting on it hung a run's stop)
        self._lock = threading.Lock()
        self._futures: dict[concurrent.futures.Future[Any], Coroutine[Any, Any, Any]] = {}
        self._closed = False

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            pending = asyncio.all_tasks(self._loop)
            for task in pending:
                task.cancel()
            if pending:
                self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            with self._lock:
                self._closed = True
                left = list(self._futures.items())
            self._loop.close()
            for future, coro in left:
                if future.cancel():
                    coro.close()  # never started: no "never awaited" warning

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop (cancelling what still runs on it) and join the thread."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()

    def submit(
        self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any
    ) -> concurrent.futures.Future[T]:
        """Schedule ``fn(*args)`` on the loop; ``RuntimeError`` once the loop has stopped."""
        with self._lock:
            if self._closed:
                raise RuntimeError("this asyncio thread has stopped")
            coro = fn(*args)
            future = asyncio.run_coroutine_threadsafe(coro, self._loop)
            self._futures[future] = coro
        future.add_done_callback(self._forget)
        return future

    def _forget(self, future: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._futures.pop(future, None)

    def call_blocking(self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
        """Run ``fn(*args)`` on the loop and wait for it (from a worker thread only)."""
        return self.submit(fn, *args).result()

    async def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` on the loop; trio waits without blocking. Cancelling the trio
        caller cancels the asyncio task (its own cleanup, e.g. vLLM aborting the request,
        finishes on the asyncio loop)."""

        async def run() -> T:
            return await fn(*args)

        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        future = self.submit(run)

        def wake(_: object) -> None:
            try:
                token.run_sync_soon(done.set)
            except trio.RunFinishedError:
                pass

        future.add_done_callback(wake)
        try:
            await done.wait()
        except trio.Cancelled:
            future.cancel()
            raise
        return future.result()
