"""``ActorAddress``: what an ``ActorRef`` is on the wire, so refs can travel inside messages.

An address names an actor from anywhere in a run: the *node* (the name of the actor system that
hosts it), its *path* there, the node's *endpoints* (where to connect, as the node advertised
them) and the node's *incarnation* (which start of that node minted the address; later starts
draw larger ones). An address is hearsay where it lands: it places a node the receiver does not
know, and never re-points one its supervisor or owner told about (``_peer``). ``token`` is the actor's capability to be stopped by a
peer that holds its ref (``docs/remote.md``, security). Refs follow restarts of their actor and
of its node, as they do in the process that created them.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class ActorAddress:
    node: str
    path: str
    endpoints: tuple[str, ...] = ()
    incarnation: int = 0
    token: str = ""

    def __str__(self) -> str:
        return f"{self.node}/{self.path}"
