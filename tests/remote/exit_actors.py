"""Actors the node-exit tests place on nodes (importable by nodes): a TransferQueue consumer
waiting in a claim, as a station waits for its next batch, and one whose process would take
long to tear its interpreter down."""

from __future__ import annotations

import time
from typing import Any

import trio

import asyncflow_actors as afa
from asyncflow_actors import transfer_queue as tq

TOPIC = tq.TopicSpec.from_dict(
    {"consumers": ["c"], "columns": {"x": {"dtype": "float32", "shape": [4]}}}, name="t"
)


class Claimer(afa.Actor[Any]):
    """Claims samples that never come, from the start on, and closes its client when stopped:
    the clean-ups of a station stopped while it waits for data."""

    def __init__(self, controller: afa.ActorRef[Any]) -> None:
        self.controller = controller
        self.client: tq.TransferQueueClient | None = None

    async def on_start(self, ctx: afa.ActorContext[Any]) -> None:
        self.client = await tq.TransferQueueClient.connect(self.controller, holder="claimer")
        ctx.start_soon(self._claim)

    async def _claim(self) -> None:
        assert self.client is not None
        await self.client.get("t", "c", ["x"], 4)
        await trio.sleep_forever()

    async def on_stop(self, ctx: afa.ActorContext[Any], error: BaseException | None) -> None:
        if self.client is not None:
            await self.client.aclose()


class _SlowTeardown:
    """Writes ``path`` and sleeps when collected: at interpreter teardown, if there is one."""

    def __init__(self, path: str) -> None:
        self.path = path
        # held here: module globals may be gone by the time a teardown collects this
        self._open, self._sleep = open, time.sleep

    def __del__(self) -> None:
        with self._open(self.path, "w") as f:
            f.write("torn down")
        self._sleep(30)  # a teardown slower than any shutdown grace


_KEPT: list[_SlowTeardown] = []  # module globals go at the interpreter's teardown


class HeavyProcess(afa.Actor[Any]):
    """Leaves an object behind whose teardown is slow, as torch's modules are."""

    def __init__(self, path: str) -> None:
        _KEPT.append(_SlowTeardown(path))
