"""Spawning and stopping actors for peers: who may, and what a reconnected session adopts.

A node spawns actors for peers from import paths its allowlist permits (``_hosting``), once they
said hello. Stopping one is for its spawner, the holder of its stop token (carried by refs to
it) or the node's owner. A session that reconnects after a blip adopts what it spawned; one that
is gone leaves its actors to be stopped when another claims their names.
"""

from __future__ import annotations

import logging
import secrets
from typing import TYPE_CHECKING, Any

from .._actor import default_mailbox_size
from .._errors import ActorCrashed, NameTakenError
from .._ref import LocalActorRef
from .._supervisor import Restart
from . import _protocol as P
from ._hosting import NotAuthorized, SpawnRefused, import_actor
from ._sessions import PeerState

if TYPE_CHECKING:
    from ._server import NodeServer

log = logging.getLogger("asyncflow_actors.node")


async def spawn_for(
    server: NodeServer, peer: bytes, state: PeerState, corr: int, request: P.SpawnRequest
) -> None:
    """Spawn ``request``'s actor for ``peer`` and serve it (its spawner: the peer's session);
    a refusal is the request's error reply."""
    try:
        if not state.session:
            raise NotAuthorized("say hello before spawning")
        cls = import_actor(request.target, server.allow, server.name)
        existing = server.served.get(request.name)
        if existing is not None and existing.spawner is not None:
            if request.adopt and existing.spawner == state.session:
                # the same session reconnected (its link blipped): adopt what it left here
                server.open_window(existing, peer)
                info = server.actor_info(existing, token=True)
                server.send_nowait(peer, {"k": P.OK, "c": corr}, info)
                return
            if not server.sessions.connected(existing.spawner):
                log.warning(
                    "node %s: stopping %s, left by a session that is gone",
                    server.name,
                    request.name,
                )
                await existing.ref.stop()
        kwargs = dict(request.kwargs)
        ref = await server.system.spawn(
            lambda: cls(**kwargs),
            name=request.name,
            restart=Restart(request.restart),
            mailbox_size=request.mailbox_size
            if request.mailbox_size is not None
            else default_mailbox_size(cls),
        )
    except (
        SpawnRefused,
        NotAuthorized,
        NameTakenError,
        ActorCrashed,
        ValueError,
        TypeError,
    ) as exc:
        if isinstance(exc, SpawnRefused):
            server.refusals += 1
        server.reply_error(peer, corr, exc, request.name)
        return
    assert isinstance(ref, LocalActorRef)
    served = server.serve_actor(ref.cell, spawner=state.session)
    server.open_window(served, peer)
    server.send_nowait(peer, {"k": P.OK, "c": corr}, server.actor_info(served, token=True))


async def stop_for(
    server: NodeServer, peer: bytes, state: PeerState, corr: int, meta: dict[str, Any]
) -> None:
    """Stop the actor ``meta["t"]`` names if ``peer`` may (its spawner, a holder of its stop
    token, the owner); stopping one that is gone already is fine."""
    target = meta.get("t")
    served = server.served.get(target) if isinstance(target, str) else None
    if served is not None:
        token = meta.get("tok")
        allowed = (
            state.owner
            or (served.spawner is not None and served.spawner == state.session)
            or (
                isinstance(token, str)
                and bool(token)
                and secrets.compare_digest(token, served.ref.cell.token)
            )
        )
        if not allowed:
            error = NotAuthorized(
                f"{served.path!r} may only be stopped by its spawner, a holder of its ref, "
                "or the node's owner"
            )
            server.reply_error(peer, corr, error, served.path)
            return
        await served.ref.stop()
    server.send_nowait(peer, {"k": P.OK, "c": corr}, None)
