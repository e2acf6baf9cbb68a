"""Peer benchmark: the public `transferqueue` package (0.1.11, verl / Ascend) on our TQ workload.

Runs in its own environment (``nox -s bench_peer``) and never imports asyncflow_actors, so that
our benchmark can set these figures beside its own, measured on the same machine in one sitting.
Prints one JSON object per line on stdout; diagnostics go to stderr.

- peer_tq_throughput (MB/s): batches of 256 samples (prompt_ids int64[2048], response_ids
  int64[4096], old_logprobs float32[4096], rewards float32 scalar; 16,778,240 bytes a batch)
  through 2 SimpleStorage units (Ray actors, the package's default round-robin placement). One
  producer task puts while one consumer task concurrently polls ``get_meta`` (fetch mode, polling
  controller), reads with ``get_data`` and frees with ``clear_samples``. Bytes of all batches over
  the wall time from the first put to the last batch cleared; median over repeats.
- peer_tq_small_batch_latency (ms): 8 samples put + get_meta + get_data + clear_samples, one
  after the other; median over iterations.
- peer_tq_startup (s): ``ray.init`` (local instance) + ``transfer_queue.init`` until the clients
  are ready.

Producer and consumer are two ``AsyncTransferQueueClient`` instances sharing one asyncio loop in
this process (like two tasks of one trio process); the controller and the storage units are Ray
actors, so separate processes. ``--mode actors`` instead runs the producer and the consumer in
two Ray actors of their own and prints ``peer_tq_throughput_actors``.

Usage: python benchmarks/peer_transferqueue.py [--batches N] [--repeats N] [--iterations N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from typing import Any

BATCH = 256
SMALL_BATCH = 8
PROMPT_LEN = 2048
RESPONSE_LEN = 4096
FIELDS = ["prompt_ids", "response_ids", "old_logprobs", "rewards"]
TASK = "train"
# Wall-clock cap on every phase: the package's own socket timeout is 200 s, far past our budget.
PHASE_TIMEOUT_S = 120.0


def _set_env() -> None:
    """Environment read at import time by Ray and transfer_queue; must precede those imports.

    Ray workers (controller, storage units) inherit it from this process via the local raylet.
    """
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # Every put/get otherwise logs "target_num_threads 8 should not exceed total physical CPU
    # cores" at WARNING in the driver and in each storage unit.
    os.environ.setdefault("TQ_LOGGING_LEVEL", "ERROR")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _emit(name: str, value: float, unit: str) -> None:
    print(json.dumps({"name": name, "value": round(value, 3), "unit": unit}), flush=True)


def make_batch(n: int, seed: int) -> Any:
    import torch
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(seed)
    return TensorDict(
        {
            "prompt_ids": torch.randint(0, 50_000, (n, PROMPT_LEN), dtype=torch.int64, generator=g),
            "response_ids": torch.randint(
                0, 50_000, (n, RESPONSE_LEN), dtype=torch.int64, generator=g
            ),
            "old_logprobs": torch.randn(n, RESPONSE_LEN, generator=g),
            "rewards": torch.randn(n, generator=g),
        },
        batch_size=n,
    )


def batch_nbytes(batch: Any) -> int:
    return sum(t.numel() * t.element_size() for t in batch.values())


def check_same(sent: Any, got: Any) -> None:
    """The package hands back jagged nested tensors for rows; compare row by row."""
    import torch

    for field in FIELDS:
        value = got[field]
        rows = value.unbind() if value.is_nested else list(value)
        if len(rows) != sent.batch_size[0]:
            raise AssertionError(f"{field}: {len(rows)} rows, expected {sent.batch_size[0]}")
        for i, row in enumerate(rows):
            if not torch.equal(row.reshape(sent[field][i].shape), sent[field][i]):
                raise AssertionError(f"{field}: row {i} differs from what was put")


def new_client(name: str, conf: Any) -> Any:
    from transfer_queue.client import AsyncTransferQueueClient

    client = AsyncTransferQueueClient(
        client_id=f"{name}_{os.getpid()}", controller_info=conf.controller.zmq_info
    )
    client.initialize_storage_manager(
        manager_type=conf.backend.storage_backend,
        config=conf.backend[conf.backend.storage_backend],
    )
    return client


async def produce(client: Any, batch: Any, n_batches: int, partition: str) -> None:
    for _ in range(n_batches):
        await client.async_put(batch, partition_id=partition)


async def consume(
    client: Any, n_batches: int, partition: str, poll_s: float, expect: Any = None
) -> int:
    """Consume ``n_batches`` full batches; returns how many empty polls it took."""
    empty_polls = 0
    done = 0
    while done < n_batches:
        meta = await client.async_get_meta(
            data_fields=FIELDS,
            batch_size=BATCH,
            partition_id=partition,
            mode="fetch",
            task_name=TASK,
        )
        if meta.size == 0:
            empty_polls += 1
            await asyncio.sleep(poll_s)
            continue
        data = await client.async_get_data(meta)
        if expect is not None:
            check_same(expect, data)
        await client.async_clear_samples(meta)
        done += 1
    return empty_polls


async def stream_once(
    producer: Any,
    consumer: Any,
    batch: Any,
    n_batches: int,
    partition: str,
    poll_s: float,
    expect: Any = None,
) -> tuple[float, int]:
    start = time.perf_counter()
    _, empty_polls = await asyncio.wait_for(
        asyncio.gather(
            produce(producer, batch, n_batches, partition),
            consume(consumer, n_batches, partition, poll_s, expect),
        ),
        PHASE_TIMEOUT_S,
    )
    elapsed = time.perf_counter() - start
    await producer.async_clear_partition(partition)
    return elapsed, empty_polls


async def small_once(client: Any, batch: Any, partition: str) -> float:
    start = time.perf_counter()
    await client.async_put(batch, partition_id=partition)
    meta = await client.async_get_meta(
        data_fields=FIELDS,
        batch_size=SMALL_BATCH,
        partition_id=partition,
        mode="fetch",
        task_name=TASK,
    )
    if meta.size != SMALL_BATCH:
        raise RuntimeError(f"get_meta returned {meta.size} samples right after put, expected 8")
    await client.async_get_data(meta)
    await client.async_clear_samples(meta)
    return time.perf_counter() - start


async def bench_in_process(conf: Any, args: argparse.Namespace) -> dict[str, float]:
    producer = new_client("peer_producer", conf)
    consumer = new_client("peer_consumer", conf)
    try:
        batch = make_batch(BATCH, seed=0)
        nbytes = batch_nbytes(batch)
        poll_s = args.poll_ms / 1000

        # Warm-up: connections, allocator, and one correctness check of the round trip.
        await stream_once(producer, consumer, batch, args.warmup, "warmup", poll_s, expect=batch)

        rates = []
        for r in range(args.repeats):
            elapsed, empty_polls = await stream_once(
                producer, consumer, batch, args.batches, f"stream_{r}", poll_s
            )
            rates.append(args.batches * nbytes / elapsed / 1e6)
            _log(
                f"throughput repeat {r}: {args.batches} x {nbytes} B in {elapsed:.3f} s "
                f"= {rates[-1]:.1f} MB/s ({empty_polls} empty polls)"
            )

        small = make_batch(SMALL_BATCH, seed=1)
        for _ in range(args.warmup_iterations):
            await asyncio.wait_for(small_once(producer, small, "small"), PHASE_TIMEOUT_S)
        latencies = []
        for _ in range(args.iterations):
            latencies.append(
                await asyncio.wait_for(small_once(producer, small, "small"), PHASE_TIMEOUT_S)
            )
        latencies_ms = sorted(x * 1000 for x in latencies)
        _log(
            f"small-batch latency over {len(latencies_ms)}: min {latencies_ms[0]:.2f} ms, "
            f"p90 {latencies_ms[int(0.9 * (len(latencies_ms) - 1))]:.2f} ms, "
            f"max {latencies_ms[-1]:.2f} ms"
        )
        return {
            "throughput": statistics.median(rates),
            "latency_ms": statistics.median(latencies_ms),
        }
    finally:
        producer.close()
        consumer.close()


def bench_actors(args: argparse.Namespace) -> float:
    """Producer and consumer each in a Ray actor of its own; the driver only times them."""
    import ray

    @ray.remote(num_cpus=0)
    class Side:
        def __init__(self) -> None:
            import transfer_queue as tq

            tq.init()  # attaches to the controller the driver started
            conf = ray.get(
                ray.get_actor("TransferQueueController", "transfer_queue").get_config.remote()
            )
            self.client = new_client("peer_actor", conf)
            self.batch = make_batch(BATCH, seed=0)
            self.loop = asyncio.new_event_loop()

        def ready(self) -> int:
            return batch_nbytes(self.batch)

        def produce(self, n_batches: int, partition: str) -> None:
            self.loop.run_until_complete(produce(self.client, self.batch, n_batches, partition))

        def consume(self, n_batches: int, partition: str, poll_s: float) -> None:
            self.loop.run_until_complete(consume(self.client, n_batches, partition, poll_s))
            self.loop.run_until_complete(self.client.async_clear_partition(partition))

        def close(self) -> None:
            self.client.close()

    producer, consumer = Side.remote(), Side.remote()  # type: ignore[attr-defined]
    nbytes = ray.get([producer.ready.remote(), consumer.ready.remote()])[0]
    poll_s = args.poll_ms / 1000
    ray.get(
        [
            producer.produce.remote(args.warmup, "a_warmup"),
            consumer.consume.remote(args.warmup, "a_warmup", poll_s),
        ],
        timeout=PHASE_TIMEOUT_S,
    )
    rates = []
    for r in range(args.repeats):
        start = time.perf_counter()
        ray.get(
            [
                producer.produce.remote(args.batches, f"a_stream_{r}"),
                consumer.consume.remote(args.batches, f"a_stream_{r}", poll_s),
            ],
            timeout=PHASE_TIMEOUT_S,
        )
        elapsed = time.perf_counter() - start
        rates.append(args.batches * nbytes / elapsed / 1e6)  # MB = 10**6 bytes
        _log(f"actors throughput repeat {r}: {rates[-1]:.1f} MB/s ({elapsed:.3f} s)")
    ray.get([producer.close.remote(), consumer.close.remote()])
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=20, help="batches per throughput repeat")
    parser.add_argument("--warmup", type=int, default=20, help="warm-up batches")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=100, help="small-batch round trips")
    parser.add_argument("--warmup-iterations", type=int, default=10)
    parser.add_argument("--poll-ms", type=float, default=1.0, help="consumer sleep on empty poll")
    parser.add_argument("--num-cpus", type=int, default=4, help="logical CPUs Ray may schedule")
    parser.add_argument("--mode", choices=["process", "actors", "both"], default="process")
    args = parser.parse_args()

    _set_env()
    start = time.perf_counter()
    import ray

    ray_start = time.perf_counter()
    ray.init(
        address="local",
        num_cpus=args.num_cpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        logging_level="ERROR",
    )
    ray_s = time.perf_counter() - ray_start
    try:
        from omegaconf import OmegaConf

        import transfer_queue as tq

        _log(f"transferqueue {tq.__version__}, ray {ray.__version__}")
        tq_start = time.perf_counter()
        # Defaults everywhere (SequentialSampler, 2 SimpleStorage units, round-robin placement)
        # except polling mode: the blocking mode sleeps TQ_CONTROLLER_GET_METADATA_CHECK_INTERVAL
        # (5 s, integer) inside the controller's only request thread when a batch is not ready,
        # holding every other request, then raises TimeoutError (TQ_CONTROLLER_GET_METADATA_TIMEOUT,
        # 1 s); a concurrent consumer must poll.
        conf = tq.init(OmegaConf.create({"controller": {"polling_mode": True}}))
        n_units = len(conf.backend.SimpleStorage.zmq_info)
        if n_units != 2:
            raise RuntimeError(f"expected 2 storage units from the defaults, got {n_units}")
        startup = time.perf_counter() - start
        _log(
            f"startup {startup:.2f} s: ray.init {ray_s:.2f} s, "
            f"transfer_queue.init {time.perf_counter() - tq_start:.2f} s, rest imports"
        )

        if args.mode in ("process", "both"):
            results = asyncio.run(bench_in_process(conf, args))
            _emit("peer_tq_throughput", results["throughput"], "MB/s")
            _emit("peer_tq_small_batch_latency", results["latency_ms"], "ms")
        if args.mode in ("actors", "both"):
            _emit("peer_tq_throughput_actors", bench_actors(args), "MB/s")
        _emit("peer_tq_startup", startup, "s")
    finally:
        try:
            import transfer_queue as tq

            tq.close()
        finally:
            ray.shutdown()


if __name__ == "__main__":
    main()
