"""``Preload``: import the roles (and torch) on a node in a worker thread, before spawning them.

A node imports an actor's module when it is asked to spawn it, on its event loop; importing
torch takes seconds on a busy machine. Spawning ``Preload`` first moves that import to a
thread, so the node keeps answering while it loads. This module itself imports no torch.
"""

from __future__ import annotations

import importlib

import attrs
import trio

from ..actors import Actor, ActorContext, Request


@attrs.frozen
class Loaded(Request[bool]):
    pass


class Preload(Actor[Loaded]):
    """Imports ``asyncflow_actors.roles`` in a worker thread during ``on_start``."""

    async def on_start(self, ctx: ActorContext[Loaded]) -> None:
        await trio.to_thread.run_sync(importlib.import_module, "asyncflow_actors.roles")

    async def receive(self, msg: Loaded, ctx: ActorContext[Loaded]) -> bool:
        await trio.lowlevel.checkpoint()
        return True
