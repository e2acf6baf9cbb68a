"""The receiver that ``bench_weight_sync`` spawns on node processes (a module nodes can import).

``BenchReceiver`` hosts a ``WeightReceiver`` around ``ModelTarget`` (a model of plain tensors whose
``load_weights`` copies into them on the event loop, as a simple engine would), and a compute loop
(a helper task) that calls ``apply_pending()`` at each batch boundary (every 5 ms). A trio
instrument times every task step of the node's loop: while a sync is in progress here (from
``SyncPause`` to the end of ``SyncResume``), steps longer than 1 ms count as the loop blocked
(nothing else on that loop could run meanwhile): the stall figure.

For the raw baseline it also runs, on request, a plain blocking pyzmq PULL loop in a worker thread
of the same process: the same receivers, without any of our code on the path.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import attrs
import torch
import trio
import zmq

import asyncflow_actors as afa
from asyncflow_actors.checkpoint import (
    SYNC_MESSAGES,
    PauseAck,
    PauseMode,
    SyncMessage,
    SyncPause,
    SyncResume,
    WeightReceiver,
)

BLOCKING = 0.001  # a task step longer than this blocks the loop


class StepTimer(trio.abc.Instrument):
    """Adds up the task steps longer than ``BLOCKING`` while ``open``."""

    def __init__(self) -> None:
        self.open = False
        self.blocked = 0.0
        self._started = 0.0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._started = time.perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        step = time.perf_counter() - self._started
        if self.open and step > BLOCKING:
            self.blocked += step


class ModelTarget:
    """Plain tensors; loading copies into them (on the loop)."""

    def __init__(self, specs: Mapping[str, list[int]]) -> None:
        self.params = {name: torch.zeros(shape) for name, shape in specs.items()}
        self.version = -1

    async def pause(self, mode: PauseMode) -> PauseAck:
        await trio.lowlevel.checkpoint()
        return PauseAck(mode, self.version)

    async def resume(self) -> None:
        await trio.lowlevel.checkpoint()

    async def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        await trio.lowlevel.checkpoint()
        for name, tensor in weights.items():
            self.params[name].copy_(tensor)
        self.version = version


@attrs.frozen
class Stall:
    blocked: float  # seconds of long task steps during the last sync window
    window: float  # seconds of that window
    load: float  # seconds of the last load into the model


@attrs.frozen
class GetStall(afa.Request[Stall]):
    pass


@attrs.frozen
class StartRaw(afa.Request[None]):
    """Receive raw messages on ``pull`` (ipc), answer every b"end" on ``ack``, until b"quit"."""

    pull: str
    ack: str


def raw_loop(pull_addr: str, ack_addr: str, ready: Any) -> None:
    ctx = zmq.Context()
    pull, ack = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind(pull_addr)
    ack.bind(ack_addr)
    trio.from_thread.run_sync(ready.set)
    try:
        while True:
            parts = pull.recv_multipart(copy=False)
            if parts[0].bytes == b"end":
                ack.send(b"ok")
            elif parts[0].bytes == b"quit":
                return
    finally:
        pull.close(0)
        ack.close(0)
        ctx.term()


ReceiverMsg = SyncMessage | GetStall | StartRaw


class BenchReceiver(afa.Actor[ReceiverMsg]):
    def __init__(self, specs: dict[str, list[int]], load: str = "lazy") -> None:
        self.specs = specs
        self.load = load
        self.window_start: float | None = None
        self.timer = StepTimer()
        self.last = Stall(0.0, 0.0, 0.0)

    async def on_start(self, ctx: afa.ActorContext[ReceiverMsg]) -> None:
        self.target = ModelTarget(self.specs)
        self.receiver = WeightReceiver(self.target, load=self.load, name=ctx.name)  # type: ignore[arg-type]
        trio.lowlevel.add_instrument(self.timer)
        ctx.start_soon(self._compute)

    async def _compute(self) -> None:
        while True:
            await self.receiver.apply_pending()  # the batch boundary
            await trio.sleep(0.005)

    async def receive(self, msg: ReceiverMsg, ctx: afa.ActorContext[ReceiverMsg]) -> Any:
        if isinstance(msg, SyncPause):
            self.window_start = time.perf_counter()
            self.timer.open, self.timer.blocked = True, 0.0
        if isinstance(msg, SYNC_MESSAGES):
            reply = await self.receiver.handle(msg, ctx)
            if isinstance(msg, SyncResume) and self.window_start is not None:
                # this step itself (an eager load) is still running: add it by hand
                step = time.perf_counter() - self.timer._started
                window = time.perf_counter() - self.window_start
                blocked = self.timer.blocked + (step if step > BLOCKING else 0.0)
                self.window_start, self.timer.open = None, False
                self.last = Stall(blocked, window, self.receiver.statistics().last_load_seconds)
            return reply
        if isinstance(msg, GetStall):
            await trio.sleep(0.05)  # a lazy load happens at the next batch boundary
            return attrs.evolve(self.last, load=self.receiver.statistics().last_load_seconds)
        ready = trio.Event()
        ctx.start_soon(
            lambda: trio.to_thread.run_sync(
                raw_loop, msg.pull, msg.ack, ready, abandon_on_cancel=True
            )
        )
        await ready.wait()
        return None
