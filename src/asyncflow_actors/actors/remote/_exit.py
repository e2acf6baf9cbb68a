"""``exit_now``: how a process the runtime starts (a node, a trainer's rank) ends."""

from __future__ import annotations

import atexit
import os
import sys

__all__ = ["exit_now"]


def exit_now(code: int) -> None:
    """End the process now that its work stopped cleanly, skipping the interpreter's teardown
    of every module and object: with torch loaded it takes from half a second to seconds,
    which the process's owner would wait out at every stop or group close (``multiprocessing``
    ends its children the same way). Exit handlers still run first (rank groups end their
    processes there; logging flushes); the standard streams are flushed."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # closed, or its reader is gone: nothing more can reach it
    os._exit(code)
