"""``open_observer``: collect spans and metrics from every process of a run, export them.

The observer lives in the driver. Every ``interval`` it:

1. polls the sources it watches (TransferQueue clients, FlowControls) into this process's
   registry, and mirrors this process's actor statistics;
2. pulls each attached node's ``ObserveAgent`` (``Collect``: spans since the last pull, a metrics
   snapshot, the node's clock) and estimates the node's clock offset from the round trip;
3. merges the processes' snapshots into one, publishes it on ``feed`` (the dashboard), and hands
   it to the exporters (in a worker thread);
4. keeps the spans for the trace, written as Chrome/Perfetto JSON by ``write_trace`` (and to
   ``run_dir/trace.json`` when it closes).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from ..actors import ActorCrashed, ActorRef, ActorSystem, Restart
from ..actors.remote import Node, WireError
from ..transfer_queue import FlowControl, TransferQueueClient
from ._agent import AGENT_TARGET, Collect, Collected, collect_local
from ._config import ObserveConfig
from ._exporters import Exporter, JsonlExporter, TensorBoardExporter
from ._feed import SnapshotFeed
from ._metrics import MetricsSnapshot, get_registry, merge_snapshots
from ._sources import record_flow_control, record_transfer_queue
from ._trace_json import CounterPoint, SpanChunk, chrome_trace
from ._tracer import clock_ns, get_tracer

log = logging.getLogger("asyncflow_actors.observe")

_OFFSET_SAMPLES = 16  # clock-offset estimates kept per process; the lowest round trip wins


@attrs.frozen
class ObserverStatistics:
    """Counts since the observer opened.

    ``spans_dropped``: lost in the processes' own buffers (their ``trace_capacity`` overflowed
    between pulls); ``spans_discarded``: dropped by the observer past ``max_spans``.
    ``clock_error_ns``: per node process, the bound on the error of its clock offset (half the
    fastest pull's round trip): its spans are placed on the trace within that much.
    """

    collections: int
    agents: int
    spans_kept: int
    spans_dropped: int
    spans_discarded: int
    pull_failures: int
    poll_failures: int
    exporter_errors: int
    clock_error_ns: dict[str, int] = attrs.field(factory=dict, hash=False)


class Observer:
    """A running observer (from ``open_observer``): attach nodes and sources, read, export."""

    def __init__(
        self, system: ActorSystem, config: ObserveConfig, exporters: Sequence[Exporter]
    ) -> None:
        self.system = system
        self.config = config
        self.feed = SnapshotFeed(config.graph)
        self.feed.trace = self.trace
        self._exporters = list(exporters)
        self._agents: dict[str, ActorRef[Collect]] = {}
        self._queues: list[TransferQueueClient] = []
        self._flows: list[tuple[str, FlowControl]] = []
        # (process token, process name, spans): placed on the trace with the process's best
        # clock-offset estimate when the trace is built, so every span of a process carries the
        # error bound ``statistics().clock_error_ns`` reports, not that of its own pull
        self._chunks: collections.deque[tuple[str, str, Sequence[Any]]] = collections.deque()
        self._best: dict[str, int] = {}  # token -> offset of its fastest kept round trip
        self._span_count = 0
        self._counters: collections.deque[CounterPoint] = collections.deque(maxlen=100_000)
        self._offsets: dict[str, collections.deque[tuple[int, int]]] = {}
        self._latest: dict[str, MetricsSnapshot] = {}  # per process incarnation (token)
        self._token_of: dict[str, str] = {}  # agent label -> its process's current token
        self._retired: list[MetricsSnapshot] = []
        self._dropped: dict[str, int] = {}
        self._names: dict[str, str] = {}  # token -> process label
        self._lock = trio.Lock()
        self._collections = self._pull_failures = self._poll_failures = 0
        self._exporter_errors = self._discarded = 0

    # ------------------------------------------------------------------ what to observe

    async def attach_node(self, node: Node, *, name: str | None = None) -> ActorRef[Collect]:
        """Spawn an ``ObserveAgent`` on ``node`` (its ``allow`` must include
        ``asyncflow_actors.observe``); its spans and metrics are labelled ``name`` (default: the
        node's name). The agent is respawned with the node if the node restarts. Raises
        ``SpawnRefused`` (not allowed there), or ``trio.TooSlowError`` past ``collect_timeout``."""
        label = name or node.name
        with trio.fail_after(self.config.collect_timeout):
            ref: ActorRef[Collect] = await node.spawn(
                AGENT_TARGET,
                name="observe-agent",
                kwargs={
                    "process_name": label,
                    "trace": self.config.trace,
                    "capacity": self.config.trace_capacity,
                },
                restart=Restart.PERMANENT,
            )
        self.attach(ref, name=label)
        return ref

    def attach(self, agent: ActorRef[Collect], *, name: str) -> None:
        """Pull an agent started some other way (e.g. under your own supervisor)."""
        if name in self._agents:
            raise ValueError(f"an agent named {name!r} is already attached")
        self._agents[name] = agent

    def watch_transfer_queue(self, client: TransferQueueClient) -> None:
        """Poll ``client.statistics()`` each interval into the ``afa_tq_*`` metrics."""
        self._queues.append(client)

    def unwatch_transfer_queue(self, client: TransferQueueClient) -> None:
        """Stop polling ``client`` (before its queue closes); its last values stay."""
        self._queues = [c for c in self._queues if c is not client]

    def watch_flow_control(self, flow: FlowControl, *, name: str = "flow") -> None:
        """Poll ``flow.statistics()`` each interval into the ``afa_flow_*`` metrics."""
        self._flows.append((name, flow))

    def unwatch_flow_control(self, flow: FlowControl) -> None:
        self._flows = [(n, f) for n, f in self._flows if f is not flow]

    # ------------------------------------------------------------------ collecting

    async def collect(self) -> MetricsSnapshot:
        """Collect now (the observer also does every ``interval``); returns the merged snapshot."""
        async with self._lock:
            registry = get_registry()
            for client in self._queues:
                try:
                    with trio.fail_after(self.config.collect_timeout):
                        record_transfer_queue(registry, await client.statistics())
                except (ActorCrashed, trio.TooSlowError) as exc:
                    self._poll_failures += 1
                    log.warning("observe: TransferQueue statistics unavailable: %r", exc)
            for name, flow in self._flows:
                record_flow_control(registry, flow.statistics(), name)
            cap = self.config.trace_capacity
            self._accept("", collect_local(self.config.process_name, self.system.statistics(), cap))
            async with trio.open_nursery() as nursery:
                for label, ref in list(self._agents.items()):
                    nursery.start_soon(self._pull, label, ref)
            snapshot = merge_snapshots([*self._latest.values(), *self._retired], at=time.time())
            self._note_counters(snapshot)
            self._collections += 1
            self.feed.publish(snapshot)
            for exporter in self._exporters:
                try:
                    await trio.to_thread.run_sync(exporter.export, snapshot)
                except Exception:
                    self._exporter_errors += 1
                    log.exception("observe: exporter %r failed", exporter)
            return snapshot

    async def _pull(self, label: str, ref: ActorRef[Collect]) -> None:
        start = clock_ns()
        try:
            # Shielded (bounded by collect_timeout): the agent hands its spans over as it
            # answers, so an answer cancelled in flight (the observer closing mid-pull) would
            # lose them for good.
            with trio.CancelScope(shield=True), trio.fail_after(self.config.collect_timeout):
                got = await ref.ask(Collect(self.config.trace_capacity))
        except (ActorCrashed, trio.TooSlowError, WireError) as exc:
            # WireError: the node could not encode its answer (a span argument that is not
            # plain data); those spans are lost, the next pull starts afresh.
            self._pull_failures += 1
            log.warning("observe: agent %r did not answer: %r", label, exc)
            return
        end = clock_ns()
        # NTP-style: the agent read its clock about halfway through the round trip.
        estimates = self._offsets.setdefault(
            got.process.token, collections.deque(maxlen=_OFFSET_SAMPLES)
        )
        estimates.append((end - start, got.now_ns - (start + end) // 2))
        self._names[got.process.token] = got.process.name
        self._best[got.process.token] = min(estimates)[1]
        self._accept(label, got)

    def _accept(self, label: str, got: Collected) -> None:
        token = got.process.token
        if got.spans:
            self._chunks.append((token, got.process.name, got.spans))
            self._span_count += len(got.spans)
            while self._span_count > self.config.max_spans and len(self._chunks) > 1:
                dropped = self._chunks.popleft()
                self._span_count -= len(dropped[2])
                self._discarded += len(dropped[2])
        self._dropped[token] = got.dropped
        previous = self._token_of.get(label)
        if previous is not None and previous != token and previous in self._latest:
            # The process restarted: keep what its counters had reached, forget its gauges.
            old = self._latest.pop(previous)
            kept = tuple(s for s in old.series if old.info(s.name).kind != "gauge")
            self._retired.append(MetricsSnapshot(old.time, kept, old.declared))
        self._token_of[label] = token
        self._latest[token] = got.metrics

    def _note_counters(self, snapshot: MetricsSnapshot) -> None:
        now = clock_ns()
        depths: dict[str, dict[str, float]] = {}
        for s in snapshot.select("afa_tq_ready_samples"):
            depths.setdefault(s.label("topic") or "", {})[s.label("consumer") or ""] = s.value
        for topic, values in sorted(depths.items()):
            self._counters.append((now, f"ready samples [{topic}]", values))
        for s in snapshot.select("afa_flow_in_flight_slots"):
            self._counters.append((now, f"in flight [{s.label('flow')}]", {"slots": s.value}))

    # ------------------------------------------------------------------ reading

    def statistics(self) -> ObserverStatistics:
        return ObserverStatistics(
            collections=self._collections,
            agents=len(self._agents),
            spans_kept=self._span_count,
            spans_dropped=sum(self._dropped.values()),
            spans_discarded=self._discarded,
            pull_failures=self._pull_failures,
            poll_failures=self._poll_failures,
            exporter_errors=self._exporter_errors,
            clock_error_ns={
                self._names[token]: min(estimates)[0] // 2
                for token, estimates in self._offsets.items()
            },
        )

    def _placed(self) -> list[SpanChunk]:
        """The span chunks so far, each with its process's current best clock offset (copies
        of a deque and a dict run in C under the GIL: safe from a worker thread)."""
        chunks, best = list(self._chunks), dict(self._best)
        return [(name, best.get(token, 0), spans) for token, name, spans in chunks]

    def trace(self, last: float | None = None) -> dict[str, Any]:
        """The trace of the spans collected so far (Chrome trace-event JSON object), or of
        those that ended in the ``last`` seconds. Safe to call from a worker thread."""
        # Copying a deque of tuples runs in C under the GIL: atomic against the event loop.
        chunks = self._placed()
        counters = list(self._counters)
        if last is not None:
            cutoff = clock_ns() - int(last * 1e9)
            horizon = cutoff - int(2e9 * self.config.interval)  # chunks are at most this stale
            recent: list[SpanChunk] = []
            for process, offset, records in reversed(chunks):
                kept = [r for r in records if r[4] - offset >= cutoff]
                if kept:
                    recent.append((process, offset, kept))
                elif all(r[4] - offset < horizon for r in records):
                    break  # chunks arrive in collection order: the older ones are older still
            chunks = recent[::-1]
            counters = [c for c in counters if c[0] >= cutoff]
        return chrome_trace(
            chunks,
            counters=counters,
            role_order=self.config.role_order(),
            max_flows=self.config.max_flows,
            metadata={
                "spans_dropped": sum(self._dropped.values()),
                "spans_discarded": self._discarded,
            },
        )

    async def write_trace(self, path: str | os.PathLike[str]) -> None:
        """Write the trace so far to ``path`` (built and written in a worker thread)."""
        chunks, counters = self._placed(), list(self._counters)
        order, flows = self.config.role_order(), self.config.max_flows

        def build_and_write() -> None:
            trace = chrome_trace(chunks, counters=counters, role_order=order, max_flows=flows)
            with open(path, "w", encoding="utf-8") as f:
                json.dump(trace, f, separators=(",", ":"))

        await trio.to_thread.run_sync(build_and_write)

    async def finish(self) -> None:
        """The last pull from every attached agent, then stop them: call it before the nodes
        stop (a run stops its roles, calls this, then stops its nodes), or their last spans and
        metrics are lost. Bounded by ``2 * collect_timeout`` (a pull that does not answer by
        then is counted in ``pull_failures``); shielded; later collections pull this process
        only. Closing the observer still writes the trace."""
        with trio.CancelScope(shield=True):
            try:
                with trio.move_on_after(self.config.collect_timeout * 2):
                    await self.collect()
            finally:
                await self._stop_agents()

    async def _stop_agents(self) -> None:
        async with self._lock:  # not while a collection pulls them
            agents, self._agents = self._agents, {}

        async def stop(label: str, ref: ActorRef[Collect]) -> None:
            with trio.move_on_after(self.config.collect_timeout):
                try:
                    await ref.stop()
                except ActorCrashed as exc:
                    log.debug("observe: agent %r already gone: %r", label, exc)

        async with trio.open_nursery() as nursery:
            for label, ref in agents.items():
                nursery.start_soon(stop, label, ref)

    async def _run(self) -> None:
        while True:
            await trio.sleep(self.config.interval)
            await self.collect()

    async def _close(self) -> None:
        """The last collection, the trace file, then stop the agents and exporters."""
        try:
            with trio.move_on_after(self.config.collect_timeout * 2):
                await self.collect()
            if self.config.run_dir is not None and self.config.trace:
                await self.write_trace(os.path.join(self.config.run_dir, "trace.json"))
        finally:
            await self._stop_agents()
            for exporter in self._exporters:
                try:
                    exporter.close()
                except Exception:
                    log.exception("observe: closing exporter %r failed", exporter)


def _file_exporters(config: ObserveConfig) -> list[Exporter]:
    """Create ``run_dir`` with ``observe.json`` (what ``asyncflow dashboard`` reads besides the
    metrics) and the file exporters the config asks for."""
    assert config.run_dir is not None
    os.makedirs(config.run_dir, exist_ok=True)
    meta = {"graph": [attrs.asdict(e) for e in config.graph], "interval": config.interval}
    with open(os.path.join(config.run_dir, "observe.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f)
    out: list[Exporter] = []
    try:
        if config.tensorboard:
            out.append(TensorBoardExporter(os.path.join(config.run_dir, "tensorboard")))
        if config.jsonl:
            out.append(JsonlExporter(os.path.join(config.run_dir, "metrics.jsonl")))
    except BaseException:
        for exporter in out:
            exporter.close()
        raise
    return out


@asynccontextmanager
async def open_observer(
    system: ActorSystem,
    config: ObserveConfig | None = None,
    *,
    exporters: Sequence[Exporter] = (),
) -> AsyncIterator[Observer]:
    """Observe ``system``'s process (and the nodes you attach) while the block runs.

    Tracing is on in this process while the block runs (``config.trace``). Leaving the block
    collects once more, writes ``run_dir/trace.json``, stops the agents and closes the
    exporters — also when the block raises or is cancelled (bounded by ``collect_timeout``).
    """
    config = config if config is not None else ObserveConfig()
    chosen = list(exporters)
    if config.run_dir is not None:
        chosen = await trio.to_thread.run_sync(_file_exporters, config) + chosen
    observer = Observer(system, config, chosen)
    tracer = get_tracer()
    if config.trace:
        tracer.enable(config.trace_capacity)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(observer._run)
            try:
                yield observer
            finally:
                nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            try:
                await observer._close()
            finally:
                if config.trace:
                    tracer.disable()
