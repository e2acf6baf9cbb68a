"""The trainer's ranks on CPU (FSDP2, gloo): step time, sync time, memory, LoRA, bf16.

The model: a ``TinyDecoder`` of 8 layers, d_model 512 (25 M parameters, 101 MB in fp32)
exported as a Hugging Face ``LlamaForCausalLM`` folder, built locally (no hub). The global
batch: 16 rows of a 16-token prompt and a 48-token response, token-mean loss, AdamW. Every rank
runs one torch thread (on a 2-core host, 2 ranks use both cores, 1 rank one; 4 ranks share the
2 cores, so their sync time measures the scheduler as much as the sync: it is the figure issue
31 asks for all the same, and the byte figures below do not depend on the load). Times are
medians of ``STEPS`` measured steps after one warm-up step (syncs likewise; ``--sync``: of
``SYNCS``). JSON lines:

- ``trainer_step_2ranks`` (s per global batch, FSDP2 over 2 ranks); baseline: 1 rank; the
  ratio is the scaling (2 cores: ideal 0.5).
- ``trainer_step_2ranks_ddp`` (s): the same with ``sharding = "ddp"`` (replicas, one
  all-reduce of the gradients: the option for a model that fits a rank); baseline: 1 rank.
- ``trainer_step_cpu_2ranks`` (s): rank 0's CPU time per step with 2 ranks; baseline: 1 rank
  (its share of the work, whatever the host's load; ideal 0.5 plus the collectives).
- ``trainer_sync_s_2ranks``, ``trainer_sync_s_4ranks`` (s): a whole weight sync
  (``ShardedSyncEngine``: each rank packs and sends the buckets of its own shards, the actor
  transport, 64 MiB buckets) to one receiver actor in rank 0's process; baseline: the same
  from 1 rank. After each sync the receiver loads the weights (at its next boundary) before
  the next one starts. ``--sync`` takes the sync figures alone, and also
  ``trainer_sync_send_s_{2,4}ranks`` (the syncs' broadcast phase: the sending of the bytes),
  and ``trainer_sync_node_s_{2,4}ranks``, ``trainer_sync_node_send_s_{2,4}ranks``: the same to
  a receiver on a node process of its own (as a rollout engine is), each against 1 rank;
  ``trainer_sync_node_cpu_s_{2,4}ranks``: rank 0's CPU seconds (every thread of its process)
  a sync to the node's receiver, against 1 rank (its share of the work, whatever the load);
  ``trainer_sync_node_ready_s_{2,4}ranks``: from a sync's start until the node's receiver has
  loaded the weights (the sync, then its load at its next 5 ms boundary, which puts the
  tensors split across the ranks' buckets together; polled every 10 ms), against 1 rank.
- ``trainer_sync_shard_bytes_2ranks``, ``..._4ranks`` (bytes): the parameters rank 0 holds,
  which is what each rank puts into the sync's all-gathers; baseline: the whole model (what
  one rank holds).
- ``trainer_sync_peak_rise_1rank``, ``..._2ranks``, ``..._4ranks`` (bytes): how far rank 0's
  resident memory rises during its first sync (``sync_memory``: a fresh process each, 8 MiB
  buckets, the receiver on a node process, glibc mapping every block from 1 MiB on by itself);
  baseline: the same with a rank-0 funnel (the full state dict gathered on rank 0, then sent by
  a plain ``CheckpointEngine``). Two bucket buffers, never the model a second time.
- ``trainer_lora_sync_bytes`` (bytes): a LoRA (r 8, q/k/v/o) adapters-only sync's payload;
  baseline: the full model's (what a merged sync sends).
- ``trainer_lora_optimizer_bytes`` (bytes): AdamW's state after a step with LoRA (the
  adapters' moments), summed over the 2 ranks; baseline: full fine-tuning's.
- ``trainer_bf16_step`` (s): a 2-rank step with ``dtype = "bf16"``; baseline: fp32.
- ``trainer_step_rank_bytes_2ranks`` (bytes): what rank 1 receives for a step when each rank
  fetches its own rows from the TransferQueue (the ``step_rows`` command, and the most bytes
  of rows a rank fetched); baseline: the ``step`` command broadcasting every row.
  ``trainer_step_rank_fetch_s_2ranks`` (s): such a step, from the claim of its lease to the
  end of the update; baseline: the same with rank 0 fetching and broadcasting every row. The
  two alternate, step by step, on one group and one queue (units on node processes, shared
  memory); ``--rank-fetch`` takes these figures alone.
- ``forward_rank_bytes_2ranks`` (bytes): what rank 1 of a forward station
  (``train.forward_ranks = 2``) receives for a batch of 16 rows when each rank fetches its own
  rows (the ``forward_rows`` command, and the most bytes of rows a rank fetched); baseline: the
  ``forward`` command broadcasting every row. ``forward_rank_fetch_s_2ranks`` (s): such a
  batch, from the claim of its lease to the log-probs on rank 0; baseline: the broadcast.
  Alternated batch by batch on one group and one queue; ``--forward-fetch`` takes these alone.

A ``#`` line on stderr gives the load average at the start and the end, rank 0's resident
memory before each memory figure's sync and its rise, and ``DistributedLearner.memory()`` of
full fine-tuning and of LoRA.

Run: ``PYTHONPATH=benchmarks:src python benchmarks/bench_trainer.py`` (13 minutes at load
12-19 on 2 cores; no quiet run timed).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NamedTuple

import attrs
import torch
import trio
from common import emit

import asyncflow_actors as afa
from asyncflow_actors.checkpoint import CheckpointConfig, GetReceiverStatistics
from asyncflow_actors.models import CharTokenizer, TinyConfig, TinyDecoder
from asyncflow_actors.roles import (
    AlgorithmSettings,
    DistributedLearner,
    LoraSettings,
    ModelSettings,
    ParallelSettings,
    RunSpec,
    ShardedSyncEngine,
    TrainSettings,
)
from asyncflow_actors.rollout import export_hf

STEPS = 3
SYNCS = 7  # ``--sync``: syncs a figure (their median), the sync figures alone
MEMORY_BUCKET = 8 << 20  # the memory figures' buckets: well below the model's 101 MB
ROWS, PROMPT, RESPONSE = 16, 16, 48


def build_model(folder: Path) -> None:
    tokenizer = CharTokenizer("0123456789+=")
    torch.manual_seed(0)
    config = TinyConfig(vocab_size=tokenizer.vocab_size, d_model=512, n_layers=8, n_heads=8,
                        max_seq_len=128)  # fmt: skip
    export_hf(folder, TinyDecoder(config), tokenizer)


def batch() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 12, (PROMPT,), generator=g) for _ in range(ROWS)]
    responses = [torch.randint(3, 12, (RESPONSE,), generator=g) for _ in range(ROWS)]
    return {
        "prompt_ids": prompts,
        "response_ids": responses,
        "old_logprobs": [torch.full((RESPONSE,), -2.5) for _ in range(ROWS)],
        "behaviour_logprobs": [torch.full((RESPONSE,), -2.5) for _ in range(ROWS)],
        "advantages": [torch.full((RESPONSE,), 1.0 - 2 * (k % 2)) for k in range(ROWS)],
    }


def spec(folder: Path) -> RunSpec:
    return RunSpec(
        mode="async", staleness=1, stage_barrier=False, colocated=False,
        model=ModelSettings(hf=str(folder)), algorithm=AlgorithmSettings(),
        train=TrainSettings(lr=1e-5),
    )  # fmt: skip


def step_time(learner: DistributedLearner) -> tuple[float, float]:
    """Median wall seconds of a step, and rank 0's CPU seconds (every thread of it)."""
    data = batch()
    learner.step(data)  # warm-up
    times, cpu = [], []
    for _ in range(STEPS):
        t0, c0 = time.perf_counter(), time.process_time()
        learner.step(data)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(times), statistics.median(cpu)


