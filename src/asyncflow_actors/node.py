"""Run a node: ``python -m asyncflow_actors.node --bind tcp://0.0.0.0:5555 --allow mypkg.actors``.

A node hosts actors for remote systems (``system.connect_node(address, name=...)``). Start one per
host or per accelerator under SLURM, torchrun or Kubernetes; see ``docs/remote.md``. Once bound it
prints one JSON line, ``{"endpoints": [...], "pid": ...}``, on stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections.abc import Sequence

import trio

from .actors.remote._server import DEFAULT_MAX_MESSAGE_BYTES, serve_node
from .actors.remote._zmq import CurveKeypair, CurveServer


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m asyncflow_actors.node", description=__doc__)
    p.add_argument("--bind", action="append", required=True, help="endpoint, repeatable")
    p.add_argument(
        "--allow", action="append", default=[], help="module prefix actors may come from"
    )
    p.add_argument("--name", default=None, help="node name (default: host:pid)")
    p.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES)
    p.add_argument(
        "--peer-timeout",
        type=float,
        default=math.inf,
        help="stop a peer's actors after this many seconds without hearing from it",
    )
    p.add_argument("--curve-keys", help="file with 'public secret' Z85 keys: require CURVE")
    p.add_argument("--authorized-keys", help="file with client public keys (Z85), one a line")
    p.add_argument("--exit-on-stdin-eof", action="store_true", help="exit when stdin closes")
    p.add_argument("--log-level", default="WARNING")
    return p


def _read_keys(path: str) -> list[bytes]:
    with open(path, encoding="ascii") as f:
        return [line.strip().encode() for line in f if line.strip() and not line.startswith("#")]


async def _watch_stdin(scope: trio.CancelScope) -> None:
    stream = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    async with stream:
        while await stream.receive_some(4096):
            pass
    scope.cancel()


async def _main(args: argparse.Namespace) -> None:
    curve = None
    if args.curve_keys:
        public, secret = _read_keys(args.curve_keys)[0].split()
        curve = CurveServer(CurveKeypair(public, secret))
    authorized = _read_keys(args.authorized_keys) if args.authorized_keys else None
    name = args.name or f"{os.uname().nodename}:{os.getpid()}"
    async with trio.open_nursery() as nursery:
        if args.exit_on_stdin_eof:
            nursery.start_soon(_watch_stdin, nursery.cancel_scope)

        async def serve(task_status: trio.TaskStatus[list[str]]) -> None:
            await serve_node(
                args.bind,
                allow=args.allow,
                name=name,
                curve=curve,
                authorized_keys=authorized,
                max_message_bytes=args.max_message_bytes,
                peer_timeout=args.peer_timeout,
                task_status=task_status,
            )
            nursery.cancel_scope.cancel()

        endpoints = await nursery.start(serve)
        print(json.dumps({"endpoints": endpoints, "pid": os.getpid(), "name": name}), flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr)
    trio.run(_main, args)


if __name__ == "__main__":
    main()
