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
- ``weight_sync_small_total_ms`` (ms): a whole sync of a small model (the pipeline benchmark's
  time-to-reward policy: 15 float32 tensors, 109k parameters, 435 KB) to one lazy receiver node
  (ipc), the default config: one fused round and the resume; baseline: the same sync in five
  phases (``fused_bytes=0``), syncs of both alternated, median of ``SMALL_SYNCS`` each per round.
  ``weight_sync_small_cpu_ms``: this process's CPU time per sync (the sender's share), against
  the same baseline.

Run: ``nox -s bench -- bench_weight_sync`` or ``PYTHONPATH=benchmarks python
benchmarks/bench_weight_sync.py [rounds] [--small]`` (``--small``: the small-model lines only).
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
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 5
SMALL_ONLY = "--small" in sys.argv[1:]
SWEEP = (4, 16, 64, 256)
DEFAULT_BUCKET = CheckpointConfig().bucket_bytes // MiB
SMALL_SYNCS = 40  # small-model syncs of each kind per round
OPTIONS = afa.NodeOptions(heartbeat_timeout=30.0)  # nodes import torch on their loop


def make_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    sizes = [4096] * 60 + [6 * MiB // 4] * 36
    rest = 400 * MiB // 4 - sum(sizes)
    sizes += [rest // 4] * 3 + [rest - 3 * (rest // 4)]
    return {f"layers.{i}.weight": torch.randn(n, generator=gen) for i, n in enumerate(sizes)}


def make_small_state() -> dict[str, torch.Tensor]:
    """The shapes of the pipeline benchmark's time-to-reward policy (2 layers, d=64)."""
    gen = torch.Generator().manual_seed(1)
    shapes: dict[str, list[int]] = {"embed.weight": [15, 64]}
    for i in range(2):
        shapes |= {
            f"layers.{i}.attn.wo.weight": [64, 64],
            f"layers.{i}.attn.wqkv.weight": [192, 64],
            f"layers.{i}.attn_norm.weight": [64],
            f"layers.{i}.mlp.w_down.weight": [64, 192],
            f"layers.{i}.mlp.w_gate_up.weight": [384, 64],
            f"layers.{i}.mlp_norm.weight": [64],
        }
    shapes |= {"lm_head.weight": [15, 64], "norm.weight": [64]}
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


async def small_round(
    engines: dict[str, CheckpointEngine], state: dict[str, torch.Tensor], version: int
) -> tuple[dict[str, list[float]], dict[str, list[float]], int]:
    """``SMALL_SYNCS`` syncs with each engine, alternated: wall and CPU seconds of each."""
    wall: dict[str, list[float]] = {name: [] for name in engines}
    cpu: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(SMALL_SYNCS):
        for name, engine in engines.items():
            version += 1
            cpu_started = time.process_time()
            result = await engine.sync(version, state)
            cpu[name].append(time.process_time() - cpu_started)
            wall[name].append(result.total_s)
    return wall, cpu, version


async def small_engines(
    node: afa.Node, state: dict[str, torch.Tensor]
) -> dict[str, CheckpointEngine]:
    """A lazy receiver of the small model on ``node``; the default engine and a phased one."""
    specs = {name: list(t.shape) for name, t in state.items()}
    ref = await node.spawn("sync_targets:BenchReceiver", name="small", kwargs={"specs": specs})
    return {
        "fused": CheckpointEngine([ref]),
        "phased": CheckpointEngine([ref], CheckpointConfig(fused_bytes=0)),
    }


def emit_small(wall: dict[str, list[float]], cpu: dict[str, list[float]]) -> None:
    med = statistics.median
    emit("weight_sync_small_total_ms", 1e3 * med(wall["fused"]), "ms", 1e3 * med(wall["phased"]))
    emit("weight_sync_small_cpu_ms", 1e3 * med(cpu["fused"]), "ms", 1e3 * med(cpu["phased"]))
    rounds = {name: " ".join(f"{1e3 * x:.2f}" for x in values) for name, values in wall.items()}
    print(
        f"# small model, per-round medians (ms): fused {rounds['fused']}; "
        f"phased {rounds['phased']}",
        file=sys.stderr,
    )


async def main_small(env: dict[str, str]) -> None:
    """``--small``: the small-model lines alone (one receiver node)."""
    state = make_small_state()
    async with afa.open_actor_system() as system:
        node = await system.start_node("rx0", allow=["sync_targets"], env=env, options=OPTIONS)
        engines = await small_engines(node, state)
        wall: dict[str, list[float]] = {name: [] for name in engines}
        cpu: dict[str, list[float]] = {name: [] for name in engines}
        version = 0
        version = (await small_round(engines, state, version))[2]  # warm
        for _ in range(ROUNDS):
            walls, cpus, version = await small_round(engines, state, version)
            for name in engines:
                wall[name].append(statistics.median(walls[name]))
                cpu[name].append(statistics.median(cpus[name]))
        emit_small(wall, cpu)


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
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": here + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if SMALL_ONLY:
        await main_small(env)
        return
    state = make_state()
    total = sum(t.nbytes for t in state.values())
    specs = {name: list(t.shape) for name, t in state.items()}
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

        small_state = make_small_state()
        small = await small_engines(nodes[0], small_state)
        small_wall: dict[str, list[float]] = {name: [] for name in small}
        small_cpu: dict[str, list[float]] = {name: [] for name in small}
        small_version = 0
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
            wall, cpu, small_version = await small_round(small, small_state, small_version)
            for name in small:
                small_wall[name].append(statistics.median(wall[name]))
                small_cpu[name].append(statistics.median(cpu[name]))
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
        emit_small(small_wall, small_cpu)
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
