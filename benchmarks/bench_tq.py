"""TransferQueue end to end, against raw pyzmq measured in the same run.

Workload (the one used against the public ``transferqueue`` package, ``nox -s bench_peer``):
batches of 256 samples, each ``prompt_ids`` int64[2048], ``response_ids`` int64[4096],
``old_logprobs`` float32[4096], ``rewards`` float32 (16,778,240 bytes a batch, prompts counted
per sample); 2 storage units, each in its own node process (ipc); one producer task puts while
one consumer task gets and acks. Prints JSON lines (medians over repeats):

- ``tq_throughput`` (MB/s, 10^6 bytes, put → get → ack) with baseline: the same bytes pushed once
  from this process to another over tcp loopback with raw pyzmq (PUSH/PULL, copy=False);
- ``tq_small_batch_latency`` (ms): 8 samples put + get + ack;
- ``tq_startup`` (s): ``open_transfer_queue`` (two node processes) to the first put done;
- ``tq_claims_per_s``: controller selections per second with 100k ready samples;
- ``tq_group_dedup_bytes_saved`` (bytes a batch): 32 groups of 8 sharing their prompt.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import trio

import asyncflow_actors as afa
from asyncflow_actors import transfer_queue as tq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_tq_state import bench_claims
from common import emit, raw_push_throughput

N = 256
BATCHES = 30
REPEATS = 5
WARMUP = 10
LATENCY_ITERATIONS = 200


def spec(shared_prompt: bool = False) -> tq.TopicSpec:
    return tq.TopicSpec(
        name="rollout",
        columns={
            "prompt_ids": tq.ColumnSpec(dtype="int64", shape=(2048,), shared=shared_prompt),
            "response_ids": tq.ColumnSpec(dtype="int64", shape=(4096,)),
            "old_logprobs": tq.ColumnSpec(dtype="float32", shape=(4096,)),
            "rewards": tq.ColumnSpec(dtype="float32", shape=()),
        },
        consumers=("trainer",),
        staleness=0,
        capacity=4 * N,
    )


def make_batch(n: int = N) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "prompt_ids": torch.randint(0, 150_000, (n, 2048), generator=gen),
        "response_ids": torch.randint(0, 150_000, (n, 4096), generator=gen),
        "old_logprobs": torch.randn(n, 4096, generator=gen),
        "rewards": torch.randn(n, generator=gen),
    }


def nbytes(batch: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in batch.values())


COLUMNS = ["prompt_ids", "response_ids", "old_logprobs", "rewards"]


async def produce(client: tq.TransferQueueClient, data: dict[str, torch.Tensor]) -> None:
    for _ in range(BATCHES):
        await client.put("rollout", data, version=0)


async def consume(client: tq.TransferQueueClient) -> None:
    for _ in range(BATCHES):
        await client.ack(await client.get("rollout", "trainer", COLUMNS, N))


async def tq_figures() -> tuple[list[float], list[float], list[float]]:
    """Startup per fresh queue; throughput and latency in one queue (as the peer benchmark does:
    its repeats reuse one Ray session's processes with a fresh partition)."""
    data = make_batch()
    small = make_batch(8)
    throughputs, latencies, startups = [], [], []
    config = tq.TransferQueueConfig(topics=(spec(),), units=2, placement="process")
    for _ in range(REPEATS):
        async with afa.open_actor_system() as system:
            t0 = time.perf_counter()
            async with tq.open_transfer_queue(system, config) as queue:
                client = await queue.client("bench")
                await client.put("rollout", small, version=0)
                startups.append(time.perf_counter() - t0)
    async with afa.open_actor_system() as system, tq.open_transfer_queue(system, config) as queue:
        client = await queue.client("bench")
        for _ in range(WARMUP):
            await client.put("rollout", data, version=0)
            await client.ack(await client.get("rollout", "trainer", COLUMNS, N))
        for _ in range(REPEATS):
            t1 = time.perf_counter()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(produce, client, data)
                nursery.start_soon(consume, client)
            elapsed = time.perf_counter() - t1
            throughputs.append(BATCHES * nbytes(data) / elapsed / 1e6)
            times = []
            for _ in range(LATENCY_ITERATIONS):
                t2 = time.perf_counter()
                await client.put("rollout", small, version=0)
                await client.ack(await client.get("rollout", "trainer", COLUMNS, 8))
                times.append((time.perf_counter() - t2) * 1e3)
            latencies.append(statistics.median(times))
    print(f"# throughputs {[round(t) for t in throughputs]} MB/s", file=sys.stderr)
    return throughputs, latencies, startups


def raw_throughput() -> float:
    data = make_batch()
    return raw_push_throughput([t.numpy() for t in data.values()], BATCHES) / 1e6


async def dedup_saved() -> int:
    data = make_batch()
    config = tq.TransferQueueConfig(topics=(spec(shared_prompt=True),), units=2)
    async with afa.open_actor_system() as system, tq.open_transfer_queue(system, config) as queue:
        client = await queue.client("dedup")
        per_sample = {k: v for k, v in data.items() if k != "prompt_ids"}
        for g in range(N // 8):
            slot = await client.open_group(
                "rollout", 8, shared={"prompt_ids": data["prompt_ids"][g * 8]}
            )
            rows = slice(g * 8, g * 8 + 8)
            await client.put(
                "rollout", {k: v[rows] for k, v in per_sample.items()}, version=0, group=slot
            )
        stats = await client.statistics()
        return int(stats.controller.state.topics[0].dedup_bytes_saved)


def main() -> None:
    raw = [raw_throughput() for _ in range(REPEATS)]
    throughputs, latencies, startups = trio.run(tq_figures)
    raw += [raw_throughput() for _ in range(REPEATS)]  # bracket our runs: same machine noise
    med = statistics.median
    emit("tq_throughput", med(throughputs), "MB/s", med(raw))
    emit("tq_small_batch_latency", med(latencies), "ms")
    emit("tq_startup", med(startups), "s")
    emit("tq_claims_per_s", bench_claims(), "samples/s")
    emit("tq_group_dedup_bytes_saved", trio.run(dedup_saved), "bytes")


if __name__ == "__main__":
    main()
