"""Launchers: how a ``NodeActor`` gets a node to talk to (a child process, a task, an address).

A launcher starts (or finds) one node and says where to connect, whether this system owns it
(may shut it down: it holds the node's owner token), and how to clean up. The Ray launcher lives
in ``_ray``; a launcher of one's own implements ``Launcher``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Literal, Protocol

import attrs
import trio

from .._actor import ActorContext
from . import _protocol as P
from ._curve import CurveClient, curve_keypair
from ._mesh import Mesh
from ._server import DEFAULT_MAX_MESSAGE_BYTES

OWNER_TOKEN_ENV = "AFA_NODE_OWNER_TOKEN"
"""The environment variable a launcher hands a child node its owner token in (not argv: ps)."""
CURVE_KEYS_ENV = "AFA_NODE_CURVE_KEYS"
"""The environment variable a launcher hands a child node its CURVE keypair in, as
``"PUBLIC SECRET"`` (Z85; not argv: ps)."""


def _str_tuple(values: Iterable[str]) -> tuple[str, ...]:
    if isinstance(values, str):
        return (values,)
    return tuple(values)


@attrs.frozen
class NodeOptions:
    """Timing and limits of links between systems (seconds).

    ``heartbeat_interval``/``heartbeat_timeout`` drive ZMTP heartbeats: libzmq's I/O threads
    ping and answer them, so a peer whose *process* stops answering (its host vanished, it was
    SIGSTOPped) is dropped after the timeout, while a peer whose Python loop is merely busy
    never is. ``shutdown_grace``: how long a polite node shutdown may take before SIGTERM.
    """

    connect_timeout: float = 20.0
    heartbeat_interval: float = 0.5
    heartbeat_timeout: float = 5.0
    shutdown_grace: float = 5.0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES


@attrs.define
class Launched:
    """What a launcher started: where to connect, and how to clean up.

    ``wait_exit`` (for a node that is not our child process, e.g. a Ray actor) returns when the
    node is gone: while it runs, its return is a node loss; after a polite shutdown it is awaited
    (within ``shutdown_grace``) so that the node finishes stopping its actors before ``cleanup``.
    ``cleanup`` runs last, shielded; it may return an awaitable (which must bound itself).
    """

    address: str
    curve: CurveClient | None = None
    process: trio.Process | None = None
    owns_node: bool = True  # stopping the NodeActor shuts the node down
    in_process: bool = False  # the node runs in a helper task: it stops (gracefully) with it
    cleanup: Callable[[], Awaitable[None] | None] | None = None  # may return an awaitable
    owner_token: str = ""  # proves to the node that we own it
    pid: int | None = None  # the node's process, when it is not our child (Ray)
    wait_exit: Callable[[], Any] | None = None  # an async callable returning when the node died


class Launcher(Protocol):
    async def launch(self, ctx: ActorContext[Any], name: str, options: NodeOptions) -> Launched: ...


@attrs.frozen
class SubprocessLauncher:
    """Start ``python -m asyncflow_actors.node`` as a child process of this one.

    ``transport``: ``"ipc"`` (a socket file in a private temporary directory) or ``"tcp"`` (a free
    port on ``host``, loopback by default). The child exits when this process dies (it watches
    its stdin). Its stdout is forwarded to ours.
    """

    allow: tuple[str, ...] = attrs.field(converter=_str_tuple)
    transport: Literal["ipc", "tcp"] = "ipc"
    host: str = "127.0.0.1"
    python: str = sys.executable
    env: Mapping[str, str] | None = None

    async def launch(self, ctx: ActorContext[Any], name: str, options: NodeOptions) -> Launched:
        """Start the node; under CURVE (this system listens with it) the node listens with
        CURVE too: with a keypair of its own, handed over in its environment, in the node key
        model; with the cluster keypair in the cluster model (``docs/remote.md``)."""
        tmpdir = tempfile.mkdtemp(prefix="afa-node-")
        bind = f"ipc://{tmpdir}/node.sock" if self.transport == "ipc" else f"tcp://{self.host}:*"
        cmd = [self.python, "-m", "asyncflow_actors.node", "--bind", bind, "--name", name]
        cmd += ["--exit-on-stdin-eof", "--max-message-bytes", str(options.max_message_bytes)]
        cmd += ["--heartbeat-interval", str(options.heartbeat_interval)]
        cmd += ["--heartbeat-timeout", str(options.heartbeat_timeout)]
        for prefix in self.allow:
            cmd += ["--allow", prefix]
        token = secrets.token_hex(16)
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        env[OWNER_TOKEN_ENV] = token
        curve = _child_curve(ctx, tmpdir, cmd, env)
        exposed = self.transport == "tcp" and self.host not in ("127.0.0.1", "localhost", "::1")
        if exposed and curve is None:
            cmd += ["--insecure"]  # the caller chose to expose it; a warning is printed
        # A session of its own: a terminal's Ctrl-C (sent to the whole foreground group) is
        # for the driver, which stops its nodes; they exit anyway when it dies (stdin EOF).
        process = await trio.lowlevel.open_process(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True
        )
        try:
            assert process.stdout is not None
            with trio.fail_after(options.connect_timeout):
                line, rest = await _read_line(process.stdout)
            ready = json.loads(line)
            address = ready["endpoints"][0]
        except BaseException:
            process.kill()
            with trio.CancelScope(shield=True):
                await process.wait()
            shutil.rmtree(tmpdir, ignore_errors=True)
            raise
        ctx.start_soon(_pump, process.stdout, rest)
        return Launched(
            address,
            curve=curve,
            process=process,
            cleanup=lambda: shutil.rmtree(tmpdir, True),
            owner_token=token,
        )


@attrs.frozen
class ConnectLauncher:
    """Connect to a node started by hand (``python -m asyncflow_actors.node --bind ...``).

    Stopping the ``NodeActor`` stops the actors it spawned there, not the node. If the link
    drops, the restarted ``NodeActor`` reconnects and adopts the actors it had spawned there.
    """

    address: str
    curve: CurveClient | None = None

    async def launch(self, ctx: ActorContext[Any], name: str, options: NodeOptions) -> Launched:
        await trio.lowlevel.checkpoint()
        return Launched(self.address, curve=self.curve, owns_node=False)


def _child_curve(
    ctx: ActorContext[Any], tmpdir: str, cmd: list[str], env: dict[str, str]
) -> CurveClient | None:
    """Set up CURVE for a child node of a system that listens with it (``None``: it does not).

    The node model gives the child a new keypair and makes this system's key its supervisor's;
    the cluster model gives it the cluster keypair, authorizing the cluster key. The secret
    goes in the environment; the public key it admits, in a file of the private ``tmpdir``.
    """
    mesh = getattr(ctx.system, "mesh", None)
    keys = mesh.keys if isinstance(mesh, Mesh) else None
    if keys is None:
        return None
    own = curve_keypair() if keys.model == "node" else keys.keypair
    env[CURVE_KEYS_ENV] = f"{own.public.decode()} {own.secret.decode()}"
    path = os.path.join(tmpdir, "supervisor.keys")
    with open(path, "w", encoding="ascii") as f:
        f.write(keys.keypair.public.decode() + "\n")
    cmd += ["--supervisor-keys" if keys.model == "node" else "--authorized-keys", path]
    return CurveClient(own.public, keys.keypair)


async def _read_line(stream: trio.abc.ReceiveStream) -> tuple[bytes, bytes]:
    buffer = b""
    while b"\n" not in buffer:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise P.NodeLost(f"node exited before it was ready (output: {buffer[-2000:]!r})")
        buffer += chunk
    line, _, rest = buffer.partition(b"\n")
    return line, rest


async def _pump(stream: trio.abc.ReceiveStream, first: bytes | bytearray) -> None:
    """Forward a node's stdout to ours (a full pipe would block the node)."""
    out = sys.stdout.buffer if hasattr(sys.stdout, "buffer") else None
    data = first
    while True:
        if data and out is not None:
            out.write(data)
            out.flush()
        data = await stream.receive_some(65536)
        if not data:
            return