class Sync(NamedTuple):
    seconds: float  # median of the measured syncs
    payload: int  # bytes sent
    shard: int  # bytes of the parameters rank 0 holds
    send: float = 0.0  # median of the measured syncs' broadcast phases (the bytes' sending)
    cpu: float = 0.0  # median CPU seconds of rank 0's process (every thread) a sync
    ready: float = 0.0  # median seconds from a sync's start until the receiver has loaded it


def _status(field: str) -> int:
    """A ``/proc/self/status`` figure in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> int:
    """Reset this process's peak resident memory (``VmHWM``) to its current; that level."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _local(param: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return param.to_local() if isinstance(param, DTensor) else param


def shard_bytes(learner: DistributedLearner) -> int:
    """Bytes of the parameters rank 0 holds (its FSDP2 shards)."""
    total = 0
    for _, param in learner.learner.named_parameters():
        local = _local(param)
        total += local.numel() * local.element_size()
    return total


def sync(
    learner: DistributedLearner, *, node: bool = False, syncs: int = STEPS, **config: Any
) -> Sync:
    """``syncs`` whole syncs to one receiver (in rank 0's process, or with ``node`` on a node
    process of its own, as a rollout engine would be), after one more to warm up: their
    median seconds, payload, and rank 0's shard."""
    from sync_targets import BenchReceiver

    async def run() -> Sync:
        async with afa.open_actor_system() as system:
            state = await trio.to_thread.run_sync(learner.full_state_dict)
            keep = CheckpointConfig(**config).tensor_filter()
            specs = {k: list(v.shape) for k, v in state.items() if keep(k)}
            del state
            if node:
                here = os.path.dirname(os.path.abspath(__file__))
                path = here + os.pathsep + os.environ.get("PYTHONPATH", "")
                options = afa.NodeOptions(heartbeat_timeout=30.0)  # it imports torch on its loop
                rx = await system.start_node("rx", allow=["sync_targets"], options=options,
                                             env={**os.environ, "PYTHONPATH": path})  # fmt: skip
                ref = await rx.spawn("sync_targets:BenchReceiver", name="receiver",
                                     kwargs={"specs": specs})  # fmt: skip
            else:
                ref = await system.spawn(lambda: BenchReceiver(specs), name="receiver")
            cfg = CheckpointConfig(bucket_bytes=64 << 20, **config)
            engine = ShardedSyncEngine(learner, [ref], cfg)
            times, sends, cpu, ready, payload = [], [], [], [], 0
            for version in range(syncs + 1):
                t0, c0 = time.perf_counter(), time.process_time()
                result = await engine.sync(version)
                if version:  # the first one warms up
                    times.append(time.perf_counter() - t0)
                    cpu.append(time.process_time() - c0)
                    sends.append(result.broadcast_s)
                payload = result.payload_bytes
                # the receiver loads at its next boundary (on its loop): let it, as a trainer's
                # step would, so that the next sync's pause does not wait for this load (its
                # pending version clears when the load starts: wait for the target's version)
                while (await ref.ask(GetReceiverStatistics())).version != version:
                    await trio.sleep(0.01)
                ready.append(time.perf_counter() - t0)
            return Sync(statistics.median(times), payload, shard_bytes(learner),
                        statistics.median(sends), statistics.median(cpu),
                        statistics.median(ready[1:]))  # fmt: skip

    return trio.run(run)


