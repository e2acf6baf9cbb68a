"""The per-process side of observation: an agent actor that hands over spans and metrics.

Each process of a run buffers its own spans (``get_tracer()``) and metrics (``get_registry()``);
nothing is written to a shared file system. On a node, an :class:`ObserveAgent` (spawned there
by ``Observer.attach_node``) turns tracing on and answers the observer's ``Collect`` with the
spans buffered since the last one, the registry's snapshot (plus the node's runtime statistics)
and its clock reading, from which the observer maps the node's timestamps onto its own clock.

Today the observer pulls (only the driver can reach actors spawned on nodes); once refs travel
inside messages, an agent can as well push to the observer's ref with the same ``Collected``.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import attrs

from ..actors import Actor, ActorContext, Request, SystemStatistics
from ._metrics import MetricsRegistry, MetricsSnapshot, get_registry
from ._tracer import Tracer, clock_ns, get_tracer

AGENT_TARGET = "asyncflow_actors.observe._agent:ObserveAgent"
"""What ``node.spawn`` starts; nodes need ``asyncflow_actors.observe`` in their ``allow`` list."""

_ACTOR_FAMILIES = (
    "afa_actor_mailbox_depth",
    "afa_actor_senders_waiting",
    "afa_actor_processed_total",
    "afa_actor_restarts_total",
    "afa_actor_dead_letters_total",
)


@attrs.frozen
class ProcessInfo:
    """Who answered: the process's label, host, pid, and its registry's token (an incarnation)."""

    name: str
    host: str
    pid: int
    token: str


def process_info(name: str | None, registry: MetricsRegistry) -> ProcessInfo:
    host, pid = socket.gethostname(), os.getpid()
    return ProcessInfo(name or f"{host}:{pid}", host, pid, registry.token)


@attrs.frozen
class Collected:
    """One process's spans since the last collection, its metrics, and its clock reading."""

    process: ProcessInfo
    now_ns: int
    spans: tuple[tuple[Any, ...], ...]
    dropped: int
    metrics: MetricsSnapshot


@attrs.frozen
class Collect(Request[Collected]):
    """Hand over at most ``max_spans`` buffered spans and a metrics snapshot."""

    max_spans: int = 200_000


def record_runtime(
    registry: MetricsRegistry, stats: SystemStatistics, tracer: Tracer, process: str
) -> None:
    """Mirror an actor system's statistics and the tracer's counters into ``registry``."""
    for family in _ACTOR_FAMILIES:
        registry.remove(family, process=process)
    for a in stats.actors:
        if not a.name:
            continue
        registry.gauge("afa_actor_mailbox_depth", process=process, actor=a.name).set(
            a.mailbox_depth
        )
        registry.gauge("afa_actor_senders_waiting", process=process, actor=a.name).set(
            a.senders_waiting
        )
        registry.counter("afa_actor_processed_total", process=process, actor=a.name).set_total(
            a.processed
        )
        registry.counter("afa_actor_restarts_total", process=process, actor=a.name).set_total(
            a.restarts
        )
        registry.counter("afa_actor_dead_letters_total", process=process, actor=a.name).set_total(
            a.dead_letters
        )
    registry.gauge("afa_process_actors", process=process).set(len(stats.actors))
    registry.counter("afa_trace_spans_total", process=process).set_total(tracer.recorded)
    registry.counter("afa_trace_spans_dropped_total", process=process).set_total(tracer.dropped)


def collect_local(name: str | None, system_stats: SystemStatistics, max_spans: int) -> Collected:
    """What this process answers to ``Collect`` (the observer calls it for its own process)."""
    tracer, registry = get_tracer(), get_registry()
    info = process_info(name, registry)
    record_runtime(registry, system_stats, tracer, info.name)
    spans = tuple(tracer.drain(max_spans))
    return Collected(info, clock_ns(), spans, tracer.dropped, registry.snapshot())


class ObserveAgent(Actor[Collect]):
    """Turns tracing on in its process while it runs, and answers ``Collect``.

    ``process_name`` labels the process's spans and runtime metrics (default ``host:pid``);
    ``trace=False`` collects metrics only; ``capacity`` bounds the process's span buffer.
    """

    def __init__(self, process_name: str = "", trace: bool = True, capacity: int = 200_000) -> None:
        self.process_name = process_name or None
        self.trace = trace
        self.capacity = capacity
        self.enabled = False

    async def on_start(self, ctx: ActorContext[Collect]) -> None:
        if self.trace:
            get_tracer().enable(self.capacity)
            self.enabled = True

    async def receive(self, msg: Collect, ctx: ActorContext[Collect]) -> Collected:
        return collect_local(self.process_name, ctx.system.statistics(), msg.max_spans)

    async def on_stop(self, ctx: ActorContext[Collect], error: BaseException | None) -> None:
        if self.enabled:
            get_tracer().disable()
            self.enabled = False
