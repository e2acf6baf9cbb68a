"""TransferQueue end to end, against raw pyzmq measured in the same run (interleaved rounds).

Workload (the one used against the public ``transferqueue`` package, ``nox -s bench_peer``):
batches of 256 samples, each ``prompt_ids`` int64[2048], ``response_ids`` int64[4096],
``old_logprobs`` float32[4096], ``rewards`` float32 (16,778,240 bytes a batch, prompts counted
per sample); 2 storage units, each in its own node process (ipc) on this host; one producer task
puts while one consumer task gets and acks. Prints JSON lines (medians over repeats):

- ``tq_throughput`` (MB/s, 10^6 bytes, put → get → ack), tensor bodies through shared memory,
  with baseline: the same bytes pushed once from this process to another over tcp loopback with
  raw pyzmq (PUSH/PULL, copy=False), one baseline round before each TQ round;
- ``tq_throughput_socket``: the same with shared memory off (bodies over the unit sockets);
- ``tq_small_batch_latency`` (ms): 8 samples put + get + ack, median of 200 rounds a repeat;
- ``tq_startup`` (s): ``open_transfer_queue`` (two node processes) to the first put done;
- ``tq_controller_batch_us`` (µs): ``ControllerState`` alone, one 256-sample put (allocate +
  commit) + get (claim) + ack cycle, one consumer, median of 500 cycles; and
  ``tq_controller_small_us``: the same for the small batch's 8 samples (2,000 cycles);
- ``tq_claims_per_s``: controller selections per second with 100k ready samples;
- ``tq_clients_1024`` (samples/s): 1024 concurrent client tasks in this process, 512 putting
  groups of 4 (versions advancing) and 512 getting whole groups, units in node processes; and
  ``tq_clients_1024_unit_rss`` (MB): the largest peak RSS of a unit process during that run;
- ``tq_group_dedup_bytes_saved`` (bytes a batch): 32 groups of 8 sharing their prompt;
- ``tq_group_batch_cpu_ms`` (ms of process CPU a step, baseline: the per-group calls) and
  ``tq_group_batch_requests`` (client requests a step, same baseline): one training step's
  writes, 16 groups of 8 each sharing its prompt, written with ``open_groups`` + one put of
  the 128 rows against 16 ``open_group`` + 16 puts, alternated in one process (units in this
  process, as in the async pipeline; the step ends with ``flush``, so the controller's
  bookkeeping to the units counts); ``tq_group_batch_speedup``: per-group CPU / batched CPU.

``--only latency,controller`` (say) measures only those figures (names: ``FIGURES``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

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
COLUMNS = ["prompt_ids", "response_ids", "old_logprobs", "rewards"]


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


async def produce(client: tq.TransferQueueClient, data: dict[str, torch.Tensor]) -> None:
    for _ in range(BATCHES):
        await client.put("rollout", data, version=0)


async def consume(client: tq.TransferQueueClient) -> None:
    for _ in range(BATCHES):
        await client.ack(await client.get("rollout", "trainer", COLUMNS, N))


async def throughput(client: tq.TransferQueueClient, data: dict[str, torch.Tensor]) -> float:
    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(produce, client, data)
        nursery.start_soon(consume, client)
    return BATCHES * nbytes(data) / (time.perf_counter() - t0) / 1e6


async def latency(client: tq.TransferQueueClient, small: dict[str, torch.Tensor]) -> float:
    times = []
    for _ in range(LATENCY_ITERATIONS):
        t0 = time.perf_counter()
        await client.put("rollout", small, version=0)
        await client.ack(await client.get("rollout", "trainer", COLUMNS, 8))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def config(*, shm: bool = True) -> tq.TransferQueueConfig:
    name = "tq" if shm else "tq-socket"
    return tq.TransferQueueConfig(
        topics=(spec(),), units=2, placement="process", shm=shm, name=name
    )


async def startups() -> list[float]:
    small = make_batch(8)
    out = []
    for _ in range(REPEATS):
        async with afa.open_actor_system() as system:
            t0 = time.perf_counter()
            async with tq.open_transfer_queue(system, config()) as queue:
                client = await queue.client()
                await client.put("rollout", small, version=0)
                out.append(time.perf_counter() - t0)
    return out


async def data_path() -> dict[str, list[float]]:
    """Rounds of: raw pyzmq baseline, TQ over shared memory, TQ over sockets (warm queues)."""
    data, small = make_batch(), make_batch(8)
    frames = [t.numpy() for t in data.values()]
    out: dict[str, list[float]] = {"raw": [], "shm": [], "socket": [], "latency": []}
    async with (
        afa.open_actor_system() as system,
        tq.open_transfer_queue(system, config()) as shm_queue,
        tq.open_transfer_queue(system, config(shm=False)) as socket_queue,
    ):
        shm_client, socket_client = await shm_queue.client(), await socket_queue.client()
        for client in (shm_client, socket_client):
            for _ in range(WARMUP):
                await client.put("rollout", data, version=0)
                await client.ack(await client.get("rollout", "trainer", COLUMNS, N))
        for _ in range(REPEATS):
            raw = await trio.to_thread.run_sync(raw_push_throughput, frames, BATCHES)
            out["raw"].append(raw / 1e6)
            out["shm"].append(await throughput(shm_client, data))
            out["socket"].append(await throughput(socket_client, data))
            out["latency"].append(await latency(shm_client, small))
    return out


def controller_batch_us(cycles: int = 500, n: int = N) -> float:
    state = tq.ControllerState([spec()], ["unit-0", "unit-1"])
    columns = frozenset(COLUMNS)
    sizes = {"prompt_ids": 2048 * 8, "response_ids": 4096 * 8, "old_logprobs": 4096 * 4}
    sizes["rewards"] = 4
    times = []
    for k in range(cycles + 50):
        t0 = time.perf_counter()
        allocation = state.allocate("rollout", n, 0, holder="producer", now=float(k))
        state.commit_write("rollout", allocation.indexes, sizes)
        lease = state.claim("rollout", "trainer", columns, n, holder="consumer", now=float(k))
        assert lease is not None
        state.ack(lease.id)
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times[50:])


CLIENT_SPEC = tq.TopicSpec.from_dict(
    {
        "consumers": ["trainer"],
        "staleness": 1000,
        "capacity": 2048,
        "columns": {
            "prompt": {"dtype": "int64", "shape": [256], "shared": True},
            "resp": {"dtype": "int64", "shape": [1024]},
        },
    },
    name="rollout",
)


async def clients_1024(tasks: int = 1024, groups: int = 4, size: int = 4) -> tuple[float, float]:
    """(samples/s, peak unit RSS in MB) with ``tasks`` concurrent client tasks."""
    cfg = tq.TransferQueueConfig(topics=(CLIENT_SPEC,), units=2, placement="process")
    writers = readers = tasks // 2
    async with afa.open_actor_system() as system, tq.open_transfer_queue(system, cfg) as queue:
        pids = [pid for pid in (await queue.unit_pids()).values() if pid is not None]

        async def writer(w: int) -> None:
            client = await queue.client()
            for g in range(groups):
                prompt = torch.full((256,), w)
                slot = await client.open_group("rollout", size, shared={"prompt": prompt})
                rows = torch.full((size, 1024), w * groups + g)
                version = (w * groups + g) // 256
                await client.put("rollout", {"resp": rows}, version=version, group=slot)

        async def reader() -> None:
            client = await queue.client()
            for _ in range(groups):
                batch = await client.get(
                    "rollout", "trainer", ["resp", "prompt"], size, sampler=tq.WHOLE_GROUPS
                )
                await client.ack(batch)

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for w in range(writers):
                nursery.start_soon(writer, w)
            for _ in range(readers):
                nursery.start_soon(reader)
        elapsed = time.perf_counter() - t0
        rss = max(_peak_rss_mb(pid) for pid in pids)
    return writers * groups * size / elapsed, rss


def _peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def dedup_saved() -> int:
    data = make_batch()
    cfg = tq.TransferQueueConfig(topics=(spec(shared_prompt=True),), units=2)
    async with afa.open_actor_system() as system, tq.open_transfer_queue(system, cfg) as queue:
        client = await queue.client()
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


GROUPS, GROUP_SIZE = 16, 8
GROUP_SPEC = tq.TopicSpec(
    name="rollout",
    columns={
        "prompt_ids": tq.ColumnSpec(dtype="int64", shape=(256,), shared=True),
        "response_ids": tq.ColumnSpec(dtype="int64", shape=(512,)),
        "old_logprobs": tq.ColumnSpec(dtype="float32", shape=(512,)),
    },
    consumers=("trainer",),
    staleness=4,
)


class _Counted(afa.ActorRef[Any]):
    """Passes everything to ``ref``, counting requests (asks) and tells."""

    def __init__(self, ref: afa.ActorRef[Any], counter: list[int]) -> None:
        self.ref, self.counter = ref, counter

    @property
    def name(self) -> str:
        return self.ref.name

    async def ask(self, request: Any) -> Any:
        self.counter[0] += 1
        return await self.ref.ask(request)

    async def send(self, msg: Any) -> None:
        self.counter[0] += 1
        await self.ref.send(msg)

    def send_nowait(self, msg: Any) -> None:
        self.counter[0] += 1
        self.ref.send_nowait(msg)

    async def send_tracked(self, msg: Any) -> afa.Tracker:
        self.counter[0] += 1
        return await self.ref.send_tracked(msg)

    async def stop(self) -> None:
        await self.ref.stop()

    def statistics(self) -> Any:
        return self.ref.statistics()

    def _watch(self, watcher: Any) -> None:
        self.ref._watch(watcher)

    def _unwatch(self, watcher: Any) -> None:
        self.ref._unwatch(watcher)


async def group_batches(steps: int = 20, repeats: int = REPEATS) -> dict[str, list[float]]:
    """Per repeat, the medians over ``steps`` steps of CPU ms and client requests a step, of the
    per-group calls (``old``), of ``open_groups`` with per-group puts (``open``) and of the
    batched calls (``new``), in rotation step by step."""
    prompts = [torch.full((256,), g) for g in range(GROUPS)]
    rows = GROUPS * GROUP_SIZE
    data = {
        "response_ids": torch.arange(rows * 512).reshape(rows, 512),
        "old_logprobs": torch.rand(rows, 512),
    }
    per_group = [{k: v[g * 8 : g * 8 + 8] for k, v in data.items()} for g in range(GROUPS)]

    async def per_group_step(client: tq.TransferQueueClient, version: int) -> None:
        for g in range(GROUPS):
            shared = {"prompt_ids": prompts[g]}
            slot = await client.open_group("rollout", GROUP_SIZE, shared=shared)
            await client.put("rollout", per_group[g], version=version, group=slot)

    async def opened_step(client: tq.TransferQueueClient, version: int) -> None:
        shared = [{"prompt_ids": p} for p in prompts]
        slots = await client.open_groups("rollout", [GROUP_SIZE] * GROUPS, shared=shared)
        for g, slot in enumerate(slots):
            await client.put("rollout", per_group[g], version=version, group=slot)

    async def batched_step(client: tq.TransferQueueClient, version: int) -> None:
        shared = [{"prompt_ids": p} for p in prompts]
        slots = await client.open_groups("rollout", [GROUP_SIZE] * GROUPS, shared=shared)
        owners = [s.group_id for s in slots for _ in range(GROUP_SIZE)]
        await client.put("rollout", data, version=version, group=owners)

    kinds = {"old": per_group_step, "open": opened_step, "new": batched_step}
    out: dict[str, list[float]] = {f"{m}_{k}": [] for m in ("cpu", "req") for k in kinds}
    cfg = tq.TransferQueueConfig(topics=(GROUP_SPEC,), units=2)
    async with afa.open_actor_system() as system, tq.open_transfer_queue(system, cfg) as queue:
        client = await queue.client()
        counter = [0]
        client.controller = _Counted(client.controller, counter)
        client.io.units = {u: _Counted(r, counter) for u, r in client.io.units.items()}
        reader = await queue.client()
        for repeat in range(repeats + 1):  # the first: warm-up
            figures: dict[str, list[float]] = {k: [] for k in out}
            for step in range(len(kinds) * steps):
                kind = list(kinds)[(step + repeat) % len(kinds)]
                await client.flush()
                counter[0] = 0
                t0 = time.process_time()
                await kinds[kind](client, 0)
                await client.flush()
                figures[f"cpu_{kind}"].append((time.process_time() - t0) * 1e3)
                figures[f"req_{kind}"].append(counter[0] - 1)  # not the flush
                batch = await reader.get("rollout", "trainer", ["response_ids"], rows)
                assert batch is not None and len(batch) == rows
                await reader.ack(batch)
            if repeat:
                for key, values in figures.items():
                    out[key].append(statistics.median(values))
    return out


def spread(values: list[float]) -> str:
    return f"[{min(values):.3g}, {max(values):.3g}]"


async def latency_rounds() -> list[float]:
    """Only the small-batch rounds (``--only latency``): one warm queue, no throughput rounds."""
    data, small = make_batch(), make_batch(8)
    async with afa.open_actor_system() as system, tq.open_transfer_queue(system, config()) as q:
        client = await q.client()
        for _ in range(WARMUP):
            await client.put("rollout", data, version=0)
            await client.ack(await client.get("rollout", "trainer", COLUMNS, N))
        return [await latency(client, small) for _ in range(REPEATS)]


FIGURES = (
    "throughput",
    "latency",
    "startup",
    "controller",
    "claims",
    "clients",
    "dedup",
    "groups",
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--only",
        default=",".join(FIGURES),
        help=f"comma-separated figures to measure, of {','.join(FIGURES)} (default: all)",
    )
    only = set(parser.parse_args(argv).only.split(","))
    if not only <= set(FIGURES):
        parser.error(f"unknown figures {sorted(only - set(FIGURES))}; known: {FIGURES}")
    med = statistics.median
    if "throughput" in only:
        figures: dict[str, Any] = trio.run(data_path)
        print(
            f"# raw {spread(figures['raw'])} shm {spread(figures['shm'])} socket "
            f"{spread(figures['socket'])} MB/s; latency {spread(figures['latency'])} ms",
            file=sys.stderr,
        )
        emit("tq_throughput", med(figures["shm"]), "MB/s", med(figures["raw"]))
        emit("tq_throughput_socket", med(figures["socket"]), "MB/s", med(figures["raw"]))
    elif "latency" in only:
        figures = {"latency": trio.run(latency_rounds)}
        print(f"# latency {spread(figures['latency'])} ms", file=sys.stderr)
    if "latency" in only:
        emit("tq_small_batch_latency", med(figures["latency"]), "ms")
    if "startup" in only:
        emit("tq_startup", med(trio.run(startups)), "s")
    if "controller" in only:
        emit("tq_controller_batch_us", controller_batch_us(), "us")
        emit("tq_controller_small_us", controller_batch_us(2000, 8), "us")
    if "claims" in only:
        emit("tq_claims_per_s", bench_claims(), "samples/s")
    if "clients" in only:
        rate, rss = trio.run(clients_1024)
        emit("tq_clients_1024", rate, "samples/s")
        emit("tq_clients_1024_unit_rss", rss, "MB")
    if "dedup" in only:
        emit("tq_group_dedup_bytes_saved", trio.run(dedup_saved), "bytes")
    if "groups" in only:
        g = trio.run(group_batches)
        print(
            "# group batches: CPU ms a step (median [spread of the repeats]) per-group "
            f"{med(g['cpu_old']):.3g} {spread(g['cpu_old'])}, open_groups + per-group puts "
            f"{med(g['cpu_open']):.3g} {spread(g['cpu_open'])}, batched {med(g['cpu_new']):.3g} "
            f"{spread(g['cpu_new'])}; requests {med(g['req_old'])}, {med(g['req_open'])}, "
            f"{med(g['req_new'])}",
            file=sys.stderr,
        )
        emit("tq_group_batch_cpu_ms", med(g["cpu_new"]), "ms", med(g["cpu_old"]))
        emit("tq_group_batch_requests", med(g["req_new"]), "requests", med(g["req_old"]))
        emit("tq_group_batch_speedup", med(g["cpu_old"]) / med(g["cpu_new"]), "x")


if __name__ == "__main__":
    main()