def sync_memory(ranks: int, funnel: bool, folder: Path) -> dict[str, int]:
    """In a fresh process (``--sync-memory``: nothing freed earlier for the allocator to
    hand back), rank 0's resident bytes before its first sync (``rss``) and how far they rose
    during it (``rise``), 8 MiB buckets, to a receiver on a node process: the
    ``ShardedSyncEngine``, or with ``funnel`` the whole state dict gathered on rank 0 and sent
    by a plain ``CheckpointEngine``."""
    from asyncflow_actors.checkpoint import CheckpointEngine

    async def run(learner: DistributedLearner) -> dict[str, int]:
        specs = {name: list(p.shape) for name, p in learner.learner.named_parameters()}
        here = os.path.dirname(os.path.abspath(__file__))
        env = {**os.environ, "PYTHONPATH": here + os.pathsep + os.environ.get("PYTHONPATH", "")}
        options = afa.NodeOptions(heartbeat_timeout=30.0)  # the node imports torch on its loop
        async with afa.open_actor_system() as system:
            # the receiver in a node process of its own: its staged copy is not rank 0's
            node = await system.start_node("rx", allow=["sync_targets"], env=env, options=options)
            kwargs = {"specs": specs}
            ref = await node.spawn("sync_targets:BenchReceiver", name="receiver", kwargs=kwargs)
            cfg = CheckpointConfig(bucket_bytes=MEMORY_BUCKET)
            for _, param in learner.learner.named_parameters():  # page them in first: a
                _local(param).sum()  # model loaded from safetensors may still be file-mapped
            before = _reset_peak()
            if funnel:
                state = await trio.to_thread.run_sync(learner.full_state_dict)
                await CheckpointEngine([ref], cfg).sync(0, state)
                del state
            else:
                await ShardedSyncEngine(learner, [ref], cfg).sync(0)
            return {"rss": before, "rise": _status("VmHWM") - before}

    with DistributedLearner.open(spec(folder), ParallelSettings(ranks=ranks)) as learner:
        return trio.run(run, learner)


