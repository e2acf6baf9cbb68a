"""Weight sync of a 400 MB float32 state to 2 receiver processes, against raw pyzmq.

The state: 100 tensors (60 small of 16 KiB, 36 of 6 MiB, 4 of ~46 MiB), random values. The
receivers: ``sync_targets.BenchReceiver`` actors on 2 node processes (ipc), each loading into its
own 400 MB model. Prints JSON lines (medians over rounds; baseline rounds interleaved):

- ``weight_sync_bandwidth`` (GB/s): state bytes / wall time of a whole sync (pause to resume,
  actor transport over zmq ipc, default bucket size, checksums on), delivered to both receivers;
  baseline: raw pyzmq ipc PUSH/PULL of the same 100 tensors (``copy=False``) from this process to
  a plain blocking PULL loop in a worker thread of the *same* receiver processes, timed until
  both acknowledge. Target ratio >= 0.5.
- ``weight_sync_bandwidth_bucket_<n>MiB``: the same for a sweep of bucket sizes.
- ``weight_sync_receiver_stall`` (fraction): time a receiver's event loop woke late (a 1 ms
  ticker, lateness over 1 ms counted) over the time the sync ran there, with the host cache and
  lazy load; baseline: the same receivers loading eagerly (on the loop, before resuming). Lower is
  better; target <= 0.1. ``weight_sync_lazy_load_s``: the load at the batch boundary, outside.
- ``weight_sync_gloo_bandwidth`` (GB/s): the same sync over a gloo broadcast (baseline: the raw
  zmq figure of the same run, for scale); ``weight_sync_gloo_topology_s``: building its group.
- ``weight_sync_phase_<phase>`` (s): phase timings of the default sync.

Run: ``nox -s bench -- bench_weight_sync`` or ``PYTHONPATH=benchmarks python
benchmarks/bench_weight_sync.py [rounds]``.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import trio
import zmq

import asyncflow_actors as afa
from asyncflow_actors.checkpoint import CheckpointConfig, CheckpointEngine, SyncResult

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit
from sync_targets import GetStall, Stall, StartRaw

MiB = 1 << 20
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
SWEEP = (4, 16, 64, 256)
DEFAULT_BUCKET = CheckpointConfig().bucket_bytes // MiB
OPTIONS = afa.NodeOptions(heartbeat_timeout=30.0)  # nodes import torch on their loop


def make_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    sizes = [4096] * 60 + [6 * MiB // 4] * 36
    rest = 400 * MiB // 4 - sum(sizes)
    sizes += [rest // 4] * 3 + [rest - 3 * (rest // 4)]
    return {f"layers.{i}.weight": torch.randn(n, generator=gen) for i, n in enumerate(sizes)}


def raw_round(socks: list[Any], acks: list[Any], tensors: list[torch.Tensor]) -> float:
    """Seconds to push every tensor to every receiver and hear both acknowledge."""
    started = time.perf_counter()
    for tensor in tensors:
        for sock in socks:
            sock.send(tensor.numpy(), copy=False)
    for sock in socks:
        sock.send(b"end")
    for ack in acks:
        ack.recv()
    return time.perf_counter() - started


async def timed(
    engine: CheckpointEngine, version: int, state: dict[str, torch.Tensor]
) -> tuple[SyncResult, list[Stall]]:
    """One sync, then wait until every receiver has loaded it (a lazy one at its next batch
    boundary), so the next sync starts on idle receivers."""
    result = await engine.sync(version, state)
    stalls = [await ref.ask(GetStall()) for ref in engine.targets]
    return result, stalls


async def main() -> None:
    state = make_state()
    total = sum(t.nbytes for t in state.values())
    specs = {name: list(t.shape) for name, t in state.items()}
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": here + os.pathsep + os.environ.get("PYTHONPATH", "")}
    tmp = tempfile.mkdtemp(prefix="afa-bench-sync-")
    ctx = zmq.Context()
    raw_socks: list[Any] = []
    raw_acks: list[Any] = []
    async with afa.open_actor_system() as system:
        nodes = [
            await system.start_node(f"rx{i}", allow=["sync_targets"], env=env, options=OPTIONS)
            for i in range(2)
        ]
        lazy = [
            await n.spawn("sync_targets:BenchReceiver", name="lazy", kwargs={"specs": specs})
            for n in nodes
        ]
        eager = [
            await n.spawn(
                "sync_targets:BenchReceiver", name="eager", kwargs={"specs": specs, "load": "eager"}
            )
            for n in nodes
        ]
        for i, ref in enumerate(lazy):
            pull, ack = f"ipc://{tmp}/raw-{i}", f"ipc://{tmp}/ack-{i}"
            await ref.ask(StartRaw(pull, ack))
            push, back = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
            push.connect(pull)
            back.connect(ack)
            raw_socks.append(push)
            raw_acks.append(back)
        tensors = list(state.values())
        raw_round(raw_socks, raw_acks, tensors[:2])  # connected and warm

        default = CheckpointEngine(lazy)
        gloo = CheckpointEngine(lazy, CheckpointConfig(transport="gloo"))
        eager_engine = CheckpointEngine(eager)
        sweep = {
            size: CheckpointEngine(lazy, CheckpointConfig(bucket_bytes=size * MiB))
            for size in SWEEP
        }
        raw: list[float] = []
        ours: list[float] = []
        gloo_bw: list[float] = []
        gloo_topology: list[float] = []
        swept: dict[int, list[float]] = {size: [] for size in SWEEP}
        stall_lazy: list[float] = []
        stall_eager: list[float] = []
        lazy_load: list[float] = []
        phases: dict[str, list[float]] = {}
        version = 0
        for _ in range(ROUNDS):
            raw.append(total / raw_round(raw_socks, raw_acks, tensors) / 1e9)
            version += 1
            result, stalls = await timed(default, version, state)
            ours.append(total / result.total_s / 1e9)
            for key, value in result.metrics().items():
                phases.setdefault(key, []).append(value)
            stall_lazy += [s.blocked / s.window for s in stalls]
            lazy_load += [s.load for s in stalls]
            _, stalls = await timed(eager_engine, version, state)
            stall_eager += [s.blocked / s.window for s in stalls]
            version += 1
            gloo_result = (await timed(gloo, version, state))[0]
            gloo_bw.append(total / gloo_result.total_s / 1e9)
            gloo_topology.append(gloo_result.topology_s)
            for size, engine in sweep.items():
                version += 1
                swept[size].append(total / (await timed(engine, version, state))[0].total_s / 1e9)
        for sock in raw_socks:
            sock.send(b"quit")
        med = statistics.median
        emit("weight_sync_bandwidth", med(ours), "GB/s", med(raw))
        for size in SWEEP:
            emit(f"weight_sync_bandwidth_bucket_{size}MiB", med(swept[size]), "GB/s", med(raw))
        emit("weight_sync_receiver_stall", med(stall_lazy), "fraction", med(stall_eager))
        emit("weight_sync_lazy_load_s", med(lazy_load), "s")
        emit("weight_sync_gloo_bandwidth", med(gloo_bw), "GB/s", med(raw))
        emit("weight_sync_gloo_topology_s", med(gloo_topology), "s")
        for phase in ("pause", "prepare", "topology", "broadcast", "finalize", "resume"):
            emit(f"weight_sync_phase_{phase}", med(phases[f"sync_{phase}"]), "s")
        spread = (min(ours), max(ours), min(raw), max(raw))
        print(
            f"# {ROUNDS} rounds, default bucket {DEFAULT_BUCKET} MiB; ours min/max "
            f"{spread[0]:.2f}/{spread[1]:.2f} GB/s, raw {spread[2]:.2f}/{spread[3]:.2f}",
            file=sys.stderr,
        )
    for sock in raw_socks + raw_acks:
        sock.close(0)
    ctx.term()


if __name__ == "__main__":
    trio.run(main)
