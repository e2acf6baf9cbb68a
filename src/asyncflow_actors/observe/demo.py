"""A scripted four-station pipeline over the TransferQueue, instrumented like the real roles.

``rollout → forward → advantage → train``, no model: rollout workers write GRPO groups of
scripted responses and rewards, ``forward`` asks a :class:`ForwardEngine` actor (in this process or
on a node) for per-token log-probs, ``advantage`` computes group-relative advantages, ``train``
takes batches, records their staleness, bumps the policy version and runs a scripted weight
sync. Stations are actors talking only through the TQ; ``FlowControl`` bounds how far rollout
runs ahead, as in the real pipeline.

It exists to show and test ``observe`` without models (``asyncflow demo``, the dashboard test,
``benchmarks/bench_observe.py``), and it shows how a role emits spans and metrics. Every figure it
produces is determined by its config: with ``staleness=0`` every trained sample has staleness 0.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import attrs
import trio

from ..actors import Actor, ActorContext, ActorCrashed, ActorRef, ActorSystem, Request
from ..actors.remote import Node
from ..transfer_queue import (
    WHOLE_GROUPS,
    FlowControl,
    TopicSpec,
    TransferQueueClient,
    TransferQueueConfig,
    open_transfer_queue,
)
from ._config import GraphEdge
from ._metrics import get_registry
from ._observer import Observer
from ._tracer import Track, clock_ns, get_tracer

TOPIC = "samples"
ROLES = ("rollout", "forward", "advantage", "train")
GRAPH = (
    GraphEdge("rollout", "forward", TOPIC),
    GraphEdge("forward", "advantage", TOPIC),
    GraphEdge("advantage", "train", TOPIC),
)
ENGINE_TARGET = "asyncflow_actors.observe.demo:ForwardEngine"


@attrs.frozen
class DemoConfig:
    """The scripted run: ``groups`` prompts of ``group_size`` responses, trained in batches of
    ``batch_size`` (a multiple of ``group_size`` dividing the total). ``*_delay``: seconds each
    station's compute takes per group / batch (a sleep: the work happens "on an accelerator");
    ``sync``: run a scripted weight sync (``sync_delay`` seconds) after each step."""

    groups: int = 16
    group_size: int = 4
    batch_size: int = 8
    staleness: int = 1
    rollout_workers: int = 2
    rollout_delay: float = 0.0
    forward_delay: float = 0.0
    advantage_delay: float = 0.0
    train_delay: float = 0.0
    sync: bool = True
    sync_delay: float = 0.0

    def __attrs_post_init__(self) -> None:
        total = self.groups * self.group_size
        if self.batch_size % self.group_size or total % self.batch_size:
            raise ValueError(
                f"batch_size {self.batch_size} must be a multiple of group_size "
                f"{self.group_size} and divide groups * group_size = {total}"
            )

    @property
    def total(self) -> int:
        return self.groups * self.group_size


@attrs.frozen
class DemoResult:
    samples: int
    steps: int
    seconds: float

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else math.inf


@attrs.frozen
class Logprobs:
    values: tuple[tuple[float, ...], ...]


@attrs.frozen
class ComputeLogprobs(Request[Logprobs]):
    samples: tuple[int, ...]
    responses: tuple[tuple[int, ...], ...]
    version: int


class ForwardEngine(Actor[ComputeLogprobs]):
    """The forward pass, as a separate actor (on a node, its spans come from that process)."""

    def __init__(self, worker: str = "engine-0", delay: float = 0.0) -> None:
        self.track = get_tracer().track("forward", worker)
        self.delay = delay

    async def receive(self, msg: ComputeLogprobs, ctx: ActorContext[ComputeLogprobs]) -> Logprobs:
        with self.track.span("forward.compute", samples=msg.samples, version=msg.version):
            if self.delay:
                await trio.sleep(self.delay)
            return Logprobs(tuple(tuple(-0.01 * (t % 97) for t in r) for r in msg.responses))


def response_of(group: int, member: int) -> list[int]:
    """The scripted response of a group member (its length varies from 4 to 8 tokens)."""
    return [group * 7 + member + k for k in range(4 + (group + member) % 5)]


def reward_of(member: int) -> float:
    """Half of each group is right: every group's (and so every batch's) mean reward is 0.5."""
    return float(member % 2)


class _Run:
    """What the stations share: the policy version, the group counter, and completion."""

    def __init__(self, config: DemoConfig) -> None:
        self.config = config
        self.version = 0
        self.next_group = 0
        self.trained = 0
        self.steps = 0
        self.done = trio.Event()
        self.error: BaseException | None = None


class _Station(Actor[Any]):
    """An actor whose helper task runs one station's fetch → compute → write-back loop."""

    def __init__(self, run: _Run, body: Callable[[], Awaitable[None]]) -> None:
        self.run = run
        self.body = body

    async def on_start(self, ctx: ActorContext[Any]) -> None:
        ctx.start_soon(self._loop)

    async def _loop(self) -> None:
        try:
            await self.body()
        except Exception as exc:
            self.run.error = exc
            self.run.done.set()
            raise

    async def receive(self, msg: Any, ctx: ActorContext[Any]) -> None:
        return None