def memory_of(ranks: int, funnel: bool, folder: Path) -> dict[str, int]:
    """``sync_memory`` in a child process."""
    args = [sys.executable, __file__, "--sync-memory", str(ranks), str(int(funnel)), str(folder)]
    # glibc: every block from 1 MiB on mapped on its own and unmapped when freed (no dynamic
    # threshold, no arena keeping freed buffers): resident memory follows what is live
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    out = subprocess.run(args, capture_output=True, text=True, check=True, env=env)
    figures: dict[str, int] = json.loads(out.stdout.strip().splitlines()[-1])
    return figures


def sync_only() -> None:
    """``--sync``: the sync figures alone, from 1, 2 and 4 ranks, to a receiver in rank 0's
    process (``trainer_sync_s_*``) and to one on a node process (``trainer_sync_node_s_*``)."""
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        build_model(folder)
        local, node = {}, {}
        for ranks in (1, 2, 4):
            with DistributedLearner.open(spec(folder), ParallelSettings(ranks=ranks)) as group:
                local[ranks] = sync(group, syncs=SYNCS)
                node[ranks] = sync(group, node=True, syncs=SYNCS)
    for figure, runs in (("sync", local), ("sync_node", node)):
        for n in (2, 4):
            emit(f"trainer_{figure}_s_{n}ranks", runs[n].seconds, "s", runs[1].seconds)
        for n in (2, 4):
            emit(f"trainer_{figure}_send_s_{n}ranks", runs[n].send, "s", runs[1].send)
    for n in (2, 4):  # rank 0's share of the work, whatever the load (its receiver elsewhere)
        emit(f"trainer_sync_node_cpu_s_{n}ranks", node[n].cpu, "s", node[1].cpu)
    for n in (2, 4):  # the sync and the receiver's load after it (10 ms polls)
        emit(f"trainer_sync_node_ready_s_{n}ranks", node[n].ready, "s", node[1].ready)
    print(f"# load average at the start {load_start}, at the end {os.getloadavg()}; "
          f"1 rank: {local[1].seconds:.3f} s here, {node[1].seconds:.3f} s to a node",
          file=sys.stderr)  # fmt: skip


CLAIMED = ("prompt_ids", "response_ids", "behaviour_logprobs", "token_versions",
           "old_logprobs", "advantages")  # fmt: skip


def command_bytes(header: dict[str, Any], tensors: list[torch.Tensor]) -> int:
    """Bytes a rank > 0 receives of a command: its msgpack header and its tensors."""
    import msgspec

    return len(msgspec.msgpack.encode(header)) + sum(int(t.nbytes) for t in tensors)


