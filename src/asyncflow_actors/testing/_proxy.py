"""A fault-injecting proxy for node links: drop, delay, duplicate, partition.

``open_link_proxy(node_address)`` listens on an address of its own and forwards every zmq
message between the systems that connect to it and the node behind it, one upstream connection
per connecting peer, so the node sees each peer as usual. Rules decide, message by message,
whether it is dropped, delayed or duplicated; ``partition(seconds)`` cuts the link both ways for a
while. Connect through it with ``system.connect_node(proxy.address, name=...)``::

    async with open_node_process(allow=["mypkg"]) as node_proc, \\
            open_link_proxy(node_proc.address, seed=3) as proxy:
        node = await system.connect_node(proxy.address, name="n")
        proxy.add_rule(LinkRule("drop", kinds={"tell"}, count=1))     # lose the next tell
        proxy.add_rule(LinkRule("delay", seconds=0.2, direction=Direction.TO_PEER))
        proxy.partition(3.0)                                           # nothing passes for 3 s

The proxy works on frames, not on the runtime's objects: it reads only the envelope of each
message (its kind and target actor, from the wire header) to match rules. Delays keep each
direction of each connection in order (like TCP, a delayed message holds back the ones after it);
drops and duplicates are what TCP never does but a reconnecting link, a restarted peer or a buggy
retry may, so protocols that must survive them can be tested against them. Random choices come
from ``seed``.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import math
import random
from collections import deque
from collections.abc import AsyncIterator, Iterable
from typing import Any, Literal

import attrs
import msgspec
import trio
import zmq

from ..actors.remote import TrioSocket, open_zmq_socket


class Direction(enum.Enum):
    """Which way a message travels through the proxy."""

    TO_NODE = "to_node"  # from a connecting system to the node
    TO_PEER = "to_peer"  # from the node back to the system


@attrs.frozen
class LinkMessage:
    """What a rule sees of one message: its direction, envelope kind and target, its size.

    ``kind`` is the envelope's kind (``"tell"``, ``"ask"``, ``"ok"``, ``"err"``, ``"credit"``,
    ``"ping"``, ``"pong"``, ``"spawn"``, ``"hello"``... see ``docs/remote.md``), ``None`` if the
    header could not be read. ``seq`` counts the messages of this direction and connection from 1.
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

    Matching: ``direction`` (``None``: both), ``kinds`` (``None``: all, heartbeats included),
    ``target`` (the actor name on the node, ``None``: any). A matching message is acted on with
    ``probability``, at most ``count`` times (``None``: no limit). ``delay`` holds it
    ``seconds`` (plus up to ``jitter``) before it goes on; ``duplicate`` sends it twice.
    Rules are tried in the order they were added; the first that acts wins.
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
    peers: int
    to_node: int  # messages received from peers
    to_peer: int  # messages received from the node
    dropped: int
    delayed: int
    duplicated: int
    held: int  # held back by a partition, then delivered


_HEADER = msgspec.msgpack.Decoder(ext_hook=lambda code, data: None)


def _peek(frames: list[zmq.Frame]) -> tuple[str | None, str | None]:
    """The envelope's kind and target (the header is ``[version, meta, body, n]``)."""
    try:
        header = _HEADER.decode(frames[0].buffer)
        meta = header[1]
        kind, target = meta.get("k"), meta.get("t")
    except Exception:
        return None, None
    return (
        kind if isinstance(kind, str) else None,
        target if isinstance(target, str) else None,
    )


@attrs.define(eq=False)
class _Active:
    rule: LinkRule
    left: int | None  # times it may still act (None: no limit)


@attrs.define(eq=False)
class _Item:
    frames: list[Any]
    release_at: float
    held: bool
    copies: int


class _Lane:
    """One direction of one connection: a FIFO of messages, each sent once its time comes."""

    def __init__(self, proxy: LinkProxy, send: Any) -> None:
        self.proxy = proxy
        self.send = send
        self.queue_send, self.queue_recv = trio.open_memory_channel[_Item](math.inf)
        self.last_release = -math.inf
        self.seq = itertools.count(1)

    def put(self, item: _Item) -> None:
        item.release_at = max(item.release_at, self.last_release)  # never overtake
        self.last_release = item.release_at
        self.queue_send.send_nowait(item)

    async def run(self) -> None:
        async for item in self.queue_recv:
            while True:
                wake = item.release_at
                if item.held:
                    wake = max(wake, self.proxy._partition_end)
                if wake <= trio.current_time():
                    break
                with trio.move_on_at(wake):
                    await self.proxy._changed.wait()
            for _ in range(item.copies):
                await self.send(item.frames)


