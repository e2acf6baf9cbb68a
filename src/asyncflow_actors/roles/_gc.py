"""The garbage collector paused while a process imports torch and transformers.

Those imports allocate about a million long-lived objects, and CPython runs a full collection
each time the long-lived heap has grown by a quarter: six or so in a row during a process's
start, each rescanning everything so far (0.02 s growing to 0.2 s, about 0.5 s of a process's
start in all, measured with ``peer_trl``), to find a few hundred objects. ``gc_paused`` pauses
the collector for its block (blocks may nest and overlap across threads: it resumes when the
last one ends, if it ran before the first). In a process of the library's own (a node),
``gc_paused(freeze=True)``: the first such block to end freezes what exists then
(``gc.freeze``), so later full collections (0.2 s each) no longer rescan the imported modules.
The freeze is once per process, at its start: it keeps for good what was alive then (a few
hundred objects of cyclic garbage, and the objects of that moment that become garbage in a
cycle later: bounded, once), and ``gc.get_objects()`` no longer lists them. The driver's
process is the user's: it is paused, never frozen (the user's objects are theirs to collect).
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
        self.freeze = False  # a block of the current pause asked for the freeze


_state = _State()


@contextmanager
def gc_paused(*, freeze: bool = False) -> Iterator[None]:
    """No garbage collection during the block; with ``freeze``, what exists when the last block
    ends is frozen, once a process (see the module docstring)."""
    state = _state
    with state.lock:
        if state.depth == 0:
            state.was_enabled = gc.isenabled()
            gc.disable()
        state.depth += 1
        state.freeze = state.freeze or freeze
    try:
        yield
    finally:
        with state.lock:
            state.depth -= 1
            if state.depth == 0:
                if state.freeze and not state.frozen:
                    gc.freeze()
                    state.frozen = True
                state.freeze = False
                if state.was_enabled:
                    gc.enable()
