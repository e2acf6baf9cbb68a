"""Leak checks: threads, child processes and sockets/pipes still open after a test.

A failing example is where cleanup code is least exercised: an exception in the middle of a
protocol, a killed node, a cancelled call. ``ResourceSnapshot.take()`` before and
``check_no_leaks(before)`` after say whether anything was left behind. Linux only (``/proc``).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator, Mapping

import attrs

# Long-lived helpers of the libraries we use, not leaks: trio's idle worker-thread cache and
# pyzmq's zero-copy garbage collector (one per process, started on first use).
IGNORED_THREAD_PREFIXES = ("Trio thread",)
IGNORED_THREAD_TYPES = ("GarbageCollectorThread",)
_TRACKED_FD_KINDS = ("socket:", "pipe:", "anon_inode:")


class ResourceLeak(AssertionError):
    """Resources (threads, processes, sockets, pipes) that outlived what should own them."""


def _threads() -> frozenset[tuple[int, str]]:
    out = set()
    for thread in threading.enumerate():
        if thread.name.startswith(IGNORED_THREAD_PREFIXES):
            continue
        if type(thread).__name__ in IGNORED_THREAD_TYPES:
            continue
        if thread.ident is not None:
            out.add((thread.ident, thread.name))
    return frozenset(out)


def _children() -> frozenset[int]:
    me = os.getpid()
    out = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[-1].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            out.add(int(entry))
    return frozenset(out)


def _fds() -> dict[int, str]:
    out = {}
    for entry in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{entry}")
        except OSError:
            continue  # closed meanwhile (or the listing's own fd)
        if target.startswith(_TRACKED_FD_KINDS):
            out[int(entry)] = target
    return out


def warm_up_zmq() -> None:
    """Create the process's zmq context and its I/O threads now, so they are not seen as leaks."""
    import zmq

    zmq.Context.instance().socket(zmq.DEALER).close(linger=0)


@attrs.frozen
class ResourceSnapshot:
    """The threads, child processes and socket/pipe/event file descriptors of this process."""

    threads: frozenset[tuple[int, str]]
    children: frozenset[int]
    fds: Mapping[int, str]

    @classmethod
    def take(cls) -> ResourceSnapshot:
        if not os.path.isdir("/proc/self/fd"):
            raise RuntimeError("leak checks read /proc: Linux only")
        return cls(_threads(), _children(), _fds())

    def leaks_since(self, before: ResourceSnapshot) -> list[str]:
        """What this snapshot holds that ``before`` did not, one description per resource."""
        out = [f"thread {name!r}" for ident, name in sorted(self.threads - before.threads)]
        out += [f"child process {pid}" for pid in sorted(self.children - before.children)]
        out += [
            f"fd {fd} -> {target}"
            for fd, target in sorted(self.fds.items())
            if before.fds.get(fd) != target
        ]
        return out


def check_no_leaks(before: ResourceSnapshot, *, settle: float = 5.0) -> None:
    """Raise ``ResourceLeak`` if resources opened since ``before`` are still there.

    Some releases are asynchronous by design (libzmq closes a socket's descriptors in its reaper
    thread; a killed child is reaped a moment later), so this waits up to ``settle`` seconds for
    the count to come back, and fails with the list of what did not.
    """
    deadline = time.monotonic() + settle
    while True:
        leaks = ResourceSnapshot.take().leaks_since(before)
        if not leaks:
            return
        if time.monotonic() >= deadline:
            raise ResourceLeak(f"{len(leaks)} resource(s) leaked: " + "; ".join(leaks))
        time.sleep(0.02)


@contextlib.contextmanager
def no_leaks(*, settle: float = 5.0) -> Iterator[ResourceSnapshot]:
    """Check that the block leaves no thread, child process, socket or pipe behind.

    The check runs only if the block raised nothing (a failure inside is reported as it is).
    Call ``warm_up_zmq()`` first if the block is the process's first use of zmq.
    """
    before = ResourceSnapshot.take()
    yield before
    check_no_leaks(before, settle=settle)
