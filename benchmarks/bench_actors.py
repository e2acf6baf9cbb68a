"""Actor runtime micro-benchmarks against raw trio memory channels, measured in the same run.

Prints one JSON object per line: ``{"name", "value", "unit", "baseline", "ratio"}``. Values are
medians over repeats. Targets (issue #2): tell_rate ratio >= 0.6, ask_rtt_p50 ratio <= 3.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import attrs
import trio

import asyncflow_actors as afa

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit

N_TELLS = 100_000
N_ASKS = 20_000
REPEATS = 5
MAILBOX = 256


@attrs.frozen
class Add:
    n: int


@attrs.frozen
class Get(afa.Request[int]):
    pass


class Counter(afa.Actor[Add | Get]):
    def __init__(self) -> None:
        self.total = 0

    async def receive(self, msg: Add | Get, ctx: afa.ActorContext[Add | Get]) -> Any:
        if type(msg) is Add:
            self.total += msg.n
            return None
        return self.total


async def actor_tell_rate() -> float:
    async with afa.open_actor_system() as system:
        ref = await system.spawn(Counter, name="counter", mailbox_size=MAILBOX)
        msg = Add(1)
        t0 = time.perf_counter()
        for _ in range(N_TELLS):
            await ref.send(msg)
        total = await ref.ask(Get())
        elapsed = time.perf_counter() - t0
        assert total == N_TELLS
        return N_TELLS / elapsed


async def raw_tell_rate() -> float:
    send, recv = trio.open_memory_channel[Add](MAILBOX)
    done = trio.Event()
    total = 0

    async def consumer() -> None:
        nonlocal total
        async for msg in recv:
            total += msg.n
            if total == N_TELLS:
                done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consumer)
        msg = Add(1)
        t0 = time.perf_counter()
        for _ in range(N_TELLS):
            await send.send(msg)
        await done.wait()
        elapsed = time.perf_counter() - t0
        nursery.cancel_scope.cancel()
    return N_TELLS / elapsed


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def actor_ask_rtts() -> list[float]:
    async with afa.open_actor_system() as system:
        ref = await system.spawn(Counter, name="counter", mailbox_size=MAILBOX)
        req = Get()
        out = []
        for _ in range(N_ASKS):
            t0 = time.perf_counter_ns()
            await ref.ask(req)
            out.append((time.perf_counter_ns() - t0) / 1000)
        return out


async def raw_ask_rtts() -> list[float]:
    req_send, req_recv = trio.open_memory_channel[object](MAILBOX)
    rsp_send, rsp_recv = trio.open_memory_channel[int](MAILBOX)

    async def server() -> None:
        async for _ in req_recv:
            await rsp_send.send(0)

    out = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server)
        req = Get()
        for _ in range(N_ASKS):
            t0 = time.perf_counter_ns()
            await req_send.send(req)
            await rsp_recv.receive()
            out.append((time.perf_counter_ns() - t0) / 1000)
        nursery.cancel_scope.cancel()
    return out


def main() -> None:
    actor_rates, raw_rates, actor_p50, raw_p50, actor_p99, raw_p99 = [], [], [], [], [], []
    for _ in range(REPEATS):  # interleave so that machine noise hits both alike
        raw_rates.append(trio.run(raw_tell_rate))
        actor_rates.append(trio.run(actor_tell_rate))
        raw = trio.run(raw_ask_rtts)
        act = trio.run(actor_ask_rtts)
        raw_p50.append(p(raw, 0.5))
        actor_p50.append(p(act, 0.5))
        raw_p99.append(p(raw, 0.99))
        actor_p99.append(p(act, 0.99))
    med = statistics.median
    emit("tell_rate", med(actor_rates), "msg/s", med(raw_rates))
    emit("ask_rtt_p50", med(actor_p50), "us", med(raw_p50))
    emit("ask_rtt_p99", med(actor_p99), "us", med(raw_p99))


if __name__ == "__main__":
    main()
