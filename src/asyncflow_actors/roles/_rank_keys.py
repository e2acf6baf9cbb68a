"""A trainer's ranks > 0 in a CURVE mesh: they present the identity of the process that started them.

A rank > 0 runs an actor system of its own (``_rank_mesh``) to send its buckets of a weight
sync to the receivers and to fetch its rows from the TransferQueue's units. Under CURVE those
servers let in only the keys they know: the cluster key (``key_model="cluster"``), or, in the
node model, the keys the supervisor bound to names. A rank is a child process of the trainer's
node and runs under its authority, so it presents that node's own keypair (not a binding of its
own): the servers already admit it (a server accepts any number of connections proving one key;
a node admits its own key, for its ranks' links to itself), no supervisor round trip is needed
when ranks start or restart, and a rank cannot outlive its node's key (a restarted node draws a
new one and starts new ranks). The keypair reaches the rank in its environment
(``AFA_RANK_CURVE_KEYS``: ``"MODEL PUBLIC SECRET"``, read and removed at its start), never its
command line. The server key each rank expects of a node travels with the node's address in
the commands (``address_entry``); in the cluster model it is the cluster key anyway.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ..actors.remote import ActorAddress, CurveClient, CurveKeypair, KeyBindings
from ..actors.remote._curve import process_keys
from ..actors.remote._mesh import Mesh

RANK_KEYS_ENV = "AFA_RANK_CURVE_KEYS"


def rank_key_env() -> dict[str, str]:
    """The environment that hands this process's CURVE identity to the ranks it starts (empty
    where no system of this process listens with CURVE)."""
    keys = process_keys()
    if keys is None:
        return {}
    pair = keys.keypair
    return {RANK_KEYS_ENV: f"{keys.model} {pair.public.decode()} {pair.secret.decode()}"}


def join_curve(mesh: Mesh) -> bool:
    """Give a rank's system the CURVE identity its starter handed it (``RANK_KEYS_ENV``, removed
    from the environment: not left to its children); False without one."""
    handed = os.environ.pop(RANK_KEYS_ENV, "")
    if not handed:
        return False
    model, public, secret = handed.split()
    if model not in ("cluster", "node"):
        raise ValueError(f"{RANK_KEYS_ENV}: key model {model!r}")
    keypair = CurveKeypair(public, secret)
    mesh.keys = KeyBindings(keypair, "node" if model == "node" else "cluster")
    mesh.curve = CurveClient(keypair.public, keypair)
    return True


def server_key(mesh: Mesh, node: str) -> str:
    """The CURVE key (Z85) ``mesh`` expects of ``node``'s server ("" without CURVE): what a
    rank binds the name to before linking to it."""
    keys = mesh.keys
    if keys is None:
        return ""
    key = keys.bound_key(node, mesh.name) or keys.key_of(node)
    return key.decode() if key is not None else ""


def address_entry(mesh: Mesh, address: ActorAddress) -> list[Any]:
    """An actor's address as plain data for the ranks: node, path, endpoints, incarnation and
    its node's server key (no stop token: the ranks only send to it)."""
    node = address.node
    key = server_key(mesh, node)
    return [node, address.path, list(address.endpoints), address.incarnation, key]


def resolve_entry(mesh: Mesh, entry: Sequence[Any]) -> Any:
    """A ref on a rank's ``mesh`` to the actor of an ``address_entry`` (binding its node's key
    first: the rank's links to it expect that key)."""
    node, path, endpoints, incarnation, *rest = entry
    key = rest[0] if rest else ""
    if key and mesh.keys is not None:
        mesh.keys.bind(node, key)
    return mesh.resolve(ActorAddress(node, path, tuple(endpoints), incarnation))