class LinkProxy:
    """The running proxy (from ``open_link_proxy``): its address, its rules, its partition."""

    def __init__(self, upstream: str, address: str, seed: int, history: int) -> None:
        self.upstream = upstream
        self.address = address
        self._rules: list[_Active] = []
        self._random = random.Random(seed)
        self._partition_end = -math.inf
        self._partition_hold = False
        self._changed = trio.Event()
        self._counts = dict.fromkeys(
            ("to_node", "to_peer", "dropped", "delayed", "duplicated", "held"), 0
        )
        self._peers = 0
        self.history: deque[tuple[LinkMessage, Outcome]] = deque(maxlen=history)
        """The latest decisions, oldest first (``history`` of ``open_link_proxy`` long)."""

    # -- control ---------------------------------------------------------------------------------

    def add_rule(self, rule: LinkRule) -> None:
        """Apply ``rule`` from now on (after the rules added before it)."""
        self._rules.append(_Active(rule, rule.count))

    def clear_rules(self) -> None:
        self._rules.clear()

    def partition(self, seconds: float, *, hold: bool = False) -> None:
        """Cut the link both ways for ``seconds`` from now (``math.inf``: until ``heal``).

        ``hold=False``: what is sent meanwhile is lost. ``hold=True``: it is delivered, in
        order, when the partition ends (a stall, as TCP would do for a short outage).
        """
        if not seconds >= 0:
            raise ValueError(f"partition() takes seconds >= 0, got {seconds!r}")
        self._partition_end = trio.current_time() + seconds
        self._partition_hold = hold
        self._wake()

    def heal(self) -> None:
        """End the partition now; held messages go on, in order."""
        self._partition_end = -math.inf
        self._wake()

    @property
    def partitioned(self) -> bool:
        return self._partition_end > trio.current_time()

    def statistics(self) -> LinkProxyStatistics:
        return LinkProxyStatistics(peers=self._peers, **self._counts)

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # -- routing -----------------------------------------------------------------------------------

    def _route(self, lane: _Lane, direction: Direction, frames: list[zmq.Frame]) -> None:
        kind, target = _peek(frames)
        nbytes = sum(len(f.buffer) for f in frames)
        msg = LinkMessage(direction, kind, target, next(lane.seq), nbytes)
        self._counts[direction.value] += 1
        now = trio.current_time()
        if self._partition_end > now:
            if not self._partition_hold:
                self._record(msg, "dropped")
                return
            self._record(msg, "held")
            lane.put(_Item(frames, now, True, 1))
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
        lane.put(_Item(frames, now + delay, False, copies))

    def _record(self, msg: LinkMessage, outcome: Outcome) -> None:
        if outcome != "forwarded":
            self._counts[outcome] += 1
        self.history.append((msg, outcome))

    async def _session(
        self,
        ctx: zmq.Context[Any],
        router: TrioSocket,
        identity: bytes,
        task_status: trio.TaskStatus[_Lane],
    ) -> None:
        async with open_zmq_socket(ctx, zmq.DEALER, connect=self.upstream) as upstream:

            async def to_peer(frames: list[Any]) -> None:
                await router.send_multipart([identity, *frames])

            to_node = _Lane(self, upstream.send_multipart)
            back = _Lane(self, to_peer)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(to_node.run)
                nursery.start_soon(back.run)
                self._peers += 1
                task_status.started(to_node)
                while True:
                    frames = await upstream.recv_multipart()
                    self._route(back, Direction.TO_PEER, frames)

    async def _serve(self, ctx: zmq.Context[Any], router: TrioSocket) -> None:
        lanes: dict[bytes, _Lane] = {}
        async with trio.open_nursery() as nursery:
            while True:
                frames = await router.recv_multipart()
                if len(frames) < 2:
                    continue
                identity = frames[0].bytes
                lane = lanes.get(identity)
                if lane is None:
                    lane = await nursery.start(self._session, ctx, router, identity)
                    lanes[identity] = lane
                self._route(lane, Direction.TO_NODE, frames[1:])


@contextlib.asynccontextmanager
async def open_link_proxy(
    upstream: str,
    *,
    bind: str = "tcp://127.0.0.1:*",
    seed: int = 0,
    history: int = 10_000,
    context: zmq.Context[Any] | None = None,
) -> AsyncIterator[LinkProxy]:
    """Run a fault-injecting proxy in front of the node at ``upstream`` for the block.

    Connect to ``proxy.address`` instead of ``upstream``. Everything the proxy opened (its
    listening socket, one upstream connection per peer) is closed when the block exits. CURVE is
    not proxied: connect without it, on loopback.
    """
    ctx = context if context is not None else zmq.Context.instance()
    async with open_zmq_socket(ctx, zmq.ROUTER, bind=bind, sndhwm=0, rcvhwm=0) as router:
        proxy = LinkProxy(upstream, router.bound_endpoints[0], seed, history)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(proxy._serve, ctx, router)
            try:
                yield proxy
            finally:
                nursery.cancel_scope.cancel()