class _Worker:
    """A station worker's span track and metric handles (what a real role holds)."""

    def __init__(self, role: str, worker: str) -> None:
        registry = get_registry()
        self.track: Track = get_tracer().track(role, worker)
        self.samples = registry.counter("afa_role_samples_total", role=role, worker=worker)
        self.tokens = registry.counter("afa_role_tokens_total", role=role, worker=worker)
        self.steps = registry.counter("afa_role_steps_total", role=role, worker=worker)
        self.busy = registry.counter("afa_role_busy_seconds_total", role=role, worker=worker)
        self.version = registry.gauge("afa_policy_version", role=role, worker=worker)
        self._waits = {
            op: registry.counter("afa_role_wait_seconds_total", role=role, worker=worker, op=op)
            for op in ("get", "put", "acquire")
        }

    def waited(self, op: str, name: str, start: int, **span: Any) -> None:
        """Account a wait that began at ``start`` (``clock_ns``) as a span and in the metrics."""
        end = clock_ns()
        self._waits[op].inc((end - start) / 1e9)
        tracer = self.track.tracer
        tracer.record(
            name, role=self.track.role, worker=self.track.worker, start_ns=start, end_ns=end, **span
        )


async def _rollout(run: _Run, client: TransferQueueClient, flow: FlowControl, worker: str) -> None:
    import torch

    cfg, w = run.config, _Worker("rollout", worker)
    n = cfg.group_size
    while run.next_group < cfg.groups:
        group = run.next_group
        run.next_group += 1
        start = clock_ns()
        await flow.acquire(n)
        w.waited("acquire", "flow.acquire", start, group=group)
        version = run.version
        w.version.set(version)
        with w.track.span("rollout", group=group, version=version) as span:
            busy = clock_ns()
            prompt = torch.tensor([group, group + 1, group + 2])
            responses = [torch.tensor(response_of(group, j)) for j in range(n)]
            rewards = torch.tensor([reward_of(j) for j in range(n)], dtype=torch.float32)
            if cfg.rollout_delay:
                await trio.sleep(cfg.rollout_delay)
            w.busy.inc((clock_ns() - busy) / 1e9)
            start = clock_ns()
            slot = await client.open_group(TOPIC, n, shared={"prompt": prompt})
            indexes = await client.put(
                TOPIC, {"response": responses, "reward": rewards}, version=version, group=slot
            )
            w.waited("put", "tq.put", start, samples=indexes)
            span.set(samples=indexes, tq_group=slot.group_id)
        w.samples.inc(n)
        w.tokens.inc(sum(len(r) for r in responses))


