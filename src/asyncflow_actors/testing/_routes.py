"""Routing the links a system opens by itself through a link proxy (``Mesh.route``).

A system opens links lazily: to a node it starts, and to any system a ref it received points
to (node to node, node to driver). ``system.mesh.route``, a ``(peer name, endpoint) ->
endpoint`` hook, says where each new link connects. ``route_through`` sets it in this process so
that links to the chosen peers go through a ``LinkProxy``; ``RouteLinks``, spawned on a node,
does the same in the node's process with fixed addresses (the proxy lives in the test's
process). Links already open keep their connection: route before the first use.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import TYPE_CHECKING

import attrs

from ..actors import Actor, ActorContext, Request
from ..actors.remote import mesh_of

if TYPE_CHECKING:
    from ..actors.remote import NodeSystem
    from ._proxy import LinkProxy

Route = Callable[[str, str], str]


@contextlib.contextmanager
def route_through(
    system: NodeSystem, proxy: LinkProxy, *, peers: Collection[str] | None = None
) -> Iterator[None]:
    """Links ``system`` opens in the block to ``peers`` (names; ``None``: every peer) connect
    through ``proxy`` (an address of it per endpoint, ``proxy.relay``); the hook in place
    before comes back after the block.

    The name is the one the link is opened under: the node name given to ``start_node`` or
    ``connect_node``, or a peer system's own name for links the mesh opens.
    """
    mesh = system.mesh
    previous = mesh.route

    def route(name: str, endpoint: str) -> str:
        if previous is not None:
            endpoint = previous(name, endpoint)
        if peers is not None and name not in peers:
            return endpoint
        return proxy.relay(endpoint)

    mesh.route = route
    try:
        yield
    finally:
        if mesh.route is route:
            mesh.route = previous


@attrs.frozen
class Routes(Request[dict[str, str]]):
    """Ask a ``RouteLinks`` actor for the routes it set."""


class RouteLinks(Actor[Routes]):
    """Spawned on a node, makes the node's new links to the named peers connect elsewhere.

    ``routes`` maps a peer name to the endpoint to connect to instead of the one the peer
    advertises, typically ``proxy.relay(peer_address)`` of a proxy in the test's process::

        await node_a.spawn(RouteLinks, name="routes",
                           kwargs={"routes": {"b": proxy.relay(node_b.address)}})

    The node must allow ``asyncflow_actors.testing``. Stopping the actor restores the routing
    the node had before.
    """

    def __init__(self, routes: dict[str, str]) -> None:
        self.routes = dict(routes)
        self._previous: Route | None = None
        self._route: Route | None = None

    async def on_start(self, ctx: ActorContext[Routes]) -> None:
        mesh = mesh_of(ctx.system)
        self._previous = previous = mesh.route
        self._route = mesh.route = _fixed(self.routes, previous)

    async def receive(self, msg: Routes, ctx: ActorContext[Routes]) -> dict[str, str]:
        return dict(self.routes)

    async def on_stop(self, ctx: ActorContext[Routes], error: BaseException | None) -> None:
        mesh = mesh_of(ctx.system)
        if mesh.route is self._route:
            mesh.route = self._previous


def _fixed(routes: Mapping[str, str], previous: Route | None) -> Route:
    def route(name: str, endpoint: str) -> str:
        chosen = routes.get(name)
        if chosen is not None:
            return chosen
        return previous(name, endpoint) if previous is not None else endpoint

    return route
