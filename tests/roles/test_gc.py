"""``roles._gc.gc_paused``: no garbage collection while a process imports torch and transformers
(nested and overlapping blocks resume it once, as it was), the start-up frozen once."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from asyncflow_actors.roles import _gc, preload
from asyncflow_actors.roles._gc import gc_paused


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """A process that has not frozen yet (``gc.freeze`` counted, not run); the collector's
    state restored after the test."""
    frozen: list[int] = []
    monkeypatch.setattr(_gc, "_state", _gc._State())
    monkeypatch.setattr(_gc.gc, "freeze", lambda: frozen.append(1))
    enabled = gc.isenabled()
    gc.enable()
    try:
        yield frozen
    finally:
        (gc.enable if enabled else gc.disable)()


def test_paused_in_the_block_resumed_after_and_frozen_once(fresh: list[int]) -> None:
    with gc_paused():  # the driver's (the user's process): never frozen
        assert not gc.isenabled()
    assert gc.isenabled() and fresh == []
    with gc_paused(freeze=True):
        assert not gc.isenabled()
        with gc_paused():  # nested
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled() and fresh == [1]
    with gc_paused(freeze=True):
        assert not gc.isenabled()
    assert gc.isenabled() and fresh == [1]  # frozen at the first end only


def test_overlapping_blocks_of_two_threads_resume_when_the_last_ends(fresh: list[int]) -> None:
    inside, release = threading.Event(), threading.Event()
    seen: list[bool] = []

    def other() -> None:
        with gc_paused():
            inside.set()
            release.wait(10)
        seen.append(gc.isenabled())

    with gc_paused():
        thread = threading.Thread(target=other)
        thread.start()
        assert inside.wait(10)
    assert not gc.isenabled()  # the other thread's block still runs
    release.set()
    thread.join(10)
    assert seen == [True] and gc.isenabled()


def test_a_collector_disabled_before_stays_disabled(fresh: list[int]) -> None:
    gc.disable()
    with gc_paused():
        pass
    assert not gc.isenabled()


def test_preload_imports_with_the_collector_paused(
    fresh: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    states: list[bool] = []

    def record(name: str) -> Any:
        states.append(gc.isenabled())

    monkeypatch.setattr(preload.importlib, "import_module", record)
    monkeypatch.setattr(preload, "warm_hf_classes", record)
    preload.Preload(("asyncflow_actors.roles._schema",), hf_model="/models/x")._load()
    assert states == [False, False] and gc.isenabled() and fresh == [1]
