"""Helpers shared by the benchmarks: the JSON line format and raw pyzmq baselines."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import zmq

RAW_SINK = r"""
import sys, zmq
ctx = zmq.Context(); s = ctx.socket(zmq.PULL); s.bind(sys.argv[1])
ack = ctx.socket(zmq.PUSH); ack.bind(sys.argv[2])
while True:
    parts = s.recv_multipart(copy=False)
    if parts[0].bytes == b"end":
        ack.send(b"ok")
"""


def emit(name: str, value: float, unit: str, baseline: float | None = None) -> None:
    """Print one figure as a JSON line: ``name``, ``value``, ``unit`` [, ``baseline``, ``ratio``]."""
    row: dict[str, Any] = {"name": name, "value": round(value, 3), "unit": unit}
    if baseline is not None:
        row["baseline"] = round(baseline, 3)
        row["ratio"] = round(value / baseline, 3)
    print(json.dumps(row), flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def raw_push_throughput(frames: Sequence[Any], messages: int) -> float:
    """Bytes/s of ``messages`` multipart messages pushed with ``copy=False`` to another process
    over tcp loopback (raw pyzmq: the baseline of the remote and TransferQueue benchmarks)."""
    addr, ack_addr = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-c", RAW_SINK, addr, ack_addr])
    try:
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.connect(addr)
        ack = ctx.socket(zmq.PULL)
        ack.connect(ack_addr)
        push.send(b"end")
        ack.recv()  # connected and warm
        t0 = time.perf_counter()
        for _ in range(messages):
            push.send_multipart(frames, copy=False)
        push.send(b"end")
        ack.recv()
        elapsed = time.perf_counter() - t0
        push.close(linger=0)
        ack.close(linger=0)
        ctx.term()
        return messages * sum(memoryview(f).nbytes for f in frames) / elapsed
    finally:
        proc.kill()
        proc.wait()
