"""``Transport``: what an actor system needs from whatever links it to the other systems of a run.

The local runtime (this package) knows nothing of sockets, nodes or wire formats: an
``ActorSystem`` is given a transport (``ActorSystem(transport=...)``) and never builds one. The
remote half (:mod:`asyncflow_actors.actors.remote`) implements it with its ``Mesh``; a system
without a transport is a plain local system, whose refs cannot leave the process.

The interface is what the local runtime itself calls, and nothing more:

- ``name``: the system's name in the run (``ActorSystem.name``);
- ``run()``: the transport's lifetime, entered before the root supervisor starts and left after
  every actor stopped (an actor's ``on_stop`` may still talk to other systems).

The other direction, a transport reaching this system's actors (finding an actor by path,
queueing a request from the wire), goes through public hooks of the local runtime:
``ActorSystem.lookup``, ``ActorSystem.spawn``, ``LocalActorRef.cell``,
``LocalActorRef.enqueue_ask`` / ``enqueue_ask_nowait``, ``ActorContext.cell``.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Protocol


class Transport(Protocol):
    """How one actor system reaches the other systems of a run, and they reach it.

    A transport belongs to one system: it is made for it (the remote half's ``Mesh`` takes the
    system it serves) and handed to ``ActorSystem(transport=...)``.
    """

    @property
    def name(self) -> str:
        """The system's name in the run (how addresses of its actors name it)."""
        ...

    def run(self) -> AbstractAsyncContextManager[object]:
        """Own the transport's tasks and sockets for the life of the system.

        Entered before the root supervisor starts, left after every actor has stopped.
        """
        ...
