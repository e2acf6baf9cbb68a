"""Who is connected to a server: peers by ROUTER identity, their sessions, their comings and goings.

A peer says who it is (its system's name and session) in its hello. A ROUTER socket does not say
when a peer's connection drops, but its monitor reports the file descriptor that closed, and every
message carries the descriptor it came in on (``SRCFD``): together they tell which peer left.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from ._zmq import TrioSocket, open_monitor_socket


@attrs.define(eq=False)
class PeerState:
    identity: bytes
    name: str = ""
    session: str = ""
    owner: bool = False
    key: bytes = b""  # the CURVE key this connection proved (Z85; ZAP's User-Id)
    fd: int = -1
    disconnected_at: float | None = None


def source_fd(frame: Any) -> int:
    """The descriptor a received frame came in on (``-1`` over inproc)."""
    try:
        return int(frame.get(zmq.SRCFD))
    except Exception:  # inproc has no fd; older libzmq may lack the property
        return -1


class Sessions:
    """The peers of one server (see the module docstring)."""

    def __init__(self) -> None:
        self.peers: dict[bytes, PeerState] = {}

    def connected(self, session: str) -> bool:
        """Whether any connection of ``session`` is up."""
        return any(p.session == session and p.disconnected_at is None for p in self.peers.values())

    async def watch(self, sock: TrioSocket, dropped: Callable[[PeerState], None]) -> None:
        """Mark peers whose connection dropped, and tell ``dropped``."""
        async with open_monitor_socket(sock, int(zmq.EVENT_DISCONNECTED)) as mon:
            while True:
                event = parse_monitor_message([f.bytes for f in await mon.recv_multipart()])
                fd = event["value"]
                now = trio.current_time()
                for state in self.peers.values():
                    if state.fd == fd and state.disconnected_at is None:
                        state.disconnected_at = now
                        dropped(state)

    async def reap(self, timeout: float, gone: Callable[[str], Awaitable[None]]) -> None:
        """Forget peers gone for ``timeout`` s; call ``gone`` for a session left with none."""
        while True:
            await trio.sleep(timeout / 4)
            deadline = trio.current_time() - timeout
            left = [
                p
                for p in self.peers.values()
                if p.disconnected_at is not None and p.disconnected_at < deadline
            ]
            for state in left:
                del self.peers[state.identity]
                if state.session and not self.connected(state.session):
                    await gone(state.session)
