"""Remote actors against raw pyzmq between two processes, measured in the same run.

Prints JSON lines ``{"name", "value", "unit", "baseline", "ratio"}`` (medians over repeats):

- ``remote_ask_rtt_p50`` / ``_p99`` (µs): an ask of a small request to an actor on a node process
  over tcp loopback; baseline: a raw pyzmq REQ/REP round trip between two processes, measured
  *interleaved* with it (alternating rounds of 100 in one loop), so that both see the same
  machine and the ratio is stable on a noisy one.
- ``trio_zmq_rtt_p50`` (µs): the same round trip through bare ``TrioSocket``s (DEALER/ROUTER,
  no actors, no codec) against the raw REQ/REP baseline: the floor that trio's wake-ups on the
  zmq FD put under any trio-based remote ask.
- ``remote_tensor_bandwidth`` (GB/s): 16 MiB as 4 float32 tensors told to an actor on a node
  process over tcp loopback (the last message is an ask, so the clock stops when all arrived);
  baseline: raw pyzmq PUSH/PULL with ``copy=False`` of the same 4 buffers.
- ``node_to_node_tensor_bandwidth`` (GB/s): the same 16 MiB messages from an actor on node A to
  an actor on node B (the driver only gives the order: the bytes go A → B over a link the mesh
  opens); baseline: the same raw PUSH/PULL.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import trio
import zmq

import asyncflow_actors as afa

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit, free_port, raw_push_throughput
from remote_targets import Blob, Ping, Push, Pusher, Sink

REPEATS = 5
N_ASKS = 2000
ROUND = 100
N_BLOBS = 30
MiB = 1 << 20

TRIO_SERVER = r"""
import sys, trio, zmq
from asyncflow_actors.actors.remote import open_zmq_socket
async def main():
    async with open_zmq_socket(zmq.Context.instance(), zmq.ROUTER, bind=sys.argv[1]) as s:
        while True:
            await s.send_multipart(await s.recv_multipart())
trio.run(main)
"""

RAW_SERVER = r"""
import sys, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.REP); s.bind(sys.argv[2])
while True:
    msg = s.recv(); s.send(msg)
"""


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def raw_rtts() -> list[float]:
    addr = f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-c", RAW_SERVER, "rep", addr])
    try:
        ctx = zmq.Context()
        s = ctx.socket(zmq.REQ)
        s.connect(addr)
        s.send(b"warm")
        s.recv()
        out = []
        payload = b"x" * 64
        for _ in range(N_ASKS):
            t0 = time.perf_counter_ns()
            s.send(payload)
            s.recv()
            out.append((time.perf_counter_ns() - t0) / 1000)
        s.close(linger=0)
        ctx.term()
        return out
    finally:
        proc.kill()
        proc.wait()


async def trio_zmq_rtts() -> list[float]:
    from asyncflow_actors.actors.remote import open_zmq_socket

    addr = f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-c", TRIO_SERVER, addr])
    try:
        async with open_zmq_socket(zmq.Context.instance(), zmq.DEALER, connect=addr) as s:
            payload = [b"x" * 64]
            await s.send_multipart(payload)
            with trio.fail_after(30):
                await s.recv_multipart()
            out = []
            for _ in range(N_ASKS):
                t0 = time.perf_counter_ns()
                await s.send_multipart(payload)
                await s.recv_multipart()
                out.append((time.perf_counter_ns() - t0) / 1000)
            return out
    finally:
        proc.kill()
        proc.wait()


def raw_bandwidth() -> float:
    buffers = [torch.randn(MiB).numpy() for _ in range(4)]  # 4 x 4 MiB = 16 MiB
    return raw_push_throughput(buffers, N_BLOBS) / 1e9


async def remote_figures() -> tuple[list[float], list[float], float, float]:
    """Interleaved ask/REQ-REP round trips, driver→node and node→node bandwidth."""
    addr = f"tcp://127.0.0.1:{free_port()}"
    rep = subprocess.Popen([sys.executable, "-c", RAW_SERVER, "rep", addr])
    ctx = zmq.Context()
    req = ctx.socket(zmq.REQ)
    req.connect(addr)
    try:
        async with afa.open_actor_system() as system:
            here = os.path.dirname(os.path.abspath(__file__))
            env = {**os.environ, "PYTHONPATH": here}
            node = await system.start_node(
                "bench", allow=["remote_targets"], transport="tcp", env=env
            )
            other = await system.start_node(
                "other", allow=["remote_targets"], transport="tcp", env=env
            )
            ref = await node.spawn(Sink, name="sink")
            pusher = await other.spawn(Pusher, name="pusher")
            ping = Ping(b"x" * 64)
            req.send(b"warm")
            req.recv()
            for _ in range(50):
                await ref.ask(ping)
            rtts: list[float] = []
            raw: list[float] = []
            payload = b"x" * 64
            for _ in range(N_ASKS // ROUND):  # alternating rounds: both see the same machine
                for _ in range(ROUND):
                    t0 = time.perf_counter_ns()
                    req.send(payload)
                    req.recv()
                    raw.append((time.perf_counter_ns() - t0) / 1000)
                for _ in range(ROUND):
                    t0 = time.perf_counter_ns()
                    await ref.ask(ping)
                    rtts.append((time.perf_counter_ns() - t0) / 1000)
            seconds = await pusher.ask(Push(ref, N_BLOBS, 16))
            node_to_node = N_BLOBS * 16 * MiB / seconds / 1e9
            driver_to_node = await _driver_bandwidth(ref)
            await node.stop()
            await other.stop()
            return rtts, raw, driver_to_node, node_to_node
    finally:
        req.close(linger=0)
        ctx.term()
        rep.kill()
        rep.wait()


async def _driver_bandwidth(ref: Any) -> float:
    blob = Blob(tuple(torch.randn(MiB) for _ in range(4)))
    ping = Ping(b"x" * 64)
    await ref.send(blob)
    await ref.ask(ping)
    t0 = time.perf_counter()
    for _ in range(N_BLOBS):
        await ref.send(blob)
    received: Any = await ref.ask(ping)
    elapsed = time.perf_counter() - t0
    assert received is not None
    return N_BLOBS * 16 * MiB / elapsed / 1e9


def main() -> None:
    p50, p99, raw50, raw99, bw, n2n, raw_bw, floor50, floor_raw = ([] for _ in range(9))
    for _ in range(REPEATS):
        floor_raw.append(pct(raw_rtts(), 0.5))
        floor50.append(pct(trio.run(trio_zmq_rtts), 0.5))
        raw_bw.append(raw_bandwidth())
        rtts, raw, gbps, node_gbps = trio.run(remote_figures)
        p50.append(pct(rtts, 0.5))
        p99.append(pct(rtts, 0.99))
        raw50.append(pct(raw, 0.5))
        raw99.append(pct(raw, 0.99))
        bw.append(gbps)
        n2n.append(node_gbps)
    med = statistics.median
    emit("remote_ask_rtt_p50", med(p50), "us", med(raw50))
    emit("remote_ask_rtt_p99", med(p99), "us", med(raw99))
    emit("trio_zmq_rtt_p50", med(floor50), "us", med(floor_raw))
    emit("remote_tensor_bandwidth", med(bw), "GB/s", med(raw_bw))
    emit("node_to_node_tensor_bandwidth", med(n2n), "GB/s", med(raw_bw))


if __name__ == "__main__":
    main()
