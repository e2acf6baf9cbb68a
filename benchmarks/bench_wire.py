"""Wire format and trio-zmq micro-benchmarks, each against a baseline measured in the same run.

Prints one JSON object per line: ``{"name", "value", "unit", "baseline", "ratio"}`` with
``ratio = value / baseline``. Values are medians over repeats; value and baseline repeats are
interleaved so that load from other processes hits both alike. Baselines:

- ``pickle.dumps``/``loads`` of the same payload (pickle is a *benchmark baseline only*: it never
  touches the wire);
- raw blocking pyzmq (``copy=False``) between two threads, for bandwidth and round trip;
- the same message with its body as a data frame, for the inline sweep (``ratio < 1``: inline is
  faster), which sets ``DEFAULT_INLINE_THRESHOLD``;
- a copying send, for the zero-copy sweep (``ratio < 1``: zero copy is faster), which sets
  ``DEFAULT_COPY_THRESHOLD``.
"""

from __future__ import annotations

import json
import pickle
import statistics
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import torch
import trio
import zmq

from asyncflow_actors.actors.remote._wire import MessageRegistry, decode, encode
from asyncflow_actors.actors.remote._zmq import TrioSocket, open_zmq_socket

REPEATS = 5
MiB = 1 << 20
NEVER = 1 << 40
REG = MessageRegistry()


@REG.register(name="bench.Batch")
@attrs.frozen
class Batch:
    version: int
    tensors: list[torch.Tensor]


@REG.register(name="bench.Tell")
@attrs.frozen
class Tell:
    step: int
    name: str
    data: Any


def emit(name: str, value: float, unit: str, baseline: float) -> None:
    row = {
        "name": name,
        "value": round(value, 3),
        "unit": unit,
        "baseline": round(baseline, 3),
        "ratio": round(value / baseline, 3),
    }
    print(json.dumps(row), flush=True)


def per_call_us(fn: Callable[[], object], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def interleaved(value: Callable[[], float], baseline: Callable[[], float]) -> tuple[float, float]:
    values, baselines = [], []
    for _ in range(REPEATS):
        values.append(value())
        baselines.append(baseline())
    return statistics.median(values), statistics.median(baselines)


async def interleaved_async(
    value: Callable[[], Awaitable[float]], baseline: Callable[[], Awaitable[float] | float]
) -> tuple[float, float]:
    values, baselines = [], []
    for _ in range(REPEATS):
        values.append(await value())
        b = baseline()
        baselines.append(b if isinstance(b, float) else await b)
    return statistics.median(values), statistics.median(baselines)


def big_batch() -> Batch:
    gen = torch.Generator().manual_seed(0)
    return Batch(
        version=3,
        tensors=[  # 4 MiB each
            torch.randn(1024, 2048, generator=gen).to(torch.bfloat16),
            torch.randn(1024, 1024, generator=gen),
            torch.randint(0, 50_000, (512 * 1024,), generator=gen, dtype=torch.int64),
            torch.randn(2048, 1024, generator=gen).to(torch.float16),
        ],
    )


def bench_codec() -> None:
    batch = big_batch()
    assert sum(t.nbytes for t in batch.tensors) == 16 * MiB

    def wire() -> object:
        frames = encode({"k": 1}, batch, registry=REG)
        return decode(frames, registry=REG, max_message_bytes=1 << 30)

    def pickled() -> object:
        return pickle.loads(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL))

    value, baseline = interleaved(lambda: per_call_us(wire, 20), lambda: per_call_us(pickled, 3))
    emit("wire_encode_decode_16MiB_us", value, "us", baseline)

    small = Tell(step=7, name="rollout-3", data={"ids": [1, 2, 3], "mask": torch.ones(16)})

    def wire_small() -> object:
        frames = encode({"kind": "tell", "to": "a/b", "corr": 12}, small, registry=REG)
        return decode(frames, registry=REG, max_message_bytes=1 << 20)

    def pickled_small() -> object:
        return pickle.loads(pickle.dumps(small, protocol=pickle.HIGHEST_PROTOCOL))

    value, baseline = interleaved(
        lambda: per_call_us(wire_small, 1000), lambda: per_call_us(pickled_small, 1000)
    )
    emit("wire_encode_decode_small_us", value, "us", baseline)


async def trio_bandwidth(pull: TrioSocket, push: TrioSocket, batch: Batch, n: int) -> float:
    """GB/s of 16 MiB Batch messages (4 tensors): encoded, sent, received and decoded."""
    done = trio.Event()

    async def consume() -> None:
        for _ in range(n):
            frames = await pull.recv_multipart()
            _, got = decode(frames, registry=REG, max_message_bytes=1 << 30)
            assert isinstance(got, Batch)
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consume)
        t0 = time.perf_counter()
        for _ in range(n):
            await push.send_multipart(encode({}, batch, registry=REG))
        await done.wait()
        return n * 16 * MiB / (time.perf_counter() - t0) / 1e9


def raw_bandwidth(pull: zmq.Socket[Any], push: zmq.Socket[Any], batch: Batch, n: int) -> float:
    """GB/s of the same 4 buffers with blocking pyzmq PUSH/PULL, copy=False, two threads."""
    bufs = [t.view(torch.uint8).reshape(-1).numpy().data for t in batch.tensors]

    def consume() -> None:
        for _ in range(n):
            pull.recv_multipart(copy=False)

    thread = threading.Thread(target=consume)
    thread.start()
    t0 = time.perf_counter()
    for _ in range(n):
        push.send_multipart(bufs, copy=False)
    thread.join()
    return n * 16 * MiB / (time.perf_counter() - t0) / 1e9