async def rank_fetch_steps(group: DistributedLearner) -> dict[str, list[float]]:
    """Steps of the global batch alternately broadcast by rank 0 and fetched by each rank
    from a queue (``trainer_step_rank_*``): each kind's seconds and bytes rank 1 receives."""
    from asyncflow_actors.roles import _schema as S
    from asyncflow_actors.roles._rank_fetch import RANK_FETCH, rank_leases, step_data
    from asyncflow_actors.roles._rank_host import encode_batch
    from asyncflow_actors.transfer_queue import TransferQueueConfig, open_transfer_queue

    topic = S.topic_specs(group.learner.spec)[1]
    config = TransferQueueConfig(topics=(topic,), units=2, placement="process")
    data = batch()
    out: dict[str, list[float]] = {"broadcast": [], "fetch": [], "broadcast_bytes": [],
                                   "fetch_bytes": []}  # fmt: skip
    async with afa.open_actor_system() as system, open_transfer_queue(system, config) as queue:
        client = await queue.client()

        async def put() -> None:
            slots = await client.open_groups(
                S.ROLLOUT, [1] * ROWS, [{S.PROMPT_IDS: p} for p in data["prompt_ids"]]
            )
            rows = {name: data[name] for name in CLAIMED if name in data and name != S.PROMPT_IDS}
            rows[S.TOKEN_VERSIONS] = [torch.zeros(RESPONSE, dtype=torch.long)] * ROWS
            await client.put(S.ROLLOUT, rows, version=0, group=list(slots))

        async def broadcast() -> tuple[float, int]:
            await put()
            t0 = time.perf_counter()
            got = await client.get(S.ROLLOUT, "trainer", CLAIMED, ROWS)
            step = {c: got.expand(c) if c in got.shared else got[c] for c in data}
            await trio.to_thread.run_sync(group.step, step)
            seconds = time.perf_counter() - t0
            await client.ack(got)
            layout, tensors = encode_batch(step)
            return seconds, command_bytes({"op": "step", "layout": layout}, tensors)

        async def fetch() -> tuple[float, int]:
            await put()
            t0 = time.perf_counter()
            got = await client.get(S.ROLLOUT, "trainer", CLAIMED, ROWS,
                                   fetch=[S.PROMPT_IDS, S.TOKEN_VERSIONS])  # fmt: skip
            step = {S.PROMPT_IDS: got.expand(S.PROMPT_IDS), S.TOKEN_VERSIONS: got[S.TOKEN_VERSIONS],
                    RANK_FETCH: await rank_leases(client, topic, got)}  # fmt: skip
            metrics = await trio.to_thread.run_sync(group.step_leased, step)
            seconds = time.perf_counter() - t0
            await client.ack(got)
            header, tensors = step_data(step)
            return seconds, command_bytes(header, tensors) + int(metrics["fetched_bytes"])

        await _alternate(out, broadcast, fetch)
    return out


async def _alternate(
    out: dict[str, list[float]],
    broadcast: Callable[[], Awaitable[tuple[float, float]]],
    fetch: Callable[[], Awaitable[tuple[float, float]]],
) -> None:
    """One warm-up of each, then ``STEPS`` of both alternated: seconds and bytes into ``out``."""
    await broadcast()
    await fetch()
    for _ in range(STEPS):
        for kind, take in (("broadcast", broadcast), ("fetch", fetch)):
            seconds, nbytes = await take()
            out[kind].append(seconds)
            out[f"{kind}_bytes"].append(nbytes)


def rank_fetch_only(folder: Path | None = None) -> None:
    """``--rank-fetch``: the ``trainer_step_rank_*`` figures alone."""
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        if folder is None:
            folder = Path(tmp) / "model"
            build_model(folder)
        with DistributedLearner.open(spec(folder), ParallelSettings(ranks=2)) as two:
            runs = trio.run(rank_fetch_steps, two)
    emit("trainer_step_rank_bytes_2ranks", statistics.median(runs["fetch_bytes"]), "bytes",
         statistics.median(runs["broadcast_bytes"]))  # fmt: skip
    emit("trainer_step_rank_fetch_s_2ranks", statistics.median(runs["fetch"]), "s",
         statistics.median(runs["broadcast"]))  # fmt: skip
    print(f"# rank fetch: load average at the start {load_start}, at the end "
          f"{os.getloadavg()}; steps (s) broadcast {runs['broadcast']}, fetch {runs['fetch']}",
          file=sys.stderr)  # fmt: skip


