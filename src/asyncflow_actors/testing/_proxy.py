"""A fault-injecting proxy for links between actor systems: drop, delay, duplicate, partition.

``open_link_proxy(node_address)`` listens on a tcp address of its own and relays the bytes of
every connection made to it to the node behind it (one upstream connection per connection, so
the node sees each peer as usual). It reads the ZMTP stream it relays (``_zmtp``) in whole
units, so rules can act on messages, by their envelope's kind and target, without breaking the
stream. Connect through it with ``system.connect_node(proxy.address, name=...)``, or route the
links a system opens by itself through it (``route_through``, ``RouteLinks``)::

    async with open_node_process(allow=["mypkg"]) as node_proc, \\
            open_link_proxy(node_proc.address, seed=3) as proxy:
        node = await system.connect_node(proxy.address, name="n")
        proxy.add_rule(LinkRule("drop", kinds={"tell"}, count=1))     # lose the next tell
        proxy.add_rule(LinkRule("delay", seconds=0.2, direction=Direction.TO_PEER))
        proxy.partition(3.0)                                           # silence for 3 s

A partition is silence at the transport level, as a real one is: no byte crosses either way,
ZMTP heartbeats included, while the TCP connections stay open. Each side's libzmq then finds
its pings unanswered and drops the connection once its heartbeat timeout passes (the side with
the shorter timeout first); the other side learns of it when the partition heals, as it would
when the FIN finally arrives. A link whose timeouts outlast the partition rides it out.
``hold=True``: what was sent meanwhile arrives, in order, when it heals (TCP's buffers hold it).
Otherwise the messages and heartbeats sent meanwhile are lost, the connection not.

Delays keep each direction of each connection in order (like TCP, a delayed message holds back
the ones after it). Drops and duplicates are what TCP never does but a reconnecting link, a
restarted peer or a buggy retry may, so protocols that must survive them can be tested against
them. Random choices come from ``seed``.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import itertools
import math
import random
import socket
from collections import deque
from collections.abc import AsyncIterator, Iterable
from typing import Literal

import attrs
import msgspec
import trio

from ._zmtp import HEARTBEATS, Unit, ZmtpReader

_CHUNK = 64 * 1024  # bytes written between two looks at the partition
_LANE_BYTES = 4 * 1024 * 1024  # what one direction buffers before it stops reading (backpressure)


class Direction(enum.Enum):
    """Which way a message travels through the proxy."""

    TO_NODE = "to_node"  # from the connecting system to the one it connects to
    TO_PEER = "to_peer"  # back from there to the connecting system


@attrs.frozen
class LinkMessage:
    """What a rule sees of one message: its direction, envelope kind and target, its size.

    ``kind`` is the envelope's kind (``"tell"``, ``"ask"``, ``"ok"``, ``"err"``, ``"credit"``,
    ``"spawn"``, ``"hello"``... see ``docs/remote.md``), ``None`` if the header could not be
    read (an encrypted CURVE link). ``seq`` counts the messages of this direction and connection
    from 1.
    """

    direction: Direction
    kind: str | None
    target: str | None
    seq: int
    nbytes: int


def _kinds(value: Iterable[str] | None) -> frozenset[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return frozenset({value})
    return frozenset(value)


@attrs.frozen
class LinkRule:
    """One fault: ``action`` on the messages it matches.

    Matching: ``direction`` (``None``: both), ``kinds`` (``None``: every message), ``target``
    (the actor name, ``None``: any). Rules act on messages only; ZMTP commands (the handshake,
    the heartbeats) pass, only a partition stops them. A matching message is acted on with
    ``probability``, at most ``count`` times (``None``: no limit). ``delay`` holds it ``seconds``
    (plus up to ``jitter``) before it goes on; ``duplicate`` sends it twice. Rules are tried in
    the order they were added; the first that acts wins.
    """

    action: Literal["drop", "delay", "duplicate"]
    direction: Direction | None = None
    kinds: frozenset[str] | None = attrs.field(default=None, converter=_kinds)
    target: str | None = None
    probability: float = attrs.field(
        default=1.0, validator=[attrs.validators.ge(0), attrs.validators.le(1)]
    )
    count: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.ge(1))
    )
    seconds: float = attrs.field(default=0.0, validator=attrs.validators.ge(0))
    jitter: float = attrs.field(default=0.0, validator=attrs.validators.ge(0))

    def __attrs_post_init__(self) -> None:
        if self.action not in ("drop", "delay", "duplicate"):
            raise ValueError(f"action must be 'drop', 'delay' or 'duplicate', got {self.action!r}")

    def matches(self, msg: LinkMessage) -> bool:
        return (
            (self.direction is None or msg.direction is self.direction)
            and (self.kinds is None or msg.kind in self.kinds)
            and (self.target is None or msg.target == self.target)
        )


Outcome = Literal["forwarded", "dropped", "delayed", "duplicated", "held"]


@attrs.frozen
class LinkProxyStatistics:
    """Counts since the proxy opened; messages only, except ``heartbeats_dropped``."""

    peers: int  # connections accepted
    connections: int  # connections open now
    to_node: int  # messages received from connecting systems
    to_peer: int  # messages received from the systems behind the proxy
    dropped: int
    delayed: int
    duplicated: int
    held: int  # held back by a partition, then delivered
    heartbeats_dropped: int  # ZMTP PING/PONG lost in a partition


_HEADER = msgspec.msgpack.Decoder(ext_hook=lambda code, data: None)


def _peek(header: bytes) -> tuple[str | None, str | None]:
    """The envelope's kind and target (the header is ``[version, meta, body, n]``)."""
    try:
        meta = _HEADER.decode(header)[1]
        kind, target = meta.get("k"), meta.get("t")
    except Exception:
        return None, None
    return (
        kind if isinstance(kind, str) else None,
        target if isinstance(target, str) else None,
    )