async def bench_bandwidth(ctx: zmq.Context[Any]) -> None:
    batch = big_batch()
    raw_pull = ctx.socket(zmq.PULL)
    raw_push = ctx.socket(zmq.PUSH)
    raw_push.connect(f"tcp://127.0.0.1:{raw_pull.bind_to_random_port('tcp://127.0.0.1')}")
    try:
        async with (
            open_zmq_socket(ctx, zmq.PULL, bind="tcp://127.0.0.1:*") as pull,
            open_zmq_socket(ctx, zmq.PUSH, connect=pull.bound_endpoints[0]) as push,
        ):
            value, baseline = await interleaved_async(
                lambda: trio_bandwidth(pull, push, batch, 32),
                lambda: raw_bandwidth(raw_pull, raw_push, batch, 32),
            )
    finally:
        raw_pull.close(linger=0)
        raw_push.close(linger=0)
    emit("zmq_bandwidth_16MiB_GBps", value, "GB/s", baseline)


async def trio_rtt(a: TrioSocket, b: TrioSocket, n: int) -> float:
    """p50 µs of a small encoded message echoed between two trio tasks over tcp."""
    msg = Tell(step=1, name="x", data=[1, 2, 3])
    samples = []

    async def echo() -> None:
        while True:
            frames = await b.recv_multipart()
            meta, payload = decode(frames, registry=REG, max_message_bytes=1 << 20)
            await b.send_multipart(encode(meta, payload, registry=REG))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(echo)
        for _ in range(n):
            t0 = time.perf_counter()
            await a.send_multipart(encode({"corr": 1}, msg, registry=REG))
            decode(await a.recv_multipart(), registry=REG, max_message_bytes=1 << 20)
            samples.append((time.perf_counter() - t0) * 1e6)
        nursery.cancel_scope.cancel()
    return statistics.median(samples)


def raw_rtt(req: zmq.Socket[Any], rep: zmq.Socket[Any], n: int) -> float:
    """p50 µs of a raw blocking pyzmq REQ/REP round trip between two threads over tcp."""

    def serve() -> None:
        for _ in range(n):
            rep.send_multipart(rep.recv_multipart())

    thread = threading.Thread(target=serve)
    thread.start()
    samples = []
    payload = [b"x" * 64]
    for _ in range(n):
        t0 = time.perf_counter()
        req.send_multipart(payload)
        req.recv_multipart()
        samples.append((time.perf_counter() - t0) * 1e6)
    thread.join()
    return statistics.median(samples)


async def bench_rtt(ctx: zmq.Context[Any]) -> None:
    rep = ctx.socket(zmq.REP)
    req = ctx.socket(zmq.REQ)
    req.connect(f"tcp://127.0.0.1:{rep.bind_to_random_port('tcp://127.0.0.1')}")
    try:
        async with (
            open_zmq_socket(ctx, zmq.DEALER, bind="tcp://127.0.0.1:*") as a,
            open_zmq_socket(ctx, zmq.DEALER, connect=a.bound_endpoints[0]) as b,
        ):
            value, baseline = await interleaved_async(
                lambda: trio_rtt(a, b, 500), lambda: raw_rtt(req, rep, 500)
            )
    finally:
        rep.close(linger=0)
        req.close(linger=0)
    emit("zmq_small_msg_rtt_p50_us", value, "us", baseline)


async def bench_sweeps(ctx: zmq.Context[Any]) -> None:
    """Per-message µs for one tensor body of each size, encode → send → recv → decode over tcp:
    inline vs data frame; then, for data frames, zero-copy vs copied send."""
    async with (
        open_zmq_socket(ctx, zmq.PAIR, bind="tcp://127.0.0.1:*") as a,
        open_zmq_socket(ctx, zmq.PAIR, connect=a.bound_endpoints[0]) as b,
    ):

        async def one(t: torch.Tensor, inline: int, copy: int, n: int) -> float:
            t0 = time.perf_counter()
            for _ in range(n):
                frames = encode({}, t, registry=REG, inline_threshold=inline)
                await b.send_multipart(frames, copy_threshold=copy)
                decode(await a.recv_multipart(), registry=REG, max_message_bytes=1 << 30)
            return (time.perf_counter() - t0) / n * 1e6

        for size in (1024, 4096, 8192, 32768):
            t = torch.zeros(size, dtype=torch.uint8)
            value, baseline = await interleaved_async(
                lambda t=t: one(t, NEVER, NEVER, 200),  # type: ignore[misc]
                lambda t=t: one(t, 0, NEVER, 200),  # type: ignore[misc]
            )
            emit(f"wire_inline_{size}B_us", value, "us", baseline)
        for size in (65536, 262144, MiB, 4 * MiB):
            t = torch.zeros(size, dtype=torch.uint8)
            n = 100 if size <= 262144 else 20
            value, baseline = await interleaved_async(
                lambda t=t, n=n: one(t, 0, 0, n),  # type: ignore[misc]
                lambda t=t, n=n: one(t, 0, NEVER, n),  # type: ignore[misc]
            )
            emit(f"zmq_zero_copy_{size}B_us", value, "us", baseline)


async def main_async(ctx: zmq.Context[Any]) -> None:
    await bench_bandwidth(ctx)
    await bench_rtt(ctx)
    await bench_sweeps(ctx)


def main() -> None:
    torch.set_num_threads(1)
    bench_codec()
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        trio.run(main_async, ctx)
    finally:
        ctx.destroy(linger=0)


if __name__ == "__main__":
    main()