async def forward_fetch_batches(group: Any, topic: Any) -> dict[str, list[float]]:
    """A forward station's batches alternately broadcast by rank 0 and fetched by each rank
    from a queue (``forward_rank_*``): each kind's seconds and bytes rank 1 receives."""
    from asyncflow_actors.roles import _schema as S
    from asyncflow_actors.roles._forward_fetch import header_of
    from asyncflow_actors.roles._rank_fetch import rank_leases
    from asyncflow_actors.roles._rank_host import encode_batch
    from asyncflow_actors.transfer_queue import TransferQueueConfig, open_transfer_queue

    config = TransferQueueConfig(topics=(topic,), units=2, placement="process")
    data = batch()
    claimed = [S.PROMPT_IDS, S.RESPONSE_IDS]
    out: dict[str, list[float]] = {"broadcast": [], "fetch": [], "broadcast_bytes": [],
                                   "fetch_bytes": []}  # fmt: skip
    options = {"pad_id": 0, "temperature": 1.0}
    async with afa.open_actor_system() as system, open_transfer_queue(system, config) as queue:
        client = await queue.client()

        async def put() -> None:
            slots = await client.open_groups(
                S.ROLLOUT, [1] * ROWS, [{S.PROMPT_IDS: p} for p in data["prompt_ids"]]
            )
            await client.put(S.ROLLOUT, {S.RESPONSE_IDS: data[S.RESPONSE_IDS]}, version=0,
                             group=list(slots))  # fmt: skip

        async def broadcast() -> tuple[float, int]:
            await put()
            t0 = time.perf_counter()
            got = await client.get(S.ROLLOUT, "actor_fwd", claimed, ROWS)
            rows = {S.PROMPT_IDS: got.expand(S.PROMPT_IDS), S.RESPONSE_IDS: got[S.RESPONSE_IDS]}
            rows = {c: list(v) for c, v in rows.items()}
            await trio.to_thread.run_sync(
                lambda: group.logprobs(rows[S.PROMPT_IDS], rows[S.RESPONSE_IDS], **options)
            )
            seconds = time.perf_counter() - t0
            await client.ack(got)
            layout, tensors = encode_batch(rows)
            return seconds, command_bytes({"op": "forward", "layout": layout, **options},
                                          tensors)  # fmt: skip

        async def fetch() -> tuple[float, int]:
            await put()
            t0 = time.perf_counter()
            got = await client.get(S.ROLLOUT, "actor_fwd", claimed, ROWS, fetch=[])
            leases = await rank_leases(client, topic, got)
            assert leases is not None
            _, fetched = await trio.to_thread.run_sync(
                lambda: group.logprobs_leased(leases, range(ROWS), **options)
            )
            seconds = time.perf_counter() - t0
            await client.ack(got)
            header = header_of(leases, range(ROWS), **options)
            return seconds, command_bytes(header, []) + int(fetched)

        await _alternate(out, broadcast, fetch)
    return out


def forward_fetch_only(folder: Path | None = None) -> None:
    """``--forward-fetch``: the ``forward_rank_*`` figures alone."""
    from asyncflow_actors.roles import _schema as S
    from asyncflow_actors.roles._forward_ranks import ForwardGroup

    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        if folder is None:
            folder = Path(tmp) / "model"
            build_model(folder)
        run = spec(folder)
        run = attrs.evolve(run, train=attrs.evolve(run.train, forward_ranks=2))
        with ForwardGroup.open(run) as group:
            runs = trio.run(forward_fetch_batches, group, S.topic_specs(run)[1])
    emit("forward_rank_bytes_2ranks", statistics.median(runs["fetch_bytes"]), "bytes",
         statistics.median(runs["broadcast_bytes"]))  # fmt: skip
    emit("forward_rank_fetch_s_2ranks", statistics.median(runs["fetch"]), "s",
         statistics.median(runs["broadcast"]))  # fmt: skip
    print(f"# forward fetch: load average at the start {load_start}, at the end "
          f"{os.getloadavg()}; batches (s) broadcast {runs['broadcast']}, fetch {runs['fetch']}",
          file=sys.stderr)  # fmt: skip


