"""Compute threads of a station: a call cancelled before its thread started leaves nothing for
``wait_for_threads`` to wait on (it used to wait out its whole timeout, 10 s per role at stop)."""

from __future__ import annotations

import threading
import time

import trio

from asyncflow_actors.roles import _worker


async def test_a_call_cancelled_before_its_thread_started_is_withdrawn() -> None:
    ran = threading.Event()
    with trio.CancelScope() as scope:
        scope.cancel()
        await _worker.in_thread(ran.set)
    assert not _worker._running
    start = time.monotonic()
    await _worker.wait_for_threads(10)
    assert time.monotonic() - start < 1
    await trio.sleep(0.05)
    assert not ran.is_set()  # withdrawn: it never runs


async def test_an_abandoned_running_call_is_waited_for() -> None:
    release = threading.Event()
    finished = threading.Event()

    def work() -> None:
        release.wait(10)
        finished.set()

    before = set(_worker._running)
    with trio.move_on_after(0.05):
        await _worker.in_thread(work)  # abandoned while it runs
    assert len(_worker._running - before) == 1
    release.set()
    await _worker.wait_for_threads(10)
    assert finished.is_set() and not _worker._running - before
