"""Remote actors against raw pyzmq between two processes, measured in the same run.

Prints JSON lines ``{"name", "value", "unit", "baseline", "ratio"}`` (medians over repeats):

- ``remote_ask_rtt_p50`` / ``_p99`` (µs): an ask of a small request to an actor on a node process
  over tcp loopback; baseline: a raw pyzmq REQ/REP round trip between two processes.
- ``trio_zmq_rtt_p50`` (µs): the same round trip through bare ``TrioSocket``s (DEALER/ROUTER,
  no actors, no codec) against the raw REQ/REP baseline: the floor that trio's wake-ups on the
  zmq FD put under any trio-based remote ask.
- ``remote_tensor_bandwidth`` (GB/s): 16 MiB as 4 float32 tensors told to an actor on a node
  process over tcp loopback (the last message is an ask, so the clock stops when all arrived);
  baseline: raw pyzmq PUSH/PULL with ``copy=False`` of the same 4 buffers.
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
from remote_targets import Blob, Ping, Sink

REPEATS = 5
N_ASKS = 2000
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


async def remote_figures() -> tuple[list[float], float]:
    async with afa.open_actor_system() as system:
        here = os.path.dirname(os.path.abspath(__file__))
        env = {**os.environ, "PYTHONPATH": here}
        node = await system.start_node("bench", allow=["remote_targets"], transport="tcp", env=env)
        ref = await node.spawn(Sink, name="sink")
        ping = Ping(b"x" * 64)
        for _ in range(50):
            await ref.ask(ping)
        rtts = []
        for _ in range(N_ASKS):
            t0 = time.perf_counter_ns()
            await ref.ask(ping)
            rtts.append((time.perf_counter_ns() - t0) / 1000)
        blob = Blob(tuple(torch.randn(MiB) for _ in range(4)))
        await ref.send(blob)
        await ref.ask(ping)
        t0 = time.perf_counter()
        for _ in range(N_BLOBS):
            await ref.send(blob)
        received: Any = await ref.ask(ping)
        elapsed = time.perf_counter() - t0
        assert received is not None
        await node.stop()
        return rtts, N_BLOBS * 16 * MiB / elapsed / 1e9


def main() -> None:
    p50, p99, raw50, raw99, bw, raw_bw, floor50 = [], [], [], [], [], [], []
    for _ in range(REPEATS):
        raw = raw_rtts()
        floor50.append(pct(trio.run(trio_zmq_rtts), 0.5))
        raw50.append(pct(raw, 0.5))
        raw99.append(pct(raw, 0.99))
        raw_bw.append(raw_bandwidth())
        rtts, gbps = trio.run(remote_figures)
        p50.append(pct(rtts, 0.5))
        p99.append(pct(rtts, 0.99))
        bw.append(gbps)
    med = statistics.median
    emit("remote_ask_rtt_p50", med(p50), "us", med(raw50))
    emit("remote_ask_rtt_p99", med(p99), "us", med(raw99))
    emit("trio_zmq_rtt_p50", med(floor50), "us", med(raw50))
    emit("remote_tensor_bandwidth", med(bw), "GB/s", med(raw_bw))


if __name__ == "__main__":
    main()