async def _forward(
    run: _Run, client: TransferQueueClient, engine: ActorRef[ComputeLogprobs], worker: str
) -> None:
    import torch

    w = _Worker("forward", worker)
    while True:
        start = clock_ns()
        batch = await client.get(TOPIC, "forward", ["response"], run.config.batch_size)
        assert batch is not None
        w.waited("get", "tq.get", start, samples=batch.indexes)
        version = min(batch.versions)
        with w.track.span("forward", samples=batch.indexes, version=version):
            busy = clock_ns()
            responses = tuple(tuple(int(t) for t in r.tolist()) for r in batch["response"])
            got = await engine.ask(ComputeLogprobs(batch.indexes, responses, version))
            logprobs = [torch.tensor(v, dtype=torch.float32) for v in got.values]
            w.busy.inc((clock_ns() - busy) / 1e9)
            await client.put_columns(batch, {"old_logprob": logprobs})
        await client.ack(batch)
        w.samples.inc(len(batch))
        w.tokens.inc(sum(len(r) for r in responses))
        w.steps.inc()


async def _advantage(run: _Run, client: TransferQueueClient, worker: str) -> None:
    import torch

    cfg, w = run.config, _Worker("advantage", worker)
    while True:
        start = clock_ns()
        batch = await client.get(
            TOPIC, "advantage", ["reward", "old_logprob"], cfg.batch_size, sampler=WHOLE_GROUPS
        )
        assert batch is not None
        w.waited("get", "tq.get", start, samples=batch.indexes)
        with w.track.span("advantage", samples=batch.indexes, version=min(batch.versions)):
            busy = clock_ns()
            rewards = batch["reward"]
            groups = torch.tensor(batch.group_ids)
            means = {int(g): float(rewards[groups == g].mean()) for g in set(batch.group_ids)}
            advantages = rewards - torch.tensor([means[int(g)] for g in batch.group_ids])
            if cfg.advantage_delay:
                await trio.sleep(cfg.advantage_delay)
            w.busy.inc((clock_ns() - busy) / 1e9)
            await client.put_columns(batch, {"advantage": advantages})
        await client.ack(batch)
        w.samples.inc(len(batch))
        w.steps.inc()


async def _train(run: _Run, client: TransferQueueClient, flow: FlowControl, worker: str) -> None:
    cfg, w = run.config, _Worker("train", worker)
    registry = get_registry()
    staleness = registry.histogram("afa_train_staleness_versions")
    reward = registry.gauge("afa_reward_mean", role="train")
    while True:
        start = clock_ns()
        batch = await client.get(TOPIC, "train", ["advantage", "reward"], cfg.batch_size)
        assert batch is not None
        w.waited("get", "tq.get", start, samples=batch.indexes)
        with w.track.span("train", samples=batch.indexes, version=run.version):
            busy = clock_ns()
            staleness.observe_many(run.version - v for v in batch.versions)
            reward.set(float(batch["reward"].mean()))
            if cfg.train_delay:
                await trio.sleep(cfg.train_delay)
            w.busy.inc((clock_ns() - busy) / 1e9)
        await client.ack(batch)
        run.version += 1
        w.version.set(run.version)
        await client.set_version(TOPIC, run.version)
        if cfg.sync:
            await _scripted_sync(w.track, run.version, cfg.sync_delay)
        flow.release(len(batch))
        w.samples.inc(len(batch))
        w.steps.inc()
        run.trained += len(batch)
        run.steps += 1
        if run.trained >= cfg.total:
            run.done.set()