def _mb(n: int) -> str:
    return f"{n / 1e6:.0f} MB"


def main() -> None:
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        build_model(folder)
        run = spec(folder)
        with DistributedLearner.open(run, ParallelSettings(ranks=1)) as one:
            step_1, cpu_1 = step_time(one)
            sync_1 = sync(one)
        with DistributedLearner.open(run, ParallelSettings(ranks=2)) as two:
            step_2, cpu_2 = step_time(two)
            sync_2 = sync(two)
            full_memory = two.memory()
            two.setup(run, ParallelSettings(ranks=2, dtype="bf16"))
            step_bf16, _ = step_time(two)
            lora = LoraSettings(
                r=8, alpha=16, target_modules=("q_proj", "k_proj", "v_proj", "o_proj")
            )
            two.setup(run, ParallelSettings(ranks=2), lora)
            two.step(batch())  # the adapters' optimizer state
            lora_memory = two.memory()
            lora_sync = sync(two, lora_only=True)
        with DistributedLearner.open(run, ParallelSettings(ranks=2, sharding="ddp")) as ddp:
            step_ddp, _ = step_time(ddp)
        with DistributedLearner.open(run, ParallelSettings(ranks=4)) as four:
            sync_4 = sync(four)
        rises = {n: memory_of(n, False, folder) for n in (1, 2, 4)}
        funnels = {n: memory_of(n, True, folder) for n in (2, 4)}
        emit("trainer_step_2ranks", step_2, "s", step_1)
        emit("trainer_step_cpu_2ranks", cpu_2, "s", cpu_1)
        emit("trainer_step_2ranks_ddp", step_ddp, "s", step_1)
        emit("trainer_sync_s_2ranks", sync_2.seconds, "s", sync_1.seconds)
        emit("trainer_sync_s_4ranks", sync_4.seconds, "s", sync_1.seconds)
        emit("trainer_sync_shard_bytes_2ranks", sync_2.shard, "bytes", sync_1.shard)
        emit("trainer_sync_shard_bytes_4ranks", sync_4.shard, "bytes", sync_1.shard)
        emit("trainer_sync_peak_rise_1rank", rises[1]["rise"], "bytes")
        for n in (2, 4):
            emit(f"trainer_sync_peak_rise_{n}ranks", rises[n]["rise"], "bytes",
                 funnels[n]["rise"])  # fmt: skip
        emit("trainer_lora_sync_bytes", lora_sync.payload, "bytes", sync_2.payload)
        emit("trainer_lora_optimizer_bytes", lora_memory["optimizer_bytes"], "bytes",
             full_memory["optimizer_bytes"])  # fmt: skip
        emit("trainer_bf16_step", step_bf16, "s", step_2)
        rank_fetch_only(folder)
        forward_fetch_only(folder)
    memory = ", ".join(
        [f"{n} rank(s) {_mb(m['rss'])} + {_mb(m['rise'])}" for n, m in rises.items()]
        + [f"funnel {n} ranks {_mb(m['rss'])} + {_mb(m['rise'])}" for n, m in funnels.items()]
    )
    print(f"# load average (1, 5, 15 min) at the start {load_start}, at the end "
          f"{os.getloadavg()}; rank 0's resident memory before its first sync + its rise: "
          f"{memory}; full fine-tuning {full_memory}, LoRA {lora_memory}",
          file=sys.stderr)  # fmt: skip


if __name__ == "__main__":
    if sys.argv[1:2] == ["--sync"]:
        sys.exit(sync_only())
    if sys.argv[1:2] == ["--rank-fetch"]:
        sys.exit(rank_fetch_only())
    if sys.argv[1:2] == ["--forward-fetch"]:
        sys.exit(forward_fetch_only())
    if sys.argv[1:2] == ["--sync-memory"]:
        ranks, funnel, folder = sys.argv[2:5]
        print(json.dumps(sync_memory(int(ranks), bool(int(funnel)), Path(folder))))
        sys.exit(0)
    sys.exit(main())