def _host_port(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not endpoint.startswith("tcp://") or not host or not (port == "*" or port.isdigit()):
        raise ValueError(f"expected tcp://HOST:PORT (PORT may be *), got {endpoint!r}")
    return host.strip("[]"), 0 if port == "*" else int(port)


def _check_upstream(endpoint: str) -> None:
    if endpoint.startswith("tcp://"):
        _host_port(endpoint)
    elif not endpoint.startswith("ipc://"):
        raise ValueError(
            f"the link proxy relays tcp:// and ipc:// endpoints, not {endpoint!r} "
            "(an inproc:// link never leaves its process: there is no transport to cut)"
        )


async def _connect(endpoint: str) -> trio.SocketStream:
    if endpoint.startswith("ipc://"):
        return await trio.open_unix_socket(endpoint.removeprefix("ipc://"))
    host, port = _host_port(endpoint)
    return await trio.open_tcp_stream(host, port)


@attrs.define(eq=False)
class _Active:
    rule: LinkRule
    left: int | None  # times it may still act (None: no limit)


@attrs.define(eq=False)
class _Item:
    unit: Unit | None  # None: the sender closed its end (passed on in order, like a FIN)
    release_at: float
    copies: int = 1


@attrs.define(eq=False)
class _Relay:
    upstream: str
    address: str
    listener: trio.SocketListener


class _Lane:
    """One direction of one connection: units read, decided on, queued, written in order."""

    def __init__(self, proxy: LinkProxy, direction: Direction, scope: trio.CancelScope) -> None:
        self.proxy = proxy
        self.direction = direction
        self.scope = scope  # the connection's: cancelled once a close has been passed on
        self.send, self.recv = trio.open_memory_channel[_Item](math.inf)
        self.last_release = -math.inf
        self.seq = itertools.count(1)
        self.queued = 0
        self._space = trio.lowlevel.ParkingLot()

    def put(self, item: _Item) -> None:
        item.release_at = max(item.release_at, self.last_release)  # never overtake
        self.last_release = item.release_at
        if item.unit is not None:
            self.queued += item.unit.nbytes * item.copies
        self.send.send_nowait(item)

    async def read(self, stream: trio.SocketStream) -> None:
        reader = ZmtpReader(stream)
        while True:
            try:
                unit = await reader.next()
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                unit = None
            if unit is None:
                self.put(_Item(None, trio.current_time()))
                return
            self.proxy._decide(self, unit)
            while self.queued > _LANE_BYTES:  # like a full socket buffer: stop reading
                await self._space.park()

    async def write(self, stream: trio.SocketStream) -> None:
        async for item in self.recv:
            await self.proxy._flowing(item.release_at)
            if item.unit is None:
                self.scope.cancel()  # the close goes on: both ends are closed
                return
            try:
                for _ in range(item.copies):
                    for part in item.unit.parts:
                        view = memoryview(part)
                        for offset in range(0, len(view), _CHUNK):
                            await self.proxy._flowing()  # a partition stops even a large message
                            await stream.send_all(view[offset : offset + _CHUNK])
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                return  # that end is gone; its own reader passes the close on
            self.queued -= item.unit.nbytes * item.copies
            if self.queued <= _LANE_BYTES:
                self._space.unpark_all()


class LinkProxy:
    """The running proxy (from ``open_link_proxy``): its addresses, rules and partition."""

    def __init__(self, host: str, seed: int, history: int, nursery: trio.Nursery) -> None:
        self._host = host
        self._nursery = nursery
        self._relays: dict[str, _Relay] = {}
        self._default: _Relay | None = None
        self._closed = False
        self._rules: list[_Active] = []
        self._random = random.Random(seed)
        self._partition_end = -math.inf
        self._partition_hold = False
        self._changed = trio.Event()
        self._counts = dict.fromkeys(
            ("to_node", "to_peer", "dropped", "delayed", "duplicated", "held"), 0
        )
        self._heartbeats_dropped = 0
        self._peers = 0
        self._connections = 0
        self.history: deque[tuple[LinkMessage, Outcome]] = deque(maxlen=history)
        """The latest decisions on messages, oldest first (``history`` of ``open_link_proxy``)."""

    # -- addresses --------------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """Where to connect to reach the upstream given to ``open_link_proxy``."""
        if self._default is None:
            raise RuntimeError("this proxy was opened without an upstream: use relay(endpoint)")
        return self._default.address

    @property
    def upstream(self) -> str:
        """The upstream given to ``open_link_proxy``."""
        if self._default is None:
            raise RuntimeError("this proxy was opened without an upstream")
        return self._default.upstream

    def relay(self, upstream: str) -> str:
        """The proxy's address for ``upstream`` (``tcp://`` or ``ipc://``), listening from now on.

        The same upstream always gets the same address. Rules, partitions and statistics are
        the proxy's, shared by all its addresses. Synchronous, so a ``Mesh.route`` hook may call
        it (``route_through``).
        """
        relay = self._relays.get(upstream)
        return relay.address if relay is not None else self._listen(upstream, 0).address

    def _listen(self, upstream: str, port: int) -> _Relay:
        if self._closed:
            raise RuntimeError(f"the link proxy is closed: cannot relay to {upstream!r}")
        _check_upstream(upstream)
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((self._host, port))
            sock.listen(128)
            bound = sock.getsockname()[1]
            listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
        except BaseException:
            sock.close()
            raise
        host = f"[{self._host}]" if family == socket.AF_INET6 else self._host
        relay = self._relays[upstream] = _Relay(upstream, f"tcp://{host}:{bound}", listener)
        self._nursery.start_soon(self._accept, relay)
        return relay

    # -- control ---------------------------------------------------------------------------------

    def add_rule(self, rule: LinkRule) -> None:
        """Apply ``rule`` from now on (after the rules added before it)."""
        self._rules.append(_Active(rule, rule.count))

    def clear_rules(self) -> None:
        self._rules.clear()

    def partition(self, seconds: float, *, hold: bool = False) -> None:
        """Silence every connection through the proxy, both ways, for ``seconds`` from now
        (``math.inf``: until ``heal``); new connections wait for the end too.

        ``hold=False``: messages and heartbeats sent meanwhile are lost (the connections are
        not). ``hold=True``: they arrive, in order, when the partition ends. Either way the
        heartbeats go unanswered meanwhile: a side whose heartbeat timeout passes drops its
        connection, and the other side sees it dropped when the partition ends.
        """
        if not seconds >= 0:
            raise ValueError(f"partition() takes seconds >= 0, got {seconds!r}")
        self._partition_end = trio.current_time() + seconds
        self._partition_hold = hold
        self._wake()

    def heal(self) -> None:
        """End the partition now; held bytes go on, in order."""
        self._partition_end = -math.inf
        self._wake()

    @property
    def partitioned(self) -> bool:
        return self._partition_end > trio.current_time()

    def statistics(self) -> LinkProxyStatistics:
        return LinkProxyStatistics(
            peers=self._peers,
            connections=self._connections,
            heartbeats_dropped=self._heartbeats_dropped,
            **self._counts,
        )

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _flowing(self, at: float = -math.inf) -> None:
        """Return once it is ``at`` or later and no partition is on."""
        while True:
            wake = max(at, self._partition_end)
            if wake <= trio.current_time():
                return
            with trio.move_on_at(wake):
                await self._changed.wait()

    # -- deciding ----------------------------------------------------------------------------------

    def _decide(self, lane: _Lane, unit: Unit) -> None:
        now = trio.current_time()
        msg: LinkMessage | None = None
        if unit.kind == "message":
            kind, target = _peek(unit.header)
            msg = LinkMessage(lane.direction, kind, target, next(lane.seq), unit.nbytes)
            self._counts[lane.direction.value] += 1
        if self._partition_end > now:
            lossy = msg is not None or unit.name in HEARTBEATS
            if lossy and not self._partition_hold:
                if msg is not None:
                    self._record(msg, "dropped")
                else:
                    self._heartbeats_dropped += 1
                return
            if msg is not None:
                self._record(msg, "held")
            lane.put(_Item(unit, now))  # the handshake is held even by a lossy partition
            return
        if msg is None:
            lane.put(_Item(unit, now))
            return
        delay, copies = 0.0, 1
        outcome: Outcome = "forwarded"
        for active in self._rules:
            rule = active.rule
            if active.left == 0 or not rule.matches(msg):
                continue
            if rule.probability < 1 and self._random.random() >= rule.probability:
                continue
            if active.left is not None:
                active.left -= 1
            if rule.action == "drop":
                self._record(msg, "dropped")
                return
            if rule.action == "duplicate":
                copies, outcome = 2, "duplicated"
            else:
                delay = rule.seconds + (self._random.uniform(0, rule.jitter) if rule.jitter else 0)
                outcome = "delayed"
            break
        self._record(msg, outcome)
        lane.put(_Item(unit, now + delay, copies))

    def _record(self, msg: LinkMessage, outcome: Outcome) -> None:
        if outcome != "forwarded":
            self._counts[outcome] += 1
        self.history.append((msg, outcome))

    # -- relaying ----------------------------------------------------------------------------------

    async def _accept(self, relay: _Relay) -> None:
        await trio.serve_listeners(functools.partial(self._connection, relay), [relay.listener])

    async def _connection(self, relay: _Relay, downstream: trio.SocketStream) -> None:
        self._peers += 1
        self._connections += 1
        upstream: trio.SocketStream | None = None
        try:
            async with trio.open_nursery() as nursery:
                to_node = _Lane(self, Direction.TO_NODE, nursery.cancel_scope)
                to_peer = _Lane(self, Direction.TO_PEER, nursery.cancel_scope)
                nursery.start_soon(to_node.read, downstream)
                try:
                    await self._flowing()  # a partition holds the connect too (SYNs are lost)
                    upstream = await _connect(relay.upstream)
                except OSError:
                    nursery.cancel_scope.cancel()  # refused: the peer's connection closes
                    return
                nursery.start_soon(to_peer.read, upstream)
                nursery.start_soon(to_node.write, upstream)
                nursery.start_soon(to_peer.write, downstream)
        finally:
            self._connections -= 1
            with trio.CancelScope(shield=True):
                await downstream.aclose()
                if upstream is not None:
                    await upstream.aclose()


@contextlib.asynccontextmanager
async def open_link_proxy(
    upstream: str | None = None,
    *,
    bind: str = "tcp://127.0.0.1:*",
    seed: int = 0,
    history: int = 10_000,
) -> AsyncIterator[LinkProxy]:
    """Run a fault-injecting proxy for the block (see the module docstring).

    ``upstream`` (``tcp://`` or ``ipc://``): connect to ``proxy.address`` instead; more
    upstreams get addresses of their own with ``proxy.relay(endpoint)``. ``bind``: the tcp host
    the proxy listens on (and the port of ``proxy.address``; ``*`` picks one). Every socket the
    proxy opened is closed when the block exits, so the connections through it drop. Links
    with CURVE pass (partitions and delays of everything work; rules see no kinds or targets).
    """
    host, port = _host_port(bind)
    async with trio.open_nursery() as nursery:
        proxy = LinkProxy(host, seed, history, nursery)
        try:
            if upstream is not None:
                proxy._default = proxy._listen(upstream, port)
            yield proxy
        finally:
            proxy._closed = True
            nursery.cancel_scope.cancel()
            with trio.CancelScope(shield=True):
                for relay in proxy._relays.values():
                    await relay.listener.aclose()
