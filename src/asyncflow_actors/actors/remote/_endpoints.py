"""Where systems listen: endpoints advertised and picked, loopback, incarnations, heartbeats.

Small pure helpers of the ``Mesh`` and the node CLI (no sockets are opened here).
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import zmq

if TYPE_CHECKING:
    from ._launch import NodeOptions

_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


def heartbeat_options(options: NodeOptions) -> dict[int, int]:
    """ZMTP heartbeats (answered by libzmq's I/O thread, whatever Python's loop is doing)."""
    ivl = max(1, round(options.heartbeat_interval * 1000))
    timeout = max(ivl, round(options.heartbeat_timeout * 1000))
    return {
        zmq.HEARTBEAT_IVL: ivl,
        zmq.HEARTBEAT_TIMEOUT: timeout,
        zmq.HEARTBEAT_TTL: min(timeout, 6553500),  # the TTL is sent in units of 100 ms
        zmq.MAXMSGSIZE: options.max_message_bytes,
    }


def is_loopback(endpoint: str) -> bool:
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = endpoint.removeprefix("tcp://").rpartition(":")[0]
    return host in _LOOPBACK


def advertised(endpoint: str) -> str:
    """An endpoint peers can connect to (a wildcard bind advertises this host's name)."""
    if endpoint.startswith("tcp://0.0.0.0:") or endpoint.startswith("tcp://*:"):
        return f"tcp://{socket.gethostname()}:{endpoint.rpartition(':')[2]}"
    return endpoint


def new_incarnation() -> int:
    """A node's incarnation: later starts draw larger ones (milliseconds since the epoch,
    then 20 random bits), so that an address from a newer start is recognised as newer."""
    return (time.time_ns() // 1_000_000) << 20 | secrets.randbits(20)


def pick_endpoint(endpoints: Iterable[str]) -> str | None:
    """ipc when its socket file is on this host, else the first tcp endpoint."""
    candidates = list(endpoints)
    for endpoint in candidates:
        if endpoint.startswith("ipc://") and os.path.exists(endpoint.removeprefix("ipc://")):
            return endpoint
    for endpoint in candidates:
        if endpoint.startswith("tcp://"):
            return endpoint
    return None
