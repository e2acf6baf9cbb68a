"""A rank > 0's own actor system, in a thread: how such a rank reaches the run's actors.

A rank > 0 is a process (or a Ray actor) running a synchronous ``torch.distributed`` loop
(``_rank_host.serve``): it has no trio loop and no mesh of its own. To send its buckets of a
weight sync straight to the receivers (``_rank_send``), it opens one when first needed: an
``open_actor_system`` running in a daemon thread of the process, a member of the run's mesh
like any other system (it resolves the receivers' addresses and opens links to their
processes on first use; on loopback that needs nothing more; under CURVE it presents the
key of the process that started it, ``_rank_keys``). The rank's command loop calls
into it with ``RankMesh.run`` and waits; ``close`` stops it (at the end of ``serve``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

from ..actors.remote import NodeSystem, open_actor_system
from ._rank_keys import join_curve

T = TypeVar("T")


class RankMesh:
    """An actor system in a thread of this process (module docstring); ``start`` opens it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.system: NodeSystem | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Open the system (returns once it runs; raises what kept it from starting)."""
        self._thread = threading.Thread(target=self._main, name=f"afa-{self.name}", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise RuntimeError(f"{self.name}: its actor system did not start") from self._error

    def _main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as exc:  # reported by start() (or lost at the process's end)
            self._error = exc
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        async with open_actor_system(name=self.name, handle_signals=False) as system:
            join_curve(system.mesh)  # under CURVE: its trainer node's key (``_rank_keys``)
            self.system = system
            self._token = trio.lowlevel.current_trio_token()
            self._stop = trio.Event()
            self._ready.set()
            await self._stop.wait()

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``await fn(*args)`` on the system's loop, from this (another) thread."""
        assert self._token is not None, "RankMesh.run before start"
        return trio.from_thread.run(fn, *args, trio_token=self._token)

    def close(self) -> None:
        """Stop the system (its links and sockets closed) and wait for its thread."""
        token, stop, thread = self._token, self._stop, self._thread
        self._token = None
        if token is None or stop is None or thread is None:
            return
        try:
            trio.from_thread.run_sync(stop.set, trio_token=token)
        except trio.RunFinishedError:
            pass
        thread.join(10.0)


_MESH: list[RankMesh] = []  # this process's, once a command needed it


def rank_mesh(rank: int) -> RankMesh:
    """This process's ``RankMesh``, started on first use."""
    if not _MESH:
        mesh = RankMesh(f"rank{rank}-{os.getpid()}")
        mesh.start()
        _MESH.append(mesh)
    return _MESH[0]


def close_rank_mesh() -> None:
    """Stop this process's ``RankMesh``, if it was started."""
    while _MESH:
        _MESH.pop().close()