async def _scripted_sync(track: Track, version: int, delay: float) -> None:
    """A weight sync's spans and metrics, as the checkpoint layer will record them."""
    registry = get_registry()
    seconds: dict[str, float] = {}
    begin = clock_ns()
    for phase in ("pause", "broadcast", "resume"):
        start = clock_ns()
        with track.span(f"sync.{phase}", version=version):
            if delay:
                await trio.sleep(delay / 3)
        seconds[phase] = (clock_ns() - start) / 1e9
    seconds["total"] = (clock_ns() - begin) / 1e9
    for phase, value in seconds.items():
        registry.histogram("afa_sync_duration_seconds", phase=phase).observe(value)
        registry.gauge("afa_sync_last_seconds", phase=phase).set(value)
    registry.gauge("afa_sync_last_version").set(version)
    registry.gauge("afa_sync_last_bytes").set(0)
    registry.counter("afa_sync_total").inc()


def topic_spec(config: DemoConfig) -> TopicSpec:
    return TopicSpec.from_dict(
        {
            "consumers": ["forward", "advantage", "train"],
            "staleness": config.staleness,
            "columns": {
                "prompt": {"dtype": "int64", "shape": [3], "shared": True},
                "response": {"dtype": "int64", "shape": [None]},
                "reward": {"dtype": "float32", "shape": []},
                "old_logprob": {"dtype": "float32", "shape": [None]},
                "advantage": {"dtype": "float32", "shape": []},
            },
        },
        name=TOPIC,
    )


async def run_demo(
    system: ActorSystem,
    config: DemoConfig | None = None,
    *,
    observer: Observer | None = None,
    engine_node: Node | None = None,
) -> DemoResult:
    """Run the scripted pipeline once under ``system``; returns samples, steps and duration.

    With ``observer``, the TQ and the FlowControl are watched. With ``engine_node`` (whose
    ``allow`` includes ``asyncflow_actors.observe``), the forward engine runs on that node.
    Raises what a station raised.
    """
    cfg = config if config is not None else DemoConfig()
    # The stations build tensors. Importing torch takes seconds on a busy machine: do it in a
    # worker thread, so this process's event loop (node heartbeats, the dashboard) keeps going.
    await trio.to_thread.run_sync(importlib.import_module, "torch")
    run = _Run(cfg)
    flow = FlowControl(cfg.staleness, cfg.batch_size)
    tq_config = TransferQueueConfig(topics=(topic_spec(cfg),), units=1, name="demo-tq")
    async with open_transfer_queue(system, tq_config) as queue:
        client = await queue.client("demo")
        if observer is not None:
            observer.watch_transfer_queue(client)
            observer.watch_flow_control(flow, name="rollout")
        engine: ActorRef[ComputeLogprobs]
        if engine_node is not None:
            engine = await engine_node.spawn(
                ENGINE_TARGET,
                name="forward-engine",
                kwargs={"worker": "engine-0", "delay": cfg.forward_delay},
            )
        else:
            engine = await system.spawn(
                partial(ForwardEngine, "engine-0", cfg.forward_delay), name="forward-engine"
            )
        bodies: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            ("train-0", lambda: _train(run, client, flow, "train-0")),
            ("advantage-0", lambda: _advantage(run, client, "advantage-0")),
            ("forward-0", lambda: _forward(run, client, engine, "forward-0")),
        ]
        for i in range(cfg.rollout_workers):
            bodies.append((f"rollout-{i}", partial(_rollout, run, client, flow, f"rollout-{i}")))
        stations: list[ActorRef[Any]] = []
        start = trio.current_time()
        try:
            for name, body in bodies:
                stations.append(
                    await system.spawn(partial(_Station, run, body), name=f"demo-{name}")
                )
            await run.done.wait()
            seconds = trio.current_time() - start
            if observer is not None:
                await observer.collect()  # the queue's final figures, while it still runs
        finally:
            with trio.CancelScope(shield=True):
                if observer is not None:
                    observer.unwatch_transfer_queue(client)
                    observer.unwatch_flow_control(flow)
                for ref in [*reversed(stations), engine]:
                    try:
                        await ref.stop()
                    except ActorCrashed:  # a station that crashed is gone already
                        pass
                await client.aclose()
        if run.error is not None:
            raise run.error
        return DemoResult(run.trained, run.steps, seconds)
