"""Run a node: ``python -m asyncflow_actors.node --bind tcp://127.0.0.1:5555 --allow mypkg.actors``.

A node hosts actors for the other systems of a run (``system.connect_node(address, name=...)``).
Start one per host or per accelerator under SLURM, torchrun or Kubernetes; see
``docs/remote.md``. Once bound it prints one JSON line, ``{"endpoints": [...], "pid": ...}``, on
stdout. Binding beyond loopback requires ``--curve-keys`` with ``--authorized-keys`` (or
``--supervisor-keys``), or an explicit ``--insecure``. A node exits on SIGTERM/SIGINT after
stopping its actors.

CURVE: ``--curve-keys`` is the node's keypair (or, for a node its launcher started, the
``AFA_NODE_CURVE_KEYS`` environment variable). With ``--authorized-keys`` only, the node is in
the cluster key model (every authorized key may say where other nodes listen); with
``--supervisor-keys`` it is in the node model: names are bound to keys, and only its owner and
those supervisors say where other nodes listen and which key each name is bound to.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
from collections.abc import Sequence

import trio

from .actors.remote._curve import CurveKeypair, CurveServer
from .actors.remote._endpoints import is_loopback
from .actors.remote._exit import exit_now
from .actors.remote._launch import CURVE_KEYS_ENV, OWNER_TOKEN_ENV, NodeOptions
from .actors.remote._server import DEFAULT_MAX_MESSAGE_BYTES
from .actors.remote._system import serve_node


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
        help="stop a session's actors once all its connections have been gone this long (s)",
    )
    defaults = NodeOptions()
    p.add_argument("--heartbeat-interval", type=float, default=defaults.heartbeat_interval)
    p.add_argument("--heartbeat-timeout", type=float, default=defaults.heartbeat_timeout)
    p.add_argument("--curve-keys", help="file with 'public secret' Z85 keys: require CURVE")
    p.add_argument("--authorized-keys", help="file with client public keys (Z85), one a line")
    p.add_argument(
        "--supervisor-keys",
        help="file with the public keys (Z85) of the systems that supervise this node: "
        "names are then bound to keys (the node key model)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow binding beyond loopback without CURVE (a trusted network only)",
    )
    p.add_argument("--exit-on-stdin-eof", action="store_true", help="exit when stdin closes")
    p.add_argument("--log-level", default="WARNING")
    return p


def _read_keys(path: str) -> list[bytes]:
    with open(path, encoding="ascii") as f:
        return [line.strip().encode() for line in f if line.strip() and not line.startswith("#")]


async def _stdin_closed() -> None:
    """Return once stdin closes: the process that launched this node, holding its other end,
    exited."""
    stream = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    async with stream:
        while await stream.receive_some(4096):
            pass


async def _watch_signals(scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            scope.cancel()  # leaving serve_node stops the actors and closes the sockets
            return


async def _main(args: argparse.Namespace) -> None:
    curve = None
    handed = os.environ.pop(CURVE_KEYS_ENV, "")  # from our launcher: not left to our children
    if args.curve_keys or handed:
        line = _read_keys(args.curve_keys)[0] if args.curve_keys else handed.encode()
        public, secret = line.split()
        curve = CurveServer(CurveKeypair(public, secret))
    authorized = _read_keys(args.authorized_keys) if args.authorized_keys else None
    supervisors = _read_keys(args.supervisor_keys) if args.supervisor_keys else []
    options = NodeOptions(
        heartbeat_interval=args.heartbeat_interval,
        heartbeat_timeout=args.heartbeat_timeout,
        max_message_bytes=args.max_message_bytes,
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_watch_signals, nursery.cancel_scope)

        async def serve(task_status: trio.TaskStatus[list[str]]) -> None:
            await serve_node(
                args.bind,
                allow=args.allow,
                name=args.name,
                curve=curve,
                authorized_keys=authorized,
                key_model="node" if args.supervisor_keys else "cluster",
                supervisor_keys=supervisors,
                insecure=args.insecure,
                max_message_bytes=args.max_message_bytes,
                peer_timeout=args.peer_timeout,
                owner_token=os.environ.pop(OWNER_TOKEN_ENV, ""),
                options=options,
                watch_owner=_stdin_closed if args.exit_on_stdin_eof else None,
                task_status=task_status,
            )
            nursery.cancel_scope.cancel()

        endpoints = await nursery.start(serve)
        name = args.name or f"{os.uname().nodename}:{os.getpid()}"
        print(json.dumps({"endpoints": endpoints, "pid": os.getpid(), "name": name}), flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    curve = bool(args.curve_keys or os.environ.get(CURVE_KEYS_ENV))
    if curve and not (args.authorized_keys or args.supervisor_keys):
        parser.error(
            "--curve-keys without --authorized-keys would let in any client that knows the "
            "server key: list the clients' public keys with --authorized-keys (or the "
            "supervisors' with --supervisor-keys)"
        )
    if args.supervisor_keys and not curve:
        parser.error("--supervisor-keys needs CURVE: give the node's keys with --curve-keys")
    exposed = [b for b in args.bind if not is_loopback(b)]
    if exposed and not curve and not args.insecure:
        parser.error(
            f"binding {exposed} without CURVE exposes the node's actors to the network: "
            "give --curve-keys and --authorized-keys, or --insecure on a trusted network"
        )
    logging.basicConfig(level=args.log_level, stream=sys.stderr)
    trio.run(_main, args)
    exit_now(0)


if __name__ == "__main__":
    main()
