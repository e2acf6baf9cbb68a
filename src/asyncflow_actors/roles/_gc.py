"""The garbage collector paused while a process imports torch and transformers.

Those imports allocate about a million long-lived objects, and CPython runs a full collection
each time the long-lived heap has grown by a quarter: six or so in a row during a process's
start, each rescanning everything so far (0.02 s growing to 0.2 s, about 0.5 s of a process's
start in all, measured with ``peer_trl``), to find a few hundred objects. ``gc_paused`` pauses
the collector for its block (blocks may nest and overlap across threads: it resumes when the
last one ends, if it ran before the first), and the first block to end in a process freezes
what exists then (``gc.freeze``): later full collections (0.2 s each) no longer rescan the
imported modules. The freeze is once per process, at its start: it keeps for good what was
alive then (a few hundred objects of cyclic garbage, and the objects of that moment that become
garbage in a cycle later: bounded, once), and ``gc.get_objects()`` no longer lists them.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.was_enabled = False
        self.frozen = False


_state = _State()


@contextmanager
def gc_paused() -> Iterator[None]:
    """No garbage collection during the block (see the module docstring)."""
    state = _state
    with state.lock:
        if state.depth == 0:
            state.was_enabled = gc.isenabled()
            gc.disable()
        state.depth += 1
    try:
        yield
    finally:
        with state.lock:
            state.depth -= 1
            if state.depth == 0:
                if not state.frozen:
                    gc.freeze()
                    state.frozen = True
                if state.was_enabled:
                    gc.enable()
